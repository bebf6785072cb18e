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
import math
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh, sub_env

from shared import data, decode
from shared.modelio import trained
from shared import probes as probes_command
from shared.evals import harness, probes
from shared.config import ConfigError
from shared.variant import ROOT, discover, load

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


@pytest.mark.integration  # a long run: the loop with probes on its eval cadence
def test_probes_on_the_eval_cadence(tiny_dense, tmp_path):
    out = tiny_dense.train.main(tiny_dense.config(tmp_path / "run", steps=3, eval_every=3, save_every=0, **PROBE_FLAGS))
    rows = [json.loads(line) for line in open(os.path.join(out["run_dir"], "metrics.jsonl"))]
    last = [r for r in rows if "eval/loss" in r][-1]
    for name in ("mqar", "passkey_0", "passkey_50", "passkey_100", "copy"):
        assert 0 <= last[f"eval/{name}/accuracy"] <= 1
        assert last[f"eval/{name}/loss"] > 0
    # an untrained model: the answers' loss is about that of a guess over the vocabulary (512 tokens)
    assert abs(last["eval/mqar/loss"] - math.log(512)) < 1.5


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


@pytest.mark.integration  # lm-eval indexes its own thousands of task files (over 10 s) to say a name is none of them
def test_unknown_task_is_refused_with_near_names(lm_eval_model):
    with pytest.raises(harness.LMEvalError, match=r"unknown lm-eval task 'stencil_mcq'.*stencil_mc"):
        harness.check_tasks("stencil_mcq", TASKS)
    assert harness.check_tasks("stencil_mc, stencil_ppl", TASKS) == ["stencil_mc", "stencil_ppl"]


def test_a_task_file_that_does_not_parse_is_named(lm_eval_model, tmp_path):
    bad = tmp_path / "tasks"
    shutil.copytree(TASKS, bad)
    (bad / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n")
    with pytest.raises(harness.LMEvalError, match=r"broken\.yaml does not parse"):
        harness.check_tasks("stencil_mc", str(bad))
    with pytest.raises(harness.LMEvalError, match="not a directory"):
        harness.check_tasks("stencil_mc", str(tmp_path / "nowhere"))


@pytest.fixture(scope="module")
def dense_run(tiny_dense, tmp_path_factory):
    """A tiny dense run (fp32), 4 steps."""
    run = tmp_path_factory.mktemp("evals") / "dense"
    tiny_dense.train.main(tiny_dense.config(run, steps=4, eval_every=0, save_every=0))
    return str(run)


@pytest.mark.integration  # a long run: trains the tiny dense run it copies (dense_run)
def test_a_checkpoint_without_its_tokenizer_is_refused(lm_eval_model, dense_run, tmp_path, capsys):
    run = tmp_path / "copy"
    shutil.copytree(dense_run, run)
    os.remove(run / "tokenizer.json")
    code = lm_eval_model.main(["--run_dir", str(run), "--tasks", "stencil_mc", "--include_path", TASKS])
    assert code == 2 and "no tokenizer" in capsys.readouterr().err


@pytest.mark.integration  # lm-eval indexes its own thousands of task files (over 10 s) to say a name is none of them
def test_lm_eval_tasks_in_the_loop_are_checked_first(lm_eval_model, tiny_dense, tmp_path):
    with pytest.raises(harness.LMEvalError, match="unknown lm-eval task 'no_such_task'"):
        tiny_dense.train.main(tiny_dense.config(tmp_path / "run", lm_eval_tasks="no_such_task", lm_eval_include=TASKS))
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


# ---------------------------------------------------------------- lm-eval: real runs


@pytest.mark.integration  # a subprocess running lm-eval over the three offline tasks
def test_command_runs_the_offline_tasks(lm_eval_model, dense_run, tmp_path):
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        "-m",
        "shared.lm_eval_model",
        "--run_dir",
        dense_run,
        "--tasks",
        "stencil_mc,stencil_ppl,stencil_gen",
        "--include_path",
        TASKS,
        "--limit",
        "6",
        "--out",
        str(out),
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=sub_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "|stencil_mc " in p.stdout and "bits_per_byte" in p.stdout  # lm-eval's table
    res = json.load(open(out))["results"]
    assert 0 <= res["stencil_mc"]["acc,none"] <= 1 and 0 <= res["stencil_gen"]["exact_match,none"] <= 1
    assert 0 < res["stencil_ppl"]["bits_per_byte,none"] < 20
    again = subprocess.run(cmd, cwd=ROOT, env=sub_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and "exists" in again.stderr  # nothing is overwritten


@pytest.mark.integration  # lm-eval in the train loop (TaskManager, three tasks at every evaluation)
def test_lm_eval_in_the_loop(lm_eval_model, tiny_dense, tmp_path, capsys, caplog):
    """lm-eval's metrics on the eval cadence, in metrics.jsonl and on the console's eval line (metrics only);
    lm-eval's `--metadata` notice, which it logs at every evaluation, shows once."""
    from shared.evals import harness

    harness.ONCE.seen.clear()  # as in a new process
    out = tiny_dense.train.main(
        tiny_dense.config(
            tmp_path / "run",
            steps=2,
            eval_every=1,
            save_every=0,
            lm_eval_tasks="stencil_mc,stencil_ppl",
            lm_eval_limit=4,
            lm_eval_include=TASKS,
        )
    )
    rows = [json.loads(line) for line in open(os.path.join(out["run_dir"], "metrics.jsonl"))]
    last = [r for r in rows if "eval/loss" in r][-1]
    assert 0 <= last["eval/lm_eval/stencil_mc/acc"] <= 1
    assert last["eval/lm_eval/stencil_ppl/bits_per_byte"] > 0
    assert not [k for k in last if k.endswith("sample_len")], "lm-eval's sample count is no metric"
    shown = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("eval ")]
    assert len(shown) == 2 and "lm_eval/stencil_mc/acc " in shown[-1] and " bpb " in f" {shown[-1]} ", shown
    notices = [r for r in caplog.records if "--metadata" in r.getMessage()]
    assert len(notices) == 1, [r.getMessage()[:80] for r in notices]


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


def _samples(results, task):
    return {s["doc_id"]: s for s in results["samples"][task]}


@pytest.mark.integration  # Hugging Face: lm-eval's own `hf` model (transformers on torch) on the exported run
def test_hf_export_gives_the_same_loglikelihoods_as_the_adapter(lm_eval_model, dense_run, tmp_path):
    pytest.importorskip("torch", reason="lm-eval's hf model needs a torch (README, 'Set up and run': torch first)")
    pytest.importorskip("transformers", reason="lm-eval's hf model: pip install -e '.[eval]' 'lm-eval[hf]>=0.4.9,<0.5'")
    from lm_eval.models.huggingface import HFLM

    hf = load(os.path.join(ROOT, "variants", "dense", "hf.py"))
    out = hf.export(dense_run, str(tmp_path / "hf"), progress=False)
    args = lm_eval_model.parser().parse_args(["--run_dir", dense_run, "--tasks", "stencil_mc", "--batch_size", "8"])
    ours, _ = lm_eval_model.open_lm(args)
    theirs = HFLM(pretrained=out, dtype="float32", batch_size=4, device="cpu")
    assert theirs.max_length == ours.max_length == 32  # the run's seq_len: the perplexity documents take windows
    tasks = ["stencil_mc", "stencil_ppl"]
    a = harness.run_tasks(ours, tasks, include=TASKS, log_samples=True, bootstrap_iters=0)
    b = harness.run_tasks(theirs, tasks, include=TASKS, log_samples=True, bootstrap_iters=0)
    worst = 0.0
    for task in tasks:
        sa, sb = _samples(a, task), _samples(b, task)
        assert sa.keys() == sb.keys() and len(sa) >= 8
        for i in sa:
            x = np.array([r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in sa[i]["resps"]], float)
            y = np.array([r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in sb[i]["resps"]], float)
            worst = max(worst, float(np.abs(x - y).max()))
            np.testing.assert_allclose(x, y, atol=1e-4, rtol=0)
    print(f"\nmax |per-document log-likelihood difference| adapter vs hf: {worst:.2e}")
    assert a["results"]["stencil_mc"]["acc,none"] == b["results"]["stencil_mc"]["acc,none"]
    assert a["results"]["stencil_mc"]["acc_norm,none"] == b["results"]["stencil_mc"]["acc_norm,none"]


@pytest.mark.integration  # every folder's model at its CPU default (kda's chunked layers compile slowly on CPU)
@pytest.mark.parametrize("folder", discover())
def test_every_folders_loglikelihoods_do_not_depend_on_the_batch(lm_eval_model, folder):
    """Sorted, padded to a power of two and batched with rows of other lengths, a continuation's log-likelihood
    is the one of its row alone, unpadded (the folder's forward, log-softmax in the test)."""
    import argparse

    from tokenizers import Tokenizer

    model = load(os.path.join(ROOT, folder, "model.py"))
    cfg = model.ModelConfig()
    m = trained._mesh(folder, cfg, argparse.Namespace(mesh_data=-1, mesh_model=1, mesh_expert=1))
    with jax.set_mesh(m):
        params = jax.jit(lambda k: model.init(cfg, k))(jax.random.key(0))
    rows = decode.rows_multiple(model, cfg, m)
    tok = Tokenizer.from_str(
        '{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"<|eos|>": 0}, "unk_token": "<|eos|>"}}'
    )
    lm = harness.StencilLM(model, params, cfg, m, tok, eos_id=0, max_length=64, batch_size=rows)
    rng = np.random.default_rng(0)
    reqs = [
        (None, list(rng.integers(1, cfg.vocab_size, n)), list(rng.integers(1, cfg.vocab_size, 3)))
        for n in (5, 20, 40, 90)
    ]  # 90: left-truncated to the last 65 tokens
    got = lm._loglikelihood_tokens(reqs)
    with jax.set_mesh(m):
        for (_, ctx, cont), (ll, _) in zip(reqs, got):
            whole = np.array([(ctx + cont)[-65:]] * rows, np.int32)
            logits = jax.jit(lambda p, t: model.forward(p, t, cfg))(params, jnp.asarray(whole[:, :-1]))
            lp = np.take_along_axis(np.asarray(jax.nn.log_softmax(np.asarray(logits)[0], -1)), whole[0, 1:, None], -1)
            assert abs(ll - float(lp[-3:].sum())) < 1e-4, (folder, ll, float(lp[-3:].sum()))


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
