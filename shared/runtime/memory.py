"""Per-device memory of a train step, estimated from shapes alone (nothing is allocated).

    from shared.runtime import memory
    est = memory.estimate(abstract_state, loss, abstract_micro_batch, grad_accum=cfg.grad_accum)
    print(memory.report(est))   # params 2.1 GB, grads 2.1 GB, optimizer 4.2 GB, activations 31.0 GB, ...

The parts, each per device (every array's bytes divided by the mesh axes its sharding names):
- params, optimizer state: the train state as `init_state` builds it (its PartitionSpecs);
- grads: one gradient of the params, and one more for the accumulator when grad_accum > 1;
- activations: what the backward pass keeps from the forward pass of one micro-batch, exactly as
  the model's remat policy decides it: the residuals of `jax.vjp` of the loss, traced abstractly
  (for a scanned model, each per-layer residual is stacked over the layers);
- batch: the step's input arrays.
Not counted: XLA's temporaries inside one op or one layer's recompute, fragmentation, and the
runtime's own reserve. On the CPU default of dense the total is within a few percent of XLA's
compiled memory analysis (tests/contract/test_contract.py compares them); `fits` keeps `HEADROOM` of the
device free for what is not counted.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp

HEADROOM = 0.15  # of a device's memory, kept for XLA temporaries, fragmentation and the runtime


def per_device_bytes(x) -> int:
    """Bytes one device holds of an array or ShapeDtypeStruct, from its NamedSharding's spec (an
    array without one counts whole)."""
    n = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
    sharding = getattr(x, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return n
    div = 1
    for axes in spec:
        for a in axes if isinstance(axes, tuple) else (axes,):
            if a is not None:
                div *= sharding.mesh.shape[a]
    return -(-n // div)


def total_bytes(tree) -> int:
    return sum(per_device_bytes(x) for x in jax.tree.leaves(tree))


def estimate(state, loss, micro_batch, *, grad_accum: int = 1) -> dict:
    """Bytes per device of each part (see the module docstring) and their "total". `state`: the abstract
    train state ({"params", "opt", ...}, from jax.eval_shape under the mesh); `loss(params, batch)`:
    the scalar loss; `micro_batch`: the abstract batch of one micro-step. Call under the run's mesh."""
    residuals = jax.eval_shape(lambda p, b: jax.vjp(lambda q: loss(q, b), p)[1], state["params"], micro_batch)
    params = total_bytes(state["params"])
    out = {
        "params": params,
        "optimizer": total_bytes({k: v for k, v in state.items() if k != "params"}),
        "grads": params * (2 if grad_accum > 1 else 1),
        "activations": total_bytes(residuals),
        "batch": total_bytes(micro_batch) * grad_accum,
    }
    out["total"] = sum(out.values())
    return out


def device_capacity(text: str) -> tuple[str, int] | None:
    """The device a preset is written for, from its header: a line `# device: H100 80 GB` gives
    ("H100 80 GB", 80e9 bytes). None without one."""
    m = re.search(r"^#\s*device:\s*(.*?(\d+(?:\.\d+)?)\s*GB)\b", text, re.M | re.I)
    return (m.group(1).strip(), int(float(m.group(2)) * 1e9)) if m else None


def fits(est: dict, capacity: int) -> bool:
    return est["total"] <= (1 - HEADROOM) * capacity


def report(est: dict) -> str:
    return ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in est.items())
