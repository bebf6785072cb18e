"""One declaration per weight: `Weight(shape, spec, role, init, fan_in, fan_out)`.

A model's `weights(cfg)` returns a nested dict of `Weight`s; its `param_shapes`, `param_specs`
and `init` are read off it (`shapes`, `specs`, `init_params` below), and the optimizer
(shared/optim.py) groups the weights by `role`. Nothing looks at a weight's name, except its
random key: `init_params` folds a stable hash (crc32) of the weight's path into the seed, so
adding a weight leaves every other weight's initial value unchanged, and renaming a weight
changes its initial draw and nothing else.

Roles (what the optimizer does with each: shared/optim.py, `MUON_ROLES`, `DECAY_ROLES`):

| role | what | fan_in / fan_out |
|---|---|---|
| matrix | a hidden projection [*layers, in, out] | required |
| expert_matrix | one expert's projection [*layers, experts, in, out] | required |
| router | token -> expert scores [*layers, d_model, experts] | required |
| embedding | token id -> vector [vocab, d_model] (fan_in: the vocabulary) | required |
| unembedding | vector -> logits [d_model, vocab] | required |
| conv | depthwise convolution taps [*layers, taps, channels] | none |
| norm | a normalisation's scale (initialised at 1) | none |
| gain | a learned per-head / per-channel gate whose 0 is the identity (2 sigmoid(g)); decays towards it | none |
| rate | a learned per-head / per-channel rate (a log decay rate, A_log) | none |
| bias | an additive bias | none |
| buffer | moved by the train loop, not by gradients (moe_hero's router bias) | none |

For the matrix roles the axes other than fan_in and fan_out (stacked layers, experts) are
batch axes: each slice over them is one matrix.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

MATRIX_ROLES = ("matrix", "expert_matrix", "router", "embedding", "unembedding")
ROLES = MATRIX_ROLES + ("conv", "norm", "gain", "rate", "bias", "buffer")


@dataclass(frozen=True)
class Weight:
    shape: tuple
    spec: P
    role: str
    init: Callable  # (key, shape, dtype, spec) -> array; see normal / ones / zeros / uniform
    fan_in: int | None = None  # axis of a matrix role's input side
    fan_out: int | None = None  # axis of its output side; every other axis is a batch axis
    dtype: str = ""  # "" = the model's param_dtype

    def __post_init__(self):
        where = f"Weight{self.shape}"
        if self.role not in ROLES:
            raise ValueError(f"{where}: role {self.role!r} is not one of {ROLES}")
        if len(self.spec) > len(self.shape):
            raise ValueError(f"{where}: spec {self.spec} has more axes than the shape")
        n = len(self.shape)
        if self.role in MATRIX_ROLES:
            axes = (self.fan_in, self.fan_out)
            if None in axes or not all(-n <= a < n for a in axes) or self.fan_in % n == self.fan_out % n:
                raise ValueError(f"{where}: role {self.role} needs two distinct axes fan_in, fan_out, got {axes}")
        elif (self.fan_in, self.fan_out) != (None, None):
            raise ValueError(f"{where}: role {self.role} is not a matrix; fan_in / fan_out must be None")

    def batch_axes(self) -> tuple:
        """The axes over which a matrix role's slices are separate matrices (layers, experts)."""
        n = len(self.shape)
        return tuple(a for a in range(n) if a not in (self.fan_in % n, self.fan_out % n))


def normal(std: float) -> Callable:
    def draw(key, shape, dtype, spec):
        return std * jax.random.normal(key, shape, dtype, out_sharding=spec)

    return draw


def uniform(lo: float, hi: float) -> Callable:
    def draw(key, shape, dtype, spec):
        return jax.random.uniform(key, shape, dtype, lo, hi, out_sharding=spec)

    return draw


def ones(key, shape, dtype, spec):
    return jnp.ones(shape, dtype, out_sharding=spec)


def zeros(key, shape, dtype, spec):
    return jnp.zeros(shape, dtype, out_sharding=spec)


def is_weight(x) -> bool:
    return isinstance(x, Weight)


def field(decl: dict, name: str) -> dict:
    """The pytree of one field of every Weight (shape, spec, role, ...), in the structure of `decl`."""
    return jax.tree.map(lambda w: getattr(w, name), decl, is_leaf=is_weight)


def shapes(decl: dict) -> dict:
    return field(decl, "shape")


def specs(decl: dict) -> dict:
    return field(decl, "spec")


def init_params(decl: dict, key, dtype: str) -> dict:
    """Every weight drawn by its own `init`, from a key derived from its path (not its place in the
    tree): a copy that adds weights starts the ones it shares with its parent from the same values."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(decl, is_leaf=is_weight)
    leaves = []
    for path, w in paths:
        k = jax.random.fold_in(key, zlib.crc32(jax.tree_util.keystr(path).encode()))
        leaves.append(w.init(k, w.shape, jnp.dtype(w.dtype or dtype), w.spec))
    return jax.tree.unflatten(treedef, leaves)
