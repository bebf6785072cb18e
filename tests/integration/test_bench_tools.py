"""The integration tier of tests/fast/test_bench_tools.py (tools/bench/bench_step.py (the plain-JAX reference
step; two attention backends side by side), tools/bench/bench_attention.py (attention backends side by side at
one shape) and tools/bench/gpu_benchmark.py (on CPU: the plan, a real tiny job, the table, the time limits)):
the checks that start real processes or servers, or run long. What they share with the fast half is imported
from it."""

import json
import os
import pytest
from shared.variant import ROOT, load
from fast.test_bench_tools import BENCH, BENCH_GENERATE, GPU, TINY, run  # (tests/fast/test_bench_tools.py)


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
