"""The integration tier of tests/fast/test_generate.py (Generation (shared/generate.py, `python -m
shared.generate`) as a user relies on it: the sampling rules, stopping at the end-of-text token and at
max_len, a prompt decoding the same alone as in a batch, the weights a checkpoint is read for (params or its
moving average), one clear error for each bad input, and the command end to end from a trained run directory
and from a Hugging Face directory. That the cache decodes as `forward` computes is the contract's
(tests/contract/test_contract.py, test_decoding_with_the_cache_is_forward), for every folder): the checks that start
real processes or servers, or run long. What they share with the fast half is imported from it."""

import json
import os
import subprocess
import sys
import jax
import pytest
from shared.data import sources
from shared import decode
from shared.variant import ROOT, load
from fast.test_generate import mesh, model  # (tests/fast/test_generate.py)


@pytest.mark.integration  # subprocesses: the command as a user runs it, from a run directory and from hf:DIR
def test_command_end_to_end(run, tmp_path):
    """`python -m shared.generate` on 8 devices with 3 prompts: prompts from a JSONL file, greedy, JSONL out; the
    completions are generate()'s on the checkpoint's weights, and --init_from hf:DIR (the run exported
    by variants/dense/hf.py) gives the same."""
    hf = load(os.path.join(ROOT, "variants", "dense", "hf.py"))
    hf_dir = tmp_path / "hf"
    hf.export(run["dir"], str(hf_dir), progress=False)
    texts = ["def ", "import os\n", "class A:"]
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps(t) + "\n" for t in texts[:2]) + json.dumps({"prompt": texts[2]}) + "\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT}  # 8 devices (conftest.py): 3 prompts on a data axis of 8
    base = [
        sys.executable,
        "-m",
        "shared.generate",
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--max_new_tokens",
        "10",
        "--ignore_eos",
    ]
    outs = {}
    for name, source in (("run", [run["dir"]]), ("hf", ["--init_from", f"hf:{hf_dir}"])):
        out = tmp_path / f"{name}.jsonl"
        r = subprocess.run(
            base + source + ["--out", str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
        )
        assert r.returncode == 0, r.stderr
        outs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    assert outs["run"] == outs["hf"], (outs["run"], outs["hf"])
    tok, _ = sources.load_tokenizer(os.path.join(run["dir"], "tokenizer.json"))
    cfg = run["cfg"].model
    m = mesh(1)
    with jax.set_mesh(m):
        params = jax.device_put(
            jax.device_get(run["params"]), jax.tree.map(lambda s: jax.NamedSharding(m, s), model.param_specs(cfg))
        )
    want = decode.generate(
        model, params, cfg, [tok.encode(t, add_special_tokens=False).ids for t in texts], mesh=m, max_new_tokens=10
    )
    assert [r["prompt"] for r in outs["run"]] == texts
    assert [r["completion"] for r in outs["run"]] == [tok.decode(c.tokens, skip_special_tokens=False) for c in want]
    assert all(r["new_tokens"] == 10 and r["stop"] == "max_new_tokens" for r in outs["run"])
