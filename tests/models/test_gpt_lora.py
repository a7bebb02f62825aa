"""``recipe=lora``: a frozen GPT-2 base streamed from the store (``offload_params=True``) + trainable
low-rank adapters. The recipe composes and trains; the frozen weights are never written to the store
(every write to a block's region lies in its adapters' tail) and stay the checkpoint's values; per step
only the adapters and their optimizer state are written."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback

from lightning_nvme.launch import build, compose_config
from lightning_nvme.models import GPT, GPTConfig
from lightning_nvme.models.gpt_lora import LoRALinear
from lightning_nvme.params.layout import BlockLayout
from lightning_nvme.store import align_up

STEPS = 4


class StoreWrites(Callback):
    """Every store write issued during training (after the blocks were placed at setup), per step."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, str, int, int]] = []  # (step, region, offset, bytes)
        self.bytes_per_step: list[int] = []

    def on_train_start(self, trainer, pl_module):
        store = trainer.strategy.nvme_store
        real = store.write

        def write(name, tensor, offset=0):
            self.writes.append((trainer.global_step, name, offset, tensor.numel() * tensor.element_size()))
            return real(name, tensor, offset)

        store.write = write

    def on_train_batch_start(self, trainer, *args):
        self._before = trainer.strategy.nvme_store.stats.bytes_written

    def on_train_batch_end(self, trainer, *args):
        trainer.strategy.nvme_store.fence()
        self.bytes_per_step.append(trainer.strategy.nvme_store.stats.bytes_written - self._before)


def test_lora_recipe_streams_a_frozen_base_and_writes_only_adapters(tmp_path):
    base = tmp_path / "base"
    torch.manual_seed(5)
    GPT(GPTConfig(vocab_size=256, n_positions=32, n_embd=64, n_layer=3, n_head=4)).save_pretrained(base)
    cfg = compose_config("lora", [f"model.path={base}", "model.block_size=32", "model.lora_rank=2",
                                  f"paths.output_dir={tmp_path}/out", f"paths.store_dir={tmp_path}/store",
                                  "trainer.accelerator=cpu", "data.max_bytes=20000", "data.batch_size=2",
                                  "data.steps_per_epoch=4", "data.val_batches=1", f"trainer.max_steps={STEPS}",
                                  "++trainer.limit_val_batches=0", "logger=none", "callbacks=none"])
    assert cfg.strategy.offload_params and cfg.strategy.overlap == "backward" and cfg.data.source == "stdlib"
    run = build(cfg)
    assert all(p.is_meta for p in run.model.parameters())  # built on the meta device: streamed at setup
    watch = StoreWrites()
    run.trainer.callbacks.append(watch)
    run.trainer.fit(run.model, datamodule=run.datamodule)
    assert run.trainer.global_step == STEPS

    model = run.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 4 * 3
    # The frozen base is still exactly the checkpoint; the adapters trained.
    pretrained = GPT.from_pretrained(base).state_dict()
    state = model.state_dict()
    for name, value in pretrained.items():
        assert torch.equal(state["model." + name], value), name
    assert any(m.lora_up.abs().sum() > 0 for m in model.modules() if isinstance(m, LoRALinear))

    # Never written: every write to a block's region starts at or after its frozen head.
    blocks: dict[str, BlockLayout] = {b.region: b for b in run.trainer.strategy.param_offload.blocks}
    assert blocks and all(b.writable_offset > 0 for b in blocks.values())
    block_writes = [(r, off) for _, r, off, _ in watch.writes if r in blocks]
    assert len(block_writes) >= STEPS * len(blocks)  # each step writes every block's adapters back
    assert all(off >= blocks[r].writable_offset for r, off in block_writes), block_writes

    # Bytes written per step: the adapters' tails + their AdamW moments (two per adapter value), page-aligned;
    # far below the frozen base that a full finetune would write.
    adapter_bytes = sum(s.nbytes for b in blocks.values() for s in b.slots if s.trainable)
    frozen_bytes = sum(s.nbytes for b in blocks.values() for s in b.slots if not s.trainable)
    pages = 4096 * 2 * len(run.trainer.strategy.offloaded[0].chunks)  # alignment of each chunk's two moments
    bound = sum(align_up(b.nbytes - b.writable_offset) for b in blocks.values()) + 2 * adapter_bytes + pages
    assert len(watch.bytes_per_step) == STEPS
    assert 0 < max(watch.bytes_per_step) <= bound, (watch.bytes_per_step, bound)
    assert bound < frozen_bytes / 3
