"""What every launcher shares: the repository root and the train.py command line of a variant."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def variants() -> list[str]:
    d = os.path.join(ROOT, "variants")
    return sorted(v for v in os.listdir(d) if os.path.exists(os.path.join(d, v, "train.py")))


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant", default="dense", help=f"one of {', '.join(variants())} (default dense)")
    p.add_argument("--preset", default=None, help="the variant's presets/NAME.yaml (default: none)")
    p.add_argument("overrides", nargs=argparse.REMAINDER,
                   help="after --: flags passed through to train.py, e.g. -- --steps 1000 --model.n_layers 8")


def train_args(args: argparse.Namespace, python: str = "python") -> list[str]:
    """[python, variants/<variant>/train.py, --preset P, *overrides], paths relative to the repo root."""
    if args.variant not in variants():
        sys.exit(f"error: unknown variant {args.variant!r}; variants: {variants()}")
    presets = os.path.join(ROOT, "variants", args.variant, "presets")
    if args.preset is not None and not os.path.exists(os.path.join(presets, args.preset + ".yaml")):
        sys.exit(f"error: variant {args.variant} has no preset {args.preset!r} (in {presets})")
    over = list(args.overrides)
    if over and over[0] == "--":
        over = over[1:]
    cmd = [python, f"variants/{args.variant}/train.py"]
    if args.preset:
        cmd += ["--preset", args.preset]
    return cmd + over


def has_flag(cmd: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in cmd)


def shell(cmd: list[str]) -> str:
    """A shell line; arguments holding $VAR stay expandable (double quotes), the rest are quoted."""
    return " ".join(f'"{a}"' if "$" in a and '"' not in a else shlex.quote(a) for a in cmd)


def write_output(text: str, path: str, next_step: str) -> int:
    """Write a generated file to `path` ("-" = stdout) and say how to use it."""
    if path == "-":
        sys.stdout.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}; {next_step} {path}", file=sys.stderr)
    return 0
