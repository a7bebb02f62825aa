"""kill -9 crash consistency: randomized SIGKILLs mid write-back, mid checkpoint (both commit paths),
at random times, and mid activation offload; then resume with ``ckpt_path="last"``.

After every kill: every visible checkpoint loads completely and equals, bit for bit, the uninterrupted
reference run's checkpoint of the same step (weights, optimizer moments, step counts, schedulers);
only hidden ``.NAME.tmp-PID`` / ``.NAME.old`` names hold partial data; the store lock names the dead
pid. The next run resumes from exactly the step of ``last.ckpt``, takes over the stale store and
lock, and the run that finally completes ends with parameters ``torch.equal`` to the reference.
A live run's store is refused to a second trainer (``StoreLockedError`` naming its pid) and untouched.

Trials are drawn from a seeded RNG (``CRASH_SEED``, ``CRASH_TRIALS`` per phase): kill points index
the events counted in the reference run, so every trial really dies mid-phase. See ``crash_worker.py``.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import random
import re
import shutil
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # crash_worker, whether or not faults/ is a package
import crash_worker as cw  # noqa: E402

from lightning_nvme.checkpoint import convert
from lightning_nvme.checkpoint.load import open_checkpoint
from lightning_nvme.checkpoint.state_files import is_padding, open_readers
from lightning_nvme.optim.formats.state_format import StateFormat

SEED = int(os.environ.get("CRASH_SEED", "20261129"))
TRIALS = int(os.environ.get("CRASH_TRIALS", "8"))  # per phase
EPOCHS, STEPS = 6, 3  # a checkpoint every 3 optimizer steps; 18 steps in all
HIDDEN = re.compile(r"^\..+\.(tmp-\d+|old)$")
KILLED = -signal.SIGKILL


def _has_activation_offload() -> bool:
    try:
        return hasattr(importlib.import_module("lightning_nvme.callbacks"), "NVMeActivationOffload")
    except ImportError:
        return False


# ---- fixtures -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def jobs():
    server = cw.Jobs()
    yield server
    server.close()


@dataclass
class Reference:
    root: str
    counts: dict[str, dict[int, int]]
    seconds: float
    final: dict[str, torch.Tensor]
    snapshots: dict[int, str]  # global step -> copy of last.ckpt (and its .optim directory) at that step


def _reference(jobs: cw.Jobs, root: str, activations: bool = False, **spec) -> Reference:
    _, rc = jobs.run(cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS, snapshots=True, activations=activations,
                                 **spec))
    assert rc == 0, _log(root)
    events = cw.read_events(root)
    started, done = events[0], events[-1]
    counts = {phase: {int(e): n for e, n in by.items()} for phase, by in done["counts"].items()}
    snap = cw.paths(root)["snapshots"]
    snapshots = {int(d.split("-")[1]): os.path.join(snap, d, "last.ckpt") for d in os.listdir(snap)}
    assert sorted(snapshots) == [STEPS * (e + 1) for e in range(EPOCHS)]
    return Reference(root, counts, done["t"] - started["t"], torch.load(cw.paths(root)["final"]), snapshots)


@pytest.fixture(scope="module")
def reference(jobs, tmp_path_factory) -> Reference:
    return _reference(jobs, str(tmp_path_factory.mktemp("reference")))


def _log(root: str) -> str:
    try:
        with open(os.path.join(root, "log.txt")) as f:
            return f.read()[-4000:]
    except FileNotFoundError:
        return "(no log)"


# ---- checks ----------------------------------------------------------------------------------------------
def _equal(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _load_complete(path: str) -> tuple[dict, list[dict]]:
    """A checkpoint (file + optimizer state) loaded completely: its dict and, per
    optimizer, every streamed tensor (read in full: a truncated file or another save's is refused), assembled
    per parameter and key (a reflink save's range entries and padding are layout, not state)."""
    ckpt, parts = open_checkpoint(path)
    assert parts is not None and parts.problem is None, f"{path}: {parts and parts.problem}"
    tensors = []
    for marker in parts.markers:
        readers = open_readers(parts.directory, marker, parts.save_id, parts.records, parts.source)
        state: dict = {}
        try:
            for r in readers:
                for name in r.entries:
                    if not is_padding(name):
                        convert._gather(state, r, name, marker.get("shapes"),
                                        StateFormat.from_dict(marker.get("state_format")))
        finally:
            for r in readers:
                r.close()
        tensors.append(state)
    return ckpt, tensors


def verify_checkpoint(path: str, ref: Reference) -> int:
    """``path`` loads completely and holds exactly the reference run's state at its step; returns the step."""
    ckpt, tensors = _load_complete(path)
    step = ckpt["global_step"]
    assert step in ref.snapshots, f"{path}: step {step} is not an epoch end of the reference run"
    expected, expected_tensors = _load_complete(ref.snapshots[step])
    for key in ("epoch", "global_step", "state_dict", "lr_schedulers"):
        assert _equal(ckpt[key], expected[key]), f"{path}: {key} differs from the reference at step {step}"
    for state, ref_state in zip(ckpt["optimizer_states"], expected["optimizer_states"], strict=True):
        assert _equal(state, ref_state), f"{path}: optimizer param groups/scalars differ at step {step}"
    assert _equal(tensors, expected_tensors), f"{path}: optimizer state differs from the reference at step {step}"
    return step


def _check_parts_dir(path: str) -> list[str]:
    """A ``NAME.optim`` directory holds complete saves (named by save id) and hidden temps only; returns those."""
    entries = os.listdir(path)
    hidden = [e for e in entries if e.startswith(".")]
    assert all(HIDDEN.match(e) for e in hidden), f"unexpected hidden entries in {path}: {hidden}"
    assert all(re.match(r"^[0-9a-f]{32}$", e) for e in entries if not e.startswith(".")), entries
    return hidden


def checkpoint_state(root: str, ref: Reference) -> tuple[int | None, int]:
    """Verify every visible checkpoint; return (step of last.ckpt or None, number of hidden leftovers)."""
    ckpts = cw.paths(root)["ckpts"]
    names = os.listdir(ckpts) if os.path.isdir(ckpts) else []
    hidden = [n for n in names if n.startswith(".")]
    assert all(HIDDEN.match(n) for n in hidden), f"unexpected hidden entries in {ckpts}: {hidden}"
    resolved = ModelCheckpoint(dirpath=ckpts)._find_last_checkpoints(None)  # what ckpt_path="last" picks from
    assert resolved <= {os.path.join(ckpts, "last.ckpt")}, f"ckpt_path='last' would consider {resolved}"
    last = None
    for name in names:
        if name.startswith("."):
            continue
        if name.endswith(".optim"):  # the optimizer state of a checkpoint file (or debris a later save sweeps)
            hidden += _check_parts_dir(os.path.join(ckpts, name))
            continue
        step = verify_checkpoint(os.path.join(ckpts, name), ref)
        if name == "last.ckpt":
            last = step
    return last, len(hidden)


def lock_path(root: str) -> str:
    return os.path.join(cw.paths(root)["store"], cw.STORE_FILE + ".lock")


def lock_holder(root: str) -> str | None:
    """The pid a store lock file names; None when there is no file or it is empty (a released lock is emptied)."""
    try:
        with open(lock_path(root)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def params_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- a chain of crashes and resumes -------------------------------------------------------------------------
@dataclass
class Tally:
    killed: int = 0
    torn_writes: int = 0
    finished_first: int = 0  # runs that completed before their kill point came: not trials
    checkpoints_verified: int = 0
    resumes_checked: int = 0  # a resumed run started at last.ckpt's step (or at 0 when there was none)
    stale_takeovers: int = 0  # ... and took over the lock the killed run left
    hidden_leftovers: int = 0  # hidden temp/aside dirs seen after kills (never visible, swept later)
    between_fallback_renames: int = 0  # kills that left last.ckpt only as the complete .last.ckpt.old
    final_runs_equal: int = 0  # run directories whose completed run equals the reference bitwise
    kill_steps: list[int | None] = field(default_factory=list)  # last.ckpt's step after each kill
    kill_sites: Counter = field(default_factory=Counter)  # the call each in-process kill came just before


FINAL_STEP = EPOCHS * STEPS
KILLS_PER_DIR = 3  # then a new run directory, so kill points spread over all epochs


def _draw_kill(rng: random.Random, phase: str, ref: Reference, start_epoch: int) -> dict:
    events = sum(n for e, n in ref.counts[phase].items() if e >= start_epoch)
    assert events > 0, f"the reference run counted no {phase} events from epoch {start_epoch}"
    return {"phase": phase, "at": rng.randint(1, events), "torn": rng.choice([None, round(rng.random(), 3)])}


def _wait_started(root: str, pid: int, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e["event"] == "started" and e["pid"] == pid for e in cw.read_events(root)):
            return True
        if not cw._alive(pid):
            return False
        time.sleep(0.005)
    return False


def _check_resumed(root: str, pid: int, last_step: int | None, dead_pid: int | None, tally: Tally) -> None:
    """The run ``pid`` resumed from last.ckpt's step (via ``ckpt_path="last"``) and took over the stale lock."""
    started = [e for e in cw.read_events(root) if e["event"] == "started" and e["pid"] == pid]
    if not started:  # killed during setup, before training started (or nothing left to train): checked later
        return
    s = started[0]
    if last_step is None:
        assert s["global_step"] == 0 and s["ckpt_path"] is None, s
    else:
        assert s["ckpt_path"] == cw.paths(root)["last"], f"resumed from {s['ckpt_path']}, not last.ckpt"
        assert s["global_step"] == last_step, f"resumed at step {s['global_step']}, last.ckpt is at {last_step}"
    if dead_pid is not None:
        assert s["took_over_stale"], "the dead run's lock was not recognised as stale"
        tally.stale_takeovers += 1
    tally.resumes_checked += 1


def _check_completed(root: str, ref: Reference, tally: Tally, saved: bool) -> None:
    """The run in ``root`` completed: bitwise equal to the reference; dead runs' hidden dirs swept if it saved."""
    final_step, hidden = checkpoint_state(root, ref)
    assert final_step == FINAL_STEP
    assert params_equal(torch.load(cw.paths(root)["final"]), ref.final), f"{root}: final params differ"
    if saved:
        assert hidden == 0, f"hidden leftovers of dead runs were not swept: {os.listdir(cw.paths(root)['ckpts'])}"
    tally.final_runs_equal += 1


def run_chain(jobs: cw.Jobs, ref: Reference, base: str, phase: str, trials: int, *, exchange: bool = True,
              activations: bool = False, fresh_final: bool = False, **stripes: int) -> Tally:
    """``trials`` kills, each run resuming the one killed before it in the same run directory, up to
    ``KILLS_PER_DIR`` per directory; each directory's last run goes to the end and is compared with the
    reference. A run that finished before its kill point is verified too but is not counted as a trial."""
    rng = random.Random(f"{SEED}-{phase}-{exchange}")
    tally = Tally()
    attempts, segment = 0, 0
    while tally.killed < trials:
        root = os.path.join(base, f"run{segment}")
        segment += 1
        last_step, dead_pid, finished = None, None, False
        kills_here = 0
        while tally.killed < trials and last_step != FINAL_STEP and kills_here < KILLS_PER_DIR:
            attempts += 1
            assert attempts <= 3 * trials, f"{phase}: only {tally.killed} of {trials} runs could be killed"
            resume = last_step is not None or dead_pid is not None
            start_epoch = (last_step or 0) // STEPS
            kill = None if phase == "timed" else _draw_kill(rng, phase, ref, start_epoch)
            spec = cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS, resume=resume, kill=kill,
                               exchange=exchange, activations=activations, recover_last=not exchange, **stripes)
            pid = jobs.start(spec)
            if phase == "timed" and _wait_started(root, pid):
                time.sleep(rng.uniform(0, 0.6 * ref.seconds * (EPOCHS - start_epoch) / EPOCHS))
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            rc = jobs.wait(pid)
            _check_resumed(root, pid, last_step, dead_pid, tally)
            if rc == 0:  # the kill point lay beyond this run's end (resumed runs vary a little): not a trial
                tally.finished_first += 1
                _check_completed(root, ref, tally, saved=last_step != FINAL_STEP)
                finished = True
                break
            assert rc == KILLED, f"run {pid} exited with {rc} instead of being killed:\n{_log(root)}"
            tally.killed += 1
            kills_here += 1
            tally.kill_sites.update(e["at"] for e in cw.read_events(root) if e["event"] == "dying" and e["pid"] == pid)
            tally.torn_writes += bool(kill and kill["torn"])
            holder = lock_holder(root)
            assert holder in (str(pid), None), f"the lock file names {holder}, not the dead run {pid}"
            dead_pid = pid if holder == str(pid) else None
            last_step, hidden = checkpoint_state(root, ref)
            tally.hidden_leftovers += hidden
            aside = os.path.join(cw.paths(root)["ckpts"], ".last.ckpt.old")
            if last_step is None and not exchange and os.path.isdir(aside):
                # killed between the fallback commit's two renames: the next run recovers the previous
                # last.ckpt (see test_kill9_between_fallback_renames_is_recovered) and must resume from it
                last_step = verify_checkpoint(aside, ref)
                tally.between_fallback_renames += 1
            tally.checkpoints_verified += sum(not n.startswith(".") and not n.endswith(".optim")
                                              for n in os.listdir(cw.paths(root)["ckpts"])) \
                if os.path.isdir(cw.paths(root)["ckpts"]) else 0
            tally.kill_steps.append(last_step)
        if finished:
            continue
        spec = cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS, resume=True, exchange=exchange,
                           activations=activations, recover_last=not exchange, **stripes)
        if fresh_final and segment == 1:  # a resume in a new interpreter: nothing shared with the fork server
            rc = cw.run_fresh_interpreter(spec)
            pid = [e for e in cw.read_events(root) if e["event"] in ("started", "done")][-1]["pid"]
        else:
            pid, rc = jobs.run(spec)
        assert rc == 0, _log(root)
        _check_resumed(root, pid, last_step, dead_pid, tally)
        _check_completed(root, ref, tally, saved=last_step != FINAL_STEP)
    print(f"\n[crash {phase}{'' if exchange else ' fallback-commit'}] {tally}")
    return tally


# ---- the tests -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("phase,exchange", [("writeback", True), ("checkpoint", True), ("checkpoint", False),
                                            ("timed", True)],
                         ids=["mid-writeback", "mid-checkpoint", "mid-checkpoint-fallback-commit", "random-time"])
def test_kill9_trials_resume_bitwise(jobs, reference, tmp_path, phase, exchange):
    """``CRASH_TRIALS`` seeded SIGKILLs in one phase; every check of ``run_chain`` holds after each."""
    tally = run_chain(jobs, reference, str(tmp_path), phase, TRIALS, exchange=exchange,
                      fresh_final=phase == "writeback")
    assert tally.killed == TRIALS
    assert tally.resumes_checked >= 1 and tally.stale_takeovers >= 1


def test_kill9_mid_writeback_on_one_stripe_resumes_bitwise(jobs, reference, tmp_path):
    """A store striped over three directories (4 KiB units), killed mid write-back to its second stripe's file:
    every check of ``run_chain`` holds, and the striped run equals the one-directory reference bit for bit."""
    striped = _reference(jobs, str(tmp_path / "reference"), stripes=3, kill_stripe=1)
    assert params_equal(striped.final, reference.final)
    for step, path in striped.snapshots.items():
        assert verify_checkpoint(path, reference) == step  # checkpoints too: the same as one directory's
    assert sum(striped.counts["writeback"].values()) > 0, "no write-back reached the second stripe"
    tally = run_chain(jobs, striped, str(tmp_path), "writeback", max(2, TRIALS // 2), stripes=3, kill_stripe=1)
    assert tally.killed == max(2, TRIALS // 2)
    assert tally.resumes_checked >= 1 and tally.stale_takeovers >= 1


@pytest.mark.skipif(not _has_activation_offload(),
                    reason="lightning_nvme.callbacks.NVMeActivationOffload is not on this branch yet (issue: "
                           "activation offload is built in another session); the mid-activation-offload phase runs "
                           "once it lands")
def test_kill9_mid_activation_offload(jobs, tmp_path):
    ref = _reference(jobs, str(tmp_path / "reference"), activations=True)
    assert sum(ref.counts["activation"].values()) > 0, "the activation callback wrote nothing to the store"
    run_chain(jobs, ref, str(tmp_path / "chain"), "activation", TRIALS, activations=True)


# ---- targeted kills at the two riskiest instants ---------------------------------------------------------------
def test_kill9_mid_removal_of_previous_checkpoint(jobs, reference, tmp_path):
    """ModelCheckpoint(save_top_k=1) deletes the previous checkpoint after committing the new one: one file, one
    unlink. Killed just before it, the previous checkpoint is still whole (and exact) under its name."""
    root = str(tmp_path / "run")
    kill = {"event": "os.remove", "during": "remove_checkpoint", "nth": 1}
    _, rc = jobs.run(cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS, kill=kill))
    assert rc == KILLED, _log(root)
    last_step, hidden = checkpoint_state(root, reference)  # every visible checkpoint loads and is exact
    assert last_step == STEPS  # last.ckpt is still epoch 0's: the removal came before its update
    assert "epoch=0-step=3.ckpt" in os.listdir(cw.paths(root)["ckpts"])  # verified exact by checkpoint_state
    _, rc = jobs.run(cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS, resume=True))
    assert rc == 0, _log(root)
    assert params_equal(torch.load(cw.paths(root)["final"]), reference.final)
    assert checkpoint_state(root, reference)[0] == EPOCHS * STEPS


def test_kill9_after_the_run_released_its_store(jobs, reference, tmp_path):
    """A kill from outside at a random time lands after ``fit`` returned when the run ends sooner than drawn (a
    busy machine's speed varies): the store is closed and its lock file emptied, so no pid is named;
    ``last.ckpt`` is the final one and the next run, with nothing left to train, ends
    bitwise equal to the reference."""
    root = str(tmp_path / "run")
    _, rc = jobs.run(cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS,
                                 kill={"phase": "exit", "at": 1, "torn": None}))
    assert rc == KILLED, _log(root)
    assert os.path.getsize(lock_path(root)) == 0, "a released store lock still names a pid"
    assert lock_holder(root) is None
    assert checkpoint_state(root, reference) == (FINAL_STEP, 0)
    _, rc = jobs.run(cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS, resume=True))
    assert rc == 0, _log(root)
    assert params_equal(torch.load(cw.paths(root)["final"]), reference.final)
    assert checkpoint_state(root, reference) == (FINAL_STEP, 0)


COMMIT_STEPS = pytest.mark.parametrize("kill,expected_last", [
    # the second save's fill of its staged file (each save opens it 4 times: zipfile and record_offsets read it, the
    # fill writes it, the commit fsyncs it): killed with the file staged, its state records reserved, not yet filled
    ({"event": "open", "match": "/.last.ckpt.tmp-", "nth": 4 + 3}, STEPS),
    ({"event": "os.rename", "match": "/last.ckpt', -1", "nth": 2}, STEPS),  # just before the file's switch
    ({"event": "shutil.rmtree", "match": "/.last.ckpt.optim.tmp-", "nth": 2}, 2 * STEPS),  # 2nd save's temp state
], ids=["before-fill", "before-switch", "mid-sweep"])


def kill_and_resume(jobs: cw.Jobs, ref: Reference, root: str, kill: dict, expected_last: int | None) -> None:
    """Kill a run at ``kill`` (during ``save_checkpoint``): ``last.ckpt`` is then the one of ``expected_last``
    (every visible checkpoint exact); the resumed run ends bitwise equal to ``ref`` with no leftovers."""
    _, rc = jobs.run(cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS, kill={**kill, "during": "save_checkpoint"}))
    assert rc == KILLED, _log(root)
    assert checkpoint_state(root, ref)[0] == expected_last
    _, rc = jobs.run(cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS, resume=True))
    assert rc == 0, _log(root)
    assert params_equal(torch.load(cw.paths(root)["final"]), ref.final)
    assert checkpoint_state(root, ref) == (FINAL_STEP, 0)


@COMMIT_STEPS
def test_kill9_at_each_commit_step(jobs, reference, tmp_path, kill, expected_last):
    """Targeted kills at the steps of the commit protocol (``lightning_nvme.checkpoint.paired``) while epoch 1's
    save replaces ``last.ckpt``: before its optimizer state is renamed into place, just before the file's
    ``os.replace``, and while the previous save's state is deleted. ``last.ckpt`` is then the old checkpoint or
    the new one, complete with its own save's state, and the resumed run ends bitwise equal."""
    kill_and_resume(jobs, reference, str(tmp_path / "run"), kill, expected_last)


def test_kill9_between_fallback_renames_is_recovered(jobs, reference, tmp_path):
    """A checkpoint file replaces an existing file with one ``os.replace``; only replacing a directory (a sharded
    checkpoint that Lightning's FSDP or DeepSpeed strategy saved at that path) takes ``RENAME_EXCHANGE``, and
    without it (e.g. NFS) two renames: the old directory aside, then the new file in. Killed between them:
    ``last.ckpt`` is absent, the directory complete under the hidden ``.last.ckpt.old``, and ``atomic.recover``
    (run by the next save or load of that path) puts it back; the run resumes bitwise and saves over it.

    Known limit, pinned here: Lightning resolves ``ckpt_path="last"`` before the strategy runs, so on such a
    filesystem call ``lightning_nvme.fs.atomic.recover(<dir>/last.ckpt)`` before ``fit``."""
    from lightning_nvme.checkpoint import paired
    from lightning_nvme.fs.atomic import recover

    root = str(tmp_path / "run")
    ckpts, last = cw.paths(root)["ckpts"], cw.paths(root)["last"]
    _, rc = jobs.run(cw.job_spec(root, epochs=1, steps_per_epoch=STEPS))
    assert rc == 0, _log(root)
    # Resumed from a copy of last.ckpt (one file, its state inside), ModelCheckpoint saves last.ckpt again at that
    # path, where another strategy's sharded checkpoint (a directory) now is.
    resume_from = str(tmp_path / "resume.ckpt")
    shutil.copyfile(last, resume_from)
    paired.remove(last)
    os.makedirs(os.path.join(last, "checkpoint"))
    torch.save({"global_step": 0}, os.path.join(last, "checkpoint", "meta.pt"))
    before = _tree_state(last)
    kill = {"event": "os.rename", "match": "/last.ckpt', -1", "during": "save_checkpoint", "nth": 1}
    _, rc = jobs.run(cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS, resume=True, kill=kill, exchange=False,
                                 ckpt_path=resume_from))
    assert rc == KILLED, _log(root)
    assert "last.ckpt" not in os.listdir(ckpts)
    assert _tree_state(os.path.join(ckpts, ".last.ckpt.old")) == before  # the directory, complete, aside
    assert checkpoint_state(root, reference)[0] is None  # the newer epoch=1 checkpoint is visible and exact
    assert ModelCheckpoint(dirpath=ckpts)._find_last_checkpoints(None) == set()  # the limit above
    recover(last)
    assert _tree_state(last) == before
    pid, rc = jobs.run(cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS, resume=True, exchange=False,
                                   ckpt_path=resume_from))
    assert rc == 0, _log(root)
    assert [e["global_step"] for e in cw.read_events(root) if e["event"] == "started" and e["pid"] == pid] == [STEPS]
    assert params_equal(torch.load(cw.paths(root)["final"]), reference.final)
    assert checkpoint_state(root, reference) == (FINAL_STEP, 0) and os.path.isfile(last)


# ---- a live run's store is never touched ------------------------------------------------------------------------
def _tree_state(directory: str) -> dict[str, tuple[str, int, int]]:
    """Every file under ``directory``: (sha256, size, mtime_ns)."""
    out = {}
    for dirpath, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            st = os.stat(path)
            out[os.path.relpath(path, directory)] = (digest, st.st_size, st.st_mtime_ns)
    return out


def test_live_store_is_refused_and_untouched(jobs, reference, tmp_path):
    """While a run is alive (paused after step 7, its I/O fenced), a second trainer on the same store_dir, in
    this process and in another process launched exactly like the first, fails with StoreLockedError naming
    the live pid; no file of the live run changes, and the live run then finishes bitwise equal."""
    from lightning.pytorch import Trainer
    from models import MLP

    from lightning_nvme import NVMeOffloadStrategy
    from lightning_nvme.store import StoreLockedError

    root, release = str(tmp_path / "live"), str(tmp_path / "release")
    spec = cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS, hold={"step": 7, "file": release})
    pid = jobs.start(spec)
    try:
        deadline = time.monotonic() + 60
        while not any(e["event"] == "holding" and e["pid"] == pid for e in cw.read_events(root)):
            assert cw._alive(pid) and time.monotonic() < deadline, f"live run did not reach its pause:\n{_log(root)}"
            time.sleep(0.01)
        store_dir = cw.paths(root)["store"]
        before = _tree_state(root)
        assert lock_holder(root) == str(pid)

        second = Trainer(default_root_dir=str(tmp_path / "second"), accelerator="cpu", max_epochs=1,
                         strategy=NVMeOffloadStrategy(store_dir=store_dir, chunk_bytes=16 << 10, io_chunk_bytes=8 << 10,
                                                      staging_bytes=64 << 10, min_free_bytes=0),
                         limit_train_batches=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
        with pytest.raises(StoreLockedError, match=rf"pid {pid}\b"):
            second.fit(MLP())

        twin_pid, rc = jobs.run(dict(spec, hold=None, resume=True))
        assert rc == 1
        twin_errors = [e for e in cw.read_events(root) if e["pid"] == twin_pid and e["event"] == "failed"]
        assert twin_errors and "StoreLockedError" in twin_errors[0]["error"] and f"pid {pid}" in twin_errors[0]["error"]
        after = _tree_state(root)
        changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        assert changed <= {"events.jsonl", "log.txt"}, f"a second run changed the live run's files: {changed}"
    finally:
        open(release, "w").close()
    assert jobs.wait(pid) == 0, _log(root)
    assert params_equal(torch.load(cw.paths(root)["final"]), reference.final)
    assert checkpoint_state(root, reference)[0] == FINAL_STEP


def test_kill9_with_forked_dataloader_workers_restarts_at_once(jobs, reference, tmp_path):
    """DataLoader workers are forked, so they share the run's open files, the store lock's included. Killed
    mid-epoch, the run leaves orphaned workers that live on until they notice (seconds later); they must not
    keep the lock, or an immediate restart would be refused in the dead run's name."""
    root = str(tmp_path / "run")
    at = sum(n for e, n in reference.counts["writeback"].items() if e < 2) + reference.counts["writeback"][2] // 2
    spec = cw.job_spec(root, epochs=EPOCHS, steps_per_epoch=STEPS, loader_workers=2,
                       kill={"phase": "writeback", "at": at, "torn": None})
    pid, rc = jobs.run(spec)
    assert rc == KILLED, _log(root)
    workers = {e["pid"] for e in cw.read_events(root) if e["event"] == "loader_worker"}
    orphans = [w for w in workers if cw._alive(w)]
    try:
        assert orphans, "no DataLoader worker outlived the kill: the case this test is about did not arise"
        resumed, rc = jobs.run(dict(spec, kill=None, resume=True))  # at once, while the orphans still run
        assert rc == 0, _log(root)
        started = [e for e in cw.read_events(root) if e["event"] == "started" and e["pid"] == resumed]
        assert started[0]["took_over_stale"] and started[0]["global_step"] == 2 * STEPS
        assert params_equal(torch.load(cw.paths(root)["final"]), reference.final)
    finally:
        deadline = time.monotonic() + 15
        while any(cw._alive(w) for w in orphans) and time.monotonic() < deadline:
            time.sleep(0.1)
        for w in orphans:  # never leave a process behind
            if cw._alive(w):
                os.kill(w, signal.SIGKILL)
