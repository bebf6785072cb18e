"""Hugging Face model directories: the format half of every variant's `hf.py`.

A variant's `hf.py` knows its own mapping (which stencil leaf is which Hugging Face tensor,
which config fields correspond, which options have no counterpart); this module knows the
files, for every variant alike:

- safetensors shards and their index, written tensor by tensor (`write_safetensors`): a
  shard's header is planned from shapes alone, then each tensor is read, written and
  dropped, so an export never holds more than one tensor (one layer's slice of a stacked
  leaf) in host memory; and read back without copies (`Safetensors`, numpy memory maps);
- the tokenizer (`tokenizer.json` as it is, `tokenizer_config.json` naming the eos token),
  `config.json` and `generation_config.json` (`write_model_dir`), written under a `.tmp`
  name and renamed when complete: a killed export never leaves a directory that looks whole,
  and an existing directory is never overwritten;
- the stencil side: a run's checkpoint read leaf by leaf (`CheckpointLeaves`), params in
  memory read the same way (`ParamLeaves`), and an imported leaf placed on the current mesh
  with its PartitionSpec (`place`).

Errors a user causes (a missing file, a damaged header, an option a variant cannot
represent) raise `HFError`, whose message names the file or the config field.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from typing import Callable

import jax
import ml_dtypes
import numpy as np
from tqdm import tqdm

from shared.data import sources
from shared.storage import checkpoint
from shared.errors import StencilError


class HFError(StencilError, ValueError):
    """A Hugging Face directory or option that cannot be converted; the message names the field or file."""


def refuse(ok: bool, field: str, why: str) -> None:
    """Raise HFError naming `field` (a Hugging Face config field, or a stencil one) unless `ok`."""
    if not ok:
        raise HFError(f"{field}: {why}")


# ---------------------------------------------------------------- safetensors

DTYPES = {
    "F64": np.dtype("float64"),
    "F32": np.dtype("float32"),
    "F16": np.dtype("float16"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("int64"),
    "I32": np.dtype("int32"),
    "I16": np.dtype("int16"),
    "I8": np.dtype("int8"),
    "U8": np.dtype("uint8"),
    "BOOL": np.dtype("bool"),
}
CODES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Tensor:
    """One tensor to write: its name in the Hugging Face model, shape, dtype, and how to read it."""

    name: str
    shape: tuple
    dtype: np.dtype
    read: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000000' -> bytes."""
    t = str(text).strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for u, m in units.items():
        if t.endswith(u):
            t, mult = t[: -len(u)], m
            break
    else:
        mult = 1
    try:
        n = int(float(t) * mult)
    except ValueError:
        raise HFError(f"max_shard_size: {text!r} is not a size such as 5GB or 500MB") from None
    refuse(n > 0, "max_shard_size", f"must be positive, got {text!r}")
    return n


def _header(tensors: list[Tensor]) -> bytes:
    head, offset = {"__metadata__": {"format": "pt"}}, 0
    for t in tensors:
        head[t.name] = {
            "dtype": CODES[np.dtype(t.dtype)],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned


def write_safetensors(out: str, tensors: list[Tensor], max_shard_bytes: int, *, progress: bool = True) -> list[str]:
    """Write `tensors` as model-0000i-of-0000n.safetensors shards of at most `max_shard_bytes` each
    (a larger tensor gets a shard of its own) and model.safetensors.index.json; return the shard names.
    Each tensor is read when its turn comes and checked against its declared shape and dtype."""
    names = [t.name for t in tensors]
    refuse(len(set(names)) == len(names), "tensors", "two tensors have the same name")
    groups, size = [[]], 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    bar = tqdm(
        total=sum(t.nbytes for t in tensors),
        unit="B",
        unit_scale=True,
        desc="writing safetensors",
        disable=not progress,
    )
    for fname, group in zip(files, groups):
        header = _header(group)
        with open(os.path.join(out, fname), "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for t in group:
                a = np.asarray(t.read())
                if a.shape != tuple(t.shape) or a.dtype != t.dtype:
                    raise HFError(
                        f"tensor {t.name}: read {a.dtype}{list(a.shape)}, declared "
                        f"{t.dtype}{list(t.shape)} (the mapping is wrong)"
                    )
                f.write(np.ascontiguousarray(a).tobytes())
                bar.update(t.nbytes)
    bar.close()
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors)},
        "weight_map": {t.name: fname for fname, g in zip(files, groups) for t in g},
    }
    write_json(os.path.join(out, "model.safetensors.index.json"), index)
    return files


class Safetensors:
    """The tensors of a Hugging Face directory (model.safetensors, or shards with an index), as
    read-only numpy memory maps: nothing is read until a tensor is used."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.isfile(index):
            try:
                weight_map = json.load(open(index))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise HFError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from e
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            files = ["model.safetensors"]
        else:
            raise HFError(
                f"{directory}: no model.safetensors or model.safetensors.index.json "
                "(only safetensors weights are read, not pytorch_model.bin)"
            )
        self.entries = {}  # name -> (file, dtype, shape, offset)
        for fname in files:
            path = os.path.join(directory, fname)
            try:
                with open(path, "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    head = json.loads(f.read(n))
                size = os.path.getsize(path)
            except (OSError, ValueError, struct.error) as e:
                raise HFError(f"{path}: not a safetensors file ({type(e).__name__}: {e})") from e
            for name, e in head.items():
                if name == "__metadata__":
                    continue
                if e.get("dtype") not in DTYPES:
                    raise HFError(f"{path}: tensor {name} has dtype {e.get('dtype')!r}, which is not read here")
                begin, end = e["data_offsets"]
                if 8 + n + end > size:
                    raise HFError(
                        f"{path}: tensor {name} ends at byte {8 + n + end} but the file has {size} (truncated)"
                    )
                self.entries[name] = (path, DTYPES[e["dtype"]], tuple(e["shape"]), 8 + n + begin)

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple:
        return self.entries[name][2]

    def get(self, name: str) -> np.ndarray:
        if name not in self.entries:
            raise HFError(f"{self.directory}: no tensor {name}")
        path, dtype, shape, offset = self.entries[name]
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


# ---------------------------------------------------------------- config and tokenizer files


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def read_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise HFError(f"{directory}: no config.json (not a Hugging Face model directory)")
    try:
        cfg = json.load(open(path))
    except (OSError, ValueError) as e:
        raise HFError(f"{path}: unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(cfg, dict):
        raise HFError(f"{path}: not a JSON object")
    return cfg


def check_architecture(hf: dict, architecture: str, model_type: str) -> None:
    """Refuse a config.json of another class, naming what it is."""
    archs = hf.get("architectures") or []
    refuse(
        hf.get("model_type") == model_type,
        "model_type",
        f"{hf.get('model_type')!r} ({', '.join(archs) or 'no architectures'}); this variant imports "
        f"{model_type} ({architecture}) only",
    )
    refuse(not archs or archs == [architecture], "architectures", f"{archs}; this variant imports [{architecture!r}]")


def rope_theta(hf: dict, default: float) -> float:
    """The RoPE base of a config.json, refusing any RoPE scaling (old `rope_scaling` or new `rope_parameters`)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    refuse(
        not scaling or scaling.get("rope_type", scaling.get("type")) == "default",
        "rope_scaling",
        f"{scaling} is not supported: stencil's RoPE has no scaling (plain theta ** (-2i / head_dim) frequencies)",
    )
    refuse(
        params.get("rope_type", "default") == "default",
        "rope_parameters.rope_type",
        f"{params.get('rope_type')!r} is not supported: stencil's RoPE has no scaling (rope_type 'default' only)",
    )
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    refuse(partial in (None, 1.0), "partial_rotary_factor", f"{partial}: stencil rotates the whole head_dim")
    return float(params.get("rope_theta", hf.get("rope_theta", default)))


def tokenizer_eos(tokenizer_path: str) -> tuple[str, int]:
    """(the end-of-document token, its id) of a tokenizer.json: the first of shared/data/'s candidates it has."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(tokenizer_path)
    except Exception as e:
        raise HFError(f"tokenizer {tokenizer_path}: cannot be loaded ({type(e).__name__}: {e})") from e
    for name in sources.EOS_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return name, i
    raise HFError(f"tokenizer {tokenizer_path}: has none of the end-of-document tokens {sources.EOS_CANDIDATES}")


def hf_tokenizer(directory: str) -> str:
    """The tokenizer.json of a Hugging Face directory, for training from it (`--init_from hf:DIR`)."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        raise HFError(
            f"{directory}: no tokenizer.json (a fast tokenizer file is needed; pass --data.tokenizer "
            "to use another one with the same ids)"
        )
    tokenizer_eos(path)
    return path


def write_model_dir(
    out: str,
    config: dict,
    tensors: list[Tensor],
    tokenizer_path: str,
    *,
    max_length: int,
    max_shard_bytes: int,
    progress: bool = True,
) -> str:
    """A complete Hugging Face model directory at `out` (which must not exist): config.json (`config`, plus
    the eos token's id as bos/eos/pad), generation_config.json, tokenizer.json and tokenizer_config.json,
    and the safetensors shards with their index. Written as `out.tmp` and renamed when complete.

    `max_length` (the trained row length) goes to config.json's `max_position_embeddings` (the variant's
    `config`) and tokenizer_config.json's `model_max_length`, never to generation_config.json: there it
    would be a generation length that transformers' `generate(max_new_tokens=...)` warns about."""
    out = os.path.abspath(out)
    if os.path.exists(out):
        raise HFError(f"--out {out} exists; choose a new directory (an export never overwrites one)")
    eos, eos_id = tokenizer_eos(tokenizer_path)
    tmp = out + ".tmp"
    if os.path.exists(tmp):  # left by a killed export
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        ids = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
        write_json(os.path.join(tmp, "config.json"), {**config, **ids})
        write_json(os.path.join(tmp, "generation_config.json"), ids)  # no max_length: see the docstring
        shutil.copyfile(tokenizer_path, os.path.join(tmp, "tokenizer.json"))
        # stencil adds no BOS and ends every document with eos (shared/data/)
        write_json(
            os.path.join(tmp, "tokenizer_config.json"),
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": eos,
                "pad_token": eos,
                "model_max_length": max_length,
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
            },
        )
        write_safetensors(tmp, tensors, max_shard_bytes, progress=progress)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------- the stencil side


class CheckpointLeaves:
    """A run's checkpoint read leaf by leaf (or one layer of a stacked leaf at a time), without restoring it.

    `step` None: the newest complete checkpoint of `run_dir/checkpoints`. The files are checked
    against their CRC32s first: a damaged checkpoint is never exported."""

    def __init__(self, run_dir: str, step: int | None = None):
        ckpt_dir = os.path.join(run_dir, "checkpoints")
        try:
            self.path = checkpoint.find(ckpt_dir, str(step)) if step is not None else checkpoint.latest(ckpt_dir)
        except (checkpoint.CheckpointError, OSError) as e:
            raise HFError(f"--run_dir {run_dir}: {e}") from e
        if self.path is None:
            raise HFError(f"--run_dir {run_dir}: no complete checkpoint in {ckpt_dir}")
        problems = checkpoint.verify(self.path, checksums=True)
        if problems:
            raise HFError(f"checkpoint {self.path} is damaged: {'; '.join(problems[:5])}")
        self.meta = checkpoint.read_metadata(self.path)
        self._open = {}

    def leaf(self, path: tuple):
        name = "params." + ".".join(path)
        if name not in self._open:
            self._open[name] = checkpoint.open_leaf(self.path, name)
        return self._open[name]

    def shape(self, path: tuple) -> tuple:
        return tuple(self.meta["leaves"]["params." + ".".join(path)]["shape"])

    def dtype(self, path: tuple) -> np.dtype:
        name = self.meta["leaves"]["params." + ".".join(path)]["dtype"]
        return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)

    def read(self, path: tuple, layer: int | None = None) -> np.ndarray:
        a = self.leaf(path)
        return np.asarray((a[layer] if layer is not None else a).read().result())


class ParamLeaves:
    """Params in memory (a dict of jax arrays on any mesh) read like `CheckpointLeaves`."""

    def __init__(self, params: dict):
        self.params, self._last = params, (None, None)

    def _get(self, path: tuple):
        x = self.params
        for k in path:
            x = x[k]
        return x

    def shape(self, path: tuple) -> tuple:
        return tuple(self._get(path).shape)

    def dtype(self, path: tuple) -> np.dtype:
        return np.dtype(self._get(path).dtype)

    def read(self, path: tuple, layer: int | None = None) -> np.ndarray:
        if self._last[0] != path:  # one gathered leaf at a time
            self._last = (path, np.asarray(jax.device_get(self._get(path))))
        a = self._last[1]
        return a[layer] if layer is not None else a


def place(leaf: np.ndarray, spec) -> jax.Array:
    """A host array as a global jax.Array on the current mesh (jax.set_mesh) with PartitionSpec `spec`;
    each device takes only its slice (multi-process too)."""
    mesh = jax.sharding.get_mesh()
    if mesh.empty:
        raise HFError("importing params needs a mesh: call under jax.set_mesh(mesh)")
    sharding = jax.sharding.NamedSharding(mesh, spec)
    return jax.make_array_from_callback(leaf.shape, sharding, lambda idx: np.ascontiguousarray(leaf[idx]))
