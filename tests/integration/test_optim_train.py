"""The integration tier of tests/fast/test_optim_train.py (Train steps with the optimizers of shared/optim.py: a
folder's CPU default model, 10 steps on one fixed batch of 4 rows of 32 tokens on one device; the loss falls.
Every folder with Muon, MuonH and AdamH (Newton-Schulz on all its matrices: low-rank, experts; the hyperball;
AdamW on the rest; AdamW, the default, trains every folder in the contract test). And the weights' moving
average): the checks that start real processes or servers, or run long. What they share with the fast half is
imported from it."""

import numpy as np
import pytest
from fast.test_optim_train import CASES, steps  # (tests/fast/test_optim_train.py)


@pytest.mark.integration  # a long run: every folder trained with every optimizer
@pytest.mark.parametrize("folder,name", CASES)
def test_loss_falls(folder, name):
    losses, _, _ = steps(folder, name)
    assert np.all(np.isfinite(losses)), losses
    assert np.mean(losses[-3:]) < losses[0] - 0.3, (folder, name, losses)
