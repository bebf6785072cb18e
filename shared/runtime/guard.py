"""What keeps a run safe from its surroundings: one run per directory, preemption, hangs.

- `RunLock(run_dir, checkpoint_dir)`: a `LOCK` file naming the pid and host of the run that
  holds the directory. A second run in the same directory is refused with that name; a lock
  left by a dead process on this host is taken over. Only process 0 of a multi-process run
  locks. A checkpoint directory elsewhere (`--checkpoint_dir`, e.g. gs:// or s3://) gets its
  own `LOCK` object, taken through tensorstore's kvstore by a conditional write (created only
  if absent; taken over only if unchanged since it was read), with the same rules: another
  host's lock is never taken over (delete it by hand if that run is gone). The gcs driver
  sends the condition; the fake-gcs-server emulator does not honour it (tests use file and s3).
- `StopSignals()`: SIGTERM (what schedulers send before they preempt), SIGINT (Ctrl-C) and
  SIGUSR1 (what SLURM sends with `--signal`) set a flag; the train loop finishes its
  current step, saves a checkpoint and exits with `EXIT_PREEMPTED`. A second signal exits
  at once, naming the last checkpoint (exit `EXIT_PREEMPTED`: resume from it) or saying that
  none was saved (exit 128 + the signal's number). `requested()` is agreed by every process of
  a multi-process run, so they all stop at the same step.
  Before the loop's first step (`starting`: installed by the command line's parse, shared/cli.py,
  until `Run.begin`) nothing is trained, so a signal exits at once, whatever runs (the data, the
  first compilation): exit `EXIT_PREEMPTED` when the run continues a checkpoint (which the line
  names), else 128 + the signal's number; a run directory this process created and left empty
  is removed. (Before the parse, the train.py's imports, SIGINT has its default action: the
  process ends, nothing written.)
- `Watchdog(seconds, run_dir)`: a thread that aborts the process with `EXIT_HUNG` when no
  training step has completed for `seconds` (a stuck collective, a wedged device), after
  writing every thread's Python stack to stderr and to `<run_dir>/hang-<pid>.txt`. It is
  armed by the first `beat()`, so the first step's compilation is not counted.

Both immediate exits (a second signal, the watchdog) release the run lock first, so a requeued
run on another host is not refused by the lock of a process that is gone.

Exit codes: 75 (`EXIT_PREEMPTED`: stopped on a signal, checkpoint saved; requeue and
resume) and 70 (`EXIT_HUNG`: no progress; requeue). launch/ maps both to a requeue.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time

import jax
import numpy as np

from shared.storage import objstore
from shared.errors import StencilError

EXIT_PREEMPTED = 75
EXIT_HUNG = 70


class RunLockError(StencilError, RuntimeError):
    """The run directory (or checkpoint directory) is held by another run."""


_HELD: list = []  # this process's locks: released before an os._exit too (a second signal, the watchdog)


def _exit_now(code: int) -> None:
    for lock in list(_HELD):
        lock.release()
    os._exit(code)


STOP: StopSignals | None = None  # the process's own, from the command line's parse (cli.py) to the run's end


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """Holds `<run_dir>/LOCK` (and `<checkpoint_dir>/LOCK` if it lies elsewhere) for this process
    (process 0 only) until `release()`."""

    def __init__(self, run_dir: str, checkpoint_dir: str | None = None):
        self.path = os.path.join(run_dir, "LOCK")
        self.held = False
        self.store_lock = None
        if jax.process_index() != 0:
            return
        self._take(run_dir)
        if checkpoint_dir and os.path.abspath(checkpoint_dir) != os.path.abspath(os.path.join(run_dir, "checkpoints")):
            try:
                self.store_lock = StoreLock(checkpoint_dir)
            except BaseException:
                self.release()
                raise

    def _take(self, run_dir: str) -> None:
        self.created = None if os.path.isdir(run_dir) else run_dir  # removed on release if it is still empty
        os.makedirs(run_dir, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if not held_by_another(holder):
                    # unreadable, left by a dead process on this host, or this process's own (an earlier
                    # main() in the same process, e.g. a notebook): take it over, atomically
                    stale = f"{self.path}.stale-{os.getpid()}"
                    try:
                        os.rename(self.path, stale)
                        os.remove(stale)
                    except FileNotFoundError:
                        pass  # another run took it over first; the next O_EXCL decides
                    continue
                raise in_use(run_dir, holder)
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            _HELD.append(self)
            atexit.register(self.release)  # also when the run stops on an error before its loop
            return
        raise RunLockError(f"could not take {self.path}: another run keeps taking it")

    def _holder(self) -> dict | None:
        return lock_holder(self.path)

    @staticmethod
    def refuse_if_held(run_dir: str) -> None:
        """Raise RunLockError if another live run holds `<run_dir>/LOCK`; reads only (a run checks this before
        anything else, so a second run is told so first, and a refused run writes nothing)."""
        holder = lock_holder(os.path.join(run_dir, "LOCK"))
        if jax.process_index() == 0 and held_by_another(holder):
            raise in_use(run_dir, holder)

    def release(self) -> None:
        if self.store_lock is not None:
            self.store_lock.release()
            self.store_lock = None
        if self.held and (self._holder() or {}).get("pid") == os.getpid():
            os.remove(self.path)
            if getattr(self, "created", None):  # a run that stopped before writing anything leaves no directory
                try:
                    os.rmdir(self.created)
                except OSError:
                    pass  # not empty: the run wrote in it
        self.held = False
        if self in _HELD:
            _HELD.remove(self)


def lock_holder(path: str) -> dict | None:
    """The holder a LOCK file names ({"pid", "host", "since"}), or None when there is none or it is unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def held_by_another(holder: dict | None) -> bool:
    """Whether a lock so held is another live run's: an unreadable lock, one left by a dead process on this host
    or this process's own (an earlier main() in the same process, e.g. a notebook) can be taken over; a lock on
    another host never is, whatever its pid."""
    if holder is None:
        return False
    me = socket.gethostname(), os.getpid()
    if holder.get("host") != me[0]:
        return True
    return _alive(int(holder.get("pid", -1))) and holder.get("pid") != me[1]


def in_use(run_dir: str, holder: dict) -> RunLockError:
    return RunLockError(
        f"{run_dir} is in use by pid {holder.get('pid')} on {holder.get('host')} (since "
        f"{holder.get('since')}); one run per directory. If that run is gone (another host, a "
        f"container that was killed), delete {os.path.join(run_dir, 'LOCK')}"
    )


class StoreLock:
    """`<location>/LOCK` as an object in any storage tensorstore reaches (shared/storage/checkpoint's
    locations), created and taken over by conditional writes. Held until `release()`."""

    def __init__(self, location: str):
        self.location, self.url = location, objstore.join(location, "LOCK")
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):
            try:
                r = objstore.read_key(location, "LOCK")
                holder = None
                if r.state == "value":
                    try:
                        holder = json.loads(r.value)
                    except ValueError:
                        holder = None  # unreadable: taken over, as a local one
                    here = holder is not None and holder.get("host") == me["host"]
                    if holder is not None and not (
                        here and (not _alive(int(holder.get("pid", -1))) or holder["pid"] == me["pid"])
                    ):
                        raise RunLockError(
                            f"{location} is in use by pid {holder.get('pid')} on {holder.get('host')} (since "
                            f"{holder.get('since')}); one run per checkpoint directory. If that run is gone, "
                            f"delete {self.url}"
                        )
                # absent, or stale: write ours only if it is still what was read (a conditional write)
                got = objstore.write_key(location, "LOCK", json.dumps(me), if_generation=r.stamp.generation)
            except ValueError as e:
                raise RunLockError(f"cannot take the lock {self.url}: {e}") from e
            if got.generation:  # an empty generation: the condition failed, another run wrote first
                self.generation = got.generation
                _HELD.append(self)
                atexit.register(self.release)
                return
        raise RunLockError(f"could not take {self.url}: another run keeps taking it")

    def release(self) -> None:
        if self in _HELD:
            _HELD.remove(self)
            try:
                objstore.write_key(self.location, "LOCK", None, if_generation=self.generation)  # only if still ours
            except ValueError as e:
                print(f"warning: could not release {self.url}: {e}", file=sys.stderr, flush=True)


class StopSignals:
    """Turns SIGTERM, SIGINT and SIGUSR1 into a request to stop after the current step (or, `starting`, before
    the first step, into an exit at once)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, starting: bool = False):
        self.signal: int | None = None
        self.starting = starting  # before the loop's first step: nothing to save, a signal exits at once
        self.resume_from: str | None = None  # the checkpoint the run continues, once found (Run)
        self.last_saved = lambda: "none"  # the run's last complete checkpoint, "none" if none (Run.begin)
        self._previous = {}
        self.install()

    def install(self) -> None:
        """(Re)take the signals: a library may have set its own handlers since (jax.distributed sets SIGTERM's)."""
        if threading.current_thread() is threading.main_thread():  # handlers only install there
            for s in self.SIGNALS:
                previous = signal.signal(s, self._handle)
                self._previous.setdefault(s, previous)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.starting:
            if self.resume_from:
                say(
                    f"\n{name} before the first step: nothing trained or saved; the run still resumes from "
                    f"{self.resume_from} (exit {EXIT_PREEMPTED})"
                )
                _exit_now(EXIT_PREEMPTED)
            say(f"\n{name} before the first step: nothing trained or saved (exit {128 + signum})")
            _exit_now(128 + signum)
        if self.signal is not None:
            saved = self.last_saved()
            if saved == "none":
                say(f"\nsecond signal ({name}): exiting now; no checkpoint was saved (exit {128 + signum})")
                _exit_now(128 + signum)
            say(
                f"\nsecond signal ({name}): exiting now, without saving this step; the last checkpoint, {saved}, "
                f"is intact (exit {EXIT_PREEMPTED}: resume from it)"
            )
            _exit_now(EXIT_PREEMPTED)
        self.signal = signum
        say(
            f"\n{name}: finishing this step, then saving a checkpoint and exiting with code {EXIT_PREEMPTED} "
            f"(a second signal exits at once)"
        )

    def requested(self) -> bool:
        """True when any process got a signal (all processes agree: one small all-gather per call)."""
        mine = self.signal is not None
        if jax.process_count() == 1:
            return mine
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.int32(mine))))

    def restore(self) -> None:
        global STOP
        for s, h in self._previous.items():
            if h is not None:  # None: a handler set outside Python, which cannot be put back from here
                signal.signal(s, h)
        self._previous = {}
        if STOP is self:
            STOP = None


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Watchdog:
    """Aborts the process when `beat()` has not been called for `seconds` (0 = off)."""

    def __init__(self, seconds: float, run_dir: str):
        self.seconds, self.run_dir = float(seconds), run_dir
        self._last: float | None = None
        self._done = threading.Event()
        self._thread = None
        if self.seconds > 0:
            self._thread = threading.Thread(target=self._watch, name="stencil-watchdog", daemon=True)
            self._thread.start()

    def beat(self) -> None:
        self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._done.wait(min(self.seconds / 4, 5.0)):
            if self._last is not None and time.monotonic() - self._last > self.seconds:
                self._abort()

    def _abort(self) -> None:
        msg = (
            f"\nwatchdog: no training step completed for {self.seconds:.0f} s (watchdog_s); aborting with "
            f"exit code {EXIT_HUNG}. Every thread's stack follows"
        )
        path = os.path.join(self.run_dir, f"hang-{os.getpid()}.txt")
        try:
            with open(path, "w") as f:
                f.write(msg.strip() + "\n")
                faulthandler.dump_traceback(file=f, all_threads=True)
            msg += f" (also in {path})"
        except OSError as e:
            msg += f" (could not write {path}: {e})"
        print(msg + ":", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        _exit_now(EXIT_HUNG)

    def stop(self) -> None:
        self._done.set()
