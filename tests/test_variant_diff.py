"""tools/variant_diff.py on small synthetic repositories: nearest sibling, file changes,
determinism, lineage warnings, --since in a git repository, and the real repo's table."""

import contextlib
import io
import os
import shutil
import subprocess
import sys

import pytest

from shared.variant import ROOT, load

TOOL = os.path.join(ROOT, "tools", "variant_diff.py")
vd = load(TOOL)

BASE_MODEL = "".join(f"def layer_{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(20))
BASE_TRAIN = "".join(f"STEP_{i} = {i}  # train setting {i}\n" for i in range(25))
PRESET = "".join(f"key_{i}: {i}\n" for i in range(12))


def model(parent, body=BASE_MODEL):
    return f'"""A model."""\n\nCOPIED_FROM = {parent!r}\n\n' + body


def write(root, files):
    for path, text in files.items():
        p = root / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def edit(text, n, tag):
    """`text` with its first n lines replaced."""
    lines = text.splitlines(keepends=True)
    return "".join([f"# {tag} {i}\n" for i in range(n)] + lines[n:])


@pytest.fixture
def repo(tmp_path):
    """templates/base <- variants/a (30 model lines edited) <- variants/b (2 model lines added).

    Each COPIED_FROM line differs from its parent's too: one more line removed and added."""
    a_model = edit(BASE_MODEL, 30, "a")
    write(tmp_path, {
        "templates/base/model.py": model(None), "templates/base/train.py": BASE_TRAIN,
        "templates/base/presets/small.yaml": PRESET,
        "variants/a/model.py": model("templates/base", a_model), "variants/a/train.py": BASE_TRAIN,
        "variants/a/presets/small.yaml": PRESET,
        "variants/b/model.py": model("variants/a", a_model + "def extra(x):\n    return x\n"),
        "variants/b/train.py": BASE_TRAIN, "variants/b/presets/small.yaml": PRESET,
        "variants/b/__pycache__/model.cpython-311.pyc": "ignored",
    })
    return tmp_path


def run(root, *args):
    """(exit status, stdout, stderr) of the tool's main, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = vd.main([*args, "--root", str(root)])
    return rc, out.getvalue(), err.getvalue()


def test_reads_copied_from_without_importing(tmp_path):
    p = tmp_path / "model.py"
    p.write_text('import module_that_does_not_exist\nCOPIED_FROM = "variants/dense/"  # trailing slash\n')
    assert vd.read_copied_from(str(p)) == ("variants/dense", None)
    p.write_text("COPIED_FROM = None\n")
    assert vd.read_copied_from(str(p)) == (None, None)
    p.write_text('PARENT = "x"\nCOPIED_FROM = PARENT\n')
    assert "not a string literal" in vd.read_copied_from(str(p))[1]
    p.write_text("x = 1\n")
    assert "does not assign COPIED_FROM" in vd.read_copied_from(str(p))[1]


def test_picks_nearest_sibling_and_skips_descendants(repo):
    r = vd.Repo(str(repo))
    assert r.folders == ["templates/base", "variants/a", "variants/b"]
    assert r.nearest("variants/b") == ("variants/a", 2 + 2)  # two added lines, COPIED_FROM changed
    assert r.nearest("variants/a")[0] == "templates/base"  # b is a's copy, never its nearest
    assert r.nearest("templates/base") == (None, None)
    assert r.distance("variants/a", "templates/base") == 60 + 2  # 30 lines removed + 30 added, COPIED_FROM
    assert "__pycache__/model.cpython-311.pyc" not in r.files("variants/b")
    rc, out, err = run(repo, "--table")
    assert rc == 0 and not err
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in out.splitlines()[2:]}
    assert rows["variants/b"][:4] == ["variants/a", "variants/a", "4 (2.0%)", "4"]  # 4 of 102 + 100 lines
    assert rows["templates/base"][0] == "(root)" and rows["variants/a"][-1] == "ok"


def test_added_removed_and_renamed_files(repo):
    write(repo, {
        "variants/c/model.py": (repo / "variants/a/model.py").read_text().replace("'templates/base'", "'variants/a'"),
        "variants/c/loop.py": BASE_TRAIN.replace("STEP_3 = 3", "STEP_3 = 33"),  # train.py, renamed and edited
        "variants/c/NOTES.md": "why this variant exists\n```\ncode\n```\n",
    })  # presets/small.yaml removed
    r = vd.Repo(str(repo))
    entries = {e.path: e for e in vd.compare(r.files("variants/a"), r.files("variants/c"))}
    assert entries["loop.py"].status == "renamed" and entries["loop.py"].old == "train.py"
    assert (entries["loop.py"].added, entries["loop.py"].removed) == (1, 1) and entries["loop.py"].similarity > 0.9
    assert (entries["NOTES.md"].status, entries["NOTES.md"].added) == ("added", 4)
    assert (entries["presets/small.yaml"].status, entries["presets/small.yaml"].removed) == ("removed", 12)
    assert (entries["model.py"].status, entries["model.py"].added) == ("modified", 1)  # the COPIED_FROM line
    assert r.distance("variants/c", "variants/a") == 2 + 2 + 4 + 12

    out_dir = repo / "report"
    rc, out, _ = run(repo, "variants/c", "--out", str(out_dir))
    assert rc == 0
    md = (out_dir / "report.md").read_text()
    assert md.startswith(vd.MARKER)
    assert "| `loop.py` ← `train.py` | renamed, 96% similar | +1 -1 |" in md
    assert "| `presets/small.yaml` | removed | -12 |" in md and "| `NOTES.md` | added | +4 |" in md
    assert "````diff" in md, "a diff holding ``` needs a longer fence"
    assert "+STEP_3 = 33" in md and "--- variants/a/train.py\n+++ variants/c/loop.py" in md
    page = (out_dir / "variants__c.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "train.py → loop.py" in page and "<script" not in page
    assert "http" not in page.replace("http-equiv", ""), "the page must be self-contained"


def test_output_is_deterministic(repo, tmp_path_factory):
    write(repo, {"variants/c/model.py": model("variants/b", BASE_MODEL), "variants/c/train.py": BASE_TRAIN})
    outs = []
    for i in range(2):
        d = tmp_path_factory.mktemp(f"out{i}")
        rc, out, err = run(repo, "--table", "variants/c", "variants/a", "--out", str(d))
        assert rc == 0
        outs.append((out.replace(str(d), "OUT"), err,
                     {p: (d / p).read_bytes() for p in sorted(os.listdir(d))}))
    assert outs[0] == outs[1]
    assert sorted(outs[0][2]) == ["report.md", "variants__a.html", "variants__c.html"]


def test_parent_mismatch_and_missing_parent(repo):
    # d is b plus one line, but declares templates/base: the nearest is b, far nearer than the base
    b_model = (repo / "variants/b/model.py").read_text().replace("'variants/a'", "'templates/base'")
    b_train = BASE_TRAIN + "ONLY_IN_B = 1\n"
    write(repo, {"variants/b/train.py": b_train,
                 "variants/d/model.py": b_model + "# d\n", "variants/d/train.py": b_train,
                 "variants/d/presets/small.yaml": PRESET,
                 "variants/e/model.py": model("variants/gone"), "variants/e/train.py": BASE_TRAIN})
    rc, out, err = run(repo, "variants/d", "variants/e")
    assert rc == 0, "warnings alone do not fail without --strict"
    assert "declared parent templates/base is" in out and 'set COPIED_FROM = "variants/b"' in out
    assert "declared parent 'variants/gone' does not exist" in out
    assert "warning: variants/d:" in err and "warning: variants/e:" in err
    assert "Change against the nearest sibling (the declared parent is unusable) `templates/base`" in out
    table = run(repo, "--table")[1]
    assert "parent far" in table and "parent missing" in table
    assert run(repo, "variants/d", "--strict")[0] == 1
    assert run(repo, "variants/b", "--strict")[0] == 0
    rc, _, err = run(repo, "variants/nope")
    assert rc == 2 and "not a variant folder" in err


def git(root, *args):
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com",
                           "-c", "commit.gpgsign=false", *args], check=True, capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_since_reports_only_changed_variants(repo):
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "one")
    rc, _, err = run(repo, "--since", "HEAD~1")
    assert rc == 2 and "not a commit" in err, "the first commit has no HEAD~1: say so"
    rc, out, _ = run(repo, "--since", "HEAD")
    assert rc == 0 and "since `HEAD`: 0 (nothing to compare)" in out

    write(repo, {"variants/b/presets/small.yaml": PRESET + "new: 1\n",             # tracked change
                 "variants/c/model.py": model("variants/b", BASE_MODEL),         # untracked variant
                 "variants/c/train.py": BASE_TRAIN,
                 "variants/a/__pycache__/x.pyc": "not a change", "README.md": "not a variant\n",
                 "variants/half/notes.txt": "no model.py yet\n"})
    rc, out, _ = run(repo, "--since", "HEAD")
    assert rc == 0 and "since `HEAD`: 2" in out
    assert "`variants/half` changed but holds no model.py" in out
    assert "### `variants/b`" in out and "### `variants/c`" in out and "### `variants/a`" not in out

    git(repo, "add", "variants/b", "variants/c")
    git(repo, "commit", "-q", "-m", "two")
    shutil.rmtree(repo / "variants/a/__pycache__")
    git(repo, "rm", "-q", "-r", "variants/a")
    git(repo, "commit", "-q", "-m", "three")
    rc, out, _ = run(repo, "--since", "HEAD~1")
    assert rc == 0 and "- `variants/a` was removed" in out and "### `variants/" not in out
    rc, out, _ = run(repo, "--since", "HEAD~2")
    assert "### `variants/b`" in out and "### `variants/c`" in out
    assert "declared parent 'variants/a' does not exist" in out  # b's parent went away


def test_cli_help_and_real_repository_table():
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    h = subprocess.run([sys.executable, TOOL, "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert h.returncode == 0 and "--since REV" in h.stdout and "--table" in h.stdout
    t = subprocess.run([sys.executable, TOOL, "--table"], capture_output=True, text=True, env=env, timeout=60)
    assert t.returncode == 0, t.stderr
    assert "| templates/base " in t.stdout and "| variants/dense " in t.stdout
    none = subprocess.run([sys.executable, TOOL], capture_output=True, text=True, env=env, timeout=60)
    assert none.returncode == 2 and "--since REV or --table" in none.stderr
    out_only = subprocess.run([sys.executable, TOOL, "--table", "--out", "/nonexistent"], capture_output=True,
                              text=True, env=env, timeout=60)
    assert out_only.returncode == 2 and "--out writes the report" in out_only.stderr
