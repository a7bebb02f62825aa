"""LoRA through ``peft``: the field's adapter library, so trained adapters load with ``PeftModel.from_pretrained``.

With ``offload_params`` the model is built on the meta device; ``peft`` then creates its adapters on the
meta device too (it follows the base layer), where its own init cannot run; under Lightning's
``init_module(empty_init=True)`` of any strategy, ``nn.init`` is skipped and the adapters hold uninitialized
memory. ``init_adapters`` then gives them their values on the CPU right away, replaying what peft does in
memory on the same random stream: per adapted layer, in module order, ``nn.Linear(in, r)`` and
``nn.Linear(r, out)`` constructed (their default init draws from the generator), ``reset_lora_parameters``
(kaiming-uniform ``A``, zero ``B``), then the cast to the base layer's dtype. So the same seed gives bitwise
the same adapters as a plain in-memory build, whatever the strategy. They are small, and the base weights
still stream from the checkpoint at setup (``AdapterNames`` maps
peft's names, ``...q_proj.base_layer.weight``, back to the checkpoint's). In the store the frozen base is a
block's read-only head and the adapters its written tail (``lightning_nvme.params.layout``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_nvme.params.materialize import InitialWeights, empty_meta

PEFT_PREFIX = "base_model.model."  # where PeftModel keeps the wrapped model
ADAPTER = "default"


def add_peft_lora(model: nn.Module, rank: int, alpha: float | None = None, targets: list[str] | None = None,
             dropout: float = 0.0) -> Any:
    """``get_peft_model(model, LoraConfig(...))``: every base parameter frozen, rank-``rank`` adapters on
    ``targets`` (module name suffixes; ``None``: peft's default for the architecture, e.g. ``q_proj``/``v_proj``
    for Llama). Adapters of a meta-device model are initialized on the CPU (``init_adapters``)."""
    if rank < 1:
        raise ValueError(f"model.lora_rank must be >= 1 for LoRA, got {rank}")
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank,  # type: ignore[arg-type]
                        target_modules=targets,
                        lora_dropout=dropout)
    skipped = init_skipped()  # before peft runs: its construction draws nothing from the generator then
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as e:  # no default targets for this architecture, or none matched
        raise ValueError(f"model.lora_targets: {e} Name the projections, e.g. model.lora_targets=[q_proj,v_proj]") from e
    init_adapters(peft_model, config.init_lora_weights, skipped)
    return peft_model


def init_skipped() -> bool:
    """Whether ``nn.init`` is a no-op here (Lightning's ``_EmptyInit`` mode of ``init_module(empty_init=True)``)."""
    with torch._C.DisableTorchFunction():
        probe, own = torch.zeros(()), torch.Generator()  # on the CPU, also under a meta-device mode
    # uniform_ dispatches to torch-function modes (ones_ does not); its own generator leaves the global one alone
    torch.nn.init.uniform_(probe, 1.0, 1.0, generator=own)
    return probe.item() == 0


def init_adapters(model: nn.Module, init: Any = True, skipped: bool = False) -> None:
    """peft's own init, on the CPU and on the in-memory build's random stream, for adapters left on the meta
    device or (``skipped``) created while ``nn.init`` did nothing. Adapters that peft initialized are kept."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for name in module.active_adapters:
            parts = [module.lora_A[name], module.lora_B[name]]
            if not skipped and not any(p.is_meta for part in parts for p in part.parameters()):
                continue
            with torch._C.DisableTorchFunction():  # new tensors on the CPU; nn.init not skipped
                if isinstance(parts[0], nn.Linear) and isinstance(parts[1], nn.Linear):
                    _replay_linear(module, name, init)
                    continue
                for part in parts:  # adapters of other layer kinds: peft's reset only
                    for sub in part.modules():
                        empty_meta(sub, torch.device("cpu"))
                module.reset_lora_parameters(name, init)


def _replay_linear(module: Any, name: str, init: Any) -> None:
    """What ``LoraLayer.update_layer`` does for a linear adapter in memory, on the CPU: construct both linears
    (the generator draws of their default init included), peft's reset, the cast to the base layer's dtype."""
    old_a, old_b = module.lora_A[name], module.lora_B[name]
    module.lora_A[name] = nn.Linear(old_a.in_features, old_a.out_features, bias=False)
    module.lora_B[name] = nn.Linear(old_b.in_features, old_b.out_features, bias=old_b.bias is not None)
    module.reset_lora_parameters(name, init)
    module._move_adapter_to_device_of_base_layer(name, device=torch.device("cpu"))
    for old, new in ((old_a, module.lora_A[name]), (old_b, module.lora_B[name])):
        for (_, p), (_, q) in zip(old.named_parameters(), new.named_parameters()):
            q.requires_grad_(p.requires_grad)


class AdapterNames:
    """The base model's initial weights (``HubWeights``/``PretrainedWeights`` under ``prefix``) for the same model
    wrapped by peft: ``prefix + "base_model.model." + name`` with ``.base_layer`` dropped is the unwrapped name."""

    def __init__(self, source: InitialWeights, prefix: str) -> None:
        self.source = source
        self.prefix = prefix

    def _base(self, name: str) -> str | None:
        if not name.startswith(self.prefix + PEFT_PREFIX):
            return None
        return self.prefix + name[len(self.prefix + PEFT_PREFIX):].replace(".base_layer.", ".")

    def __contains__(self, name: object) -> bool:
        base = self._base(name) if isinstance(name, str) else None
        return base is not None and base in self.source

    def get(self, name: str) -> torch.Tensor:
        base = self._base(name)
        assert base is not None
        return self.source.get(base)

    def locate(self, name: str) -> tuple[str, str] | None:
        """Where the base weight behind ``name`` lies in its file, if the source says (``HubWeights.locate``)."""
        base = self._base(name)
        locate = getattr(self.source, "locate", None)
        return locate(base) if base is not None and locate is not None and base in self.source else None


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``weight + scaling * B @ A`` exactly as peft's ``merge`` computes it on the CPU (half adapters in fp32)."""
    half = lora_b.dtype in (torch.float16, torch.bfloat16)
    a, b = (lora_a.float(), lora_b.float()) if half else (lora_a, lora_b)
    delta = (b @ a) * scaling
    out = weight.clone()
    out += delta.to(lora_b.dtype) if half else delta
    return out


def lora_merges(peft_model: Any, prefix: str) -> dict[str, tuple[str, str, float]]:
    """``state_dict`` key of each adapted base weight -> (its ``lora_A`` key, its ``lora_B`` key, scaling)."""
    from peft.tuners.lora import LoraLayer

    inner = prefix + PEFT_PREFIX
    merges = {}
    for name, m in peft_model.base_model.model.named_modules():
        if isinstance(m, LoraLayer):
            if getattr(m, "fan_in_fan_out", False) or m.use_dora.get(ADAPTER, False):
                raise ValueError(f"{name}: merging fan_in_fan_out / DoRA adapters on export is not supported; export "
                                 "the adapters alone (merge_adapters=False)")
            merges[f"{inner}{name}.base_layer.weight"] = (f"{inner}{name}.lora_A.{ADAPTER}.weight",
                                                          f"{inner}{name}.lora_B.{ADAPTER}.weight",
                                                          float(m.scaling[ADAPTER]))
    return merges
