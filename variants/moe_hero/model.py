"""Mixture-of-experts decoder (DeepSeek-V3 style routing) on the swa_hybrid attention pattern.

Copied from variants/swa_hybrid (sliding-window local layers and periodic global layers,
each kind with its own attention backend, separate RoPE bases, QK-norm, soft-capping, head gate, GQA, RMSNorm, z-loss, bf16 compute);
this variant changes the feed-forward and the sharding:
  - MoE feed-forward: `n_experts` routed SwiGLU experts of width `d_expert`, `top_k` of them
    per token, plus `n_shared` always-on shared experts (one SwiGLU of width
    n_shared * d_expert); the first `n_dense_layers` layers keep a dense SwiGLU (`d_ff`).
    Dense and MoE layers are two stacks (`dense_layers`, `moe_layers`), each scanned with
    its per-layer local/global flags;
  - router: sigmoid scores in fp32; the top-k choice uses scores + a per-expert bias
    (`router_bias`, no gradient; train.py moves it toward balance after every step), the
    combine weights use the unbiased scores renormalised over the chosen k, times
    `routed_scale`. Optional router z-loss and sequence-level balance loss;
  - dispatch (`dispatch`): "dropless" sorts the token-expert assignments by expert and runs
    the experts as grouped matmuls, then scatter-adds back; "capacity" gives each expert
    `capacity_factor * assignments / n_experts` slots per device, drops the overflow and
    counts it;
  - grouped matmul (`expert_matmul`, dropless mode): "ragged" is `jax.lax.ragged_dot`;
    "tiled" pads each expert's rows up to a multiple of a tile (`expert_tile`: 256 rows at
    the CPU default) and runs one batched matmul over the tiles, each tile with its expert's
    weights. XLA:CPU runs ragged_dot as a dense matmul of every row with every local expert
    (n_experts times the active FLOPs), so "auto" picks tiled on CPU (measured faster:
    README "On CPU") and ragged on GPU/TPU. `expert_flops_ratio` gives what the chosen path
    executes relative to the active FLOPs;
  - expert parallelism: a third mesh axis `expert`. Rows of the batch are sharded over
    ("data", "expert") jointly; expert weights over `expert` on their expert axis (FSDP over
    `data`, TP over `model` inside); every other weight is FSDP-sharded over ("data",
    "expert"). The routed experts run inside `jax.shard_map`, tokens exchanged with
    all-to-all over `expert` (ragged all-to-all, or a fixed-capacity one: `a2a`);
  - remat "moe": save the weight matmuls and the expert-side tensors (`moe_in`, `moe_out`),
    so the backward pass does not repeat the all-to-alls;
  - `flops_per_token` counts active parameters only (top-k routed + shared + router);
  - decoding (`init_cache`, `prefill`, `decode_step`) as swa_hybrid's (global layers keep every
    slot, local ones a ring of `window`), with the experts always dropless: see `prefill`.

Parameters are a plain dict of arrays; `param_specs` gives a PartitionSpec for every leaf.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from jax.sharding import reshard

from shared import flops, kernels
from shared import weights as weights_lib
from shared.config import ConfigError, check, check_types  # noqa: F401  (model.ConfigError, model.check)
from shared.kernels import context
from shared.weights import Weight, normal, ones, zeros

COPIED_FROM = "variants/swa_hybrid"

BATCH = ("data", "expert")  # rows of the batch (and FSDP shards) live on both axes
RAGGED_ALL_TO_ALL = jax.lax.ragged_all_to_all  # module-level so a test can emulate it on CPU


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 2048
    d_model: int = 128
    n_layers: int = 4  # all layers, the dense first ones included
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    d_ff: int = 384  # SwiGLU width of the first n_dense_layers layers
    n_dense_layers: int = 1  # the first layers keep a dense SwiGLU; the rest are MoE
    n_experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # routed experts per token
    n_shared: int = 1  # always-on shared experts (0 = none)
    d_expert: int = 96  # SwiGLU width of one expert (routed or shared)
    routed_scale: float = 1.0  # combine weights = renormalised top-k scores * routed_scale
    router_z_loss: float = 0.0  # weight of mean(logsumexp(router logits)^2) over the loss tokens
    balance_loss: float = 0.0  # weight of the sequence-level balance loss (DeepSeek-V3 uses 1e-4)
    dispatch: str = "dropless"  # "dropless" | "capacity"
    capacity_factor: float = 1.25  # capacity mode: slots per expert = ceil(cf * assignments / n_experts)
    a2a: str = "auto"  # "auto" | "ragged" | "dense": the token exchange over `expert` (dropless mode)
    expert_matmul: str = "auto"  # "auto" | "ragged" | "tiled": the grouped matmul (dropless mode); auto = tiled on CPU
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
    z_loss: float = 0.0  # weight of mean(logsumexp^2) of the output logits
    init_std: float = 0.02
    param_dtype: str = "float32"
    compute_dtype: str = "float32"  # "bfloat16" on accelerators
    remat: str = "dots"  # "none" | "dots" | "full" | "moe" (dots + the expert-side tensors)
    attention_backend: str = "auto"  # global layers, and local ones too unless local_attention_backend is set
    local_attention_backend: str = ""  # sliding-window layers; "" = attention_backend (see shared/kernels/attention.py)

    def __post_init__(self):
        check_types(self, "model.")
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "d_ff",
            "n_experts",
            "top_k",
            "d_expert",
        ):
            check(getattr(self, name) > 0, f"model.{name}", f"must be positive, got {getattr(self, name)}")
        check(
            self.n_heads % self.n_kv_heads == 0,
            "model.n_heads",
            f"{self.n_heads} is not a multiple of model.n_kv_heads={self.n_kv_heads}",
        )
        check(self.head_dim % 2 == 0, "model.head_dim", f"RoPE needs an even head_dim, got {self.head_dim}")
        check(
            0 <= self.n_dense_layers < self.n_layers,
            "model.n_dense_layers",
            f"{self.n_dense_layers} must be in [0, n_layers={self.n_layers}): at least one MoE layer",
        )
        check(self.top_k <= self.n_experts, "model.top_k", f"{self.top_k} > n_experts={self.n_experts}")
        check(self.n_shared >= 0, "model.n_shared", f"must be >= 0, got {self.n_shared}")
        check(self.routed_scale > 0, "model.routed_scale", f"must be positive, got {self.routed_scale}")
        for name in ("router_z_loss", "balance_loss", "z_loss"):
            check(getattr(self, name) >= 0, f"model.{name}", f"must be >= 0, got {getattr(self, name)}")
        check(
            self.dispatch in ("dropless", "capacity"),
            "model.dispatch",
            f"must be dropless or capacity, got {self.dispatch!r}",
        )
        check(self.capacity_factor > 0, "model.capacity_factor", f"must be positive, got {self.capacity_factor}")
        check(self.a2a in ("auto", "ragged", "dense"), "model.a2a", f"must be auto, ragged or dense, got {self.a2a!r}")
        check(
            self.expert_matmul in ("auto", "ragged", "tiled"),
            "model.expert_matmul",
            f"must be auto, ragged or tiled, got {self.expert_matmul!r}",
        )
        for name in ("param_dtype", "compute_dtype"):
            check(
                getattr(self, name) in ("float32", "bfloat16"),
                f"model.{name}",
                f"must be float32 or bfloat16, got {getattr(self, name)!r}",
            )
        check(self.remat in REMAT, "model.remat", f"must be one of {sorted(REMAT)}, got {self.remat!r}")
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

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers


def global_layers(cfg: ModelConfig) -> list[bool]:
    """Per layer (dense ones first): True for a global layer, False for a sliding-window one."""
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


def capacity(cfg: ModelConfig, tokens_per_device: int) -> int:
    """Capacity mode: slots per expert on one device, for its `tokens_per_device` tokens."""
    return max(1, math.ceil(cfg.capacity_factor * tokens_per_device * cfg.top_k / cfg.n_experts))


MAX_TILE, MIN_TILE = 256, 32  # rows per tile of the "tiled" grouped matmul (measured on CPU: README "On CPU")


def expert_matmul(cfg: ModelConfig, platform: str) -> str:
    """The grouped matmul dropless mode runs on `platform` (jax.default_backend()): "ragged" or "tiled"."""
    if cfg.expert_matmul != "auto":
        return cfg.expert_matmul
    return "ragged" if platform in ("gpu", "tpu") else "tiled"


def expert_tile(rows: int, n_local: int) -> int:
    """Rows per tile for `rows` rows in `n_local` groups: MAX_TILE, halved while the padding it can
    add (n_local tiles) is over a quarter of the rows, down to MIN_TILE (smaller tiles ran slower)."""
    tile = MAX_TILE
    while tile > MIN_TILE and 4 * n_local * tile > rows:
        tile //= 2
    return tile


def n_tiles(rows: int, n_local: int, tile: int) -> int:
    """Tiles of the tiled grouped matmul: the most that `rows` rows in `n_local` groups, each padded
    up to a multiple of `tile`, can need (sum of ceil(group / tile) <= (rows + n_local * (tile - 1)) // tile)."""
    return (rows + n_local * (tile - 1)) // tile


def expert_flops_ratio(cfg: ModelConfig, tokens_per_device: int, platform: str, *, ep: int = 1) -> float:
    """FLOPs the routed-expert matmuls execute on one device / their active FLOPs, for the path
    `platform` picks (`ep` = mesh_expert). 1.0 = no wasted work.

    Active: the device's A = tokens_per_device * top_k assignments (tokens it routes in one
    forward pass: micro-batch rows per device x seq_len), each through one expert's SwiGLU;
    this is what flops_per_token counts. Executed: rows x experts the three expert matmuls run
    (all the same shape per row, and the backward pass repeats the forward's shapes, so the
    ratio holds for fwd+bwd). The grouped matmul gets R = A rows at ep = 1, and the exchange's
    worst-case receive buffer of R = ep * A rows (A real ones on average) at ep > 1:
      dropless, ragged on gpu/tpu: 1.0 (the grouped kernel runs the groups' rows only: assumed,
        as the GPU/TPU path is unverified);
      dropless, ragged elsewhere: R * E_local / A = n_experts (XLA:CPU's ragged_dot is a dense
        matmul of every row with every local expert, masked);
      dropless, tiled: tile * n_tiles / A, the static worst-case tile bound (each expert's
        rows padded up to a multiple of the tile, plus the exchange's padding rows);
      capacity: E_local * ep * slots / A (every slot runs, empty or not).
    Shared experts and the router are not counted (they execute exactly their active FLOPs).
    """
    A = tokens_per_device * cfg.top_k
    El = cfg.n_experts // ep
    if cfg.dispatch == "capacity":
        return El * ep * capacity(cfg, tokens_per_device) / A
    R = ep * A
    if expert_matmul(cfg, platform) == "tiled":
        m = expert_tile(R, El)
        return m * n_tiles(R, El, m) / A
    return 1.0 if platform in ("gpu", "tpu") else R * El / A


# ---------------------------------------------------------------- parameters


def _attn_weights(cfg: ModelConfig, L: int) -> dict:
    D, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    col, row, rep = P(None, BATCH, "model"), P(None, "model", BATCH), P(None, None)
    std, out_std = normal(cfg.init_std), normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
    w = {
        "attn_norm": Weight((L, D), rep, "norm", ones),
        "wq": Weight((L, D, q), col, "matrix", std, fan_in=1, fan_out=2),
        "wk": Weight((L, D, kv), col, "matrix", std, fan_in=1, fan_out=2),
        "wv": Weight((L, D, kv), col, "matrix", std, fan_in=1, fan_out=2),
        "wo": Weight((L, q, D), row, "matrix", out_std, fan_in=1, fan_out=2),
        "mlp_norm": Weight((L, D), rep, "norm", ones),
    }
    if cfg.qk_norm:
        w |= {
            "q_norm": Weight((L, cfg.head_dim), rep, "norm", ones),
            "k_norm": Weight((L, cfg.head_dim), rep, "norm", ones),
        }
    if cfg.head_gate:  # heads, as in wq's columns; 2 * sigmoid(0) = 1: the gate starts as the identity
        w["head_gate"] = Weight((L, cfg.n_heads), P(None, "model"), "gain", zeros)
    return w


def weights(cfg: ModelConfig) -> dict:
    """Every weight, declared once: shape, PartitionSpec, role, init, and for matrices the fan-in and
    fan-out axes (shared/weights.py; layer and expert axes are batch axes). FSDP over ("data",
    "expert") on the d_model side of every non-expert weight; experts over `expert` (then FSDP over
    `data`); `model` the width side. Matrices Normal(0, init_std), output projections scaled by
    1/sqrt(2 n_layers), unit norms, zero gates; the router bias (role `buffer`: the optimizer leaves
    it alone, train.py's balance_bias moves it) zero and fp32 always."""
    D, V, E, Fe = cfg.d_model, cfg.vocab_size, cfg.n_experts, cfg.d_expert
    Ld, Lm = cfg.n_dense_layers, cfg.n_moe_layers
    col, row = P(None, BATCH, "model"), P(None, "model", BATCH)
    std, out_std = normal(cfg.init_std), normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
    ex_col, ex_row = P(None, "expert", "data", "model"), P(None, "expert", "model", "data")
    moe = _attn_weights(cfg, Lm) | {
        "router": Weight((Lm, D, E), P(None, BATCH, None), "router", std, fan_in=1, fan_out=2),
        "router_bias": Weight((Lm, E), P(None, None), "buffer", zeros, dtype="float32"),
        "ex_gate": Weight((Lm, E, D, Fe), ex_col, "expert_matrix", std, fan_in=2, fan_out=3),
        "ex_up": Weight((Lm, E, D, Fe), ex_col, "expert_matrix", std, fan_in=2, fan_out=3),
        "ex_down": Weight((Lm, E, Fe, D), ex_row, "expert_matrix", out_std, fan_in=2, fan_out=3),
    }
    if cfg.n_shared:
        S = cfg.n_shared * Fe
        moe |= {
            "sh_gate": Weight((Lm, D, S), col, "matrix", std, fan_in=1, fan_out=2),
            "sh_up": Weight((Lm, D, S), col, "matrix", std, fan_in=1, fan_out=2),
            "sh_down": Weight((Lm, S, D), row, "matrix", out_std, fan_in=1, fan_out=2),
        }
    decl = {
        "embed": Weight((V, D), P("model", BATCH), "embedding", std, fan_in=0, fan_out=1),
        "moe_layers": moe,
        "final_norm": Weight((D,), P(None), "norm", ones),
    }
    if Ld:
        F = cfg.d_ff
        decl["dense_layers"] = _attn_weights(cfg, Ld) | {
            "w_gate": Weight((Ld, D, F), col, "matrix", std, fan_in=1, fan_out=2),
            "w_up": Weight((Ld, D, F), col, "matrix", std, fan_in=1, fan_out=2),
            "w_down": Weight((Ld, F, D), row, "matrix", out_std, fan_in=1, fan_out=2),
        }
    if not cfg.tie_embeddings:
        decl["unembed"] = Weight((D, V), P(BATCH, "model"), "unembedding", std, fan_in=0, fan_out=1)
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
    return (
        ("n_kv_heads", cfg.n_kv_heads),
        ("d_ff", cfg.d_ff),
        ("vocab_size", cfg.vocab_size),
        ("d_expert", cfg.d_expert),
    )


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


def _matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights one token multiplies with: attention, dense FFNs, top-k routed + shared experts, router, unembed."""
    D, E, Fe = cfg.d_model, cfg.n_experts, cfg.d_expert
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attn = D * q + 2 * D * kv + q * D
    dense = cfg.n_dense_layers * (attn + 3 * D * cfg.d_ff)
    moe = cfg.n_moe_layers * (attn + D * E + (cfg.top_k + cfg.n_shared) * 3 * D * Fe)
    return dense + moe + D * cfg.vocab_size


def num_active_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies with (top_k routed + shared experts, router, attention, dense
    FFNs, unembedding); the embedding lookup and the norms are not counted."""
    return _matmul_params_per_token(cfg)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, by active parameters: attention projections, the dense FFNs,
    the top_k routed and the shared experts, the router and the unembedding (not the
    n_experts - top_k idle experts, nor padding slots or the grouped matmul's fallback work:
    `expert_flops_ratio` gives those as a factor on the routed experts' FLOPs),
    plus causal attention with local layers at their window."""
    attn = sum(
        flops.attention_flops_per_token(seq_len, cfg.n_heads, cfg.head_dim, window=None if g else cfg.window)
        for g in global_layers(cfg)
    )
    return flops.matmul_flops_per_token(_matmul_params_per_token(cfg)) + attn


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
    """PartitionSpec of activations [B, T, ...]: rows over BATCH, the sequence over `context` (where the
    mesh has that axis; shared/kernels/context.py), then `rest`."""
    return P(BATCH, context.axis(), *rest)


def gather(w, spec, dtype):
    """FSDP: all-gather a weight (keep its `model` / `expert` sharding) and cast for compute."""
    return reshard(w, spec).astype(dtype)


def attend(q, k, v, angles, segment_ids, is_global, cfg: ModelConfig):
    """Attention of one layer: the sliding-window branch or the global one, chosen by data.
    Returns (output, the keys after the layer's RoPE)."""

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


@jax.named_scope(
    "attention"
)  # profiles read moe_layer/attention, moe_layer/moe/experts, ... (tools/bench/profile_top.py)
def attention(x, layer, angles, segment_ids, is_global, cfg: ModelConfig, cache=None):
    """(x + the attention sub-block's output, {"k", "v"}: this layer's keys (after RoPE) and values
    [B, T, Hkv, hd], which prefill stores). With `cache` (decode_step: this layer's cached {"k", "v"}
    [B, S, Hkv, hd] with the step's "slot" and "visible"; `is_global` a Python bool then), the new keys
    and values are written at `slot` and the queries attend to the cache instead (`attend_cache`); the
    cache's updated {"k", "v"} come back then. A local layer's cache is its ring of the last `window` slots."""
    dt = x.dtype
    B, T, _ = x.shape
    col, row, heads = P(None, "model"), P("model", None), acts("model", None)
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
    return x + jnp.einsum("btq,qd->btd", o, gather(layer["wo"], row, dt), out_sharding=acts(None)), kv


@jax.named_scope("mlp")
def swiglu(h, w_gate, w_up, w_down):
    """A dense SwiGLU on [B, T, D] with FSDP-gathered, TP-sharded weights."""
    dt = h.dtype
    col, row = P(None, "model"), P("model", None)
    gate = jnp.einsum("btd,df->btf", h, gather(w_gate, col, dt))
    up = jnp.einsum("btd,df->btf", h, gather(w_up, col, dt))
    return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, gather(w_down, row, dt), out_sharding=acts(None))


# ---------------------------------------------------------------- routing and dispatch (per device)


@jax.named_scope("route")
def route(x, w_router, bias, cfg: ModelConfig):
    """x [N, D] -> (expert ids [N, k], combine weights [N, k], logits [N, E], scores [N, E]), fp32.

    The bias only changes which experts are chosen; the weights are the chosen experts'
    unbiased sigmoid scores, renormalised over the k of them, times routed_scale.
    """
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), w_router.astype(jnp.float32))
    scores = jax.nn.sigmoid(logits)
    _, idx = jax.lax.top_k(scores + jax.lax.stop_gradient(bias.astype(jnp.float32)), cfg.top_k)
    chosen = jnp.take_along_axis(scores, idx, axis=-1)
    weights = chosen / jnp.sum(chosen, axis=-1, keepdims=True) * cfg.routed_scale
    return idx, weights, logits, scores


def _experts_grouped(x, group_sizes, wg, wu, wd, *, matmul):
    """Rows of x sorted by local expert (group_sizes rows each; any rows after them are padding,
    their outputs zero). matmul: "ragged" (jax.lax.ragged_dot) or "tiled" (_experts_tiled)."""
    if matmul == "tiled":
        return _experts_tiled(x, group_sizes, wg, wu, wd, tile=expert_tile(x.shape[0], group_sizes.shape[0]))
    g = jax.lax.ragged_dot(x, wg, group_sizes)
    u = jax.lax.ragged_dot(x, wu, group_sizes)
    return jax.lax.ragged_dot(jax.nn.silu(g) * u, wd, group_sizes)


def _experts_tiled(x, group_sizes, wg, wu, wd, *, tile):
    """_experts_grouped as a batched matmul over tiles of `tile` rows: each expert's rows are
    padded up to a multiple of the tile, every tile is multiplied by its expert's weights, and
    the rows are put back. Static shapes: n_tiles(R, E_local, tile) tiles, the unused ones last."""
    R, D = x.shape
    El = group_sizes.shape[0]
    T = n_tiles(R, El, tile)
    row_end = jnp.cumsum(group_sizes)
    tiles = (group_sizes + tile - 1) // tile  # per expert
    tile_end = jnp.cumsum(tiles)
    r = jnp.arange(R, dtype=row_end.dtype)
    e = jnp.searchsorted(row_end, r, side="right")  # expert of each row; El for the padding rows
    ec = jnp.minimum(e, El - 1)
    slot = (tile_end - tiles)[ec] * tile + r - (row_end - group_sizes)[ec]  # its row in the tiles
    slot = jnp.where(e < El, slot, T * tile + r)  # out of range (and unique): padding rows are not placed
    xt = jnp.zeros((T * tile, D), x.dtype).at[slot].set(x, mode="drop", unique_indices=True).reshape(T, tile, D)
    te = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(T, dtype=tile_end.dtype), side="right"), El - 1)
    g = jnp.einsum("tmd,tdf->tmf", xt, wg[te])  # te: expert of each tile (unused tiles: any, on zeros)
    u = jnp.einsum("tmd,tdf->tmf", xt, wu[te])
    y = jnp.einsum("tmf,tfd->tmd", jax.nn.silu(g) * u, wd[te]).reshape(T * tile, D)
    return y.at[slot].get(mode="fill", fill_value=0)


def _experts_batched(x, wg, wu, wd):
    """x [E_local, slots, D]: every expert on its own fixed number of slots."""
    g = jnp.einsum("esd,edf->esf", x, wg)
    u = jnp.einsum("esd,edf->esf", x, wu)
    return jnp.einsum("esf,efd->esd", jax.nn.silu(g) * u, wd)


def _a2a(x, ep):
    """All-to-all over `expert` on the leading axis (ep equal chunks, chunk i to peer i)."""
    return jax.lax.all_to_all(x, "expert", 0, 0, tiled=True) if ep > 1 else x


def _receiver_experts(recv, rc, src_off, wg, wu, wd, *, matmul):
    """Run the local experts on rows received from every source.

    recv [M, D]: from source s, starting at row src_off[s], rc[s, 0] rows for local expert 0,
    then rc[s, 1] rows for expert 1, ...; the other rows are padding. Rows are regrouped by
    local expert for the grouped matmul and the outputs put back in the received order.
    """
    M = recv.shape[0]
    ep, El = rc.shape
    starts = (src_off[:, None] + jnp.cumsum(rc, axis=1) - rc).reshape(-1)  # [ep * El], non-decreasing
    ends = starts + rc.reshape(-1)
    r = jnp.arange(M, dtype=starts.dtype)
    g = jnp.searchsorted(ends, r, side="right")  # first (source, expert) group ending after row r
    gc = jnp.minimum(g, ep * El - 1)
    e_loc = jnp.where((g < ep * El) & (r >= starts[gc]), gc % El, El)  # El = padding, sorted last
    perm = jnp.argsort(e_loc, stable=True)
    x = checkpoint_name(recv[perm], "moe_in")
    y = _experts_grouped(x, jnp.sum(rc, axis=0), wg, wu, wd, matmul=matmul)
    inv = jnp.zeros((M,), jnp.int32).at[perm].set(jnp.arange(M, dtype=jnp.int32))
    return y[inv]


@jax.named_scope("experts")
def _dropless(xs, e_sorted, counts, wg, wu, wd, *, ep, a2a, matmul):
    """Expert outputs [A, D] for the assignments xs [A, D], sorted by expert; nothing dropped."""
    A, D = xs.shape
    E = counts.shape[0]
    El = E // ep
    if ep == 1:
        return _experts_grouped(checkpoint_name(xs, "moe_in"), counts, wg, wu, wd, matmul=matmul)
    pc = jnp.sum(counts.reshape(ep, El), axis=1)  # assignments this device sends to each peer
    pstart = jnp.cumsum(pc) - pc  # where each peer's rows start in xs (sorted by expert)
    rc = _a2a(counts.reshape(ep, El), ep)  # [source, local expert]: rows each source sends here
    if a2a == "ragged":  # send exactly the rows; receive into a buffer sized for the worst case
        allc = jax.lax.all_gather(pc, "expert")  # [source, destination]
        me = jax.lax.axis_index("expert")
        recv_sizes = allc[:, me]
        recv_off = jnp.cumsum(recv_sizes) - recv_sizes  # received rows are packed by source
        out_off = (jnp.cumsum(allc, axis=0) - allc)[me]  # where my rows land in each peer's buffer
        recv = RAGGED_ALL_TO_ALL(
            xs, jnp.zeros((ep * A, D), xs.dtype), pstart, pc, out_off, recv_sizes, axis_name="expert"
        )
        y = _receiver_experts(recv, rc, recv_off, wg, wu, wd, matmul=matmul)
        back_off = _a2a(pstart, ep)  # source s's pstart[me]: where its rows sit in its own xs
        return checkpoint_name(
            RAGGED_ALL_TO_ALL(y, jnp.zeros_like(xs), recv_off, recv_sizes, back_off, pc, axis_name="expert"), "moe_out"
        )
    # fixed capacity: A rows per peer (the worst case, so nothing can overflow)
    peer = e_sorted // El
    slot = peer * A + jnp.arange(A) - pstart[peer]
    buf = jnp.zeros((ep * A, D), xs.dtype).at[slot].set(xs, unique_indices=True)
    recv = _a2a(buf, ep)  # [source-major blocks of A rows]
    y = _receiver_experts(recv, rc, jnp.arange(ep, dtype=rc.dtype) * A, wg, wu, wd, matmul=matmul)
    return checkpoint_name(_a2a(y, ep), "moe_out")[slot]


@jax.named_scope("experts")
def _capacity(xs, e_sorted, counts, wg, wu, wd, *, ep, slots):
    """Capacity mode: each expert takes its first `slots` assignments of this device (token
    order); the rest are dropped. Returns (outputs [A, D], zero where dropped; kept [A])."""
    A, D = xs.shape
    E = counts.shape[0]
    El = E // ep
    estart = jnp.cumsum(counts) - counts
    pos = jnp.arange(A) - estart[e_sorted]
    kept = pos < slots
    slot = jnp.where(kept, e_sorted * slots + pos, E * slots)  # out of range = dropped
    buf = jnp.zeros((E * slots, D), xs.dtype).at[slot].set(xs, mode="drop", unique_indices=True)
    recv = _a2a(buf, ep).reshape(ep, El, slots, D)  # [source, local expert, slot]
    x = checkpoint_name(jnp.swapaxes(recv, 0, 1).reshape(El, ep * slots, D), "moe_in")
    y = _experts_batched(x, wg, wu, wd).reshape(El, ep, slots, D)
    y = checkpoint_name(_a2a(jnp.swapaxes(y, 0, 1).reshape(E * slots, D), ep), "moe_out")
    return jnp.where(kept[:, None], y[jnp.minimum(slot, E * slots - 1)], 0), kept


def _moe_local(x, weight, w_router, bias, wg, wu, wd, *, cfg: ModelConfig, ep: int, a2a: str, matmul: str):
    """The routed experts on one device's tokens x [B_l, T, D] (inside shard_map); weight [B_l, T]
    (the loss mask) says which tokens the router z-loss and the balance loss count.

    Returns (output [B_l, T, D], stats): stats are summed over the data and expert axes.
    """
    B, T, D = x.shape
    N, k, E = B * T, cfg.top_k, cfg.n_experts
    A = N * k
    xt = x.reshape(N, D)
    idx, w, logits, scores = route(xt, w_router, bias, cfg)
    flat = idx.reshape(A)
    with jax.named_scope("dispatch"):
        counts = jnp.zeros((E,), jnp.int32).at[flat].add(1)
        order = jnp.argsort(flat, stable=True)  # assignments sorted by expert, token order within one
        e_sorted, tok = flat[order], order // k
        xs = xt[tok]
    if cfg.dispatch == "dropless":
        y = _dropless(xs, e_sorted, counts, wg, wu, wd, ep=ep, a2a=a2a, matmul=matmul)
        dropped = jnp.zeros((), jnp.int32)
    else:
        y, kept = _capacity(xs, e_sorted, counts, wg, wu, wd, ep=ep, slots=capacity(cfg, N))
        dropped = A - jnp.sum(kept.astype(jnp.int32))
    with jax.named_scope("combine"):
        out = jnp.zeros((N, D), jnp.float32).at[tok].add(y.astype(jnp.float32) * w.reshape(A)[order][:, None])
        out = jax.lax.psum(out, "model").astype(x.dtype)  # the experts' width is sharded over `model`

    # sequence-level balance loss (DeepSeek-V3): sum_i f_i P_i per row over the row's loss tokens
    # (T_r of them), f from the choice, P from the scores; summed as T_r * that, so that loss_fn's
    # division by the loss-token count gives the token-weighted mean over rows (exact under accumulation)
    # (a row split over `context`: its per-row sums are added over `context` first, so every device of the row
    # holds the row's balance term; it is then summed over the row axes only, token sums over all three)
    ctx = (context.AXIS,) if context.axis() else ()
    row_sum = (lambda x: jax.lax.psum(x, ctx)) if ctx else (lambda x: x)  # noqa: E731
    wt = weight.astype(jnp.float32)
    t_r = row_sum(jnp.sum(wt, axis=1))  # [B] loss tokens per row
    rows = jnp.repeat(jnp.arange(B), T * k)
    c = row_sum(jnp.zeros((B, E), jnp.float32).at[rows, flat].add(jnp.repeat(wt.reshape(N), k)))  # masked choices
    s_sum = row_sum(jnp.einsum("bt,bte->be", wt, (scores / jnp.sum(scores, axis=-1, keepdims=True)).reshape(B, T, E)))
    balance = jnp.sum(E / k * jnp.sum(c * s_sum, axis=-1) / jnp.maximum(t_r, 1.0))  # sum_r T_r * sum_i f_i P_i
    router_z = jnp.sum(wt.reshape(N) * jax.nn.logsumexp(logits, axis=-1) ** 2)
    stats = jax.lax.psum({"load": counts, "dropped": dropped, "router_z": router_z}, ("data", "expert") + ctx)
    return out.reshape(B, T, D), stats | {"balance": jax.lax.psum(balance, ("data", "expert"))}


def moe_ffn(h, layer, cfg: ModelConfig, weight=None):
    """Routed experts (shard_map over the whole mesh) + shared experts, on h [B, T, D]; weight
    [B, T] (the loss mask; default all ones) says which tokens router_z and balance count.

    Returns (output, stats) with stats {"load" [E], "dropped", "router_z", "balance"} as global sums.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or set(mesh.axis_names) - {context.AXIS, context.REPLICA} != {"data", "expert", "model"}:
        raise ConfigError(
            "moe_hero runs under a mesh with axes data, expert, model (train.make_mesh); "
            f"got {mesh.axis_names if not mesh.empty else 'no mesh'}"
        )
    dt, ep = h.dtype, mesh.shape["expert"]
    a2a = cfg.a2a if cfg.a2a != "auto" else ("ragged" if jax.default_backend() in ("gpu", "tpu") else "dense")
    matmul = expert_matmul(cfg, jax.default_backend())
    ex, exd = P("expert", None, "model"), P("expert", "model", None)
    weight = reshard(jnp.ones(h.shape[:2], jnp.float32) if weight is None else weight, acts())
    args = (
        h,
        weight,
        reshard(layer["router"], P(None, None)),
        reshard(layer["router_bias"], P(None)),
        gather(layer["ex_gate"], ex, dt),
        gather(layer["ex_up"], ex, dt),
        gather(layer["ex_down"], exd, dt),
    )
    routed, stats = jax.shard_map(
        functools.partial(_moe_local, cfg=cfg, ep=ep, a2a=a2a, matmul=matmul),
        in_specs=(acts(None), acts(), P(None, None), P(None), ex, ex, exd),
        out_specs=(acts(None), P()),
    )(*args)
    if cfg.n_shared:
        routed = routed + swiglu(h, layer["sh_gate"], layer["sh_up"], layer["sh_down"])
    return routed, stats


REMAT = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
    "moe": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("moe_in", "moe_out"),
    ),
}


def hidden_states(params, tokens, cfg: ModelConfig, *, segment_ids=None, loss_mask=None, cache=None):
    """(final-norm hidden states [B, T, D] in the compute dtype, per-MoE-layer stats stacked on axis 0).
    loss_mask [B, T] (default all ones): the tokens the router z-loss and balance loss count. With
    `cache` (prefill: an empty one from init_cache), a third output: that cache holding every layer's
    keys and values (`store_prompt`)."""
    dt = jnp.dtype(cfg.compute_dtype)
    tokens = reshard(tokens, acts())
    if segment_ids is not None:
        segment_ids = reshard(segment_ids, acts())
    x = reshard(params["embed"], P(None, None)).at[tokens].get(out_sharding=acts(None)).astype(dt)
    pos = positions(context.whole_row(tokens), None if segment_ids is None else context.whole_row(segment_ids))
    angles = layer_angles(reshard(pos, acts()), cfg)

    @jax.named_scope("dense_layer")
    def dense_step(x, layer_and_kind):
        layer, is_global = layer_and_kind
        x, kv = attention(x, layer, angles, segment_ids, is_global, cfg)
        h = rms_norm(x, layer["mlp_norm"], cfg.norm_eps)
        return x + swiglu(h, layer["w_gate"], layer["w_up"], layer["w_down"]), (kv if cache is not None else None)

    @jax.named_scope("moe_layer")
    def moe_step(x, layer_and_kind):
        layer, is_global = layer_and_kind
        x, kv = attention(x, layer, angles, segment_ids, is_global, cfg)
        with jax.named_scope("moe"):
            y, stats = moe_ffn(rms_norm(x, layer["mlp_norm"], cfg.norm_eps), layer, cfg, loss_mask)
        return x + y, (stats, kv if cache is not None else None)

    if cfg.remat != "none":
        dense_step = jax.checkpoint(dense_step, policy=REMAT[cfg.remat])
        moe_step = jax.checkpoint(moe_step, policy=REMAT[cfg.remat])
    kinds = jnp.asarray(global_layers(cfg))  # the layer pattern, scanned alongside the weights
    nd = cfg.n_dense_layers
    kv = []  # the dense layers' and the MoE layers' keys and values, each stacked on a leading layer axis
    if nd:
        x, dense_kv = jax.lax.scan(dense_step, x, (params["dense_layers"], kinds[:nd]))
        kv.append(dense_kv)
    x, (stats, moe_kv) = jax.lax.scan(moe_step, x, (params["moe_layers"], kinds[nd:]))
    h = rms_norm(x, params["final_norm"], cfg.norm_eps)
    if cache is None:
        return h, stats
    kv = {n: jnp.concatenate([part[n] for part in kv + [moe_kv]]) for n in ("k", "v")}
    return h, stats, store_prompt(cache, kv, cfg)


def unembedding(params, cfg: ModelConfig):
    w = params["embed"].T if cfg.tie_embeddings else params["unembed"]
    return reshard(w, P(None, "model")).astype(jnp.dtype(cfg.compute_dtype))


def forward(params, tokens, cfg: ModelConfig, *, segment_ids=None):
    """Logits [B, T, V] in fp32. Training uses `loss_fn`, which never holds all of them at once."""
    h, _ = hidden_states(params, tokens, cfg, segment_ids=segment_ids)
    return jnp.einsum("btd,dv->btv", h, unembedding(params, cfg), preferred_element_type=jnp.float32)


def loss_fn(params, batch, cfg: ModelConfig):
    """Mean next-token cross-entropy (+ z-loss, router z-loss, balance loss). Returns (loss, metrics).

    metrics: loss, z, tokens as in dense; load [n_moe_layers, E] (assignments per expert),
    dropped (assignments dropped, all layers), assignments (all layers), router_z (mean over the
    loss tokens and the layers of logsumexp(router logits)^2) and balance (the per-row balance
    loss over each row's loss tokens, averaged over rows weighted by their loss tokens, and layers).
    """
    targets, mask = (reshard(batch[k], acts()) for k in ("targets", "loss_mask"))  # rows as h's
    h, st = hidden_states(params, batch["tokens"], cfg, segment_ids=batch["segment_ids"], loss_mask=mask)
    with jax.named_scope("loss"):
        nll, zsq = kernels.cross_entropy(h, unembedding(params, cfg), targets, mask)
    n = jnp.maximum(jnp.sum(mask), 1.0)
    ce, z = nll / n, zsq / n
    B, T = batch["tokens"].shape
    Lm = cfg.n_moe_layers
    # every term is a sum over this batch's loss tokens divided by their count n, so train.py's
    # token-weighted gradient accumulation equals the large batch (AGENTS.md, "Auxiliary losses")
    router_z = jnp.sum(st["router_z"]) / (n * Lm)
    balance = jnp.sum(st["balance"]) / (n * Lm)
    loss = ce
    if cfg.z_loss:
        loss = loss + cfg.z_loss * z
    if cfg.router_z_loss:
        loss = loss + cfg.router_z_loss * router_z
    if cfg.balance_loss:
        loss = loss + cfg.balance_loss * balance
    return loss, {
        "loss": ce,
        "z": z,
        "tokens": n,
        "load": st["load"].astype(jnp.float32),
        "dropped": jnp.sum(st["dropped"]).astype(jnp.float32),
        "assignments": jnp.float32(B * T * cfg.top_k * Lm),
        "router_z": router_z,
        "balance": balance,
    }


# ---------------------------------------------------------------- decoding with a cache


def cache_specs(cfg: ModelConfig) -> dict:
    """PartitionSpec of every leaf of `init_cache`: rows over ("data", "expert") (BATCH), heads over `model`."""
    kv = P(None, BATCH, None, "model", None)
    return {"global": {"k": kv, "v": kv}, "local": {"k": kv, "v": kv}, "pos": P(BATCH), "slot": P()}


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> dict:
    """An empty cache for `batch` rows of up to `max_len` slots (a prompt's left padding, the prompt and
    the new tokens; the same slots in every row):
      global.k, .v  [global layers, batch, max_len, n_kv_heads, head_dim] keys (after RoPE) and values;
      local.k, .v   [local layers, batch, R, n_kv_heads, head_dim], R = min(window, max_len): a ring,
                    slot s at s % R, holding the last R slots (all a local layer sees);
      pos           [batch] int32 each row's next position (the tokens it holds, padding not counted);
      slot          [] int32 the slot the next token is written to (prompts are left-padded: one for all rows).
    Layers count dense ones first, as global_layers does. Memory grows with max_len in the global layers only."""
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
    the prompt 1), so the prompt's positions start at 0 and nothing of it attends to the padding.

    Routing: every token goes to its top-k experts as in `forward` (the router is per token), and the
    experts run dropless whatever `dispatch` says (here and in decode_step). Under dispatch="capacity",
    `forward` drops the assignments past an expert's slots on a device, and which those are depends
    on the other tokens of the pass on that device (other rows, the padding); generation has no such
    batch, so it drops nothing. It equals `forward` with dispatch="dropless", and `forward` itself
    whenever that drops nothing (train/dropped = 0); variants/moe_hero/test_moe_hero.py checks both."""
    kernels.check_specs("prefill: cache", cache, cache_specs(cfg))  # a hand-built cache is named, not failed deep
    cfg = dataclasses.replace(cfg, dispatch="dropless")
    B, T = tokens.shape
    lengths = jnp.full((B,), T, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    lengths = reshard(lengths, cache_specs(cfg)["pos"])
    segment_ids = (jnp.arange(T)[None, :] >= (T - lengths)[:, None]).astype(jnp.int32)
    h, _, cache = hidden_states(params, tokens, cfg, segment_ids=segment_ids, cache=cache)
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

    The layers run one after the other (a Python loop: local and global caches differ in length, and
    dense and MoE layers in weights); each token is routed as `forward` routes it, dropless (`prefill`)."""
    kernels.check_specs("decode_step: cache", cache, cache_specs(cfg))  # a hand-built cache is named, not failed deep
    cfg = dataclasses.replace(cfg, dispatch="dropless")
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
    nd = cfg.n_dense_layers
    for i, is_global in enumerate(global_layers(cfg)):
        kind = "global" if is_global else "local"
        layer = jax.tree.map(lambda w: w[i if i < nd else i - nd], params["dense_layers" if i < nd else "moe_layers"])
        kv = {n: cache[kind][n][len(new[kind])] for n in ("k", "v")}
        x, kv = attention(x, layer, angles, None, is_global, cfg, cache=kv | at[kind])
        new[kind].append(kv)
        h = rms_norm(x, layer["mlp_norm"], cfg.norm_eps)
        x = x + (swiglu(h, layer["w_gate"], layer["w_up"], layer["w_down"]) if i < nd else moe_ffn(h, layer, cfg)[0])
    h = rms_norm(x[:, 0], params["final_norm"], cfg.norm_eps)
    logits = jnp.einsum("bd,dv->bv", h, unembedding(params, cfg), preferred_element_type=jnp.float32)
    stacked = {
        kind: {n: jnp.stack([kv[n] for kv in kvs]) for n in ("k", "v")} if kvs else cache[kind]
        for kind, kvs in new.items()
    }
    return logits, stacked | {"pos": cache["pos"] + 1, "slot": slot + 1}
