"""Every variant under EleutherAI's lm-evaluation-harness: `StencilLM`, an lm-eval model of a folder's
`model` with its weights on a mesh, and the task checks and runs that training (shared/evals/__init__.py)
and the command (`python -m shared.lm_eval_model`, shared/lm_eval_model.py) share.

Needs the `eval` extra (`pip install -e '.[eval]'`: the lm-eval package); without it this module imports,
and anything that needs lm-eval raises LMEvalError saying what to install.
`StencilLM` is an `lm_eval.api.model.LM` (through lm-eval's TemplateLM, which splits a request into
context and continuation tokens the way lm-eval's own `hf` model does):
  loglikelihood          every (context, continuation) as one row, left-truncated to the last
                         max_length + 1 tokens (lm-eval's rule: the oldest context goes first); an empty
                         context is the end-of-text token. Rows are scored in batches of `--batch_size`
                         (sharded over the mesh's batch axes), sorted by length and padded on the right to a
                         power of two (at most max_length), so a handful of shapes compile.
  loglikelihood_rolling  a document's log-likelihood in windows of max_length tokens, each predicting the
                         tokens the one before did not (lm-eval's get_rolling_token_windows, context 1).
  generate_until         greedy (or sampled at the task's temperature) cached decoding with the folder's
                         `init_cache` / `prefill` / `decode_step` (shared/decode.py), the context
                         left-truncated to max_length - max_gen_toks tokens, stopped at eos, at the
                         task's `until` strings (the text is cut before the first) or after max_gen_toks.
max_length is the run's seq_len by default (the length it was trained at; `--max_length`). The scores are
fp32 log-softmax of `model.forward`'s logits (shared/evals/probes.score).

Every process of a multi-process run takes part in every batch (each holds its rows of it) and computes
the same answers; only process 0 prints and writes. moe_hero: the padding of a batch's rows is routed
like any token (forward has no mask), so a padded row can take expert capacity from real tokens when
the capacity factor is tight; its scores can differ slightly with the batch.

UNVERIFIED ON GPU: this has run on CPU only (tests/fast/test_evals.py).
"""

from __future__ import annotations

import difflib
import glob
import json
import logging
import os

import jax
import numpy as np

from shared import decode
from shared.evals import probes
from shared.kernels import context
from shared.errors import StencilError

try:
    from lm_eval.api.model import TemplateLM
except ImportError:  # the `eval` extra is missing: --help still works, anything else says what to install
    TemplateLM = object

INSTALL = "this needs the lm-eval package: pip install -e '.[eval]' (docs/evaluation.md)"


class OncePerProcess(logging.Filter):
    """Lets a notice through the first time only. lm-eval logs "<task>: Custom kwargs can be passed to
    `--metadata` ..." each time it loads a task with a custom dataset, which is every evaluation of a run;
    the text after the task's name is the notice, and it is shown once per process."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        notice = record.getMessage().partition(": ")[2] or record.getMessage()
        if record.levelno >= logging.ERROR or notice not in self.seen:
            self.seen.add(notice)
            return True
        return False


ONCE = OncePerProcess()
logging.getLogger("lm_eval.api.task").addFilter(ONCE)  # where lm-eval's per-task notices come from


class LMEvalError(StencilError, ValueError):
    """lm-eval cannot run as asked (a task, a task file, the weights, the tokenizer, a flag); the message says why."""


def need_lm_eval() -> None:
    if TemplateLM is object:
        raise LMEvalError(INSTALL)


# ---------------------------------------------------------------- the tasks

_MANAGERS: dict = {}


def _parse_task_files(include: str) -> None:
    """Parse every YAML under `include`, naming the first that fails: lm-eval itself skips such a file without
    a word, and the task it held would then be reported as unknown."""
    from lm_eval.tasks._yaml_loader import load_yaml  # the `eval` extra: imported only when asked for

    if not os.path.isdir(include):
        raise LMEvalError(f"--include_path {include}: not a directory of task YAMLs")
    files = sorted(glob.glob(os.path.join(include, "**", "*.yaml"), recursive=True))
    if not files:
        raise LMEvalError(f"--include_path {include}: no .yaml task files in it")
    for path in files:
        try:
            cfg = load_yaml(path, resolve_func=False, recursive=True)
        except Exception as e:
            raise LMEvalError(f"task file {path} does not parse: {type(e).__name__}: {e}") from e
        if not isinstance(cfg, dict) or not any(k in cfg for k in ("task", "group", "tag", "include")):
            raise LMEvalError(f"task file {path} is not an lm-eval task: it names no task, group or tag")


def task_manager(include: str = "", names=()):
    """lm-eval's TaskManager over the YAMLs under `include` and, unless every name in `names` is one of those,
    lm-eval's own tasks too (indexing lm-eval's thousands of task files takes seconds). Built once each."""
    need_lm_eval()
    from lm_eval.tasks import TaskManager  # the `eval` extra: imported only when asked for

    if include and (include, False) not in _MANAGERS:
        _parse_task_files(include)
        _MANAGERS[include, False] = TaskManager(include_path=include, include_defaults=False)
    if include and names and all(_MANAGERS[include, False].match_tasks([n]) for n in names):
        return _MANAGERS[include, False]
    if (include, True) not in _MANAGERS:
        _MANAGERS[include, True] = TaskManager(include_path=include or None)
    return _MANAGERS[include, True]


def check_tasks(tasks: str, include: str = "") -> list[str]:
    """The task names of `tasks` (comma-separated), refusing an unknown one with the names closest to it."""
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise LMEvalError("no tasks: give --tasks NAME[,NAME...]")
    tm = task_manager(include, names)
    for name in names:
        if not tm.match_tasks([name]):
            near = difflib.get_close_matches(name, tm.all_tasks, n=5)
            where = f" or under {include}" if include else " (task YAMLs of your own: --include_path DIR)"
            raise LMEvalError(
                f"unknown lm-eval task {name!r}: not one of lm-eval's tasks{where}"
                + (f"; near names: {near}" if near else "")
            )
    return names


# ---------------------------------------------------------------- the model


class StencilLM(TemplateLM):
    """lm-eval's model for a folder's `model` with `params` on `mesh` (see the module docstring)."""

    def __init__(
        self, model, params, cfg, mesh, tokenizer, *, eos_id: int, max_length: int, batch_size: int, seed: int = 0
    ):
        need_lm_eval()
        super().__init__()
        if batch_size < 1:
            raise LMEvalError(f"--batch_size must be positive, got {batch_size}")
        if max_length < 2:
            raise LMEvalError(f"--max_length must be at least 2, got {max_length}")
        params, mesh = context.unsplit(params, mesh)  # rows whole on every device: a run's mesh may split them
        self.model, self.params, self.cfg, self.mesh = model, params, cfg, mesh
        rows = decode.rows_multiple(model, cfg, mesh)
        batch_size = -(-batch_size // rows) * rows  # a multiple of the devices the rows are sharded over
        self.tok, self.eos, self.max_length, self.batch_size, self.seed = (
            tokenizer,
            eos_id,
            max_length,
            batch_size,
            seed,
        )

    @property
    def eot_token_id(self) -> int:
        return self.eos

    @property
    def tokenizer_name(self) -> str:
        return "stencil"

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tok.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens) -> str:
        return self.tok.decode([int(t) for t in tokens], skip_special_tokens=False)

    def _score_rows(self, rows: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(log-probabilities, greedy) of every row's next tokens (a row: 2 .. max_length + 1 tokens)."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        out = [None] * len(rows)
        for s in range(0, len(order), self.batch_size):
            idx = order[s : s + self.batch_size]
            width = min(self.max_length, 1 << max(4, (len(rows[idx[0]]) - 2).bit_length()))  # inputs, a power of 2
            x = np.full((len(idx), width + 1), self.eos, np.int32)
            for j, i in enumerate(idx):
                x[j, : len(rows[i])] = rows[i]
            lp, greedy = probes.score(self.model, self.params, self.cfg, self.mesh, x, self.batch_size)
            for j, i in enumerate(idx):
                n = len(rows[i]) - 1
                out[i] = (lp[j, :n], greedy[j, :n])
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        rows, conts = [], []
        for _, prefix, continuation in requests:
            whole = (list(prefix) + list(continuation))[-(self.max_length + 1) :]
            rows.append(whole)
            conts.append(min(len(continuation), len(whole) - 1))
        answers = []
        for req, (lp, greedy), n in zip(requests, self._score_rows(rows), conts):
            answer = (float(np.sum(lp[len(lp) - n :], dtype=np.float64)), bool(np.all(greedy[len(greedy) - n :])))
            if req[0] is not None:
                self.cache_hook.add_partial("loglikelihood", req[0], answer)
            answers.append(answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils  # the `eval` extra: imported only when asked for

        windows, owner = [], []
        for k, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0])
            for ctx, cont in map(
                utils.make_disjoint_window,
                utils.get_rolling_token_windows(
                    tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
                ),
            ):
                windows.append((None, ctx, cont))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (lp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[k] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict = {}
        for k, req in enumerate(requests):
            prefix, kw = req.args
            groups.setdefault(json.dumps(kw, sort_keys=True, default=str), []).append((k, prefix, kw))
        out = [None] * len(requests)
        for items in groups.values():
            kw = dict(items[0][2])
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = int(kw.pop("max_gen_toks", 256))
            temperature = float(kw.pop("temperature", 0.0) or 0.0)
            sample = kw.pop("do_sample", None)
            sample = temperature > 0 if sample is None else bool(sample)  # as lm-eval's hf model reads them
            sampling = decode.Sampling(
                temperature=temperature if sample else 0.0,
                top_k=int(kw.pop("top_k", 0) or 0) if sample else 0,
                top_p=float(kw.pop("top_p", 1.0) or 1.0) if sample else 1.0,
            )
            keep = max(1, self.max_length - max_gen)  # the context's last tokens, leaving room for the new ones
            for s in range(0, len(items), self.batch_size):
                chunk = items[s : s + self.batch_size]
                prompts = [self.tok_encode(c)[-keep:] or [self.eos] for _, c, _ in chunk]
                done = decode.generate(
                    self.model,
                    self.params,
                    self.cfg,
                    prompts,
                    mesh=self.mesh,
                    max_new_tokens=max_gen,
                    max_len=min(self.max_length, max(map(len, prompts)) + max_gen),
                    sampling=sampling,
                    key=jax.random.key(self.seed),
                    eos_id=self.eos,
                )
                for (k, prefix, _), c in zip(chunk, done):
                    text = self.tok_decode(c.tokens)
                    for stop in until:
                        if stop:
                            text = text.split(stop)[0]
                    out[k] = text
                    self.cache_hook.add_partial("generate_until", (prefix, items[0][2]), text)
        return out


# ---------------------------------------------------------------- evaluating


def run_tasks(
    lm, tasks: list[str], *, limit: int = 0, include: str = "", log_samples: bool = False, bootstrap_iters: int = 1000
) -> dict:
    """lm-eval's simple_evaluate of `tasks` with `lm` (every process calls it: see the module docstring)."""
    from lm_eval import evaluator  # the `eval` extra: imported only when asked for

    return evaluator.simple_evaluate(
        model=lm,
        tasks=tasks,
        limit=limit or None,
        task_manager=task_manager(include, tasks),
        log_samples=log_samples,
        bootstrap_iters=bootstrap_iters,
    )


def metrics_of(results: dict) -> dict:
    """{eval/lm_eval/<task>/<metric>: value} of simple_evaluate's results (stderr and non-numbers left out)."""
    row = {}
    for task, res in results["results"].items():
        for key, v in res.items():
            metric = key.split(",")[0]
            if (
                metric.endswith("_stderr")
                or metric == "sample_len"
                or isinstance(v, bool)
                or not isinstance(v, (int, float))
            ):
                continue
            row[f"eval/lm_eval/{task}/{metric}"] = float(v)
    return row
