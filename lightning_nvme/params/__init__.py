"""Parameter offload: each block's parameters live in the flat store between uses (``offload_params=True``).

One concept per module: ``policy`` (which modules are blocks), ``layout`` (where each parameter lives
in the store), ``residency`` (moving blocks in and out), ``transfer`` (what bound parameters point at: the
host buffer, or a device copy), ``schedule`` (module hooks: when), ``offload`` (the whole, for a strategy).
What the module holds meanwhile is a placeholder (``lightning_nvme.optim.plan.placeholder``: defined beside
the optimizer's plan, a lower layer, which recognises it too). Its arguments (``offload_params``,
``param_prefetch``, ``param_block_classes``, ``restore_params``) are in ``lightning_nvme.settings``.
"""

from lightning_nvme.optim.plan import is_placeholder
from lightning_nvme.params.offload import ParamOffload
from lightning_nvme.params.policy import find_blocks

__all__ = ["ParamOffload", "find_blocks", "is_placeholder"]
