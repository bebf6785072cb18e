"""The lineage of the folders under templates/ and variants/: which folder each one declares as its
parent (COPIED_FROM in its model.py, read with `ast`, never imported), the code distance between two
folders, the nearest sibling by that distance, and whether the declared parent is near enough.

tools/review/variant_diff.py renders it (the lineage table, the Markdown and HTML review) and
tools/review/propagate.py walks it; the measure is described in variant_diff.py's docstring and --help.
Stdlib only.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import os


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOPS = ("templates", "variants")
LINEAGE_ROOT = "templates/base"  # the one folder that declares COPIED_FROM = None
RENAME_MIN = 0.5  # similarity (difflib ratio) at which a removed + an added file are a rename
SKIP_DIRS = {"__pycache__", "runs", "wandb", "build", "node_modules"}
SKIP_SUFFIXES = (".pyc", ".pyo", ".so", ".egg-info")
CODE_FILES = ("model.py", "train.py", "hf.py")  # the lineage (nearest sibling, the check) is measured over these only
# hf.py (the Hugging Face mapping) changes with the math, so it is code; a folder without one has no export
# (deleting a parent's is one decision, not hundreds of changed lines: Repo.distance)
OPTIONAL_CODE = ("hf.py",)


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
        return decode_lines(f.read())


def decode_lines(raw: bytes) -> list[str]:
    try:
        return raw.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return [f"<binary file, {len(raw)} bytes, sha256 {hashlib.sha256(raw).hexdigest()}>\n"]


def kind_of(path: str) -> str:
    """A file's kind inside a folder: "code" (model.py, train.py, hf.py: the lineage is measured over
    these), "docs" (*.md), "presets" (presets/*.yaml) or "other" (bench_*.py and the rest)."""
    if path in CODE_FILES:
        return "code"
    low = path.lower()
    if low.endswith(".md"):
        return "docs"
    if low.startswith("presets/") and low.endswith((".yaml", ".yml")):
        return "presets"
    return "other"


class Repo:
    """The folders of one repository, read once."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.folders = discover(self.root)
        self._files: dict[str, dict[str, list[str]]] = {}
        self._dist: dict[tuple[str, str, bool], int] = {}
        self.parents: dict[str, tuple[str | None, str | None]] = {
            f: read_copied_from(os.path.join(self.root, f, "model.py")) for f in self.folders
        }

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

    def part(self, folder: str, code: bool) -> dict[str, list[str]]:
        """The code files of the folder (model.py, train.py, hf.py), or all its other files."""
        return {p: v for p, v in self.files(folder).items() if (kind_of(p) == "code") == code}

    def n_lines(self, folder: str, code: bool = True) -> int:
        return sum(len(v) for v in self.part(folder, code).values())

    def distance(self, a: str, b: str, code: bool = True) -> int:
        """Changed lines to make folder `a` from folder `b` over their code (the lineage measure),
        or over their other files with code=False. Symmetric but for hf.py: one that `b` has and
        `a` lacks is one deletion (a has no export), so it is left out; one that `a` has and `b`
        lacks was written, and counts all its lines."""
        key = (a, b, code)
        if key not in self._dist:
            a_part, b_part = self.part(a, code), self.part(b, code)
            if code:
                for p in OPTIONAL_CODE:
                    if p in b_part and p not in a_part:
                        b_part.pop(p)
            self._dist[key] = total(compare(b_part, a_part))
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
        """The nearest other folder by code distance (not a declared descendant); ties go to the
        declared parent, then by name."""
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
    pairs = sorted(
        ((s, o, n) for o in gone for n in came if (s := similarity(old[o], new[n])) >= RENAME_MIN),
        key=lambda t: (-t[0], t[1], t[2]),
    )
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
    nearest: str | None  # the nearest other folder by code distance
    nearest_distance: int | None  # code distance (model.py, train.py, hf.py) to the nearest
    parent_distance: int | None  # code distance to the declared parent
    parent_other: int | None  # distance over the other files (docs, presets, ...) to the declared parent
    base: str | None  # what the diff is against: the declared parent, else the nearest sibling
    code_entries: list[Entry]  # model.py, train.py, hf.py against the base
    other_entries: list[Entry]  # every other file against the base
    warnings: list[str]
    percent: float | None  # nearest code distance over the code lines of both folders
    within_margin: bool = False  # another folder is nearer by code, but not by more than the margin
    tests: str | None = None  # <folder>/test_<name>.py or tests/test_<name>.py, when it exists

    @property
    def entries(self) -> list[Entry]:
        return self.code_entries + self.other_entries


def tests_path(folder: str, root: str = ".") -> str:
    """The variant's own tests: <folder>/test_<name>.py (they travel with a copy), else tests/test_<name>.py."""
    name = folder.split("/", 1)[1]
    inside = f"{folder}/test_{name}.py"
    return inside if os.path.isfile(os.path.join(root, inside)) else f"tests/test_{name}.py"


def analyse(repo: Repo, folder: str, margin: float, slack: int) -> Report:
    declared, problem = repo.parents[folder]
    warnings = [problem] if problem else []
    nearest, nd = repo.nearest(folder)
    pd = po = None
    within = False
    if declared is None and problem is None and folder != LINEAGE_ROOT:
        warnings.append(
            f"COPIED_FROM = None, but only {LINEAGE_ROOT} is the root of the lineage; "
            "name the folder this one was copied from"
        )
    if declared is not None:
        if declared == folder:
            warnings.append("COPIED_FROM names this folder itself")
        elif not repo.exists(declared):
            warnings.append(
                f"declared parent {declared!r} does not exist (no {declared}/model.py)"
                + (f"; the nearest folder by code is {nearest}" if nearest else "")
            )
        else:
            pd = repo.distance(folder, declared)
            po = repo.distance(folder, declared, code=False)
            loop = repo.cycle(folder)
            if loop:
                warnings.append("lineage cycle: " + " -> ".join(loop))
            if nearest is not None and nearest != declared:
                limit = nd * margin + slack
                if pd > limit:
                    warnings.append(
                        f"declared parent {declared} is {pd} changed lines of code away (model.py, train.py, hf.py), but "
                        f"{nearest} is only {nd} (the limit is {margin:g} x {nd} + {slack} = {limit:g}): if this "
                        f'folder was copied from {nearest}, set COPIED_FROM = "{nearest}" in {folder}/model.py; '
                        f"if {nearest} was copied from this folder, its COPIED_FROM should name {folder}"
                    )
                else:
                    within = True
    base = declared if declared is not None and declared != folder and repo.exists(declared) else nearest
    code_entries = compare(repo.part(base, True), repo.part(folder, True)) if base else []
    other_entries = compare(repo.part(base, False), repo.part(folder, False)) if base else []
    if base is None and folder != LINEAGE_ROOT:
        warnings.append("no other folder to compare with")
    pct = None
    if nd is not None:
        both = repo.n_lines(folder) + repo.n_lines(nearest)
        pct = 100.0 * nd / both if both else 0.0
    tests = tests_path(folder, repo.root)
    tests = tests if os.path.isfile(os.path.join(repo.root, tests)) else None
    return Report(
        folder, declared, nearest, nd, pd, po, base, code_entries, other_entries, warnings, pct, within, tests
    )


def check_word(r: Report) -> str:
    """ "ok" only when the declared parent is the nearest folder by code (or this is the root)."""
    if not r.warnings:
        return "within margin" if r.within_margin else "ok"
    w = r.warnings[0]
    more = f" (+{len(r.warnings) - 1})" if len(r.warnings) > 1 else ""
    for key, word in (
        ("does not exist", "parent missing"),
        ("lines of code away", "parent far"),
        ("cycle", "cycle"),
        ("COPIED_FROM = None", "no parent"),
        ("itself", "self parent"),
        ("no other folder", "alone"),
    ):
        if key in w:
            return word + more
    return "COPIED_FROM" + more
