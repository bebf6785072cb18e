"""A change that moves code changes no number a run computes: every folder's first losses and held-out loss
equal, bit for bit, those tests/reference/first_losses.json recorded before the shared layer's redesign
(tools/review/first_losses.py says how it was measured and how to regenerate it). The tool runs in its own process
with XLA's optimizations on, as the reference was measured (conftest.py turns them off for the tests: other
programs, other rounding)."""

import os
import subprocess
import sys

import pytest

from shared.variant import ROOT

REFERENCE = os.path.join(ROOT, "tests", "reference", "first_losses.json")


@pytest.mark.integration  # every folder compiles and trains three steps
def test_every_folders_first_losses_equal_the_reference_bit_for_bit(tmp_path):
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "STENCIL_CACHE": str(tmp_path),
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "0",
    }
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "review", "first_losses.py"), "--check", REFERENCE],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=1200,
    )
    if r.returncode == 3:
        pytest.skip(r.stdout.strip().splitlines()[-1])  # other JAX/jaxlib/tokenizers versions: not comparable
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
