"""Training documents of a capability probe (shared/evals/probes.py), for a data mixture.

    python -m shared.probes write mqar --source stdlib --vocab_size 4096 --out /tmp/mqar   # training data for a mixture

`write` makes the documents of one probe as a .npy of token ids (each ends at eos) and the tokenizer.json
they are ids of, for a mixture source (`--data.source text=stdlib@0.9,mqar=/tmp/mqar/mqar.npy@0.1
--data.tokenizer /tmp/mqar/tokenizer.json`). The documents use the same roles as the evaluation sets
(the same tokens for keys, values, markers, filler) but never the same sequences (`--seed`, 0 by default;
the evaluation sets use 1, 2, ...).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from shared import data
from shared.data import sources
from shared.config import ConfigError
from shared.errors import StencilError
from shared.evals.probes import KINDS, ProbeConfig, make_set, run_roles, set_names


def write(args) -> int:
    cfg = ProbeConfig(
        sets=args.kind,
        mqar_pairs=args.mqar_pairs,
        mqar_gap=args.mqar_gap,
        passkey_depths=args.passkey_depth,
        passkey_len=args.passkey_len,
        copy_len=args.copy_len,
    )
    if args.seq_len < 2:
        raise ConfigError(f"--seq_len must be at least 2, got {args.seq_len}")
    cfg.check_fits(args.seq_len)
    if args.kind == "passkey" and len(cfg.depths()) != 1:
        raise ConfigError("probes.passkey_depth: give one depth for training documents")
    if args.n < 1:
        raise ConfigError(f"--n must be positive, got {args.n}")
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        raise ConfigError(f"--out {args.out} exists and is not an empty directory (nothing is overwritten)")
    if args.tokenizer:
        tok = sources.load_tokenizer(args.tokenizer)[0]
        eos = sources.eos_id_of(tok)
    else:  # the tokenizer the run will use: the one this source trains (cached)
        corpus = data.load_corpus(data.DataConfig(source=args.source), args.vocab_size, progress=True)
        tok, eos = corpus.tokenizer, corpus.eos_id
    if tok is None:
        raise ConfigError(f"--source {args.source}: has no tokenizer; pass --tokenizer")
    roles = run_roles(tok, args.vocab_size, eos)
    name = set_names(cfg)[0]
    tokens, _ = make_set(name, cfg, roles, args.seq_len, args.n, seed=args.seed)
    os.makedirs(args.out, exist_ok=True)
    np.save(os.path.join(args.out, f"{args.kind}.npy"), tokens.ravel())
    tok.save(os.path.join(args.out, "tokenizer.json"))
    print(
        f"wrote {args.n} {name} documents of {args.seq_len + 1} tokens to {args.out}/{args.kind}.npy, and the "
        f"tokenizer they are ids of to {args.out}/tokenizer.json",
        file=sys.stderr,
    )
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m shared.probes", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="documents of one probe as a .npy (for a data mixture) and their tokenizer.json")
    w.add_argument("kind", choices=KINDS)
    w.add_argument("--out", required=True, help="a new (or empty) directory")
    w.add_argument(
        "--source",
        default="stdlib",
        help="the text source whose tokenizer to use (data.source; default stdlib, the CPU default's)",
    )
    w.add_argument("--tokenizer", default="", help="a tokenizer.json instead of the source's")
    w.add_argument("--vocab_size", type=int, default=4096, help="the run's model.vocab_size (default 4096)")
    w.add_argument("--seq_len", type=int, default=128, help="the run's seq_len: each document is seq_len + 1 tokens")
    w.add_argument("--n", type=int, default=2000, help="documents (default 2000)")
    w.add_argument("--seed", type=int, default=0, help="the evaluation sets use seeds 1, 2, ...; default 0")
    w.add_argument("--mqar_pairs", type=int, default=ProbeConfig.mqar_pairs)
    w.add_argument("--mqar_gap", type=int, default=ProbeConfig.mqar_gap)
    w.add_argument("--passkey_depth", default="0.5")
    w.add_argument("--passkey_len", type=int, default=ProbeConfig.passkey_len)
    w.add_argument("--copy_len", type=int, default=ProbeConfig.copy_len)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return write(args)
    except StencilError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
