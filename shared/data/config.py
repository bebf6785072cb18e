"""The data's settings (`--data.*`) and the parsing of a source or evaluation list: below both halves of
the data (shared/data/sources.py builds stores, shared/data/ reads them), which import it. The meaning of
each form is shared/data/'s docstring."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from shared.config import check
from shared.storage.tokenstore import DataError

NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_.-]*)=(.+)$")


def _check(ok: bool, name: str, why: str) -> None:
    check(ok, f"data.{name}", why, DataError)


@dataclass(frozen=True)
class DataConfig:
    # "stdlib"; text paths/globs (comma-separated); one .npy; a token store (folder or URL); or a mixture
    # name=path@weight,... (see shared/data/)
    source: str = "stdlib"
    weights: dict[str, float] = field(default_factory=dict)  # mixture weights by source name (YAML form); {} = @w / 1
    eval: str = ""  # extra evaluation sets: name=path,... (token stores or text sources)
    text_field: str = "text"  # field read from each JSONL line / Parquet column
    tokenizer: str = ""  # "" = the store's, or train a byte-level BPE on the text; or a tokenizer.json
    val_fraction: float = 0.02  # fraction of each source's documents held out (at least 1 document)
    max_bytes: int = 0  # cap on the text bytes read from a text source (0 = no cap)
    cache_dir: str = ""  # "" = $STENCIL_CACHE or ~/.cache/stencil
    seed: int = 0  # data order seed

    def __post_init__(self):
        _check(isinstance(self.source, str) and self.source.strip() != "", "source", "must name a source")
        named = [n for n, _, _ in parse_sources(self.source, self.weights) if n]  # each error names the field
        clash = [n for n, _ in parse_eval(self.eval) if n in named]
        _check(
            not clash,
            "eval",
            f"{clash} also name sources of data.source, whose held-out documents are "
            f"evaluated as eval/<source>/ already; give the extra sets other names",
        )
        _check(bool(self.text_field), "text_field", "must be a field name, got ''")
        _check(
            self.tokenizer == "" or self.tokenizer.endswith(".json"),
            "tokenizer",
            f"must be '' or a tokenizer .json file, got {self.tokenizer!r}",
        )
        _check(0.0 < self.val_fraction < 1.0, "val_fraction", f"must be in (0, 1), got {self.val_fraction}")
        _check(self.max_bytes >= 0, "max_bytes", f"must be >= 0 (0 = no cap), got {self.max_bytes}")
        _check("\0" not in self.cache_dir, "cache_dir", "contains a NUL byte")
        _check(
            not (self.cache_dir and os.path.isfile(os.path.expanduser(self.cache_dir))),
            "cache_dir",
            f"{self.cache_dir!r} is a file, not a directory",
        )
        _check(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")


def parse_sources(source: str, weights: dict | None = None) -> list[tuple[str, str, float]]:
    """[(name, spec, weight)]: one unnamed source ("", source, 1.0), or the named entries of a mixture."""
    weights = dict(weights or {})
    entries = [e.strip() for e in source.split(",") if e.strip()]
    named = [NAME.match(e) for e in entries]
    if not any(named):
        if weights:
            raise DataError(
                f"data.weights: names sources {sorted(weights)} but data.source {source!r} has no "
                "named sources (name=path,...)"
            )
        return [("", source.strip(), 1.0)]
    out = []
    for e, m in zip(entries, named):
        if not m:
            raise DataError(f"data.source: {e!r} has no name; in a mixture every entry is name=path[@weight]")
        name, spec = m.groups()
        w = None
        if "@" in spec:
            spec, _, ws = spec.rpartition("@")
            try:
                w = float(ws)
            except ValueError:
                raise DataError(f"data.source: weight {ws!r} of source {name!r} is not a number") from None
        if name in weights:
            if w is not None:
                raise DataError(f"data.weights: source {name!r} already has weight @{w:g} in data.source")
            w = float(weights.pop(name))
        if any(n == name for n, _, _ in out):
            raise DataError(f"data.source: source name {name!r} appears twice")
        out.append((name, spec, 1.0 if w is None else w))
    if weights:
        raise DataError(f"data.weights: unknown source(s) {sorted(weights)}; the sources are {[n for n, _, _ in out]}")
    for name, _, w in out:
        if not (math.isfinite(w) and w >= 0):
            raise DataError(f"data.weights: source {name!r} has weight {w}; weights must be finite and >= 0")
    if sum(w for _, _, w in out) <= 0:
        raise DataError(f"data.weights: the weights of {[n for n, _, _ in out]} sum to zero")
    return out


def parse_eval(spec: str) -> list[tuple[str, str]]:
    """[(name, path)] of data.eval = "name=path,..."."""
    out = []
    for e in (e.strip() for e in spec.split(",")):
        if not e:
            continue
        m = NAME.match(e)
        if not m:
            raise DataError(f"data.eval: {e!r} is not name=path")
        if m.group(1) in [n for n, _ in out] or m.group(1) == "val":
            raise DataError(f"data.eval: the name {m.group(1)!r} is used twice ('val' is the held-out split)")
        out.append(m.groups())
    return out
