"""Checking configs: `check`, `check_types`, and each field's own range or choices declared once.

Configs are dataclasses that check themselves in `__post_init__`, so a bad value is refused where it
is set (a flag, a preset, a Python caller), before anything compiles, with a message naming the field:

    check(ok, "model.n_heads", "must divide ...")    # raises ConfigError("model.n_heads: must divide ...")
    check_types(self, "model.")                      # every field holds its declared type
    check_fields(self, TRAIN_FIELDS)                 # types, then each field's own rule (below)

A rule is a function of one value returning None when the value is fine, else why it is not. The
rules every train.py's TrainConfig shares are `TRAIN_FIELDS`; a folder adds its own fields' rules
to that dict in its `__post_init__` (`TRAIN_FIELDS | {"mesh_expert": positive}`), and writes the
checks that span several fields (grad_accum divides batch_size, warmup below steps) as plain
`check` calls, visible where they are.
"""

from __future__ import annotations

import math
import os
import typing
from typing import Callable

from shared.errors import StencilError


class ConfigError(StencilError, ValueError):
    """A configuration that cannot work; the message names the field."""


def check(ok: bool, field: str, why: str, error: type = ConfigError) -> None:
    """Raise `error(f"{field}: {why}")` unless `ok` (`error`: a module's own ConfigError-like class)."""
    if not ok:
        raise error(f"{field}: {why}")


def check_types(config, prefix: str = "") -> None:
    """Every field of a config dataclass holds its declared type (a preset or a Python caller can pass
    anything): "false" is not a bool, 2.5 not an int; an int is fine where a float is declared."""
    for name, tp in typing.get_type_hints(type(config)).items():
        v = getattr(config, name)
        if tp is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        else:
            ok = isinstance(v, typing.get_origin(tp) or tp) and (tp is bool or not isinstance(v, bool))
        check(ok, prefix + name, f"must be {getattr(tp, '__name__', tp)}, got {v!r}")


# ---------------------------------------------------------------- rules: value -> None, or why not

Rule = Callable[[object], "str | None"]


def positive(v) -> str | None:
    return None if v > 0 and (not isinstance(v, float) or math.isfinite(v)) else f"must be positive, got {v}"


def at_least(lo) -> Rule:
    def rule(v):
        return None if v >= lo and (not isinstance(v, float) or math.isfinite(v)) else f"must be >= {lo}, got {v}"

    return rule


def in_range(lo, hi, *, lo_open: bool = False, hi_open: bool = False) -> Rule:
    """lo <= v <= hi, either end open; written as [lo, hi), (lo, hi] ... in the message."""
    text = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"

    def rule(v):
        ok = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
        return None if ok else f"must be in {text}, got {v}"

    return rule


def one_of(*choices) -> Rule:
    def rule(v):
        return None if v in choices else f"must be one of {', '.join(map(str, choices))}, got {v!r}"

    return rule


def path(v) -> str | None:
    """A local path that may be empty: no NUL byte, not an existing file (where a directory goes)."""
    if "\0" in v:
        return "contains a NUL byte"
    if v and os.path.isfile(os.path.expanduser(v)):
        return f"{v!r} is a file, not a directory"
    return None


def step_or_path(v) -> str | None:
    """--resume_from: "" (none), a positive step, or a checkpoint's path."""
    if "\0" in v:
        return "contains a NUL byte"
    if v.lstrip("-").isdigit() and int(v) <= 0:
        return f"a step must be positive, got {v}"
    return None


def check_fields(config, rules: dict[str, Rule], prefix: str = "") -> None:
    """`check_types`, then each rule on its field (a rule for a field this config lacks is skipped)."""
    check_types(config, prefix)
    for name, rule in rules.items():
        if hasattr(config, name):
            why = rule(getattr(config, name))
            check(why is None, prefix + name, why or "")


# The range or choices of the fields every TrainConfig has (templates/base/train.py says what each means) and
# of those of shared/run.py's RunConfig, which every TrainConfig derives from. What spans fields (grad_accum
# divides batch_size, warmup < steps) is checked in train.py.
TRAIN_FIELDS: dict[str, Rule] = {
    "seq_len": at_least(2),
    "batch_size": positive,
    "grad_accum": positive,
    "steps": positive,
    "stop_at": at_least(0),
    "optimizer": one_of("adamw", "muon", "muonh", "adamh"),
    "lr": positive,
    "min_lr_ratio": in_range(0, 1),
    "weight_decay": in_range(0, 1, hi_open=True),
    "beta1": in_range(0, 1, hi_open=True),
    "beta2": in_range(0, 1, hi_open=True),
    "grad_clip": at_least(0),
    "mesh_data": lambda v: None if v == -1 or v > 0 else f"must be -1 or positive, got {v}",
    "mesh_model": positive,
    "mesh_context": positive,
    "eval_every": at_least(0),
    "eval_batches": positive,
    "init_from": lambda v: (
        None
        if v == "" or (v.startswith("hf:") and len(v) > 3)
        else f"must be '' or hf:DIR (a Hugging Face model directory), got {v!r}"
    ),
    "sample_every": at_least(0),
    "sample_tokens": at_least(0),
    "seed": at_least(0),
}
# The run's fields: shared/run.py's RUN_FIELDS; the evaluation's: shared/evals/__init__.py's EVAL_FIELDS.
