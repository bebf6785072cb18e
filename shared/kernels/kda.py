"""Kimi Delta Attention (KDA): a gated delta rule with a per-channel forget gate.

Per batch row and head, with state S [K, V] (fp32), for t = 1..T:

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * S_t^T q_t

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] (log decay, <= 0);
beta [B, T, H]; initial_state / final_state [B, H, K, V] (fp32). q and k arrive already
L2-normalised; `scale` defaults to K**-0.5. The output has v's dtype; all state, decay
and matmul work runs in fp32.

`segment_ids` [B, T] (optional): the state is reset to zero where the id changes from
one token to the next (a document start), so each document runs as if alone. Documents
are the runs of equal ids, so ids 1,1,2,2,1 are three documents. `initial_state` feeds
the first document of each row; `final_state` is the state after the last token (the
last document's). T need not be a multiple of `chunk_size`: the row is padded with
tokens that change nothing (beta = 0, g = 0).

Entry points:
  kda(...)            the chunked algorithm below (the one the model uses);
  kda_recurrent(...)  `jax.lax.scan` over time, one token at a time: the reference.
  kda_flops_per_token(...)  the matmul FLOPs of `kda` as it computes them.

Special cases are calls of `kda`, not new kernels: Gated DeltaNet (a scalar gate per head
and token) is g equal across the K channels (variants/kda/test_kda.py checks it against its own
rule), DeltaNet is g = 0. A variant with a different chunked recurrence copies `kda` (and
the private helpers it uses, `_pairwise`, `_after`) into its model.py and imports the public
building blocks, each tested on its own in variants/kda/test_kda.py:
  reshape(x, shape, lead)     a reshape that keeps the sharding of the leading (row, head) axes;
  runs(segment_ids, B, T)     the document index of every token;
  run_masks(doc, chunk_size)  the chunked algorithm's document masks (same, reads, keeps, carries);
  unit_lower_inverse(M)       (I + A)^-1 of unit lower-triangular blocks, by matmuls.
A copy keeps the XLA:CPU workaround described in `kda`'s docstring (the optimization
barrier on delta) and its regression test. See AGENTS.md, "Where a kernel lives".

The chunked algorithm (WY / UT transform), per chunk of C tokens with the state S_0 at its
start and G = the cumulative sum of g inside the chunk (G_t = sum_{s<=t} g_s, <= 0):

    A[t, s]   = beta_t sum_c k_tc k_sc exp(G_tc - G_sc)          (s < t; 0 otherwise)
    Aqk[t, s] = scale  sum_c q_tc k_sc exp(G_tc - G_sc)          (s <= t)
    T         = (I + A)^-1                                        (unit lower triangular)
    W = T diag(beta) (exp(G) * K),   U = T diag(beta) V
    Delta = U - W S_0                                             (the corrected values)
    O     = scale (exp(G) * Q) S_0 + Aqk Delta
    S_C   = exp(G_C) * S_0 + (exp(G_C - G) * K)^T Delta

Everything except the last three lines is independent across chunks and runs for all
chunks at once as batched matmuls; only the [K, V] state is carried by a `lax.scan`
over chunks, so the cost is linear in T and matmul-bound.

Decay without overflow or cancellation: exp(G_t - G_s) is never formed as
exp(G_t) * exp(-G_s) (the second factor overflows under strong decay), nor is G_t - G_s
taken as a difference of two cumulative sums (under strong decay both are large and the
fp32 difference loses the small gap between them). The pairwise products are computed
hierarchically (`_pairwise`): a block of n tokens is split in halves; the lower-left
quadrant (t in the second half, s in the first) is one matmul of k_t exp(sum_{m<r<=t} g_r)
by k_s exp(sum_{s<r<=m} g_r), with m the last token of the first half, each sum taken
directly over the tokens between (a cumulative sum inside the half), so both exponents
are <= 0 and carry only the decay that lies between the two tokens; the two diagonal
quadrants recurse. Every pair is counted once, as in the dense product, with no
[C, C, K] tensor. exp(G_C - G_s) in S_C is likewise a sum over the tokens after s.
(I + A)^-1 is the same recursion on 2x2 blocks:
[[P, 0], [R, Q]]^-1 = [[P^-1, 0], [-Q^-1 R P^-1, Q^-1]]. This holds for g <= 0, which
the model guarantees (g = -exp(A_log) * softplus(...)); a positive g can overflow.

Document starts: a pair (t, s) of different documents is masked out of A and Aqk, a
token in a different document from the one the chunk's incoming state belongs to does
not read S_0 (its exp(G_t) factor is masked to 0), and S_C keeps only the last
document's contributions. Masks multiply finite values, so gradients stay finite.

impl="pallas" computes the pairwise decayed products (the [C, C] matrices A and Aqk
before beta, scale and masks) with a Pallas (Triton) kernel, one program per chunk and
head; its backward is the XLA path, recomputed. It takes exponents as differences of the
in-chunk cumulative sum G, as other chunked kernels do, so under very strong decay (|G| in
the thousands within a chunk) its exponents lose about |G| * 6e-8 to fp32 rounding, where
the XLA path stays exact. UNVERIFIED ON GPU: it was written on a
CPU-only machine, checked there in interpret mode (impl="pallas_interpret") and lowered
for CUDA, never run on a GPU. impl="xla" (the default) runs everywhere.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from shared.errors import StencilError
from shared.kernels.dispatch import check_alike, named, per_shard, spec

IMPLS = ("xla", "pallas", "pallas_interpret")
PALLAS_BLOCK = 16  # sub-block of the Pallas kernel: tl.dot needs every dimension >= 16


class KDAError(StencilError, ValueError):
    """A call `kda` cannot run as asked (shapes, chunk size, implementation)."""


def reshape(x, shape, lead: int):
    """`x.reshape(shape)` under an explicit mesh: the first `lead` axes keep x's sharding, the rest are unsharded.

    The first `lead` axes must be the same in x and `shape` (e.g. B, H); the rest may split or
    merge freely, e.g. the chunk reshape [B, H, T, K] -> [B, H, N, C, K] (T = N * C) with
    lead=2, and back. Under explicit sharding a plain `x.reshape` of a sharded array needs an
    `out_sharding`; this gives it one that keeps rows and heads where they were.
    """
    return x.reshape(shape, out_sharding=named(*spec(x)[:lead], *([None] * (len(shape) - lead))))


def _check(q, k, v, g, beta, initial_state, segment_ids, chunk_size, impl):
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape:
        raise KDAError(f"q, k and g must have one shape [B, T, H, K], got {q.shape}, {k.shape}, {g.shape}")
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise KDAError(f"v must be [B, T, H, V] and beta [B, T, H] with q {q.shape}, got {v.shape}, {beta.shape}")
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise KDAError(f"initial_state must be [B, H, K, V] = {(B, H, K, V)}, got {initial_state.shape}")
    if segment_ids is not None and segment_ids.shape != (B, T):
        raise KDAError(f"segment_ids must be [B, T] = {(B, T)}, got {segment_ids.shape}")
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise KDAError(f"chunk_size must be a power of two, got {chunk_size}")
    lead = ({0: 0, 1: 1, 2: 2}, "rows, positions and heads (axes 0-2)")  # as q's, on axes of more than one device
    check_alike("kda", "q", q, {"k": (k, *lead), "v": (v, *lead), "g": (g, *lead), "beta": (beta, *lead)}, KDAError)
    if impl not in IMPLS:
        raise KDAError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "xla":
        why = pallas_refuses(K, chunk_size)
        if why:
            raise KDAError(f"impl={impl!r} cannot run this call: {why}")


def pallas_refuses(K: int, chunk_size: int) -> str | None:
    """Why the Pallas kernel cannot take head dim K and this chunk size (None if it can)."""
    c = PALLAS_BLOCK
    if chunk_size < c or chunk_size % c:
        return f"chunk_size must be a multiple of {c}, got {chunk_size}"
    if K < 16 or K & (K - 1):
        return f"the key head dim must be a power of two >= 16 (Triton block shapes), got {K}"
    return None


def runs(segment_ids, B: int, T: int):
    """Document index [B, T] int32 of every token: 0, 1, 2, ... counting the places where the id changes.

    segment_ids [B, T] (or None: one document, all zeros). A document is a run of equal ids,
    so ids 5,5,2,2,5 give 0,0,1,1,2 (an id that comes back starts a new document).
    """
    if segment_ids is None:
        return jnp.zeros((B, T), jnp.int32)
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros_like(segment_ids[:, :1]), jnp.cumsum(change, axis=1, dtype=jnp.int32)], axis=1)


def run_masks(doc, chunk_size: int):
    """The document masks of the chunked algorithm, from the document index doc [B, T] (`runs`).

    T is padded to N = ceil(T / C) whole chunks of C = chunk_size tokens; padding tokens
    belong to the row's last document. Returns four float32 0/1 arrays, with t, s tokens of
    chunk n and "the incoming state" the state at the chunk's start (the token before it):
      same    [B, N, C, C]  t and s are in the same document (masks the pairwise A and Aqk);
      reads   [B, N, C]     t is in the incoming state's document (t reads S_0);
      keeps   [B, N, C]     t is in the chunk's last document (t still counts in S_C);
      carries [B, N, 1]     the incoming state survives the chunk (S_0 and the last token share
                            a document).
    Chunk 0's incoming state belongs to token 0's document (the initial state feeds it).
    """
    B, T = doc.shape
    C = chunk_size
    N = -(-T // C)
    doc = jnp.concatenate([doc, jnp.broadcast_to(doc[:, -1:], (B, N * C - T))], axis=1)  # padding: last document
    doc = reshape(doc, (B, N, C), 1)
    prev = jnp.concatenate([doc[:, :1, :1], doc[:, :-1, -1:]], axis=1)  # [B, N, 1]: the token before each chunk
    last = doc[..., -1:]
    f32 = jnp.float32
    return (
        (doc[..., :, None] == doc[..., None, :]).astype(f32),
        (doc == prev).astype(f32),
        (doc == last).astype(f32),
        (last == prev).astype(f32),
    )


# ---------------------------------------------------------------- the reference: one token at a time


def kda_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None):
    """The KDA recurrence with `jax.lax.scan` over time (fp32). Returns (o [B,T,H,V], state [B,H,K,V])."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    _check(q, k, v, g, beta, initial_state, segment_ids, 1, "xla")
    scale = K**-0.5 if scale is None else scale
    f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)  # noqa: E731 [T, B, ...]
    doc = runs(segment_ids, B, T)
    start = jnp.concatenate([jnp.zeros((B, 1), bool), doc[:, 1:] != doc[:, :-1]], axis=1)
    b, _, h, _ = spec(q)
    S0 = (
        jnp.zeros((B, H, K, V), jnp.float32, out_sharding=named(b, h, None, None))
        if initial_state is None
        else initial_state.astype(jnp.float32)
    )

    def step(S, x):
        qt, kt, vt, gt, bt, st = x
        S = jnp.where(st[:, None, None, None], 0.0, jnp.exp(gt)[..., None] * S)  # reset, or decay per key channel
        pred = jnp.einsum("bhk,bhkv->bhv", kt, S)
        S = S + jnp.einsum("bhk,bhv->bhkv", kt, bt[..., None] * (vt - pred))
        return S, scale * jnp.einsum("bhk,bhkv->bhv", qt, S)

    S, o = jax.lax.scan(step, S0, (f32(q), f32(k), f32(v), f32(g), f32(beta), jnp.moveaxis(start, 1, 0)))
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), S


# ---------------------------------------------------------------- the chunked algorithm


def _pairwise(x, y, g):
    """M[..., m, t, s] = sum_c x_tc y_sc exp(sum_{s<r<=t} g_rc) for s < t, else 0, on blocks x, y, g [..., M, n, K].

    g holds per-token log decays (not their cumulative sum); n is a power of 2. Hierarchical
    (see the module docstring): every exponent is a sum over exactly the tokens between the
    two, never a difference of cumulative sums. The two halves of every block become
    blocks of their own (M -> 2M), so the rank never grows (XLA:CPU limits tensor rank).
    """
    *lead, M, n, _ = x.shape
    if n == 1:
        return jnp.zeros_like(x[..., :1])  # [..., M, 1, 1], x's sharding
    h = n // 2
    g1, g2 = g[..., :h, :], g[..., h:, :]
    left = y[..., :h, :] * jnp.exp(_after(g1))  # s in the first half: decay from s to its last token m
    right = x[..., h:, :] * jnp.exp(jnp.cumsum(g2, axis=-2))  # t in the second half: decay from m to t
    low = jnp.einsum("...tc,...sc->...ts", right, left)  # [..., M, h, h]
    halves = lambda z: reshape(z, (*lead, 2 * M, h, z.shape[-1]), len(lead))  # noqa: E731
    sub = reshape(_pairwise(halves(x), halves(y), halves(g)), (*lead, M, 2 * h, h), len(lead))
    top = jnp.concatenate([sub[..., :h, :], jnp.zeros_like(low)], axis=-1)
    bottom = jnp.concatenate([low, sub[..., h:, :]], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def _after(g):
    """sum_{r > s} g_r along axis -2 (the decay from token s to the block's end), summed directly."""
    later = jnp.concatenate([g[..., 1:, :], jnp.zeros_like(g[..., :1, :])], axis=-2)
    return jax.lax.cumsum(later, axis=later.ndim - 2, reverse=True)


def unit_lower_inverse(M):
    """Inverse of unit lower-triangular blocks M [..., m, n, n] (n a power of 2) by 2x2 block recursion.

    M must have ones on the diagonal and zeros above it; what lies above the diagonal is not
    read (the result is lower triangular). [[P, 0], [R, Q]]^-1 = [[P^-1, 0], [-Q^-1 R P^-1, Q^-1]]:
    matmuls only, log2(n) levels, no triangular solve, and the rank stays fixed (the two
    diagonal halves become blocks of their own, m -> 2m; XLA:CPU limits tensor rank). The
    chunked algorithm's T = (I + A)^-1 is this on [B, H, N, C, C]. The leading axes keep their
    sharding; the last three must be unsharded.
    """
    *lead, m, n, _ = M.shape
    if n == 1:
        return jnp.ones_like(M)
    h = n // 2
    R = M[..., h:, :h]
    diag = jnp.concatenate([M[..., :h, :h], M[..., h:, h:]], axis=-2)  # [..., m, 2h, h]
    sub = reshape(unit_lower_inverse(reshape(diag, (*lead, 2 * m, h, h), len(lead))), (*lead, m, 2 * h, h), len(lead))
    Pi, Qi = sub[..., :h, :], sub[..., h:, :]
    low = -jnp.einsum("...ij,...jk,...kl->...il", Qi, R, Pi)
    return jnp.concatenate(
        [jnp.concatenate([Pi, jnp.zeros_like(low)], axis=-1), jnp.concatenate([low, Qi], axis=-1)], axis=-2
    )


def _pairwise_xla(q, k, g):
    """(sum_c k_t k_s e^(G_t-G_s) for s < t, sum_c q_t k_s e^(G_t-G_s) for s <= t) on [..., C, K] chunks."""
    diag = jnp.einsum("...tc,...tc->...t", q, k)
    C = q.shape[-2]
    return _pairwise(k, k, g), _pairwise(q, k, g) + diag[..., None] * jnp.eye(C, dtype=q.dtype)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None, chunk_size=64, impl="xla"):
    """Chunked KDA (see the module docstring). Returns (o [B, T, H, V] in v's dtype, final_state [B, H, K, V] fp32).

    XLA:CPU miscompile workaround, to keep in any copy of this algorithm: the per-chunk
    corrected values `delta` (U - W S_0, an output of the `lax.scan` over chunks) pass
    through `jax.lax.optimization_barrier` before the output einsums. Without it XLA:CPU
    (jaxlib 0.10.2) fused across the scan's output in the one-chunk case (T <= chunk_size,
    no initial state) inside the model, and compiled a program whose output changed from
    one compilation to the next (garbage up to 1e22). The barrier costs nothing (the scan
    materialises delta anyway). It showed inside a model layer, so the regression test,
    variants/kda/test_kda.py::test_one_chunk_layer_compiles_to_the_same_result_every_time, compiles a
    KDA layer three times and compares; a copy keeps the barrier and gets the same test for its
    own layer.
    """
    _check(q, k, v, g, beta, initial_state, segment_ids, chunk_size, impl)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    N = -(-T // C)
    Tp = N * C
    scale = K**-0.5 if scale is None else scale
    b, _, h, _ = spec(q)
    f32 = jnp.float32

    def chunks(x):  # [B, T, H, ...] -> [B, H, N, C, ...] fp32, padded with zeros (no effect: beta = g = 0)
        x = jnp.pad(x.astype(f32), [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x, 1, 2)  # [B, H, Tp, ...]
        return reshape(x, (B, H, N, C) + x.shape[3:], 2)

    qc, kc, vc, gc, bc = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)  # bc: [B, H, N, C]
    G = jnp.cumsum(gc, axis=-2)  # inclusive, restarting in every chunk

    same, reads, keeps, carries = (m[:, None] for m in run_masks(runs(segment_ids, B, T), C))  # [B, 1, N, ...]

    if impl == "xla":
        Akk, Aqk = _pairwise_xla(qc, kc, gc)
    else:
        Akk, Aqk = _pairwise_pallas(qc, kc, gc, impl == "pallas_interpret")
    A = bc[..., None] * Akk * same
    Aqk = scale * Aqk * same
    Tinv = unit_lower_inverse(A + jnp.eye(C, dtype=f32))
    decay_in = jnp.exp(G) * reads[..., None]  # [B, H, N, C, K]
    W = jnp.einsum("...ts,...sk->...tk", Tinv, bc[..., None] * decay_in * kc)
    U = jnp.einsum("...ts,...sv->...tv", Tinv, bc[..., None] * vc)
    Kout = jnp.exp(_after(gc)) * kc * keeps[..., None]  # k_s decayed to the chunk's end
    decay_all = jnp.exp(G[..., -1, :]) * carries  # [B, H, N, K]

    S0 = (
        jnp.zeros((B, H, K, V), f32, out_sharding=named(b, h, None, None))
        if initial_state is None
        else initial_state.astype(f32)
    )

    def step(S, xs):
        W, U, Kout, decay = xs
        delta = U - jnp.einsum("bhtk,bhkv->bhtv", W, S)
        S_next = decay[..., None] * S + jnp.einsum("bhtk,bhtv->bhkv", Kout, delta)
        return S_next, (S, delta)

    along = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731 [B, H, N, ...] -> [N, B, H, ...]
    S, (S_in, delta) = jax.lax.scan(step, S0, (along(W), along(U), along(Kout), along(decay_all)))
    S_in, delta = jnp.moveaxis(S_in, 0, 2), jnp.moveaxis(delta, 0, 2)  # [B, H, N, K, V], [B, H, N, C, V]
    # The XLA:CPU miscompile workaround (see the docstring): no fusion across the scan's output.
    delta = jax.lax.optimization_barrier(delta)
    o = jnp.einsum("bhntk,bhnkv->bhntv", scale * decay_in * qc, S_in) + jnp.einsum("bhnts,bhnsv->bhntv", Aqk, delta)
    o = jnp.moveaxis(reshape(o, (B, H, Tp, V), 2), 1, 2)[:, :T]  # [B, T, H, V]
    return o.astype(v.dtype), S


# ---------------------------------------------------------------- Pallas: the pairwise decayed products


def _pairwise_kernel(q_ref, k_ref, g_ref, akk_ref, aqk_ref):
    """One chunk of one head: akk [C, C] (s < t) and aqk [C, C] (s <= t), before beta, scale and masks.

    Sub-blocks of c = PALLAS_BLOCK tokens. Block (i, j), j < i: one tl.dot of k_t exp(G_t - G_m)
    by k_s exp(G_m - G_s), m the first token of block i (both exponents <= 0). Diagonal
    block (i, i): the exact [c, c, K] products, exponents masked to t >= s before exp.
    """
    C = q_ref.shape[0]
    c = PALLAS_BLOCK
    n = C // c
    t = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    s = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    for i in range(n):
        rows = pl.ds(i * c, c)
        qi, ki, gi = q_ref[rows, :], k_ref[rows, :], g_ref[rows, :]
        gm = g_ref[pl.ds(i * c, 1), :]  # [1, K]
        ei = jnp.exp(gi - gm)
        for j in range(n):
            cols = pl.ds(j * c, c)
            if j < i:
                kj = k_ref[cols, :] * jnp.exp(gm - g_ref[cols, :])
                akk_ref[rows, cols] = plt.dot(ki * ei, kj, trans_b=True)
                aqk_ref[rows, cols] = plt.dot(qi * ei, kj, trans_b=True)
            elif j > i:
                akk_ref[rows, cols] = jnp.zeros((c, c), jnp.float32)
                aqk_ref[rows, cols] = jnp.zeros((c, c), jnp.float32)
        lower = (t >= s)[:, :, None]
        e = jnp.where(lower, jnp.exp(jnp.where(lower, gi[:, None, :] - gi[None, :, :], 0.0)), 0.0)  # [c, c, K]
        akk_ref[rows, rows] = jnp.where(t > s, jnp.sum(ki[:, None, :] * ki[None, :, :] * e, axis=-1), 0.0)
        aqk_ref[rows, rows] = jnp.sum(qi[:, None, :] * ki[None, :, :] * e, axis=-1)


def _pairwise_call(q, k, G, interpret):
    lead = q.shape[:-2]
    C, K = q.shape[-2:]
    n = math.prod(lead)
    flat = lambda x: x.reshape(n, C, K)  # noqa: E731
    spec_in = pl.BlockSpec((None, C, K), lambda i: (i, 0, 0))
    spec_out = pl.BlockSpec((None, C, C), lambda i: (i, 0, 0))
    out = jax.ShapeDtypeStruct((n, C, C), jnp.float32)
    akk, aqk = pl.pallas_call(
        _pairwise_kernel,
        out_shape=(out, out),
        grid=(n,),
        in_specs=[spec_in] * 3,
        out_specs=(spec_out, spec_out),
        interpret=interpret,
        compiler_params=None if interpret else plt.CompilerParams(num_warps=4, num_stages=1),
        name="kda_pairwise",
    )(flat(q), flat(k), flat(G))
    return akk.reshape(*lead, C, C), aqk.reshape(*lead, C, C)


def _pallas_local(q, k, g, interpret):
    """The Pallas forward (on G = cumsum g) with the XLA backward (recomputed), on arrays local to one device."""

    @jax.custom_vjp
    def f(q, k, g):
        return _pairwise_call(q, k, jnp.cumsum(g, axis=-2), interpret)

    def fwd(q, k, g):
        return f(q, k, g), (q, k, g)

    def bwd(res, ct):
        return jax.vjp(_pairwise_xla, *res)[1](ct)

    f.defvjp(fwd, bwd)
    return f(q, k, g)


def _pairwise_pallas(q, k, g, interpret):
    """[B, H, N, C, K] -> two [B, H, N, C, C]; under a mesh, each device runs its own rows and heads."""
    s = spec(q)
    return per_shard(functools.partial(_pallas_local, interpret=interpret), (q, k, g), (s, s, s), [s, s])


# ---------------------------------------------------------------- FLOPs


def kda_flops_per_token(T: int, H: int, K: int, V: int, chunk_size: int = 64, training: bool = True) -> float:
    """Matmul FLOPs per token of `kda` as computed (2 per multiply-add), x3 for training (fwd + 2x bwd).

    Per chunk of C tokens and head: the pairwise products A (C(C-1)/2 pairs x K) and Aqk
    (C(C+1)/2 pairs x K); the block-recursive inverse (at half-size h, C/2h blocks of two
    h x h x h matmuls); W and U (dense C x C by C x K, C x V); in the scan, W S and
    Kout^T Delta (C K V each); the output (C K V for Q S_0, C^2 V for Aqk Delta). T is
    padded to whole chunks, and the padding is counted. Elementwise work is not.
    """
    C = chunk_size
    N = -(-T // C)
    pairs = K * C * (C - 1) // 2 + K * C * (C + 1) // 2
    inverse, hh = 0, C // 2
    while hh >= 1:
        inverse += (C // (2 * hh)) * 2 * hh**3
        hh //= 2
    wu = C * C * (K + V)
    scan = 2 * C * K * V
    out = C * K * V + C * C * V
    per_chunk = 2 * (pairs + inverse + wu + scan + out) * H
    return (3.0 if training else 1.0) * N * per_chunk / T
