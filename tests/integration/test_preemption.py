"""The integration tier of tests/fast/test_preemption.py (Runs that meet their surroundings: preemption signals,
a second run in the same directory, a hung step, and resumes that would silently change the data
(shared/runtime/guard.py, the train loop)): the checks that start real processes or servers, or run long. What
they share with the fast half is imported from it."""

import json
import os
import signal
import subprocess
import sys
import time
import jax
import numpy as np
import pytest
from shared.runtime import guard
from shared.storage import checkpoint
from shared.variant import ROOT
from helpers import losses, wait_for_step
from fast.test_preemption import END_ONLY, HANG, small, train  # (tests/fast/test_preemption.py)


def start(tiny_dense, run_dir, *args):
    """The tiny dense run as its own process, evaluated and saved only at the end unless `args` say otherwise."""
    return tiny_dense.start(run_dir, *args, **END_ONLY, save_every=100)


@pytest.mark.integration  # a subprocess: the signal must not take pytest with it
def test_sigterm_saves_exits_75_and_the_resume_is_bit_exact(tiny_dense, tmp_path):
    run = tmp_path / "preempted"
    proc = start(tiny_dense, run, "--steps", "500", "--warmup_steps", "1", "--save_every", "0")
    wait_for_step(run, 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == guard.EXIT_PREEMPTED, err[-3000:]
    saved = checkpoint.latest(str(run / "checkpoints"))
    step = checkpoint.read_metadata(saved)["step"]
    assert 3 <= step < 500 and f"stopped by a signal after step {step}: saved {saved}" in out + err
    assert not (run / "LOCK").exists()
    first = losses(run)
    assert max(first) == step
    end = step + 3  # the same 500-step schedule, stopped early
    resumed = train.main(small(tiny_dense, run, steps=500, save_every=0, stop_at=end, resume=True))["losses"]
    assert sorted(resumed) == list(range(step + 1, end + 1))
    straight = train.main(small(tiny_dense, tmp_path / "straight", steps=500, save_every=0, stop_at=end))["losses"]
    assert {**first, **resumed} == straight  # every loss, before and after the stop, bit for bit


def _until(what, proc, timeout=240):
    t = time.time()
    while not what():
        if proc.poll() is not None or time.time() - t > timeout:
            raise AssertionError(f"not reached (exit {proc.poll()}): {proc.communicate()[1][-3000:]}")
        time.sleep(0.01)


@pytest.mark.integration  # real processes, each signalled at one moment of its start
def test_a_signal_at_any_moment_of_the_start_ends_cleanly(tiny_dense, tmp_path):
    """Ctrl-C during the imports, while the run opens its data and compiles its init, during the first
    step's compilation, twice there, and while a resume starts: no traceback, no empty run directory, exit
    75 only where a checkpoint is there to resume (named)."""
    long = ("--steps", "500", "--save_every", "0")

    def signalled(run, when, *args, signals=1):
        proc = start(tiny_dense, run, *long, *args)
        when(proc)
        for _ in range(signals):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.05)
        out, err = proc.communicate(timeout=240)
        assert "Traceback" not in err and "Segmentation" not in err, err[-3000:]
        return proc.returncode, out + err

    # the imports (train.py's first lines give SIGINT its default action): the process ends, nothing written
    code, _ = signalled(tmp_path / "imports", lambda proc: time.sleep(0.8))
    assert code == -signal.SIGINT and not (tmp_path / "imports").exists()
    # the run directory is there (the lock), the init compiles: exit at once, the directory gone
    code, text = signalled(tmp_path / "start", lambda p: _until((tmp_path / "start").exists, p))
    assert code == 128 + signal.SIGINT and "SIGINT before the first step: nothing trained or saved" in text, text
    assert not (tmp_path / "start").exists()
    # the first step compiles (Run.begin wrote run.json): the step ends, is saved, exit 75
    run = tmp_path / "compile"
    code, text = signalled(run, lambda p: _until((run / "run.json").exists, p))
    assert code == guard.EXIT_PREEMPTED and "stopped by a signal after step 1" in text, text
    assert checkpoint.read_metadata(checkpoint.latest(str(run / "checkpoints")))["step"] == 1
    # twice there: exit at once, saying nothing was saved; what the run wrote stays
    twice = tmp_path / "twice"
    code, text = signalled(twice, lambda p: _until((twice / "run.json").exists, p), signals=2)
    assert code == 128 + signal.SIGINT and "no checkpoint was saved" in text, text
    assert (twice / "config.json").exists() and not (twice / "LOCK").exists()
    # a resume, signalled once it has said what it resumes: exit 75, the checkpoint named and untouched
    ckpt = checkpoint.latest(str(run / "checkpoints"))
    code, text = signalled(run, lambda p: _until((run / "LOCK").exists, p), "--resume", "true")  # the lock: taken
    assert code == guard.EXIT_PREEMPTED and ckpt in text and checkpoint.latest(str(run / "checkpoints")) == ckpt, text


@pytest.mark.integration  # a subprocess the watchdog aborts
def test_the_watchdog_aborts_a_hung_step_with_every_stack(tiny_dense, tmp_path):
    t = time.time()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            HANG,
            tiny_dense.script,
            *tiny_dense.flags(tmp_path, **END_ONLY, save_every=100, steps=20, watchdog_s=4),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=300,
    )
    assert out.returncode == guard.EXIT_HUNG, out.stderr[-3000:]
    assert time.time() - t < 240
    assert "watchdog: no training step completed for 4 s" in out.stderr
    assert "in wrapped" in out.stderr  # the hung thread's stack, down to the sleeping step
    dumps = [p for p in os.listdir(tmp_path) if p.startswith("hang-")]
    assert len(dumps) == 1 and "in wrapped" in (tmp_path / dumps[0]).read_text()
    assert max(losses(tmp_path)) == 3  # steps 1-3 ran and were logged; step 4 hung
    assert not (tmp_path / "LOCK").exists()  # released before the abort: a requeue elsewhere may take the directory


@pytest.mark.integration  # a kill -9 loop over subprocesses
def test_kill_9_in_saves_and_deletions_never_loses_the_newest_complete_checkpoint(tiny_dense, tmp_path):
    """A checkpoint every step (keep 2, so every step also deletes one), killed with SIGKILL at
    random moments three times: the newest complete checkpoint always restores, the dead run's
    lock is taken over, and the last resume ends with the losses and weights of a run never killed."""
    import random

    rng, run, steps = random.Random(0), tmp_path / "run", 40
    args = ["--steps", str(steps), "--warmup_steps", "1", "--save_every", "1", "--keep_checkpoints", "2"]
    seen = 0
    for _ in range(3):
        resume = ["--resume", "true"] if checkpoint.all_checkpoints(str(run / "checkpoints")) else []
        before = checkpoint.latest(str(run / "checkpoints"))
        proc = start(tiny_dense, run, *args, *resume)
        wait_for_step(run, seen + 2, proc)
        t = time.time()  # and a save of this process committed (the first ones can lag the steps on a loaded machine)
        while checkpoint.latest(str(run / "checkpoints")) == before and time.time() - t < 240 and proc.poll() is None:
            time.sleep(0.1)
        assert checkpoint.latest(str(run / "checkpoints")) != before, "no checkpoint committed"
        time.sleep(rng.uniform(0.0, 0.4))
        proc.kill()
        proc.wait()
        seen = max(losses(run))
        last = checkpoint.latest(str(run / "checkpoints"))  # never raises: nothing damaged is named a checkpoint
        assert last is not None and checkpoint.verify(last, checksums=True) == []
    at = checkpoint.read_metadata(checkpoint.latest(str(run / "checkpoints")))["step"]
    resumed = train.main(small(tiny_dense, run, steps=steps, save_every=1, keep_checkpoints=2, resume=True))
    straight = train.main(small(tiny_dense, tmp_path / "straight", steps=steps, save_every=0))
    assert resumed["losses"] == {k: v for k, v in straight["losses"].items() if k > at}
    for a, b in zip(jax.tree.leaves(resumed["state"]), jax.tree.leaves(straight["state"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # metrics.jsonl: one row per step, the redone steps' rows in place of the killed runs' ones
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, steps + 1)), logged
