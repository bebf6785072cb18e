"""Helpers several test modules share (not a test module: no test module imports another). The tiny
configs live in conftest.py as fixtures (`tiny_dense`); these are plain functions."""

import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from shared.data import Split
from shared.variant import ROOT

DENSE = os.path.join(ROOT, "variants", "dense", "train.py")


FAST_CHECKS = ("loop", "context")  # the long per-folder checks a folder's FAST_TIER may name


def fast_tier(folder: str) -> tuple:
    """The long checks `folder`'s train.py keeps in the fast tier (its FAST_TIER, read with ast, never
    imported; none when it has no FAST_TIER): "loop" (tests/contract/test_loop.py, the loop with every feature on),
    "context" (tests/contract/test_contract.py, the row split over context 2). The others run in the integration tier,
    so a copy adds to the fast tier only what its parent kept there, and a new folder nothing."""
    import ast

    tree = ast.parse(open(os.path.join(ROOT, folder, "train.py")).read())
    for node in tree.body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) else None)
        )
        if isinstance(target, ast.Name) and target.id == "FAST_TIER":
            value = ast.literal_eval(node.value)
            unknown = set(value) - set(FAST_CHECKS)
            assert not unknown, (
                f"{folder}/train.py: FAST_TIER names {sorted(unknown)}; the long checks are {FAST_CHECKS}"
            )
            return tuple(value)
    return ()


def text(doc: str) -> str:
    """A file of the repository (a doc), by its path from the root."""
    with open(os.path.join(ROOT, doc)) as f:
        return f.read()


def fenced(doc: str) -> list[str]:
    """The lines of a Markdown doc's fenced code blocks, in order (a backslash joins a command's lines)."""
    out = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text(doc), re.S):
        out += [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return out


def spans(doc: str) -> list[str]:
    """The lines of fenced code blocks, then the inline code spans, of a Markdown doc."""
    return fenced(doc) + re.findall(r"(?<!`)`([^`\n]+)`(?!`)", re.sub(r"```.*?```", "", text(doc), flags=re.S))


def metric_rows(run_dir) -> list[dict]:
    """The rows of a run's metrics.jsonl, in order."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(run_dir) -> dict:
    """{step: train/loss} of a run's metrics.jsonl (the last row of a step wins)."""
    return {r["step"]: r["train/loss"] for r in metric_rows(run_dir) if "train/loss" in r}


def arrays(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def sub_env(**extra):
    """The environment of a train.py subprocess: no wandb, CPU, unbuffered, no multi-process settings, and
    no persistent compilation cache (with one, only process 0 writes entries (jax 0.10), so process 1
    compiles alone while process 0 waits in a collective, past gloo's fixed 30 s on a busy machine)."""
    env = dict(os.environ, WANDB_MODE="disabled", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    for k in ("STENCIL_COORDINATOR", "STENCIL_NUM_PROCESSES", "STENCIL_PROCESS_ID", "STENCIL_DISTRIBUTED"):
        env.pop(k, None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.update(extra)  # STENCIL_CACHE: conftest's session tmp dir, so the tokenizer is the in-process one
    return env


def finish(procs, timeout):
    """[(output, exit status)] of each process, waited for in turn; any still running after that is killed."""
    try:
        return [(p.communicate(timeout=timeout)[0], p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def wrap_step(monkeypatch, train, on_call):
    """train.make_train_step's steps call on_call(n, state, metrics) after the n-th step (1-based), which may
    return replacements (a poisoned update) or act (send a signal)."""
    real = train.make_train_step

    def made(*args):
        step, calls = real(*args), [0]

        def wrapped(state, batch):
            state, m = step(state, batch)
            calls[0] += 1
            return on_call(calls[0], state, m) or (state, m)

        return wrapped

    monkeypatch.setattr(train, "make_train_step", made)


def wait_for_step(run_dir, step, proc, timeout=240):
    """Until the run in `proc` has logged `step` (its metrics.jsonl); fails if it ends first."""
    t = time.time()
    while time.time() - t < timeout:
        if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and max(losses(run_dir), default=0) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before step {step}: {proc.communicate()[1][-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s")


# ---------------------------------------------------------------- checkpoints


def mesh(n, shape=None):
    shape = shape or (n, 1)
    return jax.make_mesh(shape, ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:n])


def ckpt_tree(m):
    """A small state sharded over the mesh `m`: an fp32 matrix, a bf16 vector, an int step."""
    with jax.set_mesh(m):
        return {
            "w": jax.device_put(jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16), P("data", "model")),
            "b": jax.device_put(jnp.arange(16, dtype=jnp.bfloat16), P(None)),
            "step": jnp.asarray(7, jnp.int32),
        }


# ---------------------------------------------------------------- data

VOCAB = 320


def write_corpus(tmp_path, n_docs=40, name="docs"):
    d = tmp_path / name
    d.mkdir()
    for i in range(n_docs):
        words = " ".join(f"word{(i * 7 + j) % 23}" for j in range(30 + i % 11))
        (d / f"doc{i:03d}.txt").write_text(f"document {i}: {words}\n")
    return d


def toy_split(lengths, eos=0):
    """Docs of the given lengths; token values 1.. within a doc, eos last."""
    toks = np.concatenate([np.r_[np.arange(1, n), eos] for n in lengths]).astype(np.uint16)
    return Split(toks, np.cumsum(lengths).astype(np.int64))
