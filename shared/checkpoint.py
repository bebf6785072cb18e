"""`python -m shared.checkpoint list DIR`: the committed checkpoints of a directory on any storage, for the
launchers' resume check (launch/). The library is shared/storage/checkpoint.py."""

from __future__ import annotations

import argparse
import sys

from shared.storage import checkpoint, objstore


def main(argv=None) -> int:
    """`python -m shared.checkpoint list DIR`: the committed checkpoints in DIR (any location this
    module takes), oldest first, one per line with what `verify` finds wrong (nothing for a good
    one). Exit 0 if there is one, 1 if there is none, 2 if DIR cannot be listed. The launchers use
    it to decide `--resume true` for a `--checkpoint_dir` on object storage."""
    ap = argparse.ArgumentParser(prog="python -m shared.checkpoint", description=main.__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    ls = sub.add_parser(
        "list", help="committed checkpoints in DIR; exit 0 if any, 1 if none, 2 if DIR cannot be listed"
    )
    ls.add_argument("directory", metavar="DIR")
    ls.add_argument("--quiet", action="store_true", help="print nothing; the exit code says it")
    args = ap.parse_args(argv)
    before = objstore.REQUEST_RETRIES
    objstore.REQUEST_RETRIES = {"max_retries": 5, "initial_delay": "0.5s", "max_delay": "5s"}
    try:  # an answer within about 15 s, also from a store that does not answer
        return _list(args)
    finally:
        objstore.REQUEST_RETRIES = before


def _list(args) -> int:
    why = checkpoint.location_error(args.directory)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        found = checkpoint._step_dirs(
            args.directory
        )  # committed, damaged or not: train.py names a damaged one and stops
        problems = {d: checkpoint.verify(d) for d in found} if not args.quiet else {}
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: cannot list {args.directory}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    for d in found if not args.quiet else []:
        print(d + ("" if not problems[d] else "  DAMAGED: " + "; ".join(problems[d])))
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
