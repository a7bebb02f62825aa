"""How optimizer state is stored on the SSD: one module per state format (``exact``, ``bf16``, ``int8``), the
master policies (``masters``), the registry that names them, ``state_format`` (``StateFormat``: a format with a
master policy, the API the optimizer, plan and checkpoints ask, and the in-memory reference), the numba
kernels: shared element maths in ``kernels``, the one-pass AdamW update in ``adamw_kernel`` driven by
``fused_update``. A new format is a module implementing ``StateCodec`` and one ``register`` line below (or in
the code that uses it)."""

from lightning_nvme.optim.formats.bf16 import Bf16
from lightning_nvme.optim.formats.codec import Component, MasterPolicy, StateCodec, StateFormatError
from lightning_nvme.optim.formats.exact import Exact
from lightning_nvme.optim.formats.int8 import Int8
from lightning_nvme.optim.formats.masters import Fp32Masters, StochasticBf16
from lightning_nvme.optim.formats.registry import (
    master_format_names,
    master_policy,
    register,
    register_master,
    state_codec,
    state_format_names,
)

register(Exact())  # the default comes first
register(Bf16())
register(Int8())
register_master(Fp32Masters())  # the default comes first
register_master(StochasticBf16())

__all__ = ["Component", "MasterPolicy", "StateCodec", "StateFormatError", "master_format_names", "master_policy",
           "register", "register_master", "state_codec", "state_format_names"]
