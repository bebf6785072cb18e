"""tools/review/propagate.py on small throwaway git repositories: templates/base <- variants/a <- variants/b.

Each test builds its own repository in tmp_path and runs the tool by subprocess with --root."""

import os
import subprocess
import sys

import pytest

from shared.variant import ROOT

TOOL = os.path.join(ROOT, "tools", "review", "propagate.py")

TRAIN = "".join(f"STEP_{i} = {i}  # train setting {i}\n" for i in range(20))
BODY = "".join(f"def layer_{i}(x):\n    return x * {i}\n" for i in range(9))
GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
    "GIT_CONFIG_NOSYSTEM": "1",
    "HOME": "/nonexistent",
}


def model(parent):
    return f'"""A model."""\nCOPIED_FROM = {parent!r}\n' + BODY


def line(text, n, new):
    """`text` with its line n (1-based) replaced by `new`."""
    lines = text.splitlines(keepends=True)
    lines[n - 1] = new + "\n"
    return "".join(lines)


FIX = "STEP_2 = 2.5  # train setting 2, fixed"
FIXED = line(TRAIN, 3, FIX)  # the parent's change: line 3 of train.py


def git(root, *args):
    env = {**os.environ, **GIT_ENV}
    return subprocess.run(
        ["git", "-C", str(root), *args], check=True, capture_output=True, text=True, env=env
    ).stdout.strip()


def write(root, files):
    for path, text in files.items():
        p = root / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def make_repo(root, a_train=TRAIN, b_train=TRAIN):
    """The three folders, committed; the descendants' train.py as given."""
    write(
        root,
        {
            "templates/base/model.py": model(None),
            "templates/base/train.py": TRAIN,
            "variants/a/model.py": model("templates/base"),
            "variants/a/train.py": a_train,
            "variants/b/model.py": model("variants/a"),
            "variants/b/train.py": b_train,
        },
    )
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "initial")
    return root


def run(root, *args):
    p = subprocess.run([sys.executable, TOOL, *args, "--root", str(root)], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


def read(root, path):
    return (root / path).read_text()


A_OWN = line(TRAIN, 18, "STEP_17 = 170  # a's own setting")
B_OWN = line(line(A_OWN, 16, "STEP_15 = 150  # b's own setting"), 20, "STEP_19 = 190  # b's own setting")


def test_clean_into_child_and_grandchild(tmp_path):
    root = make_repo(tmp_path, A_OWN, B_OWN)
    write(root, {"templates/base/train.py": FIXED})  # the uncommitted fix in the parent

    rc, out, err = run(root, "templates/base", "--out", str(tmp_path / "rep"))
    assert rc == 0, out + err
    assert "variants/a/train.py: clean (would write)" in out
    assert "variants/b/train.py: clean (would write)" in out
    assert out.index("== variants/a") < out.index("== variants/b")  # children before grandchildren
    assert "templates/base -> variants/a -> variants/b" in out
    assert "model.py" not in out.split("\n")[0]  # only the changed file is carried
    assert read(root, "variants/a/train.py") == A_OWN and read(root, "variants/b/train.py") == B_OWN  # dry run
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "`variants/b/train.py`: clean (would write)" in report

    rc, out, err = run(root, "templates/base", "--apply")
    assert rc == 0, out + err
    assert "variants/a/train.py: clean; written" in out
    a, b = read(root, "variants/a/train.py"), read(root, "variants/b/train.py")
    assert a == line(A_OWN, 3, FIX)  # the fix landed, a's own edit stayed
    assert b == line(B_OWN, 3, FIX)  # and b's two own edits
    assert read(root, "templates/base/train.py") == FIXED

    rc, out, _ = run(root, "templates/base")  # again: the descendants already have it
    assert rc == 0 and out.count(": already (") == 2 and "summary: already 2" in out


def test_apply_refuses_uncommitted_descendant_unless_force(tmp_path):
    root = make_repo(tmp_path, A_OWN)
    write(root, {"templates/base/train.py": FIXED, "variants/a/train.py": line(A_OWN, 12, "X = 1")})

    rc, out, _ = run(root, "templates/base", "--apply")
    assert rc == 1
    assert "variants/a/train.py has uncommitted changes" in out and "--force" in out
    assert read(root, "variants/a/train.py") == line(A_OWN, 12, "X = 1")  # untouched
    assert read(root, "variants/b/train.py") == FIXED  # b was committed: written

    rc, out, _ = run(root, "templates/base", "--apply", "--force")
    assert rc == 0, out
    assert "--force" in out
    assert read(root, "variants/a/train.py") == line(line(A_OWN, 12, "X = 1"), 3, FIX)


def test_conflict_reported_and_file_untouched(tmp_path):
    mine = line(TRAIN, 3, "STEP_2 = 7  # a's own value")
    root = make_repo(tmp_path, mine, mine)
    write(root, {"templates/base/train.py": FIXED})

    for extra in ([], ["--apply"]):
        rc, out, _ = run(root, "templates/base", *extra)
        assert rc == 1, out
        assert "variants/a/train.py: conflict: 1 hunk" in out
        assert "<<<<<<< variants/a/train.py (descendant)" in out
        assert "STEP_2 = 7  # a's own value" in out
        assert "||||||| templates/base/train.py before" in out
        assert f"      {FIX}" in out  # the parent's new line inside the printed hunk
        assert ">>>>>>> templates/base/train.py after" in out
        assert "diverged: lines 3 of the descendant differ from the parent's old lines 3" in out
        assert read(root, "variants/a/train.py") == mine and read(root, "variants/b/train.py") == mine
    assert "not written (conflicts" in out

    rc, out, _ = run(root, "templates/base", "--apply", "--write-conflicts", "--to", "variants/b")
    assert rc == 1 and "== variants/a" not in out
    assert "<<<<<<< variants/b/train.py (descendant)" in read(root, "variants/b/train.py")
    assert read(root, "variants/a/train.py") == mine


def test_diverged_near_the_change_but_clean(tmp_path):
    near = line(TRAIN, 5, "STEP_4 = 40  # a's own edit, two lines below the fix")
    root = make_repo(tmp_path, near, TRAIN)
    write(root, {"templates/base/train.py": FIXED})

    rc, out, _ = run(root, "templates/base", "--apply")
    assert rc == 0, out
    a_part, b_part = out.split("== variants/b")
    assert "variants/a/train.py: clean; written" in a_part
    assert (
        "parent hunk: old lines 3 -> new lines 3: diverged: lines 5 of the descendant differ "
        "from the parent's old lines 5"
    ) in a_part
    assert "diverged" not in b_part and "matches the parent's old lines" in b_part
    assert read(root, "variants/a/train.py") == line(near, 3, FIX)

    rc, out, _ = run(root, "templates/base", "--context", "1")  # out of reach of a 1-line window
    assert "diverged" not in out


def test_already_when_descendant_has_the_fix(tmp_path):
    root = make_repo(tmp_path, line(A_OWN, 3, FIX), TRAIN)
    write(root, {"templates/base/train.py": FIXED})

    rc, out, _ = run(root, "templates/base", "--apply")
    assert rc == 0, out
    assert "variants/a/train.py: already" in out
    assert "variants/b/train.py: clean; written" in out
    assert read(root, "variants/a/train.py") == line(A_OWN, 3, FIX)


def test_rev_range_and_single_commit(tmp_path):
    root = make_repo(tmp_path, A_OWN, TRAIN)
    first = git(root, "rev-parse", "HEAD")
    write(root, {"templates/base/train.py": FIXED, "templates/base/model.py": model(None) + "# note\n"})
    git(root, "commit", "-q", "-am", "fix base")
    second = git(root, "rev-parse", "HEAD")
    write(root, {"README.md": "unrelated\n"})
    git(root, "add", "README.md")
    git(root, "commit", "-q", "-m", "unrelated")

    rc, _, err = run(root, "templates/base")  # nothing uncommitted in the parent
    assert rc == 2 and err.startswith("error: no change to templates/base/")

    for rev in (second, "HEAD~1", f"{first}..HEAD"):
        rc, out, _ = run(root, "templates/base", "--rev", rev)
        assert rc == 0, out
        assert "(2 file(s): model.py, train.py)" in out
        assert "variants/a/train.py: clean (would write)" in out
        assert "variants/a/model.py: clean (would write)" in out
    assert f"{first[:9]}..{git(root, 'rev-parse', 'HEAD')[:9]}" in out

    rc, out, _ = run(root, "templates/base", "--rev", f"{first}..{second}", "--files", "train.py", "--apply")
    assert rc == 0, out
    assert "model.py" not in out
    assert read(root, "variants/a/train.py") == line(A_OWN, 3, FIX)
    assert read(root, "variants/b/train.py") == FIXED
    assert "# note" not in read(root, "variants/a/model.py")

    rc, out, _ = run(root, "templates/base", "--rev", "HEAD")  # README only: no change to the folder
    assert rc == 2


@pytest.mark.parametrize(
    "args, msg",
    [
        (["variants/nope"], "unknown folder"),
        (["templates/base"], "no change to templates/base/"),
        (["templates/base", "--rev", "nosuchrev"], "is not a commit"),
        (["templates/base", "--rev", "HEAD..nosuchrev"], "is not a commit"),
        (["templates/base", "--rev", "HEAD...HEAD"], "two dots"),
        (["templates/base", "--files", "model.py"], "not changed"),
        (["templates/base", "--to", "variants/zz"], "not a descendant"),
        (["variants/b", "--files", "train.py", "--to", "variants/a"], "not a descendant"),
    ],
)
def test_usage_errors(tmp_path, args, msg):
    root = make_repo(tmp_path)
    if "--files" in args or "--to" in args:
        write(root, {"templates/base/train.py": FIXED, "variants/b/train.py": FIXED})
    rc, out, err = run(root, *args)
    assert rc == 2, out + err
    assert err.startswith("error: ") and msg in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert out == ""


def test_help_has_examples():
    p = subprocess.run([sys.executable, TOOL, "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    assert "examples:" in p.stdout and "--rev" in p.stdout and "--apply" in p.stdout
