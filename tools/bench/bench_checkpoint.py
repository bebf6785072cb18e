"""How long an asynchronous checkpoint save blocks the train loop, and what it costs the steps
that run while it writes (shared/storage/checkpoint.py's Saver), for a local directory and for a local
S3 server (moto, tools/servers/local_objstore.py).

For one dense train state (params + AdamW moments + step) it interleaves, round after round in
one process:
  sync   checkpoint.save(): the whole save, committed (what the loop waited for before)
  block  Saver.save(): the part the loop waits for (clearing the step's name, device-to-host copy
         of this process's shards); the rest (finiteness check of the copy, writes) runs on a thread.
         One Saver per store for all rounds, as in train.py (its host buffers are reused)
  steps  `--steps-per-round` train steps with no save, then as many right after Saver.save()
         returns, while the write runs (each step waited for, so its time is its own)
and prints medians: block / sync (goal <= 20%), and step time during a save / without one, with
the fraction of those steps that actually overlapped the write.

    python tools/bench/bench_checkpoint.py                                 # CPU default config, local + s3
    python tools/bench/bench_checkpoint.py --config 100m --rounds 3        # ~100M parameters (1.2 GB of state)
    python tools/bench/bench_checkpoint.py --stores local                  # no S3 server
    python tools/bench/bench_checkpoint.py --faults 0,0.1,0.3 --rounds 5   # S3 behind tools/servers/fault_proxy.py

With --faults, only synchronous saves to the S3 server are timed, through tools/servers/fault_proxy.py faulting
each given share of requests (503 SlowDown, a connection reset or a delay of --fault-delay-s, drawn in
equal parts: the first two fail the request), one share after the other in each round; every request is retried within the budget
of shared/storage/objstore.py (STENCIL_STORE_RETRIES, its default unless set).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools", "servers"))  # fault_proxy, local_objstore

import jax  # noqa: E402
import numpy as np  # noqa: E402

import fault_proxy  # noqa: E402
import local_objstore  # noqa: E402
from shared import cli  # noqa: E402
from shared.storage import checkpoint, objstore
from shared.variant import load  # noqa: E402

CONFIGS = {
    "default": [],  # the CPU default of variants/dense (batch 32 x 128 tokens)
    # ~100M parameters (100.7M): 8 layers of 768, vocabulary 32768, untied; a small batch so a step takes seconds on CPU
    "100m": [
        "--model.vocab_size",
        "32768",
        "--model.d_model",
        "768",
        "--model.n_layers",
        "8",
        "--model.n_heads",
        "12",
        "--model.n_kv_heads",
        "4",
        "--model.head_dim",
        "64",
        "--model.d_ff",
        "2048",
        "--batch_size",
        "2",
        "--seq_len",
        "128",
    ],
}


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", choices=sorted(CONFIGS), default="default")
    ap.add_argument("--stores", default="local,s3", help="comma-separated: local, s3")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps-per-round", type=int, default=4)
    ap.add_argument(
        "--faults",
        default="",
        help="comma-separated shares of faulted requests (e.g. 0,0.1,0.3): "
        "time synchronous S3 saves through tools/servers/fault_proxy.py at each",
    )
    ap.add_argument(
        "--fault-delay-s", type=float, default=0.5, help="how long a delayed request is held (with --faults)"
    )
    args = ap.parse_args(argv)
    shares = [float(x) for x in args.faults.split(",")] if args.faults else []
    if any(not 0 <= x < 1 for x in shares):
        ap.error(f"--faults {args.faults}: each share must be in [0, 1)")

    train = load(os.path.join(ROOT, "variants", "dense", "train.py"))
    cfg = cli.parse(train.TrainConfig, train.HERE, [*CONFIGS[args.config], "--wandb", "disabled"])
    mesh = train.make_mesh(cfg)
    optimizer, schedule = train.make_optimizer(cfg)
    rng = np.random.default_rng(0)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda k: train.init_state(cfg, optimizer, k))(jax.random.key(0))
        step_fn = train.make_train_step(cfg, optimizer, schedule)
        tokens = rng.integers(0, cfg.model.vocab_size, (cfg.batch_size, cfg.seq_len), dtype=np.int32)
        batch = train.to_device(
            {
                "tokens": tokens,
                "targets": np.roll(tokens, -1, -1),
                "segment_ids": np.ones_like(tokens),
                "loss_mask": np.ones(tokens.shape, np.float32),
            },
            mesh,
            (cfg.grad_accum,),
        )

        def one_step(s):
            s, m = step_fn(s, batch)
            jax.block_until_ready(m)
            return s

        state = one_step(state)  # compile
        n_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
        print(
            f"dense {args.config}: {train.model.num_params(cfg.model) / 1e6:.1f}M params, state {n_bytes / 1e9:.3f} GB "
            f"({len(jax.tree.leaves(state))} arrays), mesh {dict(mesh.shape)}, {jax.devices()[0].platform}; "
            f"{args.rounds} rounds of {args.steps_per_round} steps",
            flush=True,
        )
        if shares:
            return _faults(state, shares, args)
        rows = []
        with tempfile.TemporaryDirectory() as tmp, _s3_if("s3" in args.stores.split(",")) as s3:
            for store in args.stores.split(","):
                where = os.path.join(tmp, "ck") if store == "local" else s3.bucket("stencil-bench") + "/ck"
                sync, block, quiet, busy, overlap = [], [], [], [], []
                step_no = 0
                saver = checkpoint.Saver()  # one per run, as in train.py: its host buffers are reused by every save
                for r in range(args.rounds):
                    step_no += 1
                    t = time.perf_counter()
                    checkpoint.save(where, step_no, state, {"round": r}, keep=1)
                    sync.append(time.perf_counter() - t)
                    for _ in range(args.steps_per_round):
                        t = time.perf_counter()
                        state = one_step(state)
                        quiet.append(time.perf_counter() - t)
                    step_no += 1
                    t = time.perf_counter()
                    saver.save(where, step_no, state, {"round": r}, keep=1)
                    block.append(time.perf_counter() - t)
                    for _ in range(args.steps_per_round):
                        was = saver.in_flight
                        t = time.perf_counter()
                        state = one_step(state)
                        if was:
                            busy.append(time.perf_counter() - t)
                        overlap.append(was)
                    saver.wait()
                    print(f"  {store} round {r}: sync {sync[-1]:.3f} s, blocked {block[-1]:.3f} s", flush=True)
                med = statistics.median
                rows.append(
                    (
                        store,
                        med(sync),
                        med(block),
                        med(quiet),
                        med(busy) if busy else float("nan"),
                        sum(overlap) / len(overlap),
                    )
                )
    print(
        "\n| store | sync save | async: loop blocked | blocked / sync | step without save | step during save "
        "| during / without | steps that overlapped the write |\n|---|---|---|---|---|---|---|---|"
    )
    for store, s, b, q, bz, ov in rows:
        print(
            f"| {store} | {s:.3f} s | {b:.3f} s | **{b / s:.1%}** | {q * 1e3:.0f} ms | {bz * 1e3:.0f} ms "
            f"| {bz / q:.2f}x | {ov:.0%} |"
        )


def _faults(state, shares, args):
    """Synchronous saves to the S3 server through the fault proxy, round after round, each share in turn."""
    times = {f: [] for f in shares}
    counts = {f: {"requests": 0, **{k: 0 for k in fault_proxy.KINDS}} for f in shares}
    with (
        local_objstore.s3_server() as s3,
        fault_proxy.fault_proxy(s3.endpoint, delay_s=args.fault_delay_s, seed=0) as proxy,
    ):
        where = s3.bucket("stencil-bench-faults") + "/ck"
        os.environ["AWS_ENDPOINT_URL_S3"] = proxy.url  # restored by s3_server on exit
        step = 0
        for r in range(args.rounds):
            for f in shares:
                proxy.fail, before = f, dict(proxy.counts)
                step += 1
                t = time.perf_counter()
                checkpoint.save(where, step, state, {"round": r}, keep=1)
                times[f].append(time.perf_counter() - t)
                for k in counts[f]:
                    counts[f][k] += proxy.counts[k] - before[k]
                print(f"  round {r} faults {f:.0%}: {times[f][-1]:.2f} s", flush=True)
    retries = objstore.request_retries()
    print(
        f"\nretry budget per request: {retries['max_retries']} retries, first after {retries['initial_delay']}, "
        f"at most {retries['max_delay']} apart; delayed requests held {args.fault_delay_s} s; {args.rounds} rounds"
    )
    print(
        "\n| requests faulted | sync save (median) | min | max | vs 0% | requests per save | 503 / reset / delay "
        "per save |\n|---|---|---|---|---|---|---|"
    )
    base = statistics.median(times[shares[0]])
    for f in shares:
        c, n = counts[f], len(times[f])
        print(
            f"| {f:.0%} | {statistics.median(times[f]):.2f} s | {min(times[f]):.2f} s | {max(times[f]):.2f} s "
            f"| {statistics.median(times[f]) / base:.2f}x | {c['requests'] / n:.0f} | {c['503'] / n:.1f} / "
            f"{c['reset'] / n:.1f} / {c['delay'] / n:.1f} |"
        )


class _s3_if:
    """The local S3 server when asked for, else nothing."""

    def __init__(self, wanted):
        self.cm = local_objstore.s3_server() if wanted else None

    def __enter__(self):
        return self.cm.__enter__() if self.cm else None

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc) if self.cm else False


if __name__ == "__main__":
    main()
