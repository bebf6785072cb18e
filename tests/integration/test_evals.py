"""The integration tier of tests/fast/test_evals.py (Evaluation beyond loss: the capability probes
(shared/probes.py) and the lm-eval model (shared/lm_eval_model.py)): the checks that start real processes or
servers, or run long. What they share with the fast half is imported from it."""

import json
import math
import os
import shutil
import subprocess
import sys
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import sub_env
from shared import decode
from shared.modelio import trained
from shared.evals import harness
from shared.variant import ROOT, discover, load
from fast.test_evals import PROBE_FLAGS, TASKS  # (tests/fast/test_evals.py)


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


@pytest.mark.integration  # lm-eval indexes its own thousands of task files (over 10 s) to say a name is none of them
def test_unknown_task_is_refused_with_near_names(lm_eval_model):
    with pytest.raises(harness.LMEvalError, match=r"unknown lm-eval task 'stencil_mcq'.*stencil_mc"):
        harness.check_tasks("stencil_mcq", TASKS)
    assert harness.check_tasks("stencil_mc, stencil_ppl", TASKS) == ["stencil_mc", "stencil_ppl"]


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
