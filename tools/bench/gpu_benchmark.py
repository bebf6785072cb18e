#!/usr/bin/env python3
"""One command for a GPU machine: kernel self-check, then train steps of every preset with each
usable attention backend, in one table (tokens/s, MFU against the data-sheet peak, step time,
peak device memory).

    python tools/bench/gpu_benchmark.py --out /tmp/gpubench             # the whole benchmark (< 8 min on an H200)
    python tools/bench/gpu_benchmark.py --dry-run                        # the plan only: jobs, backends, budget
    python tools/bench/gpu_benchmark.py --jobs dense:125m --backends cudnn,flash4
    launch/gpu_benchmark.sh                                        # installs carried wheels first, then this

Each job is a child process with its own time limit (`--job-timeout`), and the whole run has
a budget (`--budget`): a job that would not fit in what is left is listed as not run, so the
command always ends, and always prints its table. A job builds the variant's own
`make_train_step` at the preset's shapes on one device (batch reduced to `batch` rows, so it
fits one GPU; mesh 1 x 1), runs one step to compile, then `--steps` timed steps on a
synthetic batch (random tokens packed as documents). No data loading, no checkpoint.

MFU: model FLOPs (`flops_per_token`, remat not counted) x tokens/s over the data-sheet dense
bf16 peak of the device (`shared.flops.PEAKS`). Peak memory: the device allocator's
`peak_bytes_in_use` after the timed steps (n/a on CPU).

UNVERIFIED ON GPU: this has run on CPU only (the dry run, a tiny job, the table, the time
limits; tests/test_gpu_benchmark.py). No GPU figure exists yet.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# variant, preset, rows per step on one device (tokens per step = rows x the preset's seq_len)
JOBS = [
    ("dense", "125m", 16),  # 16 x 2048 = 32k tokens
    ("dense", "1b", 16),  # 32k
    ("swa_hybrid", "1b_8k", 4),  # 4 x 8192 = 32k
    ("kda", "1b_8k", 4),  # 32k
    ("moe_hero", "1b_a200m", 8),  # 8 x 4096 = 32k
]
BACKENDS = ("cudnn", "flash4", "pallas", "reference")  # attention backends, in `auto`'s order
RESULT = "GPU_BENCHMARK_RESULT "


# ---------------------------------------------------------------- one job (a child process)


def run_job(variant: str, preset: str, rows: int, backend: str, steps: int, flags: list[str]) -> dict:
    """Compile and time `steps` train steps of one variant/preset/backend; the table's row."""
    import jax

    sys.path.insert(0, os.path.join(ROOT, "tools", "bench"))
    from bench_step import setup, synthetic_batch, time_arm  # noqa: E402  (tools/bench/bench_step.py)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shared import flops

    argv = (["--preset", preset] if preset else []) + [
        "--batch_size",
        str(rows),
        "--grad_accum",
        "1",
        "--model.attention_backend",
        backend,
        "--wandb",
        "disabled",
        *flags,
    ]
    train, tc, mesh = setup(f"variants/{variant}", argv)
    batch = synthetic_batch(tc)
    with jax.set_mesh(mesh):
        put = NamedSharding(mesh, P())
        accum = {k: jax.device_put(v.reshape(1, *v.shape), put) for k, v in batch.items()}
        opt, sched = train.make_optimizer(tc)
        state = jax.jit(lambda k: train.init_state(tc, opt, k))(jax.random.key(0))
        step = train.make_train_step(tc, opt, sched)
        t0 = time.perf_counter()
        state, _, _ = time_arm(step, state, accum, 1)
        compile_s = time.perf_counter() - t0
        state, wall, _ = time_arm(step, state, accum, steps)
    tokens = tc.batch_size * tc.seq_len
    tok_s = tokens / wall
    peak, src = flops.device_peak(tc.model.compute_dtype)
    stats = jax.local_devices()[0].memory_stats() or {}
    return {
        "variant": variant,
        "preset": preset or "(CPU default)",
        "backend": backend,
        "status": "ok",
        "tokens_per_step": tokens,
        "step_s": wall,
        "tokens_per_s": tok_s,
        "mfu": flops.mfu(train.model.flops_per_token(tc.model, tc.seq_len), tok_s, 1, peak),
        "peak_src": src,
        "peak_mem_gib": stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None,
        "compile_s": compile_s,
        "device": jax.devices()[0].device_kind,
    }


def list_backends() -> dict:
    """The attention backends this process can run, and the device (a child process, like the jobs)."""
    import jax

    from shared import kernels

    return {
        "usable": [b for b in BACKENDS if b in kernels.available_backends()],
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
    }


# ---------------------------------------------------------------- the parent: plan, run, table


def plan(jobs, usable) -> list[tuple]:
    """(variant, preset, rows, backend) in run order: every preset with its first usable backend
    first (what `auto` would pick), then the other backends, so a short budget still covers each preset."""
    first = [(v, p, r, usable[0]) for v, p, r in jobs] if usable else []
    rest = [(v, p, r, b) for v, p, r in jobs for b in usable[1:]]
    return first + rest


def child(args: list[str], timeout: float) -> tuple[str, dict | None, str]:
    """Run this file with `args` in a fresh process group; (status, result or None, output tail)."""
    cmd = [sys.executable, os.path.abspath(__file__), *args]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", None, out[-2000:]
    for line in out.splitlines():
        if line.startswith(RESULT):
            return "ok", json.loads(line[len(RESULT) :]), out[-2000:]
    last = [ln for ln in out.splitlines() if ln.strip()]
    return "failed", None, (last[-1] if last else f"exit {proc.returncode}")


def fmt(x, spec, none="n/a"):
    return none if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    head = ["variant", "preset", "attention", "tokens/s", "MFU", "step (ms)", "peak mem (GiB)", "compile (s)", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                [
                    r["variant"],
                    r["preset"],
                    r["backend"],
                    fmt(r.get("tokens_per_s"), ",.0f", "-"),
                    fmt(r.get("mfu"), ".1%", "-"),
                    fmt(r.get("step_s") and r["step_s"] * 1e3, ".1f", "-"),
                    fmt(r.get("peak_mem_gib"), ".1f", "n/a" if r.get("status") == "ok" else "-"),
                    fmt(r.get("compile_s"), ".0f", "-"),
                    r["status"],
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def parse_jobs(spec: str | None):
    """'dense:125m,kda' -> the JOBS rows they name ('variant' alone = all its presets; 'variant:' = CPU default)."""
    if not spec:
        return JOBS
    out = []
    for item in spec.split(","):
        v, _, rest = item.partition(":")
        p, _, rows = rest.partition(":")
        if ":" not in item:
            found = [j for j in JOBS if j[0] == v]
            if not found:
                raise ValueError(
                    f"--jobs: no preset of {v!r} in the benchmark; known: "
                    f"{sorted({j[0] for j in JOBS})} (or 'variant:preset', 'variant:' for its CPU default)"
                )
            out += found
            continue
        if not os.path.isfile(os.path.join(ROOT, "variants", v, "train.py")):
            raise ValueError(f"--jobs: no variants/{v}/train.py")
        default = next((j[2] for j in JOBS if j[:2] == (v, p)), 8)
        out.append((v, p, int(rows) if rows else default))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python tools/bench/gpu_benchmark.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", default="", help="folder for results.jsonl, table.md and selfcheck.txt (default: none)")
    ap.add_argument("--budget", type=float, default=450, help="seconds for the whole run (default 450: 7.5 min)")
    ap.add_argument(
        "--job-timeout", type=float, default=100, help="seconds for one job, compile included (default 100)"
    )
    ap.add_argument(
        "--selfcheck-timeout", type=float, default=120, help="seconds for the kernel self-check (default 120)"
    )
    ap.add_argument("--no-selfcheck", action="store_true", help="skip shared.kernels.selfcheck")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per job, after one compile step (default 5)")
    ap.add_argument(
        "--jobs",
        help="e.g. 'dense:125m,kda' (default: every preset in JOBS; 'dense:' = its CPU default; "
        "'dense:125m:8' sets the rows)",
    )
    ap.add_argument(
        "--backends", help=f"attention backends to try, comma-separated (default: every usable one of {BACKENDS})"
    )
    ap.add_argument("--flags", default="", help="extra TrainConfig flags for every job, e.g. '--model.n_layers 2'")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (jobs, backends, limits) and stop")
    ap.add_argument("--job", help=argparse.SUPPRESS)  # child mode: variant:preset:rows:backend
    ap.add_argument("--list", action="store_true", help=argparse.SUPPRESS)  # child mode: usable backends
    a = ap.parse_args(argv)
    for name in ("budget", "job_timeout", "selfcheck_timeout"):
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if a.steps < 1:
        ap.error("--steps must be >= 1")
    sys.path.insert(0, ROOT)

    if a.list:
        print(RESULT + json.dumps(list_backends()), flush=True)
        return 0
    if a.job:
        v, p, rows, b = a.job.split(":")
        print(RESULT + json.dumps(run_job(v, p, int(rows), b, a.steps, shlex.split(a.flags))), flush=True)
        return 0

    try:
        jobs = parse_jobs(a.jobs)
    except ValueError as e:
        ap.error(str(e))
    wanted = a.backends.split(",") if a.backends else list(BACKENDS)
    unknown = [b for b in wanted if b not in BACKENDS]
    if unknown:
        ap.error(f"--backends: unknown {unknown}; known: {list(BACKENDS)}")
    start = time.monotonic()
    left = lambda: a.budget - (time.monotonic() - start)  # noqa: E731
    if a.out:
        os.makedirs(a.out, exist_ok=True)

    if a.dry_run:
        work = plan(jobs, wanted)
        print(
            f"plan: {len(work)} jobs (attention backends {wanted}, those this machine cannot run are dropped "
            f"when the run starts); budget {a.budget:.0f} s, {a.job_timeout:.0f} s a job, {a.steps} timed steps; "
            f"self-check {'skipped' if a.no_selfcheck else f'first, {a.selfcheck_timeout:.0f} s'}"
        )
        for v, p, r, b in work:
            print(f"  {v:<11} {p or '(CPU default)':<14} {r:>3} rows  attention={b}")
        return 0

    failed = False
    if not a.no_selfcheck:
        t = min(a.selfcheck_timeout, left())
        print(f"== kernel self-check (limit {t:.0f} s)", flush=True)
        proc = subprocess.Popen(
            [sys.executable, "-m", "shared.kernels.selfcheck"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=t)
            status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            status = f"timeout after {t:.0f} s"
        failed |= status != "ok"
        print(out.rstrip() + f"\nself-check: {status}", flush=True)
        if a.out:
            with open(os.path.join(a.out, "selfcheck.txt"), "w") as f:
                f.write(out)

    status, info, tail = child(["--list"], max(min(60, left()), 30))  # the plan needs it, even over budget
    if info is None:
        print(f"error: could not list the attention backends ({status}): {tail}", file=sys.stderr)
        return 1
    usable = [b for b in wanted if b in info["usable"]]
    print(
        f"== {info['device']} ({info['platform']}); attention backends: {usable} "
        f"(of {wanted}; {left():.0f} s of the budget left)",
        flush=True,
    )
    rows = []
    for v, p, r, b in plan(jobs, usable):
        t = min(a.job_timeout, left())
        if t < min(a.job_timeout, 20):
            rows.append({"variant": v, "preset": p or "(CPU default)", "backend": b, "status": "not run: budget"})
            continue
        t0 = time.monotonic()
        status, res, tail = child(["--job", f"{v}:{p}:{r}:{b}", "--steps", str(a.steps), "--flags", a.flags], t)
        row = res or {
            "variant": v,
            "preset": p or "(CPU default)",
            "backend": b,
            "status": f"{status}: {tail.strip().splitlines()[-1][:120] if tail.strip() else ''}",
        }
        failed |= res is None
        rows.append(row)
        print(f"   {v} {p or '(CPU default)'} {b}: {row['status']} ({time.monotonic() - t0:.0f} s)", flush=True)
    text = table(rows)
    note = (
        f"{info['device']}, one device; batch rows per job as in tools/bench/gpu_benchmark.py JOBS; "
        f"{a.steps} timed steps after one compile step; MFU against {rows[0].get('peak_src', 'the data-sheet peak') if rows else ''}."
    )
    print("\n" + text + "\n\n" + note)
    if a.out:
        with open(os.path.join(a.out, "results.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        with open(os.path.join(a.out, "table.md"), "w") as f:
            f.write(text + "\n\n" + note + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
