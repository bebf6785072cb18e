"""variants/swa_hybrid: locality of local vs global layers (with every backend that can run
each kind here), the blockwise windowed reference attention against the dense masked one,
soft-capping, sharding, and the variant's options (a backend each for local and global layers).

The contract (tests/contract/test_contract.py) already checks causality and document isolation, but
at T=32 < window=64; here they are checked again with a window shorter than the row.
"""

import dataclasses
import functools
import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shared import flops, kernels
from shared.modelio.hf import HFError
from shared.variant import load

from decode_check import decode_against_forward  # noqa: E402  (tests/decode_check.py)

HERE = os.path.dirname(os.path.abspath(__file__))  # this folder: a copy's tests test the copy

LONG = pytest.mark.integration  # a slow case of a parametrized check (the other cases stay in the fast tier)

A = importlib.import_module("shared.kernels.attention")  # the module, not the function
model = load(os.path.join(HERE, "model.py"))


def mesh42():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def small(**over):
    kw = dict(
        vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, window=4, global_every=2
    )
    kw.update(over)
    return model.ModelConfig(**kw)


def qkv(rng, B, T, H, Hkv, D, dtype=jnp.float32):
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in [(B, T, H, D), (B, T, Hkv, D), (B, T, Hkv, D)])


def packed_segments(rng, B, T):
    return jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32)


# ---------------------------------------------------------------- the layer pattern and config


def test_global_layer_pattern():
    assert model.global_layers(small(n_layers=6, global_every=4)) == [False, False, False, True, False, True]
    assert model.global_layers(small(n_layers=4, global_every=1)) == [True] * 4
    assert model.global_layers(small(n_layers=3, global_every=10)) == [False, False, True]


@pytest.mark.parametrize(
    "field,value",
    [
        ("window", 0),
        ("global_every", 0),
        ("global_rope", "alibi"),
        ("attn_softcap", -1.0),
        ("global_rope_theta", 0.0),
        ("attention_backend", "nope"),
        ("local_attention_backend", "nope"),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(model.ConfigError, match=f"model.{field}"):
        small(**{field: value})


def test_config_refuses_a_backend_that_cannot_run_its_layers():
    """Known before tracing on any machine: cuDNN takes no float32 and no soft-capping."""
    with pytest.raises(
        model.ConfigError, match="model.attention_backend: 'cudnn' cannot run the global layers: .*bfloat16"
    ):
        small(attention_backend="cudnn", local_attention_backend="reference")
    with pytest.raises(
        model.ConfigError, match="model.local_attention_backend: 'cudnn' .*sliding-window.*soft-capping"
    ):
        small(compute_dtype="bfloat16", attn_softcap=30.0, local_attention_backend="cudnn")
    cfg = small(compute_dtype="bfloat16", attention_backend="cudnn", local_attention_backend="reference")
    assert (
        model.local_backend(cfg) == "reference" and model.local_backend(small(attention_backend="pallas")) == "pallas"
    )


def test_a_global_only_backend_runs_the_global_layers(monkeypatch):
    """A backend without windows (here a test-only one on CPU) runs the global layers, the reference the local ones."""
    ran = []

    def run(q, k, v, **kw):
        ran.append(kw["window"])
        return A.reference(q, k, v, **kw)

    no_windows = lambda c: "no sliding window" if c.window is not None else None  # noqa: E731
    registry = {"global_only": A.Backend("global_only", lambda: None, no_windows, run), **A.BACKENDS}
    monkeypatch.setattr(A, "BACKENDS", registry)
    monkeypatch.setitem(kernels.REGISTRIES, "attention", registry)
    with pytest.raises(
        model.ConfigError,
        match=r"model.local_attention_backend: 'global_only' \(from attention_backend\)"
        r" cannot run the sliding-window layers: no sliding window",
    ):
        small(attention_backend="global_only")
    cfg = small(attention_backend="global_only", local_attention_backend="reference")
    ref = small()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 16)), jnp.int32)
    with jax.set_mesh(mesh42()):
        params = jax.jit(lambda k: model.init(ref, k))(jax.random.key(0))
        got = jax.jit(lambda p, t: model.forward(p, t, cfg))(params, tokens)
        want = jax.jit(lambda p, t: model.forward(p, t, ref))(params, tokens)
    assert ran and set(ran) == {None}  # traced for the global branch only
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_flops_count_local_layers_at_their_window():
    T = 1024
    cfg = small(n_layers=4, global_every=4, window=128)  # 3 local layers, 1 global
    full = dataclasses.replace(cfg, window=T)  # a window as long as the row is global attention
    attn = lambda w: flops.attention_flops_per_token(T, cfg.n_heads, cfg.head_dim, window=w)  # noqa: E731
    assert model.flops_per_token(full, T) - model.flops_per_token(cfg, T) == pytest.approx(3 * (attn(None) - attn(128)))


# ---------------------------------------------------------------- locality, per backend

LOCALITY_T, LOCALITY_W = 24, 5


def layer_backends():
    """(kind, backend, compute dtype) for every attention backend that can run that kind of layer of the
    locality test here: available and not refusing its call, in float32 or else bfloat16."""
    out = []
    for kind, window in (("local", LOCALITY_W), ("global", None)):
        seen = set()
        for dt in ("float32", "bfloat16"):
            cfg = small(n_layers=1, window=LOCALITY_W, compute_dtype=dt)
            call = kernels.AttentionCall(
                (4, LOCALITY_T, cfg.n_heads, cfg.head_dim),
                (4, LOCALITY_T, cfg.n_kv_heads, cfg.head_dim),
                jnp.dtype(dt),
                True,
                window,
                False,
                cfg.attn_softcap,
            )
            out += [(kind, b, dt) for b in kernels.usable("attention", call) if b not in seen]
            seen |= set(kernels.usable("attention", call))
    return out


def _block_fn(cfg, kind, backend, dt):
    """One block of `kind` with `backend` on that kind's layers, the other kind on the reference (both fields
    set: a global layer's backend need not run sliding windows)."""
    local, glob = (backend, "reference") if kind == "local" else ("reference", backend)
    cfg = dataclasses.replace(cfg, compute_dtype=dt, attention_backend=glob, local_attention_backend=local)
    params = model.init(cfg, jax.random.key(0))
    layer = jax.tree.map(lambda w: w[0], params["layers"])
    angles = lambda x: model.layer_angles(model.positions(x[..., 0], None), cfg)  # noqa: E731
    return jax.jit(lambda x: model.block(x, layer, angles(x), None, kind == "global", cfg)[0])


@pytest.mark.parametrize("kind,backend,dt", layer_backends())
def test_local_layer_ignores_tokens_beyond_its_window(kind, backend, dt):
    """Perturbing positions < c: a local layer's outputs from position c + W - 1 on are unchanged,
    a global layer's change. With every backend that can run that kind of layer here."""
    T, W, c = LOCALITY_T, LOCALITY_W, 6
    cfg = small(n_layers=1, window=W)
    mesh = mesh42()
    with jax.set_mesh(mesh):
        f = _block_fn(cfg, kind, backend, dt)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((4, T, cfg.d_model)).astype(np.float32)
        y = x.copy()
        y[:, :c] = rng.standard_normal((4, c, cfg.d_model))
        sh = NamedSharding(mesh, P("data", None, None))
        x, y = (jax.device_put(jnp.asarray(a, dt), sh) for a in (x, y))
        out_x, out_y = np.asarray(f(x), np.float32), np.asarray(f(y), np.float32)
    if kind == "local":
        np.testing.assert_array_equal(
            out_x[:, c + W - 1 :],
            out_y[:, c + W - 1 :],
            err_msg=f"{backend}: a local layer sees tokens more than window back",
        )
        assert not np.allclose(out_x[:, c + W - 2], out_y[:, c + W - 2]), "the window is shorter than W"
    else:
        assert not np.allclose(out_x[:, c + W - 1 :], out_y[:, c + W - 1 :]), (
            f"{backend}: a global layer ignores the far past"
        )


# ---------------------------------------------------------------- blockwise windowed reference

CASES = [  # T, W, block, H, Hkv, softcap, segments
    (37, 8, None, 4, 2, 0.0, True),  # T not a multiple of the block (8): 5 blocks, the last part-filled
    (37, 8, 3, 4, 1, 5.0, True),  # W not a multiple of the block: 3 key blocks back, MQA, soft-cap
    (50, 13, 5, 2, 2, 2.0, False),
    (20, 1, None, 4, 2, 0.0, True),  # W = 1: each token only itself
    (33, 32, None, 4, 2, 1.0, True),  # W = T - 1
]


@pytest.mark.parametrize("T,W,block,H,Hkv,softcap,segments", CASES)
def test_blockwise_window_matches_dense_mask(T, W, block, H, Hkv, softcap, segments):
    rng = np.random.default_rng(T + W)
    q, k, v = qkv(rng, 2, T, H, Hkv, 8)
    seg = packed_segments(rng, 2, T) if segments else None
    ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    @jax.jit
    def both(q, k, v):  # (output, dq, dk, dv) of each path, one compiled program
        blockwise = lambda *a: A._windowed(*a, segment_ids=seg, window=W, softcap=softcap, block=block)  # noqa: E731
        dense = lambda *a: A._dense(*a, segment_ids=seg, causal=True, window=W, softcap=softcap)  # noqa: E731
        outs = []
        for f in (blockwise, dense):
            out, vjp = jax.vjp(f, q, k, v)
            outs.append((out, *vjp(ct)))
        return outs

    got, want = both(q, k, v)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


def test_softcap_matches_its_definition():
    """Dense path: logits = c * tanh(q.k / sqrt(D) / c), checked with explicit numpy."""
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, 1, 6, 2, 2, 4)
    q = q * 4  # large logits, so the cap bites
    c = 2.0
    got = kernels.attention(q, k, v, causal=True, softcap=c, backend="reference")
    qn, kn, vn = (np.asarray(a, np.float64) for a in (q, k, v))
    logits = c * np.tanh(np.einsum("bthd,bshd->bhts", qn, kn) / 2.0 / c)
    logits = np.where(np.tril(np.ones((6, 6), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, np.einsum("bhts,bshd->bthd", p, vn), rtol=1e-5, atol=1e-5)
    with pytest.raises(kernels.AttentionError, match="softcap must be >= 0"):
        kernels.attention(q, k, v, softcap=-1.0)


def test_windowed_reference_memory_is_linear_in_T():
    """reference() takes the blockwise path for window < T: temporaries far below T^2 logits,
    and about double when T doubles."""
    H, D, W = 2, 16, 64

    def temp(T):
        q = jax.ShapeDtypeStruct((1, T, H, D), jnp.float32)
        f = jax.grad(lambda q: jnp.sum(kernels.attention(q, q, q, window=W, backend="reference")))
        return jax.jit(f).lower(q).compile().memory_analysis().temp_size_in_bytes

    t1, t2 = temp(2048), temp(4096)
    assert t2 < 4 * 2048**2 * H, (t2, "bytes: as large as the dense logits")
    assert 1.5 < t2 / t1 < 2.6, (t1, t2)


def test_windowed_reference_under_explicit_4x2_mesh():
    """Batch on `data`, heads on `model`: same values and gradients as unsharded, sharding kept."""
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, 4, 37, 4, 2, 8)
    seg = packed_segments(rng, 4, 37)

    def loss(q, k, v, seg):
        return jnp.sum(kernels.attention(q, k, v, segment_ids=seg, window=8, softcap=3.0, backend="reference") ** 2)

    want_out = jax.jit(lambda q, k, v, s: kernels.attention(q, k, v, segment_ids=s, window=8, softcap=3.0))(
        q, k, v, seg
    )
    want_grads = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v, seg)
    mesh = mesh42()
    with jax.set_mesh(mesh):
        heads = NamedSharding(mesh, P("data", None, "model", None))
        qs, ks, vs = (jax.device_put(a, heads) for a in (q, k, v))
        ss = jax.device_put(seg, NamedSharding(mesh, P("data", None)))
        out = jax.jit(lambda q, k, v, s: kernels.attention(q, k, v, segment_ids=s, window=8, softcap=3.0))(
            qs, ks, vs, ss
        )
        grads = jax.jit(jax.grad(loss, (0, 1, 2)))(qs, ks, vs, ss)
    assert out.sharding.spec == P("data", None, "model", None), out.sharding.spec
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_grads):
        assert g.sharding.spec == P("data", None, "model", None), g.sharding.spec
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_cudnn_refuses_softcap_and_auto_falls_to_reference(monkeypatch):
    """Pretend cuDNN is present: soft-capping is refused by name, never run without the cap."""
    cud = A.BACKENDS["cudnn"]
    ran = []
    monkeypatch.setitem(
        A.BACKENDS, "cudnn", A.Backend("cudnn", lambda: None, cud.refuses, lambda *a, **kw: ran.append(1))
    )
    q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(kernels.AttentionError, match="soft-capping"):
        kernels.attention(q, q, q, window=4, softcap=30.0, backend="cudnn")
    out = kernels.attention(q, q, q, window=4, softcap=30.0)
    assert out.shape == q.shape and not ran
    kernels.attention(q, q, q, window=4, segment_ids=jnp.ones((1, 8), jnp.int32))  # causal + window + ids: cuDNN runs
    assert ran == [1]


# ---------------------------------------------------------------- the whole model


@functools.cache
def _init(cfg):
    with jax.set_mesh(mesh42()):
        return jax.jit(lambda k: model.init(cfg, k))(jax.random.key(1))


def _tokens(rng, cfg, T=32):
    return jnp.asarray(rng.integers(0, cfg.vocab_size, (4, T)), jnp.int32)


OPTIONS = [
    dict(local_rope_theta=100.0, global_rope_theta=1e6),
    dict(qk_norm=False, head_gate=False, global_rope="none", attn_softcap=5.0),
]


@pytest.mark.parametrize(
    "over",
    [pytest.param(OPTIONS[0], marks=LONG), pytest.param(OPTIONS[1], marks=LONG)],  # 15-45 s each: integration tier
    ids=["two-thetas", "nope-softcap-plain"],
)
def test_scanned_layers_match_an_unrolled_loop(over):
    """The per-layer pattern fed as scan data picks the same attention as Python flags per layer."""
    cfg = small(n_layers=3, global_every=2, remat="none", **over)  # local, global, global (the last)
    params = _init(cfg)
    tokens = _tokens(np.random.default_rng(0), cfg)

    def unrolled(params, tokens):
        x = params["embed"].at[tokens].get(out_sharding=P("data", None, None))
        angles = model.layer_angles(model.positions(tokens, None), cfg)
        for i, g in enumerate(model.global_layers(cfg)):
            x, _ = model.block(x, jax.tree.map(lambda w: w[i], params["layers"]), angles, None, g, cfg)
        return model.rms_norm(x, params["final_norm"], cfg.norm_eps)

    all_global = dataclasses.replace(cfg, global_every=1)
    with jax.set_mesh(mesh42()):
        want, got, other = jax.jit(
            lambda p, t: (unrolled(p, t), model.hidden_states(p, t, cfg), model.hidden_states(p, t, all_global))
        )(params, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, other, atol=1e-4), "the layer pattern makes no difference"


@LONG  # about 20 s on 2 cores: the integration tier
def test_remat_policies_agree_on_loss_and_grads():
    """lax.cond inside a checkpointed scan step: every remat policy gives the same gradients."""
    rng = np.random.default_rng(2)
    base = small(n_layers=4, global_every=2)
    params = _init(base)
    toks = _tokens(rng, base, 33)
    seg = jnp.asarray(np.where(np.arange(32) < 19, 1, 2)[None].repeat(4, 0), jnp.int32)
    batch = {"tokens": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": seg, "loss_mask": jnp.ones((4, 32))}
    grad = lambda remat: jax.value_and_grad(  # noqa: E731
        lambda p, b: model.loss_fn(p, b, dataclasses.replace(base, remat=remat))[0]
    )
    with jax.set_mesh(mesh42()):
        (l0, g0), *rest = jax.jit(lambda p, b: [grad(r)(p, b) for r in ("none", "dots", "full")])(params, batch)
    for loss, g in rest:
        np.testing.assert_allclose(loss, l0, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_head_gate_starts_as_the_identity():
    cfg = small()
    params = _init(cfg)
    assert not np.any(np.asarray(params["layers"]["head_gate"]))
    no_gate = {**params, "layers": {k: v for k, v in params["layers"].items() if k != "head_gate"}}
    tokens = _tokens(np.random.default_rng(4), cfg)
    with jax.set_mesh(mesh42()):
        a = jax.jit(lambda p, t: model.forward(p, t, cfg))(params, tokens)
        b = jax.jit(lambda p, t: model.forward(p, t, dataclasses.replace(cfg, head_gate=False)))(no_gate, tokens)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_causality_and_document_isolation_with_window_below_row():
    """The contract's two masks checks at window 4 < T = 32, so the blockwise path runs in the model."""
    cfg = small(n_layers=4, global_every=4)
    params = _init(cfg)
    T, cut = 32, 13
    rng = np.random.default_rng(6)
    with jax.set_mesh(mesh42()):
        f = jax.jit(lambda p, t, s: model.forward(p, t, cfg, segment_ids=s))
        run = lambda t, s: np.asarray(f(params, jnp.asarray(t), jnp.asarray(s)))  # noqa: E731
        ones = np.ones((4, T), np.int32)
        a = rng.integers(0, cfg.vocab_size, (4, T)).astype(np.int32)
        b = a.copy()
        b[:, 20:] = rng.integers(0, cfg.vocab_size, (4, T - 20))
        la, lb = run(a, ones), run(b, ones)
        np.testing.assert_array_equal(la[:, :20], lb[:, :20], err_msg="later tokens leak into earlier logits")
        assert not np.allclose(la[:, 20:], lb[:, 20:])

        seg = lambda n: np.where(np.arange(T) < n, 1, 2).astype(np.int32)[None].repeat(4, 0)  # noqa: E731
        out = run(a, seg(cut))
        first, second = np.zeros_like(a), np.zeros_like(a)
        first[:, :cut], second[:, : T - cut] = a[:, :cut], a[:, cut:]
        np.testing.assert_allclose(out[:, :cut], run(first, seg(cut))[:, :cut], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out[:, cut:], run(second, seg(T - cut))[:, : T - cut], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "over",
    [
        dict(window=4),
        pytest.param(dict(window=64, global_rope="none", attn_softcap=5.0, head_gate=False), marks=LONG),
    ],  # 20 s: integration
    ids=["ring-wraps", "ring-is-the-row-nope-softcap"],
)
def test_decoding_matches_forward(over):
    """prefill + greedy decoding equal forward: local layers' rings of 4 slots wrapping several times
    (prompts of 1 to 11 tokens, 10 steps), and a window longer than the cache (the ring holds the whole
    row) with NoPE global layers and soft-capping, on the 4 x 2 mesh."""
    cfg = small(**over)
    err, same = decode_against_forward(model, cfg, mesh42(), _init(cfg), [1, 11, 4, 7], steps=10, max_len=24)
    assert err < 1e-4 and same, (err, same)


# ---------------------------------------------------------------- its Hugging Face mapping (Qwen3ForCausalLM)
# tests/fast/test_hf.py runs the checks every hf.py gets; these are swa_hybrid's own: what its export and import
# refuse, and the layer pattern it reads.


def hf_module():
    return load(os.path.join(HERE, "hf.py"))


QWEN3 = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    use_sliding_window=True,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 2,
)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"qk_norm": False}, "model.qk_norm"),
        ({"attn_softcap": 30.0}, "model.attn_softcap"),
        ({"global_rope": "none"}, "model.global_rope"),
        ({"global_rope_theta": 5e5}, "model.global_rope_theta"),
    ],
)
def test_hf_export_refuses(change, field, tmp_path):
    cfg = small(**change)
    with pytest.raises(HFError, match=f"^{field}: "):
        hf_module().export_params(
            {}, cfg, str(tmp_path / "hf"), str(tmp_path / "tokenizer.json"), max_length=64, progress=False
        )
    assert not os.path.exists(tmp_path / "hf")


@pytest.mark.parametrize(
    "change,field",
    [
        ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types"),  # the last layer is always full
        ({"layer_types": ["sliding_attention", "full_attention", "full_attention", "full_attention"]}, "layer_types"),
        ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
        ({"use_sliding_window": False}, "use_sliding_window"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_parameters.rope_type"),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "model_type"),
    ],
)
def test_hf_import_refuses(change, field):
    with pytest.raises(HFError, match=f"^{field}: "):
        hf_module().model_config({**QWEN3, **change})


def test_hf_import_reads_the_layer_pattern():
    hf = hf_module()
    cfg = hf.model_config(QWEN3)
    assert (cfg.global_every, cfg.window, cfg.head_gate, cfg.qk_norm) == (2, 8, False, True)
    assert hf.model.global_layers(cfg) == [False, True, False, True]
    assert hf.model.global_layers(hf.model_config({**QWEN3, "layer_types": ["full_attention"] * 4})) == [True] * 4
