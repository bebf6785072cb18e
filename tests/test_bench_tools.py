"""tools/bench/bench_step.py (the plain-JAX reference step; two attention backends side by side),
tools/bench/bench_attention.py (attention backends side by side at one shape) and tools/bench/gpu_benchmark.py
(on CPU: the plan, a real tiny job, the table, the time limits)."""

import importlib
import json
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


@pytest.mark.integration  # a subprocess timing real steps (the tool as a user runs it)
def test_bench_checks_then_times_both_steps_and_reports_noise():
    """The hand-written plain step computes dense's math (loss, gradients and one optimizer step agree
    on packed documents, GQA, z-loss on, tied embeddings; else the tool refuses to time them), then
    the two are timed with the A/A noise beside them."""
    p = run(
        BENCH,
        "--rounds",
        "2",
        "--steps-per-round",
        "1",
        *TINY,
        "--model.z_loss",
        "1e-3",
        "--model.tie_embeddings",
        "true",
    )
    assert p.returncode == 0, p.stdout + p.stderr
    for line in (
        "losses, gradients and one-step parameters of A and B agree",
        "A/A' (noise)   wall",
        "A/B            wall",
        "of the best in-process fp32 matmul",
    ):
        assert line in p.stdout, p.stdout


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


@pytest.mark.integration  # a long run: real train steps of a variant timed with two backends
def test_bench_step_times_two_attention_backends_side_by_side(capsys):
    """--attention-backends: the variant's step with each backend on every attention layer, plus the noise
    arm, each with its tokens/s and ratio to the last; a backend the config refuses is named."""
    bench = load(os.path.join(ROOT, "tools", "bench", "bench_step.py"))
    flags = ["--rounds", "1", "--steps-per-round", "1", *TINY]
    assert bench.main([*flags, "--attention-backends", "blocked,reference"]) == 0
    out = capsys.readouterr().out
    for line in (
        "attention=blocked, again wall",
        "A/A' (noise)   wall",
        "tokens/s (median wall); / attention=reference",
    ):
        assert line in out, out
    with pytest.raises(SystemExit):
        bench.main([*flags, "--attention-backends", "nope"])
    assert "model.attention_backend" in capsys.readouterr().err


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


@pytest.mark.integration  # a subprocess timing real steps (the tool as a user runs it)
def test_gpu_benchmark_runs_a_job_and_prints_the_table(tmp_path):
    """A real (tiny) job on CPU: the row has throughput, MFU and step time; memory is n/a on CPU.
    A second job past its own time limit is killed and reported, and the command still ends with its table."""
    flags = " ".join(TINY)
    p = run(
        GPU, "--jobs", "dense:,swa_hybrid:", "--no-selfcheck", "--steps", "1", "--flags", flags, "--out", str(tmp_path)
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [json.loads(x) for x in open(tmp_path / "results.jsonl")]
    assert [(r["variant"], r["backend"], r["status"]) for r in rows] == [
        ("dense", "reference", "ok"),
        ("swa_hybrid", "reference", "ok"),
    ]
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["peak_mem_gib"] is None for r in rows)
    assert abs(rows[0]["step_s"] * rows[0]["tokens_per_s"] - 4 * 32) < 1e-6
    table = (tmp_path / "table.md").read_text()
    assert "| dense | (CPU default) | reference |" in table and "| n/a |" in table

    p = run(
        GPU,
        "--jobs",
        "dense:",
        "--no-selfcheck",
        "--job-timeout",
        "3",
        "--steps",
        "100000",
        "--flags",
        flags,
        "--out",
        str(tmp_path),
    )  # far more steps than 3 s allow, even with a warm compilation cache
    assert p.returncode == 1
    assert json.loads(open(tmp_path / "results.jsonl").readline())["status"].startswith("timeout")
    assert "| dense | (CPU default) | reference |" in p.stdout


@pytest.mark.integration  # a subprocess timing real steps (the tool as a user runs it)
def test_gpu_benchmark_budget_leaves_jobs_unrun(tmp_path):
    """A budget too small for any job: every job is listed as not run, nothing hangs."""
    p = run(
        GPU,
        "--jobs",
        "dense:",
        "--no-selfcheck",
        "--budget",
        "2",
        "--job-timeout",
        "100",
        "--out",
        str(tmp_path),
        timeout=120,
    )
    rows = [json.loads(x) for x in open(tmp_path / "results.jsonl")]
    assert rows and all(r["status"] == "not run: budget" for r in rows), p.stdout + p.stderr


BENCH_GENERATE = os.path.join(ROOT, "tools", "bench", "bench_generate.py")


@pytest.mark.integration  # a subprocess: the tool as a user runs it (two folders, tiny lengths)
def test_bench_generate_times_both_paths_and_sizes_the_cache():
    """Both greedy paths are timed (after agreeing); the cache table grows linearly for the template and
    stops growing at swa_hybrid's 64-token window in its local layers."""
    p = run(
        BENCH_GENERATE,
        "--variants",
        "base,swa_hybrid",
        "--new",
        "8",
        "--rounds",
        "1",
        "--full-steps",
        "2",
        "--lengths",
        "32,64,128",
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {
        tuple(line.split()[:3]): line.split()
        for line in p.stdout.splitlines()
        if line.startswith(("templates", "variants"))
    }
    base, swa = rows[("templates/base", "CPU", "default")], rows[("variants/swa_hybrid", "CPU", "default")]
    assert base[3:9] == ["128.0", "KiB", "256.0", "KiB", "512.0", "KiB"] and base[-2:] == ["8", "B"], base
    assert swa[-2:] == ["96.0", "KiB"], swa  # 3 local layers x (k, v) x 64 slots x 2 heads x 32 x 4 bytes, + 8 B
    speed = [line for line in p.stdout.splitlines() if line.split()[1:2] == ["8"]]
    assert len(speed) == 2 and all(line.endswith("x") for line in speed), p.stdout
