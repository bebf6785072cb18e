"""Test set-up: 8 fake CPU devices, no wandb, a private cache, and a small shared corpus."""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["WANDB_MODE"] = "disabled"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
