"""The repository passes its lint rule set (pyproject.toml's [tool.ruff.lint]: syntax, statements, unused
or undefined names), as `ruff check .` reports it."""

import subprocess
import sys

from shared.variant import ROOT


def test_ruff_check_passes():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
