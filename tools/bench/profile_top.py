"""The top ops of a captured profile, by self time, and the time per named scope.

    python variants/dense/train.py --profile_steps 20:24      # writes <run_dir>/profile
    python tools/bench/profile_top.py runs/dense-.../profile         # the table below
    python tools/bench/profile_top.py runs/dense-.../profile --top 30 --csv top.csv

Reads the newest `*.xplane.pb` under the directory (what `jax.profiler` writes; open the same
directory in xprof or TensorBoard's profile plugin, `pip install xprof`, for the timeline). An
op's self time is its duration less the ops nested inside it on the same thread. Ops are XLA's
(fusions, custom calls, GPU kernels), identified by the `hlo_op` the profiler records; the
scope column comes from the compiled program's text that the train loop saves beside the
trace (`jit_train_step.hlo.txt`): the `jax.named_scope`s the op was traced under, such as
`layer/attention`, with `(bwd)` for ops of the backward pass. Without that file the scope
column is empty.
"""

from __future__ import annotations

import argparse
import collections
import csv
import glob
import os
import re
import sys

# components of an op_name that JAX's transformations add, not the model's scopes
_WRAPPERS = {
    "while",
    "body",
    "cond",
    "closed_call",
    "checkpoint",
    "rematted_computation",
    "remat",
    "scan",
    "branch_0_fun",
    "branch_1_fun",
}


def scope_of(op_name: str) -> str:
    """ "jit(train_step)/while/body/transpose(jvp())/layer/attention/dot_general" -> "layer/attention (bwd)"."""
    parts = []
    for p in op_name.split("/")[1:-1]:  # not jit(<function>), nor the primitive at the end
        while p.endswith(")") and "(" in p:  # a scope seen through a transformation: jvp(loss) is loss
            p = p[p.index("(") + 1 : -1]
        if p and p not in _WRAPPERS:
            parts.append(p)
    return "/".join(parts) + (" (bwd)" if "transpose(" in op_name else "")


def hlo_scopes(directory: str) -> dict[tuple[str, str], str]:
    """(module, op) -> scope, from every `<module>.hlo.txt` under `directory`."""
    out = {}
    for path in glob.glob(os.path.join(directory, "**", "*.hlo.txt"), recursive=True):
        module = os.path.basename(path)[: -len(".hlo.txt")]
        with open(path) as f:
            for m in re.finditer(r'^\s*(?:ROOT )?%?([\w.-]+) = .*?metadata=\{[^}]*op_name="([^"]*)"', f.read(), re.M):
                out[(module, m.group(1))] = scope_of(m.group(2))
    return out


def newest_trace(directory: str) -> str:
    found = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
    if not found:
        raise FileNotFoundError(f"{directory}: no *.xplane.pb (capture one with --profile_steps A:B)")
    return max(found, key=os.path.getmtime)


def self_times(path: str) -> list[dict]:
    """Per (module, op): self time (ns) and calls, over every thread or stream of the trace."""
    from jax.profiler import ProfileData

    totals = collections.defaultdict(lambda: [0.0, 0])
    for plane in ProfileData.from_file(path).planes:
        for line in plane.lines:
            events = sorted(((e.start_ns, e.duration_ns, dict(e.stats)) for e in line.events), key=lambda e: e[0])
            stack = []  # [end, key or None, self] of the enclosing events
            done = []
            for start, dur, stats in events:
                while stack and stack[-1][0] <= start:
                    done.append(stack.pop())
                if stack:
                    stack[-1][2] -= dur
                key = (stats.get("hlo_module", "?"), stats["hlo_op"]) if "hlo_op" in stats else None
                stack.append([start + dur, key, dur])
            done += stack
            for _, key, own in done:
                if key is not None:
                    totals[key][0] += max(own, 0.0)
                    totals[key][1] += 1
    return [{"module": k[0], "op": k[1], "self_ns": v[0], "calls": v[1]} for k, v in totals.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument("directory", help="a profile directory (<run_dir>/profile) or any folder above a trace")
    ap.add_argument("--top", type=int, default=20, help="rows of the op table (default 20)")
    ap.add_argument("--csv", default="", help="also write every op's row to this CSV file")
    args = ap.parse_args(argv)
    try:
        path = newest_trace(args.directory)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = sorted(self_times(path), key=lambda r: -r["self_ns"])
    if not rows:
        print(f"error: {path}: no XLA ops in the trace", file=sys.stderr)
        return 2
    scopes = hlo_scopes(args.directory)
    for r in rows:
        r["scope"] = scopes.get((r["module"], r["op"]), "")
    total = sum(r["self_ns"] for r in rows)
    print(f"{path}: {len(rows)} ops, {total / 1e6:.1f} ms of op self time\n")
    print(f"{'self ms':>9} {'%':>6} {'calls':>6}  {'op':<44} scope")
    for r in rows[: args.top]:
        print(
            f"{r['self_ns'] / 1e6:9.2f} {100 * r['self_ns'] / total:5.1f}% {r['calls']:6d}  {r['op'][:44]:<44} {r['scope']}"
        )
    by_scope = collections.Counter()
    for r in rows:
        by_scope[r["scope"] or "(no scope)"] += r["self_ns"]
    print(f"\n{'self ms':>9} {'%':>6}  scope")
    for scope, ns in by_scope.most_common():
        print(f"{ns / 1e6:9.2f} {100 * ns / total:5.1f}%  {scope}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["module", "op", "scope", "self_ns", "calls"])
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
