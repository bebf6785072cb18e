"""Command line for a variant's train.py: draccus over the TrainConfig dataclass, plus presets.

    python variants/dense/train.py                       # built-in CPU default
    python variants/dense/train.py --preset 125m         # variants/dense/presets/125m.yaml
    python variants/dense/train.py --model.n_layers 8 --steps 1000
    python variants/dense/train.py --help                # every field, and the presets

A preset is a YAML file of overrides; flags given after it win.

A resume (`--resume true`, `--resume_from`) starts from the run's own settings, its config.json, then
the preset and flags given now on top; it says which settings the flags changed (the run refuses a
change a resume cannot make). config.json is also a valid `--config_path` for a new run.

Under a multi-process launcher (SLURM, Kubernetes, a TPU slice, launch/local.py; see
shared/runtime/distributed.py) `parse` also starts JAX's distributed runtime, checks that every
process parsed the same config, and makes an uncaught exception on process i stop the run
with "process i failed: ...".
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import logging
import os
import tempfile
import re
import sys
import typing

import draccus
import yaml
from draccus.argparsing import ArgumentParser
from draccus.help_formatter import SimpleHelpFormatter

from shared import run
from shared.runtime import distributed, guard
from shared.errors import StencilError


class HelpFormatter(SimpleHelpFormatter):
    """draccus's help layout, with a field's help text taken literally. argparse expands help strings
    with `%` formatting, so a comment such as `(i+1) % global_every` would crash `--help`; the text is
    escaped here, where help is built, so that no comment has to avoid `%`. A field without a comment
    still shows its default."""

    NO_HELP = "\0"  # a field without a comment: its help line is its default

    def _format_action(self, action):
        if not (action.help or "").strip() and action.option_strings:
            action = copy.copy(action)
            action.help = self.NO_HELP
        return super()._format_action(action)

    def _expand_help(self, action):
        if action.help == self.NO_HELP:
            return f"(default: {action.default})"
        if action.help and "%" in action.help:
            action = copy.copy(action)
            action.help = action.help.replace("%", "%%")
        return super()._expand_help(action)


def presets(variant_dir: str) -> dict[str, str]:
    d = os.path.join(variant_dir, "presets")
    if not os.path.isdir(d):
        return {}
    return {f[:-5]: os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".yaml")}


def _str_fields(cls, prefix: str = "") -> set[str]:
    """Dotted names of the `str` fields of a config dataclass and its nested dataclasses."""
    out = set()
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            out |= _str_fields(tp, f"{prefix}{name}.")
        elif tp is str:
            out.add(prefix + name)
    return out


def _quote_strings(cls, argv: list[str]) -> list[str]:
    """Quote the values of string flags for YAML, which draccus parses them with: unquoted, `5:6` is
    the integer 306 (YAML 1.1 base 60), `1e3` a float and `no` a bool, then turned back into text."""
    strings, out, i = _str_fields(cls), [], 0
    quote = lambda v: "'" + v.replace("'", "''") + "'"  # noqa: E731
    while i < len(argv):
        a = argv[i]
        name, eq, value = a[2:].partition("=")
        if a.startswith("--") and name in strings:
            if eq:
                out.append(f"--{name}={quote(value)}")
            elif i + 1 < len(argv):
                out += [a, quote(argv[i + 1])]
                i += 1
            else:
                out.append(a)
        else:
            out.append(a)
        i += 1
    return out


def _flag_names(cls, prefix: str = "") -> tuple[set[str], set[str]]:
    """(every flag name of a config dataclass, dotted; the names of its dict fields, whose keys may follow)."""
    names, dicts = set(), set()
    for name, tp in typing.get_type_hints(cls).items():
        names.add(prefix + name)
        if dataclasses.is_dataclass(tp):
            sub, subdicts = _flag_names(tp, f"{prefix}{name}.")
            names, dicts = names | sub, dicts | subdicts
        elif typing.get_origin(tp) is dict:
            dicts.add(prefix + name)
    return names, dicts


def unknown_flag(cls, argv: list[str]) -> str | None:
    """One line for the first flag that is no field of `cls`, with the closest names, or None."""
    names, dicts = _flag_names(cls)
    names |= {"help", "config_path"}
    for a in argv:
        if not a.startswith("--"):
            continue
        name = a[2:].partition("=")[0]
        if name in names or any(name.startswith(d + ".") for d in dicts):
            continue
        near = difflib.get_close_matches(name, sorted(names), n=3, cutoff=0.6)
        return (
            f"unknown flag --{name}"
            + (f"; did you mean {' or '.join('--' + n for n in near)}?" if near else "")
            + " (--help lists every flag)"
        )
    return None


def _flag_error(e: BaseException) -> str:
    """One line for a bad command line: a value that does not parse names its flag and the type expected;
    a value the config refuses gives the config's own message (which names the field)."""
    chain = []
    while e is not None:
        chain.append(e)
        e = e.__cause__ or (e.__context__ if not e.__suppress_context__ else None)
    for x in chain:
        m = re.match(r"`([\w.]+)`: (.*)", str(x))
        if type(x).__name__ == "DecodingError" and m and "of type dict[" in m.group(2):  # a mapping field
            value = re.search(r"value=(.*?) into field", m.group(2))
            return (
                f"--{m.group(1)}: {value.group(1) if value else 'the value'} is not a mapping; give it as YAML, "
                f"e.g. --{m.group(1)} '{{a: 0.7, b: 0.3}}'"
            )
        if type(x).__name__ == "DecodingError" and m:
            why = "" if x is chain[-1] else f" ({chain[-1]})"
            return f"--{m.group(1)}: {m.group(2)[0].lower()}{m.group(2)[1:]}{why}"
    return str(chain[-1])


def known_fields(cls, saved: dict) -> dict:
    """`saved` (a config.json) without the keys `cls` lacks (an older run's "peak", "kernels"; a removed field)."""
    hints, out = typing.get_type_hints(cls), {}
    for k, v in saved.items():
        if k in hints:
            out[k] = known_fields(hints[k], v) if dataclasses.is_dataclass(hints[k]) and isinstance(v, dict) else v
    return out


def merge(base: dict, over: dict) -> dict:
    """`base` with `over` on top, nested dicts merged key by key (a preset over a run's settings)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def flat(d: dict, cls, prefix: str = "") -> dict:
    """{dotted field name: value} of a config dict of dataclass `cls` (a dict-valued field stays one value)."""
    hints, out = typing.get_type_hints(cls), {}
    for k, v in d.items():
        nested = k in hints and dataclasses.is_dataclass(hints[k]) and isinstance(v, dict)
        out |= flat(v, hints[k], f"{prefix}{k}.") if nested else {prefix + k: v}
    return out


def runs_settings(config, variant_dir: str) -> tuple[str, str] | None:
    """(run directory, its config.json) of the run `config` resumes, or None: a fresh run, a run directory
    without a config.json (a --resume_from URL starts a new one), or none found (the run says why)."""
    if not (config.resume or config.resume_from):
        return None
    try:
        run_dir = run.pick_run_dir(config, os.path.basename(os.path.abspath(variant_dir)))
    except StencilError:
        return None
    path = os.path.join(run_dir, "config.json")
    return (run_dir, path) if os.path.isfile(path) else None


def parse(config_cls, variant_dir: str, argv: list[str] | None = None):
    """Parse argv into `config_cls`; exits with one clear line on a bad flag or invalid value. Parsing the
    process's own command line (`argv` None) also takes its stop signals: until the run's first step a
    signal exits at once, nothing lost (shared/runtime/guard.py, StopSignals)."""
    own = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    log = logging.getLogger("stencil")  # shared/ logs its choices (e.g. the attention backend) here
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False  # printed once, by this handler, even after a library sets up the root logger
    known = presets(variant_dir)
    preset = None
    for i, a in enumerate(argv):
        if a == "--preset" and i + 1 < len(argv):
            preset = argv[i + 1]
            del argv[i : i + 2]
            break
        if a.startswith("--preset="):
            preset = a.split("=", 1)[1]
            del argv[i]
            break
    if preset is not None and preset not in known:
        sys.exit(f"error: unknown preset {preset!r} for {os.path.basename(variant_dir)}; presets: {sorted(known)}")
    helping = "-h" in argv or "--help" in argv
    if not helping:
        try:
            distributed.initialize()  # before anything touches a JAX backend
        except distributed.DistributedError as e:
            sys.exit(f"error: {e}")
        if own:  # after jax.distributed, which installs a SIGTERM handler of its own
            guard.STOP = guard.StopSignals(starting=True)
    if helping:
        print(
            f"presets (--preset NAME, from {os.path.relpath(variant_dir)}/presets/): "
            f"{', '.join(known) or 'none'}; no preset = the built-in CPU default\n"
        )
    if not helping and unknown_flag(config_cls, argv):
        sys.exit(f"error: {unknown_flag(config_cls, argv)}")
    try:
        parser = ArgumentParser(
            config_cls, config_path=known.get(preset), formatter_class=HelpFormatter, exit_on_error=True
        )
        config = parser.parse_args(_quote_strings(config_cls, argv))
        found = runs_settings(config, variant_dir)
        if found:  # a resume: the run's settings, then the preset and the flags given now
            run_dir, path = found
            with open(path) as f:
                saved = known_fields(config_cls, json.load(f))
            base = merge(saved, yaml.safe_load(open(known[preset])) or {}) if preset else saved
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump({**base, "run_dir": run_dir}, f)
            try:
                parser = ArgumentParser(
                    config_cls, config_path=f.name, formatter_class=HelpFormatter, exit_on_error=True
                )
                config = parser.parse_args(_quote_strings(config_cls, argv))
            finally:
                os.unlink(f.name)
            was, now = flat(saved, config_cls), flat(run.settings(config), config_cls)
            changed = [
                f"--{k} {was[k]!r} -> {now[k]!r}"
                for k in sorted(now)
                if k in was and was[k] != now[k] and k != "run_dir"
            ]
            log.info(
                f"resume: the settings of {path}"
                + (f"; changed now: {', '.join(changed)}" if changed else ", none changed")
            )
    except draccus.utils.ParsingError as e:
        sys.exit(f"error: invalid configuration: {_flag_error(e)}")
    distributed.install_failure_hook()
    try:
        distributed.check_same_config(config)
    except distributed.DistributedError as e:
        sys.exit(f"error: {e}")
    return config
