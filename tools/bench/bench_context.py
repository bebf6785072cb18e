"""What context parallelism saves and sends: per-device memory and collective bytes of one train step
with each row split over 1, 2, 4 ... devices on the `context` axis (shared/kernels/context.py).

For each folder and each context size it compiles (never runs) the folder's own train step on that many
CPU devices (mesh data 1 x context c x model 1, one row of --seq_len tokens a step) and reads:
  temp      XLA's compiled memory analysis: temporaries per device (the activations the step keeps
            and its scratch), the number that context parallelism divides;
  residuals shared/runtime/memory.py's estimate of what the backward pass keeps (per device);
  gathered  the result bytes per device of the all-gather and collective-permute ops in the compiled
            program's text, where the body of a loop is counted once (so a scanned stack of layers
            counts one layer, both branches of a `lax.cond` count, and a remat recompute counts
            again): the token mixers' traffic plus the positions' whole-row ids; and all-reduce +
            reduce-scatter bytes the same way (the gradients of weights replicated over `context`,
            the all-gathers' backward, the loss's sums);
and, computed from the config, the bytes one layer of each kind receives per device in the forward
pass: full attention all-gathers (c-1)/c of the row's K and V and moves T/c query rows in and as many
outputs back (the zigzag; at most, a half that stays on its device is not sent), a window's halo is W-1 tokens of K and V
(independent of the row), KDA all-gathers c states [K, K+V] per head (and 3 conv tails of conv_size-1).

    python tools/bench/bench_context.py                                  # every variant, seq_len 8192, context 1 2 4
    python tools/bench/bench_context.py --folders variants/kda --seq_len 2048 --contexts 1,2
    python tools/bench/bench_context.py --table                          # a markdown table (docs/context-parallel.md)
    python tools/bench/bench_context.py --attention --seq_len 4096       # whole row vs zigzag (all-gather, ring), timed

Needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (or more) on CPU. Compiling at seq_len 8192
takes a minute or two per folder and context size on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from shared.runtime import memory  # noqa: E402
from shared.variant import load  # noqa: E402

FOLDERS = ("variants/dense", "variants/swa_hybrid", "variants/kda", "variants/moe_hero")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}
COLLECTIVE = re.compile(
    r"=\s*(\(?[a-z0-9]+\[[^=]*?)\s+(all-gather|collective-permute|all-reduce|all-to-all|reduce-scatter)"
    r"(?:-start)?\("
)
SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


def collective_bytes(hlo: str) -> dict:
    """Bytes of each collective kind's results in an HLO module's text (per device)."""
    out: dict = {}
    hlo = re.sub(r"/\*index=\d+\*/", "", hlo)  # tuple shapes carry these comments
    for m in COLLECTIVE.finditer(hlo):
        kind = m.group(2)
        n = 0
        for dt, dims in SHAPE.findall(m.group(1)):
            if dt in DTYPE_BYTES:
                size = 1
                for d in filter(None, dims.split(",")):
                    size *= int(d)
                n += size * DTYPE_BYTES[dt]
        out[kind] = out.get(kind, 0) + n
    return out


def per_layer(cfg, c: int, T: int) -> dict:
    """Forward bytes one layer of each kind receives per device (from the config; 0 without context)."""
    m = cfg.model
    act = jnp.dtype(m.compute_dtype).itemsize
    hkv = getattr(m, "n_kv_heads", m.n_heads)
    # the gathered K/V, plus the zigzag's queries in and outputs back (at most: a half that stays is not sent)
    zigzag = 0 if c == 1 else 2 * (T // c) * m.n_heads * m.head_dim * act
    out = {"full attention": int((c - 1) / c * T * 2 * hkv * m.head_dim * act) + zigzag}
    if getattr(m, "window", None):
        out[f"window {m.window}"] = 0 if c == 1 else (m.window - 1) * 2 * hkv * m.head_dim * act
    if hasattr(m, "chunk_size"):
        K = m.head_dim
        state = (c - 1) * m.n_heads * K * 2 * K * 4  # all-gathered [K, K] and [K, V] fp32, V = K
        conv = 0 if c == 1 else 3 * (m.conv_size - 1) * m.n_heads * K * act
        out["KDA"] = state + conv
    return out


def measure(folder: str, T: int, c: int) -> dict:
    train = load(os.path.join(ROOT, folder, "train.py"))
    cfg = train.TrainConfig(
        seq_len=T,
        batch_size=1,
        grad_accum=1,
        mesh_data=1,
        mesh_model=1,
        mesh_context=c,
        wandb="disabled",
        **({"mesh_expert": 1} if hasattr(train.TrainConfig, "mesh_expert") else {}),
    )
    mesh = train.make_mesh(cfg, jax.devices()[:c])
    opt, schedule = train.make_optimizer(cfg)
    with jax.set_mesh(mesh):
        state = jax.eval_shape(lambda: train.init_state(cfg, opt, jax.random.key(0)))
        s = NamedSharding(mesh, train.batch_spec(1))
        batch = {
            k: jax.ShapeDtypeStruct((1, 1, T), jnp.float32 if k == "loss_mask" else jnp.int32, sharding=s)
            for k in ("tokens", "targets", "segment_ids", "loss_mask")
        }
        compiled = jax.jit(train.make_train_step(cfg, opt, schedule)).lower(state, batch).compile()
        micro = {
            k: jax.ShapeDtypeStruct((1, T), v.dtype, sharding=NamedSharding(mesh, train.batch_spec(0)))
            for k, v in batch.items()
        }
        est = memory.estimate(state, lambda p, b: train.model.loss_fn(p, b, cfg.model)[0], micro)
    mem = compiled.memory_analysis()
    coll = collective_bytes(compiled.as_text())
    return {
        "folder": folder,
        "context": c,
        "temp": mem.temp_size_in_bytes,
        "residuals": est["activations"],
        "gathered": coll.get("all-gather", 0) + coll.get("collective-permute", 0),
        "reduced": coll.get("all-reduce", 0) + coll.get("reduce-scatter", 0),
        "collectives": coll,
        "per_layer": per_layer(cfg, c, T),
    }


ATTENTION_PATHS = {
    "whole row": dict(ZIGZAG=False, RING=False),
    "zigzag, all-gather": dict(ZIGZAG=True, RING=False),
    "zigzag, ring": dict(ZIGZAG=True, RING=True),
}


def time_attention(T: int, c: int, rounds: int, calls: int, heads=(8, 2, 64)) -> dict:
    """Full causal `context.attention` on one row of T tokens split over c devices, forward + backward,
    by each of ATTENTION_PATHS (shared/kernels/context.py's ZIGZAG and RING): {path: (per-round time
    ratios to "whole row", XLA's temporaries per device in bytes)}; the paths run interleaved, each round
    in a rotated order."""
    import time

    from jax.sharding import PartitionSpec as P

    from shared.kernels import context

    H, Hkv, D = heads
    mesh = jax.make_mesh(
        (1, c, 1),
        ("data", "context", "model"),
        axis_types=(jax.sharding.AxisType.Explicit,) * 3,
        devices=jax.devices()[:c],
    )
    ks = jax.random.split(jax.random.key(0), 3)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", "context", None, None)))  # noqa: E731
    q, k, v = (put(jax.random.normal(kk, (1, T, h, D))) for kk, h in zip(ks, (H, Hkv, Hkv)))
    saved = {name: getattr(context, name) for name in ("ZIGZAG", "RING")}
    fns, temp = {}, {}
    try:
        for path, flags in ATTENTION_PATHS.items():
            for name, value in flags.items():
                setattr(context, name, value)  # read while tracing
            loss = lambda q, k, v: jnp.sum(context.attention(q, k, v, causal=True, backend="reference") ** 2)  # noqa: E731
            with jax.set_mesh(mesh):
                compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
                jax.block_until_ready(compiled(q, k, v))
            fns[path], temp[path] = compiled, compiled.memory_analysis().temp_size_in_bytes
    finally:
        for name, value in saved.items():
            setattr(context, name, value)
    times = {p: [] for p in fns}
    order = list(fns)
    for i in range(rounds):
        for path in order[i % len(order) :] + order[: i % len(order)]:
            t = time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(fns[path](q, k, v))
            times[path].append(time.perf_counter() - t)
    base = times["whole row"]
    return {p: ([a / b for a, b in zip(ts, base)], temp[p]) for p, ts in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--folders", default=",".join(FOLDERS), help="comma-separated folders (default: the four variants)")
    ap.add_argument("--seq_len", type=int, default=8192, help="tokens a row (default 8192)")
    ap.add_argument("--contexts", default="1,2,4", help="context axis sizes, comma-separated (default 1,2,4)")
    ap.add_argument("--table", action="store_true", help="print a markdown table with the command and date")
    ap.add_argument(
        "--attention",
        action="store_true",
        help="instead: time full causal attention's forward + backward (8 heads, 2 kv heads, head_dim 64): "
        "each device against the whole row, the zigzag on the all-gathered row, the zigzag on a "
        "ring; per context size > 1, with XLA's temporaries per device",
    )
    ap.add_argument("--rounds", type=int, default=7, help="--attention: interleaved rounds (default 7)")
    ap.add_argument("--calls", type=int, default=3, help="--attention: calls a round (default 3)")
    args = ap.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    if max(contexts) > jax.device_count():
        ap.error(
            f"--contexts {args.contexts} needs {max(contexts)} devices, {jax.device_count()} here "
            "(XLA_FLAGS=--xla_force_host_platform_device_count=8)"
        )
    MiB = 2**20
    if args.attention:
        import statistics

        for c in [c for c in contexts if c > 1]:
            for path, (r, temp) in time_attention(args.seq_len, c, args.rounds, args.calls).items():
                logits = 1.0 if path == "whole row" else (2 * c + 2) / (4 * c)
                print(
                    f"full attention, seq_len {args.seq_len}, context {c}, {path}: forward + backward time / "
                    f"whole row {statistics.median(r):.3f} median ({min(r):.3f}-{max(r):.3f}) over {args.rounds} "
                    f"rounds of {args.calls} calls; logits {logits:.3f} of the whole row's; temporaries "
                    f"{temp / MiB:.1f} MiB per device",
                    flush=True,
                )
        return
    rows = []
    for folder in args.folders.split(","):
        base = None
        for c in contexts:
            r = measure(folder, args.seq_len, c)
            base = base or r
            rows.append(r)
            layer = ", ".join(f"{k} {v / MiB:.2f}" for k, v in r["per_layer"].items())
            print(
                f"{folder} context {c}: temp {r['temp'] / MiB:.1f} MiB ({r['temp'] / base['temp']:.2f}x of "
                f"context {contexts[0]}), residuals {r['residuals'] / MiB:.1f} MiB, gathered {r['gathered'] / MiB:.1f} MiB, "
                f"all-reduce + reduce-scatter {r['reduced'] / MiB:.1f} MiB ({', '.join(f'{k} {v / MiB:.2f}' for k, v in sorted(r['collectives'].items()))}); "
                f"a layer receives (MiB): {layer}",
                flush=True,
            )
    if args.table:
        cmd = "python tools/bench/bench_context.py " + " ".join(argv if argv is not None else sys.argv[1:])
        print(
            f"\n`{cmd}` on {jax.device_count()} CPU devices, {datetime.date.today()}, seq_len {args.seq_len}, "
            "one row a step; MiB per device\n"
        )
        print(
            "| folder | context | temporaries | vs context 1 | residuals | all-gather + permute | all-reduce + reduce-scatter | "
            "a layer receives (forward) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        first = {}
        for r in rows:
            first.setdefault(r["folder"], r)
            layer = "; ".join(f"{k} {v / MiB:.2f}" for k, v in r["per_layer"].items())
            print(
                f"| {r['folder']} | {r['context']} | {r['temp'] / MiB:.1f} | {r['temp'] / first[r['folder']]['temp']:.2f}x "
                f"| {r['residuals'] / MiB:.1f} | {r['gathered'] / MiB:.1f} | {r['reduced'] / MiB:.1f} | {layer} |"
            )


if __name__ == "__main__":
    main()
