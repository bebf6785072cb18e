"""The integration tier of tests/fast/test_hf.py (Hugging Face export and import (each folder's hf.py,
shared/modelio/hf.py), the same checks for every folder that has an hf.py (found as the contract finds
model.py + train.py):): the checks that start real processes or servers, or run long. What they share with the
fast half is imported from it."""

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
from shared import data, decode
from shared.storage import checkpoint
from shared.evals import probes
from shared.modelio import hf as hfio
from shared.variant import ROOT, load
from helpers import metric_rows
from fast.test_hf import Collect, FOLDERS, MAX_DIFF, NAMES, TOL, hf_module, mesh, tiny  # (tests/fast/test_hf.py)

HF = pytest.mark.integration  # Hugging Face: transformers (on torch) runs the exported and imported models


def transformers_or_skip():
    torch = pytest.importorskip("torch", reason="transformers needs a torch: pip install torch (CPU) first")
    return torch, pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")


def cases():
    """Each folder at its tiny size, and tied (where the model can tie its embeddings)."""
    out = []
    for f, name in zip(FOLDERS, NAMES):
        out.append(pytest.param(f, {}, id=f"{name}-default"))
        if "tie_embeddings" in {x.name for x in dataclasses.fields(hf_module(f).model.ModelConfig)}:
            out.append(pytest.param(f, {"tie_embeddings": True}, id=f"{name}-tied"))
    return out


def random_params(folder, cfg, seed=0):
    """Every leaf random, norms around 1 (by role: shared/weights.py), on the current mesh."""
    mod = hf_module(folder).model
    rng = np.random.RandomState(seed)
    dtype = jnp.dtype(cfg.param_dtype)
    roles = jax.tree.map(lambda w: w.role, mod.weights(cfg), is_leaf=lambda w: hasattr(w, "role"))

    def make(shape, spec, role):
        a = ((1.0 if role in ("norm", "gain") else 0.0) + 0.15 * rng.standard_normal(shape)).astype(np.float32)
        return hfio.place(np.asarray(jnp.asarray(a, dtype)), spec)

    return jax.tree.map(
        make, mod.param_shapes(cfg), mod.param_specs(cfg), roles, is_leaf=lambda s: isinstance(s, tuple)
    )


def packed_batch(T=32):
    """Rows 0 and 2 pack three and two documents, rows 1 and 3 are one each; (tokens, segment_ids) [4, T]."""
    tokens = np.random.RandomState(1).randint(0, 512, (4, T)).astype(np.int32)
    seg = np.zeros((4, T), np.int32)
    seg[0, 10:], seg[0, 21:], seg[2, 17:] = 1, 2, 1
    return tokens, seg


def stencil_logits(folder, params, cfg, tokens, seg):
    mod = hf_module(folder).model
    return np.asarray(jax.device_get(mod.forward(params, jnp.asarray(tokens), cfg, segment_ids=jnp.asarray(seg))))


def hf_logits(directory, tokens, positions):
    torch, transformers = transformers_or_skip()
    m = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        out = m(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            use_cache=False,
            position_ids=torch.tensor(np.asarray(positions), dtype=torch.long),
        )
    return out.logits.numpy()


def tensors(directory) -> dict:
    st = hfio.Safetensors(directory)
    return {n: np.asarray(st.get(n)) for n in st.names()}


@HF
@pytest.mark.parametrize("folder,kw", cases())
def test_export_logits_match_transformers(folder, kw, tmp_path, tokenizer_file):
    transformers_or_skip()
    hf = hf_module(folder)
    cfg = tiny(folder, **kw)
    tokens, seg = packed_batch()
    with jax.set_mesh(mesh()):
        params = random_params(folder, cfg)
        out = hf.export_params(
            params, cfg, str(tmp_path / "hf"), tokenizer_file, max_length=64, max_shard_size="40KB", progress=False
        )
        ours = stencil_logits(folder, params, cfg, tokens, seg)
        pos = hf.model.positions(jnp.asarray(tokens), jnp.asarray(seg))
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1  # sharded
    theirs = hf_logits(out, tokens, jax.device_get(pos))
    diff = float(np.abs(ours - theirs).max())
    MAX_DIFF[f"{folder} {kw or 'default'}"] = diff
    print(f"\n{folder} {kw}: max |logit diff| {diff:.2e} (logits up to {np.abs(ours).max():.2f})")
    assert diff < TOL, diff
    cfg_json = json.load(open(os.path.join(out, "config.json")))
    assert cfg_json["architectures"] == [hf.ARCHITECTURE]
    tok = transformers_or_skip()[1].AutoTokenizer.from_pretrained(out)
    eos, eos_id = hfio.tokenizer_eos(tokenizer_file)
    assert tok.eos_token == eos and tok.eos_token_id == eos_id == cfg_json["eos_token_id"]
    assert json.load(open(os.path.join(out, "generation_config.json")))["eos_token_id"] == eos_id


@HF
@pytest.mark.parametrize("folder,dtype", [(f, d) for f in FOLDERS for d in ("float32", "bfloat16")])
def test_round_trip(folder, dtype, tmp_path, tokenizer_file):
    """import(export(params)) computes the same logits; its export writes the same tensors, bit for bit."""
    hf = hf_module(folder)
    cfg = tiny(folder, param_dtype=dtype)
    tokens, seg = packed_batch()
    with jax.set_mesh(mesh()):
        params = random_params(folder, cfg, seed=2)
        first = hf.export_params(params, cfg, str(tmp_path / "a"), tokenizer_file, max_length=64, progress=False)
        cfg2, back = hf.load(first, dataclasses.replace(cfg, n_layers=1))
        for leaf, spec in zip(jax.tree.leaves(back), jax.tree.leaves(hf.model.param_specs(cfg2))):
            assert leaf.sharding.spec == spec and leaf.dtype == jnp.dtype(dtype)
        second = hf.export_params(back, cfg2, str(tmp_path / "b"), tokenizer_file, max_length=64, progress=False)
        ours, again = (stencil_logits(folder, p, c, tokens, seg) for p, c in ((params, cfg), (back, cfg2)))
    np.testing.assert_allclose(again, ours, atol=TOL if dtype == "float32" else 5e-2)
    a, b = tensors(first), tensors(second)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name].view(np.uint8), b[name].view(np.uint8)), name
    assert hf.hf_config(cfg2, dtype, 64) == hf.hf_config(hf.model_config(hfio.read_config(first)), dtype, 64)


def transformers_model(folder, tmp_path, tokenizer_file):
    """A random transformers model of the folder's class, from the config its export writes, saved with
    save_pretrained (plus our tokenizer)."""
    torch, transformers = transformers_or_skip()
    torch.manual_seed(0)
    config = dict(hf_module(folder).hf_config(tiny(folder, rope_theta=5000.0), "float32", 64))
    config.pop("architectures")
    hf_cfg = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    m = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # norms away from 1, so that a misplaced one shows
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    d = str(tmp_path / "hf-random")
    m.save_pretrained(d)
    shutil.copyfile(tokenizer_file, os.path.join(d, "tokenizer.json"))
    return d


@HF
@pytest.mark.parametrize("folder", FOLDERS, ids=NAMES)
def test_import_a_transformers_model_and_train_from_it(folder, tmp_path, tokenizer_file, small_corpus):
    hf = hf_module(folder)
    d = transformers_model(folder, tmp_path, tokenizer_file)
    tokens, seg = packed_batch()
    with jax.set_mesh(mesh()):
        cfg, params = hf.load(d)
        ours = stencil_logits(folder, params, cfg, tokens, seg)
        pos = jax.device_get(hf.model.positions(jnp.asarray(tokens), jnp.asarray(seg)))
    theirs = hf_logits(d, tokens, pos)
    diff = float(np.abs(ours - theirs).max())
    MAX_DIFF[f"{folder} import"] = diff
    print(f"\n{folder} import of a transformers model: max |logit diff| {diff:.2e}")
    assert diff < TOL, diff

    # a few steps from it: the weights are the imported ones (a tiny lr barely moves them) and the loss is finite;
    # with the rows split over `context`, two micro-batches, a probe and the end-of-run sample on
    train = load(os.path.join(ROOT, folder, "train.py"))
    tcfg = train.TrainConfig(
        init_from=f"hf:{d}",
        data=data.DataConfig(source=small_corpus, val_fraction=0.1),
        seq_len=32,
        batch_size=8,
        steps=3,
        lr=1e-9,
        warmup_steps=0,
        eval_every=3,
        eval_batches=1,
        log_every=1,
        run_dir=str(tmp_path / "run"),
        wandb="disabled",
        sample_tokens=4,
        mesh_model=2,
        mesh_context=2,
        grad_accum=2,
        probes=probes.ProbeConfig(sets="mqar", rows=8, mqar_pairs=2, mqar_gap=4),
    )
    result = train.main(tcfg)
    assert len(result["losses"]) == 3 and all(np.isfinite(v) for v in result["losses"].values())
    assert result["sample"].strip() and "eval/mqar/accuracy" in metric_rows(tmp_path / "run")[-1]
    with jax.set_mesh(mesh()):
        for a, b in zip(
            jax.tree.leaves(jax.device_get(result["state"]["params"])), jax.tree.leaves(jax.device_get(params))
        ):
            np.testing.assert_allclose(a, b, atol=1e-5)


@HF
@pytest.mark.parametrize("folder", FOLDERS, ids=NAMES)
def test_greedy_generation_matches_transformers(folder, tmp_path, tokenizer_file):
    torch, transformers = transformers_or_skip()
    hf = hf_module(folder)
    cfg = tiny(folder, init_std=0.2)  # peaked logits: no near-ties for argmax to split on
    prompt, n_new = [5, 17, 300, 41, 7], 20
    with jax.set_mesh(mesh(1, 1)):
        params = hf.model.init(cfg, jax.random.key(3))
        out = hf.export_params(params, cfg, str(tmp_path / "hf"), tokenizer_file, max_length=64, progress=False)
        cached = decode.generate(hf.model, params, cfg, [prompt], mesh=mesh(1, 1), max_new_tokens=n_new)[0].tokens
    m = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    warned = Collect()
    logging.getLogger("transformers").addHandler(warned)  # transformers' loggers end there
    try:
        theirs = m.generate(
            torch.tensor([prompt]),
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0].tolist()
    finally:
        logging.getLogger("transformers").removeHandler(warned)
    assert not [r for r in warned.records if "max_length" in r], warned.records  # none in generation_config.json
    assert prompt + cached == theirs, "decoding with the cache (shared/decode.py) differs from transformers' generate"


@HF
@pytest.mark.parametrize("folder", FOLDERS, ids=NAMES)
def test_export_and_import_command_lines(folder, tmp_path, tokenizer_file):
    """A run directory's checkpoint -> a Hugging Face directory -> a stencil checkpoint, with the same
    exported tensors; an existing --out is refused."""
    hf = hf_module(folder)
    cfg = tiny(folder)
    run = tmp_path / "run"
    with jax.set_mesh(mesh()):
        params = random_params(folder, cfg, seed=4)
        checkpoint.save(
            str(run / "checkpoints"),
            7,
            {"params": params, "step": jnp.int32(7)},
            {"config": {"model": dataclasses.asdict(cfg), "seq_len": 32}, "variant": hf.VARIANT},
        )
    shutil.copyfile(tokenizer_file, run / "tokenizer.json")
    script, env = os.path.join(ROOT, folder, "hf.py"), dict(os.environ, PYTHONPATH=ROOT)
    out, back = tmp_path / "hf", tmp_path / "back"
    cmd = (
        f"{sys.executable} {script} export --run_dir {run} --out {out} && "
        f"{sys.executable} {script} import --hf_dir {out} --out {back}"
    )
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "flags: --model.vocab_size 512 --model.d_model 64" in r.stdout, r.stdout
    with pytest.raises(hfio.HFError, match=f"--out {out} exists"):
        hf.export(str(run), str(out), progress=False)
    cfg2 = hf.model_config(hfio.read_config(str(out)))
    with jax.set_mesh(mesh()):
        target = jax.eval_shape(lambda k: {"params": hf.model.init(cfg2, k)}, jax.random.key(0))
        restored, _ = checkpoint.restore(checkpoint.latest(str(back / "checkpoints")), target)
        again = hf.export_params(
            restored["params"], cfg2, str(tmp_path / "again"), tokenizer_file, max_length=32, progress=False
        )
    a, b = tensors(str(out)), tensors(again)
    assert all(np.array_equal(a[n].view(np.uint8), b[n].view(np.uint8)) for n in a) and sorted(a) == sorted(b)
    assert json.load(open(out / "config.json"))["max_position_embeddings"] == 32
