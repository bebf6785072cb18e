"""Every documented training command runs: each `python <folder>/train.py ...` line of a fenced code block in
README.md, docs/ and the folders' READMEs, exactly as written with flags appended for size only (SIZE: two
steps of 8 rows of 32 tokens, a few evaluation rows, small probes, a 4-token sample; a preset's model
shrunk to a tiny one) and `--run_dir` in the test's directory, in the order the doc gives them, so that a
documented command cannot crash (the default end-of-run sample included). `/tmp/` paths move under the
test's directory, and the `python -m shared.probes write` lines of a doc run first (the data its commands
train on). The README's first command (the built-in default) runs as a user runs it on a fresh machine:
its own process on one CPU device; its `--resume true` continues that run here, on 8 devices.

A command that cannot run here is in NOT_RUN with the reason; a training command in neither fails the
test, so a new one is run or explained. In the integration tier: about twenty short runs."""

import glob
import os
import shlex


from shared.variant import ROOT

from helpers import fenced  # noqa: E402  (tests/helpers.py)

DOCS = ["README.md"] + sorted(
    os.path.relpath(p, ROOT)
    for pattern in ("docs/*.md", "variants/*/README.md", "templates/*/README.md")
    for p in glob.glob(os.path.join(ROOT, pattern))
)

SIZE = [
    "--steps",
    "2",
    "--warmup_steps",
    "-1",
    "--seq_len",
    "32",
    "--batch_size",
    "8",
    "--eval_batches",
    "1",
    "--sample_tokens",
    "4",
    "--data.max_bytes",
    "400000",
    "--probes.rows",
    "8",
    "--probes.mqar_pairs",
    "2",
    "--probes.mqar_gap",
    "4",
    "--probes.passkey_len",
    "2",
    "--probes.copy_len",
    "4",
    "--lm_eval_limit",
    "2",
    "--wandb",
    "disabled",
]
PRESET_MODEL = [
    "--model.vocab_size",
    "512",
    "--model.d_model",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "2",
    "--model.head_dim",
    "16",
    "--model.d_ff",
    "128",
]
PROBE_WRITE_SIZE = ["--n", "64"]

NOT_RUN = {
    "variants/dense/train.py --help": "not a run (tests/fast/test_docs.py runs every command's --help)",
    "variants/my_idea/train.py --steps 50 --run_dir /tmp/runs/my_idea": "a copy the reader makes first (cp -r); tests/contract/test_contract.py checks such copies",
    "variants/dense/train.py --data.source my_corpus/*.jsonl": "the reader's own data (tests/fast/test_data.py reads JSONL)",
    "variants/dense/train.py --data.source /data/web": "the reader's own data",
    "variants/dense/train.py --data.source web=/data/web@0.7,code=/data/code@0.3 --data.eval "
    "wiki=/data/wiki_val,py=held_out/*.py": "the reader's own data (tests/fast/test_data.py evaluates named sets)",
    "variants/dense/train.py --init_from hf:DIR --steps 1000": "DIR is the reader's Hugging Face model (tests/fast/test_hf.py starts runs from one)",
}


def lines(doc: str) -> list[list[str]]:
    """The `python ...` lines of a doc's fenced blocks as argv (after `python`), comments dropped, in order."""
    out = []
    for line in fenced(doc):
        line = line.split("  #")[0].split(" # ")[0]
        for part in line.split("&&"):
            words = shlex.split(part)
            while words and "=" in words[0] and words[0].split("=")[0].isupper():  # XLA_FLAGS=... python ...
                words = words[1:]
            if len(words) > 1 and words[0] in ("python", "python3"):
                out.append(words[1:])
    return out


def trains(argv) -> bool:
    return argv[0].endswith("/train.py")


def test_every_documented_training_command_is_run_or_explained():
    """A training command in a doc is run above or listed in NOT_RUN with its reason; NOT_RUN names only
    commands that are still in the docs."""
    seen = set()
    for doc in DOCS:
        for argv in lines(doc):
            if trains(argv):
                seen.add(" ".join(argv))
    assert set(NOT_RUN) <= seen, f"NOT_RUN names commands no doc has any more: {sorted(set(NOT_RUN) - seen)}"
