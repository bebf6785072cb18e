"""Kimi Delta Attention (KDA) hybrid decoder (Kimi Linear style) on the dense blocks.

Most layers mix tokens with KDA, a gated delta rule with a per-channel forget gate
(shared/kernels/kda.py), whose state is a fixed [head_dim, head_dim] matrix per head:
time grows linearly in T and no KV cache grows with it. Layer i (0-based) is instead a
full softmax-attention layer (the dense one: GQA, RoPE) iff (i+1) % global_every == 0 or
it is the last layer; global_every = 4 is Kimi Linear's 3:1 ratio.

Parameters are a plain dict of arrays; `param_specs` gives a PartitionSpec for every leaf
on a mesh with explicit axes `data` (FSDP: weights sharded, gathered at use; batch
sharded), `context` (each row's sequence split: shared/kernels/context.py) and `model`
(tensor parallelism: heads and FFN width sharded). The two kinds of
layer have different weights, so they are two stacks, `kda` [n_kda, ...] and `attn`
[n_attn, ...]. They run as `lax.scan` over super-blocks of (global_every - 1) KDA layers
(an inner scan) and one attention layer; when n_layers is not a multiple of
global_every, the remaining n_layers % global_every layers (KDA layers, then the last,
attention, layer) run once more after the scan. No layer holds the other kind's weights.

Copied from variants/dense (RMSNorm, RoPE, grouped-query attention, SwiGLU, optional tied
embeddings, z-loss, bfloat16 compute, remat policy); this variant adds:
  - KDA layers: q, k, v projections (n_heads heads of head_dim; no GQA), each followed by
    a causal depthwise convolution (`conv_size` taps, not crossing document starts) and
    SiLU; q and k L2-normalised (q scaled by head_dim**-0.5 in the kernel); a per-channel
    forget gate g = -exp(A_log) * softplus(x W_down W_up + dt_bias) (low rank
    `gate_rank`); beta = sigmoid(x W_beta); the delta-rule state update, reset at document
    starts; a per-head RMSNorm (`o_norm`) times a sigmoid output gate (low rank
    `gate_rank`), then `wo`. The state math is the chunked kernel (`chunk_size`,
    `kda_impl`: "xla" or the GPU Pallas kernel "pallas");
  - the layer pattern (`global_every`); attention layers are dense's, unchanged.
Widths are dense's: a KDA layer has more weights than an attention layer (k and v have
n_heads heads, plus gates), so at the same shape the model is larger; `num_params` and
`flops_per_token` count it as it is.

Decoding (`init_cache`, `prefill`, `decode_step`; shared/decode.py drives them): a KDA layer
keeps its state [H, head_dim, head_dim] and the last conv_size - 1 inputs of its short
convolutions, whatever the length; an attention layer keeps its keys and values (linear in length).
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
from shared.kernels.kda import kda_flops_per_token, kda_recurrent
from shared.weights import Weight, normal, ones, uniform

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
    rope_theta: float = 10000.0  # RoPE base of the attention layers (KDA layers use no positions)
    global_every: int = 4  # layer i is softmax attention iff (i+1) % global_every == 0, and the last layer is
    conv_size: int = 4  # taps of the causal depthwise convolution on q, k, v (KDA layers)
    gate_rank: int = 32  # rank of the low-rank forget gate and output gate (Kimi Linear: head_dim)
    chunk_size: int = 64  # tokens per chunk of the chunked KDA kernel (a power of two)
    kda_impl: str = "xla"  # "xla" (everywhere) | "pallas" (GPU; UNVERIFIED, see shared/kernels/kda.py)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    z_loss: float = 0.0  # weight of mean(logsumexp^2); 1e-4 is typical when used
    init_std: float = 0.02
    param_dtype: str = "float32"
    compute_dtype: str = "float32"  # "bfloat16" on accelerators
    remat: str = "dots"  # "none" | "dots" (save weight matmul outputs) | "full"
    attention_backend: str = "auto"  # see shared/kernels/attention.py

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
        check(self.rope_theta > 0, "model.rope_theta", f"must be positive, got {self.rope_theta}")
        check(
            self.global_every >= 2,
            "model.global_every",
            f"must be >= 2 (1 makes every layer softmax attention: that is variants/dense), got {self.global_every}",
        )
        check(
            self.n_layers >= 2,
            "model.n_layers",
            f"must be >= 2 (the last layer is attention, and one at least must be KDA), got {self.n_layers}",
        )
        for name in ("conv_size", "gate_rank"):
            check(getattr(self, name) > 0, f"model.{name}", f"must be positive, got {getattr(self, name)}")
        check(
            self.chunk_size > 0 and self.chunk_size & (self.chunk_size - 1) == 0,
            "model.chunk_size",
            f"must be a power of two, got {self.chunk_size}",
        )
        check(self.kda_impl in ("xla", "pallas"), "model.kda_impl", f"must be xla or pallas, got {self.kda_impl!r}")
        if self.kda_impl == "pallas":
            from shared.kernels.kda import pallas_refuses

            why = pallas_refuses(self.head_dim, self.chunk_size)
            check(why is None, "model.kda_impl", f"the Pallas kernel cannot run this shape: {why}")
        check(0 < self.norm_eps < 1, "model.norm_eps", f"must be in (0, 1), got {self.norm_eps}")
        # an unknown backend, or one that cannot compute this model's attention layers, is refused here, before
        # tracing (whether it is available on this machine is checked when the layer is traced)
        call = kernels.AttentionCall(
            (1, 2, self.n_heads, self.head_dim),
            (1, 2, self.n_kv_heads, self.head_dim),
            jnp.dtype(self.compute_dtype),
            True,
            None,
            False,
        )
        why = kernels.refusal("attention", self.attention_backend, call)
        check(why is None, "model.attention_backend", f"{self.attention_backend!r}: {why}")


def attention_layers(cfg: ModelConfig) -> list[bool]:
    """Per layer: True for a softmax-attention layer, False for a KDA layer."""
    L = cfg.n_layers
    return [(i + 1) % cfg.global_every == 0 or i == L - 1 for i in range(L)]


def layer_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(KDA layers, attention layers)."""
    n_attn = sum(attention_layers(cfg))
    return cfg.n_layers - n_attn, n_attn


# ---------------------------------------------------------------- parameters


def a_log_init(key, shape, dtype, spec):
    """A = exp(A_log) ~ U(1, 16) per head (Kimi Linear / fla)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0, out_sharding=spec)).astype(dtype)


def dt_bias_init(key, shape, dtype, spec):
    """The inverse softplus of dt ~ log-uniform(1e-3, 1e-1): softplus(dt_bias) = dt."""
    lo, hi = math.log(1e-3), math.log(1e-1)
    dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, lo, hi, out_sharding=spec))
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def weights(cfg: ModelConfig) -> dict:
    """Every weight, declared once: shape, PartitionSpec, role, init, and for matrices the fan-in and
    fan-out axes (shared/weights.py; the leading layer axis is a batch axis). `data` shards the
    d_model side (FSDP), `model` the width side; a low-rank pair's rank is never sharded.

    Matrices Normal(0, init_std), the projections back into the residual scaled by
    1/sqrt(2 n_layers), unit norms. KDA gates as in Kimi Linear / fla: A = exp(A_log) ~ U(1, 16)
    per head; dt_bias is the inverse softplus of dt ~ log-uniform(1e-3, 1e-1), so at init the
    decay per step is exp(-A dt) in [0.2, 0.999]; convolution taps U(-1/sqrt(conv_size),
    1/sqrt(conv_size)) (PyTorch's Conv1d default). A_log and dt_bias are never decayed (roles
    `rate` and `bias`), as in Kimi Linear.
    """
    D, F, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    H, R, W = cfg.n_heads, cfg.gate_rank, cfg.conv_size
    Lk, La = layer_counts(cfg)
    col, row, rep = P(None, "data", "model"), P(None, "model", "data"), P(None, None)
    heads, down, up = P(None, "model"), P(None, "data", None), P(None, None, "model")  # low rank: rank unsharded
    std, out_std = normal(cfg.init_std), normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
    taps = uniform(-(cfg.conv_size**-0.5), cfg.conv_size**-0.5)

    def mat(shape, spec, init=std):
        return Weight(shape, spec, "matrix", init, fan_in=1, fan_out=2)

    def mlp(L):
        return {
            "mlp_norm": Weight((L, D), rep, "norm", ones),
            "w_gate": mat((L, D, F), col),
            "w_up": mat((L, D, F), col),
            "w_down": mat((L, F, D), row, out_std),
        }

    decl = {
        "embed": Weight((V, D), P("model", "data"), "embedding", std, fan_in=0, fan_out=1),
        "kda": {
            "attn_norm": Weight((Lk, D), rep, "norm", ones),
            "wq": mat((Lk, D, q), col),
            "wk": mat((Lk, D, q), col),
            "wv": mat((Lk, D, q), col),
            "conv_q": Weight((Lk, W, q), up, "conv", taps),
            "conv_k": Weight((Lk, W, q), up, "conv", taps),
            "conv_v": Weight((Lk, W, q), up, "conv", taps),
            "forget_down": mat((Lk, D, R), down),
            "forget_up": mat((Lk, R, q), up),
            "A_log": Weight((Lk, H), heads, "rate", a_log_init),
            "dt_bias": Weight((Lk, q), heads, "bias", dt_bias_init),
            "w_beta": mat((Lk, D, H), col),
            "ogate_down": mat((Lk, D, R), down),
            "ogate_up": mat((Lk, R, q), up),
            "o_norm": Weight((Lk, cfg.head_dim), rep, "norm", ones),
            "wo": mat((Lk, q, D), row, out_std),
            **mlp(Lk),
        },
        "attn": {
            "attn_norm": Weight((La, D), rep, "norm", ones),
            "wq": mat((La, D, q), col),
            "wk": mat((La, D, kv), col),
            "wv": mat((La, D, kv), col),
            "wo": mat((La, q, D), row, out_std),
            **mlp(La),
        },
        "final_norm": Weight((D,), P(None), "norm", ones),
    }
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
    or None (shared/kernels/context.py's rules): each device's slice is whole KDA chunks, and only the XLA
    chunked recurrence folds the state across devices."""
    why = context.refusal(seq_len, n, chunk=cfg.chunk_size, backend=cfg.attention_backend)
    if why is None and n > 1 and cfg.kda_impl != "xla":
        why = f"model.kda_impl {cfg.kda_impl!r} cannot run under context parallelism (mesh_context={n}): use 'xla'"
    return why


def num_params(cfg: ModelConfig) -> int:
    return sum(math.prod(s) for s in jax.tree.leaves(param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple)))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: every weight matmul (the embedding lookup is not one) plus causal attention
    on attention layers, and on KDA layers their projections, gates and convolution taps (each weight used
    once per token) plus the chunked kernel's matmuls as it computes them (`kda_flops_per_token`)."""
    D, F, H, R = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.gate_rank
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    Lk, La = layer_counts(cfg)
    mlp = 3 * D * F
    attn_layer = D * q + 2 * D * kv + q * D + mlp
    kda_layer = 3 * D * q + 3 * cfg.conv_size * q + (D * R + R * q) * 2 + D * H + q * D + mlp
    matmuls = La * attn_layer + Lk * kda_layer + D * cfg.vocab_size  # + unembedding
    attn = La * flops.attention_flops_per_token(seq_len, cfg.n_heads, cfg.head_dim)
    mix = Lk * kda_flops_per_token(seq_len, H, cfg.head_dim, cfg.head_dim, cfg.chunk_size)
    return flops.matmul_flops_per_token(matmuls) + attn + mix


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


def documents(segment_ids, B, T):
    """Document index of every token (0, 1, ...: +1 where the segment id changes); zeros without ids."""
    if segment_ids is None:
        return jnp.zeros((B, T), jnp.int32)
    change = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros_like(change[:, :1]), jnp.cumsum(change, axis=1)], axis=1)


def short_conv(x, w, docs):
    """Causal depthwise convolution over time: out_t = sum_j w[W-1-j] x_{t-j}, only over x of t's own document.

    x [B, T, C], w [W, C] (the last tap weighs the current token), docs [B, T]
    (shared/kernels/conv.py: XLA, or a Triton kernel on GPU).
    """
    return context.short_conv(x, w, docs)


def l2_norm(x, eps=1e-6):
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


def mlp(x, layer, cfg: ModelConfig):
    dt = x.dtype
    col, row = P(None, "model"), P("model", None)
    with jax.named_scope("mlp"):
        h = rms_norm(x, layer["mlp_norm"], cfg.norm_eps)
        gate = jnp.einsum("btd,df->btf", h, gather(layer["w_gate"], col, dt))
        up = jnp.einsum("btd,df->btf", h, gather(layer["w_up"], col, dt))
        return x + jnp.einsum(
            "btf,fd->btd", jax.nn.silu(gate) * up, gather(layer["w_down"], row, dt), out_sharding=acts(None)
        )


def kda_block(x, layer, docs, segment_ids, cfg: ModelConfig, cache=None):
    """A KDA layer (token mixing by the gated delta rule) and its MLP. Returns (x, what decoding goes on
    from: "state" [B, H, K, K] fp32 after the last token, and "conv_q", "conv_k", "conv_v"
    [B, conv_size - 1, H * K], the short convolutions' last inputs, zero before the last document's
    start), which prefill stores. With `cache` (decode_step: those of this layer, for one token a row),
    the convolutions run over the cached inputs and the new one, the state takes one step of the rule
    (`kda_recurrent`, the reference: one token needs no chunks), and the new cache comes back."""
    dt = x.dtype
    B, T, _ = x.shape
    H, K = cfg.n_heads, cfg.head_dim
    col, row, heads = P(None, "model"), P("model", None), acts("model", None)
    f32 = jnp.float32
    new = {}

    with jax.named_scope("kda"):
        h = rms_norm(x, layer["attn_norm"], cfg.norm_eps)

        def proj_conv(name):  # projection, short convolution, SiLU, split into heads
            y = jnp.einsum("btd,dq->btq", h, gather(layer["w" + name], col, dt))
            w = gather(layer["conv_" + name], col, dt)
            if cache is None:
                n = cfg.conv_size - 1  # the inputs a next token's convolution reads: the last document's
                if context.axis() is None:  # (prefill; under context parallelism only training runs)
                    tail = jnp.where((docs == docs[:, -1:])[..., None], y, 0)[:, max(T - n, 0) :]
                    new["conv_" + name] = jnp.pad(tail, ((0, 0), (n - tail.shape[1], 0), (0, 0)))
                y = short_conv(y, w, docs)
            else:
                y = jnp.concatenate([cache["conv_" + name], y], axis=1)  # [B, conv_size, H * K]
                new["conv_" + name] = y[:, 1:]
                y = short_conv(y, w, None)[:, -1:]
            return jax.nn.silu(y).reshape(B, T, H, K, out_sharding=heads)

        q, k, v = l2_norm(proj_conv("q")), l2_norm(proj_conv("k")), proj_conv("v")

        def low_rank(down, up):  # x W_down W_up: [B, T, H, K] in fp32
            r = jnp.einsum("btd,dr->btr", h, gather(layer[down], P(None, None), dt))
            y = jnp.einsum("btr,rq->btq", r, gather(layer[up], col, dt))
            return y.reshape(B, T, H, K, out_sharding=heads).astype(f32)

        dt_bias = gather(layer["dt_bias"], P("model"), f32).reshape(H, K, out_sharding=P("model", None))
        A = jnp.exp(gather(layer["A_log"], P("model"), f32))[:, None]  # [H, 1]
        g = -A * jax.nn.softplus(low_rank("forget_down", "forget_up") + dt_bias)  # log decay per key channel, <= 0
        beta = jax.nn.sigmoid(jnp.einsum("btd,dh->bth", h, gather(layer["w_beta"], col, dt)).astype(f32))
        if cache is None:
            o, new["state"] = context.kda(
                q, k, v, g, beta, segment_ids=segment_ids, chunk_size=cfg.chunk_size, impl=cfg.kda_impl
            )
        else:
            o, new["state"] = kda_recurrent(q, k, v, g, beta, initial_state=cache["state"])
        o = rms_norm(o, layer["o_norm"], cfg.norm_eps) * jax.nn.sigmoid(low_rank("ogate_down", "ogate_up")).astype(dt)
        o = o.reshape(B, T, H * K, out_sharding=acts("model"))
        x = x + jnp.einsum("btq,qd->btd", o, gather(layer["wo"], row, dt), out_sharding=acts(None))
    return mlp(x, layer, cfg), new


def block(x, layer, angles, segment_ids, cfg: ModelConfig, cache=None):
    """A softmax-attention layer (dense's) and its MLP. Returns (x, {"k", "v"}): this layer's keys (after
    RoPE) and values [B, T, Hkv, hd], which prefill stores. With `cache` (decode_step: this layer's cached
    {"k", "v"} [B, S, Hkv, hd] with the step's "slot" and "visible"), the new keys and values are written
    at `slot` and the queries attend to the cache instead (`attend_cache`); the updated {"k", "v"} come back."""
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
    return mlp(x, layer, cfg), kv


REMAT = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def hidden_states(params, tokens, cfg: ModelConfig, *, segment_ids=None, cache=None):
    """Final-norm hidden states [B, T, D] in the compute dtype. With `cache` (prefill: an empty one from
    init_cache), also that cache holding every layer's state (`store_prompt`)."""
    dt = jnp.dtype(cfg.compute_dtype)
    x = reshard(params["embed"], P(None, None)).at[tokens].get(out_sharding=acts(None)).astype(dt)
    pos = positions(context.whole_row(tokens), None if segment_ids is None else context.whole_row(segment_ids))
    angles = rope_angles(reshard(pos, acts()), cfg.head_dim, cfg.rope_theta)
    docs = reshard(documents(None if segment_ids is None else context.whole_row(segment_ids), *tokens.shape), acts())

    def kda_step(x, layer):
        with jax.named_scope("kda_layer"):
            x, state = kda_block(x, layer, docs, segment_ids, cfg)
            return x, (state if cache is not None else None)

    def attn_step(x, layer):
        with jax.named_scope(
            "attention_layer"
        ):  # profiles read attention_layer/attention, kda_layer/kda, ... (tools/bench/profile_top.py)
            x, kv = block(x, layer, angles, segment_ids, cfg)
            return x, (kv if cache is not None else None)

    if cfg.remat != "none":
        kda_step = jax.checkpoint(kda_step, policy=REMAT[cfg.remat])
        attn_step = jax.checkpoint(attn_step, policy=REMAT[cfg.remat])

    def super_block(x, layers):  # KDA layers (an inner scan), then one attention layer
        kda_layers, attn_layer = layers
        x, states = jax.lax.scan(kda_step, x, kda_layers)
        x, kv = attn_step(x, attn_layer)
        return x, (states, kv)

    N, L = cfg.global_every, cfg.n_layers
    full, tail = L // N, L % N  # `full` super-blocks of N layers; then `tail` layers (tail - 1 KDA, 1 attention)
    take = lambda tree, a, b: jax.tree.map(lambda w: w[a:b], tree)  # noqa: E731 leading (layer) axis
    parts = []  # (KDA layers' states, attention layers' kv), each stacked on a leading layer axis
    if full:
        kda_full = jax.tree.map(lambda w: split_layers(w, full, N - 1), take(params["kda"], 0, full * (N - 1)))
        x, (states, kv) = jax.lax.scan(super_block, x, (kda_full, take(params["attn"], 0, full)))
        parts.append((jax.tree.map(merge_layers, states), kv))
    if tail:
        x, (states, kv) = super_block(
            x, (take(params["kda"], full * (N - 1), None), jax.tree.map(lambda w: w[full], params["attn"]))
        )
        parts.append((states, jax.tree.map(lambda a: a[None], kv)))
    h = rms_norm(x, params["final_norm"], cfg.norm_eps)
    if cache is None:
        return h
    return h, store_prompt(cache, parts)


def split_layers(w, n, m):
    """[n * m, ...] -> [n, m, ...], keeping the sharding of the other axes."""
    spec = tuple(jax.typeof(w).sharding.spec) if not jax.sharding.get_abstract_mesh().empty else None
    if spec is None:
        return w.reshape(n, m, *w.shape[1:])
    spec = spec + (None,) * (w.ndim - len(spec))
    return w.reshape(n, m, *w.shape[1:], out_sharding=P(None, None, *spec[1:]))


def merge_layers(w):
    """[n, m, ...] -> [n * m, ...], keeping the sharding of the other axes (split_layers' inverse)."""
    spec = tuple(jax.typeof(w).sharding.spec) if not jax.sharding.get_abstract_mesh().empty else None
    if spec is None:
        return w.reshape(-1, *w.shape[2:])
    spec = spec + (None,) * (w.ndim - len(spec))
    return w.reshape(-1, *w.shape[2:], out_sharding=P(None, *spec[2:]))


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
    """PartitionSpec of every leaf of `init_cache`: rows over `data`, heads (and their channels) over `model`."""
    kv, conv = P(None, "data", None, "model", None), P(None, "data", None, "model")
    return {
        "kda": {"state": P(None, "data", "model", None, None), "conv_q": conv, "conv_k": conv, "conv_v": conv},
        "attn": {"k": kv, "v": kv},
        "pos": P("data"),
        "slot": P(),
    }


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> dict:
    """An empty cache for `batch` rows of up to `max_len` slots (a prompt's left padding, the prompt and
    the new tokens; the same slots in every row):
      kda.state           [KDA layers, batch, n_heads, head_dim, head_dim] fp32, the delta rule's state;
      kda.conv_q, _k, _v  [KDA layers, batch, conv_size - 1, n_heads * head_dim] the convolutions' last inputs;
      attn.k, .v          [attention layers, batch, max_len, n_kv_heads, head_dim] keys (after RoPE), values;
      pos                 [batch] int32 each row's next position (the tokens it holds, padding not counted);
      slot                [] int32 the slot the next token is written to (one for all rows: prompts are left-padded).
    Only the attention layers' memory grows with max_len."""
    specs, dt = cache_specs(cfg), jnp.dtype(cfg.compute_dtype)
    Lk, La = layer_counts(cfg)
    H, K = cfg.n_heads, cfg.head_dim
    conv = lambda n: jnp.zeros((Lk, batch, cfg.conv_size - 1, H * K), dt, out_sharding=specs["kda"][n])  # noqa: E731
    kv = lambda n: jnp.zeros((La, batch, max_len, cfg.n_kv_heads, K), dt, out_sharding=specs["attn"][n])  # noqa: E731
    return {
        "kda": {
            "state": jnp.zeros((Lk, batch, H, K, K), jnp.float32, out_sharding=specs["kda"]["state"]),
            **{n: conv(n) for n in ("conv_q", "conv_k", "conv_v")},
        },
        "attn": {n: kv(n) for n in ("k", "v")},
        "pos": jnp.zeros((batch,), jnp.int32, out_sharding=specs["pos"]),
        "slot": jnp.zeros((), jnp.int32),
    }


def store_prompt(cache, parts) -> dict:
    """The layers' states after the prompt, parts = [(KDA layers' states, attention layers' kv)] in layer
    order, into an empty cache: KDA states and convolution inputs as they are, keys and values in slots [0, T)."""
    kda_states = {n: jnp.concatenate([p[0][n] for p in parts]) for n in cache["kda"]}
    attn = {
        n: jax.lax.dynamic_update_slice_in_dim(cache["attn"][n], jnp.concatenate([p[1][n] for p in parts]), 0, axis=2)
        for n in ("k", "v")
    }
    return cache | {"kda": kda_states, "attn": attn}


def prefill(params, tokens, cache, cfg: ModelConfig, *, lengths=None):
    """Run the prompts and fill an empty cache. tokens [B, T]: row b's prompt is its last lengths[b]
    tokens (left-padded; what the padding holds does not matter); lengths [B] (default: all T).
    Returns (logits [B, V] fp32 for each row's next token, the cache at slot T).

    The rows run as `forward` runs a packed row: the padding is a document of its own (segment id 0,
    the prompt 1), so the prompt's positions start at 0, nothing of it attends to the padding, and
    the KDA state and the convolutions start afresh at the prompt (the chunked kernel, as in training)."""
    kernels.check_specs("prefill: cache", cache, cache_specs(cfg))  # a hand-built cache is named, not failed deep
    B, T = tokens.shape
    lengths = jnp.full((B,), T, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    lengths = reshard(lengths, cache_specs(cfg)["pos"])
    segment_ids = (jnp.arange(T)[None, :] >= (T - lengths)[:, None]).astype(jnp.int32)
    h, cache = hidden_states(params, tokens, cfg, segment_ids=segment_ids, cache=cache)
    logits = jnp.einsum("bd,dv->bv", h[:, -1], unembedding(params, cfg), preferred_element_type=jnp.float32)
    return logits, cache | {"pos": lengths, "slot": jnp.int32(T)}


def attend_cache(q, k, v, visible):
    """Attention of new queries q [B, T, H, hd] to the cache's keys and values [B, S, Hkv, hd] (each kv
    head serves H / Hkv query heads), key slot s seen by row b where visible[b, s]; fp32 softmax. Plain
    JAX, not shared/kernels: a decoding step has one query a row, and the whole cache is read once."""
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(B, T, Hkv, H // Hkv, D, out_sharding=acts("model", None, None))
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * D**-0.5
    logits = jnp.where(visible[:, None, None, None, :], logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    return o.reshape(B, T, H, D, out_sharding=acts("model", None))


def decode_step(params, token, cache, cfg: ModelConfig):
    """One new token per row, token [B] int32, at each row's next position and the cache's next slot.
    Returns (logits [B, V] fp32 for the token after it, the cache holding it). The caller keeps the
    slot below max_len (shared/decode.py does): a write past the end would be clamped onto the last slot.

    The layers run one after the other in their order (a Python loop over the two stacks)."""
    kernels.check_specs("decode_step: cache", cache, cache_specs(cfg))  # a hand-built cache is named, not failed deep
    dt = jnp.dtype(cfg.compute_dtype)
    x = reshard(params["embed"], P(None, None)).at[token[:, None]].get(out_sharding=acts(None)).astype(dt)
    angles = rope_angles(cache["pos"][:, None], cfg.head_dim, cfg.rope_theta)
    slots, slot = jnp.arange(cache["attn"]["k"].shape[2]), cache["slot"]
    visible = (slots[None, :] >= (slot - cache["pos"])[:, None]) & (
        slots[None, :] <= slot
    )  # the row's tokens, and this one
    new = {"kda": [], "attn": []}
    for is_attn in attention_layers(cfg):
        kind = "attn" if is_attn else "kda"
        i = len(new[kind])
        layer = jax.tree.map(lambda w: w[i], params[kind])
        mine = {n: c[i] for n, c in cache[kind].items()}
        if is_attn:
            x, mine = block(x, layer, angles, None, cfg, cache=mine | {"slot": slot, "visible": visible})
        else:
            x, mine = kda_block(x, layer, None, None, cfg, cache=mine)
        new[kind].append(mine)
    h = rms_norm(x[:, 0], params["final_norm"], cfg.norm_eps)
    logits = jnp.einsum("bd,dv->bv", h, unembedding(params, cfg), preferred_element_type=jnp.float32)
    stacked = {kind: {n: jnp.stack([m[n] for m in ms]) for n in cache[kind]} for kind, ms in new.items()}
    return logits, stacked | {"pos": cache["pos"] + 1, "slot": slot + 1}
