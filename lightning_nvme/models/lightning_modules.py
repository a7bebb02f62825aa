"""LightningModules for causal language modelling: loss + perplexity (torchmetrics) for any next-token model.

``CausalLMModule`` holds the training logic; subclasses only decide where the network comes from:
``GPTLightningModule`` builds a fresh GPT of a configured size, ``HFCausalLM`` loads a local checkpoint.
The optimizer arrives as a partial (Hydra ``_partial_: true``) so recipes choose it without code.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import nn
from torchmetrics.text import Perplexity
from typing_extensions import override

from lightning_nvme.models.gpt import GPT, GPTConfig, PretrainedWeights
from lightning_nvme.models.gpt_lora import add_gpt_lora
from lightning_nvme.models.hf import HFInit, HubWeights, block_classes, build_causal_lm
from lightning_nvme.models.peft_lora import AdapterNames, add_peft_lora
from lightning_nvme.params.materialize import InitialWeights, empty_meta

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@contextmanager
def _plain_tensors() -> Iterator[None]:
    """New tensors on the CPU in fp32, whatever device/dtype context the module is built in."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(dtype)


def _default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


IGNORE_INDEX = -100  # a target that is not one (a prompt token, padding): cross_entropy's default ignore_index
Batch = tuple[torch.Tensor, torch.Tensor] | Mapping[str, torch.Tensor]


class CausalLMModule(pl.LightningModule):
    """Next-token training on ``(input_ids, targets)`` batches, or dicts with ``input_ids``, ``targets`` and
    optionally ``position_ids`` (the finetuning data groups: packed samples restart their positions); a target
    of -100 is no target (a prompt token, padding): the loss is the mean over the others. Logs ``*/loss`` and
    ``*/ppl``."""

    def __init__(self, optimizer: OptimizerFactory | None = None) -> None:
        super().__init__()
        self.optimizer_factory = optimizer or _default_optimizer
        with _plain_tensors():  # tiny fp32 states, also inside trainer.init_module() (meta device, bf16 default)
            self.train_ppl = Perplexity(ignore_index=IGNORE_INDEX)
            self.val_ppl = Perplexity(ignore_index=IGNORE_INDEX)
            self.test_ppl = Perplexity(ignore_index=IGNORE_INDEX)

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @override
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.logits(input_ids) if position_ids is None else self.logits(input_ids, position_ids)

    def _loss(self, batch: Batch, ppl: Perplexity) -> torch.Tensor:
        if isinstance(batch, Mapping):
            x, y, positions = batch["input_ids"], batch["targets"], batch.get("position_ids")
        else:
            (x, y), positions = batch, None
        logits = self(x, positions)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX)
        ppl(logits.detach().float(), y)  # forward: this batch's value (for on_step logging) + accumulate
        return loss

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch, self.train_ppl)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/ppl", self.train_ppl, prog_bar=True)  # torchmetrics: computed & reset per step
        return loss

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        loss = self._loss(batch, self.val_ppl)
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", self.val_ppl, prog_bar=True)  # accumulated over the validation epoch

    @override
    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = self._loss(batch, self.test_ppl)
        self.log("test/loss", loss)
        self.log("test/ppl", self.test_ppl)

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """The logits of the batch's inputs (``(input_ids, targets)`` or ``input_ids``)."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x)

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        return self.optimizer_factory(p for p in self.parameters() if p.requires_grad)  # frozen: no state


class GPTLightningModule(CausalLMModule):
    """A freshly initialised GPT-2-style model of a configured size (the embedded recipes' model).

    Args:
        vocab_size: must cover the tokenizer (256 for the byte tokenizer).
        block_size: context length (GPT-2's ``n_positions``).
        n_layer / n_head / n_embd: size; parameters ~ 12 * n_layer * n_embd**2.
        dropout: GPT-2's residual/attention/embedding dropout.
        activation_checkpointing: recompute each transformer block in backward.
        optimizer: a factory ``params -> Optimizer`` (a Hydra partial).
        empty_init: build the network in ``configure_model`` instead of ``__init__``: Lightning runs it under
            the strategy's ``tensor_init_context``, so with ``offload_params=True`` the parameters are created
            on the meta device and initialized block by block straight into the store (a model bigger than
            memory is never built in memory). Initial values are then each module's ``reset_parameters()``
            (Lightning's convention for meta-device models), not GPT-2's normal(0.02) init.
    """

    def __init__(self, vocab_size: int = 256, block_size: int = 128, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0, activation_checkpointing: bool = False,
                 optimizer: OptimizerFactory | None = None, empty_init: bool = False) -> None:
        super().__init__(optimizer)
        self.save_hyperparameters(ignore=["optimizer"])
        self.config = GPTConfig(vocab_size=vocab_size, n_positions=block_size, n_embd=n_embd, n_layer=n_layer,
                                n_head=n_head, dropout=dropout)
        self.activation_checkpointing = activation_checkpointing
        if not empty_init:
            self.configure_model()

    @override
    def configure_model(self) -> None:
        if not hasattr(self, "model"):  # Lightning calls this hook again for every fit/validate/predict
            self.model = GPT(self.config, self.activation_checkpointing)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @override
    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is not None:
            raise ValueError("position_ids (data.packed=true): the built-in GPT has no block-diagonal attention mask; "
                             "use data.packed=false, or a transformers model (model=hf_local)")
        return self.model(input_ids)


class HFCausalLM(CausalLMModule):
    """A causal LM loaded from a local directory holding ``config.json`` + safetensors weights.

    Args:
        path: the checkpoint directory (no hub download: ``local_files_only``).
        block_size: training context length; must not exceed the checkpoint's maximum positions.
        backend: ``"transformers"`` (any ``AutoModelForCausalLM``; needs the ``hf`` extra), ``"native"``
            (GPT-2 checkpoints through the built-in ``GPT``; no extra dependency) or ``"auto"``
            (transformers for every architecture but GPT-2, which streams natively; GPT-2 in memory through
            transformers when installed).
        activation_checkpointing: per-block recompute (``gradient_checkpointing_enable`` under transformers).
        lora_rank: ``0``: finetune every weight; ``r > 0``: freeze the model and train rank-``r`` adapters: through
            ``peft`` under transformers (``get_peft_model``; saved in peft's format by
            ``strategy.export_weights(dir, layout="hf")``), ``lightning_nvme.models.gpt_lora`` on the native GPT-2.
        lora_alpha: adapter scale numerator (``alpha / rank``); ``None``: ``rank`` (scale 1).
        lora_targets: module names to adapt (peft's ``target_modules``); ``None``: peft's default for the
            architecture (Llama, Qwen2, Mistral: ``q_proj``, ``v_proj``; GPT-NeoX: ``query_key_value``).
        lora_dropout: dropout on the adapters' input (peft's ``lora_dropout``).
        optimizer: a factory ``params -> Optimizer`` (a Hydra partial).
        init_seed: ``None``: the weights come from the checkpoint. An int: a fresh random init instead (transformers'
            ``_init_weights``, seeded per module: ``HFInit``), and ``path`` needs only ``config.json``; built on the
            meta device it is initialized block by block straight into the store (a model bigger than memory from
            scratch, with no checkpoint beside the store), in memory it gets the same values.

    Built inside ``trainer.init_module(empty_init=True)`` with ``offload_params=True`` (what the ``train``
    command does), the model is created on the meta device (``build_causal_lm`` under transformers) and its
    weights are streamed from the checkpoint into the parameter store block by block at setup
    (``initial_weights``: ``HubWeights`` / ``PretrainedWeights``), never all in memory.
    """

    # Every weight comes from the checkpoint (adapters from their own init): building under
    # ``trainer.init_module(empty_init=True)`` skips a random init that would be overwritten anyway.
    init_empty = True

    def __init__(self, path: str, block_size: int = 128, backend: str = "auto", activation_checkpointing: bool = False,
                 lora_rank: int = 0, lora_alpha: float | None = None, lora_targets: list[str] | None = None,
                 lora_dropout: float = 0.0, optimizer: OptimizerFactory | None = None,
                 init_seed: int | None = None) -> None:
        super().__init__(optimizer)
        self.save_hyperparameters(ignore=["optimizer"])
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"model.path={path!r} has no config.json: point it at a directory saved "
                                    f"with save_pretrained (config.json + model.safetensors)")
        if backend not in ("auto", "native", "transformers"):
            raise ValueError(f"model.backend must be 'auto', 'native' or 'transformers', got {backend!r}")
        on_meta = torch.empty(()).is_meta  # inside init_module(empty_init=True) of a parameter-offload strategy
        if backend == "auto":
            backend = "transformers" if init_seed is not None else _auto_backend(path, on_meta)
        if init_seed is not None and backend != "transformers":
            raise ValueError("model.init_seed (a fresh init through transformers' _init_weights) needs "
                             f"model.backend='transformers', got {backend!r}")
        self.backend = backend
        self._initial: InitialWeights | None = None
        if backend == "native":
            weights = PretrainedWeights(path, prefix="model.")
            self.model: nn.Module = GPT(weights.config, activation_checkpointing)
            weights.check(self.model)
            if on_meta:
                self._initial = weights  # streamed into the store at setup (initial_weights)
            else:
                weights.load_into(self.model)  # one tensor at a time
            self._vocab = self.model.config.vocab_size
        else:
            if init_seed is not None:  # a fresh init, no weights read
                hf = build_causal_lm(path, gradient_checkpointing=activation_checkpointing)
                fresh = HFInit(hf, init_seed)
                if on_meta:
                    self._initial = fresh  # initialized module by module into the store at setup (initial_weights)
                else:
                    for m in hf.modules():  # the meta weights allocated (the recomputed buffers kept), then initialized
                        empty_meta(m, torch.device("cpu"))
                    fresh.apply(hf)
            elif on_meta:  # built on the meta device, streamed from the checkpoint into the store at setup
                hf = build_causal_lm(path, gradient_checkpointing=activation_checkpointing)
                self._initial = HubWeights(path, prefix="model.").checked(hf)
            else:
                from transformers import AutoModelForCausalLM

                hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True)
                hf.train()  # from_pretrained returns eval mode; Lightning switches modes per loop
                if activation_checkpointing:
                    hf.gradient_checkpointing_enable()
            self._vocab = int(hf.get_output_embeddings().weight.shape[0])
            self.model = hf
            if lora_rank:
                self.model = add_peft_lora(hf, lora_rank, lora_alpha, lora_targets and list(lora_targets), lora_dropout)
                if activation_checkpointing:
                    hf.enable_input_require_grads()  # a frozen base: checkpointed layers need an input with grad
                if self._initial is not None and init_seed is None:  # (HFInit knows modules, not names)
                    self._initial = AdapterNames(self._initial, "model.")
        if lora_rank and backend == "native":
            if lora_targets or lora_dropout:
                raise ValueError("model.lora_targets / model.lora_dropout need model.backend=transformers (peft); "
                                 "the native GPT-2 LoRA adapts attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj")
            add_gpt_lora(self.model, lora_rank, lora_alpha)
        max_positions = _max_positions(self.model)
        if max_positions is not None and block_size > max_positions:
            raise ValueError(f"model.block_size={block_size} exceeds the checkpoint's maximum of {max_positions} "
                             f"positions: set model.block_size={max_positions} or less")

    def param_block_classes(self) -> tuple[type[nn.Module], ...] | None:
        """The blocks of ``offload_params``: transformers' decoder-layer classes (``_no_split_modules``)."""
        return block_classes(self.model) if self.backend == "transformers" else None

    def initial_weights(self) -> InitialWeights | None:
        """The checkpoint, read tensor by tensor, for a model built on the meta device (``None`` once loaded)."""
        return self._initial

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @override
    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.backend == "native":
            if position_ids is not None:
                raise ValueError("position_ids (data.packed=true): the native GPT-2 has no block-diagonal attention mask; "
                                 "use data.packed=false or model.backend=transformers")
            return self.model(input_ids)
        # No attention mask: right padding cannot change a real token's logits under causal attention, and
        # restarting position_ids (packed samples) make transformers build a block-diagonal causal mask.
        out: Any = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return out.logits


    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
                 source: InitialWeights | None = None, prefetch: int = 1, **kwargs: Any) -> GenerationResult:
        """Greedy decoding (transformers' ``generate``, ``do_sample=False``) of a batch of prompts. A model whose
        blocks are not in memory (built on the meta device with ``offload_params``, or left as placeholders by a
        streamed evaluation) reads each block's weights from ``source`` (default: its checkpoint directory, read in
        place) for each decoding step's forward, once for the whole batch; the KV cache stays in memory. ``kwargs``
        go to transformers' ``generate``. Returns the sequences with the figures (tokens/s, bytes read per token)."""
        if self.backend != "transformers":
            raise ValueError(f"HFCausalLM.generate needs model.backend='transformers' (this model: {self.backend!r}); "
                             "the native GPT-2 has no KV cache. Load it with backend='transformers'.")
        import time

        from lightning_nvme.params import is_placeholder
        from lightning_nvme.params.stream import FROM_INITIAL, streamed_blocks

        if source is None and not getattr(self, FROM_INITIAL, False) and any(is_placeholder(p) for p in self.parameters()):
            raise ValueError("HFCausalLM.generate: the block weights are placeholders for values this module does not "
                             "hold (a streamed evaluation from a checkpoint, or a fit with restore_params=False): pass "
                             "source=lightning_nvme.params.stream.BesideSource(checkpoint['state_dict']) (or generate "
                             "from the checkpoint: lightning-nvme generate CKPT).")
        was_training = self.model.training
        self.model.eval()
        try:
            with streamed_blocks(self, source if source is not None else self._initial, prefetch) as stream:
                start = time.perf_counter()
                out = cast(Any, self.model).generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                          max_new_tokens=max_new_tokens, **kwargs)
                seconds = time.perf_counter() - start
        finally:
            self.model.train(was_training)
        new = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
        read = stream.stats.bytes_read if stream is not None else 0
        steps = stream.stats.reads // max(1, len(stream.blocks)) if stream is not None else 0
        return GenerationResult(out, new, seconds, read, steps)


class GenerationResult:
    """What ``HFCausalLM.generate`` returns: the sequences (prompts + new tokens) and its figures."""

    def __init__(self, sequences: torch.Tensor, new_tokens: int, seconds: float, bytes_read: int, steps: int) -> None:
        self.sequences = sequences
        self.new_tokens = new_tokens  # over the batch
        self.seconds = seconds
        self.bytes_read = bytes_read  # block weights read (0: the model was in memory)
        self.block_passes = steps  # forwards through all blocks (decoding steps, each shared by the batch)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_read / self.new_tokens if self.new_tokens else 0.0

    def figures(self) -> dict[str, Any]:
        return {"new_tokens": self.new_tokens, "seconds": round(self.seconds, 4),
                "tokens_per_s": round(self.tokens_per_s, 3), "bytes_read": self.bytes_read,
                "bytes_read_per_token": round(self.bytes_per_token, 1), "block_passes": self.block_passes}


def _auto_backend(path: str, on_meta: bool) -> str:
    """transformers for any architecture but GPT-2; GPT-2 natively when streamed (or without transformers)."""
    import json

    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f).get("model_type", "gpt2")
    has_transformers = importlib.util.find_spec("transformers") is not None
    if model_type == "gpt2" and (on_meta or not has_transformers):
        return "native"
    if not has_transformers:
        raise ValueError(f"model.path={path!r} is a {model_type!r} checkpoint: install the 'hf' extra "
                         "(pip install 'lightning-nvme[hf]') to load architectures other than GPT-2")
    return "transformers"


def _max_positions(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(cfg, key, None)
        if isinstance(value, int):
            return value
    return None
