"""The ``lightning-nvme`` command: train / recipes / bench / doctor, and config errors as exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_nvme.cli import main


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(("argv", "expected"), [
    (["train", "recipe=quickstart", "trainer.max_stepz=3"], "did you mean 'trainer.max_steps'"),
    (["train", "recipe=quickstart", "trainer.max_steps=many"], "trainer.max_steps: must be int"),
    (["train", "recipe=quickstrat"], "unknown recipe 'quickstrat'"),
    (["train", "recipe=hf_local"], "model.path: required but not set"),
    (["train", "recipe=quickstart", "strategy.store_dir=/nonexistent_mount/run"], "is the disk mounted"),
])
def test_config_errors_exit_2_with_one_message(argv: list[str], expected: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = _err(capsys)
    assert err.startswith("lightning-nvme: config error:") and expected in err
    assert len(err.strip().splitlines()) == 1


def test_dry_run_prints_the_composed_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--dry-run", "recipe=quickstart", "trainer.max_steps=7"]) == 0
    out = capsys.readouterr().out
    assert "name: quickstart" in out and "max_steps: 7" in out and "NVMeOffloadStrategy" in out


def test_train_runs_a_recipe_end_to_end(tmp_path: Path) -> None:
    """The real command in its own process (training seeds the process-global RNGs)."""
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_nvme", "train", "recipe=quickstart", f"paths.output_dir={tmp_path}",
         "trainer.max_steps=2", "data.source=generated", "data.max_bytes=20000", "data.batch_size=2",
         "data.steps_per_epoch=2", "data.val_batches=1", "model.n_layer=1", "model.n_embd=32",
         "model.block_size=32", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "I/O telemetry summary" in proc.stdout and "finished quickstart: 2 steps" in proc.stdout
    assert "NVMeOffloadStrategy:" in proc.stdout  # the summary names the strategy's store
    assert list(tmp_path.glob("logs/version_*/io_telemetry.png"))


def test_recipes_lists_every_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name in ("quickstart", "hf_local", "bigger_than_memory"):
        assert name in out


def test_bench_runs_scripts_and_collects_their_last_json_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "fast.py").write_text("import json\nprint('working')\nprint(json.dumps({'ratio': 2.0}))\n")
    (bench / "broken.py").write_text("raise SystemExit(3)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "fast"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"benchmarks": {"fast": {"ratio": 2.0}},
                                                                           "failed": []}
    assert main(["bench"]) == 1  # one failed
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["failed"] == ["broken"]
    assert main(["bench", "nope"]) == 2
    assert "unknown benchmark" in _err(capsys)


def test_doctor_delegates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_nvme.doctor.command as doctor

    seen = []
    monkeypatch.setattr(doctor, "main", lambda argv: seen.append(argv) or 0)
    assert main(["doctor", str(tmp_path), "--flag"]) == 0
    assert seen == [[str(tmp_path), "--flag"]]


def test_bench_outside_a_checkout_says_where_the_benchmarks_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["bench"]) == 2
    err = _err(capsys)
    assert "no benchmarks/ directory" in err and "source repository" in err


def test_python_dash_m_is_the_same_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "lightning_nvme", "train", "recipe=quickstart", "trainer.max_stepz=1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert "did you mean 'trainer.max_steps'" in proc.stderr and "Traceback" not in proc.stderr
