"""The optimizers every train.py can choose with `--optimizer adamw|muon|muonh|adamh`.

Weights are grouped by the `role` of their declaration (shared/weights.py), never by name:

| role | adamw | muon | muonh | adamh |
|---|---|---|---|---|
| matrix, expert_matrix | AdamW, decayed | Muon, decayed | MuonH (hyperball) | AdamH (hyperball) |
| router, embedding, unembedding, conv, gain | AdamW, decayed | AdamW, decayed | AdamW, decayed | AdamW, decayed |
| norm, rate, bias | AdamW, never decayed | same | same | same |
| buffer | left alone (moved by the train loop) | same | same | same |

Every update is scaled by the schedule (warmup + cosine, or WSD: warmup, stable, linear decay)
times the role's learning-rate multiplier (`--optim.lr_mult embedding=1.2,expert_matrix=0.5`),
after clipping the global gradient norm (buffers excluded).

**Muon** (Jordan et al. 2024): Nesterov momentum m = mu m + g, u = g + mu m, then the
orthogonalised direction O = NewtonSchulz(u) of each matrix (the axes `fan_in`, `fan_out` of
its declaration; stacked layer and expert axes are batch axes, each slice its own matrix).
Scale: O has every singular value near 1, so its RMS is 1/sqrt(max(fan_in, fan_out)); we
multiply by `muon_rms * sqrt(max(fan_in, fan_out))` (muon_rms = 0.2, Moonlight's convention,
Liu et al. 2025), which gives the update the RMS of a typical AdamW update, so that one
learning rate and one weight decay serve both groups and AdamW's tuned values carry over.

**MuonH / AdamH** (Wen et al. 2025, "Fantastic Pretraining Optimizers and Where to Find Them
2.1: Hyperball Optimization"): with u the base optimizer's update (Muon's O, or Adam's
m_hat / (sqrt(v_hat) + eps)), R the weight's initial norm and Normalize(x) = x / ||x||_F,

    W <- R * Normalize(W - lr * R * Normalize(u))

and no weight decay on those weights. The norm is the **Frobenius norm of each matrix** (per
slice over the batch axes: one per layer, one per expert), as the paper defines it: the
hyperball wraps a matrix optimizer, and the Frobenius norm is the one for which projecting back
to the sphere removes, to first order, only the radial part of an update (so it replaces weight
decay, whose only lasting effect on a normalised layer is that radius). A per-column norm would
constrain each output unit separately, which the paper does not do. The hyperball applies to
the `matrix` and `expert_matrix` roles (the same weights Muon orthogonalises); the other roles
keep AdamW.

**Newton-Schulz under the explicit mesh** (`orthogonalize`). The momentum of a matrix weight is
sharded like the weight, e.g. [L, D/data, F/model]. The plan, per weight, once per step:
  1. pad the leading batch axis (layers; 1 for an unstacked matrix) to a multiple of the number
     of devices that shard the matrix axes (data x model, x expert where a spec uses it);
  2. `reshard` so that those mesh axes split the leading batch axis instead and each matrix is
     whole on one device (an all-to-all: every device then holds ceil(L / n) matrices, the same
     memory as its shard of the weight, at most one matrix more; never the whole stack);
  3. run the Newton-Schulz iterations as batched einsums with `out_sharding` = that layout:
     local matmuls, no communication;
  4. `reshard` back to the weight's spec (an all-to-all) and drop the padding.
Expert axes keep their `expert` sharding throughout. Without a mesh (one device) the same
math runs unsharded.

Optimizer state is a dict {count, mu, nu, radius} whose leaves have the weights' shapes and
PartitionSpecs (`state_specs`); `nu` exists only for Adam-updated weights and `radius` only
for hyperball ones (None elsewhere).

An exponential moving average of the weights (`optim.ema` > 0) is kept by train.py
(`ema_update`) and used by evaluation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P
from jax.sharding import reshard

from shared.config import ConfigError, check
from shared.weights import ROLES, Weight, is_weight

OPTIMIZERS = ("adamw", "muon", "muonh", "adamh")
SCHEDULES = ("cosine", "wsd")
MUON_ROLES = ("matrix", "expert_matrix")  # orthogonalised by muon / muonh; the hyperball for muonh / adamh
DECAY_ROLES = ("matrix", "expert_matrix", "router", "embedding", "unembedding", "conv", "gain")
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Jordan et al.'s quintic: fast growth of small singular values
# Documented band: after `ns_steps` = 5 iterations, every singular value of the input above
# NS_FLOOR times its largest one ends in [NS_BAND[0], NS_BAND[1]] (tests/fast/test_optim.py checks it).
NS_BAND, NS_FLOOR = (0.6, 1.25), 1e-2


class OptimError(ConfigError):
    """A bad optimizer setting; the message names the field."""


def _check(ok: bool, field: str, why: str) -> None:
    check(ok, field, why, OptimError)


def parse_lr_mult(text: str) -> dict:
    """ "embedding=1.2,expert_matrix=0.5" -> {"embedding": 1.2, "expert_matrix": 0.5}; raises OptimError."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        role, eq, value = part.partition("=")
        _check(
            eq == "=" and role.strip() in ROLES, "optim.lr_mult", f"{part!r} is not ROLE=VALUE with ROLE one of {ROLES}"
        )
        try:
            v = float(value)
        except ValueError:
            v = float("nan")
        _check(math.isfinite(v) and v >= 0, "optim.lr_mult", f"{part!r}: the multiplier must be a number >= 0")
        _check(role.strip() not in out, "optim.lr_mult", f"role {role.strip()!r} given twice")
        out[role.strip()] = v
    return out


@dataclass(frozen=True)
class OptimConfig:
    schedule: str = "cosine"  # cosine (warmup + cosine to lr * min_lr_ratio) | wsd (warmup, stable, linear decay)
    decay_frac: float = 0.2  # wsd: fraction of the steps spent in the final linear decay
    schedule_steps: int = 0  # the steps the schedule spans (0 = --steps); after them the lr stays at its final value
    lr_mult: str = ""  # per-role learning-rate multipliers, e.g. "embedding=1.2,expert_matrix=0.5"
    momentum: float = 0.95  # muon / muonh: Nesterov momentum
    ns_steps: int = 5  # muon / muonh: Newton-Schulz iterations
    muon_rms: float = 0.2  # muon: RMS of the update (AdamW-like; see shared/optim.py)
    eps: float = 1e-8  # Adam's epsilon
    ema: float = 0.0  # decay of the weights' moving average used by evaluation; 0 = off (e.g. 0.999)

    def __post_init__(self):
        _check(self.schedule in SCHEDULES, "optim.schedule", f"must be one of {SCHEDULES}, got {self.schedule!r}")
        _check(0 < self.decay_frac <= 1, "optim.decay_frac", f"must be in (0, 1], got {self.decay_frac}")
        _check(
            self.schedule_steps >= 0, "optim.schedule_steps", f"must be >= 0 (0 = --steps), got {self.schedule_steps}"
        )
        parse_lr_mult(self.lr_mult)
        _check(0 <= self.momentum < 1, "optim.momentum", f"must be in [0, 1), got {self.momentum}")
        _check(1 <= self.ns_steps <= 20, "optim.ns_steps", f"must be in [1, 20], got {self.ns_steps}")
        _check(self.muon_rms > 0, "optim.muon_rms", f"must be positive, got {self.muon_rms}")
        _check(0 < self.eps < 1, "optim.eps", f"must be in (0, 1), got {self.eps}")
        _check(0 <= self.ema < 1, "optim.ema", f"must be in [0, 1) (0 = off), got {self.ema}")


def make_schedule(oc: OptimConfig, lr: float, steps: int, warmup: int, min_lr_ratio: float):
    """Step -> learning rate: linear warmup from 0, then cosine to lr * min_lr_ratio at `steps`, or
    (wsd) constant lr until the last decay_frac of the steps, then linear to lr * min_lr_ratio. With
    `oc.schedule_steps` > 0 the schedule spans that many steps instead of `steps` (the lr stays at its final
    value after them): a run extended past its first `--steps` keeps the schedule it was trained with."""
    steps = oc.schedule_steps or steps
    _check(
        warmup < steps or warmup == 0,
        "optim.schedule_steps",
        f"the schedule's {steps} steps end before the warmup ({warmup} steps) does",
    )
    if oc.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, lr * min_lr_ratio)
    decay = max(1, round(oc.decay_frac * steps))
    _check(
        warmup <= steps - decay,
        "optim.decay_frac",
        f"warmup ({warmup} steps) and the decay ({decay} of {steps} steps) overlap",
    )
    parts = [
        optax.linear_schedule(0.0, lr, warmup),
        optax.constant_schedule(lr),
        optax.linear_schedule(lr, lr * min_lr_ratio, decay),
    ]
    return optax.join_schedules(parts, [warmup, steps - decay])


# ---------------------------------------------------------------- Newton-Schulz


def _mesh_axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def newton_schulz(x, steps: int, out_sharding=None):
    """Approximately orthogonalise every matrix [..., m, n] (U S V^T -> U V^T), batched over the
    leading axes, in fp32. The Gram matrix is taken on the smaller side."""
    a, b, c = NS_COEFFS
    x = x.astype(jnp.float32)
    x = x / (jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True)) + 1e-7)
    wide = x.shape[-2] <= x.shape[-1]
    for _ in range(steps):
        if wide:
            g = jnp.einsum("...ij,...kj->...ik", x, x, out_sharding=out_sharding)
            g = b * g + c * jnp.einsum("...ij,...jk->...ik", g, g, out_sharding=out_sharding)
            x = a * x + jnp.einsum("...ij,...jk->...ik", g, x, out_sharding=out_sharding)
        else:
            g = jnp.einsum("...ji,...jk->...ik", x, x, out_sharding=out_sharding)
            g = b * g + c * jnp.einsum("...ij,...jk->...ik", g, g, out_sharding=out_sharding)
            x = a * x + jnp.einsum("...ij,...jk->...ik", x, g, out_sharding=out_sharding)
    return x


def orthogonalize(u, w: Weight, steps: int):
    """Newton-Schulz of every matrix slice of `u` (shaped and sharded like weight `w`), with the
    gather plan of the module docstring: whole matrices on one device each, batch axis split."""
    n = u.ndim
    fi, fo = w.fan_in % n, w.fan_out % n
    batch = w.batch_axes()
    spec = tuple(w.spec) + (None,) * (n - len(w.spec))
    x = jnp.transpose(u, (*batch, fi, fo))
    xspec = [spec[a] for a in batch] + [spec[fi], spec[fo]]
    if not batch:
        x, xspec = x[None], [None] + xspec
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        y = newton_schulz(x, steps)
    else:
        owners = _mesh_axes(xspec[-2]) + _mesh_axes(xspec[-1])  # mesh axes that split a matrix
        size = math.prod(mesh.shape[a] for a in owners)
        L = x.shape[0]
        pad = -L % size
        if pad:
            x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        local = P(_mesh_axes(xspec[0]) + owners or None, *xspec[1:-2], None, None)
        y = newton_schulz(reshard(x, local), steps, out_sharding=local)
        y = reshard(y, P(*xspec))[:L]
    if not batch:
        y = y[0]
    return jnp.transpose(y, tuple(sorted(range(n), key=(*batch, fi, fo).index)))


# ---------------------------------------------------------------- the optimizer


def _sphere_norm(x, w: Weight):
    n = x.ndim
    return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=(w.fan_in % n, w.fan_out % n), keepdims=True))


def hyperball(p, u, radius, lr, w: Weight):
    """R * Normalize(W - lr * R * Normalize(u)), Frobenius norm per matrix slice."""
    tiny = jnp.float32(1e-30)
    p32 = p.astype(jnp.float32)
    step = p32 - lr * radius * u / jnp.maximum(_sphere_norm(u, w), tiny)
    return radius * step / jnp.maximum(_sphere_norm(step, w), tiny)


def _kind(name: str, w: Weight) -> str:
    """How optimizer `name` updates weight `w`: adam | muon | muonh | adamh | none."""
    if w.role == "buffer":
        return "none"
    if w.role in MUON_ROLES and name != "adamw":
        return name
    return "adam"


def make(
    decl: dict,
    name: str,
    oc: OptimConfig,
    *,
    lr: float,
    steps: int,
    warmup: int,
    min_lr_ratio: float,
    weight_decay: float,
    b1: float,
    b2: float,
    grad_clip: float,
):
    """(optax.GradientTransformation, schedule) for the weights declared in `decl` (model.weights(cfg))."""
    _check(name in OPTIMIZERS, "optimizer", f"must be one of {OPTIMIZERS}, got {name!r}")
    schedule = make_schedule(oc, lr, steps, warmup, min_lr_ratio)
    mult = parse_lr_mult(oc.lr_mult)
    flat_decl, treedef = jax.tree.flatten(decl, is_leaf=is_weight)
    kinds = [_kind(name, w) for w in flat_decl]

    def init(params):
        ps = treedef.flatten_up_to(params)
        mu = [None if k == "none" else jnp.zeros_like(p, jnp.float32) for p, k in zip(ps, kinds)]
        nu = [jnp.zeros_like(p, jnp.float32) if k in ("adam", "adamh") else None for p, k in zip(ps, kinds)]
        radius = [_sphere_norm(p, w) if k in ("muonh", "adamh") else None for p, w, k in zip(ps, flat_decl, kinds)]
        return {
            "count": jnp.zeros((), jnp.int32),
            "mu": treedef.unflatten(mu),
            "nu": treedef.unflatten(nu),
            "radius": treedef.unflatten(radius),
        }

    def update(grads, state, params):
        gs, ps = treedef.flatten_up_to(grads), treedef.flatten_up_to(params)
        gs = [jnp.zeros_like(g) if k == "none" else g for g, k in zip(gs, kinds)]
        if grad_clip > 0:
            norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in gs))
            scale = jnp.where(norm > grad_clip, grad_clip / norm, 1.0)
            gs = [g * scale.astype(g.dtype) for g in gs]
        count = state["count"] + 1
        lr_t = schedule(state["count"])
        mus, nus = treedef.flatten_up_to(state["mu"]), treedef.flatten_up_to(state["nu"])
        radii = treedef.flatten_up_to(state["radius"])
        out_u, out_mu, out_nu = [], [], []
        for g, p, mu, nu, r, w, k in zip(gs, ps, mus, nus, radii, flat_decl, kinds):
            lr_w = lr_t * mult.get(w.role, 1.0)
            decay = weight_decay if w.role in DECAY_ROLES else 0.0
            g = g.astype(jnp.float32)
            if k == "none":
                out_u.append(jnp.zeros_like(p))
                out_mu.append(None)
                out_nu.append(None)
                continue
            if k in ("muon", "muonh"):
                mu = oc.momentum * mu + g
                o = orthogonalize(g + oc.momentum * mu, w, oc.ns_steps)
                if k == "muon":
                    scale = oc.muon_rms * math.sqrt(max(w.shape[w.fan_in], w.shape[w.fan_out]))
                    u = -lr_w * (scale * o + decay * p.astype(jnp.float32))
                else:
                    u = hyperball(p, o, r, lr_w, w) - p.astype(jnp.float32)
            else:
                mu = b1 * mu + (1 - b1) * g
                nu = b2 * nu + (1 - b2) * g * g
                a = (mu / (1 - b1**count)) / (jnp.sqrt(nu / (1 - b2**count)) + oc.eps)
                if k == "adamh":
                    u = hyperball(p, a, r, lr_w, w) - p.astype(jnp.float32)
                else:
                    u = -lr_w * (a + decay * p.astype(jnp.float32))
            out_u.append(u.astype(p.dtype))
            out_mu.append(mu)
            out_nu.append(nu)
        new = {
            "count": count,
            "mu": treedef.unflatten(out_mu),
            "nu": treedef.unflatten(out_nu),
            "radius": state["radius"],
        }
        return treedef.unflatten(out_u), new

    return optax.GradientTransformation(init, update), schedule


def state_specs(decl: dict, name: str) -> dict:
    """PartitionSpecs of `make(decl, name, ...)`'s state: moments as their weight, radius as its
    weight's batch axes (fan_in / fan_out axes of size 1, unsharded)."""
    flat, treedef = jax.tree.flatten(decl, is_leaf=is_weight)
    kinds = [_kind(name, w) for w in flat]

    def radius_spec(w):
        n = len(w.shape)
        spec = tuple(w.spec) + (None,) * (n - len(w.spec))
        return P(*(None if a in (w.fan_in % n, w.fan_out % n) else s for a, s in enumerate(spec)))

    return {
        "count": P(),
        "mu": treedef.unflatten([None if k == "none" else w.spec for w, k in zip(flat, kinds)]),
        "nu": treedef.unflatten([w.spec if k in ("adam", "adamh") else None for w, k in zip(flat, kinds)]),
        "radius": treedef.unflatten([radius_spec(w) if k in ("muonh", "adamh") else None for w, k in zip(flat, kinds)]),
    }


def ema_update(ema, params, decay: float):
    """ema <- decay * ema + (1 - decay) * params, leaf by leaf (in the weights' dtype)."""
    return jax.tree.map(
        lambda e, p: (decay * e.astype(jnp.float32) + (1 - decay) * p.astype(jnp.float32)).astype(e.dtype), ema, params
    )
