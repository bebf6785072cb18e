"""Runs that meet their surroundings: preemption signals, a second run in the same directory, a
hung step, and resumes that would silently change the data (shared/runtime/guard.py, the train loop).

The signal and watchdog tests run variants/dense/train.py as a real process (a signal or an
abort must not take pytest with it); the rest call main() in this process."""

import json
import os
import signal
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from shared import data
from shared.runtime import guard
from shared.storage import checkpoint
from shared.run import TrainingError
from shared.variant import ROOT, load


train = load(os.path.join(ROOT, "variants", "dense", "train.py"))  # the one tiny_dense (conftest) runs
END_ONLY = {"eval_every": 1000, "eval_batches": 1}  # evaluated only at the end


def small(tiny_dense, run_dir, **over):
    """The tiny dense config (conftest's tiny_dense), evaluated only at the end."""
    return tiny_dense.config(run_dir, **{**END_ONLY, **over})


# ---------------------------------------------------------------- preemption


SECOND_SIGNAL = """
import os, signal, sys, time
from shared.runtime import guard
stop = guard.StopSignals()
if sys.argv[1] != "none":
    stop.last_saved = lambda: sys.argv[1]
os.kill(os.getpid(), signal.SIGUSR1)
print("first", stop.signal == signal.SIGUSR1, stop.requested(), flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("not reached", flush=True)
"""


@pytest.mark.parametrize("saved", ["ckpt/step_00000004", "none"])
def test_a_second_signal_exits_at_once_and_names_what_was_saved(saved):
    out = subprocess.run(
        [sys.executable, "-c", SECOND_SIGNAL, saved],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=120,
    )
    assert "first True True" in out.stdout and "not reached" not in out.stdout, out
    if saved == "none":  # nothing to resume: the signal's own code, and no claim of a checkpoint
        assert out.returncode == 128 + signal.SIGTERM and "no checkpoint was saved" in out.stderr, out
    else:
        assert out.returncode == guard.EXIT_PREEMPTED, out
        assert f"second signal (SIGTERM): exiting now, without saving this step; the last checkpoint, {saved}" in (
            out.stderr
        )


# ---------------------------------------------------------------- one run per directory


def test_a_second_run_in_the_same_directory_is_refused(tiny_dense, tmp_path):
    holder = subprocess.Popen(["sleep", "60"])
    try:
        tmp_path.mkdir(exist_ok=True)
        (tmp_path / "LOCK").write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(), "since": "now"}))
        with pytest.raises(guard.RunLockError, match=rf"in use by pid {holder.pid} on {socket.gethostname()}"):
            train.main(small(tiny_dense, tmp_path, steps=2))
        assert not (tmp_path / "checkpoints").exists()
        # a lock on another host is never taken over, whatever its pid
        (tmp_path / "LOCK").write_text(json.dumps({"pid": 1, "host": "another-host", "since": "now"}))
        with pytest.raises(guard.RunLockError, match="in use by pid 1 on another-host"):
            guard.RunLock(str(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    # the holder is dead now: its lock is stale and the run takes it over, then releases it
    (tmp_path / "LOCK").write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(), "since": "now"}))
    out = train.main(small(tiny_dense, tmp_path, steps=2, save_every=0))
    assert sorted(out["losses"]) == [1, 2] and not (tmp_path / "LOCK").exists()


# ---------------------------------------------------------------- a hung step

HANG = """
import sys, time
from shared.variant import load
train = load(sys.argv[1])
real = train.make_train_step

def hanging(*args):
    step, calls = real(*args), [0]
    def wrapped(state, batch):
        calls[0] += 1
        if calls[0] == 4:
            time.sleep(600)  # a stuck collective, as far as the loop can tell
        return step(state, batch)
    return wrapped

train.make_train_step = hanging
train.main(train.cli.parse(train.TrainConfig, train.HERE, sys.argv[2:]))
"""


# ---------------------------------------------------------------- resume refuses what it cannot honour


def test_resume_refuses_what_would_change_the_data(small_corpus, tiny_dense, tmp_path, capsys):
    run = tmp_path / "run"
    first = train.main(small(tiny_dense, run, steps=6, stop_at=3))
    tokenizer = (run / "tokenizer.json").read_bytes()

    # Started again once complete (a retry wrapper, a requeued job): trains nothing and returns (exit 0),
    # naming a newer folder that never committed; fewer steps than the checkpoint holds stays an error.
    rows, ck = (run / "metrics.jsonl").read_text(), run / "checkpoints"
    (ck / "step_00000005" / "arrays").mkdir(parents=True)
    (ck / "step_00000005" / "arrays" / "x").write_bytes(b"1")
    capsys.readouterr()
    again = train.main(small(tiny_dense, run, steps=6, stop_at=3, resume=True))
    text = "".join(capsys.readouterr())
    assert again["already_complete"] and again["losses"] == {} and again["step"] == 3
    assert f"this run is complete: {ck / 'step_00000003'} is at step 3, its last step" in text, text
    assert "MFU is against" not in text  # nothing else: no peak measured (nor a wandb run opened)
    assert (
        f"resume: ignored {ck / 'step_00000005'}: 1 files, but no metadata.json (its commit record): a save "
        "that did not finish"
    ) in text, text
    for x, y in zip(jax.tree.leaves(again["state"]), jax.tree.leaves(first["state"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert (run / "metrics.jsonl").read_text() == rows  # nothing trained, nothing logged over it
    assert checkpoint.all_checkpoints(str(ck)) == [str(ck / "step_00000003")]
    with pytest.raises(
        TrainingError,
        match=r"step_00000003 is at step 3, past the end of this run at step 2 .*"
        r"pass --steps \(or --stop_at\) 3 or more",
    ):
        train.main(small(tiny_dense, run, steps=6, stop_at=2, resume=True))
    with pytest.raises(TrainingError, match=r"data stream differs.*'seq_len': \(32, 16\)"):
        train.main(small(tiny_dense, run, steps=6, seq_len=16, resume=True))
    other = tmp_path / "other"
    other.mkdir()
    for name in sorted(os.listdir(os.path.dirname(small_corpus)))[:3]:
        (other / name).write_text(open(os.path.join(os.path.dirname(small_corpus), name)).read())
    with pytest.raises(TrainingError, match=r"data stream differs.*'corpus'"):
        train.main(
            small(
                tiny_dense,
                run,
                steps=6,
                resume=True,
                data=data.DataConfig(source=str(other / "*.txt"), val_fraction=0.1),
            )
        )
    assert (run / "tokenizer.json").read_bytes() == tokenizer  # never overwritten
    # a path-only change (the cache directory) cannot change the data: the resume goes on
    out = train.main(
        small(
            tiny_dense,
            run,
            steps=6,
            resume=True,
            data=data.DataConfig(source=small_corpus, val_fraction=0.1, cache_dir=str(tmp_path / "cache2")),
        )
    )
    assert sorted(out["losses"]) == [4, 5, 6]
    assert (run / "tokenizer.json").read_bytes() == tokenizer


def test_resume_from_a_named_checkpoint(tiny_dense, tmp_path):
    straight = train.main(small(tiny_dense, tmp_path / "a", steps=6, save_every=2, keep_checkpoints=5))
    ck = tmp_path / "a" / "checkpoints"
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"no checkpoint .*step_00000005.*\['step_00000002', "
        r"'step_00000004', 'step_00000006'\]",
    ):
        train.main(small(tiny_dense, tmp_path / "a", steps=6, resume_from="5"))
    # by path, in another run directory's copy: the run directory follows from the path
    out = train.main(small(tiny_dense, "", steps=6, resume_from=str(ck / "step_00000002")))
    assert out["run_dir"] == str(tmp_path / "a") and sorted(out["losses"]) == [3, 4, 5, 6]
    assert out["losses"] == {k: v for k, v in straight["losses"].items() if k > 2}
    assert np.isfinite(list(out["losses"].values())).all()


# ---------------------------------------------------------------- kill -9
