"""``IOTelemetry``: what the NVMe store did each step, in figures a person can read.

Per training step it records bytes read and written, the achieved store throughput (bytes moved / step
wall time), the time spent blocked at fences (``IOStats.wait_seconds``: the I/O the overlap failed to
hide) and the projected SSD wear. It shows them in the progress bar, logs them to the logger, prints a
summary table at the end of ``fit`` and saves a PNG (throughput and fence wait per step) plus a JSON
summary next to the logs. Totals are aggregated with torchmetrics. The summary names the optimizer state
format (``state_format``/``master_format``), which sets the bytes written per step and so the wear.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, fields
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from torchmetrics.aggregation import MaxMetric, MeanMetric, SumMetric
from typing_extensions import override

from lightning_nvme.fs import atomic
from lightning_nvme.memory import peak_rss_bytes
from lightning_nvme.store.stats import IOStats

GB = 1e9


def find_stores(trainer: pl.Trainer) -> list[tuple[str, Any]]:
    """Every distinct ``nvme_store`` on the strategy and the callbacks, as ``(owner name, store)``."""
    found: dict[int, tuple[str, Any]] = {}
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, not declared
    for owner in (trainer.strategy, *callbacks):
        try:
            store = getattr(owner, "nvme_store", None)
        except Exception:  # a property that is not ready before setup
            store = None
        if store is not None and id(store) not in found:
            found[id(store)] = (type(owner).__name__, store)
    return list(found.values())


@dataclass
class StepHistory:
    """Per-step series for the plot; bounded: past ``max_points`` every other point is dropped."""

    max_points: int = 100_000
    step: list[int] = field(default_factory=list)
    gbps: list[float] = field(default_factory=list)
    wait_ms: list[float] = field(default_factory=list)

    def append(self, step: int, gbps: float, wait_ms: float) -> None:
        self.step.append(step)
        self.gbps.append(gbps)
        self.wait_ms.append(wait_ms)
        if len(self.step) > self.max_points:
            self.step, self.gbps, self.wait_ms = self.step[::2], self.gbps[::2], self.wait_ms[::2]


class IOTelemetry(Callback):
    """Per-step I/O figures of every NVMe store in the run.

    Args:
        tbw_tb: the SSD's endurance rating in terabytes written (TBW), for the wear projection.
        prog_bar: show throughput and fence wait in the progress bar.
        plot: save ``<filename>.png`` (needs matplotlib: the ``plot`` extra); skipped with a note if absent.
        summary: print the summary table and write ``<filename>.json`` at the end of fit.
        filename: base name of the PNG/JSON written to the trainer's log directory.
        max_history: bound on the per-step points kept for the plot.
    """

    def __init__(self, tbw_tb: float = 600.0, prog_bar: bool = True, plot: bool = True, summary: bool = True,
                 filename: str = "io_telemetry", max_history: int = 100_000) -> None:
        if tbw_tb <= 0:
            raise ValueError(f"tbw_tb must be > 0 (the SSD's rated terabytes written), got {tbw_tb}")
        self.tbw_tb, self.prog_bar, self.plot, self.summary = tbw_tb, prog_bar, plot, summary
        self.filename, self.max_history = filename, max_history
        self._reset()

    def _reset(self) -> None:
        self.read_bytes, self.written_bytes = SumMetric(), SumMetric()
        self.wait_seconds, self.step_seconds = SumMetric(), SumMetric()
        self.mean_gbps, self.peak_gbps = MeanMetric(), MaxMetric()
        self.history = StepHistory(self.max_history)
        self.stores: list[tuple[str, Any]] = []
        self.state_format: str | None = None
        self.shelf_plan: dict[str, Any] | None = None
        self.desk_plan: dict[str, Any] | None = None
        self._prev: dict[int, IOStats] = {}
        self._t_prev = 0.0
        self._t_val = 0.0
        self._steps = 0
        self._said_none = False
        self.summary_path: str | None = None
        self.plot_path: str | None = None
        self.checkpoint_bytes_written = 0  # by the strategy's checkpoint saves (strategy.checkpoint_saves)
        self.checkpoint_saves: dict[str, int] = {}  # "reflink"/"streamed" -> saves
        self._saves_seen = 0

    # ---- sampling ---------------------------------------------------------------------------------
    def _delta(self, trainer: pl.Trainer) -> IOStats:
        """Stats moved since the previous call, summed over stores (new stores count from when first seen)."""
        total = IOStats()
        self.stores = find_stores(trainer)
        for _, store in self.stores:
            now = store.stats
            prev = self._prev.get(id(store), now)
            d = now - prev
            for f in fields(IOStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(d, f.name))
            self._prev[id(store)] = now
        return total

    def _count_saves(self, trainer: pl.Trainer) -> None:
        """Checkpoint saves since the last call: their written bytes count in the wear next to training's."""
        saves = getattr(trainer.strategy, "checkpoint_saves", None) or []
        for record in saves[self._saves_seen:]:
            self.checkpoint_bytes_written += record.bytes_written
            self.checkpoint_saves[record.path] = self.checkpoint_saves.get(record.path, 0) + 1
        self._saves_seen = len(saves)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        self._delta(trainer)  # baseline
        self._saves_seen = len(getattr(trainer.strategy, "checkpoint_saves", None) or [])
        fmt = getattr(getattr(trainer.strategy, "config", None), "state_format_spec", None)
        self.state_format = fmt.describe() if fmt is not None else None
        shelf = getattr(trainer.strategy, "shelf_plan", None)  # host_memory_budget's plan, made at setup
        self.shelf_plan = shelf.as_dict() if shelf is not None else None
        desk = getattr(trainer.strategy, "desk_plan", None)  # device_memory_budget's plan
        self.desk_plan = desk.as_dict() if desk is not None else None
        if not self.stores and not self._said_none:
            rank_zero_info("IOTelemetry: no nvme_store on the strategy or the callbacks (plain Lightning strategy?); "
                           "I/O figures will be zero.")
            self._said_none = True
        self._t_prev = time.perf_counter()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t_val = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.training:  # validation inside fit: keep its time out of the next step's wall time
            self._t_prev += time.perf_counter() - self._t_val

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.perf_counter()
        step_s = max(now - self._t_prev, 1e-9)
        self._t_prev = now
        d = self._delta(trainer)
        gbps = (d.bytes_read + d.bytes_written) / step_s / GB
        for metric, value in ((self.read_bytes, d.bytes_read), (self.written_bytes, d.bytes_written),
                              (self.wait_seconds, d.wait_seconds), (self.step_seconds, step_s),
                              (self.mean_gbps, gbps), (self.peak_gbps, gbps)):
            metric.update(float(value))
        self._steps += 1
        self._count_saves(trainer)
        self.history.append(trainer.global_step, gbps, d.wait_seconds * 1e3)
        per_day, days = self._wear()
        pl_module.log_dict({"io/read_MB": d.bytes_read / 1e6, "io/written_MB": d.bytes_written / 1e6,
                            "io/wear_TB_per_day": per_day / 1e12, "io/days_to_tbw": min(days, 1e9)},
                           on_step=True, on_epoch=False)
        pl_module.log_dict({"io/GBps": gbps, "io/fence_ms": d.wait_seconds * 1e3},
                           on_step=True, on_epoch=False, prog_bar=self.prog_bar)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """I/O issued after the last sample (callbacks that run after this one, final flushes) still counts
        in the totals, so they match the stores' own counters."""
        d = self._delta(trainer)
        for metric, value in ((self.read_bytes, d.bytes_read), (self.written_bytes, d.bytes_written),
                              (self.wait_seconds, d.wait_seconds)):
            metric.update(float(value))
        self._count_saves(trainer)

    def _wear(self) -> tuple[float, float]:
        """Bytes written per day (training's and checkpoints') at the run's average rate so far, and days until
        ``tbw_tb`` at that rate."""
        seconds = float(self.step_seconds.compute()) if self._steps else 0.0
        written = float(self.written_bytes.compute()) + self.checkpoint_bytes_written if self._steps else 0.0
        per_day = written / seconds * 86400 if seconds > 0 else 0.0
        return per_day, (self.tbw_tb * 1e12 / per_day if per_day > 0 else math.inf)

    # ---- end of fit: table, JSON, PNG ---------------------------------------------------------------
    def summary_dict(self) -> dict[str, Any]:
        steps = max(self._steps, 1)
        seconds = float(self.step_seconds.compute()) if self._steps else 0.0
        wait = float(self.wait_seconds.compute()) if self._steps else 0.0
        per_day, days = self._wear()
        return {
            "stores": [f"{owner}:{getattr(s, 'path', '?')}" for owner, s in self.stores],
            "state_format": self.state_format,
            "shelf_plan": self.shelf_plan,
            "desk_plan": self.desk_plan,
            "steps": self._steps, "train_seconds": seconds,
            "bytes_read": float(self.read_bytes.compute()) if self._steps else 0.0,
            "bytes_written": float(self.written_bytes.compute()) if self._steps else 0.0,
            "mean_GBps": float(self.mean_gbps.compute()) if self._steps else 0.0,
            "peak_GBps": float(self.peak_gbps.compute()) if self._steps else 0.0,
            "fence_wait_seconds": wait, "fence_wait_ms_per_step": wait / steps * 1e3,
            "fence_wait_fraction": wait / seconds if seconds > 0 else 0.0,
            "checkpoint_bytes_written": self.checkpoint_bytes_written, "checkpoint_saves": dict(self.checkpoint_saves),
            "bytes_written_per_day": per_day, "tbw_tb": self.tbw_tb,
            "days_to_tbw": days if math.isfinite(days) else None,
            "peak_rss_bytes": peak_rss_bytes(),
        }

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.summary and not self.plot:
            return
        out_dir = trainer.log_dir or trainer.default_root_dir
        self._write(out_dir)

    @rank_zero_only
    def _write(self, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        if self.plot:
            self.plot_path = self._save_plot(os.path.join(out_dir, self.filename + ".png"))
        if self.summary:
            s = self.summary_dict()
            self.summary_path = os.path.join(out_dir, self.filename + ".json")
            atomic.write_json(self.summary_path, {**s, "plot": self.plot_path}, durable=False, indent=2)
            print(format_summary(s, self.plot_path, self.summary_path), flush=True)

    def _save_plot(self, path: str) -> str | None:
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
            from matplotlib.ticker import MaxNLocator
        except ImportError:
            rank_zero_info("IOTelemetry: matplotlib is not installed, no plot saved "
                           "(pip install 'lightning-nvme[plot]').")
            return None
        fig = Figure(figsize=(8, 5), layout="constrained")  # no pyplot: no global backend state touched
        FigureCanvasAgg(fig)
        top, bottom = fig.subplots(2, 1, sharex=True)
        top.plot(self.history.step, self.history.gbps, color="tab:blue", lw=1)
        top.set_ylabel("store GB/s\n(bytes moved / step time)")
        top.set_title("NVMe store I/O per training step" + ("" if self.stores else " (no nvme_store in this run)"))
        bottom.plot(self.history.step, self.history.wait_ms, color="tab:red", lw=1)
        bottom.set_ylabel("fence wait ms\n(I/O not hidden)")
        bottom.set_xlabel("global step")
        bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        fig.savefig(path, dpi=110)
        return path


def format_summary(s: dict[str, Any], plot_path: str | None, summary_path: str | None) -> str:
    """The end-of-fit table."""
    steps = max(s["steps"], 1)
    days = s["days_to_tbw"]
    wear = (f"{s['bytes_written_per_day'] / 1e12:.3f} TB/day at this rate -> "
            + (f"{days:,.0f} days to the {s['tbw_tb']:g} TBW rating" if days is not None else "no wear (nothing written)"))
    rows = [
        ("stores", ", ".join(s["stores"]) or "none (figures are zero)"),
        ("optimizer state format", s.get("state_format") or "-"),
        ("on the shelf (host_memory_budget)", _shelf_plan(s.get("shelf_plan"))),
        ("on the desk (device_memory_budget)", _desk_plan(s.get("desk_plan"))),
        ("steps / train time", f"{s['steps']} steps, {s['train_seconds']:.1f} s"),
        ("read", f"{s['bytes_read'] / GB:.3f} GB ({s['bytes_read'] / steps / 1e6:.1f} MB/step)"),
        ("written", f"{s['bytes_written'] / GB:.3f} GB ({s['bytes_written'] / steps / 1e6:.1f} MB/step)"),
        ("store throughput", f"mean {s['mean_GBps']:.3f} GB/s, peak {s['peak_GBps']:.3f} GB/s"),
        ("fence wait (unhidden I/O)", f"{s['fence_wait_seconds']:.2f} s total, {s['fence_wait_ms_per_step']:.1f} ms/step, "
                                      f"{100 * s['fence_wait_fraction']:.1f}% of step time"),
        ("checkpoints", ", ".join(f"{n} {path}" for path, n in sorted(s.get("checkpoint_saves", {}).items()))
         + f" save(s), {s.get('checkpoint_bytes_written', 0) / GB:.3f} GB written (in the wear below)"
         if s.get("checkpoint_saves") else "none saved during fit"),
        ("SSD wear", wear),
        ("peak RSS", f"{s['peak_rss_bytes'] / 2**30:.2f} GiB"),
        ("plot", plot_path or "not saved"),
        ("summary", summary_path or "-"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["", "I/O telemetry summary", "-" * 21] + [f"  {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def _shelf_plan(p: dict[str, Any] | None) -> str:
    if not p:
        return "-"
    return (f"{p['shelf_bytes'] / GB:.3f} GB of {p['budget_bytes'] / GB:.3f} GB budget ({p['blocks_on_shelf']} blocks, "
            f"{p['chunks_on_shelf']} chunks), {p['ssd_bytes'] / GB:.3f} GB on the SSD; planned disk I/O "
            f"{p['io_bytes_per_step_before'] / 1e6:.1f} -> {p['io_bytes_per_step_after'] / 1e6:.1f} MB/step")


def _desk_plan(p: dict[str, Any] | None) -> str:
    if not p:
        return "-"
    return (f"{p['desk_bytes'] / GB:.3f} GB of {p['budget_bytes'] / GB:.3f} GB budget ({p['blocks_on_desk']} blocks "
            f"kept), {p['streamed_bytes'] / GB:.3f} GB streamed; planned host <-> device copies "
            f"{p['copy_bytes_per_step_before'] / 1e6:.1f} -> {p['copy_bytes_per_step_after'] / 1e6:.1f} MB/step")
