"""A training run that the crash tests kill with SIGKILL, and the harness that launches it.

One *job* is one Lightning ``fit`` with ``strategy="nvme_offload"`` of the small ``MLP`` from
``tests/models.py``, checkpointing at every epoch end with ``ModelCheckpoint(save_top_k=1,
save_last=True)`` (so each epoch commits a new top-k checkpoint, overwrites ``last.ckpt`` and removes
the previous top-k one). A job either starts from scratch or resumes with ``ckpt_path="last"``.

Where it dies: the job counts the events of three phases and SIGKILLs itself at the ``at``-th event
of one phase (optionally after writing only part of that write: a torn write):

- ``writeback``  every ``pwrite`` to the store file of regions of the offloaded optimizer (from the
  store's I/O threads, while the training loop runs on);
- ``checkpoint`` every file-system call made while ``save_checkpoint``/``remove_checkpoint`` run:
  ``open``, ``mkdir``, ``pwrite``, ``ftruncate``, ``fsync``, ``rename``, ``renameat2``, ``unlink``, the
  ``ioctl`` of each reflink clone... —
  i.e. every step of the commit protocol of ``lightning_nvme.checkpoint.paired`` (optimizer files into a
  temp dir, its rename, the file's temp write and switch, the sweep of the replaced save's state);
- ``activation`` every ``pwrite`` to an ``activations*`` region (``NVMeActivationOffload``);
- ``params``     every ``pwrite`` to a ``params/*`` region: a block's parameters written back with
  ``offload_params=True`` (``param_kill_worker.py`` arms it mid-step);
- ``copy``       every ``pwrite`` of a background checkpoint's copy (``copy="background"``): into a hidden
  ``.optim/.<id>.tmp-PID/`` file after the save returned, from the copy thread or from a training write that had
  to copy its region first;
- ``commit``     every file-system call of the copy thread (``copy="background"``): the fsyncs, renames and
  deletions of its commits and of the removals ``ModelCheckpoint`` asked for while it ran;
- ``exit``       once, when ``trainer.fit`` has returned (the store closed, its lock released), before the job writes
  its final parameters: where a kill from outside at a random time lands when the run ends sooner than drawn.

The test can also kill a job from outside at a random delay. The job writes JSON lines to
``<root>/events.jsonl``: ``started`` (pid, step and checkpoint it resumed from, whether it took over
a stale store lock), and ``done`` (event counts per epoch, which the test uses to draw kill points).

Why a fork server: importing torch and Lightning costs ~5 s of CPU per process, which would eat the
suite's budget. ``serve`` imports them once and forks one child per job; a child is a separate
process with its own pid, file descriptors and locks, and the server never trains, opens a store
or touches a checkpoint, so nothing of one job outlives its SIGKILL except what it left on disk.
``python crash_worker.py run SPEC_JSON`` runs one job in a fresh interpreter instead.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
STORE_FILE = "store-rank0.bin"
PHASES = ("writeback", "checkpoint", "activation", "params", "copy", "commit", "exit")
COPY_THREAD = "lightning-nvme-checkpoint-copy"  # lightning_nvme.checkpoint.copy.background
# File-system audit events counted as checkpoint events (pwrite/fsync have no audit event: wrapped).
CHECKPOINT_AUDIT_EVENTS = {"open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree",
                           "os.truncate", "ctypes.dlsym"}


def job_spec(root: str, *, epochs: int, steps_per_epoch: int = 3, resume: bool = False,
             kill: dict[str, Any] | None = None, exchange: bool = True, snapshots: bool = False,
             hold: dict[str, Any] | None = None, activations: bool = False, recover_last: bool = False,
             loader_workers: int = 0, stripes: int = 1, kill_stripe: int = 0, copy: str = "auto",
             ckpt_path: str | None = None) -> dict:
    """``kill``: ``{"phase": ..., "at": n, "torn": fraction or None}``; ``hold``: ``{"step": n, "file": path}``
    pauses the job after step ``n`` (I/O fenced) until ``file`` exists. ``stripes`` > 1 stripes the store over that
    many directories (``store``, ``store-s1``...) with a 4 KiB unit; ``writeback`` events then count the writes to
    stripe ``kill_stripe``'s file only. ``copy``: the strategy's ``checkpoint_copy``. ``ckpt_path``: resume from this
    checkpoint instead of ``"last"`` (with ``resume``)."""
    return dict(root=root, epochs=epochs, steps_per_epoch=steps_per_epoch, resume=resume, kill=kill,
                exchange=exchange, snapshots=snapshots, hold=hold, activations=activations,
                recover_last=recover_last, loader_workers=loader_workers, stripes=stripes, kill_stripe=kill_stripe,
                copy=copy, ckpt_path=ckpt_path)


def paths(root: str) -> dict[str, str]:
    return {"ckpts": os.path.join(root, "ckpts"), "store": os.path.join(root, "store"),
            "events": os.path.join(root, "events.jsonl"), "final": os.path.join(root, "final.pt"),
            "snapshots": os.path.join(root, "snapshots"), "last": os.path.join(root, "ckpts", "last.ckpt")}


def read_events(root: str) -> list[dict]:
    try:
        with open(paths(root)["events"]) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by the kill
            pass
    return out


# ---- the job (runs in its own process) -----------------------------------------------------------------
class _Injector:
    """Counts phase events and SIGKILLs this process at the chosen one."""

    def __init__(self, kill: dict[str, Any] | None) -> None:
        self.kill = kill
        self.lock = threading.Lock()
        self.total = {p: 0 for p in PHASES}
        self.by_epoch: dict[str, dict[int, int]] = {p: {} for p in PHASES}
        self.epoch = -1
        self.in_checkpoint = False
        self.during: str | None = None  # "save_checkpoint" or "remove_checkpoint" while one runs
        self.main = threading.main_thread()
        self.store_path: str | None = None
        self.store = None  # the live FlatStore, for region lookups
        self.root: str | None = None  # where to record the instant of the kill
        self.real_pwrite = os.pwrite
        self._busy = threading.local()

    def hit(self, phase: str, write: tuple[int, Any, int] | None = None, what: str = "") -> None:
        with self.lock:
            self.total[phase] += 1
            n = self.total[phase]
            self.by_epoch[phase][self.epoch] = self.by_epoch[phase].get(self.epoch, 0) + 1
        if self.kill and self.kill.get("phase") == phase and n == self.kill["at"]:
            torn = self.kill.get("torn")
            if self.root:
                _emit(self.root, "dying", phase=phase, at=what, torn=bool(write is not None and torn))
            if write is not None and torn:
                self._torn_write(*write, torn)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)

    def _torn_write(self, fd: int, data: Any, offset: int, fraction: float) -> None:
        import fcntl

        mv = memoryview(data).cast("B")
        cut = int(len(mv) * fraction)
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            cut -= cut % 4096  # O_DIRECT takes whole blocks only
        if cut:
            self.real_pwrite(fd, mv[:cut], offset)

    def _store_phase(self, offset: int) -> str:
        store = self.store
        if store is not None and len(store.paths) == 1:  # a stripe file's offsets are not the layout's
            for region in list(store.layout.regions.values()):
                if region.offset <= offset < region.end:
                    if region.name.startswith("params/"):
                        return "params"
                    return "activation" if region.name.startswith("activations") else "writeback"
        return "writeback"

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if self.store_path is not None and target == self.store_path:
            self.hit(self._store_phase(offset), (fd, data, offset), "pwrite store")
        elif self._counting():
            self.hit("checkpoint", (fd, data, offset), f"pwrite {_norm(target)}")
        elif ".optim/." in target:  # a background copy, after its save returned
            self.hit("copy", (fd, data, offset), f"copy {_norm(target)}")
        return self.real_pwrite(fd, data, offset)

    def _counting(self) -> bool:
        return self.in_checkpoint and threading.current_thread() is self.main and not getattr(self._busy, "on", False)

    def _in_copy_thread(self) -> bool:
        return threading.current_thread().name == COPY_THREAD and not getattr(self._busy, "on", False)

    def audit(self, event: str, args: tuple) -> None:
        if event in CHECKPOINT_AUDIT_EVENTS and self._counting():
            self._busy.on = True
            try:
                self._targeted(event, args)
                self.hit("checkpoint", what=f"{event} {_short(args)}")
            finally:
                self._busy.on = False
        elif event in CHECKPOINT_AUDIT_EVENTS and self._in_copy_thread():
            self._busy.on = True
            try:
                self.hit("commit", what=f"{event} {_short(args)}")
            finally:
                self._busy.on = False

    def _targeted(self, event: str, args: tuple) -> None:
        """``kill={"event": "os.rename", "match": "/last.ckpt", "during": "save_checkpoint", "nth": n}``: die
        just before the n-th ``event`` whose arguments contain ``match``, made inside ``during``."""
        kill = self.kill
        if not kill or kill.get("event") != event or kill.get("during", self.during) != self.during:
            return
        if kill.get("match", "") not in repr(args):
            return
        kill["seen"] = kill.get("seen", 0) + 1
        if kill["seen"] == kill["nth"]:
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)

    def install(self) -> None:
        real_fsync, real_fdatasync = os.fsync, os.fdatasync

        def fsync(fd):
            if self._counting() or self._in_copy_thread():
                self.hit("checkpoint" if self._counting() else "commit", what=f"fsync {_fd_name(fd)}")
            return real_fsync(fd)

        def fdatasync(fd):
            if self._counting() or self._in_copy_thread():
                self.hit("checkpoint" if self._counting() else "commit", what=f"fdatasync {_fd_name(fd)}")
            return real_fdatasync(fd)

        import fcntl

        real_ioctl = fcntl.ioctl

        def ioctl(fd, request, *args):  # FICLONERANGE of a reflink checkpoint (lightning_nvme.fs.reflink)
            if self._counting():
                try:
                    target = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    target = "?"
                self._targeted("fcntl.ioctl", (target,))
                self.hit("checkpoint", what=f"ioctl {_norm(target)}")
            return real_ioctl(fd, request, *args)

        os.pwrite, os.fsync, os.fdatasync, fcntl.ioctl = self.pwrite, fsync, fdatasync, ioctl
        sys.addaudithook(self.audit)


def _norm(path: str) -> str:
    """A file's name without directory, pid or step numbers, for the kill-site tally."""
    return re.sub(r"(tmp-|step=|epoch=)\d+", r"\1N", os.path.basename(path))


def _fd_name(fd: int) -> str:
    try:
        return _norm(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return "?"


def _short(args: tuple) -> str:
    return " -> ".join(_norm(str(a)) for a in args[:2] if isinstance(a, (str, bytes)))


def _emit(root: str, event: str, **fields: Any) -> None:
    with open(paths(root)["events"], "a") as f:
        f.write(json.dumps({"event": event, "pid": os.getpid(), "t": time.time(), **fields}) + "\n")


def run_job(spec: dict) -> None:
    import shutil

    import torch
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    import lightning_nvme  # noqa: F401
    from lightning_nvme import NVMeOffloadStrategy
    from lightning_nvme.fs import atomic

    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    from models import MLP

    torch.set_num_threads(1)
    root = spec["root"]
    p = paths(root)
    inj = _Injector(spec["kill"])
    store_dirs = [p["store"]] + [f"{p['store']}-s{i}" for i in range(1, spec.get("stripes", 1))]
    inj.store_path = os.path.join(store_dirs[spec.get("kill_stripe", 0)], STORE_FILE)
    inj.root = root
    inj.install()
    if not spec["exchange"]:
        atomic._exchange = lambda a, b: False  # the fallback commit of filesystems without RENAME_EXCHANGE

    for name in ("save_checkpoint", "remove_checkpoint"):
        original = getattr(NVMeOffloadStrategy, name)

        def wrapped(self, *a, _original=original, _name=name, **k):
            inj.in_checkpoint, inj.during = True, _name
            try:
                return _original(self, *a, **k)
            finally:
                inj.in_checkpoint, inj.during = False, None

        setattr(NVMeOffloadStrategy, name, wrapped)

    class Probe(Callback):
        def on_train_start(self, trainer, pl_module):
            store = trainer.strategy.nvme_store
            inj.store = store
            _emit(root, "started", global_step=trainer.global_step, epoch=trainer.current_epoch,
                  ckpt_path=trainer.ckpt_path, took_over_stale=store._lock.took_over_stale)

        def on_train_epoch_start(self, trainer, pl_module):
            inj.epoch = trainer.current_epoch
            if spec["snapshots"] and trainer.current_epoch > 0:
                self._snapshot(trainer)

        def on_train_end(self, trainer, pl_module):
            if spec["snapshots"]:
                self._snapshot(trainer)

        def _snapshot(self, trainer):  # last.ckpt and its optimizer state, as <snapshots>/step-N/last.ckpt(.optim)
            copy = getattr(trainer.strategy, "_background", None)
            if copy is not None:  # a background save of last.ckpt commits once its copy is done
                copy.wait()
            dst = os.path.join(p["snapshots"], f"step-{trainer.global_step}")
            os.makedirs(dst)
            shutil.copy2(p["last"], os.path.join(dst, "last.ckpt"))
            if os.path.isdir(p["last"] + ".optim"):  # a version-2 checkpoint; one file holds its state inside
                shutil.copytree(p["last"] + ".optim", os.path.join(dst, "last.ckpt.optim"))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            hold = spec["hold"]
            if hold and trainer.global_step == hold["step"]:
                trainer.strategy.nvme_store.fence(durable=True)
                _emit(root, "holding", global_step=trainer.global_step)
                deadline = time.monotonic() + 120
                while not os.path.exists(hold["file"]):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"hold file {hold['file']} never appeared")
                    time.sleep(0.02)

    callbacks: list[Callback] = [Probe(), ModelCheckpoint(dirpath=p["ckpts"], save_top_k=1, save_last=True,
                                                          every_n_epochs=1)]
    if spec["activations"]:
        from lightning_nvme.callbacks import NVMeActivationOffload

        callbacks.append(NVMeActivationOffload(scope="all", min_bytes=1024, keep_last=0, min_segment_bytes=1 << 20,
                                               write_inflight_bytes=1 << 20, prefetch_bytes=1 << 20))
    strategy = NVMeOffloadStrategy(store_dir=store_dirs if len(store_dirs) > 1 else p["store"], chunk_bytes=16 << 10,
                                   io_chunk_bytes=8 << 10, staging_bytes=64 << 10, io_workers=2, min_free_bytes=0,
                                   stripe_bytes=4 << 10, checkpoint_copy=spec.get("copy", "auto"))
    class Model(MLP):
        def train_dataloader(self):
            loader = super().train_dataloader()
            if not spec["loader_workers"]:
                return loader
            return DataLoader(loader.dataset, batch_size=loader.batch_size, shuffle=False,
                              num_workers=spec["loader_workers"], multiprocessing_context="fork",
                              worker_init_fn=lambda _: _emit(root, "loader_worker"))

    model = Model(batch_size=32 if spec["activations"] else 8)
    trainer = Trainer(default_root_dir=root, strategy=strategy, accelerator="cpu", max_epochs=spec["epochs"],
                      limit_train_batches=spec["steps_per_epoch"], gradient_clip_val=0.5, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                      num_sanity_val_steps=0)
    if spec["recover_last"]:
        atomic.recover(p["last"])
    trainer.fit(model, ckpt_path=(spec.get("ckpt_path") or "last") if spec["resume"] else None)
    inj.hit("exit", what="fit returned")  # the store is closed and its lock released: a kill from outside can land here
    params = {n: t.detach().clone() for n, t in model.named_parameters()}
    torch.save(params, p["final"] + ".tmp")
    os.replace(p["final"] + ".tmp", p["final"])
    _emit(root, "done", global_step=trainer.global_step, counts=inj.by_epoch)


def _child(spec: dict) -> int:
    os.makedirs(spec["root"], exist_ok=True)
    log = os.open(os.path.join(spec["root"], "log.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        run_job(spec)
        return 0
    except BaseException as e:  # noqa: BLE001 - the test reads the event and the log
        traceback.print_exc()
        _emit(spec["root"], "failed", error=f"{type(e).__name__}: {e}")
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def serve() -> None:
    """Fork server: one JSON request per stdin line, one JSON reply per stdout line."""
    import lightning.pytorch  # noqa: F401
    import torch

    import lightning_nvme  # noqa: F401

    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    import models  # noqa: F401

    torch.set_num_threads(1)
    out = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "run":
            pid = os.fork()
            if pid == 0:
                os._exit(_child(req["spec"]))
            reply = {"pid": pid}
        elif req["cmd"] == "wait":
            _, status = os.waitpid(req["pid"], 0)
            reply = {"returncode": os.waitstatus_to_exitcode(status)}
        else:
            return
        out.write(json.dumps(reply) + "\n")
        out.flush()


# ---- the harness (runs in the test process) -----------------------------------------------------------
class Jobs:
    """Client of the fork server. ``kill``/``wait`` work on the job's pid; nothing outlives ``close``."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", PL_DISABLE_FORK="1")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.live: set[int] = set()

    def _ask(self, req: dict, timeout: float) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"fork server did not answer {req} within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"fork server exited (rc={self.proc.poll()})")
        return json.loads(line)

    def start(self, spec: dict) -> int:
        pid = self._ask({"cmd": "run", "spec": spec}, timeout=600)["pid"]
        self.live.add(pid)
        return pid

    def wait(self, pid: int, timeout: float = 600) -> int:
        """Exit status of job ``pid`` (negative: killed by that signal). A job still running after
        ``timeout`` is killed, so a hang fails the test instead of blocking it."""
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            self._ask({"cmd": "wait", "pid": pid}, timeout=120)
            self.live.discard(pid)
            raise TimeoutError(f"job {pid} still running after {timeout}s; killed")
        rc = self._ask({"cmd": "wait", "pid": pid}, timeout=120)["returncode"]
        self.live.discard(pid)
        return rc

    def run(self, spec: dict, timeout: float = 600) -> tuple[int, int]:
        pid = self.start(spec)
        return pid, self.wait(pid, timeout)

    def close(self) -> None:
        for pid in list(self.live):
            try:
                os.kill(pid, signal.SIGKILL)
                self._ask({"cmd": "wait", "pid": pid}, timeout=120)
            except (OSError, TimeoutError, RuntimeError):
                pass
        self.live.clear()
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped by the server counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def run_fresh_interpreter(spec: dict, timeout: float = 300) -> int:
    """One job in a new ``python`` (no fork server), for a resume that shares nothing with the server."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "run", json.dumps(spec)], timeout=timeout,
                          env=dict(os.environ, PL_DISABLE_FORK="1"))
    return done.returncode


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    elif sys.argv[1] == "run":
        sys.exit(_child(json.loads(sys.argv[2])))
    else:
        raise SystemExit(f"usage: {sys.argv[0]} serve | run SPEC_JSON")
