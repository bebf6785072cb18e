"""The integration tier of tests/fast/test_train.py (The dense train loop as a user relies on it: exact resume,
restore on other device counts, gradient accumulation, early config errors, clear data errors, NaN handling,
the kernels a run used in its run.json, and a default warmup that fits any run length): the checks that start
real processes or servers, or run long. What they share with the fast half is imported from it."""

import json
import os
import subprocess
import sys
import jax
import numpy as np
import pytest
from shared.storage import checkpoint
from helpers import arrays
from fast.test_train import SCRIPT, _batch, train  # (tests/fast/test_train.py)


@pytest.mark.integration  # a long run: three meshes, a compile each (test_objstore restores across meshes too)
def test_restore_onto_other_device_count(tiny_dense, tmp_path):
    """Saved from 8 devices (data=8), restored on 2 (data=2) and 1: same values, same next step."""
    cfg = tiny_dense.config(tmp_path, steps=3, save_every=0)
    out = train.main(cfg)
    path = checkpoint.latest(str(tmp_path / "checkpoints"))
    opt, schedule = train.make_optimizer(cfg)
    results = []
    for devices in (jax.devices(), jax.devices()[:2], jax.devices()[:1]):
        mesh = train.make_mesh(cfg, devices)
        with jax.set_mesh(mesh):
            target = jax.eval_shape(lambda k: train.init_state(cfg, opt, k), jax.random.key(0))
            state, meta = checkpoint.restore(path, target)
            assert meta["step"] == 3
            assert state["params"]["layers"]["wq"].sharding.mesh.size == len(devices)
            for a, b in zip(arrays(out["state"]), arrays(state)):
                np.testing.assert_array_equal(a, b)
            _, m = train.make_train_step(cfg, opt, schedule)(state, _batch(cfg, mesh, 1))
            results.append(float(m["train/loss"]))
    np.testing.assert_allclose(results, results[0], rtol=2e-6)


def run_cli(*args, **kw):
    env = dict(os.environ, WANDB_MODE="disabled")
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, timeout=300, **kw)


@pytest.mark.integration  # a subprocess: the command as a user runs it
def test_cli_trains_samples_and_reports_bad_flags(small_corpus, tmp_path):
    r = run_cli(
        "--data.source",
        small_corpus,
        "--model.vocab_size",
        "512",
        "--seq_len",
        "32",
        "--batch_size",
        "8",
        "--steps",
        "4",
        "--log_every",
        "2",
        "--eval_every",
        "3",  # the default warmup fits 4 steps
        "--run_dir",
        str(tmp_path / "run"),
        "--wandb",
        "disabled",
        "--sample_tokens",
        "8",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step      4" in r.stdout + r.stderr and "--- sample after 4 steps ---" in r.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the first step, every log_every, every eval_every (each on its own cadence) and the last
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert ["eval/loss" in r for r in rows] == [False, False, True, True]
    assert all("train/loss" in r and "optim/grad_norm" in r for r in rows)
    assert "throughput/tokens_per_second" in rows[-1] and "throughput/mfu" in rows[-1]
    assert checkpoint.latest(str(tmp_path / "run" / "checkpoints")).endswith("step_00000004")

    bad = run_cli("--model.n_heads", "6", "--model.n_kv_heads", "4")
    assert bad.returncode == 1 and "model.n_heads" in bad.stderr and "Traceback" not in bad.stderr

    usage = run_cli("--help")
    assert usage.returncode == 0
    for text in ("--model.n_kv_heads", "--grad_accum", "--data.source", "125m", "8b"):
        assert text in usage.stdout, f"--help does not mention {text}"
    assert "-1 = min(20, steps // 10)" in " ".join(usage.stdout.split()), "--help does not explain warmup_steps = -1"
