"""Decoding with a cache, for every variant: prompts (token ids) in, new tokens out.

`generate(model, params, cfg, prompts, mesh=..., max_new_tokens=...)` runs the prompts as one batch,
left-padded to the longest (model.prefill), then one cached step per new token (model.decode_step).
A row stops at the end-of-text token (`eos_id`), after `max_new_tokens`, or when the batch reaches
`max_len` slots. Sampling (`Sampling`): greedy at temperature 0, else softmax at that temperature over
the `top_k` most likely tokens (0 = all) and within them the smallest set whose probability reaches
`top_p` (1 = all). The batch's rows are sharded over the cache's row axes (`data`, and `expert` for
moe_hero); any number of prompts runs on any mesh: the batch is padded with copies of the last prompt
to a multiple of those axes, and the copies' rows are dropped. A mesh that splits rows over `context`
(a run's, for train.py's samples) decodes with rows whole on every device (context.unsplit).

train.py's `sample()`, the probes' row counts (shared/probes.py) and the commands
(`python -m shared.generate`, shared/generate.py; lm-eval's generate_until, shared/lm_eval_model.py)
call it, so every sample takes the same path.

UNVERIFIED ON GPU: prefill and decoding have run on CPU only (the tests, tools/bench/bench_generate.py).
On a GPU, prefill's attention goes through shared/kernels like training's (with segment ids for
the left padding); decoding's attention is plain JAX in each model.py.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, reshard
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from shared.errors import StencilError
from shared.kernels import context


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
            raise GenerateError(
                f"{name} has {len(p)} tokens, and max_len is {max_len}: no room for a new token "
                "(shorten it, or raise --max_len)"
            )
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise GenerateError(f"{name} has token ids outside the model's vocabulary of {vocab_size}: {bad[:5]}")


def generate(
    model,
    params,
    cfg,
    prompts: list[list[int]],
    *,
    mesh,
    max_new_tokens: int,
    max_len: int | None = None,
    sampling: Sampling = Sampling(),
    key=None,
    eos_id: int | None = None,
    progress: bool = False,
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
        tokens[b, T - len(p) :] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    rows = P(row_axes(model, cfg) or None)
    place = lambda x, spec: jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])  # noqa: E731
    out = [[] for _ in prompts]
    stop = [None] * B
    with jax.set_mesh(mesh):
        key = jax.random.wrap_key_data(key)
        cache = jax.jit(model.init_cache, static_argnums=(0, 1, 2))(cfg, B, T + steps)
        kw = dict(model=model, cfg=cfg, sampling=sampling)
        token, cache = _first(
            params, place(tokens, P(*rows, None)), place(lengths, rows), cache, jax.random.fold_in(key, 0), **kw
        )
        bar = None
        if progress:
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
