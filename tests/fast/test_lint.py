"""The repository passes its lint rule set (pyproject.toml's [tool.ruff.lint]: syntax, statements, unused
or undefined names) and is formatted (`ruff format`, pyproject.toml's [tool.ruff]: 120 columns), as ruff
reports them."""

import subprocess
import sys

import pytest

from shared.variant import ROOT


@pytest.mark.parametrize(
    "command",
    [["check", "--no-cache", "."], ["format", "--check", "--no-cache", "."]],
    ids=["ruff check", "ruff format --check"],
)
def test_ruff_passes(command):
    out = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True)
    fix = "ruff format ." if command[0] == "format" else "ruff check --fix ."
    assert out.returncode == 0, f"run `{fix}`:\n" + out.stdout[-5000:] + out.stderr[-2000:]
