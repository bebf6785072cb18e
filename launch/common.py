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
    p.add_argument(
        "overrides",
        nargs=argparse.REMAINDER,
        help="after --: flags passed through to train.py, e.g. -- --steps 1000 --model.n_layers 8",
    )


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


def flag_value(cmd: list[str], flag: str) -> str | None:
    """The value of the last `flag V` / `flag=V` in cmd (None if absent)."""
    value = None
    for i, a in enumerate(cmd):
        if a == flag and i + 1 < len(cmd):
            value = cmd[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


# Exit codes of train.py (shared/runtime/guard.py): stopped on a signal after saving a checkpoint, and aborted
# by the hang watchdog (stacks written). Both mean "start me again": the scheduler resumes the run.
EXIT_PREEMPTED, EXIT_HUNG = 75, 70

# A committed checkpoint, as shared/storage/checkpoint.py names it: step_XXXXXXXX/metadata.json, its commit
# record (a partial save, or a `.tmp` / `.deleting` leftover, has none). train.py needs --resume true
# exactly when one is there.
CHECKPOINT_GLOB = "step_" + "[0-9]" * 8 + "/metadata.json"


def if_checkpoint(cmd: list[str], run_dir_sh: str, then: str) -> str:
    """A POSIX sh line that runs `then` when the run's checkpoint directory holds a committed
    checkpoint: `--checkpoint_dir` of `cmd` if set, else <run_dir>/checkpoints (run_dir_sh is
    already a shell word, "$RUN_DIR"). A local directory is looked at with a glob; a gs:// or s3://
    one is listed by `python -m shared.checkpoint list` (with cmd's python, in the repository),
    and a store that cannot be listed stops the script (exit 1) instead of starting the run over.
    A damaged newest checkpoint still counts, so train.py names it and stops instead of starting over."""
    where = flag_value(cmd, "--checkpoint_dir")
    if where and where.startswith(("gs://", "s3://")):
        q = shlex.quote(where)
        return (
            f"{shlex.quote(cmd[0])} -m shared.checkpoint list --quiet {q} && ckpt_rc=0 || ckpt_rc=$?; "
            f'if [ "$ckpt_rc" = 0 ]; then {then}; elif [ "$ckpt_rc" != 1 ]; then '
            f'echo "stencil: cannot list the checkpoints in {where} (see above); not starting" >&2; exit 1; fi'
        )
    if where:
        folder = shlex.quote(where[len("file://") :] if where.startswith("file://") else where)
    else:
        folder = f"{run_dir_sh}/checkpoints"
    return f'for ckpt in {folder}/{CHECKPOINT_GLOB}; do if [ -f "$ckpt" ]; then {then}; fi; done'


def refuse_resume_flags(cmd: list[str], launcher: str) -> None:
    """A requeued or restarted job runs the same command again, so the launcher decides --resume."""
    why = {
        "--resume": "to continue a run, pass its --run_dir",
        "--resume_from": "a restart would go back to that checkpoint; copy it into the checkpoint directory instead",
    }
    for flag, hint in why.items():
        if has_flag(cmd, flag):
            sys.exit(
                f"error: {launcher} adds --resume true itself when the checkpoint directory (<run_dir>/checkpoints "
                f"or --checkpoint_dir) holds a checkpoint, "
                f"so a restarted job continues where it stopped; drop {flag} ({hint})"
            )


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
