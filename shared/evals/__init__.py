"""What a run evaluates beyond its held-out loss, on the eval cadence: the capability probes
(shared/evals/probes.py: eval/<probe>/accuracy, eval/<probe>/loss) and lm-eval tasks
(shared/evals/harness.py: eval/lm_eval/<task>/<metric>).

    python variants/kda/train.py --probes.sets mqar,passkey,copy
    python variants/dense/train.py --lm_eval_tasks stencil_mc,stencil_gen --lm_eval_include evals/tasks

`EvalConfig` holds the flags (every TrainConfig derives from it, beside shared/run.py's RunConfig).
train.py builds an `Evaluator` from its own `model` module and hands it to the run harness
(`run.Run(cfg, HERE, mesh, evals.Evaluator(cfg, model, mesh))`), which opens it on the run's data
before anything is written (so a refusal leaves no run directory) and calls it with the evaluation
weights at every evaluation, off the throughput clock. The harness itself imports nothing of this.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field

from shared import data
from shared.config import at_least, check, check_fields
from shared.decode import rows_multiple
from shared.evals import harness, probes

EVAL_FIELDS = {
    "lm_eval_limit": at_least(0),
    "lm_eval_tasks": lambda v: (
        None if re.fullmatch(r"[\w.*,\- ]*", v, re.ASCII) else f"must be comma-separated lm-eval task names, got {v!r}"
    ),
    "lm_eval_include": lambda v: (
        None
        if v == "" or ("\0" not in v and os.path.isdir(v))
        else f"must be '' or a folder of lm-eval task YAMLs (evals/tasks), got {v!r}"
    ),
}


@dataclass
class EvalConfig:
    """The evaluation's settings, the same in every folder (flags of every train.py). Whether every probe fits
    in a row (seq_len) is train.py's check: `self.probes.check_fits(self.seq_len)`."""

    probes: probes.ProbeConfig = field(default_factory=probes.ProbeConfig)  # capability probes on the eval cadence
    lm_eval_tasks: str = ""  # lm-eval tasks on the eval cadence, comma-separated ("" = none; the `eval` extra)
    lm_eval_limit: int = 0  # documents per lm-eval task (0 = all of them)
    lm_eval_include: str = ""  # a folder of task YAMLs lm-eval reads too (evals/tasks: offline tasks)

    def __post_init__(self):
        check_fields(self, EVAL_FIELDS)
        check(
            not self.lm_eval_tasks or importlib.util.find_spec("lm_eval") is not None,
            "lm_eval_tasks",
            "needs the lm-eval package: pip install -e '.[eval]' (docs/evaluation.md)",
        )


class Evaluator:
    """The probes and lm-eval tasks of a run (`cfg`: its TrainConfig) with the folder's `model` on `mesh`.
    False when the run asks for neither."""

    def __init__(self, cfg, model, mesh):
        self.cfg, self.model, self.mesh = cfg, model, mesh
        self.sets, self.tasks, self.corpus = {}, [], None

    def __bool__(self) -> bool:
        return bool(self.cfg.probes.kinds() or self.cfg.lm_eval_tasks)

    def open(self, corpus, held_out: dict) -> None:
        """Build the probe sets from the run's tokenizer and check the lm-eval tasks exist; refuse a probe named
        like a held-out set (`held_out`: the run's, data.eval_sets: both would log eval/<name>/loss)."""
        cfg, self.corpus = self.cfg, corpus
        if cfg.probes.kinds():
            self.sets = probes.eval_sets(cfg.probes, corpus.tokenizer, cfg.model.vocab_size, corpus.eos_id, cfg.seq_len)
        both = sorted(set(self.sets) & set(held_out))
        sources = {n for n, _, _ in data.parse_sources(cfg.data.source, cfg.data.weights) if n}
        check(
            not both,
            "probes.sets",
            f"probe set(s) {both} have the name of "
            + (
                f"a source of data.source (eval/{both[0]}/ holds its held-out loss); rename that source, e.g. "
                f"recall=PATH"
                if set(both) & sources
                else "a --data.eval set; rename that set"
            ),
        )
        if cfg.lm_eval_tasks:  # refused now if a task is unknown, not after the first steps
            if corpus.tokenizer is None:
                raise data.DataError(
                    "lm_eval_tasks: lm-eval tasks are text, and this corpus has no tokenizer (set data.tokenizer)"
                )
            self.tasks = harness.check_tasks(cfg.lm_eval_tasks, cfg.lm_eval_include)

    def __call__(self, params) -> dict:
        """{eval/<probe>/accuracy, eval/<probe>/loss, eval/lm_eval/<task>/<metric>} with the weights `params`."""
        cfg, row = self.cfg, {}
        batch = rows_multiple(self.model, cfg.model, self.mesh)  # a row per device: its logits are whole
        if self.sets:
            row |= probes.evaluate(self.model, params, cfg.model, self.mesh, self.sets, batch)
        if self.tasks:
            lm = harness.StencilLM(
                self.model,
                params,
                cfg.model,
                self.mesh,
                self.corpus.tokenizer,
                eos_id=self.corpus.eos_id,
                max_length=cfg.seq_len,
                batch_size=batch,
            )
            row |= harness.metrics_of(
                harness.run_tasks(
                    lm, self.tasks, limit=cfg.lm_eval_limit, include=cfg.lm_eval_include, bootstrap_iters=0
                )
            )
        return row
