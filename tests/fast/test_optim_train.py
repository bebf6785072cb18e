"""Train steps with the optimizers of shared/optim.py: a folder's CPU default model, 10 steps on one fixed
batch of 4 rows of 32 tokens on one device; the loss falls. Every folder with Muon, MuonH and AdamH
(Newton-Schulz on all its matrices: low-rank, experts; the hyperball; AdamW on the rest; AdamW, the
default, trains every folder in the contract test). And the weights' moving average."""

import dataclasses
import os

import jax
import numpy as np

from shared import optim
from shared.variant import ROOT, discover, load

FOLDERS = discover()


def steps(folder, name, n=10, **over):
    train = load(os.path.join(ROOT, folder, "train.py"))
    cfg = train.TrainConfig(seq_len=32, batch_size=4, steps=n, warmup_steps=0, optimizer=name, wandb="disabled", **over)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (4, 33)).astype(np.int32)  # a small alphabet: learnable in a few steps
    batch = {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": np.ones((4, 32), np.int32),
        "loss_mask": np.ones((4, 32), np.float32),
    }
    mesh = train.make_mesh(cfg, jax.devices()[:1])
    opt, schedule = train.make_optimizer(cfg)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda k: train.init_state(cfg, opt, k))(jax.random.key(0))
        step = train.make_train_step(cfg, opt, schedule)
        b = train.to_device(batch, mesh, (1,))
        losses = []
        for _ in range(n):
            state, m = step(state, b)
            losses.append(float(m["train/loss"]))
    return losses, state, train


CASES = [(f, n) for f in FOLDERS for n in ("muon", "muonh", "adamh")]


def test_ema_is_kept_and_evaluated():
    """optim.ema > 0: the state holds the average, eval_params returns it, and it lags the weights."""
    _, state, train = steps("variants/dense", "adamw", n=3, optim=optim.OptimConfig(ema=0.5))
    assert "ema" in state and train.eval_params(state) is state["ema"]
    p, e = state["params"]["layers"]["wq"], state["ema"]["layers"]["wq"]
    assert not np.allclose(np.asarray(p), np.asarray(e))
    cfg = train.TrainConfig(steps=3, wandb="disabled")
    with jax.set_mesh(train.make_mesh(cfg, jax.devices()[:1])):
        off = jax.eval_shape(lambda k: train.init_state(cfg, train.make_optimizer(cfg)[0], k), jax.random.key(0))
    assert "ema" not in off and train.eval_params(off) is off["params"]
    assert dataclasses.asdict(train.TrainConfig())["optim"]["ema"] == 0.0
