"""Capability probes made on the fly: associative recall, passkey retrieval and copying, with an accuracy.

    python variants/kda/train.py --probes.sets mqar,passkey,copy            # eval/<probe>/accuracy on the eval cadence

Each probe is a batch of token sequences built from the run's own vocabulary (any tokenizer: the ids are
drawn from its ordinary tokens, never eos or an added special token), so nothing is downloaded and the
probe means the same for every variant trained with that tokenizer. A sequence is `seq_len` tokens and an
eos (one training row); some of its tokens are *answers*: a probe's accuracy is the fraction of answer
tokens the model predicts exactly (argmax of the logits at the position before), its loss the mean
negative log-likelihood of the answers.

  mqar     multi-query associative recall (Zoology's MQAR): `mqar_pairs` key-value pairs, `mqar_gap`
           filler tokens, then every key again in a shuffled order, each followed by its value (the
           answer). The recall distance is at least `mqar_gap` + 1 tokens.
  passkey  a repeating filler pattern with a marker and a `passkey_len`-token key inserted at a depth
           (a fraction of the sequence), and the marker again at the end, followed by the key (the
           answers). One set per depth of `passkey_depths` (`passkey_10` for depth 0.1, ...).
  copy     a random span of `copy_len` tokens, a separator, and the span again (the answers).

The roles (keys, values, markers, filler) are fixed subsets of the vocabulary (ROLE_SEED), so the
evaluation sequences (seed 1 + the set's index) and the training documents `python -m shared.probes write` makes (its
`--seed`, 0 by default) use the same tokens for the same roles but never the same sequences.

On the eval cadence (`--probes.sets`, shared/evals/__init__.py) every set is `probes.rows` sequences, scored by
`score` below: the folder's `model.forward` on rows sharded over the mesh, fp32 log-softmax. The same
scorer serves the lm-eval model (shared/evals/harness.py). Logged as eval/<set>/accuracy and
eval/<set>/loss. Training documents of a probe, for a mixture: shared/probes.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, reshard
from jax.sharding import PartitionSpec as P

from shared.config import ConfigError, check
from shared.decode import row_axes, rows_multiple
from shared.kernels import context

KINDS = ("mqar", "passkey", "copy")
ROLE_SEED = 0x5EED  # which vocabulary ids are keys, values, markers and filler: the same in every run
N_KEYS, N_VALUES, N_FILLER = 64, 64, 256  # at most; a small vocabulary gets proportionally fewer (vocab_roles)
FILLER_PERIOD = 7  # passkey's filler repeats a pattern of this many tokens (predictable, unlike the key)


@dataclass(frozen=True)
class ProbeConfig:
    sets: str = ""  # comma-separated probes evaluated on the eval cadence: mqar, passkey, copy ("" = none)
    rows: int = 32  # sequences per probe set (a multiple of the rows the batch is sharded over)
    mqar_pairs: int = 8  # key-value pairs per mqar sequence
    mqar_gap: int = 32  # filler tokens between the pairs and the queries (the recall distance is larger)
    passkey_depths: str = "0.1,0.5,0.9"  # where the key sits, as fractions of the sequence: one set per depth
    passkey_len: int = 4  # tokens of the key
    copy_len: int = 16  # tokens of the span copied

    def __post_init__(self):
        kinds = self.kinds()
        bad = sorted(set(kinds) - set(KINDS))
        check(not bad, "probes.sets", f"unknown probe(s) {bad}; the probes are {list(KINDS)}")
        check(len(set(kinds)) == len(kinds), "probes.sets", f"names a probe twice: {self.sets!r}")
        check(self.rows > 0, "probes.rows", f"must be positive, got {self.rows}")
        check(self.mqar_pairs > 0, "probes.mqar_pairs", f"must be positive, got {self.mqar_pairs}")
        check(self.mqar_gap >= 0, "probes.mqar_gap", f"must be >= 0, got {self.mqar_gap}")
        check(self.passkey_len > 0, "probes.passkey_len", f"must be positive, got {self.passkey_len}")
        check(self.copy_len > 0, "probes.copy_len", f"must be positive, got {self.copy_len}")
        self.depths()

    def kinds(self) -> list[str]:
        return [s.strip() for s in self.sets.split(",") if s.strip()]

    def depths(self) -> list[float]:
        try:
            d = [float(s) for s in self.passkey_depths.split(",") if s.strip()]
        except ValueError:
            raise ConfigError(
                f"probes.passkey_depths: {self.passkey_depths!r} is not comma-separated numbers"
            ) from None
        check(
            bool(d) and all(0 <= x <= 1 for x in d),
            "probes.passkey_depths",
            f"must be one or more fractions in [0, 1], got {self.passkey_depths!r}",
        )
        check(
            len({depth_name(x) for x in d}) == len(d),
            "probes.passkey_depths",
            f"two depths round to the same percent: {self.passkey_depths!r}",
        )
        return d

    def check_fits(self, seq_len: int) -> None:
        """Refuse a probe that does not fit in a row of seq_len tokens, naming the field to change."""
        need = {
            "mqar": (
                4 * self.mqar_pairs + self.mqar_gap,
                "probes.mqar_pairs",
                f"4 x mqar_pairs + mqar_gap = {4 * self.mqar_pairs + self.mqar_gap}",
            ),
            "passkey": (
                2 * self.passkey_len + 2,
                "probes.passkey_len",
                f"2 x passkey_len + 2 = {2 * self.passkey_len + 2}",
            ),
            "copy": (2 * self.copy_len + 1, "probes.copy_len", f"2 x copy_len + 1 = {2 * self.copy_len + 1}"),
        }
        for kind in self.kinds():
            n, name, what = need[kind]
            check(n <= seq_len, name, f"the {kind} probe needs {what} tokens, more than seq_len={seq_len}")


def depth_name(depth: float) -> str:
    return f"passkey_{round(depth * 100)}"


# ---------------------------------------------------------------- sequences


@dataclass
class Roles:
    keys: np.ndarray
    values: np.ndarray
    filler: np.ndarray
    marker: int  # passkey's marker
    sep: int  # copy's separator
    eos: int


def vocab_roles(vocab_size: int, eos_id: int, special=()) -> Roles:
    """Disjoint sets of ordinary token ids for each role, from a fixed permutation of the vocabulary."""
    skip = {int(eos_id), *map(int, special)}
    pool = np.array([i for i in range(vocab_size) if i not in skip], np.int64)
    if len(pool) < 16:
        raise ConfigError(f"probes: the vocabulary has {len(pool)} ordinary tokens; the probes need at least 16")
    pool = np.random.default_rng(ROLE_SEED).permutation(pool)
    n = len(pool) - 2
    k = min(N_KEYS, n // 4)
    v = min(N_VALUES, n // 4)
    f = min(N_FILLER, n - k - v)
    return Roles(
        pool[2 : 2 + k],
        pool[2 + k : 2 + k + v],
        pool[2 + k + v : 2 + k + v + f],
        int(pool[0]),
        int(pool[1]),
        int(eos_id),
    )


def make_mqar(rng, roles: Roles, seq_len: int, pairs: int, gap: int):
    """(tokens [seq_len + 1], answer mask [seq_len + 1]): filler, pairs, gap filler, queries, eos."""
    check(
        pairs <= len(roles.keys),
        "probes.mqar_pairs",
        f"{pairs} pairs need as many distinct keys; this vocabulary gives {len(roles.keys)}",
    )
    keys = rng.choice(roles.keys, pairs, replace=False)
    values = rng.choice(roles.values, pairs, replace=True)
    lead = seq_len - 4 * pairs - gap
    order = rng.permutation(pairs)
    toks = np.concatenate(
        [
            rng.choice(roles.filler, lead),
            np.stack([keys, values], 1).ravel(),
            rng.choice(roles.filler, gap),
            np.stack([keys[order], values[order]], 1).ravel(),
            [roles.eos],
        ]
    )
    answer = np.zeros(seq_len + 1, bool)
    answer[seq_len - 2 * pairs + 1 : seq_len : 2] = True  # the values of the queries
    return toks, answer


def make_passkey(rng, roles: Roles, seq_len: int, depth: float, key_len: int):
    pattern = rng.choice(roles.filler, FILLER_PERIOD)
    key = rng.choice(roles.keys, key_len)
    tail = np.concatenate([[roles.marker], key])  # the query: the marker again, then the key (answers)
    room = seq_len - 2 * len(tail)  # filler tokens
    at = round(depth * room)
    filler = np.resize(pattern, room)
    toks = np.concatenate([filler[:at], tail, filler[at:], tail, [roles.eos]])
    answer = np.zeros(seq_len + 1, bool)
    answer[seq_len - key_len : seq_len] = True
    return toks, answer


def make_copy(rng, roles: Roles, seq_len: int, length: int):
    span = rng.choice(np.concatenate([roles.keys, roles.values]), length)
    lead = seq_len - 2 * length - 1
    toks = np.concatenate([rng.choice(roles.filler, lead), span, [roles.sep], span, [roles.eos]])
    answer = np.zeros(seq_len + 1, bool)
    answer[seq_len - length : seq_len] = True
    return toks, answer


def make_set(name: str, cfg: ProbeConfig, roles: Roles, seq_len: int, n: int, seed: int):
    """(tokens [n, seq_len + 1] int32, answers [n, seq_len + 1] bool) of the probe set `name`
    (mqar, copy, passkey_<percent>)."""
    rng = np.random.default_rng([seed, sum(map(ord, name))])
    if name == "mqar":
        one = functools.partial(make_mqar, rng, roles, seq_len, cfg.mqar_pairs, cfg.mqar_gap)
    elif name == "copy":
        one = functools.partial(make_copy, rng, roles, seq_len, cfg.copy_len)
    else:
        depth = {depth_name(d): d for d in cfg.depths()}[name]
        one = functools.partial(make_passkey, rng, roles, seq_len, depth, cfg.passkey_len)
    toks, ans = zip(*(one() for _ in range(n)))
    return np.stack(toks).astype(np.int32), np.stack(ans)


def set_names(cfg: ProbeConfig) -> list[str]:
    out = []
    for kind in cfg.kinds():
        out += [depth_name(d) for d in cfg.depths()] if kind == "passkey" else [kind]
    return out


# ---------------------------------------------------------------- scoring


@functools.partial(jax.jit, static_argnames=("model", "cfg"))
def _score(params, tokens, *, model, cfg):
    logits = model.forward(params, tokens[:, :-1], cfg)  # [B, T, V] fp32, rows over the batch axes
    logits = reshard(logits, P(jax.typeof(logits).sharding.spec[0], None, None))  # whole rows of the vocabulary
    target = tokens[:, 1:]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), target[..., None], axis=-1)[..., 0]
    greedy = jnp.argmax(logits, axis=-1) == target
    return reshard(logp, P()), reshard(greedy, P())  # replicated: every process reads them


def score(model, params, cfg, mesh, tokens: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(log-probability [N, T] of each next token, whether it is the argmax [N, T]) of rows tokens [N, T + 1],
    in batches of `batch` rows (rounded up to a multiple of the mesh's row axes; the last batch padded with copies
    of a row).
    Rows are whole on every device (a `context` axis is unsplit: their lengths need not divide it). Every
    process must call it with the same arguments."""
    params, mesh = context.unsplit(params, mesh)
    rows = rows_multiple(model, cfg, mesh)
    batch = -(-batch // rows) * rows  # rounded up to a multiple of the devices the rows are sharded over
    n = len(tokens)
    pad = (-n) % batch
    tokens = np.concatenate([tokens, np.repeat(tokens[-1:], pad, 0)]) if pad else tokens
    spec = P(row_axes(model, cfg) or None, None)
    lps, greedy = [], []
    with jax.set_mesh(mesh):
        for i in range(0, len(tokens), batch):
            x = np.ascontiguousarray(tokens[i : i + batch], np.int32)
            arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx, x=x: x[idx])
            lp, g = _score(params, arr, model=model, cfg=cfg)
            lps.append(np.asarray(lp))
            greedy.append(np.asarray(g))
    return np.concatenate(lps)[:n], np.concatenate(greedy)[:n]


def evaluate(model, params, cfg, mesh, sets: dict, batch: int) -> dict:
    """{eval/<set>/accuracy, eval/<set>/loss} of every set {name: (tokens, answers)}."""
    params, mesh = context.unsplit(params, mesh)  # once for every set
    row = {}
    for name, (tokens, answers) in sets.items():
        lp, g = score(model, params, cfg, mesh, tokens, batch)
        mask = answers[:, 1:]
        row[f"eval/{name}/accuracy"] = float(g[mask].mean())
        row[f"eval/{name}/loss"] = float(-lp[mask].mean())
    return row


def eval_sets(cfg: ProbeConfig, tokenizer, vocab_size: int, eos_id: int, seq_len: int) -> dict:
    """The probe sets of a run: {name: (tokens, answers)}, from the run's tokenizer (or its vocab_size)."""
    roles = run_roles(tokenizer, vocab_size, eos_id)
    return {name: make_set(name, cfg, roles, seq_len, cfg.rows, seed=1 + i) for i, name in enumerate(set_names(cfg))}


def run_roles(tokenizer, vocab_size: int, eos_id: int) -> Roles:
    """The roles over the tokenizer's ordinary tokens (its added tokens left out), else over vocab_size ids."""
    if tokenizer is None:
        return vocab_roles(vocab_size, eos_id)
    special = list(tokenizer.get_added_tokens_decoder())
    return vocab_roles(min(vocab_size, tokenizer.get_vocab_size()), eos_id, special)
