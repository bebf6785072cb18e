#!/usr/bin/env python3
"""Nearest-sibling diff for variants: check the declared lineage, write a review report.

Every folder under templates/ and variants/ with a model.py takes part. For a variant it
reports the parent its model.py declares (COPIED_FROM, read with `ast`, never imported),
the nearest existing folder by a line-level distance, and the change against the declared
parent: a Markdown summary (for a PR comment) and a side-by-side HTML page.

Distance between two folders: for every file present in either (recursively; caches,
hidden files and runs/ skipped), the lines added plus the lines removed by a difflib line
diff; a file on one side only counts all its lines; a file present only on one side
whose contents are at least 50% similar to one present only on the other is paired with
it as a rename. The percentage divides the distance by the lines of both folders.

Stdlib only; deterministic output (sorted, no timestamps).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import hashlib
import html
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPS = ("templates", "variants")
LINEAGE_ROOT = "templates/base"  # the one folder that declares COPIED_FROM = None
MARKER = "<!-- stencil-variant-diff -->"  # the CI workflow finds its PR comment by this line
RENAME_MIN = 0.5  # similarity (difflib ratio) at which a removed + an added file are a rename
SKIP_DIRS = {"__pycache__", "runs", "wandb", "build", "node_modules"}
SKIP_SUFFIXES = (".pyc", ".pyo", ".so", ".egg-info")

EXAMPLES = """\
examples:
  python tools/variant_diff.py variants/my_idea               # summary of one variant on stdout
  python tools/variant_diff.py variants/my_idea --out /tmp/vd # + /tmp/vd/report.md and variants__my_idea.html
  python tools/variant_diff.py --since main --out /tmp/vd     # every variant added or changed since main
  python tools/variant_diff.py --table                        # lineage table of every variant

--since REV compares REV with the working tree (uncommitted and untracked files count).
Warnings (printed, and in the report): COPIED_FROM missing or not a string literal, a
declared parent that does not exist, a lineage cycle, and a declared parent farther than
MARGIN x (nearest distance) + SLACK lines when another folder is nearer. A folder's own
declared descendants are never its nearest sibling (it cannot be copied from its copy).

exit status: 0 = report written (warnings do not fail unless --strict); 1 = warnings with
--strict; 2 = bad arguments (unknown folder, --since REV that is not a commit).
"""


class UsageError(Exception):
    """A bad argument: exit 2 with the message."""


# ---------------------------------------------------------------- reading folders

def read_copied_from(model_py: str) -> tuple[str | None, str | None]:
    """(COPIED_FROM value, problem). The value is a folder like "variants/dense" or None."""
    try:
        with open(model_py, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=model_py)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as e:
        return None, f"cannot parse {os.path.basename(model_py)}: {e}"
    found = None
    for node in tree.body:  # module level only; the last assignment wins, as at import
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "COPIED_FROM" for t in targets):
            found = value
    if found is None:
        return None, "model.py does not assign COPIED_FROM"
    if not (isinstance(found, ast.Constant) and (found.value is None or isinstance(found.value, str))):
        return None, "COPIED_FROM is not a string literal (or None)"
    value = found.value
    if isinstance(value, str):
        value = value.strip().strip("/")
        value = value[2:] if value.startswith("./") else value
        if not value:
            return None, "COPIED_FROM is an empty string"
    return value, None


def discover(root: str) -> list[str]:
    """Every "templates/<name>" and "variants/<name>" folder holding a model.py, sorted."""
    found = []
    for top in TOPS:
        base = os.path.join(root, top)
        if os.path.isdir(base):
            for name in sorted(os.listdir(base)):
                if os.path.isfile(os.path.join(base, name, "model.py")):
                    found.append(f"{top}/{name}")
    return found


def _skipped(name: str, is_dir: bool) -> bool:
    return name.startswith(".") or (is_dir and name in SKIP_DIRS) or name.endswith(SKIP_SUFFIXES)


def read_lines(path: str) -> list[str]:
    """A file's lines with their endings; an undecodable file is one line holding its hash."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return [f"<binary file, {len(raw)} bytes, sha256 {hashlib.sha256(raw).hexdigest()}>\n"]


class Repo:
    """The folders of one repository, read once."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.folders = discover(self.root)
        self._files: dict[str, dict[str, list[str]]] = {}
        self._dist: dict[tuple[str, str], int] = {}
        self.parents: dict[str, tuple[str | None, str | None]] = {
            f: read_copied_from(os.path.join(self.root, f, "model.py")) for f in self.folders}

    def exists(self, folder: str | None) -> bool:
        return folder in self.parents

    def files(self, folder: str) -> dict[str, list[str]]:
        """{path inside the folder: lines} for every file of the folder."""
        if folder not in self._files:
            out = {}
            base = os.path.join(self.root, folder)
            for d, dirs, names in os.walk(base):
                dirs[:] = sorted(x for x in dirs if not _skipped(x, True))
                for n in sorted(names):
                    if not _skipped(n, False):
                        p = os.path.join(d, n)
                        if os.path.isfile(p):
                            out[os.path.relpath(p, base).replace(os.sep, "/")] = read_lines(p)
            self._files[folder] = out
        return self._files[folder]

    def n_lines(self, folder: str) -> int:
        return sum(len(v) for v in self.files(folder).values())

    def distance(self, a: str, b: str) -> int:
        key = (a, b) if a <= b else (b, a)
        if key not in self._dist:
            self._dist[key] = total(compare(self.files(key[0]), self.files(key[1])))
        return self._dist[key]

    def descendants(self, folder: str) -> set[str]:
        """Folders whose declared lineage passes through `folder`."""
        children: dict[str, list[str]] = {}
        for f, (p, _) in self.parents.items():
            if p is not None:
                children.setdefault(p, []).append(f)
        out, todo = set(), [folder]
        while todo:
            for c in children.get(todo.pop(), []):
                if c not in out:
                    out.add(c)
                    todo.append(c)
        out.discard(folder)
        return out

    def cycle(self, folder: str) -> list[str] | None:
        """The declared chain from `folder` back to itself, if there is one."""
        chain, seen = [folder], {folder}
        while True:
            p = self.parents.get(chain[-1], (None, None))[0]
            if p is None or p not in self.parents:
                return None
            if p == folder:
                return chain + [p]
            if p in seen:
                return None  # a cycle further up; reported for the folders on it
            chain.append(p)
            seen.add(p)

    def nearest(self, folder: str) -> tuple[str | None, int | None]:
        """The nearest other folder (not a declared descendant); ties go to the declared parent, then by name."""
        skip = self.descendants(folder) | {folder}
        declared = self.parents.get(folder, (None, None))[0]
        best = None
        for c in self.folders:
            if c not in skip:
                key = (self.distance(folder, c), c != declared, c)
                best = key if best is None or key < best else best
        return (best[2], best[0]) if best else (None, None)


# ---------------------------------------------------------------- comparing

@dataclasses.dataclass(frozen=True)
class Entry:
    """One file of a comparison: old is the parent side, new the variant side."""

    status: str  # unchanged | modified | added | removed | renamed
    old: str | None
    new: str | None
    added: int
    removed: int
    similarity: float | None = None  # for renames

    @property
    def path(self) -> str:
        return self.new if self.new is not None else self.old


def line_changes(a: list[str], b: list[str]) -> tuple[int, int]:
    """(lines added, lines removed) to turn a into b."""
    if a == b:
        return 0, 0
    same = sum(m.size for m in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks())
    return len(b) - same, len(a) - same


def similarity(a: list[str], b: list[str]) -> float:
    if not a or not b:
        return 0.0
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    if sm.real_quick_ratio() < RENAME_MIN or sm.quick_ratio() < RENAME_MIN:
        return 0.0
    return sm.ratio()


def compare(old: dict[str, list[str]], new: dict[str, list[str]]) -> list[Entry]:
    """File-by-file change from folder `old` to folder `new`, sorted by path; renames paired."""
    out = []
    for p in sorted(old.keys() & new.keys()):
        add, rem = line_changes(old[p], new[p])
        out.append(Entry("modified" if add or rem else "unchanged", p, p, add, rem))
    gone, came = sorted(old.keys() - new.keys()), sorted(new.keys() - old.keys())
    pairs = sorted(((s, o, n) for o in gone for n in came if (s := similarity(old[o], new[n])) >= RENAME_MIN),
                   key=lambda t: (-t[0], t[1], t[2]))
    for s, o, n in pairs:
        if o in gone and n in came:
            gone.remove(o)
            came.remove(n)
            add, rem = line_changes(old[o], new[n])
            out.append(Entry("renamed", o, n, add, rem, s))
    out += [Entry("removed", o, None, 0, len(old[o])) for o in gone]
    out += [Entry("added", None, n, len(new[n]), 0) for n in came]
    return sorted(out, key=lambda e: (e.path, e.old or ""))


def total(entries: list[Entry]) -> int:
    return sum(e.added + e.removed for e in entries)


# ---------------------------------------------------------------- the analysis

@dataclasses.dataclass
class Report:
    folder: str
    declared: str | None
    nearest: str | None
    nearest_distance: int | None
    parent_distance: int | None
    base: str | None  # what the diff is against: the declared parent, else the nearest sibling
    entries: list[Entry]
    warnings: list[str]
    percent: float | None  # nearest distance over the lines of both folders


def analyse(repo: Repo, folder: str, margin: float, slack: int) -> Report:
    declared, problem = repo.parents[folder]
    warnings = [problem] if problem else []
    nearest, nd = repo.nearest(folder)
    pd = None
    if declared is None and problem is None and folder != LINEAGE_ROOT:
        warnings.append(f"COPIED_FROM = None, but only {LINEAGE_ROOT} is the root of the lineage; "
                        "name the folder this one was copied from")
    if declared is not None:
        if declared == folder:
            warnings.append("COPIED_FROM names this folder itself")
        elif not repo.exists(declared):
            warnings.append(f"declared parent {declared!r} does not exist (no {declared}/model.py)"
                            + (f"; the nearest folder is {nearest}" if nearest else ""))
        else:
            pd = repo.distance(folder, declared)
            loop = repo.cycle(folder)
            if loop:
                warnings.append("lineage cycle: " + " -> ".join(loop))
            if nearest is not None and nearest != declared and pd > nd * margin + slack:
                warnings.append(f"declared parent {declared} is {pd} changed lines away, but {nearest} is only "
                                f"{nd}: if this folder was copied from {nearest}, set "
                                f'COPIED_FROM = "{nearest}" in {folder}/model.py; if {nearest} was '
                                f"copied from this folder, its COPIED_FROM should name {folder}")
    base = declared if declared is not None and declared != folder and repo.exists(declared) else nearest
    entries = compare(repo.files(base), repo.files(folder)) if base else []
    if base is None and folder != LINEAGE_ROOT:
        warnings.append("no other folder to compare with")
    pct = None
    if nd is not None:
        both = repo.n_lines(folder) + repo.n_lines(nearest)
        pct = 100.0 * nd / both if both else 0.0
    return Report(folder, declared, nearest, nd, pd, base, entries, warnings, pct)


def check_word(r: Report) -> str:
    if not r.warnings:
        return "ok"
    w = r.warnings[0]
    for key, word in (("does not exist", "parent missing"), ("changed lines away", "parent far"),
                      ("cycle", "cycle"), ("COPIED_FROM = None", "no parent"), ("itself", "self parent")):
        if key in w:
            return word + (f" (+{len(r.warnings) - 1})" if len(r.warnings) > 1 else "")
    return "COPIED_FROM" + (f" (+{len(r.warnings) - 1})" if len(r.warnings) > 1 else "")


def dist_text(d: int | None, pct: float | None = None) -> str:
    if d is None:
        return "-"
    return f"{d} ({pct:.1f}%)" if pct is not None else str(d)


def table_rows(reports: list[Report]) -> list[list[str]]:
    rows = [["variant", "declared parent", "nearest sibling", "distance", "to parent", "check"]]
    for r in reports:
        parent = "(root)" if r.declared is None and r.folder == LINEAGE_ROOT and not r.warnings else (r.declared or "-")
        rows.append([r.folder, parent, r.nearest or "-", dist_text(r.nearest_distance, r.percent),
                     dist_text(r.parent_distance), check_word(r)])
    return rows


def render_table(rows: list[list[str]]) -> str:
    """A Markdown pipe table, padded so it also reads as plain text."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    return "\n".join([line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows[1:]])


# ---------------------------------------------------------------- rendering

def page_name(folder: str) -> str:
    return folder.replace("/", "__") + ".html"


def _fence(text: str, lang: str = "") -> str:
    run = max((len(m) for m in re.findall(r"`+", text)), default=0)
    f = "`" * max(3, run + 1)
    return f"{f}{lang}\n{text}{'' if text.endswith(chr(10)) else chr(10)}{f}"


def unified(repo: Repo, r: Report) -> list[str]:
    old = repo.files(r.base) if r.base else {}
    new = repo.files(r.folder)
    lines = []
    for e in r.entries:
        if e.status == "unchanged":
            continue
        a = old.get(e.old, []) if e.old else []
        b = new.get(e.new, []) if e.new else []
        fa = f"{r.base}/{e.old}" if e.old else "/dev/null"
        fb = f"{r.folder}/{e.new}" if e.new else "/dev/null"
        for ln in difflib.unified_diff(a, b, fa, fb, n=3):
            lines.append(ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n")
    return lines


def entry_row(e: Entry) -> list[str]:
    if e.status == "renamed":
        name, what = f"`{e.new}` ← `{e.old}`", f"renamed, {e.similarity:.0%} similar"
    else:
        name, what = f"`{e.path}`", e.status
    lines = " ".join(x for x in ((f"+{e.added}" if e.added else ""), (f"-{e.removed}" if e.removed else "")) if x)
    return [name, what, lines or "0"]


def render_section(repo: Repo, r: Report, with_diff: bool, max_diff_lines: int) -> str:
    out = [f"### `{r.folder}`", ""]
    for w in r.warnings:
        out.append(f"> **warning:** {w}")
    if r.warnings:
        out.append("")
    declared = "`(root)`" if r.declared is None and r.folder == LINEAGE_ROOT else \
        (f"`{r.declared}`" if r.declared else "none")
    out.append(f"- declared parent (COPIED_FROM in model.py): {declared}"
               + (f", {r.parent_distance} changed lines" if r.parent_distance is not None else ""))
    out.append(f"- nearest sibling: `{r.nearest}`, {dist_text(r.nearest_distance, r.percent)} changed lines"
               if r.nearest else "- nearest sibling: none")
    if r.base is None:
        if r.folder == LINEAGE_ROOT:
            out.append(f"- the root of the lineage has no parent to compare with: review its change with "
                       f"`git diff <base revision> -- {LINEAGE_ROOT}`")
        out.append("")
        return "\n".join(out)
    changed = [e for e in r.entries if e.status != "unchanged"]
    against = "declared parent" if r.base == r.declared else "nearest sibling (the declared parent is unusable)"
    out += ["", f"Change against the {against} `{r.base}`: {len(changed)} of {len(r.entries)} files, "
                f"+{sum(e.added for e in r.entries)} -{sum(e.removed for e in r.entries)} lines", ""]
    if changed:
        out += ["| file | change | lines |", "|---|---|---|"] + ["| " + " | ".join(entry_row(e)) + " |" for e in changed]
        out.append("")
    if with_diff and changed:
        diff = unified(repo, r)
        shown = diff[:max_diff_lines]
        text = "".join(shown)
        more = f"\n… {len(diff) - len(shown)} more diff lines; the HTML page has all of it\n" if len(diff) > len(shown) else ""
        out += [f"<details><summary>Unified diff against <code>{html.escape(r.base)}</code> ({len(diff)} lines)</summary>",
                "", _fence(text, "diff") + more, "", "</details>", "",
                f"Side by side: `{page_name(r.folder)}` (in the report folder; the CI artifact `variant-diff`).", ""]
    return "\n".join(out)


def render_markdown(repo: Repo, reports: list[Report], everything: list[Report], heading: str,
                    with_diff: bool, max_diff_lines: int, notes: list[str]) -> str:
    out = ([MARKER] if with_diff else []) + ["## Variant diff", "", heading, ""]
    if reports:
        out += [render_table(table_rows(reports)), ""]
    out += [f"- {n}" for n in notes] + ([""] if notes else [])
    for r in reports:
        out.append(render_section(repo, r, with_diff, max_diff_lines))
    if with_diff:
        out += ["<details><summary>Lineage of every variant</summary>", "",
                render_table(table_rows(everything)), "", "</details>", ""]
    return "\n".join(out).rstrip("\n") + "\n"


CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; }
h1 { font-size: 1.3em; } h2 { font-size: 1.05em; margin-top: 2em; font-family: monospace; }
.warn { color: #9a3412; font-weight: 600; }
table.diff { font-family: ui-monospace, monospace; font-size: 12px; border-collapse: collapse; width: 100%; }
table.diff td { white-space: pre; vertical-align: top; padding: 0 4px; }
.diff_header { background-color: #e0e0e0; text-align: right; }
td.diff_header { color: #555; }
.diff_next { background-color: #c0c0c0; }
.diff_add { background-color: #aaffaa; } .diff_chg { background-color: #ffff77; } .diff_sub { background-color: #ffaaaa; }
"""


class _HtmlDiff(difflib.HtmlDiff):
    """HtmlDiff with anchors numbered per page (difflib's own counter is global to the process)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._n = 0

    def _make_prefix(self):
        self._prefix = [f"from{self._n}_", f"to{self._n}_"]
        self._n += 1


def render_html(repo: Repo, r: Report) -> str:
    esc = html.escape
    old = repo.files(r.base) if r.base else {}
    new = repo.files(r.folder)
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{esc(r.folder)} against {esc(r.base or 'nothing')}</title>", f"<style>{CSS}</style></head><body>",
             f"<h1><code>{esc(r.folder)}</code> against <code>{esc(r.base or 'nothing')}</code></h1>", "<ul>",
             f"<li>declared parent (COPIED_FROM): <code>{esc(str(r.declared))}</code>"
             + (f", {r.parent_distance} changed lines" if r.parent_distance is not None else "") + "</li>",
             f"<li>nearest sibling: <code>{esc(str(r.nearest))}</code>, "
             f"{esc(dist_text(r.nearest_distance, r.percent))} changed lines</li>", "</ul>"]
    parts += [f'<p class="warn">warning: {esc(w)}</p>' for w in r.warnings]
    hd = _HtmlDiff(tabsize=4)
    unchanged = [e.path for e in r.entries if e.status == "unchanged"]
    for e in r.entries:
        if e.status == "unchanged":
            continue
        title = f"{e.old} → {e.new} (renamed, {e.similarity:.0%} similar)" if e.status == "renamed" else \
            f"{e.path} ({e.status}, +{e.added} -{e.removed})"
        a = old.get(e.old, []) if e.old else []
        b = new.get(e.new, []) if e.new else []
        parts += [f"<h2>{esc(title)}</h2>",
                  hd.make_table(a, b, f"{r.base}/{e.old}" if e.old else "(none)",
                                f"{r.folder}/{e.new}" if e.new else "(none)", context=True, numlines=3)]
    if unchanged:
        parts.append("<p>unchanged: " + ", ".join(f"<code>{esc(p)}</code>" for p in unchanged) + "</p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------- selecting folders

def _git(root: str, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True)
    except FileNotFoundError as e:
        raise UsageError("--since needs git, which is not installed") from e


def changed_since(repo: Repo, rev: str) -> tuple[list[str], list[str]]:
    """(variant folders added or changed since rev, notes on changed folders that are not variants now)."""
    if _git(repo.root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").returncode != 0:
        raise UsageError(f"--since {rev}: not a commit of the git repository at {repo.root} "
                         "(the first commit has no HEAD~1, and a shallow clone lacks older commits)")
    paths = []
    for args in (("diff", "--name-only", "--no-renames", "--relative", "-z", rev, "--", *TOPS),
                 ("ls-files", "--others", "--exclude-standard", "-z", "--", *TOPS)):
        p = _git(repo.root, *args)
        if p.returncode != 0:
            raise UsageError(f"git {' '.join(args[:2])} failed: {p.stderr.strip()}")
        paths += [x for x in p.stdout.split("\0") if x]
    folders = set()
    for path in paths:
        parts = path.split("/")
        if len(parts) >= 3 and parts[0] in TOPS and not any(_skipped(x, i < len(parts) - 1)
                                                             for i, x in enumerate(parts[2:], 2)):
            folders.add(f"{parts[0]}/{parts[1]}")
    present = sorted(f for f in folders if repo.exists(f))
    notes = [f"`{f}` was removed" if not os.path.isdir(os.path.join(repo.root, f)) else
             f"`{f}` changed but holds no model.py, so it is not a variant" for f in sorted(folders) if not repo.exists(f)]
    return present, notes


def resolve(repo: Repo, arg: str) -> str:
    """A folder argument (relative to the repository or the current directory, or a bare name) -> "top/name"."""
    cands = [os.path.abspath(arg), os.path.join(repo.root, arg)]
    if "/" not in arg.strip("/"):
        cands.append(os.path.join(repo.root, "variants", arg))
    for c in cands:
        rel = os.path.relpath(os.path.normpath(c), repo.root).replace(os.sep, "/")
        if rel in repo.parents:
            return rel
    raise UsageError(f"{arg}: not a variant folder of {repo.root} (templates/<name>/ or variants/<name>/ with a "
                     f"model.py); known: {', '.join(repo.folders) or 'none'}")


# ---------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/variant_diff.py", description=__doc__.split("\n\n")[0],
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="*", metavar="FOLDER", help="variant folders to report, e.g. variants/my_idea")
    p.add_argument("--since", metavar="REV", help="also report every variant added or changed since git revision REV")
    p.add_argument("--table", action="store_true", help="print the lineage table of every variant")
    p.add_argument("--out", metavar="DIR", help="write report.md (Markdown, for a PR comment) and one side-by-side "
                                                "HTML page per variant to DIR")
    p.add_argument("--root", default=ROOT, help="repository root (default: the one this tool is in)")
    p.add_argument("--margin", type=float, default=1.5, metavar="RATIO",
                   help="warn when the declared parent is farther than RATIO x nearest + SLACK (default 1.5)")
    p.add_argument("--slack", type=int, default=20, metavar="LINES", help="see --margin (default 20)")
    p.add_argument("--max-diff-lines", type=int, default=400, metavar="N",
                   help="unified-diff lines per variant in report.md (default 400; the HTML page has all)")
    p.add_argument("--strict", action="store_true", help="exit 1 when there is any warning")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        repo = Repo(args.root)
        if not (args.folders or args.since or args.table):
            raise UsageError("give variant folders, --since REV or --table (see --help)")
        if args.out and not (args.folders or args.since):
            raise UsageError("--out writes the report of variant folders or of --since REV; give one of them")
        chosen = [resolve(repo, f) for f in args.folders]
        notes: list[str] = []
        if args.since:
            present, notes = changed_since(repo, args.since)
            chosen += present
        chosen = sorted(set(chosen))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    everything = {f: analyse(repo, f, args.margin, args.slack) for f in repo.folders}
    reports = [everything[f] for f in chosen]
    if args.table:
        print(render_table(table_rows(list(everything.values()))))
        if args.folders or args.since:
            print()
    if args.folders or args.since:
        if args.since and not args.folders:
            heading = f"Variants added or changed since `{args.since}`: {len(reports)}" + \
                ("" if reports else " (nothing to compare)")
        else:
            heading = f"Variants reported: {len(reports)}"
        print(render_markdown(repo, reports, list(everything.values()), heading, False, 0, notes), end="")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "report.md"), "w", encoding="utf-8") as f:
                f.write(render_markdown(repo, reports, list(everything.values()), heading, True,
                                        args.max_diff_lines, notes))
            for r in reports:
                with open(os.path.join(args.out, page_name(r.folder)), "w", encoding="utf-8") as f:
                    f.write(render_html(repo, r))
            print(f"\nwrote {os.path.join(args.out, 'report.md')} and {len(reports)} HTML page(s)")
    shown = reports if (args.folders or args.since) else list(everything.values())
    n_warn = sum(len(r.warnings) for r in shown)
    if n_warn:
        for r in shown:
            for w in r.warnings:
                print(f"warning: {r.folder}: {w}", file=sys.stderr)
    return 1 if args.strict and n_warn else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # piped into `head` and the like
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
