"""Hybrid sliding-window / global attention decoder (Gemma-2/3 style) on the dense blocks.

Local layers attend to the previous `window` tokens (themselves included); layer i
(0-based) is global, attending to the whole causal prefix, iff (i+1) % global_every == 0
or it is the last layer. The per-layer pattern is data (a bool per layer) scanned along
with the stacked parameters; `jax.lax.cond` picks the local or the global attention
inside the scan, so the layers still compile once.

Parameters are a plain dict of arrays; `param_specs` gives a PartitionSpec for every leaf
on a mesh with explicit axes `data` (FSDP: weights sharded, gathered at use; batch
sharded), `context` (each row's sequence split: shared/kernels/context.py) and `model`
(tensor parallelism: heads and FFN width sharded). Layers are
stacked on a leading axis and run with `jax.lax.scan`.

Copied from variants/dense (RMSNorm, RoPE, grouped-query attention, SwiGLU, optional tied
embeddings, z-loss, bfloat16 compute, remat policy); this variant adds:
  - sliding-window local layers and periodic global layers (`window`, `global_every`), each
    kind with its own attention backend (`local_attention_backend`, `attention_backend`), so a
    backend that cannot run windows can still run the global layers; the config refuses a
    named backend that cannot compute its layers' attention;
  - separate RoPE bases for local and global layers, or no RoPE on global layers
    (`local_rope_theta`, `global_rope` = "rope" | "none", `global_rope_theta`);
  - QK-norm (`qk_norm`): RMSNorm over head_dim of q and k, learned per-head_dim scales;
  - attention-logit soft-capping (`attn_softcap`, 0 = off): logits = c * tanh(logits / c);
  - a per-head output gate (`head_gate`): head h's output times 2 * sigmoid(g_h), g_h a
    learned scalar initialised at 0, so the gate starts as the identity. Weight decay
    pulls g_h back to 0, i.e. towards the identity, never towards shutting a head off.

Decoding (`init_cache`, `prefill`, `decode_step`; shared/decode.py drives them) keeps every
layer's keys and values in a cache, so each new token costs one position, not the whole row. A
global layer keeps every slot; a local layer only its last `window` ones, in a ring (slot s at
s % window): its memory stops growing past the window.
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
from shared.weights import Weight, normal, ones, zeros

COPIED_FROM = "variants/dense"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 2048
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    d_ff: int = 384  # SwiGLU hidden width
    window: int = 64  # local layers see the `window` most recent tokens, themselves included
    global_every: int = 4  # layer i is global iff (i+1) % global_every == 0, and the last layer is
    local_rope_theta: float = 10000.0
    global_rope: str = "rope"  # "rope" | "none" (NoPE on global layers)
    global_rope_theta: float = 10000.0  # used when global_rope == "rope"
    qk_norm: bool = True  # RMSNorm over head_dim on q and k (learned scales), before RoPE
    attn_softcap: float = 0.0  # logits = c * tanh(logits / c); 0 = off (cuDNN cannot: reference then)
    head_gate: bool = True  # head output *= 2 * sigmoid(g_h), g_h initialised at 0 (identity)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    z_loss: float = 0.0  # weight of mean(logsumexp^2); 1e-4 is typical when used
    init_std: float = 0.02
    param_dtype: str = "float32"
    compute_dtype: str = "float32"  # "bfloat16" on accelerators
    remat: str = "dots"  # "none" | "dots" (save weight matmul outputs) | "full"
    attention_backend: str = "auto"  # global layers, and local ones too unless local_attention_backend is set
    local_attention_backend: str = ""  # sliding-window layers; "" = attention_backend (see shared/kernels/attention.py)

    def __post_init__(self):
        check_types(self, "model.")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
            check(getattr(self, name) > 0, f"model.{name}", f"must be positive, got {getattr(self, name)}")
        check(
            self.n_heads % self.n_kv_heads == 0,
            "model.n_heads",
            f"{self.n_heads} is not a multiple of model.n_kv_heads={self.n_kv_heads}",
        )
        check(self.head_dim % 2 == 0, "model.head_dim", f"RoPE needs an even head_dim, got {self.head_dim}")
        for name in ("param_dtype", "compute_dtype"):
            check(
                getattr(self, name) in ("float32", "bfloat16"),
                f"model.{name}",
                f"must be float32 or bfloat16, got {getattr(self, name)!r}",
            )
        check(self.remat in ("none", "dots", "full"), "model.remat", f"must be none, dots or full, got {self.remat!r}")
        check(self.z_loss >= 0, "model.z_loss", f"must be >= 0, got {self.z_loss}")
        check(self.init_std > 0, "model.init_std", f"must be positive, got {self.init_std}")
        check(self.window > 0, "model.window", f"must be positive, got {self.window}")
        check(self.global_every > 0, "model.global_every", f"must be positive, got {self.global_every}")
        check(
            self.global_rope in ("rope", "none"), "model.global_rope", f"must be rope or none, got {self.global_rope!r}"
        )
        for name in ("local_rope_theta", "global_rope_theta"):
            check(getattr(self, name) > 0, f"model.{name}", f"must be positive, got {getattr(self, name)}")
        check(self.attn_softcap >= 0, "model.attn_softcap", f"must be >= 0 (0 = off), got {self.attn_softcap}")
        check(0 < self.norm_eps < 1, "model.norm_eps", f"must be in (0, 1), got {self.norm_eps}")
        # A named backend that cannot compute a layer's attention is refused here, before tracing
        # (whether it is available on this machine is checked when the layer is traced).
        why = kernels.refusal("attention", self.attention_backend, attention_call(self, None))
        check(why is None, "model.attention_backend", f"{self.attention_backend!r} cannot run the global layers: {why}")
        local, inherited = local_backend(self), "" if self.local_attention_backend else " (from attention_backend)"
        why = kernels.refusal("attention", local, attention_call(self, self.window))
        check(
            why is None,
            "model.local_attention_backend",
            f"{local!r}{inherited} cannot run the sliding-window layers: {why}",
        )


def global_layers(cfg: ModelConfig) -> list[bool]:
    """Per layer: True for a global layer, False for a sliding-window one."""
    L = cfg.n_layers
    return [(i + 1) % cfg.global_every == 0 or i == L - 1 for i in range(L)]


def local_backend(cfg: ModelConfig) -> str:
    """The attention backend of the sliding-window layers: local_attention_backend, or attention_backend."""
    return cfg.local_attention_backend or cfg.attention_backend


def attention_call(cfg: ModelConfig, window: int | None) -> kernels.AttentionCall:
    """A layer's attention call as far as the config knows it, to check a named backend before tracing:
    a row of 2 * window tokens (longer than the window) without documents. The row length, the
    documents and the sharding are checked again when the layer is traced."""
    T = 2 * cfg.window
    return kernels.AttentionCall(
        (1, T, cfg.n_heads, cfg.head_dim),
        (1, T, cfg.n_kv_heads, cfg.head_dim),
        jnp.dtype(cfg.compute_dtype),
        True,
        window,
        False,
        cfg.attn_softcap,
    )


# ---------------------------------------------------------------- parameters


def weights(cfg: ModelConfig) -> dict:
    """Every weight, declared once: shape, PartitionSpec, role, init, and for matrices the fan-in and
    fan-out axes (shared/weights.py; the leading layer axis is a batch axis). `data` shards the
    d_model side (FSDP), `model` the width side. Matrices Normal(0, init_std), the projections back
    into the residual scaled by 1/sqrt(2 n_layers); norms start at 1, head gates at 0."""
    D, L, F, V = cfg.d_model, cfg.n_layers, cfg.d_ff, cfg.vocab_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    col, row, rep = P(None, "data", "model"), P(None, "model", "data"), P(None, None)
    std, out_std = normal(cfg.init_std), normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
    decl = {
        "embed": Weight((V, D), P("model", "data"), "embedding", std, fan_in=0, fan_out=1),
        "layers": {
            "attn_norm": Weight((L, D), rep, "norm", ones),
            "wq": Weight((L, D, q), col, "matrix", std, fan_in=1, fan_out=2),
            "wk": Weight((L, D, kv), col, "matrix", std, fan_in=1, fan_out=2),
            "wv": Weight((L, D, kv), col, "matrix", std, fan_in=1, fan_out=2),
            "wo": Weight((L, q, D), row, "matrix", out_std, fan_in=1, fan_out=2),
            "mlp_norm": Weight((L, D), rep, "norm", ones),
            "w_gate": Weight((L, D, F), col, "matrix", std, fan_in=1, fan_out=2),
            "w_up": Weight((L, D, F), col, "matrix", std, fan_in=1, fan_out=2),
            "w_down": Weight((L, F, D), row, "matrix", out_std, fan_in=1, fan_out=2),
        },
        "final_norm": Weight((D,), P(None), "norm", ones),
    }
    if cfg.qk_norm:
        decl["layers"] |= {
            "q_norm": Weight((L, cfg.head_dim), rep, "norm", ones),
            "k_norm": Weight((L, cfg.head_dim), rep, "norm", ones),
        }
    if cfg.head_gate:  # heads, as in wq's columns; 2 * sigmoid(0) = 1: the gate starts as the identity
        decl["layers"]["head_gate"] = Weight((L, cfg.n_heads), P(None, "model"), "gain", zeros)
    if not cfg.tie_embeddings:
        decl["unembed"] = Weight((D, V), P("data", "model"), "unembedding", std, fan_in=0, fan_out=1)
    return decl


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
    return (("n_kv_heads", cfg.n_kv_heads), ("d_ff", cfg.d_ff), ("vocab_size", cfg.vocab_size))


def context_refusal(cfg: ModelConfig, seq_len: int, n: int) -> str | None:
    """Why rows of `seq_len` tokens cannot be split over `n` devices of the `context` mesh axis for this model,
    or None (shared/kernels/context.py's rules): a window's halo comes from the previous device alone, with the
    backend of either layer kind."""
    for backend in (cfg.attention_backend, cfg.local_attention_backend or "auto"):
        why = context.refusal(seq_len, n, window=cfg.window, backend=backend)
        if why:
            return why
    return None


def num_params(cfg: ModelConfig) -> int:
    return sum(math.prod(s) for s in jax.tree.leaves(param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple)))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: every weight matmul (the embedding lookup is not one) plus causal attention,
    local layers counted at their window (min(t+1, window) keys for query t)."""
    D, F, L = cfg.d_model, cfg.d_ff, cfg.n_layers
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = D * q + 2 * D * kv + q * D + 3 * D * F
    matmuls = L * per_layer + D * cfg.vocab_size  # + unembedding
    attn = sum(
        flops.attention_flops_per_token(seq_len, cfg.n_heads, cfg.head_dim, window=None if g else cfg.window)
        for g in global_layers(cfg)
    )
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


def layer_angles(pos, cfg: ModelConfig) -> dict:
    """The RoPE tables of the local and the global layers, made once per forward pass."""
    return {
        "local": rope_angles(pos, cfg.head_dim, cfg.local_rope_theta),
        "global": rope_angles(pos, cfg.head_dim, cfg.global_rope_theta),
    }


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


def attend(q, k, v, angles, segment_ids, is_global, cfg: ModelConfig):
    """Attention of one layer: the sliding-window branch or the global one, chosen by data.
    Returns (output, the keys after the layer's RoPE).

    Both branches are traced (each with a static window for the kernel); `lax.cond` runs one.
    """

    def local(q, k, v):
        q, k = rope(q, angles["local"]), rope(k, angles["local"])
        return context.attention(
            q,
            k,
            v,
            segment_ids=segment_ids,
            causal=True,
            window=cfg.window,
            softcap=cfg.attn_softcap,
            backend=local_backend(cfg),
        ), k

    def global_(q, k, v):
        if cfg.global_rope == "rope":
            q, k = rope(q, angles["global"]), rope(k, angles["global"])
        return context.attention(
            q,
            k,
            v,
            segment_ids=segment_ids,
            causal=True,
            window=None,
            softcap=cfg.attn_softcap,
            backend=cfg.attention_backend,
        ), k

    return jax.lax.cond(is_global, global_, local, q, k, v)


def block(x, layer, angles, segment_ids, is_global, cfg: ModelConfig, cache=None):
    """One layer. Returns (x, {"k", "v"}): this layer's keys (after RoPE) and values [B, T, Hkv, hd], which
    prefill stores. With `cache` (decode_step: this layer's cached {"k", "v"} [B, S, Hkv, hd] with the
    step's "slot" and "visible"; `is_global` a Python bool then), the new keys and values are written at
    `slot` and the queries attend to the cache instead (`attend_cache`); the cache's updated {"k", "v"}
    come back then. A local layer's cache is its ring of the last `window` slots."""
    dt = x.dtype
    B, T, _ = x.shape
    col, row, heads = P(None, "model"), P("model", None), acts("model", None)

    with jax.named_scope("attention"):
        h = rms_norm(x, layer["attn_norm"], cfg.norm_eps)
        q = jnp.einsum("btd,dq->btq", h, gather(layer["wq"], col, dt)).reshape(
            B, T, cfg.n_heads, cfg.head_dim, out_sharding=heads
        )
        k = jnp.einsum("btd,dk->btk", h, gather(layer["wk"], col, dt)).reshape(
            B, T, cfg.n_kv_heads, cfg.head_dim, out_sharding=heads
        )
        v = jnp.einsum("btd,dk->btk", h, gather(layer["wv"], col, dt)).reshape(
            B, T, cfg.n_kv_heads, cfg.head_dim, out_sharding=heads
        )
        if cfg.qk_norm:  # per-head RMSNorm over head_dim, one learned scale vector per layer
            q, k = rms_norm(q, layer["q_norm"], cfg.norm_eps), rms_norm(k, layer["k_norm"], cfg.norm_eps)
        if cache is None:
            o, k = attend(q, k, v, angles, segment_ids, is_global, cfg)
            kv = {"k": k, "v": v}
        else:
            rotary = "global" if is_global else "local"
            if rotary == "local" or cfg.global_rope == "rope":
                q, k = rope(q, angles[rotary]), rope(k, angles[rotary])
            kv = {
                n: jax.lax.dynamic_update_slice_in_dim(cache[n], new, cache["slot"], axis=1)
                for n, new in (("k", k), ("v", v))
            }
            o = attend_cache(q, kv["k"], kv["v"], cache["visible"], cfg.attn_softcap)
        if cfg.head_gate:
            o = o * (2 * jax.nn.sigmoid(layer["head_gate"].astype(jnp.float32))).astype(dt)[:, None]
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


REMAT = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def hidden_states(params, tokens, cfg: ModelConfig, *, segment_ids=None, cache=None):
    """Final-norm hidden states [B, T, D] in the compute dtype. With `cache` (prefill: an empty one from
    init_cache), also that cache holding every layer's keys and values (`store_prompt`)."""
    dt = jnp.dtype(cfg.compute_dtype)
    x = reshard(params["embed"], P(None, None)).at[tokens].get(out_sharding=acts(None)).astype(dt)
    pos = positions(context.whole_row(tokens), None if segment_ids is None else context.whole_row(segment_ids))
    angles = layer_angles(reshard(pos, acts()), cfg)

    def step(x, layer_and_kind):
        layer, is_global = layer_and_kind
        with jax.named_scope("layer"):  # profiles read layer/attention, layer/mlp (tools/bench/profile_top.py)
            x, kv = block(x, layer, angles, segment_ids, is_global, cfg)
            return x, (kv if cache is not None else None)

    if cfg.remat != "none":
        step = jax.checkpoint(step, policy=REMAT[cfg.remat])
    kinds = jnp.asarray(global_layers(cfg))  # the layer pattern, scanned alongside the weights
    x, kv = jax.lax.scan(step, x, (params["layers"], kinds))
    h = rms_norm(x, params["final_norm"], cfg.norm_eps)
    if cache is None:
        return h
    return h, store_prompt(cache, kv, cfg)


def unembedding(params, cfg: ModelConfig):
    w = params["embed"].T if cfg.tie_embeddings else params["unembed"]
    return reshard(w, P(None, "model")).astype(jnp.dtype(cfg.compute_dtype))


def forward(params, tokens, cfg: ModelConfig, *, segment_ids=None):
    """Logits [B, T, V] in fp32. Training uses `loss_fn`, which never holds all of them at once."""
    h = hidden_states(params, tokens, cfg, segment_ids=segment_ids)
    return jnp.einsum("btd,dv->btv", h, unembedding(params, cfg), preferred_element_type=jnp.float32)


def loss_fn(params, batch, cfg: ModelConfig):
    """Mean next-token cross-entropy over unmasked tokens (+ z-loss). Returns (loss, metrics)."""
    h = hidden_states(params, batch["tokens"], cfg, segment_ids=batch["segment_ids"])
    with jax.named_scope("loss"):
        nll, zsq = kernels.cross_entropy(h, unembedding(params, cfg), batch["targets"], batch["loss_mask"])
    n = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
    ce, z = nll / n, zsq / n
    loss = ce + cfg.z_loss * z if cfg.z_loss else ce
    return loss, {"loss": ce, "z": z, "tokens": n}


# ---------------------------------------------------------------- decoding with a cache


def cache_specs(cfg: ModelConfig) -> dict:
    """PartitionSpec of every leaf of `init_cache`: rows over `data`, heads over `model`, as in training."""
    kv = P(None, "data", None, "model", None)
    return {"global": {"k": kv, "v": kv}, "local": {"k": kv, "v": kv}, "pos": P("data"), "slot": P()}


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> dict:
    """An empty cache for `batch` rows of up to `max_len` slots (a prompt's left padding, the prompt and
    the new tokens; the same slots in every row):
      global.k, .v  [global layers, batch, max_len, n_kv_heads, head_dim] keys (after RoPE) and values;
      local.k, .v   [local layers, batch, R, n_kv_heads, head_dim], R = min(window, max_len): a ring,
                    slot s at s % R, holding the last R slots (all a local layer sees);
      pos           [batch] int32 each row's next position (the tokens it holds, padding not counted);
      slot          [] int32 the slot the next token is written to (prompts are left-padded: one for all rows).
    Memory grows linearly with max_len in the global layers only."""
    specs, dt = cache_specs(cfg), jnp.dtype(cfg.compute_dtype)
    n_global = sum(global_layers(cfg))
    sizes = {"global": (n_global, max_len), "local": (cfg.n_layers - n_global, min(cfg.window, max_len))}
    cache = {
        kind: {
            n: jnp.zeros((L, batch, S, cfg.n_kv_heads, cfg.head_dim), dt, out_sharding=specs[kind][n])
            for n in ("k", "v")
        }
        for kind, (L, S) in sizes.items()
    }
    return cache | {"pos": jnp.zeros((batch,), jnp.int32, out_sharding=specs["pos"]), "slot": jnp.zeros((), jnp.int32)}


def store_prompt(cache, kv, cfg: ModelConfig) -> dict:
    """Every layer's prompt keys and values kv [n_layers, B, T, ...] into an empty cache: a global layer's
    in slots [0, T), a local layer's last R slots in its ring (slot s at s % R)."""
    T = kv["k"].shape[2]
    kinds = global_layers(cfg)
    out = dict(cache)
    for kind, is_global in (("global", True), ("local", False)):
        layers = [i for i, g in enumerate(kinds) if g == is_global]
        if not layers:
            continue
        R = cache[kind]["k"].shape[2]
        for n in ("k", "v"):
            x = jnp.stack([kv[n][i] for i in layers])  # [layers of this kind, B, T, ...]
            if T > R:  # a local ring shorter than the prompt: its last R slots, slot s at s % R
                x = jnp.roll(x[:, :, T - R :], (T - R) % R, axis=2)
            else:
                x = jax.lax.dynamic_update_slice_in_dim(cache[kind][n], x, 0, axis=2)
            out[kind] = out[kind] | {n: x}
    return out


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


def attend_cache(q, k, v, visible, softcap: float):
    """Attention of new queries q [B, T, H, hd] to the cache's keys and values [B, S, Hkv, hd] (each kv
    head serves H / Hkv query heads), key slot s seen by row b where visible[b, s]; logits soft-capped
    as in training, fp32 softmax. Plain JAX, not shared/kernels: a decoding step has one query a row,
    and the whole cache (a local layer's ring: its window) is read once."""
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(B, T, Hkv, H // Hkv, D, out_sharding=acts("model", None, None))
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * D**-0.5
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    logits = jnp.where(visible[:, None, None, None, :], logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    return o.reshape(B, T, H, D, out_sharding=acts("model", None))


def decode_step(params, token, cache, cfg: ModelConfig):
    """One new token per row, token [B] int32, at each row's next position and the cache's next slot.
    Returns (logits [B, V] fp32 for the token after it, the cache holding it). The caller keeps the
    slot below max_len (shared/decode.py does): a write past the end would be clamped onto the last slot.

    The layers run one after the other (a Python loop: a local and a global layer have caches of
    different lengths, so they do not stack into one scan)."""
    kernels.check_specs("decode_step: cache", cache, cache_specs(cfg))  # a hand-built cache is named, not failed deep
    dt = jnp.dtype(cfg.compute_dtype)
    x = reshard(params["embed"], P(None, None)).at[token[:, None]].get(out_sharding=acts(None)).astype(dt)
    angles = layer_angles(cache["pos"][:, None], cfg)
    slot, first = cache["slot"], cache["slot"] - cache["pos"]  # first: each row's first slot (its prompt's start)
    s, R = jnp.arange(cache["global"]["k"].shape[2]), cache["local"]["k"].shape[2]
    held = slot - (slot - jnp.arange(R)) % R  # the slot ring entry j holds once this token is written
    at = {
        "global": {"slot": slot, "visible": (s[None, :] >= first[:, None]) & (s[None, :] <= slot)},
        "local": {"slot": slot % R, "visible": held[None, :] >= first[:, None]},
    }
    new = {"global": [], "local": []}
    for i, is_global in enumerate(global_layers(cfg)):
        kind = "global" if is_global else "local"
        layer = jax.tree.map(lambda w: w[i], params["layers"])
        kv = {n: cache[kind][n][len(new[kind])] for n in ("k", "v")}
        x, kv = block(x, layer, angles, None, is_global, cfg, cache=kv | at[kind])
        new[kind].append(kv)
    h = rms_norm(x[:, 0], params["final_norm"], cfg.norm_eps)
    logits = jnp.einsum("bd,dv->bv", h, unembedding(params, cfg), preferred_element_type=jnp.float32)
    stacked = {
        kind: {n: jnp.stack([kv[n] for kv in kvs]) for n in ("k", "v")} if kvs else cache[kind]
        for kind, kvs in new.items()
    }
    return logits, stacked | {"pos": cache["pos"] + 1, "slot": slot + 1}
