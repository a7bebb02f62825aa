"""IOTelemetry: per-step figures from every distinct nvme_store, logged, summarised, plotted."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_nvme.callbacks import IOTelemetry
from lightning_nvme.data import EmbeddedTextDataModule
from lightning_nvme.models import GPTLightningModule
from lightning_nvme.store import FlatStore

STEPS = 4
WRITE_BYTES = 1 << 20  # per step


class WritesEachStep(Callback):
    """Stands in for an offloading component: owns ``nvme_store`` and writes/reads it every step."""

    def __init__(self, store: FlatStore) -> None:
        self.nvme_store = store
        self.buf = store.aligned_empty((WRITE_BYTES,), torch.uint8)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.nvme_store.wait(self.nvme_store.write("state", self.buf))
        self.nvme_store.wait(self.nvme_store.read("state", self.buf))


class SharesTheStore(Callback):
    """A second owner of the same store: telemetry must count it once."""

    def __init__(self, store: FlatStore) -> None:
        self.nvme_store = store


def _fit(tmp_path: Path, callbacks: list[Callback]) -> pl.Trainer:
    model = GPTLightningModule(n_layer=1, n_embd=32, n_head=2, block_size=32)
    data = EmbeddedTextDataModule(source="generated", max_bytes=20_000, block_size=32, batch_size=2,
                                  steps_per_epoch=STEPS, val_batches=1)
    trainer = pl.Trainer(accelerator="cpu", max_steps=STEPS, logger=CSVLogger(tmp_path, name="logs"),
                         callbacks=callbacks, enable_checkpointing=False, log_every_n_steps=1,
                         enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=data)
    return trainer


@pytest.fixture()
def store(tmp_path: Path):  # noqa: ANN201
    s = FlatStore(tmp_path / "store", io_chunk_bytes=1 << 20, io_workers=2, staging_bytes=2 << 20)
    s.add_region("state", WRITE_BYTES)
    yield s
    s.close(delete=True)


def test_counts_each_distinct_store_once_and_writes_summary_and_png(tmp_path: Path, store: FlatStore,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    telemetry = IOTelemetry(tbw_tb=300)
    writer = WritesEachStep(store)
    before = store.stats
    trainer = _fit(tmp_path, [telemetry, writer, SharesTheStore(store)])
    moved = store.stats - before

    summary = json.loads((Path(trainer.log_dir) / "io_telemetry.json").read_text())
    assert summary["steps"] == STEPS
    assert len(summary["stores"]) == 1
    # Totals match the store's own counters, including I/O issued after telemetry's last sample.
    assert summary["bytes_written"] == moved.bytes_written == STEPS * WRITE_BYTES
    assert summary["bytes_read"] == moved.bytes_read == STEPS * WRITE_BYTES
    assert summary["fence_wait_seconds"] == pytest.approx(moved.wait_seconds, abs=1e-6)
    assert summary["fence_wait_seconds"] > 0
    assert summary["peak_GBps"] >= summary["mean_GBps"] > 0
    assert summary["checkpoint_bytes_written"] == 0 and summary["checkpoint_saves"] == {}
    per_day = summary["bytes_written"] / summary["train_seconds"] * 86400
    assert summary["bytes_written_per_day"] == pytest.approx(per_day, rel=1e-6)
    assert summary["days_to_tbw"] == pytest.approx(300e12 / per_day, rel=1e-6)

    png = Path(trainer.log_dir) / "io_telemetry.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    out = capsys.readouterr().out
    assert "I/O telemetry summary" in out and "fence wait" in out and "SSD wear" in out and str(png) in out

    rows = [r for r in csv.DictReader((Path(trainer.log_dir) / "metrics.csv").open()) if r.get("io/written_MB")]
    assert len(rows) == STEPS
    # Each logged step (after the first, whose write lands in the next sample) shows the 1 MiB written.
    assert [float(r["io/written_MB"]) for r in rows[1:]] == [pytest.approx(WRITE_BYTES / 1e6)] * (STEPS - 1)
    assert all(float(r["io/GBps"]) >= 0 for r in rows)


def test_without_a_store_logs_zeros_and_says_so_once(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    telemetry = IOTelemetry(plot=False)
    with caplog.at_level("INFO"):
        trainer = _fit(tmp_path, [telemetry])
    said = [r for r in caplog.records if "no nvme_store" in r.getMessage()]
    assert len(said) == 1
    summary = json.loads((Path(trainer.log_dir) / "io_telemetry.json").read_text())
    assert summary["stores"] == [] and summary["bytes_written"] == 0 and summary["days_to_tbw"] is None
    assert "none (figures are zero)" in capsys.readouterr().out
    assert not (Path(trainer.log_dir) / "io_telemetry.png").exists()


def test_rejects_a_nonpositive_tbw_rating() -> None:
    with pytest.raises(ValueError, match="tbw_tb"):
        IOTelemetry(tbw_tb=0)


def test_history_is_bounded() -> None:
    from lightning_nvme.callbacks.io_telemetry import StepHistory

    h = StepHistory(max_points=10)
    for i in range(1000):
        h.append(i, 1.0, 0.0)
    assert len(h.step) <= 10 and h.step[0] == 0 and h.step[-1] >= 990 - 128
