"""Generate text with a cache, for every variant: prompts in, new tokens out.

    python -m shared.generate runs/dense-20260101-120000 --prompt "def " --max_new_tokens 64
    python -m shared.generate RUN --prompt "import " --prompt "class " --temperature 0.8 --top_p 0.95 --seed 1
    python -m shared.generate RUN/checkpoints/step_00000200 --prompts prompts.txt --out completions.jsonl
    python -m shared.generate --init_from hf:/models/llama-tiny --prompt "Hello"
    python -m shared.generate --help

Where the weights come from: a run directory (its newest complete checkpoint, or `--step N`),
one checkpoint (a `step_XXXXXXXX` path or URL), or `--init_from hf:DIR` (a Hugging Face model
directory, through the `hf.py` of the folder whose class it is). A checkpoint records the variant
that saved it (`variant` in its metadata) and its model config: the model is that folder's
`model.py` (shared/variant.py), so one command serves every variant, and a checkpoint of another
variant than `--variant` names is refused. Only the weights are read, not the optimizer state:
the moving average `ema` when the run kept one (`--weights auto`, the default; the weights
evaluation uses), else `params`; the command says which. The tokenizer is the run's own
`tokenizer.json` (`--tokenizer` for another file with the same ids).

Prompts: `--prompt TEXT` (repeatable), or `--prompts FILE`: one prompt per line, or JSONL (a
`.jsonl` file: each line a JSON string or an object with a "prompt" field). They run as one batch,
left-padded to the longest (model.prefill), then one cached step per new token
(model.decode_step). Each row stops at the end-of-text token (unless `--ignore_eos`), after
`--max_new_tokens`, or when the batch reaches `--max_len` slots (default: the run's seq_len, the
length it was trained at). Sampling: greedy at `--temperature 0` (the default), else softmax at that
temperature over the `--top_k` most likely tokens (0 = all) and within them the smallest set whose
probability reaches `--top_p` (1 = all), from `--seed`.

Output: each prompt and its completion as text on stdout, or JSONL (`--out FILE`, `--out -` for
stdout): {"prompt", "completion", "new_tokens", "stop": "eos" | "max_new_tokens" | "max_len"}.
The batch's rows are sharded over the mesh's `data` axis (and `expert`, moe_hero; `--mesh_data` sets its
size; -1 = all devices); any number of prompts runs on any mesh: the batch is padded with copies of the
last prompt to a multiple of that axis, and the copies' rows are dropped. A mesh that splits rows over
`context` (a run's, for train.py's samples) decodes with rows whole on every device (context.unsplit).

The decoding is shared/decode.py (train.py's `sample()` calls the same `generate`); the weights,
shared/modelio/trained.py. UNVERIFIED ON GPU: see shared/decode.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

from shared.runtime import distributed
from shared.decode import GenerateError, Sampling, check_prompts, generate
from shared.modelio.trained import add_mesh_flags, load_weights


def _read_prompts(args) -> tuple[list[str], list[str]]:
    """(texts, names for messages) from --prompt flags and --prompts FILE."""
    texts, names = [], []
    for i, p in enumerate(args.prompt or []):
        texts.append(p)
        names.append(f"--prompt #{i + 1}")
    if args.prompts:
        try:
            lines = open(args.prompts, encoding="utf-8").read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise GenerateError(f"--prompts {args.prompts}: cannot be read ({type(e).__name__}: {e})") from e
        jsonl = args.prompts.endswith(".jsonl")
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            text = line
            if jsonl:
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise GenerateError(f"{args.prompts}:{n}: not JSON ({e})") from e
                text = obj.get("prompt") if isinstance(obj, dict) else obj
                if not isinstance(text, str):
                    raise GenerateError(
                        f'{args.prompts}:{n}: neither a JSON string nor an object with a string "prompt"'
                    )
            texts.append(text)
            names.append(f"{args.prompts}:{n}")
    return texts, names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m shared.generate",
        description=__doc__.split("\n\n", 1)[0] + "\n\n" + __doc__.split("\n\n", 1)[1].split("\n\nThe decoding is")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "source",
        nargs="?",
        default="",
        help="a run directory (its newest complete checkpoint) or a "
        "checkpoint (RUN/checkpoints/step_XXXXXXXX, or a URL)",
    )
    p.add_argument("--init_from", default="", help="hf:DIR, a Hugging Face model directory, instead of a checkpoint")
    p.add_argument("--step", type=int, default=None, help="with a run directory: this step's checkpoint")
    p.add_argument(
        "--variant",
        default="",
        help="the folder whose model.py to use (default: the one the checkpoint "
        "records; for hf:DIR, the folder whose hf.py imports its class)",
    )
    p.add_argument(
        "--weights",
        choices=("auto", "params", "ema"),
        default="auto",
        help="auto: the moving average when the run kept one, else params",
    )
    p.add_argument("--tokenizer", default="", help="tokenizer.json (default: the run's own, or DIR's)")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument(
        "--prompts",
        default="",
        help='a file of prompts: one per line, or .jsonl (JSON strings or objects with a "prompt")',
    )
    p.add_argument("--max_new_tokens", type=int, default=128, help="new tokens per prompt at most (default 128)")
    p.add_argument(
        "--max_len",
        type=int,
        default=0,
        help="slots per row: the longest prompt plus the new tokens "
        "(default: the run's seq_len; for hf:DIR, its max_position_embeddings)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument(
        "--top_p", type=float, default=1.0, help="nucleus: the smallest set reaching this probability (1 = all)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore_eos", action="store_true", help="do not stop at the end-of-text token")
    p.add_argument("--out", default="", help="write JSONL here (a new file; '-' = stdout) instead of text on stdout")
    add_mesh_flags(p)
    return p


def run(args) -> int:
    distributed.initialize()
    if bool(args.source) == bool(args.init_from):
        raise GenerateError("give a run directory or checkpoint, or --init_from hf:DIR (one of them)")
    if args.max_new_tokens < 1:
        raise GenerateError(f"--max_new_tokens must be positive, got {args.max_new_tokens}")
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    if args.out and args.out != "-" and os.path.exists(args.out):
        raise GenerateError(f"--out {args.out} exists; choose a new file (nothing is overwritten)")
    texts, names = _read_prompts(args)
    if not texts:
        raise GenerateError("no prompts: give --prompt TEXT or --prompts FILE")

    w = load_weights(
        args.source,
        init_from=args.init_from,
        step=args.step,
        variant=args.variant,
        weights=args.weights,
        tokenizer=args.tokenizer,
        mesh_data=args.mesh_data,
        mesh_model=args.mesh_model,
        mesh_expert=args.mesh_expert,
    )
    model, cfg, mesh, params, tok, eos, where = (
        w[k] for k in ("model", "cfg", "mesh", "params", "tokenizer", "eos_id", "where")
    )
    prompts = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    max_len = args.max_len or int(w["seq_len"] or 0) or max(len(p) for p in prompts) + args.max_new_tokens
    check_prompts(prompts, max_len, cfg.vocab_size, names)
    print(
        f"generating from {where}: {len(prompts)} prompts, up to {args.max_new_tokens} new tokens, "
        f"max_len {max_len}, mesh {dict(mesh.shape)}",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    done = generate(
        model,
        params,
        cfg,
        prompts,
        mesh=mesh,
        max_new_tokens=args.max_new_tokens,
        max_len=max_len,
        sampling=sampling,
        key=jax.random.key(args.seed),
        eos_id=None if args.ignore_eos else eos,
        progress=jax.process_index() == 0,
    )
    dt = time.perf_counter() - t0
    n = sum(len(c.tokens) for c in done)
    if jax.process_index() != 0:
        return 0
    print(
        f"{n} new tokens in {dt:.2f} s ({n / dt:,.1f} tokens/s, the first step's compilation included)", file=sys.stderr
    )
    if any(c.stop == "max_len" for c in done):
        print(
            f"warning: some rows stopped at max_len {max_len} before --max_new_tokens (raise --max_len)",
            file=sys.stderr,
        )
    rows = [
        {
            "prompt": t,
            "completion": tok.decode(c.tokens, skip_special_tokens=False),
            "new_tokens": len(c.tokens),
            "stop": c.stop,
        }
        for t, c in zip(texts, done)
    ]
    if args.out:
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        if args.out == "-":
            sys.stdout.write(lines)
        else:
            with open(args.out, "x", encoding="utf-8") as f:
                f.write(lines)
            print(f"wrote {len(rows)} completions to {args.out}", file=sys.stderr)
    else:
        for r in rows:
            print(f"=== {r['prompt']!r} ({r['new_tokens']} tokens, stop: {r['stop']})\n{r['prompt']}{r['completion']}")
    return 0


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except GenerateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
