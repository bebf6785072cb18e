"""Generation (shared/generate.py, `python -m shared.generate`) as a user relies on it: the sampling
rules, stopping at the end-of-text token and at max_len, a prompt decoding the same alone as in a
batch, the weights a checkpoint is read for (params or its moving average), one clear error for
each bad input, and the command end to end from a trained run directory and from a Hugging Face
directory. That the cache decodes as `forward` computes is the contract's (tests/contract/test_contract.py,
test_decoding_with_the_cache_is_forward), for every folder."""

import dataclasses
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from shared import data
from shared.data import sources
from shared.storage import checkpoint
from shared import decode
from shared import generate as gen
from shared.variant import ROOT, load

train = load(os.path.join(ROOT, "variants", "dense", "train.py"))
model = train.model


@pytest.fixture(scope="module")
def run(small_corpus, tmp_path_factory):
    """A run directory as train.py leaves it, without the training: a tiny dense model's initial weights
    saved as its checkpoint (with train.py's metadata) and the corpus's tokenizer.json."""
    d = tmp_path_factory.mktemp("generate") / "run"
    cfg = train.TrainConfig(
        data=data.DataConfig(source=small_corpus, val_fraction=0.1),
        model=model.ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128),
        seq_len=32,
        batch_size=8,
        steps=4,
        run_dir=str(d),
        wandb="disabled",
        sample_prompt="def ",
    )
    corpus = data.load_corpus(cfg.data, cfg.model.vocab_size, progress=False)
    os.makedirs(d)
    corpus.tokenizer.save(str(d / "tokenizer.json"))
    m = train.make_mesh(cfg)
    with jax.set_mesh(m):
        params = jax.jit(lambda k: model.init(cfg.model, k))(jax.random.key(3))
        checkpoint.save(
            str(d / "checkpoints"),
            4,
            {"params": params, "step": jnp.int32(4)},
            {"config": dataclasses.asdict(cfg), "variant": "dense"},
        )
    return {"dir": str(d), "cfg": cfg, "params": params, "corpus": corpus, "mesh": m}


def mesh(n=1):
    return jax.make_mesh((n, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:n])


def test_sample_in_the_train_loop_continues_the_prompt(run):
    """train.py's sample() (through generate(), on the run's 8-device mesh: one row a device) continues
    its prompt."""
    cfg, corpus = run["cfg"], run["corpus"]
    with jax.set_mesh(run["mesh"]):
        text = train.sample(run["params"], cfg, corpus, run["mesh"], 12, jax.random.key(1))
    assert text.startswith("def ") and len(text) > len("def "), text


def pick(logits, sampling, seed=0):
    with jax.set_mesh(mesh()):
        x = jax.device_put(np.asarray(logits, np.float32), jax.NamedSharding(mesh(), P("data", None)))
        return np.asarray(jax.jit(decode.pick, static_argnums=2)(x, jax.random.key(seed), sampling))


def test_sampling_rules():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 50)).astype(np.float32)
    greedy = logits.argmax(-1)
    assert (pick(logits, decode.Sampling()) == greedy).all()
    assert (pick(logits, decode.Sampling(temperature=5.0, top_k=1)) == greedy).all()
    assert (pick(logits, decode.Sampling(temperature=5.0, top_p=1e-6)) == greedy).all()
    top3 = np.argsort(-logits, axis=-1)[:, :3]
    for seed in range(3):
        got = pick(logits, decode.Sampling(temperature=3.0, top_k=3), seed)
        assert all(t in top3[b] for b, t in enumerate(got))
    # probabilities 0.4, 0.3, 0.2, 0.1: top_p keeps a token while the mass before it is below top_p
    probs = np.log(np.array([[0.4, 0.3, 0.2, 0.1]] * 256, np.float32))
    assert set(pick(probs, decode.Sampling(temperature=1.0, top_p=0.35)).tolist()) == {0}
    assert set(pick(probs, decode.Sampling(temperature=1.0, top_p=0.45)).tolist()) == {0, 1}
    assert set(pick(probs, decode.Sampling(temperature=1.0, top_p=0.75)).tolist()) == {0, 1, 2}
    assert set(pick(probs, decode.Sampling(temperature=1.0)).tolist()) == {0, 1, 2, 3}
    a, b = pick(logits, decode.Sampling(temperature=1.0), 7), pick(logits, decode.Sampling(temperature=1.0), 7)
    assert (a == b).all() and not (a == pick(logits, decode.Sampling(temperature=1.0), 8)).all()


def test_bad_inputs_get_one_clear_error():
    ok = [[1, 2, 3]] * 4
    decode.check_prompts(ok, max_len=8, vocab_size=10)
    for prompts, max_len, match in (
        ([], 8, "no prompts"),
        ([[1, 2], []], 8, "prompt 2 is empty"),
        ([[1] * 8], 8, "prompt 1 has 8 tokens, and max_len is 8"),
        ([[1, 12]], 8, r"outside the model's vocabulary of 10: \[12\]"),
    ):
        with pytest.raises(decode.GenerateError, match=match):
            decode.check_prompts(prompts, max_len=max_len, vocab_size=10)
    for kw, match in (
        ({"temperature": -1.0}, "--temperature"),
        ({"top_k": -2}, "--top_k"),
        ({"top_p": 0.0}, "--top_p"),
    ):
        with pytest.raises(decode.GenerateError, match=match):
            decode.Sampling(**kw)


def test_batch_eos_and_max_len(run):
    """A prompt decodes the same alone and in a batch of longer ones (left padding changes nothing); a
    row stops at the end-of-text token, the others go on; the batch stops at max_len."""
    cfg = run["cfg"].model
    prompts = [[5, 9, 200, 31, 7, 7, 100], [3], [44, 45, 46]]
    m = mesh(1)
    with jax.set_mesh(m):
        params = jax.device_put(
            jax.device_get(run["params"]), jax.tree.map(lambda s: jax.NamedSharding(m, s), model.param_specs(cfg))
        )
    kw = dict(mesh=m, max_new_tokens=8)
    batch = decode.generate(model, params, cfg, prompts, **kw)
    alone = [c.tokens for c in batch]
    assert (
        decode.generate(model, params, cfg, [prompts[1]], **kw)[0].tokens == alone[1]
    )  # 6 slots of padding in the batch
    assert all(c.stop == "max_new_tokens" for c in batch) and all(len(t) == 8 for t in alone)
    eos = alone[0][2]  # row 0's third token: row 0 stops there; another row stops where it says the same
    stopped = decode.generate(model, params, cfg, prompts, eos_id=eos, **kw)
    for c, full in zip(stopped, alone):
        want = full[: full.index(eos)] if eos in full else full
        assert c.tokens == want and c.stop == ("eos" if eos in full else "max_new_tokens")
    short = decode.generate(model, params, cfg, prompts, max_len=len(prompts[0]) + 3, **kw)
    assert [c.tokens for c in short] == [t[:3] for t in alone] and {c.stop for c in short} == {"max_len"}


def test_any_number_of_prompts_on_any_mesh(run):
    """The same greedy tokens and probe scores whatever the mesh: one device; 8 devices on `data` with 3
    prompts (the batch padded to 8 rows, the copies dropped); a run's mesh whose rows are split over
    `context` (data 2 x context 2 x model 2: decoding and scoring unsplit it, rows whole on every device,
    and a scored row of 9 tokens that 2 does not divide). Scored in batches of 3 rows, which no row axis
    here divides (rounded up to it)."""
    from shared.evals import probes

    cfg, host = run["cfg"], jax.device_get(run["params"])
    prompts = [[5, 9, 200, 31, 7, 7, 100], [3], [44, 45, 46]]
    rows = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (4, 10), dtype=np.int32)
    got = {}
    for name, m in (
        ("one device", mesh(1)),
        ("data 8", train.make_mesh(cfg)),
        ("context 2", train.make_mesh(dataclasses.replace(cfg, mesh_context=2, mesh_model=2))),
    ):
        with jax.set_mesh(m):
            params = jax.device_put(host, jax.tree.map(lambda s: jax.NamedSharding(m, s), model.param_specs(cfg.model)))
        done = decode.generate(model, params, cfg.model, prompts, mesh=m, max_new_tokens=6)
        lp, greedy = probes.score(model, params, cfg.model, m, rows, 3)  # rounded up to the row axes' multiple
        got[name] = ([c.tokens for c in done], lp, greedy)
    tokens, lp, greedy = got.pop("one device")
    assert len(tokens) == 3 and all(len(t) == 6 for t in tokens)
    for name, (t, l, g) in got.items():
        assert t == tokens, name
        np.testing.assert_allclose(l, lp, rtol=1e-4, atol=1e-4, err_msg=name)
        assert (g == greedy).all(), name


def cli(argv, capsys):
    code = gen.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_command_refusals(run, capsys, tmp_path):
    """One line for each bad input, exit 2, nothing generated (8 devices here: the data axis has 8)."""
    d = run["dir"]
    (tmp_path / "taken.jsonl").write_text("")
    for argv, expected in (
        ([d, "--prompt", "x", "--variant", "swa_hybrid"], "was saved by variant 'dense', not 'swa_hybrid'"),
        (
            [d, "--prompt", "a", "--prompt", "def f(x): return x + 1", "--max_len", "4"],
            "--prompt #2 has 1",
        ),  # 10+ tokens
        ([d, "--prompt", ""], "--prompt #1 is empty"),
        ([d, "--prompt", "a", "--out", str(tmp_path / "taken.jsonl")], "exists; choose a new file"),
        ([d], "no prompts"),
        ([d, "--prompt", "a", "--step", "3"], "no checkpoint"),
        ([str(tmp_path), "--prompt", "a"], "no complete checkpoint"),
        (["--prompt", "a"], "give a run directory or checkpoint, or --init_from hf:DIR"),
        ([d, "--prompt", "a", "--weights", "ema"], "keeps no moving average"),
        ([d, "--prompt", "a", "--temperature", "-1"], "--temperature must be >= 0"),
    ):
        code, out, err = cli(argv, capsys)
        assert code == 2 and expected in err and "Traceback" not in err, (argv, err)
        assert out == "", out
    code, _, err = cli([d, "--prompt", "def f(x): return x + 1", "--max_len", "4"], capsys)
    assert re.search(r"--prompt #1 has \d+ tokens, and max_len is 4: no room for a new token", err), err


def test_the_moving_average_is_read_when_the_run_kept_one(run, capsys, tmp_path):
    """--weights auto reads `ema` when the checkpoint's run kept one (here all zeros: every logit 0, so
    greedy picks token 0), `params` with --weights params; the command says which."""
    src = checkpoint.latest(os.path.join(run["dir"], "checkpoints"))
    meta = checkpoint.read_metadata(src)
    cfg = model.ModelConfig(**meta["config"]["model"])
    d = tmp_path / "run"
    with jax.set_mesh(mesh()):
        target = jax.eval_shape(lambda k: model.init(cfg, k), jax.random.key(0))
        params = checkpoint.restore(src, {"params": target})[0]["params"]
        state = {"params": params, "ema": jax.tree.map(jnp.zeros_like, params)}
        config = dict(meta["config"], optim=dict(meta["config"]["optim"], ema=0.99))
        checkpoint.save(str(d / "checkpoints"), 4, state, {"config": config, "variant": "dense"})
    shutil.copyfile(os.path.join(run["dir"], "tokenizer.json"), d / "tokenizer.json")
    args = [str(d), "--prompt", "def ", "--mesh_data", "8", "--max_new_tokens", "4", "--out", "-", "--ignore_eos"]
    code, out, err = cli(args + ["--prompt", "x"] * 7, capsys)
    assert code == 0 and "dense, ema)" in err, err
    tok, _ = sources.load_tokenizer(str(d / "tokenizer.json"))
    assert json.loads(out.splitlines()[0])["completion"] == tok.decode([0] * 4, skip_special_tokens=False)
    code, out, err = cli(args + ["--weights", "params"] + ["--prompt", "x"] * 7, capsys)
    assert code == 0 and "dense, params)" in err, err
    assert json.loads(out.splitlines()[0])["completion"] != tok.decode([0] * 4, skip_special_tokens=False)
