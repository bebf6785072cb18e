"""The docs cannot go stale: every path, module, command, tool and flag that README.md, AGENTS.md, docs/,
skills/ and the variants' READMEs name exists, every command answers --help, the maps name every
module, nothing removed is still described, and CI's time limits are the ones docs/testing.md states.

Each check parses the Markdown plainly: inline code spans, fenced code blocks (a backslash joins a
command's lines) and link targets. A placeholder (`<name>`, `RUN`, a glob) is never checked as a path."""

import functools
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from shared.variant import ROOT, discover, load

from helpers import fenced, spans, text  # noqa: E402  (tests/helpers.py)

DOCS = sorted(
    {
        os.path.relpath(p, ROOT)
        for pattern in (
            "README.md",
            "AGENTS.md",
            "docs/**/*.md",
            "skills/**/*.md",
            "variants/*/README.md",
            "templates/*/README.md",
        )
        for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)
    }
)
TOP = ("shared/", "tools/", "tests/", "variants/", "templates/", "launch/", "skills/", "docs/", ".ci/", ".github/")
TOP_FILES = ("README.md", "AGENTS.md", "pyproject.toml")


def commands(doc: str) -> list[list[str]]:
    """`python ...` command lines named in a doc, as argv lists (comments dropped)."""
    out = []
    for s in spans(doc):
        s = s.split("  #")[0].split(" # ")[0]
        for part in re.split(r"&&|;|\|", s):
            words = part.split()
            while words and re.match(r"^[A-Z_]+=", words[0]):  # XLA_FLAGS=... python ...
                words = words[1:]
            if len(words) > 1 and words[0] in ("python", "python3"):
                out.append(words[1:])
    return out


EXAMPLES = ("variants/my_idea", "variants/x", "variants/y")  # folders the docs make as examples (cp -r ...)


def is_path(token: str) -> bool:
    return (
        (token.startswith(TOP) or token in TOP_FILES)
        and not re.search(r"[<>*{}$|\\]|\.\.\.|\[", token)
        and not token.startswith(EXAMPLES)
    )


# ---------------------------------------------------------------- paths and modules


def defined(token: str) -> bool:
    """`shared/errors.StencilError`: a name defined at the top of a module (class, def or assignment)."""
    m = re.match(r"^(.+)\.(\w+)$", token)
    path = m and os.path.join(ROOT, m.group(1) + ".py")
    return bool(
        path
        and os.path.isfile(path)
        and re.search(rf"^(class|def) {m.group(2)}\b|^{m.group(2)}\s*[:=]", open(path).read(), re.M)
    )


@pytest.mark.parametrize("doc", DOCS)
def test_named_paths_exist(doc):
    """Paths in code spans (`shared/run.py`, `tools/review/compare_runs.py`) from the repository root, and link
    targets from the doc's own folder."""
    missing = []
    for s in spans(doc):
        for token in re.split(r"[\s,()`'\"]+", s):
            token = re.sub(r"('s|[.:;]+)$", "", token).split("#")[0]
            if is_path(token) and not os.path.exists(os.path.join(ROOT, token)) and not defined(token):
                missing.append(token)
    for target in re.findall(r"\]\(([^)\s]+)\)", text(doc)):
        path = target.split("#")[0]
        if (
            path
            and not re.match(r"^[a-z]+://|^mailto:", path)
            and not os.path.exists(os.path.join(ROOT, os.path.dirname(doc), path))
        ):
            missing.append(f"link {target}")
    assert not missing, f"{doc} names what does not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS)
def test_python_m_modules_exist(doc):
    bad = [
        c[1]
        for c in commands(doc)
        if c[0] == "-m" and len(c) > 1 and c[1] != "pytest" and importlib.util.find_spec(c[1]) is None
    ]
    assert not bad, f"{doc}: python -m {bad}: no such module"


# ---------------------------------------------------------------- flags


def folder_of(script: str) -> str | None:
    """The folder whose train.py a command runs (placeholders like variants/<name> mean the template)."""
    if not script.endswith("/train.py"):
        return None
    folder = script[: -len("/train.py")]
    return folder if folder in discover() else "templates/base"


@functools.lru_cache(maxsize=None)
def config_flags(folder: str) -> set[str]:
    import dataclasses
    import typing

    def walk(cls, prefix=""):
        for name, tp in typing.get_type_hints(cls).items():
            yield prefix + name
            if dataclasses.is_dataclass(tp):
                yield from walk(tp, f"{prefix}{name}.")

    return set(walk(load(os.path.join(ROOT, folder, "train.py")).TrainConfig)) | {"help", "preset", "config_path"}


@pytest.mark.parametrize("doc", DOCS)
def test_train_flags_are_fields_of_the_named_config(doc):
    """`python variants/kda/train.py --model.chunk_size 32`: every --flag is a field of that folder's config."""
    bad = []
    for c in commands(doc):
        folder = folder_of(c[0])
        if folder:
            bad += [
                f"{c[0]} {w}" for w in c[1:] if w.startswith("--") and w[2:].split("=")[0] not in config_flags(folder)
            ]
    assert not bad, f"{doc}: flags that are not fields of the folder's TrainConfig: {bad}"


def runnable() -> list[list[str]]:
    """argv (after the interpreter) of every runnable file: `-m shared.x` for a module of shared/, the path
    for a script. A file runs as a command when it has a `__main__` block."""
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, ROOT)
        if rel.startswith(("tests", ".venv", "build")) or rel.endswith("/train.py"):
            continue
        with open(path) as f:
            if 'if __name__ == "__main__"' not in f.read():
                continue
        out.append(["-m", rel[:-3].replace(os.sep, ".")] if rel.startswith("shared") else [rel])
    return out


@pytest.fixture(scope="module")
def helps() -> dict[str, tuple[int, str]]:
    return all_helps()


@functools.lru_cache(maxsize=None)
def all_helps() -> dict[str, tuple[int, str]]:
    """{command: (exit status, --help output)} of every runnable file, all started at once (each its own
    process), so the whole check costs about the slowest import; once per process (a module fixture is
    set up again when a worker runs other modules' tests in between)."""
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    procs = {
        " ".join(c): subprocess.Popen(
            [sys.executable, *c, "--help"],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for c in runnable()
    }
    return {k: (p.wait(timeout=300), p.stdout.read()) for k, p in procs.items()}


def test_every_command_answers_help(helps):
    """Every tool, launcher, `python -m shared...` command and variant script (each folder's train.py is
    checked in-process by the contract's test_help_lists_every_field)."""
    assert "tools/review/variant_diff.py" in helps and "-m shared.pretokenize" in helps, sorted(helps)
    failed = [
        f"{k} --help: exit {rc}\n{out[-600:]}"
        for k, (rc, out) in helps.items()
        if rc != 0 or "usage" not in out.lower() or "Traceback" in out
    ]
    assert not failed, "\n\n".join(failed)


@functools.lru_cache(maxsize=None)
def sub_help(argv: tuple) -> str:
    """--help of a subcommand (`hf.py export --help`)."""
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, *argv, "--help"], cwd=ROOT, env=env, text=True, capture_output=True, timeout=300
    ).stdout


@pytest.mark.parametrize("doc", DOCS)
def test_tool_flags_are_in_the_tools_help(doc, helps):
    """`python tools/bench/bench_step.py --rounds 7`: every --flag appears in that command's --help (its
    subcommand's, for `python variants/dense/hf.py export --run_dir R`)."""
    bad = []
    for c in commands(doc):
        n = 2 if c[0] == "-m" else 1
        key = " ".join(c[:n])
        if key not in helps:
            continue
        usage = helps[key][1]
        subs = set(sum((g.split(",") for g in re.findall(r"\{([\w,-]+)\}", usage)), []))
        if len(c) > n and c[n] in subs:
            usage = sub_help(tuple(c[: n + 1]))
        own, passed = (c[n : c.index("--")], c[c.index("--") + 1 :]) if "--" in c else (c[n:], [])
        variant = own[own.index("--variant") + 1] if "--variant" in own[:-1] else "dense"
        train = config_flags(folder_of(f"variants/{variant}/train.py"))
        forwards = "go to the variant's TrainConfig" in usage  # tools/bench/bench_step.py
        bad += [
            f"{key} {w}"
            for w in own
            if w.startswith("--") and w.split("=")[0] not in usage and not (forwards and w[2:].split("=")[0] in train)
        ]
        bad += [f"{key} -- {w}" for w in passed if w.startswith("--") and w[2:].split("=")[0] not in train]
    assert not bad, f"{doc}: flags the command does not take: {bad}"


# ---------------------------------------------------------------- maps, removed things, CI limits


def test_the_maps_name_every_module_and_tool():
    """AGENTS.md's map names every module of shared/ and every tool; a new one is added to it."""
    agents = text("AGENTS.md")
    modules = [  # every module of shared/ and its subpackages; kernels/ is named as one row
        os.path.relpath(p, os.path.join(ROOT, "shared")).replace(os.sep, "/")
        for p in glob.glob(os.path.join(ROOT, "shared", "**", "*.py"), recursive=True)
        if os.sep + "kernels" + os.sep not in p
    ]
    missing = [m for m in modules if not m.endswith("__init__.py") and f"`{m}`" not in agents]
    tools = [os.path.relpath(p, ROOT).replace(os.sep, "/") for p in glob.glob(os.path.join(ROOT, "tools", "*", "*.py"))]
    missing += [t for t in tools if t not in agents]
    assert not missing, f"AGENTS.md's map does not name {sorted(missing)}"


# What was removed from the code and must not be described any more, with what replaced it.
REMOVED = {
    "weight-decay mask": "weight decay follows each weight's declared role (shared/optim.py DECAY_ROLES)",
    "whose name contains `norm`": "init and the optimizer follow declared roles (shared/weights.py)",
    "skips names with `norm`": "weight decay follows declared roles, never a weight's name",
}


def test_nothing_removed_is_still_described():
    files = DOCS + [
        os.path.relpath(p, ROOT)
        for p in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)
        if not p.startswith(os.path.join(ROOT, ".venv")) and not p.endswith("test_docs.py")
    ]
    stale = [f"{f}: {phrase!r} ({now})" for f in files for phrase, now in REMOVED.items() if phrase in text(f)]
    assert not stale, "\n".join(stale)


def test_ci_time_limits_are_the_ones_the_docs_state():
    """docs/testing.md states each CI job's limit; .github/workflows/ci.yml sets them; pyproject.toml
    states none of its own."""
    stated = dict(re.findall(r"CI job `([\w-]+)`: (\d+) minutes", text("docs/testing.md")))
    ci = text(".github/workflows/ci.yml")
    jobs = dict(re.findall(r"\n  ([\w-]+):\n(?:    [^\n]*\n)*?    timeout-minutes: (\d+)", ci))
    assert stated and stated == {k: v for k, v in jobs.items() if k in stated}, (stated, jobs)
    assert not re.search(r"\d+ min", text("pyproject.toml")), "pyproject.toml states a time: say it in docs/testing.md"


def test_ci_runs_the_readmes_test_command():
    """.ci/run installs what the README's test command installs and runs its two pytest commands, so the
    README's command is the whole suite with nothing skipped for a missing package."""
    cmd = next(line for line in fenced("README.md") if "python -m pytest -q -m integration" in line)
    ci = text(".ci/run")
    for part in cmd.split(" && "):
        if part.startswith("pip install"):
            assert part.replace("pip install", "pip install -q", 1) in ci, f".ci/run does not run the README's `{part}`"
        elif part.startswith(("export ", "python -m pytest")):
            assert part in ci, f".ci/run does not run the README's `{part}`"


# ---------------------------------------------------------------- what the docs promise about inputs and exports


def test_the_text_inputs_the_docs_list_are_the_accepted_ones():
    """docs/data.md's inputs and README.md's `--data.source` comment list exactly shared/data/sources.TEXT_EXTS."""
    from shared.data.sources import TEXT_EXTS

    inputs = re.search(r"\*\*Inputs\*\*:(.*?)each input file", text("docs/data.md"), re.S).group(1)
    assert sorted(re.findall(r"`(\.[\w.]+)`", inputs)) == sorted(TEXT_EXTS), inputs
    listed = re.search(r"your text \(([^)]*)\)", text("README.md")).group(1).split()
    expanded = []
    for s in listed:  # .jsonl[.gz|.zst] stands for .jsonl, .jsonl.gz, .jsonl.zst
        m = re.match(r"^([\w.]+)\[(.*)\]$", s)
        expanded += [m.group(1)] + [m.group(1) + x for x in m.group(2).split("|")] if m else [s]
    assert sorted(expanded) == sorted(TEXT_EXTS), listed


@pytest.mark.parametrize("folder", [f for f in discover() if f.startswith("variants/")])
def test_a_variant_without_hf_py_says_so_in_its_readme(folder):
    """The one rule for a folder with no hf.py (skills/new-variant, step 8): its README has a `## Hugging Face`
    section that says "no Hugging Face export", why, names the closest transformers class (`...ForCausalLM`)
    and links docs/huggingface.md. The rule is the folder's alone: a copy on a branch passes it without
    touching the top-level docs (their rows come when the variant is proposed for main, step 9)."""
    if os.path.isfile(os.path.join(ROOT, folder, "hf.py")):
        pytest.skip(f"{folder} has an hf.py (tests/fast/test_hf.py checks it)")
    readme = os.path.join(folder, "README.md")
    assert os.path.isfile(os.path.join(ROOT, readme)), (
        f"{folder}: no README.md (its '## Hugging Face' section says why there is no hf.py)"
    )
    section = re.search(r"\n## Hugging Face\n(.*?)(\n## |\Z)", text(readme), re.S)
    assert section, f"{readme}: no '## Hugging Face' section (the folder has no hf.py: say why)"
    body = section.group(1)
    for what, ok in (
        ("the words 'no Hugging Face export'", "no Hugging Face export" in body),
        ("the closest transformers class as `<Name>ForCausalLM`", re.search(r"`\w+ForCausalLM`", body)),
        ("a link to docs/huggingface.md", "docs/huggingface.md" in body),
    ):
        assert ok, f"{readme}: its '## Hugging Face' section lacks {what}"


FIGURE = re.compile(r"tokens/s|val(?:idation)? loss \d")  # a figure of a run: measured on some code, at some moment
MEASURED = re.compile(r"measured at `?[0-9a-f]{7}")


@pytest.mark.parametrize("folder", [f for f in discover() if f.startswith("variants/")])
def test_a_folders_figures_name_their_command_and_commit(folder):
    """A figure of a run in a folder's README (tokens/s, a val loss) shares its paragraph (or table) with the
    command that produced it and the commit it was measured at (`measured at <sha>`): a copy inherits its
    parent's figures, and a figure without both cannot be re-measured or told stale (skills/new-variant, step 9)."""
    readme = os.path.join(folder, "README.md")
    if not os.path.isfile(os.path.join(ROOT, readme)):
        pytest.skip(f"{folder} has no README.md")
    bad = [
        para.strip()[:160]
        for para in re.split(r"\n\s*\n", text(readme))
        if FIGURE.search(para)
        and not para.lstrip().startswith("```")
        and not (re.search(r"`python [^`]+`", para) and MEASURED.search(para))
    ]
    assert not bad, (
        f"{readme}: figures without the command (`python ...`) and `measured at <commit>` beside them: {bad}"
    )


@pytest.mark.parametrize("folder", [f for f in discover() if f != "templates/base"])
def test_a_folders_docstrings_name_its_parent_and_leave_the_diff_to_the_tool(folder):
    """A copy's files say which folder they were copied from (the parent its model.py declares, not the parent's
    parent a copied line names) and make no claim of which lines differ (`only ... differ` goes stale with the
    next edit; `python tools/review/variant_diff.py <folder>` shows it)."""
    import ast

    parent = re.search(r'^COPIED_FROM\s*=\s*"([^"]+)"', text(f"{folder}/model.py"), re.M)
    assert parent, f"{folder}/model.py: no COPIED_FROM"
    bad = []
    for name in ("model.py", "train.py", "hf.py", "README.md"):
        path = os.path.join(folder, name)
        if not os.path.isfile(os.path.join(ROOT, path)):
            continue
        body = text(path) if name.endswith(".md") else (ast.get_docstring(ast.parse(text(path))) or "")
        head = "\n\n".join(re.split(r"\n\s*\n", body)[:3])  # the title and the first paragraphs
        for named in re.findall(r"Copied from `?((?:variants|templates)/\w+)", head):
            if named != parent.group(1):
                bad.append(f"{path}: 'Copied from {named}', but model.py's COPIED_FROM is {parent.group(1)}")
        if re.search(r"\bonly\b[^.]{0,80}\bdiffers?\b", body):
            bad.append(
                f"{path}: says which lines differ from the parent; say instead that "
                f"`python tools/review/variant_diff.py {folder}` shows what differs"
            )
    assert not bad, bad


def test_the_top_level_tables_name_real_folders():
    """README.md's tour and docs/huggingface.md's table: every folder they name exists, every variant in
    docs/huggingface.md's table without an hf.py says `none`, and one with an hf.py names its class."""
    bad = []
    for row in re.findall(r"^\| `(variants/\w+|templates/\w+)/` \|", text("README.md"), re.M):
        if not os.path.isfile(os.path.join(ROOT, row, "model.py")):
            bad.append(f"README.md's tour: {row} does not exist")
    for name, cls in re.findall(r"^\| `(\w+)` \| (`\w+`|none) \|", text("docs/huggingface.md"), re.M):
        folder = os.path.join(ROOT, "variants", name)
        if not os.path.isfile(os.path.join(folder, "model.py")):
            bad.append(f"docs/huggingface.md: variants/{name} does not exist")
        elif os.path.isfile(os.path.join(folder, "hf.py")) == (cls == "none"):
            bad.append(
                f"docs/huggingface.md: {name} says {cls}, but the folder {'has' if cls == 'none' else 'has no'} hf.py"
            )
    assert not bad, bad


def test_the_modules_that_start_servers_run_on_one_worker(request):
    """conftest.py puts each module that starts servers or several processes (this one too: its fixture
    starts every command's --help at once) into one pytest-xdist group, so it runs on one worker. Two
    workers would start two SLURM clusters that hand out the same job ids, and JAX derives a job's
    coordinator port from its id. pytest 9.2 ignores the node id pytest-xdist 3.8 edits to name the group
    (the `test` extra pins pytest below 9.2 for that)."""
    if not request.config.getoption("loadgroup", default=False):
        pytest.skip("not a pytest-xdist worker under --dist loadgroup (the configured `-n 2 --dist loadgroup`)")
    assert request.node.nodeid.endswith("@test_docs"), (
        f"{request.node.nodeid}: pytest-xdist's --dist loadgroup did not group this module (pytest "
        f"{pytest.__version__}); the groups conftest.py sets are ignored, so servers start once per worker"
    )
