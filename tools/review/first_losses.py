"""Every folder's first training losses, bit for bit, against a reference file: the proof that a change
meant to move code (not to change behaviour) changed nothing a run computes.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tools/review/first_losses.py --check tests/reference/first_losses.json
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tools/review/first_losses.py --write tests/reference/first_losses.json

Each folder of templates/ and variants/ trains STEPS steps at the contract's size (8 rows of 32 tokens,
the folder's CONTRACT_TINY, data 4 x model 2 on 8 CPU devices) on a corpus this script writes (seeded
words: no download, no dependence on the Python version's standard library), with one evaluation and a
sample at the end. The losses are written as exact hex floats. Bit-identity holds for the same versions
of JAX, jaxlib and tokenizers on the same kind of CPU; the file records them, and `--check` says when
they differ instead of comparing (regenerate the reference from the commit before the change).
tests/integration/test_first_losses.py runs `--check`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import sys
import tempfile
from importlib import metadata

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

from shared.variant import ROOT, discover, load  # noqa: E402

STEPS = 3
WORDS = (
    "def return class import self value index count list dict total items key data result "
    "if else for while in not and or None True False print open read write"
).split()


def versions() -> dict:
    return {
        "jax": jax.__version__,
        "jaxlib": metadata.version("jaxlib"),
        "tokenizers": metadata.version("tokenizers"),
        "machine": platform.machine(),
        "devices": jax.device_count(),
    }


def write_corpus(folder: str) -> str:
    """Twelve files of seeded pseudo-code; the glob of them."""
    rng = random.Random(0)
    for i in range(12):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(400)]
        with open(os.path.join(folder, f"doc{i:02d}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return os.path.join(folder, "*.txt")


def first_losses(folder: str, corpus: str, run_dir: str, cache: str) -> dict:
    train = load(os.path.join(ROOT, folder, "train.py"))
    own = dict(train.CONTRACT_TINY)
    model = dataclasses.replace(train.TrainConfig().model, **own.pop("model", {}))
    kw = dict(
        seq_len=32,
        batch_size=8,
        steps=STEPS,
        warmup_steps=0,
        mesh_data=-1,
        mesh_model=2,
        wandb="disabled",
        eval_every=STEPS,
        eval_batches=1,
        log_every=1,
        sample_tokens=4,
        run_dir=run_dir,
    )
    kw.update(own)
    data = train.data.DataConfig(source=corpus, val_fraction=0.1, cache_dir=cache)
    out = train.main(train.TrainConfig(model=model, data=data, **kw))
    return {
        "losses": {str(k): float(v).hex() for k, v in sorted(out["losses"].items())},
        "val_loss": float(out["val_loss"]).hex(),
    }


def measure() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(tmp)
        return {
            f: first_losses(f, corpus, os.path.join(tmp, "runs", f.replace("/", "_")), os.path.join(tmp, "cache"))
            for f in discover()
        }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/review/first_losses.py", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="FILE", help="measure and write the reference (a new file)")
    g.add_argument("--check", metavar="FILE", help="measure and compare with the reference; exit 1 on a difference")
    args = p.parse_args(argv)
    if jax.device_count() != 8:
        print("error: run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (8 CPU devices)", file=sys.stderr)
        return 2
    if args.write:
        if os.path.exists(args.write):
            print(f"error: {args.write} exists (nothing is overwritten); remove it first", file=sys.stderr)
            return 2
        with open(args.write, "x") as f:
            json.dump({"versions": versions(), "steps": STEPS, "folders": measure()}, f, indent=1)
            f.write("\n")
        print(f"wrote {args.write}")
        return 0
    ref = json.load(open(args.check))
    if ref["versions"] != versions():
        print(
            f"versions differ: the reference has {ref['versions']}, this machine {versions()}: not compared "
            "(regenerate the reference with --write from the commit before a change)"
        )
        return 3
    got = measure()
    bad = []
    for folder in sorted(set(got) | set(ref["folders"])):
        a, b = ref["folders"].get(folder), got.get(folder)
        print(f"{folder}: {'same' if a == b else 'DIFFERENT'}")
        if a != b:
            bad.append(f"{folder}: reference {a}, now {b}")
    for line in bad:
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
