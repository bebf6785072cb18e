"""Blocked attention in plain JAX: keys in blocks with an online softmax, blocks no query can see skipped.

The `blocked` backend of shared/kernels/attention.py (which handles the mesh; this module takes
whole local arrays). Semantics are the reference's: q [B, T, H, D], k and v [B, S, Hkv, D]
with H a multiple of Hkv, masks causal / window W (t - s < W) / segment ids combined with
AND, optional logit soft-capping c * tanh(x / c), an fp32 softmax, `return_lse`.

How. Queries and keys are cut into blocks of `block` tokens (rows padded to a whole number
of blocks; padded keys are masked, padded queries sliced off). Query block i meets key
block j = i - d at block offset d. Which offsets can hold a visible pair is known from the
shapes alone: the causal mask leaves d >= 0, a window W leaves d <= (W + block - 2) //
block. The work is a Python loop over those offsets; at offset d every query block that
has a partner meets it in one batched matmul, and an online softmax (running max, running
denominator, rescaled accumulator, as FlashAttention does) folds the offsets together.
So causal attention computes about T^2 / 2 + T * block / 2 logits instead of the reference's
T^2, and a window about T * (W + block), not T^2. The position masks of one offset are the
same [block, block] matrix for every block pair (query minus key position is d * block +
a - c), a constant; offsets where every pair is visible get no mask at all. Segment ids are
applied per pair, so packed documents cost as much as one long one.

Backward: a custom VJP, as FlashAttention's. The forward saves out and the per-row
log-sum-exp; the backward visits the same offsets, recomputes the probabilities from the
lse, and accumulates dQ, dK and dV in one pass (dK, dV summed over each kv group by the
matmul itself). A cotangent g on the returned lse enters as delta = rowsum(dO * O) - g
(d lse / d logit = the softmax weight). JAX's own differentiation of the same loop
measured slower (figures below), and keeps every offset's probabilities for the backward.

Measured on the project's 2-core CPU machine, float32, 4 documents packed per row, with
other jobs running beside (load average 5 to 9: quote the ratios, not the times). Each row
is one process, blocked (its default block) against the reference in interleaved rounds:
the per-round ratio of their times, median (min-max) over 7 rounds of 3 calls each:

    python tools/bench/bench_attention.py --shape B,T,H,Hkv,D [--window W] --rounds 7 --calls 3

    B,T,H,Hkv,D      window  where it occurs                      fwd                fwd+bwd            auto
    32,128,4,2,32    -       dense, kda: CPU default              0.84 (0.36-1.97)   0.53 (0.22-0.63)   blocked
    16,256,4,2,32    -       swa_hybrid, moe_hero: global layers  0.21 (0.11-0.39)   0.52 (0.45-0.79)   blocked
    16,256,4,2,32    64      their local layers                   0.59 (0.48-1.05)   0.71 (0.65-0.93)   blocked
    8,512,4,2,32     -                                            0.31 (0.19-0.81)   0.45 (0.38-0.46)   blocked
    16,256,4,2,32    48      (blocks of 32; 9 rounds)             0.66 (0.56-0.99)   0.82 (0.62-1.02)   blocked
    16,256,4,2,32    32      (9 rounds)                           0.85 (0.47-2.20)   1.03 (0.93-1.26)   reference
    16,256,4,2,32    16                                           0.89 (0.54-1.52)   1.13 (0.74-2.16)   reference
    32,64,4,2,32     -                                            0.79 (0.52-1.83)   0.95 (0.68-1.41)   reference
    8,32,4,2,8       -       (blocks of 32; 5 rounds)             1.00 (0.86-1.15)   1.31 (1.24-1.45)   reference

Against the reference's blockwise path (windows) the gain is smaller than against its dense
one, and below a window of 48 there is none; below T = 128 neither. `auto_skip` is that
table as a rule. The block size (`default_block`), from the same tool with `--backends
blocked@16,blocked@32,blocked@64,reference` (forward + backward ratio to the reference,
5 rounds): at 32 x 128, blocks of 16 / 32 / 64 / 128 gave 0.93 / 0.65 / 0.54 / 1.74; at
8 x 512, 32 / 64 / 128 / 256 gave 0.48 / 0.43 / 0.49 / 0.65; at 16 x 256, 32 / 64 / 128
gave 0.69 / 0.57 / 0.70; with window 64, 16 / 32 / 64 gave 0.94 / 0.71 / 0.73; with
window 48, 0.93 / 0.82 / 0.94; at 32 x 64, 1.19 / 0.90 / 1.11. JAX's own differentiation
of the same loop (no custom VJP; blocks of 32, timed by the same tool through a
throwaway registry entry) took 1.38x the reference's forward + backward at 32 x 128,
where the custom VJP took 0.65x.

Runs wherever XLA does. UNVERIFIED ON GPU: measured and tested on CPU only; on a GPU
`auto` passes over it (the Pallas, cuDNN and FlashAttention-4 kernels are meant there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

NEG = -1e30  # a masked logit, as in the reference


def default_block(T: int, window: int | None) -> int:
    """Tokens per block: 64, or 32 where the row (T <= 64) or the window (< 64) is short, 16 for a
    window or row of at most 16 tokens. Measured on CPU (module docstring): smaller blocks skip more
    masked pairs, but their matmuls are too small to pay (at T = 128, 64 beat 32 and 16)."""
    L = T if window is None else min(T, window)
    if L <= 16:
        return 16
    return 32 if L < 64 or T <= 64 else 64


def auto_skip(c) -> str | None:
    """Why `auto` passes over the blocked backend for attention call `c` (attention.Call), or None where
    it takes it: on CPU, in float32, causal, T >= 128, and a window (if any) of at least 48 tokens.
    A rule of the call's shape alone, from the measurements in the module docstring, never a timing
    taken at run time: a resumed run picks what the run it resumes picked."""
    platform = jax.default_backend()
    if platform != "cpu":
        return f"measured to pay on CPU only, not on {platform!r}"
    if c.dtype != jnp.float32:
        return f"measured on CPU in float32 only, got {c.dtype}"
    if not c.causal:
        return "without the causal mask no block is skipped (not measured)"
    T = c.q_shape[1]
    if T < 128:
        return f"T={T} < 128: no faster than the reference on CPU (measured at T = 32 and 64)"
    if c.window is not None and c.window < 48:
        return f"window {c.window} < 48: the reference's blockwise path is as fast on CPU (measured at 16 and 32)"
    return None


def plan(nq: int, nk: int, block: int, causal: bool, window: int | None) -> list[tuple[int, int, int]]:
    """The block offsets that can hold a visible pair: (d, lo, hi), query blocks [lo, hi) meet key blocks
    [lo - d, hi - d). Offset 0 (the diagonal) first, then the others in order of distance."""
    dmin = 0 if causal else -(nk - 1)
    dmax = nq - 1
    if window is not None:  # the nearest pair of offset d is d * block - (block - 1) apart
        dmax = min(dmax, (window + block - 2) // block)
    steps = []
    for d in sorted(range(dmin, dmax + 1), key=abs):
        lo, hi = max(0, d), min(nq, nk + d)
        if lo < hi:
            steps.append((d, lo, hi))
    return steps


def _position_mask(d, block, causal, window):
    """[block, block] bool: which (query a, key c) pairs of offset d the causal and window masks keep;
    None where they keep all of them."""
    diff = d * block + np.arange(block)[:, None] - np.arange(block)[None, :]  # query minus key position
    ok = np.ones((block, block), bool)
    if causal:
        ok &= diff >= 0
    if window is not None:
        ok &= diff < window
    return None if ok.all() else ok


def _step_mask(d, lo, hi, segs, o):
    """The mask of offset d broadcastable to logits [B, Hkv, n, G, Bq, Bk], or None when every pair is visible."""
    block, S = o["block"], o["S"]
    ok = _position_mask(d, block, o["causal"], o["window"])
    mask = None if ok is None else jnp.asarray(ok)
    if S % block and hi - d == -(-S // block):  # this offset reaches the last key block, which is padded
        kpos = (np.arange(lo, hi)[:, None] - d) * block + np.arange(block)[None, :]  # [n, Bk]
        real = jnp.asarray((kpos < S)[:, None, None, :])  # [n, 1, 1, Bk]
        mask = real if mask is None else mask & real
    if segs is not None:
        sq, sk = segs
        same = sq[:, lo:hi, :, None] == sk[:, lo - d : hi - d, None, :]  # [B, n, Bq, Bk]
        same = same[:, None, :, None]  # [B, 1, n, 1, Bq, Bk]
        mask = same if mask is None else same & mask
    return mask


def _scores(qs, ks, o):
    """Scaled, soft-capped fp32 logits [B, Hkv, n, G, Bq, Bk] and the soft-cap's derivative factor (or None)."""
    s = jnp.einsum("bknqd,bknsd->bknqs", qs, ks, preferred_element_type=jnp.float32) * o["scale"]
    B, Hkv, n, GB, Bk = s.shape
    s = s.reshape(B, Hkv, n, o["G"], GB // o["G"], Bk)
    if o["softcap"]:
        t = jnp.tanh(s / o["softcap"])
        return o["softcap"] * t, 1.0 - t * t
    return s, None


def _flat(x):  # [B, Hkv, n, G, Bq, X] -> [B, Hkv, n, G * Bq, X] (the matmul's row axis)
    return x.reshape(*x.shape[:3], x.shape[3] * x.shape[4], *x.shape[5:])


def _groups(x, G):  # inverse of _flat
    return x.reshape(*x.shape[:3], G, x.shape[3] // G, *x.shape[4:])


def _add(acc, lo, hi, x):
    """acc[:, :, lo:hi] += x, in place."""
    return lax.dynamic_update_slice_in_dim(acc, lax.slice_in_dim(acc, lo, hi, axis=2) + x, lo, axis=2)


def _forward(q, k, v, segs, o):
    """q [B, Hkv, nq, G*Bq, D], k, v [B, Hkv, nk, Bk, D] -> out (same layout as q), lse [B, Hkv, nq, G, Bq] fp32."""
    G = o["G"]
    B, Hkv, nq, GB, D = q.shape
    acc = jnp.zeros((B, Hkv, nq, G, GB // G, D), jnp.float32)
    m = jnp.full(acc.shape[:-1], -jnp.inf, jnp.float32)
    l = jnp.zeros(acc.shape[:-1], jnp.float32)
    for d, lo, hi in o["steps"]:
        s, _ = _scores(q[:, :, lo:hi], k[:, :, lo - d : hi - d], o)
        mask = _step_mask(d, lo, hi, segs, o)
        if mask is not None:
            s = jnp.where(mask, s, NEG)
        m_old = m[:, :, lo:hi]
        m_new = jnp.maximum(m_old, jnp.max(s, axis=-1))
        alpha = jnp.exp(m_old - m_new)
        # A masked logit gives exp(NEG - m_new) = 0 once the row's max is a visible logit. A row whose every
        # key so far was masked (m_new = NEG) sums exp(0) = 1s here; alpha = exp(NEG - m) = 0 wipes them
        # at its first visible key. Every real row sees one: itself at offset 0 (causal, or T == S), or
        # every key (non-causal, no window); the rest is refused (attention.py).
        p = jnp.exp(s - m_new[..., None])
        pv = jnp.einsum(
            "bknqs,bknsd->bknqd", _flat(p).astype(v.dtype), v[:, :, lo - d : hi - d], preferred_element_type=jnp.float32
        )
        acc = lax.dynamic_update_slice_in_dim(acc, alpha[..., None] * acc[:, :, lo:hi] + _groups(pv, G), lo, axis=2)
        l = lax.dynamic_update_slice_in_dim(l, alpha * l[:, :, lo:hi] + jnp.sum(p, axis=-1), lo, axis=2)
        m = lax.dynamic_update_slice_in_dim(m, m_new, lo, axis=2)
    seen = l > 0  # padded query rows may see no key
    l = jnp.where(seen, l, 1.0)
    out = _flat(acc / l[..., None]).astype(q.dtype)
    lse = jnp.where(seen, m + jnp.log(l), NEG)
    return out, lse


def _backward(q, k, v, segs, out, lse, dout, dlse, o):
    G = o["G"]
    # dS = P * (dP - delta), delta = rowsum(dO * O); a cotangent g on lse adds P * g, folded into delta
    delta = jnp.sum(_groups(dout, G).astype(jnp.float32) * _groups(out, G).astype(jnp.float32), -1) - dlse
    dq = jnp.zeros(q.shape, jnp.float32)
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    for d, lo, hi in o["steps"]:
        qs, ks, vs, dos = q[:, :, lo:hi], k[:, :, lo - d : hi - d], v[:, :, lo - d : hi - d], dout[:, :, lo:hi]
        s, dcap = _scores(qs, ks, o)
        mask = _step_mask(d, lo, hi, segs, o)
        if mask is not None:
            s = jnp.where(mask, s, NEG)
        p = jnp.exp(s - lse[:, :, lo:hi, ..., None])
        dv = _add(
            dv,
            lo - d,
            hi - d,
            jnp.einsum("bknqs,bknqd->bknsd", _flat(p).astype(dout.dtype), dos, preferred_element_type=jnp.float32),
        )
        dp = _groups(jnp.einsum("bknqd,bknsd->bknqs", dos, vs, preferred_element_type=jnp.float32), G)
        ds = p * (dp - delta[:, :, lo:hi, ..., None])
        if dcap is not None:
            ds = ds * dcap
        ds = _flat(ds).astype(q.dtype)
        dq = _add(dq, lo, hi, jnp.einsum("bknqs,bknsd->bknqd", ds, ks, preferred_element_type=jnp.float32))
        dk = _add(dk, lo - d, hi - d, jnp.einsum("bknqs,bknqd->bknsd", ds, qs, preferred_element_type=jnp.float32))
    scale = o["scale"]
    return (dq * scale).astype(q.dtype), (dk * scale).astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blocked(q, k, v, segs, opts):
    """(out, lse) in the blocked layout, both differentiable."""
    return _forward(q, k, v, segs, dict(opts))


def _blocked_fwd(q, k, v, segs, opts):
    out, lse = _forward(q, k, v, segs, dict(opts))
    return (out, lse), (q, k, v, segs, out, lse)


def _blocked_bwd(opts, res, cts):
    q, k, v, segs, out, lse = res
    dout, dlse = cts
    dq, dk, dv = _backward(q, k, v, segs, out, lse, dout.astype(out.dtype), dlse, dict(opts))
    return dq, dk, dv, None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def attention(
    q, k, v, *, segment_ids=None, causal=True, window=None, scale=None, softcap=0.0, return_lse=False, block=None
):
    """Blocked attention on whole local arrays (no mesh handling: see attention.py's wrapper).

    Returns out [B, T, H, D], or with `return_lse` (out, lse [B, T, H] float32), as the reference.
    `block`: tokens per block (default `default_block`); any length, padded to whole blocks.
    """
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    block = default_block(max(T, S), window) if block is None else int(block)
    nq, nk = -(-T // block), -(-S // block)

    def blocks(x, n, heads):  # [B, L, heads * g, D] -> [B, Hkv, n, g * block, D]
        g = x.shape[2] // heads
        x = jnp.pad(x, [(0, 0), (0, n * block - x.shape[1]), (0, 0), (0, 0)])
        x = x.reshape(B, n, block, heads, g, D).transpose(0, 3, 1, 4, 2, 5)
        return x.reshape(B, heads, n, g * block, D)

    segs = None
    if segment_ids is not None:
        seg = segment_ids.astype(jnp.int32)
        segs = (
            jnp.pad(seg, [(0, 0), (0, nq * block - T)], constant_values=-1).reshape(B, nq, block),
            jnp.pad(seg, [(0, 0), (0, nk * block - S)], constant_values=-1).reshape(B, nk, block),
        )
    opts = (
        ("G", G),
        ("block", block),
        ("S", S),
        ("causal", bool(causal)),
        ("window", window),
        ("scale", D**-0.5 if scale is None else float(scale)),
        ("softcap", float(softcap)),
        ("steps", tuple(plan(nq, nk, block, causal, window))),
    )
    out, lse = _blocked(blocks(q, nq, Hkv), blocks(k, nk, Hkv), blocks(v, nk, Hkv), segs, opts)
    out = out.reshape(B, Hkv, nq, G, block, D).transpose(0, 2, 4, 1, 3, 5).reshape(B, nq * block, H, D)[:, :T]
    if not return_lse:
        return out
    return out, lse.transpose(0, 2, 4, 1, 3).reshape(B, nq * block, H)[:, :T]
