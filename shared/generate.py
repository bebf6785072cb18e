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

As a library: `generate(model, params, cfg, prompts, mesh=..., max_new_tokens=...)`; train.py's
`sample()` calls it, so samples during training take the same path.

UNVERIFIED ON GPU: prefill and decoding have run on CPU only (the tests, tools/bench_generate.py).
On a GPU, prefill's attention goes through shared/kernels like training's (with segment ids for
the left padding); decoding's attention is plain JAX in each model.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, reshard
from jax.sharding import PartitionSpec as P

from shared.errors import StencilError
from shared.kernels import context
from shared.variant import ROOT, discover, load


class GenerateError(StencilError, ValueError):
    """Generation cannot run as asked (a prompt, the batch, the checkpoint, a flag); the message says why."""


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked from the logits: greedy at temperature 0."""
    temperature: float = 0.0
    top_k: int = 0  # keep the k most likely tokens (ties with the k-th included); 0 = all
    top_p: float = 1.0  # then the smallest set of them whose probability reaches top_p; 1 = all

    def __post_init__(self):
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise GenerateError(f"--temperature must be >= 0 and finite (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise GenerateError(f"--top_k must be >= 0 (0 = all tokens), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise GenerateError(f"--top_p must be in (0, 1] (1 = all tokens), got {self.top_p}")


@dataclass
class Completion:
    tokens: list  # the new tokens, without the end-of-text token
    stop: str  # "eos" | "max_new_tokens" | "max_len"


def pick(logits, key, sampling: Sampling):
    """Next tokens [B] int32 from logits [B, V] fp32, replicated on every device (so that every process
    can read them)."""
    logits = reshard(logits, P(jax.typeof(logits).sharding.spec[0], None))  # whole rows: top-k and sorting
    if sampling.temperature == 0:
        return reshard(jnp.argmax(logits, axis=-1).astype(jnp.int32), P())
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        ranked = jnp.sort(logits, axis=-1, descending=True)
        before = jnp.cumsum(jax.nn.softmax(ranked, axis=-1), axis=-1) - jax.nn.softmax(ranked, axis=-1)
        kept = jnp.where(before < sampling.top_p, ranked, jnp.inf)  # the mass before a token is below top_p
        logits = jnp.where(logits < jnp.min(kept, axis=-1, keepdims=True), -jnp.inf, logits)
    return reshard(jax.random.categorical(key, logits, axis=-1).astype(jnp.int32), P())


@functools.partial(jax.jit, static_argnames=("model", "cfg", "sampling"), donate_argnames=("cache",))
def _first(params, tokens, lengths, cache, key, *, model, cfg, sampling):
    logits, cache = model.prefill(params, tokens, cache, cfg, lengths=lengths)
    return pick(logits, key, sampling), cache


@functools.partial(jax.jit, static_argnames=("model", "cfg", "sampling"), donate_argnames=("cache",))
def _next(params, token, cache, key, *, model, cfg, sampling):
    logits, cache = model.decode_step(params, token, cache, cfg)
    return pick(logits, key, sampling), cache


def row_axes(model, cfg) -> tuple:
    """The mesh axes the cache's rows are sharded over (model.cache_specs: `data`, or moe_hero's ("data", "expert"))."""
    rows = model.cache_specs(cfg)["pos"][0]
    return () if rows is None else (rows,) if isinstance(rows, str) else tuple(rows)


def rows_multiple(model, cfg, mesh) -> int:
    """The number of rows a batch must be a multiple of on `mesh`."""
    return int(np.prod([mesh.shape[a] for a in row_axes(model, cfg)]))


def check_prompts(prompts, max_len: int, vocab_size: int, names=None) -> None:
    """Refuse what cannot run, naming the prompt: none, an empty one, one of max_len tokens or more
    (no room for a new token), a token id the model does not have."""
    names = names or [f"prompt {i + 1}" for i in range(len(prompts))]
    if not prompts:
        raise GenerateError("no prompts: give --prompt TEXT or --prompts FILE")
    for name, p in zip(names, prompts):
        if len(p) == 0:
            raise GenerateError(f"{name} is empty (no tokens): generation continues a prompt, so give it at least one")
        if len(p) >= max_len:
            raise GenerateError(f"{name} has {len(p)} tokens, and max_len is {max_len}: no room for a new token "
                                "(shorten it, or raise --max_len)")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise GenerateError(f"{name} has token ids outside the model's vocabulary of {vocab_size}: {bad[:5]}")


def generate(model, params, cfg, prompts: list[list[int]], *, mesh, max_new_tokens: int, max_len: int | None = None,
             sampling: Sampling = Sampling(), key=None, eos_id: int | None = None, progress: bool = False
             ) -> list[Completion]:
    """Continue each prompt (a list of token ids) by up to `max_new_tokens` tokens, as one batch on `mesh`.

    `model` is a folder's model module, `cfg` its ModelConfig, `params` on `mesh` (any number of prompts;
    a `context` axis above 1 is unsplit: see the module docstring). A row stops at
    `eos_id` (None: never), after max_new_tokens, or when the batch's slots reach `max_len`
    (default: the longest prompt + max_new_tokens). Every process must call it with the same arguments.
    """
    longest = max((len(p) for p in prompts), default=0)
    max_len = longest + max_new_tokens if max_len is None else max_len
    check_prompts(prompts, max_len, cfg.vocab_size)
    if max_new_tokens < 1:
        raise GenerateError(f"--max_new_tokens must be positive, got {max_new_tokens}")
    params, mesh = context.unsplit(params, mesh)  # rows whole on every device (a run's mesh may split them)
    asked = len(prompts)  # the batch is padded with copies of the last prompt to a multiple of the row axes
    prompts = list(prompts) + [prompts[-1]] * (-asked % rows_multiple(model, cfg, mesh))
    B, T = len(prompts), longest
    steps = min(max_new_tokens, max_len - T)
    key = np.asarray(jax.random.key_data(jax.random.key(0) if key is None else key))  # off the caller's mesh
    tokens = np.zeros((B, T), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, T - len(p):] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    rows = P(row_axes(model, cfg) or None)
    place = lambda x, spec: jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])  # noqa: E731
    out = [[] for _ in prompts]
    stop = [None] * B
    with jax.set_mesh(mesh):
        key = jax.random.wrap_key_data(key)
        cache = jax.jit(model.init_cache, static_argnums=(0, 1, 2))(cfg, B, T + steps)
        kw = dict(model=model, cfg=cfg, sampling=sampling)
        token, cache = _first(params, place(tokens, P(*rows, None)), place(lengths, rows), cache,
                              jax.random.fold_in(key, 0), **kw)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=steps, desc="generating", unit="tok", file=sys.stderr, leave=False)
        for i in range(steps):
            host = np.asarray(token)
            for b in range(B):
                if stop[b] is None:
                    if eos_id is not None and host[b] == eos_id:
                        stop[b] = "eos"
                    else:
                        out[b].append(int(host[b]))
            if bar:
                bar.update(1)
            if all(s is not None for s in stop[:asked]) or i == steps - 1:
                break
            token, cache = _next(params, token, cache, jax.random.fold_in(key, i + 1), **kw)
        if bar:
            bar.close()
    ended = "max_new_tokens" if steps == max_new_tokens else "max_len"
    return [Completion(o, s or ended) for o, s in zip(out[:asked], stop[:asked])]


# ---------------------------------------------------------------- the command

def _folders() -> dict:
    """Folder name (as checkpoints record it: `variant`) -> folder path relative to the repository."""
    return {os.path.basename(f): f for f in discover()}


def _folder(name: str) -> str:
    folders = _folders()
    if name in folders:
        return folders[name]
    path = name if os.path.isabs(name) else os.path.join(ROOT, name)
    if os.path.isfile(os.path.join(path, "model.py")):
        return path
    raise GenerateError(f"no variant {name!r}: the folders here are {sorted(folders)} (or give a folder's path)")


def _model_config(model, saved: dict, where: str):
    """The ModelConfig a checkpoint saved, refusing fields this folder's ModelConfig does not have."""
    known = {f.name for f in dataclasses.fields(model.ModelConfig)}
    unknown = sorted(set(saved) - known)
    if unknown:
        raise GenerateError(f"{where} has model fields this folder's ModelConfig lacks: {unknown} (was it saved "
                            "by another version of the variant?)")
    try:
        return model.ModelConfig(**saved)
    except (TypeError, ValueError) as e:
        raise GenerateError(f"{where}: its model config is refused: {e}") from e


def _checkpoint_path(source: str, step: int | None) -> tuple[str, str | None]:
    """(checkpoint path, the run directory or None) of a run directory or a checkpoint path."""
    from shared import checkpoint

    try:
        if checkpoint.is_url(source) or os.path.basename(source.rstrip("/")).startswith("step_"):
            if step is not None:
                raise GenerateError(f"--step {step} with a checkpoint's path ({source}): give its run directory instead")
            path = checkpoint.find(os.path.dirname(source.rstrip("/")), source)
            run = os.path.dirname(os.path.dirname(os.path.abspath(path))) if not checkpoint.is_url(path) else None
            return path, run
        if not os.path.isdir(source):
            raise GenerateError(f"{source} is neither a run directory nor a checkpoint (step_XXXXXXXX)")
        ckpts = os.path.join(source, "checkpoints")
        path = checkpoint.find(ckpts, str(step)) if step is not None else checkpoint.latest(ckpts)
        if path is None:
            raise GenerateError(f"{source}: no complete checkpoint in {ckpts}")
        return path, source
    except checkpoint.CheckpointError as e:
        raise GenerateError(str(e)) from e


def load_checkpoint(source: str, *, step=None, variant: str = "", weights: str = "auto"):
    """What generation needs of a checkpoint (a run directory or a checkpoint's path), as a dict: path, run
    (its run directory, None for a URL), folder, model (the folder's model module), cfg (ModelConfig),
    which ("params" or "ema": the weights to read), meta, seq_len (the run's, None if not recorded)."""
    from shared import checkpoint

    path, run = _checkpoint_path(source, step)
    try:
        meta = checkpoint.read_metadata(path)
    except (OSError, ValueError) as e:
        raise GenerateError(f"{path}: metadata unreadable ({e})") from e
    saved = meta.get("variant")
    if not saved:
        raise GenerateError(f"{path} does not record the variant that saved it; pass --variant")
    if variant and os.path.basename(os.path.normpath(variant)) != saved:
        raise GenerateError(f"{path} was saved by variant {saved!r}, not {variant!r}: its weights are another "
                            f"model's (leave out --variant, or pass --variant {saved})")
    folder = _folder(variant or saved)
    model = load(os.path.join(folder if os.path.isabs(folder) else os.path.join(ROOT, folder), "model.py"))
    config = meta.get("config") or {}
    cfg = _model_config(model, config.get("model") or {}, path)
    has_ema = float((config.get("optim") or {}).get("ema", 0.0) or 0.0) > 0
    if weights == "ema" and not has_ema:
        raise GenerateError(f"--weights ema: {path} keeps no moving average (its run had optim.ema 0)")
    which = "ema" if weights == "ema" or (weights == "auto" and has_ema) else "params"
    return dict(path=path, run=run, folder=folder, model=model, cfg=cfg, which=which, meta=meta,
                seq_len=config.get("seq_len"))


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
                    raise GenerateError(f"{args.prompts}:{n}: neither a JSON string nor an object with a string \"prompt\"")
            texts.append(text)
            names.append(f"{args.prompts}:{n}")
    return texts, names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m shared.generate", description=__doc__.split("\n\n", 1)[0] + "\n\n" +
                                __doc__.split("\n\n", 1)[1].split("\n\nAs a library")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", nargs="?", default="", help="a run directory (its newest complete checkpoint) or a "
                   "checkpoint (RUN/checkpoints/step_XXXXXXXX, or a URL)")
    p.add_argument("--init_from", default="", help="hf:DIR, a Hugging Face model directory, instead of a checkpoint")
    p.add_argument("--step", type=int, default=None, help="with a run directory: this step's checkpoint")
    p.add_argument("--variant", default="", help="the folder whose model.py to use (default: the one the checkpoint "
                   "records; for hf:DIR, the folder whose hf.py imports its class)")
    p.add_argument("--weights", choices=("auto", "params", "ema"), default="auto",
                   help="auto: the moving average when the run kept one, else params")
    p.add_argument("--tokenizer", default="", help="tokenizer.json (default: the run's own, or DIR's)")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--prompts", default="", help="a file of prompts: one per line, or .jsonl (JSON strings or "
                   "objects with a \"prompt\")")
    p.add_argument("--max_new_tokens", type=int, default=128, help="new tokens per prompt at most (default 128)")
    p.add_argument("--max_len", type=int, default=0, help="slots per row: the longest prompt plus the new tokens "
                   "(default: the run's seq_len; for hf:DIR, its max_position_embeddings)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus: the smallest set reaching this probability (1 = all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore_eos", action="store_true", help="do not stop at the end-of-text token")
    p.add_argument("--out", default="", help="write JSONL here (a new file; '-' = stdout) instead of text on stdout")
    add_mesh_flags(p)
    return p


def add_mesh_flags(p: argparse.ArgumentParser) -> None:
    """--mesh_data / --mesh_model / --mesh_expert: the mesh a command loads a model onto (also
    shared/lm_eval_model.py's)."""
    p.add_argument("--mesh_data", type=int, default=-1, help="devices on the data axis (-1 = all of them / the others; fewer: only the first data x model x expert devices)")
    p.add_argument("--mesh_model", type=int, default=1, help="devices on the model (tensor-parallel) axis")
    p.add_argument("--mesh_expert", type=int, default=1, help="devices on the expert axis (moe_hero)")


def _hf_folder(hf_dir: str, variant: str) -> str:
    """The folder whose hf.py imports the class of DIR's config.json."""
    from shared import hf as hfio

    try:
        hf_cfg = hfio.read_config(hf_dir)
    except hfio.HFError as e:
        raise GenerateError(f"--init_from: {e}") from e
    if variant:
        return _folder(variant)
    for folder in _folders().values():
        if os.path.isfile(os.path.join(ROOT, folder, "hf.py")):
            if load(os.path.join(ROOT, folder, "hf.py")).MODEL_TYPE == hf_cfg.get("model_type"):
                return folder
    raise GenerateError(f"--init_from {hf_dir}: no folder's hf.py imports model_type {hf_cfg.get('model_type')!r}; "
                        "pass --variant")


def _mesh(folder: str, cfg, args):
    """The folder's own mesh (train.make_mesh), sized by --mesh_data / --mesh_model / --mesh_expert: on every
    device with --mesh_data -1; with a --mesh_data that makes a mesh of fewer devices than the process has
    (one process), on its first devices."""
    train = load(os.path.join(folder if os.path.isabs(folder) else os.path.join(ROOT, folder), "train.py"))
    fields = {f.name for f in dataclasses.fields(train.TrainConfig)}
    mesh = {"mesh_data": args.mesh_data, "mesh_model": args.mesh_model}
    if "mesh_expert" in fields:
        mesh["mesh_expert"] = args.mesh_expert
    elif args.mesh_expert != 1:
        raise GenerateError(f"--mesh_expert: {os.path.basename(folder)} has no expert axis")
    devices = jax.devices()
    wanted = int(np.prod(list(mesh.values())))
    if args.mesh_data != -1 and wanted < len(devices) and jax.process_count() == 1:
        devices = devices[:wanted]
    try:  # a batch of one row per device divides any data axis (generate() pads the prompts to it)
        tc = train.TrainConfig(model=cfg, batch_size=len(devices), grad_accum=1, wandb="disabled", **mesh)
        return train.make_mesh(tc, devices)
    except ValueError as e:
        raise GenerateError(f"the mesh: {e}") from e


def load_weights(source: str, *, init_from: str = "", step=None, variant: str = "", weights: str = "auto",
                 tokenizer: str = "", mesh_data: int = -1, mesh_model: int = 1, mesh_expert: int = 1) -> dict:
    """What a command needs to run a model: a run directory or checkpoint (`source`) or `init_from` hf:DIR, read
    onto the folder's mesh. A dict: model (the folder's module), cfg, params, mesh, tokenizer, eos_id, seq_len
    (the run's, or DIR's max_position_embeddings; None if not recorded), folder, where (a description).
    shared/lm_eval_model.py calls it too."""
    from shared import checkpoint, data, sources
    from shared import hf as hfio

    if bool(source) == bool(init_from):
        raise GenerateError("give a run directory or checkpoint, or --init_from hf:DIR (one of them)")
    if init_from:
        if not init_from.startswith("hf:") or len(init_from) == 3:
            raise GenerateError(f"--init_from must be hf:DIR, got {init_from!r}")
        hf_dir = init_from[3:]
        folder = _hf_folder(hf_dir, variant)
        hf = load(os.path.join(ROOT, folder, "hf.py") if not os.path.isabs(folder) else os.path.join(folder, "hf.py"))
        try:
            cfg = hf.model_config(hfio.read_config(hf_dir))
            tok_path = tokenizer or hfio.hf_tokenizer(hf_dir)
        except hfio.HFError as e:
            raise GenerateError(f"--init_from: {e}") from e
        model, info = hf.model, None
        seq_len = hfio.read_config(hf_dir).get("max_position_embeddings")
        where = f"{hf_dir} ({os.path.basename(folder)})"
    else:
        info = load_checkpoint(source, step=step, variant=variant, weights=weights)
        folder, model, cfg, seq_len = info["folder"], info["model"], info["cfg"], info["seq_len"]
        tok_path = tokenizer or (os.path.join(info["run"], "tokenizer.json") if info["run"] else "")
        if not tok_path or not os.path.isfile(tok_path):
            raise GenerateError(f"no tokenizer: {tok_path or 'the checkpoint is not in a run directory'} does not exist; "
                                "pass --tokenizer (the tokenizer.json the run trained with)")
        where = f"{info['path']} ({os.path.basename(folder)}, {info['which']})"
    try:
        tok, _ = sources.load_tokenizer(tok_path)
        eos = sources.eos_id_of(tok)
    except data.DataError as e:
        raise GenerateError(f"--tokenizer: {e}") from e
    mesh = _mesh(folder, cfg, argparse.Namespace(mesh_data=mesh_data, mesh_model=mesh_model, mesh_expert=mesh_expert))
    with jax.set_mesh(mesh):
        if info is None:
            try:
                params = hf.import_params(hf_dir, cfg)
            except hfio.HFError as e:
                raise GenerateError(f"--init_from: {e}") from e
        else:
            target = {info["which"]: jax.eval_shape(lambda k: model.init(cfg, k), jax.random.key(0))}
            try:
                params = checkpoint.restore(info["path"], target)[0][info["which"]]
            except checkpoint.CheckpointError as e:
                raise GenerateError(f"{e} (is it a checkpoint of {os.path.basename(folder)}?)") from e
    return dict(model=model, cfg=cfg, params=params, mesh=mesh, tokenizer=tok, eos_id=eos, seq_len=seq_len,
                folder=folder, where=where)


def run(args) -> int:
    from shared import distributed

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

    w = load_weights(args.source, init_from=args.init_from, step=args.step, variant=args.variant, weights=args.weights,
                     tokenizer=args.tokenizer, mesh_data=args.mesh_data, mesh_model=args.mesh_model,
                     mesh_expert=args.mesh_expert)
    model, cfg, mesh, params, tok, eos, where = (w[k] for k in ("model", "cfg", "mesh", "params", "tokenizer", "eos_id",
                                                                "where"))
    prompts = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    max_len = args.max_len or int(w["seq_len"] or 0) or max(len(p) for p in prompts) + args.max_new_tokens
    check_prompts(prompts, max_len, cfg.vocab_size, names)
    print(f"generating from {where}: {len(prompts)} prompts, up to {args.max_new_tokens} new tokens, "
          f"max_len {max_len}, mesh {dict(mesh.shape)}", file=sys.stderr)
    t0 = time.perf_counter()
    done = generate(model, params, cfg, prompts, mesh=mesh, max_new_tokens=args.max_new_tokens, max_len=max_len,
                    sampling=sampling, key=jax.random.key(args.seed), eos_id=None if args.ignore_eos else eos,
                    progress=jax.process_index() == 0)
    dt = time.perf_counter() - t0
    n = sum(len(c.tokens) for c in done)
    if jax.process_index() != 0:
        return 0
    print(f"{n} new tokens in {dt:.2f} s ({n / dt:,.1f} tokens/s, the first step's compilation included)",
          file=sys.stderr)
    if any(c.stop == "max_len" for c in done):
        print(f"warning: some rows stopped at max_len {max_len} before --max_new_tokens (raise --max_len)",
              file=sys.stderr)
    rows = [{"prompt": t, "completion": tok.decode(c.tokens, skip_special_tokens=False), "new_tokens": len(c.tokens),
             "stop": c.stop} for t, c in zip(texts, done)]
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
