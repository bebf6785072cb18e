"""The import graph of shared/: its depth, its cycles, its longest chain, and what one module imports.

    python tools/review/import_graph.py                 # depth, cycles, the longest chain
    python tools/review/import_graph.py --module run    # and the shared modules shared/run.py imports
    python tools/review/import_graph.py --packages      # the graph of shared/'s subpackages and top modules

Every `import` and `from ... import` of a shared module counts, at the top of a file or inside a function
(a function-local import is a dependency too, only a hidden one). Depth is the number of modules in the
longest chain of imports. With --packages a subpackage (shared/data/, shared/storage/, ...) is one node: the
architecture's layers, commands at the top. tests/fast/test_layout.py holds the limits.
"""

from __future__ import annotations

import argparse
import ast
import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def modules(package: str = "shared") -> dict[str, str]:
    """{dotted name: path} of every module of the package (a package's __init__ as the package's name)."""
    out = {}
    for d, _, files in os.walk(os.path.join(ROOT, package)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, mods: dict[str, str]) -> set[str]:
    """The modules of `mods` that module `name` imports."""
    out = set()
    for node in ast.walk(ast.parse(open(mods[name]).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.add(full if full in mods else node.module if node.module in mods else "")
    return out - {"", name}


def graph(package: str = "shared") -> dict[str, set[str]]:
    mods = modules(package)
    return {m: imports(m, mods) for m in mods}


def packages(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph with each subpackage one node (shared.storage.objstore -> shared.storage); top modules stay."""

    def node(m):
        return ".".join(m.split(".")[:2])

    out: dict[str, set[str]] = {}
    for m, deps in g.items():
        out.setdefault(node(m), set()).update(node(d) for d in deps if node(d) != node(m))
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(u, stack):
        state[u] = 1
        stack.append(u)
        for v in sorted(g[u]):
            if state.get(v) == 1:
                found.append(stack[stack.index(v) :] + [v])
            elif not state.get(v):
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for m in sorted(g):
        if not state.get(m):
            visit(m, [])
    return found


def longest_chain(g: dict[str, set[str]]) -> list[str]:
    """The longest chain of imports (the graph must have no cycle)."""

    @functools.cache
    def chain(u):
        return max(([u] + chain(v) for v in g[u]), key=len, default=[u])

    return max((chain(m) for m in sorted(g)), key=len)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/review/import_graph.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--package", default="shared")
    p.add_argument("--module", default="", help="also list what this module of the package imports (e.g. run)")
    p.add_argument("--packages", action="store_true", help="each subpackage as one node (the layers)")
    args = p.parse_args(argv)
    g = graph(args.package)
    if args.packages:
        g = packages(g)
    loops = cycles(g)
    what = "modules and subpackages" if args.packages else "modules"
    print(f"{args.package}: {len(g)} {what}, {sum(map(len, g.values()))} imports")
    if loops:
        print("cycles: " + "; ".join(" -> ".join(c) for c in loops))
        return 1
    chain = longest_chain(g)
    print(f"depth {len(chain)}: " + " -> ".join(chain))
    if args.module:
        own = g[f"{args.package}.{args.module}"]
        print(f"{args.package}.{args.module} imports {len(own)}: {', '.join(sorted(own))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
