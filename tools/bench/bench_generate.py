#!/usr/bin/env python3
"""Decoding with the cache against full recomputation, and the cache's memory, for every folder.

    python tools/bench/bench_generate.py                          # every folder: speed at 256 and 1024 new tokens, memory
    python tools/bench/bench_generate.py --variants dense,kda --new 256 --rounds 5
    python tools/bench/bench_generate.py --memory-only --lengths 1024,8192,65536
    python tools/bench/bench_generate.py --markdown               # the tables as the README shows them

Speed, in one process, on one device, each folder at its CPU default ModelConfig (random weights:
the speed does not depend on them), `--batch` rows of a `--prompt-len`-token prompt:
  cached  shared/decode.py's generate(): model.prefill, then model.decode_step per new token, greedy
          (what `python -m shared.generate` and train.py's sample() run); timed whole, compilation
          excluded (a first call with the same shapes compiles);
  full    what sample() did before the cache: `forward` over the whole row of prompt + N tokens for
          every new token, argmax at the last filled position. The row has a fixed length (one
          compiled program), so every step costs the same: `--full-steps` steps are timed per round
          and tokens/s is rows / (seconds per step).
Both greedy paths are checked to pick the same first 16 tokens (or --new) before anything is timed. The
rounds alternate cached and full (the machine is shared: quote the medians, with min-max).

Memory: bytes of `init_cache(cfg, 1, L)` (one sequence, the compute dtype) for each length L, from
shapes alone (jax.eval_shape: nothing is allocated), at the CPU default and at one preset per
folder (its first), with the part that no longer grows at the longest L (sliding-window rings,
full past the window; KDA states and convolution tails; the positions); the rest, global attention
layers' keys and values, grows linearly.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import draccus  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, reshard  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shared import cli  # noqa: E402
from shared import decode  # noqa: E402
from shared.variant import discover, load  # noqa: E402


def modules(folder):
    return load(os.path.join(ROOT, folder, "model.py")), load(os.path.join(ROOT, folder, "train.py"))


def one_device(train, tc, devices):
    """tc with a mesh of one device and one row a step; the folder's own make_mesh on `devices`."""
    one = {"mesh_data": 1, "mesh_model": 1, **({"mesh_expert": 1} if hasattr(tc, "mesh_expert") else {})}
    tc = dataclasses.replace(tc, batch_size=1, grad_accum=1, **one)
    return tc, train.make_mesh(tc, devices)


# ---------------------------------------------------------------- speed


def full_recompute(model, cfg):
    """One step of recomputation: forward over the whole row, the argmax at position i - 1, put at i."""

    @jax.jit
    def step(params, row, i):
        logits = model.forward(params, row, cfg)
        token = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, i - 1, axis=1, keepdims=False), axis=-1)
        return row.at[:, i].set(reshard(token.astype(row.dtype), P()))

    return step


def bench_speed(folder, new_lengths, prompt_len, batch, rounds, full_steps):
    model, train = modules(folder)
    tc, mesh = one_device(train, train.TrainConfig(), jax.devices()[:1])
    tc = dataclasses.replace(tc, batch_size=batch)
    cfg = tc.model
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, prompt_len).tolist()
    rows = {}
    with jax.set_mesh(mesh):
        params = jax.jit(lambda k: model.init(cfg, k))(jax.random.key(0))
        step = full_recompute(model, cfg)
        for n in new_lengths:
            T = prompt_len + n
            row = np.zeros((batch, T), np.int32)
            row[:, :prompt_len] = prompt
            row = jax.device_put(row, NamedSharding(mesh, P()))

            def cached():
                return decode.generate(model, params, cfg, [prompt] * batch, mesh=mesh, max_new_tokens=n)

            def full(k, row=row):
                for i in range(prompt_len, prompt_len + k):
                    row = step(params, row, i)
                return jax.block_until_ready(row)

            k = min(16, n)
            got = cached()[0].tokens[:k]  # compiles the cached path
            check = np.asarray(full(k))[0, prompt_len : prompt_len + k].tolist()  # compiles the full one
            if got != check:
                raise SystemExit(
                    f"error: {folder}: cached and full greedy decoding differ in the first {k} tokens: {got} vs {check}"
                )
            times = {"cached": [], "full": []}
            for r in range(rounds):
                for arm in ("cached", "full") if r % 2 == 0 else ("full", "cached"):
                    t0 = time.perf_counter()
                    cached() if arm == "cached" else full(full_steps)
                    dt = time.perf_counter() - t0
                    times[arm].append(batch * (n if arm == "cached" else full_steps) / dt)  # tokens/s
            rows[n] = times
    return {"folder": folder, "params": model.num_params(cfg), "rows": rows}


def speed_table(results, markdown, batch, prompt_len, rounds):
    med = statistics.median
    lines = []
    head = ["folder", "new tokens", "cached tok/s", "full tok/s", "cached / full"]
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    else:
        lines.append(f"{head[0]:<22}{head[1]:>11}{head[2]:>26}{head[3]:>26}{head[4]:>15}")
    for res in results:
        for n, t in res["rows"].items():
            c, f = t["cached"], t["full"]
            ratio = [a / b for a, b in zip(c, f)]
            cells = [
                res["folder"],
                str(n),
                f"{med(c):,.0f} ({min(c):,.0f}-{max(c):,.0f})",
                f"{med(f):,.1f} ({min(f):,.1f}-{max(f):,.1f})",
                f"{med(ratio):,.1f}x",
            ]
            if markdown:
                lines.append("| " + " | ".join(cells) + " |")
            else:
                lines.append(f"{cells[0]:<22}{cells[1]:>11}{cells[2]:>26}{cells[3]:>26}{cells[4]:>15}")
    lines.append(
        f"\n{batch} row(s), a {prompt_len}-token prompt, greedy; medians of {rounds} alternating rounds "
        f"(min-max); {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------- memory


def cache_bytes(model, train, tc, length):
    """{leaf path: bytes} of init_cache(cfg, 1, length), from shapes only."""
    tc, mesh = one_device(train, tc, 1)
    with jax.sharding.use_abstract_mesh(mesh):
        shapes = jax.eval_shape(lambda: model.init_cache(tc.model, 1, length))
    return {
        jax.tree_util.keystr(p): math.prod(s.shape) * s.dtype.itemsize
        for p, s in jax.tree_util.tree_flatten_with_path(shapes)[0]
    }


def bench_memory(folder, lengths):
    model, train = modules(folder)
    configs = [("CPU default", train.TrainConfig())]
    presets = cli.presets(os.path.join(ROOT, folder))
    if presets:
        name, path = next(iter(presets.items()))
        configs.append((name, draccus.parse(train.TrainConfig, config_path=path, args=[])))
    out = []
    for name, tc in configs:
        per = [cache_bytes(model, train, tc, L) for L in lengths]
        grows = [k for k in per[-1] if len(per) > 1 and per[-1][k] != per[-2][k]]  # still growing at the longest
        out.append(
            {
                "folder": folder,
                "config": name,
                "total": [sum(p.values()) for p in per],
                "grows": [sum(p[k] for k in grows) for p in per],
                "fixed": [sum(v for k, v in p.items() if k not in grows) for p in per],
                "growing_leaves": grows,
            }
        )
    return out


def size(b):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b} B"


def memory_table(results, lengths, markdown):
    head = ["folder", "config"] + [f"L = {L:,}" for L in lengths] + ["of which fixed"]
    lines = []
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    else:
        lines.append(f"{head[0]:<22}{head[1]:<14}" + "".join(f"{h:>16}" for h in head[2:]))
    for r in results:
        cells = [size(t) for t in r["total"]] + [size(r["fixed"][-1])]
        if markdown:
            lines.append("| " + " | ".join([r["folder"], r["config"]] + cells) + " |")
        else:
            lines.append(f"{r['folder']:<22}{r['config']:<14}" + "".join(f"{c:>16}" for c in cells))
    lines.append(
        "\ncache bytes per sequence (init_cache(cfg, 1, L), the compute dtype); 'of which fixed': the part "
        "that no longer grows at the longest L (sliding-window rings, KDA states and convolution tails, "
        "positions); the rest, keys and values of global attention layers, grows linearly"
    )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python tools/bench/bench_generate.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--variants", default="", help="comma-separated folders (dense or variants/dense); default all")
    ap.add_argument("--new", default="256,1024", help="new tokens per run, comma-separated (default 256,1024)")
    ap.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (default 16)")
    ap.add_argument("--batch", type=int, default=1, help="rows (default 1)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per length (default 3)")
    ap.add_argument("--full-steps", type=int, default=16, help="full-recomputation steps timed per round (default 16)")
    ap.add_argument("--lengths", default="256,1024,4096,16384,65536", help="memory: cache lengths (comma-separated)")
    ap.add_argument("--memory-only", action="store_true", help="the memory table only (no timing: seconds)")
    ap.add_argument("--speed-only", action="store_true", help="the speed table only")
    ap.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    args = ap.parse_args(argv)
    try:
        new = [int(x) for x in args.new.split(",")]
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        ap.error("--new and --lengths take comma-separated integers")
    if min(new + lengths) < 1 or args.prompt_len < 1 or args.batch < 1 or args.rounds < 1 or args.full_steps < 1:
        ap.error("--new, --lengths, --prompt-len, --batch, --rounds and --full-steps must be positive")
    if args.full_steps > min(new):
        ap.error(f"--full-steps {args.full_steps} is more than the shortest --new ({min(new)})")
    folders = discover()
    if args.variants:
        names = [v.strip() for v in args.variants.split(",")]
        by_name = {os.path.basename(f): f for f in folders} | {f: f for f in folders}
        unknown = [v for v in names if v not in by_name]
        if unknown:
            ap.error(f"unknown folder(s) {unknown}; folders: {folders}")
        folders = [by_name[v] for v in names]
    print(
        f"{time.strftime('%Y-%m-%d')}: python tools/bench/bench_generate.py {' '.join(sys.argv[1:] if argv is None else argv)}"
    )
    if not args.speed_only:
        mem = [r for f in folders for r in bench_memory(f, lengths)]
        print("\n" + memory_table(mem, lengths, args.markdown))
    if not args.memory_only:
        results = []
        for f in folders:
            print(f"timing {f} ...", file=sys.stderr, flush=True)
            results.append(bench_speed(f, new, args.prompt_len, args.batch, args.rounds, args.full_steps))
        print("\n" + speed_table(results, args.markdown, args.batch, args.prompt_len, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
