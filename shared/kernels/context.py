"""Context parallelism: a row's sequence axis sharded over the mesh axis `context`.

A variant's activations [B, T, ...] are sharded P(rows, "context", ...) when its mesh has a
`context` axis (train.py's `mesh_context`, 1 by default). Token-wise work (projections, norms,
MLPs, the loss) needs nothing more: each device holds its slice of every row. Token mixing reads
other positions, so each family's mixer has an entry point here that runs per device
(`jax.shard_map` over the whole mesh) and exchanges exactly what its positions need:

  attention(..., window=None)   full causal attention on a ring with a zigzag: the row is cut into
                                2c halves and device r attends for halves r and 2c-1-r, one early and
                                one late (its queries, keys, values and segment ids move there by
                                `ppermute`, its outputs back), so every device computes the same
                                (2c+2)/(4c) of the [T/c, T] logits and skips the blocks above the
                                diagonal (a `lax.cond` per step picks which; `_zigzag_attention`).
                                Each of the c-1 steps passes every device's pair of K/V halves to the
                                next device (`RING = True`; `RING = False` takes them from an
                                all-gathered row instead, measured the same on CPU devices:
                                docs/context-parallel.md). (c-1)/c of the row's K/V reach each device
                                a layer either way.
  attention(..., window=W)      sliding-window attention: a halo exchange. Each device receives
                                the previous device's last W - 1 keys, values and segment ids
                                (`ppermute`), so the bytes sent do not grow with the row; the
                                queries attend over [halo, own] with the reference's blockwise
                                window path (O(T/c * W)). Needs W - 1 <= T/c (`refusal`).
  short_conv(x, w, docs)        a causal depthwise convolution of width W: the previous device's
                                last W - 1 inputs and document ids arrive by `ppermute`.
  kda(q, k, v, g, beta, ...)    the KDA recurrence S_t = A_t S_{t-1} + beta_t k_t v_t^T is linear
                                in S, so a device's slice maps its incoming state S_in to
                                M S_in + S_own. One chunked pass from the state [0 | I] with values
                                [v | 0] gives both S_own (the first V columns) and M (the last K);
                                every device all-gathers the (M, S_own) pairs, folds them in rank
                                order (S_in(r+1) = M_r S_in(r) + S_own(r), zero where a document
                                starts exactly at the boundary), and runs its chunks again from its
                                own S_in. Sends 2 * c * H * K * (K + V) floats a row per layer.

Positions and document indices are computed on the whole row before the sequence is split (the
models reshard their [B, T] ids with `whole_row` first), so packed documents that cross a shard
boundary keep their positions, masks and resets.

Every entry point with a `context` axis of size 1 (or no such axis, or no mesh) is exactly the
kernel it wraps, with the backend asked for. Under context parallelism only the XLA reference
runs inside (each device's part is an ordinary call); `refusal` names a backend that cannot.
Each path is checked on CPU devices against the unsharded call (tests/contract/test_context.py) and in
every variant by the contract (logits, loss and gradients with context 2 and 4).
UNVERIFIED ON GPU: the collectives and per-device kernels here never ran on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from shared.kernels.attention import AttentionError
from shared.kernels.attention import attention as kernel_attention
from shared.kernels.attention import reference as attention_reference
from shared.kernels.conv import reference as conv_reference
from shared.kernels.conv import short_conv as kernel_short_conv
from shared.kernels.dispatch import per_shard, spec

AXIS = "context"
OTHER = -(2**31)  # a segment id no real document has: the halo of the first device (nothing before it)


def size() -> int:
    """The size of the current mesh's `context` axis (1 without one, or without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names:
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes))[AXIS]


def axis() -> str | None:
    """The name to put in a PartitionSpec for the sequence axis of activations and batches: `context`
    where the current mesh has that axis with more than one device, else None (a context axis of 1, a
    mesh without one, or no mesh), so that a run without context parallelism is the same program."""
    return AXIS if size() > 1 else None


def whole_row(ids):
    """[B, T] ids with the sequence axis whole on every device (rows keep their sharding): positions
    and document indices are cumulative along the row, so they are computed on this, then resharded."""
    if axis() is None:
        return ids
    return jax.sharding.reshard(ids, P(spec(ids)[0], None))


REPLICA = "replica"  # unsplit(): the axis the context devices move to when rows are whole


def unsplit(params, mesh):
    """(params, mesh) for work on whole rows: decoding (one new token a row), prompts and the short rows
    of probes and lm-eval, whose lengths the context axis does not divide. Without a `context` axis above
    1, `mesh` and `params` themselves. Else the same devices in a mesh whose `context` axis has size 1 and
    whose devices along it form a trailing `replica` axis that nothing is sharded over: rows go whole to
    every device (each of the context's device groups computes the same rows, redundantly), and each
    weight keeps every slice on the device that holds it (re-wrapped, not copied). Every process calls it."""
    names = tuple(mesh.axis_names)
    if AXIS not in names or mesh.shape[AXIS] == 1:
        return params, mesh
    i = names.index(AXIS)
    whole = jax.sharding.Mesh(
        np.expand_dims(np.moveaxis(mesh.devices, i, -1), i),
        (*names, REPLICA),
        axis_types=(jax.sharding.AxisType.Explicit,) * (len(names) + 1),
    )
    return jax.tree.map(lambda x: _rewrap(x, whole), params), whole


def _rewrap(x, mesh):
    """x (a global array) on `mesh` under the same PartitionSpec: its device buffers themselves when every
    device's slice is the same there (no copy), else a copy (a spec naming `context`)."""
    new = jax.sharding.NamedSharding(mesh, x.sharding.spec)
    old_map = x.sharding.addressable_devices_indices_map(x.shape)
    if new.addressable_devices_indices_map(x.shape) == old_map:
        return jax.make_array_from_single_device_arrays(x.shape, new, [s.data for s in x.addressable_shards])
    return jax.device_put(x, new)


def refusal(
    seq_len: int, context: int, *, window: int | None = None, chunk: int | None = None, backend: str = "auto"
) -> str | None:
    """Why a row of `seq_len` tokens cannot be split over `context` devices, or None. `window`: the
    longest sliding window of the model (its halo must come from one device); `chunk`: a chunked
    recurrence's chunk size (each device's slice must be whole chunks); `backend`: the attention
    backend asked for (only the reference runs per device here)."""
    if context == 1:
        return None
    if seq_len % context:
        return f"seq_len {seq_len} is not divisible by mesh_context={context}"
    shard = seq_len // context
    if chunk is not None and shard % chunk:
        return (
            f"each device's {shard} tokens (seq_len {seq_len} / mesh_context {context}) are not whole "
            f"chunks of {chunk}: seq_len must be a multiple of mesh_context * chunk_size = {context * chunk}"
        )
    if window is not None and window - 1 > shard:
        return (
            f"a window of {window} needs the previous {window - 1} tokens, more than one device's "
            f"{shard} (seq_len {seq_len} / mesh_context {context}); lower mesh_context or the window"
        )
    if backend not in ("auto", "reference"):
        return (
            f"attention_backend {backend!r} cannot run under context parallelism (mesh_context={context}): "
            f"only the XLA reference runs per device there; use 'auto' or 'reference'"
        )
    return None


def _from_previous(x, n, fill):
    """The previous device's last `n` positions of x [B, t, ...] (axis 1); `fill` on the first device."""
    c = jax.lax.axis_size(AXIS)
    got = jax.lax.ppermute(x[:, x.shape[1] - n :], AXIS, [(i, i + 1) for i in range(c - 1)])
    first = jax.lax.axis_index(AXIS) == 0
    return jnp.where(first, jnp.full_like(got, fill), got)


# ---------------------------------------------------------------- attention

QUERY_BLOCK = 512  # full attention under context: local queries in blocks of this many, each against all keys


def _masked(q, k, v, q_pos, k_pos, seg_q, seg_k, *, causal, scale, softcap, return_lse):
    """Local queries q [B, t, H, D] against keys k, v [B, S, Hkv, D] with global positions q_pos [t],
    k_pos [S]: the reference's math (fp32 logits and softmax; causal and segment masks, by position).
    More than QUERY_BLOCK queries go in blocks (`lax.map`, each block recomputed in the backward pass),
    so the logits held at once are [QUERY_BLOCK, S] a head, not [t, S]."""
    t = q.shape[1]
    kw = dict(causal=causal, scale=scale, softcap=softcap, return_lse=return_lse)
    if t <= QUERY_BLOCK or t % QUERY_BLOCK:
        return _masked_block(q, k, v, q_pos, k_pos, seg_q, seg_k, **kw)
    n = t // QUERY_BLOCK
    blocks = lambda x: jnp.moveaxis(x.reshape(x.shape[0], n, QUERY_BLOCK, *x.shape[2:]), 1, 0)  # noqa: E731
    qs, ps = blocks(q), q_pos.reshape(n, QUERY_BLOCK)
    ss = None if seg_q is None else blocks(seg_q)
    one = jax.checkpoint(lambda xs: _masked_block(xs[0], k, v, xs[1], k_pos, xs[2], seg_k, **kw))
    out = jax.lax.map(one, (qs, ps, ss))
    unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], t, *x.shape[3:])  # noqa: E731
    return jax.tree.map(unblock, out)


ZIGZAG = True  # full attention: each device's queries as two zigzag halves, blocks nobody sees skipped
RING = True  # the zigzag's keys passed device to device (True) or taken from the all-gathered row (False)


def _zigzag_halves(x, c):
    """Contiguous -> zigzag. Device r holds halves 2r and 2r+1 of the row's 2c halves (x [B, t, ...]);
    afterwards it holds half r ("low") and half 2c-1-r ("high"), [low; high]. Half j goes to device j
    if j < c, else 2c-1-j: the even halves move by one permutation, the odd ones by another, and each
    device receives one even and one odd half (r and 2c-1-r differ in parity)."""
    h = x.shape[1] // 2
    dest = lambda j: j if j < c else 2 * c - 1 - j  # noqa: E731
    even = jax.lax.ppermute(x[:, :h], AXIS, [(i, dest(2 * i)) for i in range(c)])
    odd = jax.lax.ppermute(x[:, h:], AXIS, [(i, dest(2 * i + 1)) for i in range(c)])
    r_even = jax.lax.axis_index(AXIS) % 2 == 0
    return jnp.concatenate([jnp.where(r_even, even, odd), jnp.where(r_even, odd, even)], axis=1)


def _contiguous_halves(x, c):
    """Zigzag -> contiguous: the inverse of `_zigzag_halves`."""
    h = x.shape[1] // 2
    dest = lambda j: j if j < c else 2 * c - 1 - j  # noqa: E731
    r_even = jax.lax.axis_index(AXIS) % 2 == 0
    low, high = x[:, :h], x[:, h:]
    even = jax.lax.ppermute(jnp.where(r_even, low, high), AXIS, [(dest(2 * i), i) for i in range(c)])
    odd = jax.lax.ppermute(jnp.where(r_even, high, low), AXIS, [(dest(2 * i + 1), i) for i in range(c)])
    return jnp.concatenate([even, odd], axis=1)


def _zigzag_attention(q, k, v, seg, c, *, scale, softcap, return_lse):
    """Causal attention of this device's t queries (q [B, t, H, D], k, v [B, t, Hkv, D], seg [B, t] or
    None: its contiguous slice of the row) with the causal work the same on every device and the blocks
    nobody sees skipped. Cut the row into 2c halves of h = t/2; device r attends for halves r and 2c-1-r
    (a zigzag: an early and a late half), so each device's queries see (2c+1)/2 halves of keys, whatever r.
      diagonal:   [low; high] against key halves [r; 2c-1-r], causal by position   (2h x 2h logits)
      c-1 steps:  s = (r - i) mod c for i = 1 .. c-1, a `lax.cond` on the device:
                  s < r: [low; high] against key half s (both see all of it)      (2h x h)
                  s > r: high against key halves [s; 2c-1-s] (low sees neither)   (h x 2h)
    Every other pair of (query half, key half) is above the diagonal. Each device computes (2c+2) h^2
    logits, against 4c h^2 for its queries against the whole row. The keys of step i come from the
    all-gathered row (`RING = False`) or, with `RING = True`, from a ring: K/V move to the zigzag too and
    each step passes every device's pair of key halves to the next device (`ppermute`), so step i holds
    device (r - i)'s pair, exactly halves s and 2c-1-s. The partial results are merged by their
    log-sum-exp."""
    h = q.shape[1] // 2
    r = jax.lax.axis_index(AXIS)
    lo, hi = r, 2 * c - 1 - r
    kw = dict(causal=True, scale=scale, softcap=softcap, return_lse=True)
    half = lambda x, j: jax.lax.dynamic_slice_in_dim(x, j * h, h, axis=1)  # noqa: E731
    pos = lambda j: j * h + jnp.arange(h)  # noqa: E731
    two = lambda x, a, b: None if x is None else jnp.concatenate([half(x, a), half(x, b)], axis=1)  # noqa: E731
    zig = lambda x: None if x is None else _zigzag_halves(x, c)  # noqa: E731
    qz, q_pos = zig(q), jnp.concatenate([pos(lo), pos(hi)])
    if RING:
        pair = (zig(k), zig(v), zig(seg))  # this device's key halves lo and hi: the diagonal's, then passed on
    else:
        gather = lambda x: None if x is None else jax.lax.all_gather(x, AXIS, axis=1, tiled=True)  # noqa: E731
        rows = (gather(k), gather(v), gather(seg))
        pair = tuple(two(x, lo, hi) for x in rows)
    seg_q = pair[2]
    parts = [_masked(qz, pair[0], pair[1], q_pos, q_pos, seg_q, seg_q, **kw)]

    def both(s, kp, vp, sp):  # key half s (the pair's first), seen whole by both query halves
        return _masked(qz, kp[:, :h], vp[:, :h], q_pos, pos(s), seg_q, None if sp is None else sp[:, :h], **kw)

    def high_only(s, kp, vp, sp):  # key halves s and 2c-1-s, seen whole by the high half only
        o, lse = _masked(
            qz[:, h:],
            kp,
            vp,
            pos(hi),
            jnp.concatenate([pos(s), pos(2 * c - 1 - s)]),
            None if seg_q is None else seg_q[:, h:],
            sp,
            **kw,
        )
        return (
            jnp.concatenate([jnp.zeros_like(o), o], axis=1),
            jnp.concatenate([jnp.full_like(lse, -1e30), lse], axis=1),
        )

    for i in range(1, c):
        s = (r - i) % c
        if RING:
            pair = jax.lax.ppermute(pair, AXIS, [(j, (j + 1) % c) for j in range(c)])
        else:
            pair = tuple(None if x is None else two(x, s, 2 * c - 1 - s) for x in rows)
        parts.append(jax.lax.cond(s < r, both, high_only, s, *pair))
    lses = jnp.stack([lse for _, lse in parts])  # [steps, B, t, H]
    total = jax.nn.logsumexp(lses, axis=0)
    weights = jnp.exp(lses - total)
    out = sum(w[..., None] * o.astype(jnp.float32) for w, (o, _) in zip(weights, parts)).astype(q.dtype)
    out = _contiguous_halves(out, c)
    return (out, _contiguous_halves(total, c)) if return_lse else out


def _masked_block(q, k, v, q_pos, k_pos, seg_q, seg_k, *, causal, scale, softcap, return_lse):
    B, t, H, D = q.shape
    Hkv = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    f32 = jnp.float32
    logits = jnp.einsum("btkgd,bskd->bkgts", q.reshape(B, t, Hkv, H // Hkv, D).astype(f32), k.astype(f32)) * scale
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    ok = jnp.ones((t, k.shape[1]), bool)
    if causal:
        ok = ok & (k_pos[None, :] <= q_pos[:, None])
    ok = ok[None, None, None]
    if seg_q is not None:
        ok = ok & (seg_q[:, None, None, :, None] == seg_k[:, None, None, None, :])
    logits = jnp.where(ok, logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v).reshape(B, t, H, D)
    if not return_lse:
        return out
    lse = jax.nn.logsumexp(logits, axis=-1).transpose(0, 3, 1, 2).reshape(B, t, H)
    return out, lse


def attention(
    q, k, v, *, segment_ids=None, causal=True, window=None, scale=None, softcap=0.0, return_lse=False, backend="auto"
):
    """`kernels.attention` for q [B, T, H, D], k, v [B, T, Hkv, D] whose T is sharded over `context`
    (see the module docstring); exactly `kernels.attention(..., backend=backend)` without such an axis."""
    c = size()
    kw = dict(scale=scale, softcap=softcap, return_lse=return_lse)
    if c == 1:
        return kernel_attention(q, k, v, segment_ids=segment_ids, causal=causal, window=window, backend=backend, **kw)
    if not causal:
        raise AttentionError("context parallelism runs causal attention only")
    why = refusal(q.shape[1], c, window=window, backend=backend)
    if why:
        raise AttentionError(why)
    b, t, h, d = spec(q)
    qs, kvs, ss = P(b, t, h, d), P(*spec(k)), P(b, t)
    out_specs = [qs, P(b, t, h)] if return_lse else qs

    def full(q, k, v, seg):
        t = q.shape[1]
        if ZIGZAG and t % 2 == 0:
            return _zigzag_attention(q, k, v, seg, c, **kw)
        r = jax.lax.axis_index(AXIS)
        gather = lambda x: jax.lax.all_gather(x, AXIS, axis=1, tiled=True)  # noqa: E731
        seg_k = None if seg is None else gather(seg)
        return _masked(q, gather(k), gather(v), r * t + jnp.arange(t), jnp.arange(t * c), seg, seg_k, causal=True, **kw)

    def halo(q, k, v, seg):
        n = window - 1
        if seg is None:
            seg = jnp.zeros(q.shape[:2], jnp.int32)
        seg = seg.astype(jnp.int32)
        ext = lambda x, fill: jnp.concatenate([_from_previous(x, n, fill), x], axis=1)  # noqa: E731
        q_ext = jnp.concatenate([jnp.zeros_like(q[:, :n]), q], axis=1)  # the halo's queries are dropped
        res = attention_reference(
            q_ext, ext(k, 0), ext(v, 0), segment_ids=ext(seg, OTHER), causal=True, window=window, **kw
        )
        return tuple(x[:, n:] for x in res) if return_lse else res[:, n:]

    return per_shard(full if window is None else halo, (q, k, v, segment_ids), (qs, kvs, kvs, ss), out_specs)


# ---------------------------------------------------------------- short convolution


def short_conv(x, w, docs):
    """`kernels.short_conv` for x [B, T, C] with T sharded over `context`; docs [B, T] document
    indices of the whole row (`whole_row`, then resharded like x), never None under context."""
    c = size()
    if c == 1:
        return kernel_short_conv(x, w, docs)
    b, t, ch = spec(x)
    n = w.shape[0] - 1

    def local(x, w, docs):
        if n == 0:
            return conv_reference(x, w, docs)
        xe = jnp.concatenate([_from_previous(x, n, 0), x], axis=1)
        de = jnp.concatenate([_from_previous(docs, n, OTHER), docs], axis=1)
        return conv_reference(xe, w, de)[:, n:]

    return per_shard(local, (x, w, docs), (P(b, t, ch), P(None, ch), P(b, t)), P(b, t, ch))


# ---------------------------------------------------------------- KDA


def kda(q, k, v, g, beta, *, segment_ids=None, chunk_size=64, impl="xla"):
    """`shared.kernels.kda.kda` (training: no initial state) with T sharded over `context`; returns
    (o, final_state) as it does. See the module docstring for the two passes and the fold."""
    from shared.kernels import kda as _kda

    c = size()
    if c == 1:
        return _kda.kda(q, k, v, g, beta, segment_ids=segment_ids, chunk_size=chunk_size, impl=impl)
    if impl != "xla":
        raise _kda.KDAError(f"kda_impl {impl!r} cannot run under context parallelism (mesh_context={c}): use 'xla'")
    b, t, h, kd = spec(q)
    x4, x3, ss = P(b, t, h, kd), P(b, t, h), P(b, t)
    vs = P(*spec(v))

    def local(q, k, v, g, beta, seg):
        B, T, H, K = q.shape
        V = v.shape[-1]
        f32 = jnp.float32
        if seg is None:
            seg = jnp.zeros((B, T), jnp.int32)
        # pass 1: from [0 | I] with values [v | 0]: the final state is [S_own | M]
        start = jnp.concatenate(
            [jnp.zeros((B, H, K, V), f32), jnp.broadcast_to(jnp.eye(K, dtype=f32), (B, H, K, K))], axis=-1
        )
        v_ext = jnp.concatenate([v, jnp.zeros(v.shape[:-1] + (K,), v.dtype)], axis=-1)
        _, end = _kda.kda(q, k, v_ext, g, beta, initial_state=start, segment_ids=seg, chunk_size=chunk_size)
        own, M = end[..., :V], end[..., V:]
        all_own, all_M = (jax.lax.all_gather(x, AXIS) for x in (own, M))  # [c, B, H, K, V], [c, B, H, K, K]
        firsts, lasts = (jax.lax.all_gather(x, AXIS) for x in (seg[:, 0], seg[:, -1]))  # [c, B]
        states = [jnp.zeros((B, H, K, V), f32)]
        for j in range(1, c):  # S_in(j) = M_{j-1} S_in(j-1) + S_own(j-1), unless a document starts at j
            S = jnp.einsum("bhkj,bhjv->bhkv", all_M[j - 1], states[-1]) + all_own[j - 1]
            states.append(jnp.where((firsts[j] == lasts[j - 1])[:, None, None, None], S, 0.0))
        S_in = jnp.stack(states)[jax.lax.axis_index(AXIS)]
        # pass 2: this device's chunks from its own incoming state; the row's final state is the last device's
        o, S = _kda.kda(q, k, v, g, beta, initial_state=S_in, segment_ids=seg, chunk_size=chunk_size)
        return o, jax.lax.all_gather(S, AXIS)[-1]

    return per_shard(local, (q, k, v, g, beta, segment_ids), (x4, x4, vs, x4, x3, ss), [vs, P(b, h, None, None)])
