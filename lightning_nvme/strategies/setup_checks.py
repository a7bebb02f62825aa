"""What the offload strategies refuse at setup, each refusal naming the setting (or the Lightning feature) and the fix.

Why a module of functions: a check reads the trainer, the module, the precision plugin and the settings, never the
strategy's state, so it takes them as arguments; the strategies call them from their hooks and stay about what
Lightning calls, and a test can ask one check without building a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_nvme.checks import ConfigError
from lightning_nvme.optim import OffloadedOptimizer
from lightning_nvme.params import ParamOffload, is_placeholder
from lightning_nvme.settings import OffloadSettings


def check_overlap_supported(strategy_name: str, config: OffloadSettings, trainer: pl.Trainer, precision_plugin: Any,
                            frees_grads: bool) -> None:
    """``overlap="backward"`` updates each chunk during backward: refused with what needs every gradient first."""
    if config.overlap != "backward":
        return
    algorithm = str(getattr(trainer, "gradient_clip_algorithm", None) or "norm").lower()
    if trainer.gradient_clip_val and "norm" in algorithm:
        raise ValueError(f"{strategy_name}: overlap='backward' updates each chunk as its gradients become "
                         "final, before the global gradient norm is known, so norm clipping "
                         f"(gradient_clip_val={trainer.gradient_clip_val}) would change the maths. Use "
                         "overlap='step', or gradient_clip_algorithm='value'.")
    if getattr(precision_plugin, "scaler", None) is not None:
        raise ValueError(f"{strategy_name}: overlap='backward' cannot be used with a loss scaler "
                         "(precision='16-mixed'): the inf check needs all gradients first. Use overlap='step' "
                         "or precision='bf16-mixed'.")
    if frees_grads:
        from lightning.pytorch.callbacks import Callback

        hooked = [type(obj).__name__ for obj in (trainer.lightning_module, *getattr(trainer, "callbacks", []))
                  if type(obj).on_before_optimizer_step is not (
                      pl.LightningModule if isinstance(obj, pl.LightningModule) else Callback
                  ).on_before_optimizer_step]
        if hooked:
            raise ValueError(f"{strategy_name}: overlap='backward' consumes each gradient during backward "
                             f"(freed once its chunk is updated), so {hooked[0]}.on_before_optimizer_step would "
                             "see no gradients (e.g. gradient-norm logging) and already-updated parameters. "
                             "Use overlap='step', or remove that hook.")


def check_param_offload_supported(strategy_name: str, config: OffloadSettings, device: torch.device,
                                  precision_plugin: Any) -> None:
    """``offload_params=True`` on ``device``: CPU and CUDA, without a loss scaler, on CUDA with ``overlap="backward"``."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{strategy_name}: offload_params=True runs on CPU and CUDA devices; the "
                         f"accelerator path for {device} is not implemented. Set offload_params=False.")
    if device.type == "cuda" and getattr(precision_plugin, "scaler", None) is not None:
        raise ValueError(f"{strategy_name}: offload_params=True on CUDA does not support a loss scaler "
                         "(precision='16-mixed'): its unscale and skipped steps are not verified against "
                         "in-memory training. Use precision='bf16-mixed', 'bf16-true' or '32-true', or "
                         "offload_params=False.")
    if device.type == "cuda" and config.overlap != "backward":
        # overlap="step" keeps every block's gradient on the device until the step: device memory then
        # grows with the whole model, which is what parameter offload is there to avoid (issue #33).
        raise ConfigError("overlap", f"{strategy_name}: offload_params=True on CUDA with "
                          f"overlap={config.overlap!r} keeps every block's gradient in device memory "
                          "until the optimizer step (as much memory as the parameters themselves). Fix: "
                          "overlap='backward' (each block updated, written back and its gradient freed "
                          "during backward), or offload_params=False.")


def refuse_compiled(strategy_name: str, module: torch.nn.Module) -> None:
    """``torch.compile`` (and the CUDA graphs of its ``mode="reduce-overhead"``) is refused with offloaded
    parameters. Why: every bind points a block's parameters at a new buffer (the host buffer or a fresh
    device copy), and between uses they are expanded placeholders (stride 0). A compiled graph guards on
    strides (recompiling at every bind, up to its limit, then falling back) and a CUDA graph replays the
    addresses it captured: reads of freed memory, silently wrong numbers. Neither is tested here."""
    from torch._dynamo.eval_frame import OptimizedModule

    compiled = getattr(module, "_compiler_ctx", None) is not None  # Lightning's trainer.fit(torch.compile(m))
    inner = [name for name, m in module.named_modules() if isinstance(m, OptimizedModule)]
    if compiled or inner:
        what = "the LightningModule" if compiled else f"submodule {inner[0]!r}"
        raise ConfigError("offload_params", f"{strategy_name}: {what} is compiled with torch.compile, "
                          "but offload_params=True re-points each block's parameters at a new buffer at every "
                          "load (placeholders between uses): a compiled graph would recompile at every load "
                          "and a CUDA graph (mode='reduce-overhead') would replay freed addresses. Fix: pass "
                          "the module uncompiled, or offload_params=False to compile it.")


def refuse_placeholders(strategy_name: str, module: torch.nn.Module) -> None:
    """A fit of a module whose blocks are placeholders (left by a streamed evaluation): their values are nowhere."""
    if any(is_placeholder(p) for p in module.parameters()):
        raise ValueError(f"{strategy_name}: {type(module).__name__}'s block parameters are "
                         "placeholders left by a streamed evaluation (validate/test/predict with offload_params): "
                         "their values were never in this module. Build the model again (on the meta device, "
                         "with its initial weights) or pass ckpt_path=... to fit.")


def refuse_stateless(strategy_name: str, offloaded: Sequence[OffloadedOptimizer], params: ParamOffload) -> None:
    """Trainable block parameters without per-parameter optimizer state would be updated in memory while their
    values live in the store."""
    in_blocks = params.layout.block_of()
    stateless = [piece.index for off in offloaded for piece in off.unchunked if id(piece.param) in in_blocks]
    if stateless:
        raise ValueError(f"{strategy_name}: offload_params=True needs per-parameter optimizer state for "
                         f"every trainable parameter in a block, but parameters {stateless} have none (e.g. "
                         "SGD with momentum=0): they would be updated in memory while their values live in the "
                         "store. Use an optimizer with state (SGD(momentum>0), AdamW, ...), or offload_params=False.")
