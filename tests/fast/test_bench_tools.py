"""tools/bench/bench_step.py (the plain-JAX reference step; two attention backends side by side),
tools/bench/bench_attention.py (attention backends side by side at one shape) and tools/bench/gpu_benchmark.py
(on CPU: the plan, a real tiny job, the table, the time limits)."""

import importlib
import os
import subprocess
import sys

import pytest

from shared.variant import ROOT, load

BENCH = os.path.join(ROOT, "tools", "bench", "bench_step.py")
GPU = os.path.join(ROOT, "tools", "bench", "gpu_benchmark.py")
TINY = ["--seq_len", "32", "--batch_size", "4", "--model.n_layers", "2", "--model.vocab_size", "256"]


def run(*cmd, timeout=240):
    env = {**os.environ, "XLA_FLAGS": ""}  # one CPU device, as a user runs them
    return subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_bench_refuses_a_reference_it_does_not_have():
    p = run(BENCH, "--variant", "kda")
    assert p.returncode == 2 and "--no-reference" in p.stderr


def test_bench_attention_checks_then_times_backends_side_by_side(capsys, monkeypatch):
    """At one shape: a backend that refuses the call is reported and left out, the others are checked against
    the last one and timed in interleaved rounds with their ratios to it; one that disagrees is not timed."""
    bench = load(os.path.join(ROOT, "tools", "bench", "bench_attention.py"))
    args = ["--shape", "2,16,2,1,8", "--window", "4", "--rounds", "1", "--calls", "1"]
    assert bench.main([*args, "--backends", "pallas,blocked@8,reference"]) == 0
    out = capsys.readouterr().out
    assert "pallas: refused: Pallas (Triton) attention needs an NVIDIA GPU" in out, out
    assert "check blocked@8 against reference" in out and "ratio to reference per round" in out, out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("blocked@8 ", "reference "))]
    assert [r[0] for r in rows] == ["blocked@8", "reference"] and rows[1][-2] == "1.000", rows

    A = importlib.import_module("shared.kernels.attention")
    monkeypatch.setitem(
        A.BACKENDS,
        "wrong",
        A.Backend("wrong", lambda: None, lambda c: None, lambda q, k, v, **kw: A.reference(q, k, v, **kw) * 1.01),
    )
    assert bench.main([*args, "--backends", "wrong,reference"]) == 1
    assert "['wrong'] disagree with reference" in capsys.readouterr().out
    for bad, msg in (
        (["--shape", "2,16"], "five positive integers"),
        (["--backends", "nope"], "unknown attention"),
        (["--backends", "reference@8"], "only the blocked backend takes a block size"),
    ):
        with pytest.raises(SystemExit):
            bench.main([*args, *bad])
        assert msg in capsys.readouterr().err


def test_gpu_benchmark_dry_run_plans_every_preset_first():
    p = run(GPU, "--dry-run", "--backends", "cudnn,reference")
    assert p.returncode == 0, p.stderr
    jobs = [ln.split() for ln in p.stdout.splitlines() if "attention=" in ln]
    assert len(jobs) == 10
    # each preset once with the first backend before any preset's second backend
    assert [j[-1] for j in jobs[:5]] == ["attention=cudnn"] * 5
    assert {(j[0], j[1]) for j in jobs[:5]} == {
        ("dense", "125m"),
        ("dense", "1b"),
        ("swa_hybrid", "1b_8k"),
        ("kda", "1b_8k"),
        ("moe_hero", "1b_a200m"),
    }
    for bad, msg in (
        (["--backends", "nope"], "unknown"),
        (["--jobs", "nope"], "no preset"),
        (["--budget", "0"], "--budget must be positive"),
    ):
        p = run(GPU, "--dry-run", *bad)
        assert p.returncode == 2 and msg in p.stderr, (bad, p.stderr)


BENCH_GENERATE = os.path.join(ROOT, "tools", "bench", "bench_generate.py")
