"""Units and names every module shares, defined once."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers: store regions start on this boundary
# SIMD alignment of a view inside a buffer: a piece's state in a chunk, a parameter in a block, an item packed
# for a broadcast, a decoded tensor in the decode arena
SLOT_ALIGN = 64
STORE_DIR_ENV = "LIGHTNING_NVME_STORE_DIR"  # the store directory when no store_dir is given
INT8_BLOCK = 256  # elements per block of state_format="int8" (one fp32 absmax each: 1/64 byte per element)


def align_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align`` (by default the O_DIRECT alignment)."""
    return -(-n // align) * align
