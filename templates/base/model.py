"""The template: the smallest complete decoder. RMSNorm, RoPE, multi-head attention, SwiGLU.

Parameters are a plain dict of arrays; `param_specs` gives a PartitionSpec for every leaf
on a mesh with explicit axes `data` (FSDP: weights sharded, gathered at use; batch
sharded), `context` (context parallelism: each row's sequence split; weights replicated)
and `model` (tensor parallelism: heads and FFN width sharded). Layers are stacked on a
leading axis and run with `jax.lax.scan`. Attention under a `context` axis larger than 1
runs through shared/kernels/context.py (keys and values all-gathered over `context`).

Decoding (`init_cache`, `prefill`, `decode_step`; shared/decode.py drives them) keeps every
layer's keys and values in a cache, so each new token costs one position, not the whole row.

Every variant is copied from this file (or from a variant copied from it) and then edited.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.sharding import reshard

from shared import flops, kernels
from shared import weights as weights_lib
from shared.config import ConfigError, check, check_types  # noqa: F401  (model.ConfigError, model.check)
from shared.kernels import context
from shared.weights import Weight, normal, ones

COPIED_FROM = None  # the root of the lineage


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 2048
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    head_dim: int = 32
    d_ff: int = 384  # SwiGLU hidden width
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    param_dtype: str = "float32"
    compute_dtype: str = "float32"  # "bfloat16" on accelerators
    attention_backend: str = "auto"  # see shared/kernels/attention.py

    def __post_init__(self):
        check_types(self, "model.")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim", "d_ff"):
            check(getattr(self, name) > 0, f"model.{name}", f"must be positive, got {getattr(self, name)}")
        check(self.head_dim % 2 == 0, "model.head_dim", f"RoPE needs an even head_dim, got {self.head_dim}")
        for name in ("param_dtype", "compute_dtype"):
            check(
                getattr(self, name) in ("float32", "bfloat16"),
                f"model.{name}",
                f"must be float32 or bfloat16, got {getattr(self, name)!r}",
            )
        check(self.init_std > 0, "model.init_std", f"must be positive, got {self.init_std}")
        check(self.rope_theta > 0, "model.rope_theta", f"must be positive, got {self.rope_theta}")
        check(0 < self.norm_eps < 1, "model.norm_eps", f"must be in (0, 1), got {self.norm_eps}")
        # an unknown backend, or one that cannot compute this model's attention, is refused here, before
        # tracing (whether it is available on this machine is checked when the layer is traced)
        call = kernels.AttentionCall(
            (1, 2, self.n_heads, self.head_dim),
            (1, 2, self.n_heads, self.head_dim),
            jnp.dtype(self.compute_dtype),
            True,
            None,
            False,
        )
        why = kernels.refusal("attention", self.attention_backend, call)
        check(why is None, "model.attention_backend", f"{self.attention_backend!r}: {why}")


# ---------------------------------------------------------------- parameters


def weights(cfg: ModelConfig) -> dict:
    """Every weight, declared once: shape, PartitionSpec, role, init, and for matrices the fan-in and
    fan-out axes (shared/weights.py; the leading layer axis is a batch axis). `data` shards the
    d_model side (FSDP), `model` the width side. Matrices Normal(0, init_std), the projections back
    into the residual scaled by 1/sqrt(2 n_layers); norms start at 1."""
    D, L, F, V = cfg.d_model, cfg.n_layers, cfg.d_ff, cfg.vocab_size
    q = cfg.n_heads * cfg.head_dim
    col, row, rep = P(None, "data", "model"), P(None, "model", "data"), P(None, None)
    std, out_std = normal(cfg.init_std), normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
    return {
        "embed": Weight((V, D), P("model", "data"), "embedding", std, fan_in=0, fan_out=1),
        "layers": {
            "attn_norm": Weight((L, D), rep, "norm", ones),
            "wq": Weight((L, D, q), col, "matrix", std, fan_in=1, fan_out=2),
            "wk": Weight((L, D, q), col, "matrix", std, fan_in=1, fan_out=2),
            "wv": Weight((L, D, q), col, "matrix", std, fan_in=1, fan_out=2),
            "wo": Weight((L, q, D), row, "matrix", out_std, fan_in=1, fan_out=2),
            "mlp_norm": Weight((L, D), rep, "norm", ones),
            "w_gate": Weight((L, D, F), col, "matrix", std, fan_in=1, fan_out=2),
            "w_up": Weight((L, D, F), col, "matrix", std, fan_in=1, fan_out=2),
            "w_down": Weight((L, F, D), row, "matrix", out_std, fan_in=1, fan_out=2),
        },
        "final_norm": Weight((D,), P(None), "norm", ones),
        "unembed": Weight((D, V), P("data", "model"), "unembedding", std, fan_in=0, fan_out=1),
    }


def param_shapes(cfg: ModelConfig) -> dict:
    return weights_lib.shapes(weights(cfg))


def param_specs(cfg: ModelConfig) -> dict:
    """PartitionSpec per leaf, from `weights`."""
    return weights_lib.specs(weights(cfg))


def init(cfg: ModelConfig, key) -> dict:
    """Each weight by its declared init, from a key derived from its name (not its place in the tree):
    a copy that adds weights starts the ones it shares with its parent from the same values."""
    return weights_lib.init_params(weights(cfg), key, cfg.param_dtype)


def sharded_dims(cfg: ModelConfig) -> tuple:
    """(field, size) of each size the `model` (tensor-parallel) mesh axis splits: train.py's make_mesh refuses
    a mesh_model that does not divide one, naming the field."""
    return (("n_heads", cfg.n_heads), ("d_ff", cfg.d_ff), ("vocab_size", cfg.vocab_size))


def context_refusal(cfg: ModelConfig, seq_len: int, n: int) -> str | None:
    """Why rows of `seq_len` tokens cannot be split over `n` devices of the `context` mesh axis for this model,
    or None (shared/kernels/context.py's rules; here only the attention backend matters)."""
    return context.refusal(seq_len, n, backend=cfg.attention_backend)


def num_params(cfg: ModelConfig) -> int:
    return sum(math.prod(s) for s in jax.tree.leaves(param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple)))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: every weight matmul (the embedding lookup is not one) plus causal attention."""
    D, F, L = cfg.d_model, cfg.d_ff, cfg.n_layers
    q = cfg.n_heads * cfg.head_dim
    per_layer = 4 * D * q + 3 * D * F
    matmuls = L * per_layer + D * cfg.vocab_size  # + unembedding
    attn = L * flops.attention_flops_per_token(seq_len, cfg.n_heads, cfg.head_dim)
    return flops.matmul_flops_per_token(matmuls) + attn


# ---------------------------------------------------------------- the network


def rms_norm(x, w, eps):
    """RMSNorm over the last axis, fp32 statistics (shared/kernels/rms_norm.py: XLA, or QuACK on GPU)."""
    return kernels.rms_norm(x, w, eps=eps)


def positions(tokens, segment_ids):
    """Position of each token within its own document (restarts where the segment id changes)."""
    B, T = tokens.shape
    t = jnp.broadcast_to(jnp.arange(T), (B, T))
    if segment_ids is None:
        return t
    starts = (t == 0) | (segment_ids != jnp.roll(segment_ids, 1, axis=1))
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1)


def rope_angles(pos, head_dim, theta):
    """(cos, sin) [B, T, 1, head_dim/2] in fp32 for positions `pos` [B, T]: computed once per forward
    pass and shared by every layer (the positions are the same in all of them)."""
    half = head_dim // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = pos[..., None].astype(jnp.float32) * freq  # [B, T, half]
    return jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]


def rope(x, angles):
    """Rotary embedding on [B, T, H, hd] (rotate-half form) with `rope_angles`, in fp32."""
    cos, sin = angles
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def acts(*rest):
    """PartitionSpec of activations [B, T, ...]: rows over `data`, the sequence over `context` (where the
    mesh has that axis; shared/kernels/context.py), then `rest`."""
    return P("data", context.axis(), *rest)


def gather(w, spec, dtype):
    """FSDP: all-gather a weight over `data` (keep its `model` sharding) and cast for compute."""
    return reshard(w, spec).astype(dtype)


def block(x, layer, angles, segment_ids, cfg: ModelConfig, cache=None):
    """One layer. Returns (x, {"k", "v"}): this layer's keys (after RoPE) and values [B, T, H, hd], which
    prefill stores. With `cache` (decode_step: this layer's cached {"k", "v"} [B, S, H, hd] with the
    step's "slot" and "visible"), the new keys and values are written at `slot` and the queries attend
    to the cache instead (`attend_cache`); the cache's updated {"k", "v"} come back then."""
    dt = x.dtype
    B, T, _ = x.shape
    col, row, heads = P(None, "model"), P("model", None), acts("model", None)

    with jax.named_scope("attention"):
        h = rms_norm(x, layer["attn_norm"], cfg.norm_eps)
        q = jnp.einsum("btd,dq->btq", h, gather(layer["wq"], col, dt)).reshape(
            B, T, cfg.n_heads, cfg.head_dim, out_sharding=heads
        )
        k = jnp.einsum("btd,dk->btk", h, gather(layer["wk"], col, dt)).reshape(
            B, T, cfg.n_heads, cfg.head_dim, out_sharding=heads
        )
        v = jnp.einsum("btd,dk->btk", h, gather(layer["wv"], col, dt)).reshape(
            B, T, cfg.n_heads, cfg.head_dim, out_sharding=heads
        )
        q, k = rope(q, angles), rope(k, angles)
        if cache is None:
            o = context.attention(q, k, v, segment_ids=segment_ids, causal=True, backend=cfg.attention_backend)
            kv = {"k": k, "v": v}
        else:
            kv = {
                n: jax.lax.dynamic_update_slice_in_dim(cache[n], new, cache["slot"], axis=1)
                for n, new in (("k", k), ("v", v))
            }
            o = attend_cache(q, kv["k"], kv["v"], cache["visible"])
        o = o.reshape(B, T, cfg.n_heads * cfg.head_dim, out_sharding=acts("model"))
        x = x + jnp.einsum("btq,qd->btd", o, gather(layer["wo"], row, dt), out_sharding=acts(None))

    with jax.named_scope("mlp"):
        h = rms_norm(x, layer["mlp_norm"], cfg.norm_eps)
        gate = jnp.einsum("btd,df->btf", h, gather(layer["w_gate"], col, dt))
        up = jnp.einsum("btd,df->btf", h, gather(layer["w_up"], col, dt))
        x = x + jnp.einsum(
            "btf,fd->btd", jax.nn.silu(gate) * up, gather(layer["w_down"], row, dt), out_sharding=acts(None)
        )
    return x, kv


def hidden_states(params, tokens, cfg: ModelConfig, *, segment_ids=None, cache=None):
    """Final-norm hidden states [B, T, D] in the compute dtype. With `cache` (prefill: an empty one from
    init_cache), also that cache with every layer's keys and values in slots [0, T)."""
    dt = jnp.dtype(cfg.compute_dtype)
    x = reshard(params["embed"], P(None, None)).at[tokens].get(out_sharding=acts(None)).astype(dt)
    pos = positions(context.whole_row(tokens), None if segment_ids is None else context.whole_row(segment_ids))
    angles = rope_angles(reshard(pos, acts()), cfg.head_dim, cfg.rope_theta)

    def step(x, layer):
        with jax.named_scope("layer"):  # profiles read layer/attention, layer/mlp (tools/bench/profile_top.py)
            x, kv = block(x, layer, angles, segment_ids, cfg)
            return x, (kv if cache is not None else None)

    step = jax.checkpoint(step, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    x, kv = jax.lax.scan(step, x, params["layers"])
    h = rms_norm(x, params["final_norm"], cfg.norm_eps)
    if cache is None:
        return h
    return h, cache | {n: jax.lax.dynamic_update_slice_in_dim(cache[n], kv[n], 0, axis=2) for n in ("k", "v")}


def unembedding(params, cfg: ModelConfig):
    return reshard(params["unembed"], P(None, "model")).astype(jnp.dtype(cfg.compute_dtype))


def forward(params, tokens, cfg: ModelConfig, *, segment_ids=None):
    """Logits [B, T, V] in fp32. Training uses `loss_fn`, which never holds all of them at once."""
    h = hidden_states(params, tokens, cfg, segment_ids=segment_ids)
    return jnp.einsum("btd,dv->btv", h, unembedding(params, cfg), preferred_element_type=jnp.float32)


def loss_fn(params, batch, cfg: ModelConfig):
    """Mean next-token cross-entropy over unmasked tokens. Returns (loss, metrics)."""
    h = hidden_states(params, batch["tokens"], cfg, segment_ids=batch["segment_ids"])
    with jax.named_scope("loss"):
        nll, zsq = kernels.cross_entropy(h, unembedding(params, cfg), batch["targets"], batch["loss_mask"])
    n = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
    return nll / n, {"loss": nll / n, "z": zsq / n, "tokens": n}


# ---------------------------------------------------------------- decoding with a cache


def cache_specs(cfg: ModelConfig) -> dict:
    """PartitionSpec of every leaf of `init_cache`: rows over `data`, heads over `model`, as in training."""
    kv = P(None, "data", None, "model", None)
    return {"k": kv, "v": kv, "pos": P("data"), "slot": P()}


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> dict:
    """An empty cache for `batch` rows of up to `max_len` slots (a prompt's left padding, the prompt and
    the new tokens; the same slots in every row):
      k, v  [n_layers, batch, max_len, n_heads, head_dim] every layer's keys (after RoPE) and values;
      pos   [batch] int32 each row's next position (the tokens it holds, padding not counted);
      slot  [] int32 the slot the next token is written to (prompts are left-padded: one for all rows).
    Memory grows linearly with max_len."""
    specs, dt = cache_specs(cfg), jnp.dtype(cfg.compute_dtype)
    shape = (cfg.n_layers, batch, max_len, cfg.n_heads, cfg.head_dim)
    return {
        "k": jnp.zeros(shape, dt, out_sharding=specs["k"]),
        "v": jnp.zeros(shape, dt, out_sharding=specs["v"]),
        "pos": jnp.zeros((batch,), jnp.int32, out_sharding=specs["pos"]),
        "slot": jnp.zeros((), jnp.int32),
    }


def prefill(params, tokens, cache, cfg: ModelConfig, *, lengths=None):
    """Run the prompts and fill an empty cache. tokens [B, T]: row b's prompt is its last lengths[b]
    tokens (left-padded; what the padding holds does not matter); lengths [B] (default: all T).
    Returns (logits [B, V] fp32 for each row's next token, the cache at slot T).

    The rows run as `forward` runs a packed row: the padding is a document of its own (segment id 0,
    the prompt 1), so the prompt's positions start at 0 and nothing of it attends to the padding."""
    kernels.check_specs("prefill: cache", cache, cache_specs(cfg))  # a hand-built cache is named, not failed deep
    B, T = tokens.shape
    lengths = jnp.full((B,), T, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    lengths = reshard(lengths, cache_specs(cfg)["pos"])
    segment_ids = (jnp.arange(T)[None, :] >= (T - lengths)[:, None]).astype(jnp.int32)
    h, cache = hidden_states(params, tokens, cfg, segment_ids=segment_ids, cache=cache)
    logits = jnp.einsum("bd,dv->bv", h[:, -1], unembedding(params, cfg), preferred_element_type=jnp.float32)
    return logits, cache | {"pos": lengths, "slot": jnp.int32(T)}


def attend_cache(q, k, v, visible):
    """Attention of new queries q [B, T, H, hd] to the cache's keys and values [B, S, H, hd], key slot s
    seen by row b where visible[b, s]; fp32 softmax. Plain JAX, not shared/kernels: a decoding step
    has one query a row, and the whole cache is read once."""
    logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    logits = jnp.where(visible[:, None, None, :], logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs.astype(v.dtype), v, out_sharding=acts("model", None))


def decode_step(params, token, cache, cfg: ModelConfig):
    """One new token per row, token [B] int32, at each row's next position and the cache's next slot.
    Returns (logits [B, V] fp32 for the token after it, the cache holding it). The caller keeps the
    slot below max_len (shared/decode.py does): a write past the end would be clamped onto the last slot."""
    kernels.check_specs("decode_step: cache", cache, cache_specs(cfg))  # a hand-built cache is named, not failed deep
    dt = jnp.dtype(cfg.compute_dtype)
    x = reshard(params["embed"], P(None, None)).at[token[:, None]].get(out_sharding=acts(None)).astype(dt)
    angles = rope_angles(cache["pos"][:, None], cfg.head_dim, cfg.rope_theta)
    slots, slot = jnp.arange(cache["k"].shape[2]), cache["slot"]
    visible = (slots[None, :] >= (slot - cache["pos"])[:, None]) & (
        slots[None, :] <= slot
    )  # the row's tokens, and this one

    def step(x, layer_and_kv):
        layer, kv = layer_and_kv
        return block(x, layer, angles, None, cfg, cache=kv | {"slot": slot, "visible": visible})

    x, kv = jax.lax.scan(step, x, (params["layers"], {"k": cache["k"], "v": cache["v"]}))
    h = rms_norm(x[:, 0], params["final_norm"], cfg.norm_eps)
    logits = jnp.einsum("bd,dv->bv", h, unembedding(params, cfg), preferred_element_type=jnp.float32)
    return logits, kv | {"pos": cache["pos"] + 1, "slot": slot + 1}
