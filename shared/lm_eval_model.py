"""Every variant under EleutherAI's lm-evaluation-harness: an lm-eval model for a run, a checkpoint or hf:DIR.

    python -m shared.lm_eval_model --run_dir runs/dense-20260101-120000 --tasks hellaswag --limit 100 --out r.json
    python -m shared.lm_eval_model --run_dir RUN --tasks stencil_mc,stencil_ppl,stencil_gen --include_path evals/tasks --out r.json
    python -m shared.lm_eval_model --init_from hf:/models/llama-tiny --tasks lambada_openai --out r.json
    python -m shared.lm_eval_model --help

Needs the `eval` extra (`pip install -e '.[eval]'`: the lm-eval package). Where the weights come from is
as for `python -m shared.generate` (shared/generate.py): a run directory (its newest complete checkpoint,
or `--step N`), one checkpoint (RUN/checkpoints/step_XXXXXXXX or a URL), or `--init_from hf:DIR`; the
checkpoint names its variant, so one command serves every folder. The tokenizer is the run's own
tokenizer.json (`--tokenizer` for another file with the same ids); a checkpoint without one is refused.

How `StencilLM` scores each request kind (loglikelihood, loglikelihood_rolling, generate_until), its
batching and its max_length: shared/evals/harness.py's docstring, the one place it is described.

Output: lm-eval's table on stdout, and `--out FILE` (a new file): {"results", "versions", "n-shot",
"higher_is_better", "source", "max_length"} and with `--log_samples` every document's requests and
responses. Bad input is one `error:` line: an unknown task (with the near names), a task file under
--include_path that does not parse (the file and the cause), a checkpoint without its tokenizer.

In training: `--lm_eval_tasks T1,T2 [--lm_eval_limit N] [--lm_eval_include DIR]` on any train.py
evaluates the tasks on the eval cadence as eval/lm_eval/<task>/<metric> (shared/evals/__init__.py calls
`evaluate_in_loop`); off by default.

The lm-eval model and the task checks are shared/evals/harness.py; this module is the command.

Every process of a multi-process run takes part in every batch (each holds its rows of it) and computes
the same answers; only process 0 prints and writes. moe_hero: the padding of a batch's rows is routed
like any token (forward has no mask), so a padded row can take expert capacity from real tokens when
the capacity factor is tight; its scores can differ slightly with the batch.

UNVERIFIED ON GPU: this has run on CPU only (tests/fast/test_evals.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

from shared.runtime import distributed
from shared.config import ConfigError
from shared.decode import GenerateError, rows_multiple
from shared.errors import StencilError
from shared.evals.harness import LMEvalError, StencilLM, need_lm_eval, check_tasks, task_manager
from shared.modelio.trained import add_mesh_flags, load_weights


def open_lm(args) -> tuple:
    """(StencilLM, a description of the weights) of the command's flags."""
    need_lm_eval()
    try:
        w = load_weights(
            args.run_dir,
            init_from=args.init_from,
            step=args.step,
            variant=args.variant,
            weights=args.weights,
            tokenizer=args.tokenizer,
            mesh_data=args.mesh_data,
            mesh_model=args.mesh_model,
            mesh_expert=args.mesh_expert,
        )
    except GenerateError as e:
        raise LMEvalError(str(e)) from e
    max_length = args.max_length or int(w["seq_len"] or 0)
    if not max_length:
        raise LMEvalError(f"{w['where']} records no seq_len: pass --max_length")
    batch = args.batch_size or 4 * rows_multiple(w["model"], w["cfg"], w["mesh"])
    lm = StencilLM(
        w["model"],
        w["params"],
        w["cfg"],
        w["mesh"],
        w["tokenizer"],
        eos_id=w["eos_id"],
        max_length=max_length,
        batch_size=batch,
        seed=args.seed,
    )
    return lm, w["where"]


def parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(
        prog="python -m shared.lm_eval_model",
        description="\n\n".join(doc[:3]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--run_dir",
        default="",
        help="a run directory (its newest complete checkpoint) or a checkpoint "
        "(RUN/checkpoints/step_XXXXXXXX, or a URL)",
    )
    p.add_argument("--init_from", default="", help="hf:DIR, a Hugging Face model directory, instead of a checkpoint")
    p.add_argument("--step", type=int, default=None, help="with a run directory: this step's checkpoint")
    p.add_argument("--variant", default="", help="the folder whose model.py to use (default: the checkpoint's)")
    p.add_argument(
        "--weights",
        choices=("auto", "params", "ema"),
        default="auto",
        help="auto: the moving average when the run kept one, else params",
    )
    p.add_argument("--tokenizer", default="", help="tokenizer.json (default: the run's own, or DIR's)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include_path", default="", help="a folder of task YAMLs lm-eval reads too (evals/tasks)")
    p.add_argument("--limit", type=int, default=0, help="documents per task (0 = all)")
    p.add_argument(
        "--batch_size",
        type=int,
        default=0,
        help="rows per batch (default: 4 per device of the batch axes; rounded up to a multiple of them)",
    )
    p.add_argument("--max_length", type=int, default=0, help="tokens a row holds (default: the run's seq_len)")
    p.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of generation tasks that sample")
    p.add_argument("--log_samples", action="store_true", help="also write every document's requests and responses")
    p.add_argument("--out", default="", help="write the results as JSON here (a new file)")
    add_mesh_flags(p)
    return p


def run(args) -> int:
    need_lm_eval()
    distributed.initialize()
    if args.limit < 0:
        raise LMEvalError(f"--limit must be >= 0 (0 = all documents), got {args.limit}")
    if args.out and os.path.exists(args.out):
        raise LMEvalError(f"--out {args.out} exists; choose a new file (nothing is overwritten)")
    tasks = check_tasks(args.tasks, args.include_path)  # before the weights are read: a typo fails fast
    lm, where = open_lm(args)
    print(
        f"lm-eval on {where}: tasks {tasks}, max_length {lm.max_length}, batch {lm.batch_size}, "
        f"mesh {dict(lm.mesh.shape)}",
        file=sys.stderr,
    )
    from lm_eval import evaluator, utils  # the `eval` extra: imported only when asked for

    results = evaluator.simple_evaluate(
        model=lm,
        tasks=tasks,
        limit=args.limit or None,
        num_fewshot=args.num_fewshot,
        task_manager=task_manager(args.include_path, tasks),
        log_samples=args.log_samples,
    )
    if jax.process_index() != 0:
        return 0
    print(utils.make_table(results))
    if args.out:
        out = {k: results[k] for k in ("results", "versions", "n-shot", "higher_is_better") if k in results}
        out |= {"source": where, "max_length": lm.max_length}
        if args.log_samples:
            out["samples"] = results.get("samples", {})
        with open(args.out, "x", encoding="utf-8") as f:
            json.dump(out, f, indent=1, default=utils.handle_non_serializable)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except (LMEvalError, ConfigError, StencilError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
