#!/usr/bin/env python3
"""Nearest-sibling diff for variants: check the declared lineage, write a review report.

Every folder under templates/ and variants/ with a model.py takes part. For a variant it
reports the parent its model.py declares (COPIED_FROM, read with `ast`, never imported),
the nearest existing folder by a line-level distance over the code, and the change against
the declared parent: a Markdown summary (for a PR comment) and a side-by-side HTML page.

Code distance between two folders (the lineage uses only this): over model.py, train.py and
hf.py (the Hugging Face mapping changes with the math), the lines added plus the lines removed
by a difflib line diff; a file on one side only counts all its lines, except an hf.py that
the variant lacks and the other folder has (the variant has no export: deleting the file is
one decision; the review shows it as a removed code file). The percentage divides it by the code lines of both folders. The
other files (docs *.md, presets/*.yaml, benchmarks and the rest; recursively, caches,
hidden files and runs/ skipped) are compared and reported separately, as "other files",
and never decide the nearest sibling: a copied README or preset churn says nothing about
which code a folder was copied from. Among the other files, one present only on one side
whose contents are at least 50% similar to one present only on the other is paired with
it as a rename.

With --since REV the report also lists every file outside templates/ and variants/ changed
since REV (the variant's tests, README lines, shared/ ...) with its diff; for a folder
named without --since it shows the variant's own tests, <folder>/test_<name>.py (or
tests/test_<name>.py). With --runs
it links a loss-curve picture made by tools/review/compare_runs.py (imported only then).

Stdlib only (tools/review/compare_runs.py, with matplotlib, is loaded for --runs alone); deterministic
output (sorted, no timestamps).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import html
import importlib.util
import os
import re
import subprocess
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # lineage.py beside this file, however it is loaded
from lineage import (  # noqa: E402  the lineage: parents, distances, the nearest sibling
    LINEAGE_ROOT,
    OPTIONAL_CODE,
    ROOT,
    SKIP_DIRS,
    SKIP_SUFFIXES,
    TOPS,
    UsageError,
    _skipped,
    read_lines,
    decode_lines,
    kind_of,
    Repo,
    Entry,
    line_changes,
    Report,
    tests_path,
    analyse,
    check_word,
)

MARKER = "<!-- stencil-variant-diff -->"  # the CI workflow finds its PR comment by this line
COMPARE_RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare_runs.py")  # for --runs
OTHER_PAGE = "other_files.html"  # side-by-side page of the files outside the folders (--since); no "__" in it

EXAMPLES = """\
examples:
  python tools/review/variant_diff.py variants/my_idea               # summary of one variant on stdout
  python tools/review/variant_diff.py variants/my_idea --out /tmp/vd # + /tmp/vd/report.md and variants__my_idea.html
  python tools/review/variant_diff.py --since main --out /tmp/vd     # every variant added or changed since main
  python tools/review/variant_diff.py --table                        # lineage table of every variant
  python tools/review/variant_diff.py variants/my_idea --out /tmp/vd --runs runs/dense-1 runs/my_idea-1
                                                              # + the loss curves of the two runs in report.md

Lineage: the nearest sibling, the distances and the check use the code only (model.py,
train.py and hf.py; a deleted hf.py counts as one decision). Docs (*.md), presets (presets/*.yaml) and other files (bench_*.py, ...) are shown
in their own columns and sections ("other files") and never pick the nearest sibling.

The check column: "ok" only when the declared parent is the nearest folder by code (or the
folder is the root of the lineage); "within margin" when another folder is nearer by code
but the declared parent is at most MARGIN x (nearest code distance) + SLACK lines away (no
warning); anything else is a warning.

Warnings (printed, and in the report): COPIED_FROM missing or not a string literal, a
declared parent that does not exist, a lineage cycle, and a declared parent farther in code
than MARGIN x (nearest code distance) + SLACK lines when another folder is nearer. A
folder's own declared descendants are never its nearest sibling (it cannot be copied from
its copy).

--since REV compares REV with the working tree (uncommitted and untracked files count). The
report then also lists, under "Other files changed with it", every file outside templates/
and variants/ changed since REV (the variant's tests, README lines, shared/ ...) with its
diff, when at least one variant was added or changed. A folder named without --since gets
its own tests, <folder>/test_<name>.py (or tests/test_<name>.py), in full under "The variant's own tests". Both are cut
at --max-diff-lines in report.md; the HTML pages have all of it.

--runs RUN RUN [...] (the parent's run, then the variant's; needs --out) calls compare() of
tools/review/compare_runs.py: OUT/loss.png and OUT/summary.md, shown at the top of report.md.

exit status: 0 = report written (warnings do not fail unless --strict); 1 = warnings with
--strict; 2 = bad arguments (unknown folder, --since REV that is not a commit, --runs without
--out or with fewer than two runs, a run compare_runs cannot read).
"""


def dist_text(d: int | None, pct: float | None = None) -> str:
    if d is None:
        return "-"
    return f"{d} ({pct:.1f}%)" if pct is not None else str(d)


def table_rows(reports: list[Report]) -> list[list[str]]:
    rows = [
        [
            "variant",
            "declared parent",
            "nearest by code",
            "code distance",
            "code to parent",
            "other files to parent",
            "check",
        ]
    ]
    for r in reports:
        parent = "(root)" if r.declared is None and r.folder == LINEAGE_ROOT and not r.warnings else (r.declared or "-")
        rows.append(
            [
                r.folder,
                parent,
                r.nearest or "-",
                dist_text(r.nearest_distance, r.percent),
                dist_text(r.parent_distance),
                dist_text(r.parent_other),
                check_word(r),
            ]
        )
    return rows


def render_table(rows: list[list[str]]) -> str:
    """A Markdown pipe table, padded so it also reads as plain text."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    return "\n".join([line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows[1:]])


# ---------------------------------------------------------------- files outside the folders (--since)


@dataclasses.dataclass(frozen=True)
class Outside:
    """A file outside templates/ and variants/ changed between REV and the working tree."""

    path: str
    status: str  # added | removed | modified
    old: tuple[str, ...]
    new: tuple[str, ...]
    added: int
    removed: int


# ---------------------------------------------------------------- rendering


def page_name(folder: str) -> str:
    return folder.replace("/", "__") + ".html"


def _fence(text: str, lang: str = "") -> str:
    run = max((len(m) for m in re.findall(r"`+", text)), default=0)
    f = "`" * max(3, run + 1)
    return f"{f}{lang}\n{text}{'' if text.endswith(chr(10)) else chr(10)}{f}"


def diff_lines(a: list[str], b: list[str], fa: str, fb: str) -> list[str]:
    lines = []
    for ln in difflib.unified_diff(a, b, fa, fb, n=3):
        lines.append(ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n")
    return lines


def unified(repo: Repo, r: Report, entries: list[Entry] | None = None) -> list[str]:
    """The unified diff of `entries` (default: all of them) from the base to the folder."""
    old = repo.files(r.base) if r.base else {}
    new = repo.files(r.folder)
    lines = []
    for e in r.entries if entries is None else entries:
        if e.status == "unchanged":
            continue
        lines += diff_lines(
            old.get(e.old, []) if e.old else [],
            new.get(e.new, []) if e.new else [],
            f"{r.base}/{e.old}" if e.old else "/dev/null",
            f"{r.folder}/{e.new}" if e.new else "/dev/null",
        )
    return lines


def _lines_text(added: int, removed: int) -> str:
    return " ".join(x for x in ((f"+{added}" if added else ""), (f"-{removed}" if removed else "")) if x) or "0"


def entry_row(e: Entry) -> list[str]:
    if e.status == "renamed":
        name, what = f"`{e.new}` ← `{e.old}`", f"renamed, {e.similarity:.0%} similar"
    else:
        name, what = f"`{e.path}`", e.status
    return [name, kind_of(e.path), what, _lines_text(e.added, e.removed)]


def _details(summary: str, lines: list[str], max_lines: int, lang: str, elsewhere: str) -> list[str]:
    """A collapsed fenced block of `lines`, cut at max_lines."""
    shown = lines[:max_lines]
    more = f"\n… {len(lines) - len(shown)} more lines; {elsewhere} has all of it\n" if len(lines) > len(shown) else ""
    return [
        f"<details><summary>{summary} ({len(lines)} lines)</summary>",
        "",
        _fence("".join(shown), lang) + more,
        "",
        "</details>",
        "",
    ]


def _kinds_text(entries: list[Entry]) -> str:
    parts = []
    for kind in ("docs", "presets", "other"):
        es = [e for e in entries if e.status != "unchanged" and kind_of(e.path) == kind]
        if es:
            parts.append(f"{kind} +{sum(e.added for e in es)} -{sum(e.removed for e in es)}")
    return ", ".join(parts)


def render_section(repo: Repo, r: Report, with_diff: bool, max_diff_lines: int, show_tests: bool = False) -> str:
    out = [f"### `{r.folder}`", ""]
    for w in r.warnings:
        out.append(f"> **warning:** {w}")
    if r.warnings:
        out.append("")
    declared = (
        "`(root)`" if r.declared is None and r.folder == LINEAGE_ROOT else (f"`{r.declared}`" if r.declared else "none")
    )
    out.append(
        f"- declared parent (COPIED_FROM in model.py): {declared}"
        + (f", {r.parent_distance} changed lines of code" if r.parent_distance is not None else "")
    )
    out.append(
        f"- nearest sibling by code (model.py, train.py, hf.py): `{r.nearest}`, "
        f"{dist_text(r.nearest_distance, r.percent)} changed lines"
        if r.nearest
        else "- nearest sibling: none"
    )
    if r.within_margin:
        out.append(
            f"- check: within margin: `{r.nearest}` is nearer by code than the declared parent, but not by "
            "more than --margin x (its distance) + --slack"
        )
    else:
        out.append(f"- check: {check_word(r)}")
    tests_lines = read_lines(os.path.join(repo.root, r.tests)) if r.tests else []
    out.append(
        f"- own tests: `{r.tests}` ({len(tests_lines)} lines)"
        if r.tests
        else f"- own tests: none (no `{tests_path(r.folder, repo.root)}`)"
    )
    tests_block = []
    if show_tests and r.tests and with_diff:
        tests_block = [
            "#### The variant's own tests",
            "",
            *_details(
                f"<code>{html.escape(r.tests)}</code> in full", tests_lines, max_diff_lines, "python", "the HTML page"
            ),
        ]
    if r.base is None:
        if r.folder == LINEAGE_ROOT:
            out.append(
                f"- the root of the lineage has no parent to compare with: review its change with "
                f"`git diff <base revision> -- {LINEAGE_ROOT}`"
            )
        out.append("")
        return "\n".join(out + tests_block)
    cc = [e for e in r.code_entries if e.status != "unchanged"]
    oc = [e for e in r.other_entries if e.status != "unchanged"]
    against = "declared parent" if r.base == r.declared else "nearest sibling (the declared parent is unusable)"
    kinds = _kinds_text(r.other_entries)
    out += [
        "",
        f"Change against the {against} `{r.base}`:",
        "",
        f"- code (model.py, train.py, hf.py): {len(cc)} of {len(r.code_entries)} files, "
        f"+{sum(e.added for e in cc)} -{sum(e.removed for e in cc)} lines"
        + "".join(
            f" ({e.path} deleted: its {e.removed} lines are counted here, but not in the code distance, "
            f"where deleting it is one decision)"
            for e in cc
            if e.status == "removed" and os.path.basename(e.path) in OPTIONAL_CODE
        ),
        f"- other files (docs, presets, benchmarks, ...; not used for the lineage): {len(oc)} of "
        f"{len(r.other_entries)} files, +{sum(e.added for e in oc)} -{sum(e.removed for e in oc)} lines"
        + (f" ({kinds})" if kinds else ""),
        "",
    ]
    if cc or oc:
        out += ["| file | kind | change | lines |", "|---|---|---|---|"]
        out += ["| " + " | ".join(entry_row(e)) + " |" for e in cc + oc]
        out.append("")
    if with_diff and (cc or oc):
        base = html.escape(r.base)
        if cc:
            out += _details(
                f"Unified diff of the code against <code>{base}</code>",
                unified(repo, r, cc),
                max_diff_lines,
                "diff",
                "the HTML page",
            )
        if oc:
            out += _details(
                f"Unified diff of the other files (docs, presets, ...) against <code>{base}</code>",
                unified(repo, r, oc),
                max_diff_lines,
                "diff",
                "the HTML page",
            )
        out += [f"Side by side: `{page_name(r.folder)}` (in the report folder; the CI artifact `variant-diff`).", ""]
    return "\n".join(out + tests_block)


def render_outside(outside: list[Outside], rev: str, with_diff: bool, max_diff_lines: int) -> str:
    out = ["### Other files changed with it", ""]
    if not outside:
        return "\n".join(out + [f"None: no file outside `templates/` and `variants/` changed since `{rev}`.", ""])
    out += [
        f"Files outside `templates/` and `variants/` changed since `{rev}` (the working tree; untracked files "
        f"count): {len(outside)}, +{sum(o.added for o in outside)} -{sum(o.removed for o in outside)} lines",
        "",
        "| file | change | lines |",
        "|---|---|---|",
    ]
    out += [f"| `{o.path}` | {o.status} | {_lines_text(o.added, o.removed)} |" for o in outside]
    out.append("")
    if with_diff:
        diff = []
        for o in outside:
            diff += diff_lines(
                list(o.old),
                list(o.new),
                "/dev/null" if o.status == "added" else f"a/{o.path}",
                "/dev/null" if o.status == "removed" else f"b/{o.path}",
            )
        out += _details(
            f"Unified diff since <code>{html.escape(rev)}</code>", diff, max_diff_lines, "diff", f"`{OTHER_PAGE}`"
        )
        out += [f"Side by side: `{OTHER_PAGE}` (in the report folder).", ""]
    return "\n".join(out)


def render_markdown(
    repo: Repo,
    reports: list[Report],
    everything: list[Report],
    heading: str,
    with_diff: bool,
    max_diff_lines: int,
    notes: list[str],
    *,
    show_tests: bool = False,
    outside: list[Outside] | None = None,
    since: str | None = None,
    runs_md: str | None = None,
) -> str:
    out = ([MARKER] if with_diff else []) + ["## Variant diff", "", heading, ""]
    if reports:
        out += [render_table(table_rows(reports)), ""]
    out += [f"- {n}" for n in notes] + ([""] if notes else [])
    if runs_md:
        out += [runs_md, ""]
    for r in reports:
        out.append(render_section(repo, r, with_diff, max_diff_lines, show_tests))
    if outside is not None and since is not None:
        out.append(render_outside(outside, since, with_diff, max_diff_lines))
    if with_diff:
        out += [
            "<details><summary>Lineage of every variant</summary>",
            "",
            render_table(table_rows(everything)),
            "",
            "</details>",
            "",
        ]
    return "\n".join(out).rstrip("\n") + "\n"


CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; }
h1 { font-size: 1.3em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ccc; }
h3 { font-size: 1.0em; margin-top: 1.5em; font-family: monospace; }
.warn { color: #9a3412; font-weight: 600; }
pre.file { font-family: ui-monospace, monospace; font-size: 12px; background: #f6f6f6; padding: 4px; }
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


def _page_head(title: str) -> list[str]:
    return [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{title}</title>",
        f"<style>{CSS}</style></head><body>",
    ]


def render_html(repo: Repo, r: Report, show_tests: bool = False) -> str:
    esc = html.escape
    old = repo.files(r.base) if r.base else {}
    new = repo.files(r.folder)
    parts = _page_head(f"{esc(r.folder)} against {esc(r.base or 'nothing')}") + [
        f"<h1><code>{esc(r.folder)}</code> against <code>{esc(r.base or 'nothing')}</code></h1>",
        "<ul>",
        f"<li>declared parent (COPIED_FROM): <code>{esc(str(r.declared))}</code>"
        + (f", {r.parent_distance} changed lines of code" if r.parent_distance is not None else "")
        + "</li>",
        f"<li>nearest sibling by code (model.py, train.py, hf.py): <code>{esc(str(r.nearest))}</code>, "
        f"{esc(dist_text(r.nearest_distance, r.percent))} changed lines</li>",
        f"<li>check: {esc(check_word(r))}</li>",
        "</ul>",
    ]
    parts += [f'<p class="warn">warning: {esc(w)}</p>' for w in r.warnings]
    hd = _HtmlDiff(tabsize=4)
    for heading, entries in (
        ("Code (model.py, train.py, hf.py)", r.code_entries),
        ("Other files: docs, presets, benchmarks, ... (not used for the lineage)", r.other_entries),
    ):
        if not entries:
            continue
        parts.append(f"<h2>{esc(heading)}</h2>")
        unchanged = [e.path for e in entries if e.status == "unchanged"]
        for e in entries:
            if e.status == "unchanged":
                continue
            title = (
                f"{e.old} → {e.new} (renamed, {e.similarity:.0%} similar)"
                if e.status == "renamed"
                else f"{e.path} ({e.status}, +{e.added} -{e.removed})"
            )
            a = old.get(e.old, []) if e.old else []
            b = new.get(e.new, []) if e.new else []
            parts += [
                f"<h3>{esc(title)}</h3>",
                hd.make_table(
                    a,
                    b,
                    f"{r.base}/{e.old}" if e.old else "(none)",
                    f"{r.folder}/{e.new}" if e.new else "(none)",
                    context=True,
                    numlines=3,
                ),
            ]
        if unchanged:
            parts.append("<p>unchanged: " + ", ".join(f"<code>{esc(p)}</code>" for p in unchanged) + "</p>")
    if show_tests and r.tests:
        lines = read_lines(os.path.join(repo.root, r.tests))
        parts += [
            f"<h2>The variant's own tests: <code>{esc(r.tests)}</code> ({len(lines)} lines)</h2>",
            f'<pre class="file">{esc("".join(lines))}</pre>',
        ]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def render_outside_html(outside: list[Outside], rev: str) -> str:
    esc = html.escape
    parts = _page_head(f"files outside the folders changed since {esc(rev)}") + [
        f"<h1>Other files changed since <code>{esc(rev)}</code> (outside templates/ and variants/)</h1>"
    ]
    hd = _HtmlDiff(tabsize=4)
    for o in outside:
        parts += [
            f"<h3>{esc(o.path)} ({o.status}, +{o.added} -{o.removed})</h3>",
            hd.make_table(
                list(o.old),
                list(o.new),
                f"{o.path} ({rev})" if o.status != "added" else "(none)",
                f"{o.path} (working tree)" if o.status != "removed" else "(none)",
                context=True,
                numlines=3,
            ),
        ]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------- selecting folders


def _git(root: str, *args: str, text: bool = True) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=text)
    except FileNotFoundError as e:
        raise UsageError("--since needs git, which is not installed") from e


def changed_since(repo: Repo, rev: str) -> tuple[list[str], list[str]]:
    """(variant folders added or changed since rev, notes on changed folders that are not variants now)."""
    if _git(repo.root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").returncode != 0:
        raise UsageError(
            f"--since {rev}: not a commit of the git repository at {repo.root} "
            "(the first commit has no HEAD~1, and a shallow clone lacks older commits)"
        )
    paths = []
    for args in (
        ("diff", "--name-only", "--no-renames", "--relative", "-z", rev, "--", *TOPS),
        ("ls-files", "--others", "--exclude-standard", "-z", "--", *TOPS),
    ):
        p = _git(repo.root, *args)
        if p.returncode != 0:
            raise UsageError(f"git {' '.join(args[:2])} failed: {p.stderr.strip()}")
        paths += [x for x in p.stdout.split("\0") if x]
    folders = set()
    for path in paths:
        parts = path.split("/")
        if (
            len(parts) >= 3
            and parts[0] in TOPS
            and not any(_skipped(x, i < len(parts) - 1) for i, x in enumerate(parts[2:], 2))
        ):
            folders.add(f"{parts[0]}/{parts[1]}")
    present = sorted(f for f in folders if repo.exists(f))
    notes = [
        f"`{f}` was removed"
        if not os.path.isdir(os.path.join(repo.root, f))
        else f"`{f}` changed but holds no model.py, so it is not a variant"
        for f in sorted(folders)
        if not repo.exists(f)
    ]
    return present, notes


def outside_since(repo: Repo, rev: str, first: list[str] = (), exclude: str | None = None) -> list[Outside]:
    """Every file outside templates/ and variants/ changed from rev to the working tree (untracked files
    included; caches and the folder `exclude`, the report's own, skipped), the paths in `first` first,
    then by path."""
    p = _git(repo.root, "diff", "--name-status", "--no-renames", "--relative", "-z", rev)
    if p.returncode != 0:
        raise UsageError(f"git diff failed: {p.stderr.strip()}")
    fields = [x for x in p.stdout.split("\0") if x]
    status = {fields[i + 1]: fields[i][:1] for i in range(0, len(fields) - 1, 2)}
    p = _git(repo.root, "ls-files", "--others", "--exclude-standard", "-z")
    if p.returncode != 0:
        raise UsageError(f"git ls-files failed: {p.stderr.strip()}")
    for path in (x for x in p.stdout.split("\0") if x):
        status.setdefault(path, "A")
    out = []
    for path, st in status.items():
        parts = path.split("/")
        if parts[0] in TOPS or any(x in SKIP_DIRS for x in parts[:-1]) or path.endswith(SKIP_SUFFIXES):
            continue
        full = os.path.join(repo.root, path)
        if exclude and os.path.abspath(full).startswith(os.path.join(os.path.abspath(exclude), "")):
            continue
        old: list[str] = []
        if st != "A":
            shown = _git(repo.root, "show", f"{rev}:./{path}", text=False)
            old = decode_lines(shown.stdout) if shown.returncode == 0 else []
        new = read_lines(full) if os.path.isfile(full) else []
        what = "added" if st == "A" else "removed" if not os.path.isfile(full) else "modified"
        add, rem = line_changes(old, new)
        out.append(Outside(path, what, tuple(old), tuple(new), add, rem))
    return sorted(out, key=lambda o: (o.path not in first, o.path))


def resolve(repo: Repo, arg: str) -> str:
    """A folder argument (relative to the repository or the current directory, or a bare name) -> "top/name"."""
    cands = [os.path.abspath(arg), os.path.join(repo.root, arg)]
    if "/" not in arg.strip("/"):
        cands.append(os.path.join(repo.root, "variants", arg))
    for c in cands:
        rel = os.path.relpath(os.path.normpath(c), repo.root).replace(os.sep, "/")
        if rel in repo.parents:
            return rel
    raise UsageError(
        f"{arg}: not a variant folder of {repo.root} (templates/<name>/ or variants/<name>/ with a "
        f"model.py); known: {', '.join(repo.folders) or 'none'}"
    )


# ---------------------------------------------------------------- loss curves (--runs)


def load_compare_runs():
    """tools/review/compare_runs.py (next to this file), imported by path: only --runs needs it (and matplotlib)."""
    path = COMPARE_RUNS
    if not os.path.isfile(path):
        raise UsageError(f"--runs needs {path} (its compare(runs, out) draws the loss curves), which is missing")
    name = "stencil_variant_diff_compare_runs"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def loss_curves(runs: list[str], out: str) -> str:
    """Call compare_runs.compare(runs, out) (writes out/loss.png, out/summary.md); the report.md part."""
    cr = load_compare_runs()
    bad_run = tuple(x for x in (getattr(cr, "RunError", None),) if isinstance(x, type)) + (ValueError,)
    try:
        res = cr.compare(list(runs), out)
    except bad_run as e:
        raise UsageError(f"--runs: {e}") from e
    except ImportError as e:
        raise UsageError(f"--runs: the loss curves need matplotlib ({e}); pip install -e '.[tools]'") from e
    png = os.path.relpath(res["png"], out).replace(os.sep, "/")
    with open(res["md"], encoding="utf-8") as f:
        summary = f.read()
    return "\n".join(
        [
            "### Loss curves",
            "",
            "Runs (the parent's first): " + ", ".join(f"`{r}`" for r in runs),
            "",
            f"![loss curves]({png})",
            "",
            summary.rstrip("\n"),
        ]
    )


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python tools/review/variant_diff.py",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("folders", nargs="*", metavar="FOLDER", help="variant folders to report, e.g. variants/my_idea")
    p.add_argument(
        "--since",
        metavar="REV",
        help="also report every variant added or changed since git revision REV, "
        "and the files outside the folders changed with them",
    )
    p.add_argument("--table", action="store_true", help="print the lineage table of every variant")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="write report.md (Markdown, for a PR comment) and one side-by-side HTML page per variant to DIR",
    )
    p.add_argument(
        "--runs",
        nargs="+",
        metavar="RUN",
        help="run directories, the parent's run first, then the variant's (and more): put their loss "
        "curves (tools/review/compare_runs.py: loss.png, summary.md) into report.md; needs --out",
    )
    p.add_argument("--root", default=ROOT, help="repository root (default: the one this tool is in)")
    p.add_argument(
        "--margin",
        type=float,
        default=1.5,
        metavar="RATIO",
        help="warn when the declared parent is farther in code than RATIO x nearest + SLACK (default 1.5)",
    )
    p.add_argument("--slack", type=int, default=20, metavar="LINES", help="see --margin (default 20)")
    p.add_argument(
        "--max-diff-lines",
        type=int,
        default=400,
        metavar="N",
        help="lines per diff block (code, other files, own tests, other files changed with it) in "
        "report.md (default 400; the HTML pages have all)",
    )
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
        if args.runs is not None and not args.out:
            raise UsageError(
                "--runs puts the loss curves into report.md: give --out DIR (and variant folders or --since)"
            )
        if args.runs is not None and len(args.runs) < 2:
            raise UsageError("--runs needs at least two run directories: the parent's run, then the variant's")
        chosen = [resolve(repo, f) for f in args.folders]
        notes: list[str] = []
        outside = None
        if args.since:
            present, notes = changed_since(repo, args.since)
            chosen += present
            outside = outside_since(repo, args.since, [tests_path(f, repo.root) for f in sorted(set(chosen))], args.out)
            if not chosen and outside:
                notes.append(
                    f"{len(outside)} file(s) outside `templates/` and `variants/` changed since "
                    f"`{args.since}`; they are listed with a variant only"
                )
                outside = None
        chosen = sorted(set(chosen))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    everything = {f: analyse(repo, f, args.margin, args.slack) for f in repo.folders}
    reports = [everything[f] for f in chosen]
    show_tests = not args.since  # with --since the tests are among the other files changed, with their diff
    if args.table:
        print(render_table(table_rows(list(everything.values()))))
        if args.folders or args.since:
            print()
    if args.folders or args.since:
        if args.since and not args.folders:
            heading = f"Variants added or changed since `{args.since}`: {len(reports)}" + (
                "" if reports else " (nothing to compare)"
            )
        else:
            heading = f"Variants reported: {len(reports)}"
        kw = dict(show_tests=show_tests, outside=outside, since=args.since)
        print(render_markdown(repo, reports, list(everything.values()), heading, False, 0, notes, **kw), end="")
        if args.out:
            runs_md = None
            if args.runs:
                try:
                    runs_md = loss_curves(args.runs, args.out)
                except UsageError as e:
                    print(f"error: {e}", file=sys.stderr)
                    return 2
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "report.md"), "w", encoding="utf-8") as f:
                f.write(
                    render_markdown(
                        repo,
                        reports,
                        list(everything.values()),
                        heading,
                        True,
                        args.max_diff_lines,
                        notes,
                        runs_md=runs_md,
                        **kw,
                    )
                )
            for r in reports:
                with open(os.path.join(args.out, page_name(r.folder)), "w", encoding="utf-8") as f:
                    f.write(render_html(repo, r, show_tests))
            pages = len(reports)
            if outside:
                with open(os.path.join(args.out, OTHER_PAGE), "w", encoding="utf-8") as f:
                    f.write(render_outside_html(outside, args.since))
                pages += 1
            print(
                f"\nwrote {os.path.join(args.out, 'report.md')} and {pages} HTML page(s)"
                + (" (and the loss curves: loss.png, summary.md)" if runs_md else "")
            )
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
