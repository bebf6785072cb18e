"""tools/review/variant_diff.py on small synthetic repositories: nearest sibling by code, file changes,
determinism, lineage warnings, --since in a git repository (with the files changed outside the
folders), the variant's own tests, --runs, and the real repo's table."""

import contextlib
import io
import os
import shutil
import subprocess
import sys

import pytest

from shared.variant import ROOT, load

TOOL = os.path.join(ROOT, "tools", "review", "variant_diff.py")
vd = load(TOOL)
lineage = load(os.path.join(ROOT, "tools", "review", "lineage.py"))  # what variant_diff measures with

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
    write(
        tmp_path,
        {
            "templates/base/model.py": model(None),
            "templates/base/train.py": BASE_TRAIN,
            "templates/base/presets/small.yaml": PRESET,
            "variants/a/model.py": model("templates/base", a_model),
            "variants/a/train.py": BASE_TRAIN,
            "variants/a/presets/small.yaml": PRESET,
            "variants/b/model.py": model("variants/a", a_model + "def extra(x):\n    return x\n"),
            "variants/b/train.py": BASE_TRAIN,
            "variants/b/presets/small.yaml": PRESET,
            "variants/b/__pycache__/model.cpython-311.pyc": "ignored",
        },
    )
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
    assert lineage.read_copied_from(str(p)) == ("variants/dense", None)
    p.write_text("COPIED_FROM = None\n")
    assert lineage.read_copied_from(str(p)) == (None, None)
    p.write_text('PARENT = "x"\nCOPIED_FROM = PARENT\n')
    assert "not a string literal" in lineage.read_copied_from(str(p))[1]
    p.write_text("x = 1\n")
    assert "does not assign COPIED_FROM" in lineage.read_copied_from(str(p))[1]


def test_picks_nearest_sibling_and_skips_descendants(repo):
    r = lineage.Repo(str(repo))
    assert r.folders == ["templates/base", "variants/a", "variants/b"]
    assert r.nearest("variants/b") == ("variants/a", 2 + 2)  # two added lines, COPIED_FROM changed
    assert r.nearest("variants/a")[0] == "templates/base"  # b is a's copy, never its nearest
    assert r.nearest("templates/base") == (None, None)
    assert r.distance("variants/a", "templates/base") == 60 + 2  # 30 lines removed + 30 added, COPIED_FROM
    assert "__pycache__/model.cpython-311.pyc" not in r.files("variants/b")
    rc, out, err = run(repo, "--table")
    assert rc == 0 and not err
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in out.splitlines()[2:]}
    assert rows["variants/b"][:5] == ["variants/a", "variants/a", "4 (2.2%)", "4", "0"]  # 4 of 91 + 89 code lines
    assert rows["templates/base"][0] == "(root)" and rows["variants/a"][-1] == "ok"


def test_added_removed_and_renamed_files(repo):
    write(
        repo,
        {
            "variants/a/bench_a.py": "".join(f"print({i})\n" for i in range(10)),
            "variants/c/model.py": (repo / "variants/a/model.py")
            .read_text()
            .replace("'templates/base'", "'variants/a'"),
            "variants/c/train.py": BASE_TRAIN.replace("STEP_3 = 3", "STEP_3 = 33"),
            "variants/c/presets/tiny.yaml": PRESET.replace("key_3: 3", "key_3: 33"),  # small.yaml, renamed and edited
            "variants/c/NOTES.md": "why this variant exists\n```\ncode\n```\n",
        },
    )  # bench_a.py removed
    r = lineage.Repo(str(repo))
    entries = {e.path: e for e in lineage.compare(r.files("variants/a"), r.files("variants/c"))}
    assert entries["presets/tiny.yaml"].status == "renamed" and entries["presets/tiny.yaml"].old == "presets/small.yaml"
    assert (entries["presets/tiny.yaml"].added, entries["presets/tiny.yaml"].removed) == (1, 1)
    assert entries["presets/tiny.yaml"].similarity > 0.9
    assert (entries["NOTES.md"].status, entries["NOTES.md"].added) == ("added", 4)
    assert (entries["bench_a.py"].status, entries["bench_a.py"].removed) == ("removed", 10)
    assert (entries["model.py"].status, entries["model.py"].added) == ("modified", 1)  # the COPIED_FROM line
    assert r.distance("variants/c", "variants/a") == 2 + 2  # code only: model.py and train.py
    assert r.distance("variants/c", "variants/a", code=False) == 2 + 4 + 10
    assert [lineage.kind_of(p) for p in ("model.py", "train.py", "NOTES.md", "presets/tiny.yaml", "bench_a.py")] == [
        "code",
        "code",
        "docs",
        "presets",
        "other",
    ]

    out_dir = repo / "report"
    rc, out, _ = run(repo, "variants/c", "--out", str(out_dir))
    assert rc == 0
    md = (out_dir / "report.md").read_text()
    assert md.startswith(vd.MARKER)
    assert "| `presets/tiny.yaml` ← `presets/small.yaml` | presets | renamed, 92% similar | +1 -1 |" in md
    assert "| `bench_a.py` | other | removed | -10 |" in md and "| `NOTES.md` | docs | added | +4 |" in md
    assert "| `train.py` | code | modified | +1 -1 |" in md
    assert "- code (model.py, train.py, hf.py): 2 of 2 files, +2 -2 lines" in md
    assert (
        "other files (docs, presets, benchmarks, ...; not used for the lineage): 3 of 3 files, +5 -11 lines "
        "(docs +4 -0, presets +1 -1, other +0 -10)" in md
    )
    assert "````diff" in md, "a diff holding ``` needs a longer fence"
    assert "--- variants/a/train.py\n+++ variants/c/train.py" in md
    # the code's diff first, in its own block; docs, presets and benchmarks in another
    assert (
        md.index("Unified diff of the code")
        < md.index("+STEP_3 = 33")
        < md.index("Unified diff of the other files")
        < min(md.index("+key_3: 33"), md.index("+why this variant exists"))
    )
    page = (out_dir / "variants__c.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "presets/small.yaml → presets/tiny.yaml" in page
    assert "<script" not in page and page.index("Code (model.py, train.py, hf.py)") < page.index("Other files")
    assert "http" not in page.replace("http-equiv", ""), "the page must be self-contained"


def test_output_is_deterministic(repo, tmp_path_factory):
    write(repo, {"variants/c/model.py": model("variants/b", BASE_MODEL), "variants/c/train.py": BASE_TRAIN})
    outs = []
    for i in range(2):
        d = tmp_path_factory.mktemp(f"out{i}")
        rc, out, err = run(repo, "--table", "variants/c", "variants/a", "--out", str(d))
        assert rc == 0
        outs.append((out.replace(str(d), "OUT"), err, {p: (d / p).read_bytes() for p in sorted(os.listdir(d))}))
    assert outs[0] == outs[1]
    assert sorted(outs[0][2]) == ["report.md", "variants__a.html", "variants__c.html"]


def test_parent_mismatch_and_missing_parent(repo):
    # d is b plus one line, but declares templates/base: the nearest is b, far nearer than the base
    b_model = (repo / "variants/b/model.py").read_text().replace("'variants/a'", "'templates/base'")
    b_train = BASE_TRAIN + "ONLY_IN_B = 1\n"
    write(
        repo,
        {
            "variants/b/train.py": b_train,
            "variants/d/model.py": b_model + "# d\n",
            "variants/d/train.py": b_train,
            "variants/d/presets/small.yaml": PRESET,
            "variants/e/model.py": model("variants/gone"),
            "variants/e/train.py": BASE_TRAIN,
        },
    )
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
    return subprocess.run(
        [
            "git",
            "-C",
            str(root),
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@example.com",
            "-c",
            "commit.gpgsign=false",
            *args,
        ],
        check=True,
        capture_output=True,
        text=True,
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_since_reports_only_changed_variants(repo):
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "one")
    rc, _, err = run(repo, "--since", "HEAD~1")
    assert rc == 2 and "not a commit" in err, "the first commit has no HEAD~1: say so"
    rc, out, _ = run(repo, "--since", "HEAD")
    assert rc == 0 and "since `HEAD`: 0 (nothing to compare)" in out

    write(
        repo,
        {
            "variants/b/presets/small.yaml": PRESET + "new: 1\n",  # tracked change
            "variants/c/model.py": model("variants/b", BASE_MODEL),  # untracked variant
            "variants/c/train.py": BASE_TRAIN,
            "variants/a/__pycache__/x.pyc": "not a change",
            "README.md": "not a variant\n",
            "variants/half/notes.txt": "no model.py yet\n",
        },
    )
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
    assert (
        "(model.py,\ntrain.py and hf.py; a deleted hf.py counts as one decision)" in h.stdout
        and "within margin" in h.stdout
        and "--runs RUN" in h.stdout
    )
    t = subprocess.run([sys.executable, TOOL, "--table"], capture_output=True, text=True, env=env, timeout=60)
    assert t.returncode == 0, t.stderr
    assert "| templates/base " in t.stdout and "| variants/dense " in t.stdout
    none = subprocess.run([sys.executable, TOOL], capture_output=True, text=True, env=env, timeout=60)
    assert none.returncode == 2 and "--since REV or --table" in none.stderr
    out_only = subprocess.run(
        [sys.executable, TOOL, "--table", "--out", "/nonexistent"], capture_output=True, text=True, env=env, timeout=60
    )
    assert out_only.returncode == 2 and "--out writes the report" in out_only.stderr


def table(out):
    """{variant: [declared parent, nearest by code, code distance, code to parent, other files to parent, check]}."""
    return {
        ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]]
        for ln in out.splitlines()
        if ln.startswith("| templates/") or ln.startswith("| variants/")
    }


def test_real_repository_lineage_follows_the_code():
    """moe_hero was copied from swa_hybrid; over all files (READMEs, presets, benches) templates/base looked nearer."""
    rc, out, err = run(ROOT, "--table")
    assert rc == 0, err
    rows = table(out)
    assert rows["variants/moe_hero"][:2] == ["variants/swa_hybrid", "variants/swa_hybrid"]
    assert rows["variants/moe_hero"][-1] == "ok"
    r = lineage.Repo(ROOT)
    assert r.nearest("variants/moe_hero")[0] == r.parents["variants/moe_hero"][0] == "variants/swa_hybrid"


README_BASE = "".join(f"The base, line {i}.\n" for i in range(80))
README_P = "".join(f"All about p, its idea number {i}.\n" for i in range(80))
PRESET_P = "".join(f"p_key_{i}: {i * 7}\n" for i in range(12))


@pytest.fixture
def churn(tmp_path):
    """templates/base <- variants/p (30 model lines edited, README and presets rewritten) <- variants/x.

    x's code is p's plus two lines, but its README and preset are the base's: over every file,
    templates/base is the nearer folder; over the code, p is."""
    p_model = edit(BASE_MODEL, 30, "p")
    write(
        tmp_path,
        {
            "templates/base/model.py": model(None),
            "templates/base/train.py": BASE_TRAIN,
            "templates/base/README.md": README_BASE,
            "templates/base/presets/small.yaml": PRESET,
            "variants/p/model.py": model("templates/base", p_model),
            "variants/p/train.py": BASE_TRAIN,
            "variants/p/README.md": README_P,
            "variants/p/presets/small.yaml": PRESET_P,
            "variants/x/model.py": model("variants/p", p_model + "def extra(x):\n    return x\n"),
            "variants/x/train.py": BASE_TRAIN,
            "variants/x/README.md": README_BASE,
            "variants/x/presets/small.yaml": PRESET,
        },
    )
    return tmp_path


def test_code_distance_ignores_docs_and_presets_churn(churn):
    r = lineage.Repo(str(churn))
    everything = lambda a, b: lineage.total(lineage.compare(r.files(a), r.files(b)))  # noqa: E731  (the old measure)
    assert everything("variants/x", "templates/base") < everything("variants/x", "variants/p"), (
        "the fixture must be one where README and preset churn picks the wrong folder"
    )
    assert r.nearest("variants/x") == ("variants/p", 2 + 2)  # two added lines, COPIED_FROM changed
    assert r.distance("variants/x", "templates/base") == 60 + 2 + 2  # 30 lines edited, COPIED_FROM, extra
    assert r.distance("variants/x", "variants/p", code=False) == 160 + 24  # reported, never used for the lineage
    rc, out, err = run(churn, "--table", "--strict")
    assert rc == 0 and not err
    assert table(out)["variants/x"] == ["variants/p", "variants/p", "4 (2.2%)", "4", "184", "ok"]
    rc, out, err = run(churn, "variants/x")
    assert rc == 0 and not err and "- check: ok" in out
    assert (
        "other files (docs, presets, benchmarks, ...; not used for the lineage): 2 of 2 files, +92 -92 lines "
        "(docs +80 -80, presets +12 -12)" in out
    )


HF = "".join(f"MAP_{i} = 'layers.{i}'\n" for i in range(40))  # a Hugging Face mapping of 40 lines


def test_hf_py_is_code_written_counts_deleted_does_not(repo):
    # a has an hf.py (written: 40 lines of code more than the base), b copied it and edited 3 lines,
    # c copied a and deleted it (no export: one decision, not 40 changed lines)
    write(
        repo,
        {
            "variants/a/hf.py": HF,
            "variants/b/hf.py": edit(HF, 3, "b"),
            "variants/c/model.py": model("variants/a", edit(BASE_MODEL, 30, "a")),
            "variants/c/train.py": BASE_TRAIN,
        },
    )
    r = lineage.Repo(str(repo))
    assert lineage.kind_of("hf.py") == "code"
    assert r.distance("variants/a", "templates/base") == 60 + 2 + 40
    assert r.distance("variants/b", "variants/a") == 2 + 2 + 6  # model lines added, COPIED_FROM, hf.py edits
    assert r.distance("variants/c", "variants/a") == 2  # COPIED_FROM only: the deleted hf.py is left out
    assert r.nearest("variants/c") == ("variants/a", 2)
    rc, out, err = run(repo, "variants/b")
    assert rc == 0 and "code (model.py, train.py, hf.py): 2 of 3 files" in out and "hf.py" in out


def test_warns_when_the_declared_parent_is_far_in_code(churn):
    # x's code is p's plus two lines, its docs are the base's, and it declares templates/base
    text = (churn / "variants/x/model.py").read_text()
    write(churn, {"variants/x/model.py": text.replace("'variants/p'", "'templates/base'")})
    r = lineage.Repo(str(churn))
    pd, nd = r.distance("variants/x", "templates/base"), r.distance("variants/x", "variants/p")
    assert r.nearest("variants/x") == ("variants/p", nd) and (pd, nd) == (64, 2)  # same COPIED_FROM as p
    rc, out, err = run(churn, "variants/x")
    assert rc == 0, "warnings alone do not fail without --strict"
    assert "declared parent templates/base is 64 changed lines of code away" in out
    assert 'set COPIED_FROM = "variants/p"' in out and "- check: ok" not in out
    assert "warning: variants/x: declared parent templates/base" in err
    rows = table(run(churn, "--table")[1])
    assert rows["variants/x"][:2] == ["templates/base", "variants/p"] and rows["variants/x"][-1] == "parent far"
    assert run(churn, "--table", "--strict")[0] == 1
    # the margin as stated: farther than MARGIN x nearest + SLACK warns; exactly at the limit does not,
    # and the check then says "within margin", never "ok"
    limit_slack = pd - int(1.5 * nd)  # 1.5 x 2 + 61 = 64: at the limit
    rc, out, err = run(churn, "--table", "--strict", "--slack", str(limit_slack))
    assert rc == 0 and not err and table(out)["variants/x"][-1] == "within margin"
    rc, out, err = run(churn, "--table", "--strict", "--margin", "1", "--slack", str(pd - nd))  # 2 + 62 = 64
    assert rc == 0 and table(out)["variants/x"][-1] == "within margin"
    rc, out, err = run(churn, "--table", "--strict", "--margin", "1", "--slack", str(pd - nd - 1))  # 2 + 61 = 63 < 64
    assert rc == 1 and table(out)["variants/x"][-1] == "parent far" and "the limit is 1 x 2 + 61 = 63" in err


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_since_lists_the_tests_and_readme_changed_with_the_variant(repo):
    write(
        repo,
        {
            "README.md": "# Project\n\n- variants/a: the first idea\n",
            "shared/util.py": "X = 1\n",
            "tests/test_a.py": "def test_a():\n    pass\n",
        },
    )
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "one")
    tests_c = "".join(f"def test_c_{i}():\n    assert {i} == {i}\n\n" for i in range(10))
    write(
        repo,
        {
            "variants/c/model.py": model("variants/b", BASE_MODEL),
            "variants/c/train.py": BASE_TRAIN,
            "tests/test_c.py": tests_c,
            "README.md": "# Project\n\n- variants/a: the first idea\n- variants/c: the second idea\n",
        },
    )
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "two: variants/c, its tests, a README line")
    write(repo, {"shared/util.py": "X = 2\n"})  # uncommitted: the working tree counts
    out_dir = repo / "report"
    rc, out, err = run(repo, "--since", "HEAD~1", "--out", str(out_dir))
    assert rc == 0, err
    md = (out_dir / "report.md").read_text()
    sec = md[md.index("### Other files changed with it") :]
    assert "changed since `HEAD~1` (the working tree; untracked files count): 3," in sec
    rows = [ln for ln in sec.splitlines() if ln.startswith("| `")]
    assert rows == [
        "| `tests/test_c.py` | added | +30 |",
        "| `README.md` | modified | +1 |",
        "| `shared/util.py` | modified | +1 -1 |",
    ], "the variant's own tests first, then by path"
    assert "+++ b/tests/test_c.py" in sec and "+def test_c_9():" in sec
    assert "--- a/README.md\n+++ b/README.md" in sec and "+- variants/c: the second idea" in sec
    assert "-X = 1\n+X = 2" in sec and "test_a.py" not in sec and "variants/c/model.py" not in sec
    assert "### `variants/c`" in md and "The variant's own tests" not in md  # with --since: its diff above
    page = (out_dir / vd.OTHER_PAGE).read_text()
    assert "tests/test_c.py (added, +30 -0)" in page and "README.md (modified, +1 -0)" in page
    assert "the&nbsp;second&nbsp;idea" in page
    assert "### Other files changed with it" in out and "+- variants/c" not in out  # stdout: the list, no diff
    rc, _, _ = run(repo, "--since", "HEAD~1", "--out", str(out_dir), "--max-diff-lines", "5")
    sec = (out_dir / "report.md").read_text().split("### Other files changed with it")[1]
    assert "untracked files count): 3," in sec, "the report's own folder is not a change"
    assert "more lines; `other_files.html` has all of it" in sec and "+def test_c_9():" not in sec
    # nothing but files outside the folders changed: a note, no section
    shutil.rmtree(out_dir)  # (inside the repository, but never listed by the report it holds)
    git(repo, "commit", "-q", "-am", "three")
    write(repo, {"README.md": "# Project\n"})
    rc, out, _ = run(repo, "--since", "HEAD")
    assert rc == 0 and "since `HEAD`: 0" in out and "Other files changed" not in out
    assert "1 file(s) outside `templates/` and `variants/` changed since `HEAD`" in out


def test_own_tests_of_a_single_folder(repo):
    write(repo, {"tests/test_a.py": "".join(f"def test_{i}():\n    assert True\n" for i in range(10))})
    out_dir = repo / "report"
    rc, out, _ = run(repo, "variants/a", "variants/b", "--out", str(out_dir), "--max-diff-lines", "6")
    assert rc == 0
    assert "- own tests: `tests/test_a.py` (20 lines)" in out and "- own tests: none (no `tests/test_b.py`)" in out
    md = (out_dir / "report.md").read_text()
    a = md[md.index("### `variants/a`") : md.index("### `variants/b`")]
    assert "#### The variant's own tests" in a and "<code>tests/test_a.py</code> in full (20 lines)" in a
    assert "def test_2():" in a and "def test_3():" not in a and "… 14 more lines" in a
    assert "The variant's own tests" not in md[md.index("### `variants/b`") :]
    page = (out_dir / "variants__a.html").read_text()
    assert "The variant's own tests" in page and "def test_9():" in page


def test_runs_needs_out_and_two_runs(repo, tmp_path):
    rc, _, err = run(repo, "variants/a", "--runs", str(tmp_path), str(tmp_path))
    assert rc == 2 and "--runs" in err and "--out" in err
    rc, _, err = run(repo, "variants/a", "--out", str(tmp_path / "o"), "--runs", str(tmp_path))
    assert rc == 2 and "at least two run directories" in err
    assert not (tmp_path / "o").exists()


FAKE_COMPARE_RUNS = """
import os
def compare(runs, out, labels=None):
    os.makedirs(out, exist_ok=True)
    png, md = os.path.join(out, "loss.png"), os.path.join(out, "summary.md")
    open(png, "wb").write(b"png")
    open(md, "w").write("| run | loss |\\n|---|---|\\n" + "".join(f"| {os.path.basename(r)} | 1.0 |\\n" for r in runs))
    return {"png": png, "md": md, "runs": [{"run_dir": r} for r in runs]}
"""


def test_runs_link_the_loss_curves(repo, tmp_path, monkeypatch):
    fake = tmp_path / "compare_runs.py"
    fake.write_text(FAKE_COMPARE_RUNS)
    monkeypatch.setattr(vd, "COMPARE_RUNS", str(fake))
    out_dir = tmp_path / "report"
    rc, out, err = run(
        repo, "variants/b", "--out", str(out_dir), "--runs", str(tmp_path / "run_a"), str(tmp_path / "run_b")
    )
    assert rc == 0, err
    md = (out_dir / "report.md").read_text()
    assert "### Loss curves" in md and "![loss curves](loss.png)" in md
    assert "| run_a | 1.0 |\n| run_b | 1.0 |" in md and (out_dir / "loss.png").exists()
    monkeypatch.setattr(vd, "COMPARE_RUNS", str(tmp_path / "missing.py"))
    rc, _, err = run(repo, "variants/b", "--out", str(out_dir), "--runs", "r1", "r2")
    assert rc == 2 and "missing.py" in err
    # without --runs the tool never loads compare_runs (nor matplotlib): stdlib only
    fake.write_text("raise SystemExit('compare_runs must not be imported')\n")
    monkeypatch.setattr(vd, "COMPARE_RUNS", str(fake))
    assert run(repo, "variants/b", "--out", str(out_dir))[0] == 0
    code = (
        f"import sys; sys.argv = [{TOOL!r}, '--table', '--root', {str(repo)!r}]; import runpy\n"
        f"try:\n    runpy.run_path({TOOL!r}, run_name='__main__')\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "assert not [m for m in sys.modules if 'compare_runs' in m or m.startswith('matplotlib')], sys.modules\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


@pytest.mark.skipif(
    not os.path.exists(os.path.join(ROOT, "tools", "review", "compare_runs.py")),
    reason="tools/review/compare_runs.py is not there yet",
)
def test_runs_with_the_real_compare_runs(repo, tmp_path):
    runs = []
    for name, scale in (("parent_run", 1.0), ("variant_run", 0.9)):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text(
            "".join(f'{{"step": {s}, "loss": {scale * (5 - s / 10)}}}\n' for s in range(1, 11))
        )
        (d / "config.json").write_text('{"batch_size": 2, "seq_len": 8}\n')
        runs.append(str(d))
    out_dir = tmp_path / "report"
    rc, out, err = run(repo, "variants/b", "--out", str(out_dir), "--runs", *runs)
    assert rc == 0, err
    md = (out_dir / "report.md").read_text()
    assert "![loss curves](loss.png)" in md and (out_dir / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert (out_dir / "summary.md").read_text().rstrip("\n") in md
    rc, _, err = run(repo, "variants/b", "--out", str(out_dir), "--runs", runs[0], str(tmp_path / "nope"))
    assert rc == 2 and "nope" in err


def test_own_tests_in_the_folder_travel_with_it(repo):
    """A variant's tests in its own folder (variants/<name>/test_<name>.py, as `cp -r` carries them) are its
    own tests; they win over tests/test_<name>.py."""
    write(
        repo,
        {"variants/b/test_b.py": "def test_b():\n    assert True\n", "tests/test_b.py": "def test_old():\n    pass\n"},
    )
    rc, out, _ = run(repo, "variants/b")
    assert rc == 0 and "- own tests: `variants/b/test_b.py` (2 lines)" in out, out
