"""GPU check: one prepared run (global deadline ``--deadline-min``, default 7) of the accelerator paths, bitwise
against plain Lightning.

Every case trains the same small GPT (every block under non-reentrant checkpoint, AdamW ``foreach=False``)
for ``--steps`` steps over two epochs and compares all parameters and the per-step loss bitwise with
``strategy="auto"`` trained the same way (bf16 and int8 against the in-memory ``RoundTripOptimizer`` of their
format). A case is started only if the time left exceeds the longest case so far; otherwise it is reported
skipped (``skipped_cases``), never killed mid-run. ``ok`` needs every baseline run twice and found
deterministic first (cuBLAS workspace pinned, SDPA on its math kernel, ``deterministic=True``): otherwise
equality would prove nothing.

Cases (``--only NAME,...`` runs a subset):

- ``activation_offload``: ``NVMeActivationOffload`` against the plain run.
- ``params_backward``: ``offload_params=True`` with ``overlap="backward"``.
- ``params_step``: ``overlap="step"``: on CUDA refused at setup naming ``overlap="backward"`` (every gradient
  would stay on the device until the step); on CPU (a test) trained and compared.
- ``params_bf16``: ``precision="bf16-true"``, against a bf16-true baseline whose AdamW keeps fp32 masters in
  memory (``RoundTripOptimizer`` with the exact format), as the offloaded run does.
- ``params_resume``: a checkpoint saved mid-fit (``ModelCheckpoint`` at the end of epoch 1, the blocks
  gathered from the store), resumed by a new Trainer to the last step; against plain Lightning saved and
  resumed the same way (a resumed run is not bitwise the uninterrupted one even in memory). The saved
  optimizer state is compared too: the offloaded checkpoint converted to a plain one
  (``checkpoint.convert.to_lightning``) against plain Lightning's file, every moment tensor and step bitwise
  (``optimizer_state_equal``).
- ``params_keep``: ``restore_params=False``: the weights stay in the store, exported with
  ``export_weights`` (streamed block by block) and compared from the file.
- ``params_delayed``: ``params_backward`` with a delay before every host <-> device copy (the ``CudaOps.copy``
  seam): a missing wait on an event then reads or overwrites a buffer too early and shows as a difference.
- ``sanitizer``: ``params_backward`` again in a subprocess under ``TORCH_CUDA_SANITIZER=1`` (PyTorch's
  stream sanitizer raises on an unsynchronized access between streams), 2 steps, no baselines (the child runs
  the offload only), its time taken from the deadline; checkpoint early stop off (with it on, the sanitizer
  fails inside torch even without offload: docs/params.md, "Accelerators"). It tracks CUDA tensors by pointer and ignores
  ``record_stream``: it cannot see allocator reuse (issue #33 defect 1), pinned-buffer reuse or disk I/O.
- ``params_prefetch2``: ``params_backward`` at ``param_prefetch=2``; on a GPU both require ``early_uploads > 0``.
- ``params_int8``: bf16-true with ``state_format="int8"``, ``master_format="bf16_sr"``.
- ``params_stress``: the block buffer pool shrunk to 2 buffers, activation offload on, and a GPU spin of 20-50 ms
  (``--stress-ms``, drawn per copy, calibrated against CUDA events) on the copy's stream before every block
  copy (the ``CudaTransfer.ops`` seam: blocks up, dirty blocks and shelved blocks back to the host) and every
  activation copy (``activations.device.CudaCopies.copy``: to the pinned host buffer and back) and every copy of
  the optimizer state to the device and back (the ops ``optim.buffers.copy_ops_for`` hands the optimizer, where
  that seam exists): a missing wait or a buffer reused too early shows as a bitwise difference. On a GPU every
  seam must have been delayed (``delayed_copies``).
- ``params_exception``: an exception injected in a block's forward at step 2: it propagates, no host
  registration is left (0) and ``memory_allocated`` is back to its level before (plus cuBLAS workspaces).
- ``params_memory``: device memory on a model large enough to mean something (``--memory-d-model 2048``,
  ``--memory-layers 8``: 50 M parameters per block): ``max_memory_allocated`` and ``max_memory_reserved`` of a
  plain in-memory run and of the offloaded one, ``memory_allocated`` after teardown and ``gc``; asserted:
  offloaded peak <= in-memory peak - block parameters - optimizer state + (``param_prefetch`` + 2) blocks,
  and memory back to its level before the run (plus cuBLAS workspaces).
- ``params_time``: not deterministic (default kernels), ``--time-steps`` (>= 20) steps plain and offloaded; the
  raw disk bandwidth of ``--store-dir`` measured in the same run (``_disk.raw_disk``: write through fdatasync,
  cold read); asserted: median offloaded step / max(median plain step, the step's store bytes read and
  written at that bandwidth) <= ``--time-threshold``; prints the store's I/O mode (``direct`` / buffered).
- ``params_compile``: ``torch.compile`` with ``offload_params`` is refused by name.
- ``ddp_smoke``: ``nvme_offload_ddp`` on NCCL with ``devices=1``, bitwise against Lightning's DDP (one process).
- ``fsdp_smoke``: ``nvme_offload_fsdp`` (its public constructor, through the Trainer) on NCCL with ``devices=1``:
  the blocks gathered on the device per use from the one rank's shard in its store, reduced and updated during
  backward; bitwise (weights and every loss) against Lightning's DDP (one process), the baseline ``ddp_smoke``
  shares. One device only: a 2-rank run needs a launcher per rank (``tests/strategies/test_fsdp.py``'s, on CPU).
- ``params_desk`` / ``params_desk_half``: ``params_backward`` with ``device_memory_budget`` holding every block
  (half the free device memory) / half the blocks' bytes: the kept blocks are copied up once at setup and
  never read, copied or written back during training. Reports the plan (``desk_plan``), the blocks
  kept, the block reads and write-backs during training (0 with every block kept; the streamed ones with half),
  the step time beside the plain run's and ``peak_device_MiB``.

Per case: ``bitwise_equal``, ``max_abs_diff``, ``peak_device_MiB`` (``torch.cuda.max_memory_allocated`` of the
offloaded run) beside ``baseline_peak_device_MiB``, ``peak_device_blocks``, block copy speeds, step times.
At the end: ``live_host_registrations`` (host ranges still registered with CUDA, must be 0). The last line
printed is one JSON object. Exit status: 1 if a case fails on a CUDA machine; without a CUDA device the line
says ``"skipped": "no CUDA device"`` and the status is 0.

    python benchmarks/gpu_check.py [--store-dir DIR] [--steps 6] [--only params_backward,...]

What a pass cannot prove: see docs/params.md "Accelerators" (one device, one model family, the timings of
one machine; the sanitizer ignores ``record_stream``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils.checkpoint import set_checkpoint_early_stop  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _disk import raw_disk  # noqa: E402
from activation_offload import GPT, Tokens  # noqa: E402

from lightning_nvme import NVMeOffloadStrategy  # noqa: E402
from lightning_nvme.activations import device as activation_device  # noqa: E402
from lightning_nvme.callbacks import NVMeActivationOffload  # noqa: E402
from lightning_nvme.constants import MiB  # noqa: E402
from lightning_nvme.optim import buffers as optim_buffers  # noqa: E402
from lightning_nvme.params import transfer  # noqa: E402
from lightning_nvme.store import pinned  # noqa: E402

CASES = ("activation_offload", "params_backward", "params_step", "params_bf16", "params_resume", "params_keep",
         "params_delayed", "sanitizer", "params_desk", "params_desk_half", "params_prefetch2", "params_int8",
         "params_stress", "params_exception", "params_compile", "ddp_smoke", "fsdp_smoke", "params_memory",
         "params_time")
DATA_PARALLEL = ("ddp_smoke", "fsdp_smoke")  # cases against Lightning's own DDP (one process)
# cases whose offloaded run must equal an in-memory reference with its own precision and optimizer format
REFERENCE = {"params_bf16": ("bf16-true", ("exact", "fp32")), "params_int8": ("bf16-true", ("int8", "bf16_sr"))}
# cases that train without a baseline (a refusal, an injected failure, a child process)
# params_time's fewest steps (a test on CPU lowers it: its timings judge nothing there)
TIME_MIN_STEPS = 20
NO_BASELINE = ("sanitizer", "params_compile", "params_exception", "params_memory", "params_time")


class AdamGPT(GPT):
    """The activation benchmark's GPT with AdamW: parameter offload needs per-parameter optimizer state.

    ``reference_format`` (a baseline's): the optimizer wrapped in the in-memory ``RoundTripOptimizer`` of
    that (state, master) format, what an offloaded run with the format must equal. Why for bf16-true even
    with exact state: the offloaded run keeps fp32 masters of bf16 parameters (``optim/plan.py``), plain
    AdamW on bf16 parameters does not; ``RoundTripOptimizer(opt, StateFormat())`` keeps them in memory
    (``tests/params/test_param_offload.py``'s fp32-master reference)."""

    reference_format: tuple[str, str] | None = None

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
        if self.reference_format is not None:
            from lightning_nvme.optim.formats.state_format import RoundTripOptimizer, StateFormat

            RoundTripOptimizer(opt, StateFormat(*self.reference_format))
        return opt


class StepTimer(pl.Callback):
    """Wall time of each training step, the device synchronized; the store's I/O counters before teardown."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[torch.Tensor] = []
        self.t0 = 0.0
        self.store_stats: Any = None
        self.moved_start: tuple[int, int] = (0, 0)
        self.moved: dict[str, Any] = {}  # the store's bytes read and written while training ran, its I/O mode

    def on_train_start(self, trainer, pl_module) -> None:
        store = getattr(trainer.strategy, "nvme_store", None)
        if store is not None:
            store.fence()
            self.moved_start = (store.stats.bytes_read, store.stats.bytes_written)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        sync()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sync()
        self.times.append(time.perf_counter() - self.t0)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if torch.is_tensor(loss):
            self.losses.append(loss.detach().float().cpu().clone())

    def on_train_end(self, trainer, pl_module) -> None:
        store = getattr(trainer.strategy, "nvme_store", None)  # still open: teardown closes it after this
        if store is not None:
            store.fence()
            self.store_stats = store.stats
            self.moved = {"bytes_read": store.stats.bytes_read - self.moved_start[0],
                          "bytes_written": store.stats.bytes_written - self.moved_start[1], "io_mode": store.mode}

    @property
    def step_s(self) -> float | None:
        return round(statistics.median(self.times[1:] or self.times), 4) if self.times else None


def verdict(reference: dict[str, torch.Tensor], again: dict[str, torch.Tensor],
            other: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Bitwise comparison by name; ``ok`` only if the baseline repeated itself exactly."""
    deterministic = reference.keys() == again.keys() and all(torch.equal(reference[k], again[k]) for k in reference)
    equal = reference.keys() == other.keys() and all(torch.equal(reference[k], other[k]) for k in reference)
    diff = max((float((reference[k].float() - other[k].float()).abs().max()) for k in reference if k in other),
               default=float("inf"))
    return {"bitwise_equal": equal, "baseline_deterministic": deterministic, "max_abs_diff": diff,
            "ok": bool(equal and deterministic)}


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def losses_of(timer: StepTimer) -> dict[str, torch.Tensor]:
    """The per-step loss, compared bitwise beside the weights (``loss/<step>``)."""
    return {f"loss/{i}": loss for i, loss in enumerate(timer.losses)}


def weights_only(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in values.items() if not k.startswith("loss/")}


def on_device() -> bool:
    """A CUDA context is up (``main`` makes one first): false when a test runs a case's body on CPU."""
    return torch.cuda.is_initialized()


def sync() -> None:
    if on_device():
        torch.cuda.synchronize()


def peak_MiB() -> float | None:
    return round(torch.cuda.max_memory_allocated() / MiB, 1) if on_device() else None


def train(model: pl.LightningModule, args: argparse.Namespace, data: Tokens, root: str, callbacks=(),
          strategy: Any = "auto", precision: str = "32-true", ckpt_path: str | None = None,
          deterministic: bool = True, steps: int | None = None) -> pl.Trainer:
    """``deterministic=False`` (the timing case): the default kernels, as a user's run has them."""
    gc.collect()
    if on_device():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer = pl.Trainer(max_steps=steps or args.steps, accelerator=args.accelerator, devices=1, logger=False,
                         enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
                         enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                         default_root_dir=root, deterministic=deterministic, strategy=strategy, precision=precision)
    with contextlib.ExitStack() as stack:
        if deterministic:
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        if args.no_early_stop:  # the sanitizer's child: see run_unchecked
            stack.enter_context(set_checkpoint_early_stop(False))
        trainer.fit(model, DataLoader(data, batch_size=None), ckpt_path=ckpt_path)
    return trainer


class Baselines:
    """``strategy="auto"`` runs, each made twice (determinism) and kept for every case that needs it."""

    def __init__(self, args: argparse.Namespace, base: pl.LightningModule, data: Tokens, root: str) -> None:
        self.args, self.base, self.data, self.root = args, base, data, root
        self._runs: dict[str, tuple[dict, dict, float | None, float | None]] = {}

    def get(self, precision: str = "32-true", reference_format: tuple[str, str] | None = None,
            ddp: bool = False) -> tuple[dict, dict, float | None, float | None]:
        """Plain runs at ``precision``; with ``reference_format``, the optimizer is that format's in-memory
        reference (``AdamGPT.reference_format``); with ``ddp``, Lightning's own DDP (one process)."""
        key = f"{precision}/{reference_format}/{ddp}"
        if key not in self._runs:
            timer, timer2 = StepTimer(), StepTimer()
            a = self._run(precision, reference_format, [timer], ddp)
            peak = peak_MiB()
            a2 = self._run(precision, reference_format, [timer2], ddp)
            self._runs[key] = ({**params_of(a), **losses_of(timer)}, {**params_of(a2), **losses_of(timer2)}, peak,
                               timer.step_s)
        return self._runs[key]

    def _run(self, precision: str, reference_format: tuple[str, str] | None, callbacks: list,
             ddp: bool = False) -> pl.LightningModule:
        model = copy.deepcopy(self.base)
        model.reference_format = reference_format
        strategy: Any = "auto"
        if ddp:
            from lightning.pytorch.strategies import DDPStrategy

            strategy = DDPStrategy(process_group_backend=backend(self.args))
        try:
            train(model, self.args, self.data, self.root, callbacks, strategy=strategy, precision=precision)
        finally:
            end_process_group()
        return model


def gbps(nbytes: float, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else None


def offload(args: argparse.Namespace, store_dir: str, **kwargs: Any) -> NVMeOffloadStrategy:
    kwargs.setdefault("overlap", "backward")
    kwargs.setdefault("param_prefetch", args.param_prefetch)
    return NVMeOffloadStrategy(store_dir=store_dir, offload_params=True, chunk_bytes=args.chunk_mib * MiB, **kwargs)


class TrainingMoves(pl.Callback):
    """Block reads and write-backs of the parameter offload while training ran (not setup, not teardown)."""

    def __init__(self) -> None:
        self.start: tuple[int, int] = (0, 0)
        self.moved: dict[str, int] = {}

    def _now(self, trainer: pl.Trainer) -> tuple[int, int]:
        stats = trainer.strategy.param_offload.stats
        return stats.loads, stats.writebacks

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = self._now(trainer)
        self.moved["kept_blocks"] = trainer.strategy.param_offload.stats.kept_blocks

    def on_train_end(self, trainer, pl_module) -> None:
        loads, writebacks = self._now(trainer)
        self.moved.update(block_loads_in_training=loads - self.start[0],
                          writebacks_in_training=writebacks - self.start[1])


def block_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters in the model's blocks (what ``device_memory_budget`` would keep)."""
    from lightning_nvme.params import find_blocks

    return sum(p.numel() * p.element_size() for _, block in find_blocks(model) for p in block.parameters())


def transfer_figures(strategy: NVMeOffloadStrategy, timer: StepTimer, args: argparse.Namespace) -> dict[str, Any]:
    assert strategy.param_offload is not None
    stats = strategy.param_offload.stats
    st, store = stats.transfer, timer.store_stats
    out = {"peak_device_blocks": stats.peak_bound_blocks, "peak_host_blocks": stats.peak_resident_blocks,
           "block_loads": stats.loads, "sync_loads": stats.sync_loads, "early_uploads": stats.early_uploads,
           "writebacks": stats.writebacks,
           "h2d_GBps": gbps(st.h2d_bytes, st.h2d_s), "d2h_GBps": gbps(st.d2h_bytes, st.d2h_s),
           "pinned_buffers": st.pinned_buffers, "pageable_buffers": st.pageable_buffers,
           "offload_step_s": timer.step_s}
    if store is not None:
        out.update(store_read_GBps=gbps(store.bytes_read, store.read_seconds),
                   store_write_GBps=gbps(store.bytes_written, store.write_seconds))
    out["copies_ok"] = bool(st.h2d_bytes > 0 and st.d2h_bytes > 0 and stats.peak_bound_blocks <= args.param_prefetch + 2)
    return out


def backend(args: argparse.Namespace) -> str:
    return "nccl" if args.accelerator == "gpu" else "gloo"


def end_process_group() -> None:
    """A DDP run in this process leaves its default group: the next one must make its own."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class InjectedError(RuntimeError):
    """Raised by ``params_exception`` inside a block's forward at step 2."""


def workspace_bytes() -> int:
    """cuBLAS's workspaces (``CUBLAS_WORKSPACE_CONFIG`` ``:KiB:count`` pairs): allocated by the first matmul
    and kept by the caching allocator, so memory after a run may exceed the level before it by this much."""
    sizes = [int(x) for x in os.environ.get("CUBLAS_WORKSPACE_CONFIG", "").split(":") if x]
    return sum(kib * 1024 * count for kib, count in zip(sizes[::2], sizes[1::2]))


def allocated() -> int:
    return torch.cuda.memory_allocated() if on_device() else 0


def optimizer_state(path: str, offloaded: bool) -> dict[str, torch.Tensor]:
    """The optimizer state a checkpoint file holds, by ``optim/<group>/<param>/<key>``: plain Lightning's file as
    saved; an offloaded run's converted to a plain file first (its moments live in the store's records)."""
    if offloaded:
        from lightning_nvme.checkpoint import convert

        plain = path + ".plain"
        convert.to_lightning(path, plain)
        path = plain
    states = torch.load(path, map_location="cpu", weights_only=False)["optimizer_states"]
    if offloaded:
        os.remove(path)
    return {f"optim/{i}/{pid}/{key}": torch.as_tensor(value).detach().float() if key == "step" else value.detach()
            for i, state in enumerate(states) for pid, entry in state["state"].items()
            for key, value in entry.items() if torch.is_tensor(value) or key == "step"}


def block_param_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes of every block's parameters, and of the largest block."""
    from lightning_nvme.params import find_blocks

    sizes = [sum(p.numel() * p.element_size() for p in block.parameters()) for _, block in find_blocks(model)]
    return sum(sizes), max(sizes)


def optimizer_state_bytes(trainer: pl.Trainer) -> int:
    """Bytes of the in-memory optimizer's tensors (AdamW: two moments per parameter, and its steps)."""
    return sum(v.numel() * v.element_size() for opt in trainer.optimizers for entry in opt.state.values()
               for v in entry.values() if torch.is_tensor(v))


def memory_peaks() -> dict[str, float | None]:
    if not on_device():
        return {"max_allocated_MiB": None, "max_reserved_MiB": None}
    return {"max_allocated_MiB": round(torch.cuda.max_memory_allocated() / MiB, 1),
            "max_reserved_MiB": round(torch.cuda.max_memory_reserved() / MiB, 1)}


def memory_bound_MiB(plain_peak_MiB: float, block_params: int, state: int, block: int, prefetch: int) -> float:
    """What an offloaded run may peak at: the plain run's peak without the blocks' parameters and the optimizer
    state (both in the store), plus the blocks in device memory at once (``param_prefetch`` + 2)."""
    return round(plain_peak_MiB - (block_params + state - (prefetch + 2) * block) / MiB, 1)


class Delays:
    """A GPU spin of ``lo``-``hi`` ms (drawn per copy) on the current stream before a copy: a copy that runs late
    exposes a missing wait on its event, or a buffer reused while the copy still reads it. ``counts`` says which
    seams were delayed. Without a device (a test on CPU) nothing spins; the copies are still counted."""

    def __init__(self, lo_ms: float, hi_ms: float) -> None:
        self.lo_ms, self.hi_ms = lo_ms, hi_ms
        self.rng = random.Random(0)
        self.counts: dict[str, int] = {}
        self.cycles_per_ms = spin_cycles_per_ms() if on_device() else 0.0

    def wrap(self, seam: str, copy_fn: Callable[[torch.Tensor, torch.Tensor], None]
             ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        def delayed(dst: torch.Tensor, src: torch.Tensor) -> None:
            self.counts[seam] = self.counts.get(seam, 0) + 1
            if self.cycles_per_ms:
                torch.cuda._sleep(int(self.rng.uniform(self.lo_ms, self.hi_ms) * self.cycles_per_ms))
            copy_fn(dst, src)
        return delayed


def spin_cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per millisecond on this device, measured with CUDA events."""
    cycles = 20_000_000
    torch.cuda._sleep(cycles)  # warm up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


def optimizer_copy_seam() -> bool:
    """Whether the offloaded optimizer's state copies go through a replaceable ops (``optim.buffers.copy_ops_for``)."""
    return hasattr(optim_buffers, "copy_ops_for")


@contextlib.contextmanager
def delayed_copies(delays: Delays | None, pool: int | None = None):
    """Within: every ``CudaTransfer`` made gets its copies delayed (the instance's ``ops.copy``, so a fake
    ops is wrapped too) and, with ``pool``, a pool of that many buffers; the activations' copies
    (``CudaCopies.copy``) and the optimizer state's (the ops ``optim.buffers.copy_ops_for`` hands an offloaded
    optimizer, where that seam exists) are delayed as well."""
    real_for, real_act = transfer.transfer_for, activation_device.CudaCopies.__dict__["copy"]
    real_ops_for = getattr(optim_buffers, "copy_ops_for", None)

    def state_ops(params: list[torch.Tensor]) -> Any:
        assert real_ops_for is not None and delays is not None
        ops = real_ops_for(params)
        if ops is not None:
            ops.copy = delays.wrap("optimizer", ops.copy)
        return ops

    def made(device: torch.device, buffer_bytes: int, pool_size: int) -> transfer.BlockTransfer:
        mover = real_for(device, buffer_bytes, pool if pool is not None else pool_size)
        ops = getattr(mover, "ops", None)
        if delays is not None and ops is not None:
            ops.copy = delays.wrap("blocks", ops.copy)
        return mover

    transfer.transfer_for = made
    if delays is not None:
        activation_device.CudaCopies.copy = staticmethod(delays.wrap("activations", real_act.__func__))
        if real_ops_for is not None:
            optim_buffers.copy_ops_for = state_ops
    try:
        yield
    finally:
        transfer.transfer_for = real_for
        activation_device.CudaCopies.copy = real_act
        if real_ops_for is not None:
            optim_buffers.copy_ops_for = real_ops_for


def run_unchecked(name: str, args: argparse.Namespace, base: pl.LightningModule, data: Tokens, store_dir: str,
                  deadline_s: float) -> dict[str, Any]:
    """The cases with no baseline: a refusal, an injected failure, the sanitizer's child process."""
    if name == "params_compile":
        from lightning_nvme.checks import ConfigError

        try:
            train(torch.compile(copy.deepcopy(base)), args, data, store_dir, strategy=offload(args, store_dir))
        except ConfigError as e:
            return {"ok": "torch.compile" in str(e), "refused": str(e)[:400]}
        return {"ok": False, "refused": None}
    if name == "params_exception":
        gc.collect()
        before, registered = allocated(), pinned.live_registrations()
        model = copy.deepcopy(base)

        class Inject(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
                if trainer.global_step == 2:
                    def pre(module, inputs):  # after the scheduler's pre-hook: the block is held
                        raise InjectedError("injected at step 2")
                    pl_module.blocks[1].register_forward_pre_hook(pre)

        raised = False
        try:
            train(model, args, data, store_dir, [Inject()], strategy=offload(args, store_dir))
        except InjectedError:
            raised = True
        gc.collect()
        after, live = allocated(), pinned.live_registrations()
        return {"ok": bool(raised and live == registered == 0 and after <= before + workspace_bytes()),
                "raised": raised, "live_host_registrations_before": registered,  # nonzero: a run before leaked
                "live_host_registrations_after": live, "allocated_before_MiB": round(before / MiB, 1),
                "allocated_after_MiB": round(after / MiB, 1), "allowed_MiB": round(workspace_bytes() / MiB, 1)}
    if name == "params_memory":
        return memory_case(args, store_dir)
    if name == "params_time":
        return time_case(args, base, data, store_dir)
    # sanitizer: the offload cases only (no baselines: their comparison is the parent's), within the deadline.
    # Checkpoint early stop off: torch stops a recomputation by raising an exception inside it, and under the
    # sanitizer a CUDA free during that unwinding runs the sanitizer's Python hook with the exception pending,
    # which fails in torch itself ("cuda trace hook execution failed: SystemError", the first GPU run, torch 2.11).
    cmd = [sys.executable, os.path.abspath(__file__), "--only", "params_backward", "--steps", "2", "--no-baselines",
           "--no-early-stop",
           "--store-dir", store_dir, "--layers", str(max(2, args.layers // 2)), "--accelerator", args.accelerator,
           "--deadline-min", str(max(0.5, deadline_s / 60))]
    try:
        env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"} if args.accelerator == "gpu" else dict(os.environ)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=max(30.0, deadline_s))
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"the sanitizer's child ran past the deadline ({deadline_s:.0f} s)"}
    lines = proc.stdout.strip().splitlines()
    inner = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    case = inner.get("params_backward", {})
    return {"ok": bool(proc.returncode == 0 and case.get("ok")), "returncode": proc.returncode,
            "child": case, "stderr_tail": proc.stderr[-1500:] if proc.returncode else ""}


def memory_case(args: argparse.Namespace, store_dir: str) -> dict[str, Any]:
    """``params_memory``: device memory of a plain and an offloaded run of a larger model, the bound asserted."""
    torch.manual_seed(0)
    base = AdamGPT(vocab=256, d=args.memory_d_model, heads=max(1, args.memory_d_model // 128),
                   layers=args.memory_layers, mlp=4)
    data = Tokens(max(1, args.steps // 2), args.batch, args.seq, 256)
    block_params, block = block_param_bytes(base)
    gc.collect()
    before = allocated()
    plain_trainer = train(copy.deepcopy(base), args, data, store_dir)
    plain, state = memory_peaks(), optimizer_state_bytes(plain_trainer)
    del plain_trainer
    gc.collect()
    plain_after = allocated()
    strategy = offload(args, store_dir)
    train(copy.deepcopy(base), args, data, store_dir, strategy=strategy)
    off = memory_peaks()
    assert strategy.param_offload is not None
    bound_blocks = strategy.param_offload.stats.peak_bound_blocks
    del strategy
    gc.collect()
    after = allocated()
    out: dict[str, Any] = {"model": {"d": args.memory_d_model, "layers": args.memory_layers},
                           "block_params_MiB": round(block_params / MiB, 1), "block_MiB": round(block / MiB, 1),
                           "optimizer_state_MiB": round(state / MiB, 1), "plain": plain, "offloaded": off,
                           "peak_device_blocks": bound_blocks,
                           "allocated_before_MiB": round(before / MiB, 1),
                           "plain_allocated_after_MiB": round(plain_after / MiB, 1),
                           "allocated_after_MiB": round(after / MiB, 1),
                           "allowed_after_MiB": round((before + workspace_bytes()) / MiB, 1)}
    ok = bound_blocks <= args.param_prefetch + 2 and state > 0 and block_params > 0
    if plain["max_allocated_MiB"] is not None and off["max_allocated_MiB"] is not None:
        bound = memory_bound_MiB(plain["max_allocated_MiB"], block_params, state, block, args.param_prefetch)
        out.update(bound_MiB=bound, bound_ok=off["max_allocated_MiB"] <= bound,
                   memory_back=after <= before + workspace_bytes())
        ok = ok and out["bound_ok"] and out["memory_back"]
    else:
        out["bound_ok"] = None  # no device memory to measure (a test on CPU)
    return {"ok": bool(ok), **out}


def time_case(args: argparse.Namespace, base: pl.LightningModule, data: Tokens, store_dir: str) -> dict[str, Any]:
    """``params_time``: the offloaded step against the slower of the plain step and its disk traffic at the raw
    bandwidth measured here; not deterministic (the default kernels), so the numbers are not compared."""
    steps = max(args.time_steps, TIME_MIN_STEPS)
    timed = Tokens(steps, args.batch, args.seq, 256)
    os.makedirs(store_dir, exist_ok=True)
    write_GBps, read_GBps = raw_disk(store_dir, args.disk_probe_mib * MiB)
    plain_timer, timer = StepTimer(), StepTimer()
    train(copy.deepcopy(base), args, timed, store_dir, [plain_timer], deterministic=False, steps=steps)
    strategy = offload(args, store_dir)
    train(copy.deepcopy(base), args, timed, store_dir, [timer], strategy=strategy, deterministic=False, steps=steps)
    moved = timer.moved
    disk_s = moved["bytes_read"] / steps / (read_GBps * 1e9) + moved["bytes_written"] / steps / (write_GBps * 1e9)
    plain_s, step_s = plain_timer.step_s, timer.step_s
    assert plain_s is not None and step_s is not None
    ratio = step_s / max(plain_s, disk_s, 1e-9)
    return {"ok": bool(len(timer.times) >= TIME_MIN_STEPS and ratio <= args.time_threshold), "steps": len(timer.times),
            "offload_step_s": step_s, "plain_step_s": plain_s, "disk_s_per_step": round(disk_s, 4),
            "store_bytes_per_step": (moved["bytes_read"] + moved["bytes_written"]) // steps,
            "raw_write_GBps": round(write_GBps, 2), "raw_read_GBps": round(read_GBps, 2),
            "step_vs_bound": round(ratio, 3), "threshold": args.time_threshold, "io_mode": moved["io_mode"]}


def run_case(name: str, args: argparse.Namespace, baselines: Baselines, store_dir: str,
             deadline_s: float = 600.0) -> dict[str, Any]:
    base, data = baselines.base, baselines.data
    if name in NO_BASELINE:
        return run_unchecked(name, args, base, data, store_dir, deadline_s)
    # bf16-true: the offloaded run keeps fp32 masters, so its reference does too (not plain bf16 AdamW)
    precision, fmt = REFERENCE.get(name, ("32-true", None))
    if args.no_baselines:  # the sanitizer's child: the run itself is what is checked, not its numbers
        ref = again = {}
        ref_peak = ref_step = None
    else:
        # ddp_smoke against Lightning's own DDP: its sampler and the gradient all-reduce are the same
        ref, again, ref_peak, ref_step = baselines.get(precision, fmt, ddp=name in DATA_PARALLEL)
    timer = StepTimer()
    extra: dict[str, Any] = {}
    losses = True  # one continuous fit: its per-step losses are compared too
    if name == "activation_offload":
        cb = NVMeActivationOffload(store_dir=store_dir, min_bytes=1 << 16)
        model = copy.deepcopy(base)
        train(model, args, data, store_dir, [cb, timer])
        stats = cb.total_stats
        extra = {"bytes_written": stats.bytes_written, "bytes_read": stats.bytes_read,
                 "prefetch_hits": stats.prefetch_hits, "misses": stats.misses,
                 "copies_ok": bool(stats.bytes_written > 0 and stats.bytes_read > 0)}
        got = params_of(model)
    elif name == "params_keep":
        strategy = offload(args, store_dir, restore_params=False)
        trainer = train(copy.deepcopy(base), args, data, store_dir, [timer], strategy=strategy)
        extra = transfer_figures(strategy, timer, args)
        from safetensors.torch import load_file

        path = os.path.join(store_dir, "kept.safetensors")
        trainer.strategy.export_weights(path)
        got = load_file(path)
    elif name == "params_resume":
        # Against plain Lightning resumed the same way: a run resumed from an end-of-epoch checkpoint is not
        # bitwise the uninterrupted run even in memory (measured on CPU), so the continuous baseline would fail
        # correct code.
        def saved_and_resumed(make_strategy: Callable[[], Any], callbacks: list, offloaded: bool
                              ) -> dict[str, torch.Tensor]:
            """The resumed run's weights and the saved checkpoint's optimizer state."""
            from lightning.pytorch.callbacks import ModelCheckpoint

            ckpt_dir = tempfile.mkdtemp(dir=store_dir)
            saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
            train(copy.deepcopy(base), args, data, store_dir, [saver, *callbacks], strategy=make_strategy())
            model = copy.deepcopy(base)
            path = os.path.join(ckpt_dir, "epoch=0.ckpt")
            train(model, args, data, store_dir, strategy=make_strategy(), ckpt_path=path)
            return {**params_of(model), **optimizer_state(path, offloaded)}

        if not args.no_baselines:
            ref, again = (saved_and_resumed(lambda: "auto", [], False) for _ in range(2))
        strategies: list[NVMeOffloadStrategy] = []
        got = saved_and_resumed(lambda: strategies.append(offload(args, store_dir)) or strategies[-1], [timer], True)
        extra = transfer_figures(strategies[0], timer, args)
        state = [k for k in ref if k.startswith("optim/")]
        extra["optimizer_state_equal"] = bool(state) and all(k in got and torch.equal(ref[k], got[k]) for k in state)
        extra["optimizer_state_tensors"] = len(state)
        extra["copies_ok"] = extra["copies_ok"] and (extra["optimizer_state_equal"] or args.no_baselines)
    elif name in ("params_desk", "params_desk_half"):
        every = name == "params_desk"
        from lightning_nvme.preflight import resources as preflight

        budget = preflight.device_free_bytes(torch.device("cuda", 0)) // 2 if every else block_bytes(base) // 2
        strategy = offload(args, store_dir, device_memory_budget=budget)
        moves = TrainingMoves()
        model = copy.deepcopy(base)
        train(model, args, data, store_dir, [timer, moves], strategy=strategy)
        extra = transfer_figures(strategy, timer, args)
        assert strategy.desk_plan is not None
        plan = strategy.desk_plan.as_dict()
        extra.update(desk_plan=plan, **moves.moved)
        blocks = plan["blocks_on_desk"] + plan["blocks_streamed"]
        still = moves.moved["block_loads_in_training"] == 0 and moves.moved["writebacks_in_training"] == 0
        extra["copies_ok"] = bool(moves.moved["kept_blocks"] == plan["blocks_on_desk"]
                                  and (plan["blocks_streamed"] == 0 and still if every
                                       else 0 < plan["blocks_on_desk"] < blocks and not still))
        got = params_of(model)
    elif name in DATA_PARALLEL:
        from lightning_nvme import NVMeOffloadDDPStrategy, NVMeOffloadFSDPStrategy

        if name == "ddp_smoke":
            strategy = NVMeOffloadDDPStrategy(store_dir=store_dir, chunk_bytes=args.chunk_mib * MiB,
                                              process_group_backend=backend(args))
        else:  # parameters sharded (1 rank: its shard is every block), gathered per use; overlap="backward"
            strategy = NVMeOffloadFSDPStrategy(store_dir=store_dir, chunk_bytes=args.chunk_mib * MiB,
                                               param_prefetch=args.param_prefetch, process_group_backend=backend(args))
            extra = {"devices": 1, "backend": backend(args)}
        model = copy.deepcopy(base)
        try:
            train(model, args, data, store_dir, [timer], strategy=strategy)
        finally:
            end_process_group()
        got = params_of(model)
    elif name == "params_step" and args.accelerator == "gpu":
        # on CUDA, overlap="step" with offload_params is refused (every gradient would stay on the device)
        from lightning_nvme.checks import ConfigError

        try:
            train(copy.deepcopy(base), args, data, store_dir, strategy=offload(args, store_dir, overlap="step"))
        except ConfigError as e:
            return {"ok": "overlap='backward'" in str(e), "refused": str(e)[:400]}
        return {"ok": False, "refused": None}
    else:
        kwargs: dict[str, Any] = {"overlap": "step"} if name == "params_step" else {}
        if name == "params_prefetch2":
            kwargs["param_prefetch"] = 2
        if name == "params_int8":
            kwargs.update(state_format="int8", master_format="bf16_sr")
        strategy = offload(args, store_dir, **kwargs)
        model = copy.deepcopy(base)
        delays = {"params_delayed": Delays(args.delay_ms, args.delay_ms),
                  "params_stress": Delays(*args.stress_ms)}.get(name)
        callbacks: list[pl.Callback] = [timer]
        if name == "params_stress":  # the activations' copies too
            callbacks.append(NVMeActivationOffload(store_dir=store_dir, min_bytes=1 << 16))
        # params_stress: a pool of 2, each buffer reused as soon as the rules allow
        with delayed_copies(delays, pool=2 if name == "params_stress" else None):
            train(model, args, data, store_dir, callbacks, strategy=strategy, precision=precision)
        extra = transfer_figures(strategy, timer, args)
        if delays is not None:
            extra["delayed_copies"] = dict(delays.counts)
            if args.accelerator == "gpu":  # every seam was delayed (on CPU the activations stay on the host)
                seams: tuple[str, ...] = ("blocks", "activations") if name == "params_stress" else ("blocks",)
                if name == "params_stress" and optimizer_copy_seam():
                    seams += ("optimizer",)
                extra["copies_ok"] = extra["copies_ok"] and all(delays.counts.get(k, 0) > 0 for k in seams)
        if name in ("params_backward", "params_prefetch2") and args.accelerator == "gpu":
            extra["early_uploads_ok"] = extra["early_uploads"] > 0  # the early-upload path ran
            extra["copies_ok"] = extra["copies_ok"] and extra["early_uploads_ok"]
        got = params_of(model)
    if name == "params_resume":
        losses = False  # the resumed run's losses start mid-fit: weights (and the saved optimizer state) only
    if losses:
        got = {**got, **losses_of(timer)}
    else:
        ref, again = weights_only(ref), weights_only(again)
    result = {**verdict(ref, again, got), "peak_device_MiB": peak_MiB(), "baseline_peak_device_MiB": ref_peak,
              "plain_step_s": ref_step, **extra}
    if args.no_baselines:
        result.update(ok=True, bitwise_equal=None, baseline_deterministic=None, max_abs_diff=None)
    result["ok"] = bool(result["ok"] and result.pop("copies_ok", True))
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store-dir", default=os.environ.get("LIGHTNING_NVME_STORE_DIR"))
    p.add_argument("--only", default=",".join(CASES), help=f"comma-separated cases of {CASES}")
    p.add_argument("--steps", type=int, default=6)  # two epochs of steps // 2 batches
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--d-model", type=int, default=512)  # 3.1 M parameters (12 MiB fp32) per block
    p.add_argument("--param-prefetch", type=int, default=1)
    p.add_argument("--chunk-mib", type=int, default=16)  # optimizer chunks about a block's state
    p.add_argument("--delay-ms", type=float, default=1.0, help="GPU spin before each block copy in params_delayed")
    p.add_argument("--stress-ms", type=float, nargs=2, default=(20.0, 50.0), metavar=("LO", "HI"),
                   help="params_stress: GPU spin drawn in [LO, HI] ms before every block and activation copy")
    p.add_argument("--memory-d-model", type=int, default=2048, help="params_memory's model width")
    p.add_argument("--memory-layers", type=int, default=8, help="params_memory's blocks")
    p.add_argument("--time-steps", type=int, default=20, help="params_time's steps (at least 20)")
    p.add_argument("--time-threshold", type=float, default=1.5,
                   help="params_time: most offloaded step / max(plain step, disk time of its bytes)")
    p.add_argument("--disk-probe-mib", type=int, default=1024, help="params_time: bytes of the raw disk probe")
    p.add_argument("--deadline-min", type=float, default=7.0,
                   help="global deadline in minutes (default %(default)s): a case that would not fit in what is left "
                        "is reported skipped, never killed mid-run")
    p.add_argument("--no-baselines", action="store_true", help=argparse.SUPPRESS)  # the sanitizer's child
    p.add_argument("--no-early-stop", action="store_true", help=argparse.SUPPRESS)  # the sanitizer's child
    p.add_argument("--accelerator", default="gpu", help=argparse.SUPPRESS)  # "cpu": a test runs the bodies on CPU
    return p


def run_all(only: list[str], args: argparse.Namespace, baselines: Baselines, store_dir: str,
            t0: float) -> dict[str, Any]:
    """Every case in turn within ``--deadline-min``: a case is started only if the time left exceeds the longest
    case so far (baselines included); otherwise it is reported skipped (never killed mid-run)."""
    deadline = t0 + args.deadline_min * 60
    checks: dict[str, Any] = {}
    longest = 0.0
    for name in only:
        left = deadline - time.perf_counter()
        if left <= longest:
            checks[name] = {"ok": False, "skipped": f"deadline: {left:.0f} s left, the longest case took {longest:.0f} s"}
            continue
        t = time.perf_counter()
        try:
            checks[name] = run_case(name, args, baselines, store_dir, left)
        except Exception as e:  # noqa: BLE001  (report it in the JSON line, then fail)
            checks[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        checks[name]["case_s"] = round(time.perf_counter() - t, 1)
        longest = max(longest, checks[name]["case_s"])
    return checks


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    only = [c for c in args.only.split(",") if c]
    unknown = sorted(set(only) - set(CASES))
    if unknown:
        p.error(f"unknown cases {unknown}; known: {CASES}")
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "skipped": "no CUDA device", "cases": only, "torch": torch.__version__,
                          "torch_cuda": torch.version.cuda}))
        return 0
    torch.cuda.init()  # on_device(): the context exists before the first case
    store_dir = args.store_dir or tempfile.mkdtemp(prefix="nvme-gpu-check-")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    base = AdamGPT(vocab=256, d=args.d_model, heads=8, layers=args.layers, mlp=4)
    data = Tokens(max(1, args.steps // 2), args.batch, args.seq, 256)
    baselines = Baselines(args, base, data, store_dir)
    checks = run_all(only, args, baselines, store_dir, t0)
    gc.collect()
    live = pinned.live_registrations()
    skipped = [name for name, c in checks.items() if "skipped" in c]
    result = {"ok": all(c["ok"] for c in checks.values() if "skipped" not in c) and live == 0, "skipped_cases": skipped,
              **checks, "live_host_registrations": live,
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "total_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
