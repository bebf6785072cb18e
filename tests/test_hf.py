"""Hugging Face export and import (variants/<name>/hf.py, shared/hf.py) against transformers itself.

Per variant with an hf.py, on tiny random configs: the exported directory run by transformers
(fp32, eager attention) gives stencil's logits, packed rows included (positions as
position_ids); import(export(params)) is bit for bit on a 4x2 mesh; a random transformers
model saved with save_pretrained imports with transformers' logits and trains from
`--init_from hf:DIR`; transformers' greedy `generate` continues as stencil does; each option
without a counterpart is refused with its own message. Needs torch and transformers (the
`hf` extra after a CPU torch, as .ci/run installs them); skipped without them.
"""

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from shared import checkpoint, data, generate, sources
from shared import hf as hfio
from shared.variant import load

pytestmark = pytest.mark.integration  # Hugging Face: transformers (on torch) runs the exported and imported models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4
TINY = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128)
# per variant: its own tiny options (a window shorter than a document, both layer kinds)
OWN = {"dense": {}, "swa_hybrid": {"n_layers": 3, "window": 6, "global_every": 2}}
CASES = [("dense", {}), ("dense", {"tie_embeddings": True}),
         ("swa_hybrid", {}), ("swa_hybrid", {"tie_embeddings": True, "head_gate": False})]
MAX_DIFF = {}  # measured max |logit difference| per case, printed at the end (pytest -s)


def hf_module(variant):
    return load(os.path.join(ROOT, "variants", variant, "hf.py"))


def tiny(variant, **kw):
    return hf_module(variant).model.ModelConfig(**{**TINY, **OWN[variant], **kw})


def mesh(data_=4, model_=2):
    return jax.make_mesh((data_, model_), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[: data_ * model_])


def random_params(variant, cfg, seed=0):
    """Every leaf random (norms and gates too, so that a misplaced one shows), on the current mesh."""
    mod = hf_module(variant).model
    rng = np.random.RandomState(seed)
    dtype = jnp.dtype(cfg.param_dtype)

    def make(path, shape, spec):
        name = jax.tree_util.keystr(path)
        base = 1.0 if "norm" in name else 0.0
        a = (base + 0.15 * rng.standard_normal(shape)).astype(np.float32)
        return hfio.place(np.asarray(jnp.asarray(a, dtype)), spec)

    shapes = mod.param_shapes(cfg)
    return jax.tree_util.tree_map_with_path(make, shapes, mod.param_specs(cfg),
                                            is_leaf=lambda s: isinstance(s, tuple))


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    docs = ["def f(x):\n    return x + 1\n" * 40, "class A:\n    pass\n" * 40, "import os\nprint(os.getcwd())\n" * 40]
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    sources.train_tokenizer(docs, 512).save(path)
    return path


def packed_batch(T=32):
    """Rows 0 and 2 pack three and two documents, rows 1 and 3 are one each; (tokens, segment_ids) [4, T]."""
    tokens = np.random.RandomState(1).randint(0, 512, (4, T)).astype(np.int32)
    seg = np.zeros((4, T), np.int32)
    seg[0, 10:], seg[0, 21:], seg[2, 17:] = 1, 2, 1
    return tokens, seg


def stencil_logits(variant, params, cfg, tokens, seg):
    mod = hf_module(variant).model
    return np.asarray(jax.device_get(mod.forward(params, jnp.asarray(tokens), cfg, segment_ids=jnp.asarray(seg))))


def hf_logits(directory, tokens, positions):
    m = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():
        out = m(input_ids=torch.tensor(tokens, dtype=torch.long), use_cache=False,
                position_ids=torch.tensor(np.asarray(positions), dtype=torch.long))
    return out.logits.numpy()


@pytest.mark.parametrize("variant,kw", CASES, ids=[f"{v}-{'-'.join(k) or 'default'}" for v, k in CASES])
def test_export_logits_match_transformers(variant, kw, tmp_path, tokenizer_file):
    hf = hf_module(variant)
    cfg = tiny(variant, **kw)
    tokens, seg = packed_batch()
    with jax.set_mesh(mesh()):
        params = random_params(variant, cfg)
        out = hf.export_params(params, cfg, str(tmp_path / "hf"), tokenizer_file, max_length=64,
                               max_shard_size="40KB", progress=False)
        ours = stencil_logits(variant, params, cfg, tokens, seg)
        pos = hf.model.positions(jnp.asarray(tokens), jnp.asarray(seg))
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1  # sharded
    theirs = hf_logits(out, tokens, jax.device_get(pos))
    diff = float(np.abs(ours - theirs).max())
    MAX_DIFF[f"{variant} {kw or 'default'}"] = diff
    print(f"\n{variant} {kw}: max |logit diff| {diff:.2e} (logits up to {np.abs(ours).max():.2f})")
    assert diff < TOL, diff
    cfg_json = json.load(open(os.path.join(out, "config.json")))
    assert cfg_json["architectures"] == [hf.ARCHITECTURE]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    eos, eos_id = hfio.tokenizer_eos(tokenizer_file)
    assert tok.eos_token == eos and tok.eos_token_id == eos_id == cfg_json["eos_token_id"]
    assert json.load(open(os.path.join(out, "generation_config.json")))["eos_token_id"] == eos_id


@pytest.mark.parametrize("variant,dtype", [("dense", "float32"), ("dense", "bfloat16"), ("swa_hybrid", "float32")])
def test_round_trip_is_bit_exact(variant, dtype, tmp_path, tokenizer_file):
    hf = hf_module(variant)
    cfg = tiny(variant, param_dtype=dtype, **({"head_gate": False} if variant == "swa_hybrid" else {}))
    with jax.set_mesh(mesh()):
        params = random_params(variant, cfg, seed=2)
        out = hf.export_params(params, cfg, str(tmp_path / "hf"), tokenizer_file, max_length=64, progress=False)
        cfg2, back = hf.load(out, dataclasses.replace(cfg, n_layers=1))
    assert cfg2 == cfg
    specs = hf.model.param_specs(cfg)
    for (path, a), b, spec in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(back),
                                  jax.tree.leaves(specs)):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert b.sharding.spec == spec, path
        x, y = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), jax.tree_util.keystr(path)


def transformers_model(variant, tmp_path, tokenizer_file, **over):
    """A random transformers model of the variant's class, saved with save_pretrained (plus our tokenizer)."""
    torch.manual_seed(0)
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, initializer_range=0.1,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, tie_word_embeddings=False)
    if variant == "dense":
        cfg = transformers.LlamaConfig(**{**common, **over})
    else:
        cfg = transformers.Qwen3Config(**{**common, "num_hidden_layers": 4, "use_sliding_window": True,
                                          "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"] * 2,
                                          **over})
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # norms away from 1, so that a misplaced one shows
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    d = str(tmp_path / "hf-random")
    m.save_pretrained(d)
    shutil.copyfile(tokenizer_file, os.path.join(d, "tokenizer.json"))
    return d


@pytest.mark.parametrize("variant", ["dense", "swa_hybrid"])
def test_import_transformers_model_and_train_from_it(variant, tmp_path, tokenizer_file, small_corpus):
    hf = hf_module(variant)
    d = transformers_model(variant, tmp_path, tokenizer_file)
    tokens, seg = packed_batch()
    with jax.set_mesh(mesh()):
        cfg, params = hf.load(d)
        ours = stencil_logits(variant, params, cfg, tokens, seg)
        pos = jax.device_get(hf.model.positions(jnp.asarray(tokens), jnp.asarray(seg)))
    theirs = hf_logits(d, tokens, pos)
    diff = float(np.abs(ours - theirs).max())
    MAX_DIFF[f"{variant} import"] = diff
    print(f"\n{variant} import of a transformers model: max |logit diff| {diff:.2e}")
    assert diff < TOL, diff

    # a few steps from it: the weights are the imported ones (a tiny lr barely moves them) and the loss is finite
    train = load(os.path.join(ROOT, "variants", variant, "train.py"))
    tcfg = train.TrainConfig(init_from=f"hf:{d}", data=data.DataConfig(source=small_corpus, val_fraction=0.1),
                             seq_len=32, batch_size=8, steps=3, lr=1e-9, warmup_steps=0, eval_every=3, eval_batches=1,
                             log_every=1, run_dir=str(tmp_path / "run"), wandb="disabled", sample_tokens=0,
                             mesh_model=2)
    result = train.main(tcfg)
    assert len(result["losses"]) == 3 and all(np.isfinite(v) for v in result["losses"].values())
    with jax.set_mesh(mesh()):
        for a, b in zip(jax.tree.leaves(jax.device_get(result["state"]["params"])), jax.tree.leaves(jax.device_get(params))):
            np.testing.assert_allclose(a, b, atol=1e-5)


class Collect(logging.Handler):
    """The messages of a logger, as they are logged."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


@pytest.mark.parametrize("variant", ["dense", "swa_hybrid"])
def test_greedy_generation_matches_transformers(variant, tmp_path, tokenizer_file):
    hf = hf_module(variant)
    cfg = tiny(variant, init_std=0.2)  # peaked logits: no near-ties for argmax to split on
    prompt, n_new, T = [5, 17, 300, 41, 7], 20, 32
    with jax.set_mesh(mesh(1, 1)):
        params = hf.model.init(cfg, jax.random.key(3))
        out = hf.export_params(params, cfg, str(tmp_path / "hf"), tokenizer_file, max_length=64, progress=False)
        next_token = jax.jit(lambda p, t, i: jnp.argmax(
            jax.lax.dynamic_index_in_dim(hf.model.forward(p, t, cfg), i - 1, axis=1, keepdims=False), -1))
        buf = np.zeros((1, T), np.int32)
        buf[:, : len(prompt)] = prompt
        ours = list(prompt)
        for i in range(len(prompt), len(prompt) + n_new):
            t = int(np.asarray(jax.device_get(next_token(params, jnp.asarray(buf), i)))[0])
            ours.append(t)
            buf[:, i] = t
        cached = generate.generate(hf.model, params, cfg, [prompt], mesh=mesh(1, 1), max_new_tokens=n_new)[0].tokens
    m = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    warned = Collect()
    logging.getLogger("transformers").addHandler(warned)  # transformers' loggers end there
    try:
        theirs = m.generate(torch.tensor([prompt]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0].tolist()
    finally:
        logging.getLogger("transformers").removeHandler(warned)
    assert not [r for r in warned.records if "max_length" in r], warned.records  # none in generation_config.json
    assert theirs == ours
    assert prompt + cached == theirs, "decoding with the cache (shared/generate.py) differs from transformers' generate"


def test_export_and_import_command_lines(tmp_path, tokenizer_file):
    """The CLI: a run directory's checkpoint -> a Hugging Face directory -> a stencil checkpoint, bit for bit;
    an existing --out is refused."""
    hf = hf_module("dense")
    cfg = tiny("dense")
    run = tmp_path / "run"
    with jax.set_mesh(mesh()):
        params = random_params("dense", cfg, seed=4)
        checkpoint.save(str(run / "checkpoints"), 7, {"params": params, "step": jnp.int32(7)},
                        {"config": {"model": dataclasses.asdict(cfg), "seq_len": 32}, "variant": "dense"})
    os.makedirs(run, exist_ok=True)
    shutil.copyfile(tokenizer_file, run / "tokenizer.json")
    script, env = os.path.join(ROOT, "variants", "dense", "hf.py"), dict(os.environ, PYTHONPATH=ROOT)
    out, back = tmp_path / "hf", tmp_path / "back"
    cmd = (f"{sys.executable} {script} export --run_dir {run} --out {out} && "
           f"{sys.executable} {script} import --hf_dir {out} --out {back}")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "flags: --model.vocab_size 512 --model.d_model 64" in r.stdout, r.stdout
    with pytest.raises(hfio.HFError, match=f"--out {out} exists"):
        hf.export(str(run), str(out), progress=False)
    with jax.set_mesh(mesh()):
        restored, _ = checkpoint.restore(checkpoint.latest(str(back / "checkpoints")),
                                         jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                                      {"params": params}))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored)):
        assert np.array_equal(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b)))
    assert json.load(open(out / "config.json"))["max_position_embeddings"] == 32
    assert hf.model_config(hfio.read_config(str(out))) == cfg


# ---------------------------------------------------------------- refusals, one message each

LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             rms_norm_eps=1e-5, hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": 1e4})


@pytest.mark.parametrize("change,field", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope_parameters.rope_type"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "model_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
])
def test_dense_import_refuses(change, field):
    with pytest.raises(hfio.HFError, match=f"^{field}: "):
        hf_module("dense").model_config({**LLAMA, **change})


def test_import_refuses_a_tensor_without_a_place(tmp_path, tokenizer_file):
    d = transformers_model("dense", tmp_path, tokenizer_file, attention_bias=True)
    cfg = dict(json.load(open(os.path.join(d, "config.json"))), attention_bias=False)
    hfio.write_json(os.path.join(d, "config.json"), cfg)  # a config that hides the biases the tensors have
    hf = hf_module("dense")
    with pytest.raises(hfio.HFError, match=r"^model\.layers\.0\.self_attn\.[qkvo]_proj\.bias: a tensor dense has no"):
        hf.read_params(d, hf.model_config(cfg))


def test_init_from_is_checked(tmp_path):
    for variant, value, why in (("dense", "runs/x", "must be '' or hf:DIR"), ("kda", "hf:/x", "kda has no hf.py"),
                                ("moe_hero", "hf:/x", "moe_hero has no hf.py")):
        train = load(os.path.join(ROOT, "variants", variant, "train.py"))
        with pytest.raises(train.model.ConfigError, match=f"^init_from: .*{why}"):
            train.TrainConfig(init_from=value)
    train = load(os.path.join(ROOT, "variants", "dense", "train.py"))
    hfio.write_json(str(tmp_path / "config.json"), {**LLAMA, "hidden_act": "relu"})
    with pytest.raises(train.model.ConfigError, match="^init_from: hidden_act: 'relu'"):
        train.main(train.TrainConfig(init_from=f"hf:{tmp_path}", run_dir=str(tmp_path / "run")))


@pytest.mark.parametrize("change,field", [
    ({"qk_norm": False}, "model.qk_norm"), ({"attn_softcap": 30.0}, "model.attn_softcap"),
    ({"global_rope": "none"}, "model.global_rope"), ({"global_rope_theta": 5e5}, "model.global_rope_theta"),
])
def test_swa_hybrid_export_refuses(change, field, tmp_path, tokenizer_file):
    hf = hf_module("swa_hybrid")
    cfg = tiny("swa_hybrid", **change)
    with pytest.raises(hfio.HFError, match=f"^{field}: "):
        hf.export_params({}, cfg, str(tmp_path / "hf"), tokenizer_file, max_length=64, progress=False)
    assert not os.path.exists(tmp_path / "hf")


QWEN3 = dict(LLAMA, architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_hidden_layers=4,
             use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2)


@pytest.mark.parametrize("change,field", [
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types"),  # the last layer is always full
    ({"layer_types": ["sliding_attention", "full_attention", "full_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
    ({"use_sliding_window": False}, "use_sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_parameters.rope_type"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "model_type"),
])
def test_swa_hybrid_import_refuses(change, field):
    with pytest.raises(hfio.HFError, match=f"^{field}: "):
        hf_module("swa_hybrid").model_config({**QWEN3, **change})


def test_swa_hybrid_import_reads_the_layer_pattern():
    hf = hf_module("swa_hybrid")
    cfg = hf.model_config(QWEN3)
    assert (cfg.global_every, cfg.window, cfg.head_gate, cfg.qk_norm) == (2, 8, False, True)
    assert hf.model.global_layers(cfg) == [False, True, False, True]
    assert hf.model.global_layers(hf.model_config({**QWEN3, "layer_types": ["full_attention"] * 4})) == [True] * 4


def test_export_refuses_a_leaf_the_table_does_not_map(monkeypatch):
    """A copied hf.py next to a model that gained a weight refuses to export instead of dropping it."""
    hf = hf_module("dense")
    rows = hf.tensor_map
    monkeypatch.setattr(hf, "tensor_map", lambda cfg: [r for r in rows(cfg) if r[1] != ("final_norm",)])
    with pytest.raises(hfio.HFError, match=r"^hf.py: dense's params have leaves this file does not map: \['final_norm'\]"):
        hf.export_tensors(tiny("dense"), None, np.dtype("float32"))
