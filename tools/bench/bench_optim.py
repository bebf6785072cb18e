"""The optimizers of shared/optim.py side by side: what share of a train step the optimizer takes, and
(with --sweep) the loss each reaches after a small learning-rate sweep.

    python tools/bench/bench_optim.py                                  # step share, dense, CPU default + larger
    python tools/bench/bench_optim.py --variant moe_hero --repeats 10
    python tools/bench/bench_optim.py --sweep --sweep_steps 220 --lrs 1e-3,3e-3,1e-2   # + final-loss table
    python tools/bench/bench_optim.py --configs '' --sweep --rows sweep.jsonl           # sweep only, resumable
    python tools/bench/bench_optim.py --configs '' --table --rows sweep.jsonl           # the table of every run in it

Step share: in one process, per optimizer and config, the median wall time of the jitted train step
(forward, backward, optimizer, on all devices) and of the optimizer alone (update + apply on the same
state and a gradient-shaped tree), each timed `--repeats` times after a warm-up call. The share is
their ratio; both programs run on the same mesh.

Sweep: train.main at the CPU default (same seed, data and steps for every run; `--sweep_steps`
shortens the schedule), per variant, optimizer and learning rate; the table gives the loss at the
last step and val_loss, and marks the best learning rate per optimizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from shared import optim  # noqa: E402
from shared.variant import load  # noqa: E402

LARGER = {"d_model": 256, "n_layers": 8, "d_ff": 768}  # the "larger CPU config": 4x the CPU default's matrices


def median_time(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def step_share(train, cfg, repeats: int) -> tuple[float, float]:
    """(median train step seconds, median optimizer-only seconds) for `cfg`."""
    mesh = train.make_mesh(cfg)
    opt, schedule = train.make_optimizer(cfg)
    rng = np.random.default_rng(0)
    rows = cfg.batch_size // cfg.grad_accum
    tokens = rng.integers(0, cfg.model.vocab_size, (cfg.batch_size, cfg.seq_len + 1)).astype(np.int32)
    batch = {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": np.ones((cfg.batch_size, cfg.seq_len), np.int32),
        "loss_mask": np.ones((cfg.batch_size, cfg.seq_len), np.float32),
    }
    assert rows * cfg.grad_accum == cfg.batch_size
    with jax.set_mesh(mesh):
        state = jax.jit(lambda k: train.init_state(cfg, opt, k))(jax.random.key(0))
        b = train.to_device(batch, mesh, (cfg.grad_accum,))
        step = train.make_train_step(cfg, opt, schedule)
        grads = jax.tree.map(lambda p: p * 1e-3, state["params"])

        @jax.jit
        def opt_only(params, opt_state, grads):
            u, o = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, u), o

        box = {"state": step(state, b)[0]}  # warm-up (compile)

        def run_step():
            box["state"], m = step(box["state"], b)
            return m["train/loss"]

        t_step = median_time(run_step, repeats)
        s = box["state"]
        jax.block_until_ready(opt_only(s["params"], s["opt"], grads))
        t_opt = median_time(lambda: opt_only(s["params"], s["opt"], grads), repeats)
    return t_step, t_opt


def sweep(variant: str, names, lrs, steps: int, work: str, rows_file: str = "") -> list[dict]:
    """One train.main run per optimizer and learning rate. With `rows_file`, each finished run is
    appended to it as a JSON line and a run already there is not repeated (an interrupted sweep resumes)."""
    done = {}
    if rows_file and os.path.exists(rows_file):
        with open(rows_file) as f:
            for line in f:
                r = json.loads(line)
                done[(r["variant"], r["optimizer"], r["lr"], r["steps"])] = r
    rows = []
    for name in names:
        for lr in lrs:
            if (variant, name, lr, steps) in done:
                rows.append(done[(variant, name, lr, steps)])
                print(f"sweep {variant} {name} lr {lr:g}: from {rows_file}", flush=True)
                continue
            train = load(os.path.join(ROOT, "variants", variant, "train.py"))
            cfg = train.TrainConfig(
                optimizer=name,
                lr=lr,
                steps=steps,
                eval_every=steps,
                log_every=steps,
                save_every=0,
                wandb="disabled",
                sample_tokens=0,
                run_dir=os.path.join(work, f"{variant}-{name}-{lr:g}"),
            )
            t = time.perf_counter()
            out = train.main(cfg)
            rows.append(
                {
                    "variant": variant,
                    "optimizer": name,
                    "lr": lr,
                    "steps": steps,
                    "loss": out["losses"][steps],
                    "val_loss": out["val_loss"],
                    "s": time.perf_counter() - t,
                }
            )
            if rows_file:
                with open(rows_file, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
            print(
                f"sweep {variant} {name} lr {lr:g}: loss {rows[-1]['loss']:.4f} val {rows[-1]['val_loss']:.4f} "
                f"({rows[-1]['s']:.0f} s)",
                flush=True,
            )
    return rows


def sweep_table(rows: list[dict]) -> list[str]:
    """Markdown: per variant, optimizer and run length, the loss at the last step and val_loss for each
    learning rate tried (* = the best last-step loss; the lowest learning rate first)."""
    out = [
        "Learning-rate sweep (CPU default model, batch and data, seed 0): loss at the last step / val_loss "
        "per learning rate; * = best",
        "",
        "| variant | steps | optimizer | loss / val_loss at each learning rate | best lr | val_loss at best |",
        "|---|---|---|---|---|---|",
    ]
    groups = {}
    for r in rows:
        groups.setdefault((r["variant"], r["steps"], r["optimizer"]), {})[r["lr"]] = r
    order = {n: i for i, n in enumerate(optim.OPTIMIZERS)}
    for v, steps, name in sorted(groups, key=lambda k: (k[0], k[1], order.get(k[2], 99))):
        rs = [groups[(v, steps, name)][lr] for lr in sorted(groups[(v, steps, name)])]
        best = min(rs, key=lambda r: r["loss"])
        cells = ", ".join(
            f"{r['lr']:g}: {r['loss']:.3f} / {r['val_loss']:.3f}" + ("*" if r is best else "") for r in rs
        )
        out.append(f"| {v} | {steps} | {name} | {cells} | {best['lr']:g} | {best['val_loss']:.3f} |")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="dense", help="folder under variants/ for the step share (default dense)")
    ap.add_argument("--optimizers", default=",".join(optim.OPTIMIZERS))
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per program (median)")
    ap.add_argument("--configs", default="default,larger", help="which of: default (the CPU default), larger")
    ap.add_argument("--sweep", action="store_true", help="also the learning-rate sweep on dense and moe_hero")
    ap.add_argument("--sweep_variants", default="dense,moe_hero")
    ap.add_argument("--sweep_steps", type=int, default=220, help="steps per sweep run (220 = the CPU default)")
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="learning rates of the sweep")
    ap.add_argument(
        "--rows",
        default="",
        help="sweep: append each run's result here (JSON lines) and skip "
        "runs already in it, so that an interrupted sweep resumes",
    )
    ap.add_argument("--table", action="store_true", help="print the sweep table of every run in --rows")
    ap.add_argument("--out", default="", help="also write the tables (Markdown) here")
    args = ap.parse_args(argv)
    names = [n for n in args.optimizers.split(",") if n]
    bad = [n for n in names if n not in optim.OPTIMIZERS]
    if bad:
        sys.exit(f"error: unknown optimizers {bad}; known: {optim.OPTIMIZERS}")
    train = load(os.path.join(ROOT, "variants", args.variant, "train.py"))
    base = train.TrainConfig(wandb="disabled")
    wanted = [c for c in args.configs.split(",") if c]
    if not set(wanted) <= {"default", "larger"}:
        sys.exit(f"error: --configs takes default and/or larger, got {args.configs!r}")
    configs = {}
    if "default" in wanted:
        configs["CPU default"] = base
    if "larger" in wanted:
        configs["larger (" + ", ".join(f"{k}={v}" for k, v in LARGER.items()) + ")"] = dataclasses.replace(
            base, model=dataclasses.replace(base.model, **LARGER)
        )
    lines = (
        [
            f"Optimizer step share, {args.variant}, {len(jax.devices())} {jax.devices()[0].platform} device(s), "
            f"median of {args.repeats}",
            "",
            "| config | optimizer | train step (ms) | optimizer alone (ms) | share |",
            "|---|---|---|---|---|",
        ]
        if configs
        else []
    )
    for label, cfg in configs.items():
        for name in names:
            t_step, t_opt = step_share(train, dataclasses.replace(cfg, optimizer=name), args.repeats)
            lines.append(f"| {label} | {name} | {t_step * 1e3:.1f} | {t_opt * 1e3:.1f} | {t_opt / t_step:.1%} |")
            print(lines[-1], flush=True)
    if args.sweep:
        lrs = [float(x) for x in args.lrs.split(",")]
        with tempfile.TemporaryDirectory(prefix="bench-optim-") as work:
            rows = [
                r
                for v in args.sweep_variants.split(",")
                for r in sweep(v, names, lrs, args.sweep_steps, work, args.rows)
            ]
        lines += [""] + sweep_table(rows)
    if args.table:
        if not args.rows or not os.path.exists(args.rows):
            sys.exit("error: --table prints the sweep table of the --rows file; give an existing one")
        with open(args.rows) as f:
            lines += [""] + sweep_table([json.loads(line) for line in f])
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
