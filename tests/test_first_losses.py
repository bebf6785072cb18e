"""A change that moves code changes no number a run computes: every folder's first losses and held-out loss
equal, bit for bit, those tests/reference/first_losses.json recorded before the shared layer's redesign
(tools/first_losses.py says how it was measured and how to regenerate it)."""

import json
import os

import jax
import pytest

from shared.variant import ROOT, load

REFERENCE = os.path.join(ROOT, "tests", "reference", "first_losses.json")


@pytest.mark.integration  # every folder compiles and trains three steps
def test_every_folders_first_losses_equal_the_reference_bit_for_bit():
    tool = load(os.path.join(ROOT, "tools", "first_losses.py"))
    ref = json.load(open(REFERENCE))
    if jax.device_count() != 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (the README's test command sets it)")
    if ref["versions"] != tool.versions():
        pytest.skip(f"the reference was measured with {ref['versions']}, this is {tool.versions()}: bit-identity is "
                    "only defined for the same versions (regenerate it: tools/first_losses.py)")
    got = tool.measure()
    assert sorted(got) == sorted(ref["folders"]), "a folder was added or removed: regenerate the reference"
    for folder, want in ref["folders"].items():
        assert got[folder] == want, f"{folder}: {got[folder]} != the reference {want}"
