"""A helper for the variants' own decoding tests (variants/<variant>/test_<variant>.py): prefill and greedy decoding
with a folder's cache against `forward` on the same rows. The contract's check of every folder is
tests/contract/test_contract.py's check_decoding (on its tiny run)."""

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def decode_against_forward(model, cfg, mesh, params, lengths, steps: int, max_len: int, *, forward_cfgs=None, seed=0):
    """Prompts of `lengths` (left-padded, one a row), prefill, then `steps` greedy decoding steps; returns
    (max |logit difference| to forward's at the same positions, whether every greedy token is forward's
    argmax there). `forward_cfgs`: a list of configs to run forward with instead (default: cfg alone);
    then a list of those pairs, one per config."""
    lengths = np.asarray(lengths, np.int32)
    B, longest = len(lengths), int(lengths.max())
    assert longest + steps <= max_len
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, cfg.vocab_size, (B, max_len), dtype=np.int32)
    prompts = rng.integers(0, cfg.vocab_size, (B, longest), dtype=np.int32)
    for b, n in enumerate(lengths):
        prompts[b, longest - n :] = rows[b, :n]
    row_axes = model.cache_specs(cfg)["pos"][0]
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P(row_axes, *[None] * (x.ndim - 1))))  # noqa: E731
    with jax.set_mesh(mesh):
        cache = jax.jit(model.init_cache, static_argnums=(0, 1, 2))(cfg, B, max_len)
        logits, cache = jax.jit(lambda p, t, c, n: model.prefill(p, t, c, cfg, lengths=n))(
            params, put(prompts), cache, put(lengths)
        )
        step = jax.jit(lambda p, t, c: model.decode_step(p, t, c, cfg))
        out = [np.asarray(logits)]
        for i in range(steps):
            token = out[-1].argmax(-1).astype(np.int32)
            rows[np.arange(B), lengths + i] = token
            logits, cache = step(params, put(token), cache)
            out.append(np.asarray(logits))
        fwds = [
            np.asarray(jax.jit(lambda p, t, c=c: model.forward(p, t, c))(params, put(rows)))
            for c in forward_cfgs or [cfg]
        ]
    found = []
    for fwd in fwds:
        err, same = 0.0, True
        for i, lg in enumerate(out):
            want = fwd[np.arange(B), lengths - 1 + i]
            err = max(err, float(np.abs(lg - want).max()))
            if i < steps:
                same = same and bool((rows[np.arange(B), lengths + i] == want.argmax(-1)).all())
        found.append((err, same))
    return found if forward_cfgs else found[0]
