"""Evaluation beyond loss: the capability probes (shared/probes.py) and the lm-eval model (shared/lm_eval_model.py).

Fast: the probes' sequences (each answer is what the task says it is), the scorer against the model's own
logits, the probes on the eval cadence of a tiny run, config errors; with lm-eval installed (the `eval`
extra), its errors (an unknown task, a task file that does not parse, a checkpoint without its tokenizer).
Integration: real lm-eval runs of the offline tasks in evals/tasks, and dense exported to Hugging Face and
run by lm-eval's own `hf` model against this adapter, document by document.
"""

import importlib.util
import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh

from shared import data
from shared import probes as probes_command
from shared.evals import harness, probes
from shared.config import ConfigError
from shared.variant import ROOT, load

TASKS = os.path.join(ROOT, "evals", "tasks")
HAS_LM_EVAL = importlib.util.find_spec("lm_eval") is not None
PROBE_FLAGS = {
    "probes__sets": "mqar,passkey,copy",
    "probes__mqar_pairs": 3,
    "probes__mqar_gap": 10,
    "probes__passkey_depths": "0,0.5,1",
    "probes__passkey_len": 3,
    "probes__copy_len": 8,
    "probes__rows": 16,
}


def roles():
    return probes.vocab_roles(512, eos_id=7, special=[3])


# ---------------------------------------------------------------- the probes' sequences


def test_mqar_answers_are_the_values_of_the_queried_keys():
    cfg = probes.ProbeConfig(sets="mqar", mqar_pairs=5, mqar_gap=20)
    r = roles()
    toks, ans = probes.make_set("mqar", cfg, r, 64, 12, seed=1)
    assert toks.shape == ans.shape == (12, 65) and toks.dtype == np.int32
    for t, a in zip(toks, ans):
        assert t[-1] == r.eos and not np.isin(t[:-1], [r.eos, 3]).any()
        pairs = dict(zip(t[64 - 4 * 5 - 20 : 64 - 2 * 5 - 20 : 2], t[64 - 4 * 5 - 20 + 1 : 64 - 2 * 5 - 20 : 2]))
        assert len(pairs) == 5 and set(pairs) <= set(r.keys) and set(pairs.values()) <= set(r.values)
        where = np.flatnonzero(a)
        assert len(where) == 5
        for i in where:  # the token before an answer is a key seen before; the answer is its value
            assert t[i - 1] in pairs and t[i] == pairs[t[i - 1]]
            assert i - 1 - list(t).index(t[i - 1]) > 20  # at least the gap between the pair and its query


def test_passkey_answers_are_the_key_at_its_depth():
    cfg = probes.ProbeConfig(sets="passkey", passkey_depths="0,0.5,1", passkey_len=4)
    r = roles()
    assert probes.set_names(cfg) == ["passkey_0", "passkey_50", "passkey_100"]
    for name, depth in zip(probes.set_names(cfg), (0, 0.5, 1)):
        toks, ans = probes.make_set(name, cfg, r, 64, 4, seed=1)
        for t, a in zip(toks, ans):
            first = list(t).index(r.marker)
            assert first == round(depth * (64 - 10))
            assert list(t[first + 1 : first + 5]) == list(t[a])  # the key the answers repeat
            assert t[59] == r.marker and np.flatnonzero(a).tolist() == [60, 61, 62, 63]


def test_copy_answers_repeat_the_span():
    cfg = probes.ProbeConfig(sets="copy", copy_len=10)
    toks, ans = probes.make_set("copy", cfg, roles(), 32, 4, seed=3)
    for t, a in zip(toks, ans):
        assert t[21] == roles().sep and list(t[11:21]) == list(t[a])


def test_roles_are_disjoint_and_fixed():
    r, again = roles(), roles()
    sets = [set(r.keys), set(r.values), set(r.filler), {r.marker}, {r.sep}]
    assert sum(map(len, sets)) == len(set().union(*sets))  # disjoint
    assert not set().union(*sets) & {7, 3}  # never eos or a special token
    assert (r.keys == again.keys).all() and r.marker == again.marker


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"sets": "mqar,recall"}, "probes.sets"),
        ({"sets": "copy,copy"}, "probes.sets"),
        ({"passkey_depths": "0.5,1.5"}, "probes.passkey_depths"),
        ({"passkey_depths": "half"}, "probes.passkey_depths"),
        ({"rows": 0}, "probes.rows"),
        ({"mqar_gap": -1}, "probes.mqar_gap"),
    ],
)
def test_probe_config_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        probes.ProbeConfig(**kw)


def test_a_probe_longer_than_a_row_is_refused(tiny_dense, tmp_path):
    with pytest.raises(ConfigError, match=r"probes\.mqar_pairs.*seq_len=32"):
        tiny_dense.config(tmp_path / "run", probes__sets="mqar", probes__mqar_pairs=8)  # 4 x 8 + 32 > 32
    with pytest.raises(ConfigError, match=r"probes\.copy_len"):
        tiny_dense.config(tmp_path / "run", probes__sets="copy", probes__copy_len=16)


# ---------------------------------------------------------------- scoring


def test_score_is_the_models_log_softmax_and_argmax():
    model = load(os.path.join(ROOT, "variants", "dense", "model.py"))
    cfg = model.ModelConfig(vocab_size=128, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, d_ff=64)
    m = mesh(8, (4, 2))
    with jax.set_mesh(m):
        params = jax.jit(lambda k: model.init(cfg, k))(jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 128, (12, 17)).astype(np.int32)  # 12 rows: the last batch padded
    lp, greedy = probes.score(model, params, cfg, m, tokens, batch=8)
    with jax.set_mesh(m):
        logits = np.asarray(jax.jit(lambda p, t: model.forward(p, t, cfg))(params, jnp.asarray(tokens[:, :-1])))
    ref = jax.nn.log_softmax(logits, axis=-1)
    want = np.take_along_axis(np.asarray(ref), tokens[:, 1:, None], -1)[..., 0]
    assert lp.shape == greedy.shape == (12, 16)
    np.testing.assert_allclose(lp, want, atol=1e-5)
    assert (greedy == (logits.argmax(-1) == tokens[:, 1:])).all()


def test_a_probe_named_like_a_source_says_to_rename_the_source(tiny_dense, tmp_path):
    """A mixture source named like a probe (both report eval/<name>/loss) is refused before anything runs,
    naming the source, not a --data.eval set."""
    d = os.path.dirname(tiny_dense.corpus)
    mix = data.DataConfig(source=f"text={d}/*coder.py.txt@1,mqar={d}/*s*.py.txt@1", val_fraction=0.2)
    with pytest.raises(
        ConfigError,
        match=r"probes.sets: probe set\(s\) \['mqar'\] have the name of a source of "
        r"data.source .* rename that source",
    ):
        tiny_dense.train.main(tiny_dense.config(tmp_path / "run", data=mix, **PROBE_FLAGS))
    assert not os.path.exists(tmp_path / "run")


# ---------------------------------------------------------------- lm-eval: errors


@pytest.mark.skipif(HAS_LM_EVAL, reason="lm-eval is installed: this checks the message without it")
def test_without_lm_eval_the_command_says_what_to_install(capsys):
    from shared import lm_eval_model

    assert lm_eval_model.main(["--run_dir", "x", "--tasks", "stencil_mc"]) == 2
    assert "pip install -e '.[eval]'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def lm_eval_model():
    pytest.importorskip("lm_eval", reason="the eval extra: pip install -e '.[eval]'")
    from shared import lm_eval_model

    return lm_eval_model


def test_a_task_file_that_does_not_parse_is_named(lm_eval_model, tmp_path):
    bad = tmp_path / "tasks"
    shutil.copytree(TASKS, bad)
    (bad / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n")
    with pytest.raises(harness.LMEvalError, match=r"broken\.yaml does not parse"):
        harness.check_tasks("stencil_mc", str(bad))
    with pytest.raises(harness.LMEvalError, match="not a directory"):
        harness.check_tasks("stencil_mc", str(tmp_path / "nowhere"))


# ---------------------------------------------------------------- lm-eval: real runs


def test_a_third_party_notice_shows_once_per_process(caplog):
    """The filter on lm-eval's task logger: the same notice for another task is dropped; an error is not."""
    from shared.evals import harness

    harness.ONCE.seen.clear()
    log = logging.getLogger("lm_eval.api.task")
    with caplog.at_level(logging.WARNING):
        for task in ("stencil_mc", "stencil_ppl", "stencil_mc"):
            log.warning(f"{task}: Custom kwargs can be passed to `--metadata` in console")
        log.warning("stencil_mc: another notice")
        log.error("stencil_mc: a failure")
        log.error("stencil_mc: a failure")
    assert [r.getMessage() for r in caplog.records] == [
        "stencil_mc: Custom kwargs can be passed to `--metadata` in console",
        "stencil_mc: another notice",
        "stencil_mc: a failure",
        "stencil_mc: a failure",
    ]


def test_write_makes_training_documents_of_one_probe(tmp_path, capsys):
    from tokenizers import Tokenizer

    vocab = {"<|eos|>": 0, **{f"w{i}": i for i in range(1, 300)}}
    tok = Tokenizer.from_str(
        json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<|eos|>"}})
    )
    tok.save(str(tmp_path / "tok.json"))
    out = tmp_path / "mqar"
    args = [
        "write",
        "mqar",
        "--out",
        str(out),
        "--tokenizer",
        str(tmp_path / "tok.json"),
        "--vocab_size",
        "300",
        "--seq_len",
        "40",
        "--n",
        "5",
        "--mqar_pairs",
        "4",
        "--mqar_gap",
        "8",
    ]
    assert probes_command.main(args) == 0
    docs = np.load(out / "mqar.npy").reshape(5, 41)
    assert (docs[:, -1] == 0).all() and not (docs[:, :-1] == 0).any()  # one eos, at the end of each document
    cfg = probes.ProbeConfig(sets="mqar", mqar_pairs=4, mqar_gap=8)
    evals, _ = probes.make_set("mqar", cfg, probes.run_roles(tok, 300, 0), 40, 5, seed=1)
    assert not any((d == e).all() for d in docs for e in evals)  # never an evaluation sequence
    assert os.path.isfile(out / "tokenizer.json")
    assert probes_command.main(args) == 2 and "not an empty directory" in capsys.readouterr().err  # nothing overwritten
    assert (
        probes_command.main([*args[:3], str(tmp_path / "other"), *args[4:-4], "--mqar_pairs", "9", "--mqar_gap", "8"])
        == 2
    )
    assert "probes.mqar_pairs" in capsys.readouterr().err  # 4 x 9 + 8 > 40
