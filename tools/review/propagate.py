#!/usr/bin/env python3
"""Carry a change made to a parent folder into every folder copied from it, by three-way merge.

Folders are copies (copy, don't abstract): a fix made in `templates/base/train.py` is not
seen by `variants/dense/train.py`, nor by the folders copied from dense. This tool carries
such a change into every descendant of the folder, file by file, and reports what it did.

Procedure.
1. The change. Three ways to name it, each giving, for every file of FOLDER it touched,
   the parent's file before (base) and after (theirs):
   - default: FOLDER's uncommitted edits; base = `git show HEAD:path`, theirs = the file in
     the working tree (staged or not; an untracked file counts as added);
   - `--rev A..B`: base = the file at A, theirs = the file at B;
   - `--rev REV`: the change made by commit REV; base = REV~1, theirs = REV.
   `--files` limits it to some of those files (paths inside FOLDER).
2. The descendants. Every folder whose declared lineage (`COPIED_FROM` in its model.py,
   read with `ast` by tools/review/variant_diff.py, never imported) passes through FOLDER, as the
   working tree declares it now, in lineage order: children, then grandchildren, ..., by
   name within a generation. `--to` limits them.
3. The merge. For each descendant and each changed file, with the same path inside the
   descendant: `git merge-file -p --diff3` of ours = the descendant's current working-tree
   file, base = the parent's file before, theirs = the parent's file after. A grandchild
   gets the same parent change as a child (base and theirs always come from FOLDER, not
   from the child's merged file): the grandchild is a copy of the child, which was a copy
   of FOLDER, so the lines the change touched are FOLDER's lines in all of them, and a
   child's own edits (or a conflict resolved by hand in the child) are not dragged into
   the grandchild. Each descendant is merged independently, so the order of processing
   only orders the report.
4. The verdict per descendant and file:
   - `clean`: merged with no conflict; `--apply` writes it (the dry run would write it);
   - `already`: the merged result equals the descendant's file (the fix is already there);
   - `conflict`: N conflicting hunks, each printed with diff3 markers labelled
     `<descendant>/<file> (descendant)`, `<FOLDER>/<file> before`, `<FOLDER>/<file> after`;
     never written unless `--write-conflicts` (then written with the markers);
   - `missing`: the descendant has no such file (skipped); `skipped`: the parent added
     the file while the descendant has one of its own, the parent deleted it, or it is
     binary (carry these by hand).
5. The diverged check (for `clean` and `conflict`). The parent change is split into hunks
   (difflib on base -> theirs). For each hunk, the base lines it replaces, widened by
   CONTEXT lines (default 3) on each side, are matched to the descendant's file (difflib
   on base -> ours). Where the descendant's lines there differ from the base, the copy had
   its own edits near the fix:
       diverged: lines X-Y of the descendant differ from the parent's old lines A-B
   A clean merge next to a divergence is text-correct but not necessarily right (the
   descendant may have renamed a variable the fix uses, or changed what the fixed code
   assumes), so read those places. `git merge-file` conflicts when both sides change the
   same or adjacent lines; a change 1 to CONTEXT lines away merges cleanly and is reported.

Dry run by default. `--apply` writes the clean merges into the working tree; it never
touches a descendant file with uncommitted changes (staged, unstaged or untracked)
unless `--force`. `--out DIR` also writes DIR/report.md with the same content.

Stdlib only, plus the `git` command. Exit status: 0 = every file clean or already (or
skipped/missing); 1 = conflicts present, or `--apply` left a clean merge unwritten because
of uncommitted changes; 2 = usage error (unknown folder, no change found, bad rev), one
`error: ...` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import subprocess
import sys
import tempfile

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(TOOLS))
CONTEXT = 3  # lines either side of a parent hunk in which the descendant's own edits are reported

sys.path.insert(0, TOOLS)  # lineage.py beside this file, however we were started
import lineage as vd  # noqa: E402  (tools/review/lineage.py: read_copied_from, discover, Repo)

EXAMPLES = """\
examples:
  # 1. fix templates/base/train.py (uncommitted), then see what it does to every copy:
  python tools/review/propagate.py templates/base
  # 2. write the clean merges into the descendants (conflicts are only reported):
  python tools/review/propagate.py templates/base --apply
  # the change made by one commit, only train.py, only two descendants, with a report:
  python tools/review/propagate.py templates/base --rev 1a2b3c4 --files train.py \\
      --to variants/dense,variants/kda --out /tmp/prop
  # the change between two revisions of variants/dense, into its own copies:
  python tools/review/propagate.py variants/dense --rev main..my-fix

verdicts: clean (merges cleanly; --apply writes it), already (the descendant already has
it), conflict (N hunks printed with diff3 markers; not written), missing (the descendant
has no such file), skipped (file added or deleted by the parent, or binary: by hand).
diverged: lines X-Y of the descendant differ from the parent's old lines A-B -- the copy
has its own edits within CONTEXT lines of a hunk of the change: read the merge there.

A grandchild receives the same parent change as a child (base and after from FOLDER).
--apply never writes a descendant file with uncommitted changes unless --force, and
never writes a conflict unless --write-conflicts (then with the markers).

exit status: 0 = all clean/already; 1 = conflicts present (or --apply left a file
unwritten); 2 = usage error (unknown folder, no change found, bad rev).
"""


class UsageError(Exception):
    """A bad argument: exit 2 with the message."""


# ---------------------------------------------------------------- git


def git(root: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run git in `root` (bytes out)."""
    p = subprocess.run(["git", *args], cwd=root, capture_output=True)
    if check and p.returncode != 0:
        msg = p.stderr.decode("utf-8", "replace").strip().splitlines()
        raise UsageError(f"git {' '.join(args)}: {msg[-1] if msg else 'failed'}")
    return p


def commit_of(root: str, rev: str) -> str:
    p = git(root, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}", check=False)
    if p.returncode != 0:
        raise UsageError(f"--rev: {rev!r} is not a commit")
    return p.stdout.decode().strip()


def show(root: str, rev: str, path: str) -> bytes | None:
    """The file `path` (relative to root) at `rev`, or None if it does not exist there."""
    p = git(root, "show", f"{rev}:./{path}", check=False)
    return p.stdout if p.returncode == 0 else None


def read(root: str, path: str) -> bytes | None:
    full = os.path.join(root, path)
    if not os.path.isfile(full):
        return None
    with open(full, "rb") as f:
        return f.read()


def dirty(root: str, path: str) -> bool:
    """The working-tree file has uncommitted changes (staged, unstaged or untracked)."""
    p = git(root, "status", "--porcelain", "--untracked-files=all", "--", path)
    return bool(p.stdout.strip())


@dataclasses.dataclass
class Change:
    """The parent's change: for each file (path inside FOLDER), (before, after); None = absent."""

    describe: str  # "working tree vs HEAD", "abc1234..def5678", "commit abc1234"
    before_name: str  # for labels: "HEAD", "abc1234"
    after_name: str  # "working tree", "def5678"
    files: dict[str, tuple[bytes | None, bytes | None]]


def read_change(root: str, folder: str, rev: str | None) -> Change:
    if rev is None:
        if git(root, "rev-parse", "--verify", "--quiet", "HEAD^{commit}", check=False).returncode != 0:
            raise UsageError("the repository has no commit yet (HEAD); nothing to compare with")
        out = git(root, "diff", "--name-only", "--no-renames", "--relative", "HEAD", "--", folder).stdout
        names = out.decode().split("\n")
        names += git(root, "ls-files", "--others", "--exclude-standard", "--", folder).stdout.decode().split("\n")
        a, b = "HEAD", None
        describe, a_name, b_name = "working tree vs HEAD", "HEAD", "working tree"
    else:
        if "..." in rev:
            raise UsageError(f"--rev {rev!r}: use A..B (two dots) or a single commit")
        if ".." in rev:
            lo, hi = rev.split("..", 1)
            a, b = commit_of(root, lo or "HEAD"), commit_of(root, hi or "HEAD")
            describe = f"{a[:9]}..{b[:9]}"
        else:
            b = commit_of(root, rev)
            p = git(root, "rev-parse", "--verify", "--quiet", f"{b}~1", check=False)
            if p.returncode == 0:
                a = p.stdout.decode().strip()
            else:  # a root commit: the change against the empty tree
                a = git(root, "hash-object", "-t", "tree", "/dev/null").stdout.decode().strip()
            describe = f"commit {b[:9]}"
        a_name, b_name = a[:9], b[:9]
        out = git(root, "diff", "--name-only", "--no-renames", "--relative", a, b, "--", folder).stdout
        names = out.decode().split("\n")
    files = {}
    for n in sorted({n for n in names if n}):
        rel = os.path.relpath(n, folder).replace(os.sep, "/")
        before = show(root, a, n)
        after = read(root, n) if b is None else show(root, b, n)
        if before != after:
            files[rel] = (before, after)
    return Change(describe, a_name, b_name, files)


# ---------------------------------------------------------------- merging and the diverged check


def lines_of(data: bytes) -> list[str]:
    return data.decode("utf-8", "replace").splitlines(keepends=True)


def span(lo: int, hi: int) -> str:
    """1-based text for the 0-based half-open range [lo, hi)."""
    if hi <= lo:
        return f"none (after line {lo})"
    return f"{lo + 1}" if hi == lo + 1 else f"{lo + 1}-{hi}"


def hunks(a: list[str], b: list[str]) -> list[tuple[int, int, int, int]]:
    """The changed regions (a1, a2, b1, b2) of a -> b."""
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return [(a1, a2, b1, b2) for tag, a1, a2, b1, b2 in sm.get_opcodes() if tag != "equal"]


def diverged(base: list[str], theirs: list[str], ours: list[str], context: int) -> list[str]:
    """One line per hunk of the parent change: where the descendant differs from base near it."""
    own = hunks(base, ours)
    notes = []
    for a1, a2, b1, b2 in hunks(base, theirs):
        lo, hi = max(0, a1 - context), min(len(base), a2 + context)
        if a2 == a1:
            head = f"parent hunk: new lines {span(b1, b2)} inserted after old line {a1}"
        elif b2 == b1:
            head = f"parent hunk: old lines {span(a1, a2)} deleted"
        else:
            head = f"parent hunk: old lines {span(a1, a2)} -> new lines {span(b1, b2)}"
        found = []
        for o1, o2, d1, d2 in own:
            near = (o1 < hi and o2 > lo) if o2 > o1 else (lo <= o1 <= hi)
            if not near:
                continue
            if d2 > d1 and o2 > o1:
                found.append(
                    f"diverged: lines {span(d1, d2)} of the descendant differ from "
                    f"the parent's old lines {span(o1, o2)}"
                )
            elif d2 > d1:
                found.append(
                    f"diverged: lines {span(d1, d2)} of the descendant are its own, "
                    f"added after the parent's old line {o1}"
                )
            else:
                found.append(
                    f"diverged: the descendant lacks the parent's old lines {span(o1, o2)} "
                    f"(deleted after its line {d1})"
                )
        if found:
            notes += [f"{head}: {f}" for f in found]
        else:
            notes.append(f"{head}: the descendant matches the parent's old lines there (within {context} lines)")
    return notes


def merge(ours: bytes, base: bytes, theirs: bytes, labels: tuple[str, str, str]) -> tuple[int, bytes]:
    """(conflicts, merged) from `git merge-file -p --diff3`; conflicts < 0 if git cannot merge."""
    with tempfile.TemporaryDirectory(prefix="propagate-") as d:
        paths = []
        for name, data in (("ours", ours), ("base", base), ("theirs", theirs)):
            p = os.path.join(d, name)
            with open(p, "wb") as f:
                f.write(data)
            paths.append(p)
        p = subprocess.run(
            ["git", "merge-file", "-p", "--diff3", "-L", labels[0], "-L", labels[1], "-L", labels[2], *paths],
            capture_output=True,
        )
    if p.returncode >= 128 or p.returncode < 0:
        return -1, p.stderr
    return p.returncode, p.stdout


def conflict_hunks(merged: bytes) -> list[tuple[int, list[str]]]:
    """[(first line number, lines)] of each <<<<<<< ... >>>>>>> block in the merged text."""
    out, cur, start = [], None, 0
    for i, line in enumerate(lines_of(merged), 1):
        if cur is None and line.startswith("<<<<<<< "):
            cur, start = [line], i
        elif cur is not None:
            cur.append(line)
            if line.startswith(">>>>>>> "):
                out.append((start, cur))
                cur = None
    return out


@dataclasses.dataclass
class FileResult:
    path: str  # inside the folder
    verdict: str  # clean / already / conflict / missing / skipped
    detail: str = ""  # why skipped, etc.
    n_conflicts: int = 0
    conflicts: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)
    written: str = ""  # what --apply did


@dataclasses.dataclass
class FolderResult:
    folder: str
    chain: list[str]
    files: list[FileResult]


def lineage(repo, folder: str) -> list[tuple[str, list[str]]]:
    """[(descendant, chain from folder to it)] in lineage order (generation, then name)."""
    children: dict[str, list[str]] = {}
    for f, (p, _) in repo.parents.items():
        if p is not None:
            children.setdefault(p, []).append(f)
    out, seen, gen = [], {folder}, [[folder]]
    while gen:
        nxt = []
        for chain in gen:
            for c in sorted(children.get(chain[-1], [])):
                if c not in seen:
                    seen.add(c)
                    nxt.append(chain + [c])
        nxt.sort(key=lambda ch: ch[-1])
        out += [(ch[-1], ch) for ch in nxt]
        gen = nxt
    return out


def propagate_file(
    root: str, folder: str, desc: str, rel: str, before: bytes | None, after: bytes | None, change: Change, args
) -> FileResult:
    path = f"{desc}/{rel}"
    ours = read(root, path)
    if ours is None:
        return FileResult(rel, "missing", f"{path} does not exist")
    if after is None:
        return FileResult(rel, "skipped", f"the parent deleted {folder}/{rel}; delete or keep it by hand")
    if before is None and ours != after:
        return FileResult(
            rel,
            "skipped",
            f"the parent added {folder}/{rel}, but {path} already exists with other contents; compare by hand",
        )
    base = before if before is not None else b""
    labels = (f"{path} (descendant)", f"{folder}/{rel} before", f"{folder}/{rel} after")
    n, merged = merge(ours, base, after, labels)
    if n < 0:
        why = merged.decode("utf-8", "replace").strip() or "git merge-file failed"
        return FileResult(rel, "skipped", f"cannot merge: {why}")
    if n == 0 and merged == ours:
        return FileResult(rel, "already")
    res = FileResult(rel, "clean" if n == 0 else "conflict", n_conflicts=n)
    res.notes = diverged(lines_of(base), lines_of(after), lines_of(ours), args.context)
    if n:
        res.conflicts = conflict_hunks(merged)
        res.n_conflicts = max(n, len(res.conflicts))
    if args.apply:
        if n and not args.write_conflicts:
            res.written = "not written (conflicts; resolve by hand, or --write-conflicts writes the markers)"
        elif (was_dirty := dirty(root, path)) and not args.force:
            res.written = f"not written: {path} has uncommitted changes (commit them first, or --force)"
        else:
            with open(os.path.join(root, path), "wb") as f:
                f.write(merged)
            forced = " over its uncommitted changes (--force)" if was_dirty else ""
            res.written = ("written with conflict markers" if n else "written") + forced
    else:
        res.written = "dry run: not written"
    return res


# ---------------------------------------------------------------- output


def verdict_line(r: FileResult) -> str:
    if r.verdict == "clean":
        return "clean (would write)" if r.written.startswith("dry run") else f"clean; {r.written}"
    if r.verdict == "conflict":
        s = f"conflict: {r.n_conflicts} hunk{'s' if r.n_conflicts != 1 else ''}"
        return s + ("" if r.written.startswith("dry run") else f"; {r.written}")
    if r.verdict == "already":
        return "already (the descendant already equals the merged result)"
    return f"{r.verdict}: {r.detail}"


def render(folder: str, change: Change, results: list[FolderResult], args, md: bool) -> str:
    out = []
    files = ", ".join(change.files)
    mode = "apply" if args.apply else "dry run (nothing written; --apply writes clean merges)"
    if md:
        out += [
            f"# propagate {folder}",
            "",
            f"- change: {change.describe} ({len(change.files)} file(s): {files})",
            f"- mode: {mode}",
            f"- descendants, in lineage order: {', '.join(r.folder for r in results) or 'none'}",
        ]
    else:
        out += [
            f"propagate {folder}: {change.describe} ({len(change.files)} file(s): {files})",
            f"mode: {mode}",
            f"descendants, in lineage order: {', '.join(r.folder for r in results) or 'none'}",
        ]
    for fr in results:
        chain = " -> ".join(fr.chain)
        out += ["", f"## {fr.folder}", "", f"lineage: {chain}", ""] if md else ["", f"== {fr.folder}  ({chain})"]
        for r in fr.files:
            line = f"{fr.folder}/{r.path}: {verdict_line(r)}"
            out.append(f"- `{fr.folder}/{r.path}`: {verdict_line(r)}" if md else f"  {line}")
            for note in r.notes:
                out.append(f"  - {note}" if md else f"    {note}")
            for k, (start, block) in enumerate(r.conflicts, 1):
                head = f"conflict {k} of {len(r.conflicts)} (merged lines {start}-{start + len(block) - 1}):"
                if md:
                    out += ["", f"  {head}", "", "  ```"] + [f"  {l.rstrip(chr(10))}" for l in block] + ["  ```", ""]
                else:
                    out.append(f"    {head}")
                    out += [f"      {l.rstrip(chr(10))}" for l in block]
    n_conf = sum(r.verdict == "conflict" for fr in results for r in fr.files)
    counts: dict[str, int] = {}
    for fr in results:
        for r in fr.files:
            counts[r.verdict] = counts.get(r.verdict, 0) + 1
    summary = (
        ", ".join(f"{v} {counts[v]}" for v in ("clean", "already", "conflict", "missing", "skipped") if v in counts)
        or "nothing to do"
    )
    out += ["", f"summary: {summary}" + (f" -- {n_conf} file(s) with conflicts" if n_conf else "")]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- main


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="propagate.py",
        description="Carry a change to a parent folder's files into every descendant folder "
        "(declared by COPIED_FROM), by a three-way merge per file (git merge-file). "
        "Dry run unless --apply.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("folder", help="the parent folder whose change is carried, e.g. templates/base")
    ap.add_argument(
        "--rev",
        help="A..B (base = A, after = B) or REV (the change made by commit REV); "
        "default: the folder's uncommitted changes against HEAD",
    )
    ap.add_argument("--files", help="comma-separated paths inside FOLDER to carry (default: every changed file)")
    ap.add_argument("--to", help="comma-separated descendant folders to carry into (default: all)")
    ap.add_argument("--apply", action="store_true", help="write the clean merges into the working tree")
    ap.add_argument(
        "--write-conflicts", action="store_true", help="with --apply, also write conflicting files, with diff3 markers"
    )
    ap.add_argument(
        "--force", action="store_true", help="with --apply, write even over a descendant file with uncommitted changes"
    )
    ap.add_argument(
        "--context",
        type=int,
        default=CONTEXT,
        help=f"lines either side of a parent hunk for the diverged check (default {CONTEXT})",
    )
    ap.add_argument("--out", help="also write DIR/report.md (Markdown, same content)")
    ap.add_argument("--root", default=ROOT, help="repository root (default: the repo holding this tool)")
    return ap.parse_args(argv)


def norm_folder(s: str) -> str:
    s = s.strip().replace(os.sep, "/").strip("/")
    return s[2:] if s.startswith("./") else s


def run(args) -> int:
    root = os.path.abspath(args.root)
    if not os.path.isdir(root):
        raise UsageError(f"--root {args.root}: not a directory")
    if git(root, "rev-parse", "--is-inside-work-tree", check=False).returncode != 0:
        raise UsageError(f"--root {args.root}: not a git working tree")
    if args.context < 0:
        raise UsageError("--context must be >= 0")
    repo = vd.Repo(root)
    folder = norm_folder(args.folder)
    if not repo.exists(folder):
        raise UsageError(f"unknown folder {args.folder!r} (known: {', '.join(repo.folders) or 'none'})")
    change = read_change(root, folder, args.rev)
    if args.files:
        want = [norm_folder(f) for f in args.files.split(",") if f.strip()]
        bad = [f for f in want if f not in change.files]
        if bad:
            raise UsageError(
                f"--files {','.join(bad)}: not changed in {folder} by {change.describe} "
                f"(changed: {', '.join(change.files) or 'nothing'})"
            )
        change.files = {f: change.files[f] for f in want}
    if not change.files:
        raise UsageError(f"no change to {folder}/ found ({change.describe})")
    order = lineage(repo, folder)
    if args.to:
        want = [norm_folder(t) for t in args.to.split(",") if t.strip()]
        known = {d for d, _ in order}
        bad = [t for t in want if t not in known]
        if bad:
            raise UsageError(
                f"--to {','.join(bad)}: not a descendant of {folder} "
                f"(descendants: {', '.join(d for d, _ in order) or 'none'})"
            )
        order = [(d, ch) for d, ch in order if d in want]
    results = []
    for desc, chain in order:
        files = [propagate_file(root, folder, desc, rel, b, a, change, args) for rel, (b, a) in change.files.items()]
        results.append(FolderResult(desc, chain, files))
    sys.stdout.write(render(folder, change, results, args, md=False))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "report.md"), "w", encoding="utf-8") as f:
            f.write(render(folder, change, results, args, md=True))
    all_files = [r for fr in results for r in fr.files]
    if any(r.verdict == "conflict" for r in all_files):
        return 1
    if args.apply and any(r.verdict == "clean" and not r.written.startswith("written") for r in all_files):
        return 1
    return 0


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # argparse already printed "error: ..." for a bad option
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    try:
        return run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
