"""The dense variant as a Hugging Face `LlamaForCausalLM`, both ways.

    python variants/dense/hf.py export --run_dir runs/dense-20260101-120000 --out /tmp/dense-hf
    python variants/dense/hf.py export --run_dir RUN --step 400 --dtype bfloat16 --out DIR
    python variants/dense/hf.py import --hf_dir DIR                 # check it, print the config as flags
    python variants/dense/hf.py import --hf_dir DIR --out RUN_DIR   # ... and write it as a stencil checkpoint
    python variants/dense/train.py --init_from hf:DIR               # train from its weights and tokenizer

The math is the same on both sides, so the weights map one to one: RMSNorm x * w (eps =
rms_norm_eps), rotate-half RoPE with frequencies theta ** (-2i / head_dim) (Llama's own form:
no permutation of q and k), grouped-query attention, SwiGLU down(silu(gate) * up), tied or
untied embeddings. Stencil stores a matrix [in, out] and stacks the layers on a leading
axis; Hugging Face stores nn.Linear weights [out, in] per layer:

| stencil leaf | Hugging Face tensor |
|---|---|
| embed [V, D] | model.embed_tokens.weight [V, D] |
| layers.attn_norm [L, D] | model.layers.{i}.input_layernorm.weight |
| layers.wq / wk / wv [L, D, heads * head_dim] | model.layers.{i}.self_attn.{q,k,v}_proj.weight (transposed) |
| layers.wo [L, heads * head_dim, D] | model.layers.{i}.self_attn.o_proj.weight (transposed) |
| layers.mlp_norm [L, D] | model.layers.{i}.post_attention_layernorm.weight |
| layers.w_gate / w_up / w_down | model.layers.{i}.mlp.{gate,up,down}_proj.weight (transposed) |
| final_norm [D] | model.norm.weight |
| unembed [D, V] (untied) | lm_head.weight [V, D]; tied: none (tie_word_embeddings) |

Import refuses, naming the config field, what this model cannot compute: RoPE scaling,
partial rotary, biases, another activation, attention dropout, and any tensor it has no
place for. A packed row's positions restart per document (`model.positions`); in
transformers pass them as `position_ids` (without an attention mask) for the same logits.
This file is the model-specific half; the files themselves are shared/modelio/hf.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys

import jax
import ml_dtypes
import numpy as np
from jax.sharding import AxisType

from shared.storage import checkpoint
from shared.modelio import hf as hfio
from shared.modelio.hf import HFError, refuse
from shared.variant import sibling

model = sibling(__file__, "model")
VARIANT = os.path.basename(os.path.dirname(os.path.abspath(__file__)))
ARCHITECTURE, MODEL_TYPE = "LlamaForCausalLM", "llama"


def tensor_map(cfg) -> list[tuple]:
    """(Hugging Face name, stencil leaf path, layer index or None, transposed) for every tensor;
    export and import both read this table, so they cannot disagree."""
    rows = [("model.embed_tokens.weight", ("embed",), None, False)]
    layer = [
        ("input_layernorm.weight", "attn_norm", False),
        ("self_attn.q_proj.weight", "wq", True),
        ("self_attn.k_proj.weight", "wk", True),
        ("self_attn.v_proj.weight", "wv", True),
        ("self_attn.o_proj.weight", "wo", True),
        ("post_attention_layernorm.weight", "mlp_norm", False),
        ("mlp.gate_proj.weight", "w_gate", True),
        ("mlp.up_proj.weight", "w_up", True),
        ("mlp.down_proj.weight", "w_down", True),
    ]
    for i in range(cfg.n_layers):
        rows += [(f"model.layers.{i}.{name}", ("layers", leaf), i, t) for name, leaf, t in layer]
    rows.append(("model.norm.weight", ("final_norm",), None, False))
    if not cfg.tie_embeddings:
        rows.append(("lm_head.weight", ("unembed",), None, True))
    return rows


# ---------------------------------------------------------------- export


def hf_config(cfg, dtype: str, max_length: int) -> dict:
    """config.json for LlamaForCausalLM (every ModelConfig option of dense has a counterpart)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "dtype": dtype,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,  # the same, for readers on transformers 4 (rope_parameters is 5's form)
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": max_length,
        "initializer_range": cfg.init_std,
        "use_cache": True,
    }


def export_tensors(cfg, leaves, dtype: np.dtype) -> list[hfio.Tensor]:
    """The Hugging Face tensors, each read (one layer of one leaf) only when it is written. Refuses params
    with a leaf the table does not map (a copy of this file next to a model that gained a weight)."""
    mapped = {path for _, path, _, _ in tensor_map(cfg)} | set()
    paths = {
        tuple(k.key for k in p)
        for p, _ in jax.tree_util.tree_flatten_with_path(
            model.param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple)
        )[0]
    }
    refuse(
        paths <= mapped,
        "hf.py",
        f"{VARIANT}'s params have leaves this file does not map: "
        f"{sorted('.'.join(p) for p in paths - mapped)}; edit tensor_map (and check the math) with the model",
    )
    out = []
    for name, path, layer, transposed in tensor_map(cfg):
        shape = leaves.shape(path)[1:] if layer is not None else leaves.shape(path)
        shape = tuple(reversed(shape)) if transposed else tuple(shape)

        def read(path=path, layer=layer, transposed=transposed):
            a = leaves.read(path, layer)
            return (a.T if transposed else a).astype(dtype)

        out.append(hfio.Tensor(name, shape, dtype, read))
    return out


def _dtype(name: str | None, cfg) -> np.dtype:
    name = name or cfg.param_dtype
    refuse(name in ("float32", "bfloat16"), "dtype", f"must be float32 or bfloat16, got {name!r}")
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def export_params(
    params,
    cfg,
    out: str,
    tokenizer: str,
    *,
    max_length: int,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    progress: bool = True,
) -> str:
    """Params in memory (any mesh) -> a Hugging Face directory at `out`, with the tokenizer file `tokenizer`."""
    leaves = hfio.ParamLeaves(params)
    dt = _dtype(dtype, cfg)
    return hfio.write_model_dir(
        out,
        hf_config(cfg, np.dtype(dt).name, max_length),
        export_tensors(cfg, leaves, dt),
        tokenizer,
        max_length=max_length,
        max_shard_bytes=hfio.parse_size(max_shard_size),
        progress=progress,
    )


def export(
    run_dir: str,
    out: str,
    *,
    step: int | None = None,
    dtype: str | None = None,
    tokenizer: str = "",
    max_shard_size: str = "5GB",
    progress: bool = True,
) -> str:
    """A run's checkpoint (the newest, or `step`) -> a Hugging Face directory at `out`, leaf by leaf."""
    leaves = hfio.CheckpointLeaves(run_dir, step)
    saved = leaves.meta.get("config", {})
    try:
        cfg = model.ModelConfig(**saved["model"])
    except (KeyError, TypeError, model.ConfigError) as e:
        raise HFError(
            f"{leaves.path}: its model config does not fit this variant's ModelConfig "
            f"({type(e).__name__}: {e}); export it with the variant that wrote it"
        ) from e
    if leaves.meta.get("variant", VARIANT) != VARIANT:
        raise HFError(
            f"{leaves.path} was written by variant {leaves.meta['variant']!r}; use "
            f"variants/{leaves.meta['variant']}/hf.py"
        )
    tokenizer = tokenizer or os.path.join(run_dir, "tokenizer.json")
    if not os.path.isfile(tokenizer):
        raise HFError(
            f"{tokenizer} does not exist (a run on pre-tokenized data has none): pass --tokenizer, "
            "the tokenizer.json whose ids the run was trained on"
        )
    dt = _dtype(dtype, cfg)
    return hfio.write_model_dir(
        out,
        hf_config(cfg, np.dtype(dt).name, int(saved.get("seq_len", 2048))),
        export_tensors(cfg, leaves, dt),
        tokenizer,
        max_length=int(saved.get("seq_len", 2048)),
        max_shard_bytes=hfio.parse_size(max_shard_size),
        progress=progress,
    )


# ---------------------------------------------------------------- import


def model_config(hf: dict, base=None):
    """The ModelConfig of a LlamaForCausalLM config.json; `base` gives the fields Hugging Face does not
    describe (dtypes, remat, attention backend, z_loss, init_std). Refuses what dense cannot compute."""
    base = base or model.ModelConfig()
    hfio.check_architecture(hf, ARCHITECTURE, MODEL_TYPE)
    refuse(
        hf.get("hidden_act", "silu") == "silu", "hidden_act", f"{hf.get('hidden_act')!r}: dense's MLP is SwiGLU (silu)"
    )
    for name in ("attention_bias", "mlp_bias"):
        refuse(not hf.get(name, False), name, "dense has no biases")
    refuse(not hf.get("attention_dropout", 0.0), "attention_dropout", "dense has no dropout")
    heads = int(hf["num_attention_heads"])
    fields = {
        "vocab_size": int(hf["vocab_size"]),
        "d_model": int(hf["hidden_size"]),
        "n_layers": int(hf["num_hidden_layers"]),
        "n_heads": heads,
        "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "head_dim": int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        "d_ff": int(hf["intermediate_size"]),
        "rope_theta": hfio.rope_theta(hf, 10000.0),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }
    try:
        return dataclasses.replace(base, **fields)
    except model.ConfigError as e:
        raise HFError(f"config.json maps to a ModelConfig dense refuses: {e}") from e


def read_params(hf_dir: str, cfg, place=None) -> dict:
    """The params of a Hugging Face directory in cfg.param_dtype, one leaf at a time: host arrays, or
    what `place(host leaf, leaf path)` makes of each (import_params: a sharded jax.Array)."""
    tensors = hfio.Safetensors(hf_dir)
    shapes, dtype = (
        model.param_shapes(cfg),
        np.dtype(ml_dtypes.bfloat16 if cfg.param_dtype == "bfloat16" else "float32"),
    )
    rows = tensor_map(cfg)
    used = {name for name, *_ in rows}
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()  # a tied model may save it; transformers ignores it
    extra = [n for n in tensors.names() if n not in used and n not in ignored and not n.endswith("rotary_emb.inv_freq")]
    refuse(
        not extra,
        extra[0] if extra else "",
        f"a tensor dense has no place for (a bias, another layer type); {len(extra)} such tensors",
    )
    by_leaf = {}
    for name, path, layer, transposed in rows:
        by_leaf.setdefault(path, []).append((name, layer, transposed))
    params = {}
    for path, parts in by_leaf.items():
        shape = shapes
        for k in path:
            shape = shape[k]
        pieces = []
        for name, layer, transposed in parts:
            if name not in tensors.entries:
                raise HFError(f"{hf_dir}: tensor {name} is missing")
            a = tensors.get(name)
            a = a.T if transposed else a
            want = shape[1:] if layer is not None else shape
            refuse(
                a.shape == tuple(want),
                name,
                f"shape {list(tensors.shape(name))} does not fit config.json "
                f"(stencil leaf {'.'.join(path)} {list(shape)})",
            )
            pieces.append(np.asarray(a, dtype=dtype))
        leaf = np.stack(pieces) if parts[0][1] is not None else pieces[0]
        d = params
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = place(leaf, path) if place else leaf
    return params


def import_params(hf_dir: str, cfg) -> dict:
    """The params of a Hugging Face directory on the current mesh (jax.set_mesh), each leaf with its
    PartitionSpec from model.param_specs; one leaf on the host at a time."""
    specs = model.param_specs(cfg)

    def place(leaf, path):
        spec = specs
        for k in path:
            spec = spec[k]
        return hfio.place(leaf, spec)

    return read_params(hf_dir, cfg, place)


def load(hf_dir: str, base=None):
    """(ModelConfig, params on the current mesh) of a Hugging Face directory."""
    cfg = model_config(hfio.read_config(hf_dir), base)
    return cfg, import_params(hf_dir, cfg)


def init_config(cfg):
    """train.py's `--init_from hf:DIR`: the TrainConfig with DIR's architecture (the fields config.json
    describes; the others as given) and DIR's tokenizer (unless --data.tokenizer names one). What
    cannot be imported raises model.ConfigError naming init_from and the Hugging Face field."""
    d = cfg.init_from[len("hf:") :]
    try:
        m = model_config(hfio.read_config(d), cfg.model)
        tok = cfg.data.tokenizer or hfio.hf_tokenizer(d)
    except HFError as e:
        raise model.ConfigError(f"init_from: {e}") from e
    why = model.context_refusal(m, cfg.seq_len, cfg.mesh_context)  # DIR's model against the rows' split
    if why:
        raise model.ConfigError(f"mesh_context: {why} (the model of {cfg.init_from})")
    return dataclasses.replace(cfg, model=m, data=dataclasses.replace(cfg.data, tokenizer=tok))


def init_params(cfg):
    """train.py's `--init_from hf:DIR`: DIR's params on the current mesh (errors as model.ConfigError)."""
    try:
        return import_params(cfg.init_from[len("hf:") :], cfg.model)
    except HFError as e:
        raise model.ConfigError(f"init_from: {e}") from e


# ---------------------------------------------------------------- command line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog=f"variants/{VARIANT}/hf.py",
        description="\n\n".join(__doc__.split("\n\n")[:2]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="a run's checkpoint -> a Hugging Face model directory")
    e.add_argument("--run_dir", required=True, help="the run directory (its checkpoints/ and tokenizer.json)")
    e.add_argument("--out", required=True, help="the new Hugging Face directory (must not exist)")
    e.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest complete one)")
    e.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the checkpoint's param_dtype)")
    e.add_argument("--tokenizer", default="", help="tokenizer.json (default: the run's own)")
    e.add_argument("--max_shard_size", default="5GB", help="largest safetensors shard (default 5GB)")
    i = sub.add_parser(
        "import",
        help="check a Hugging Face directory; print its config as train.py flags; "
        "with --out write it as a stencil checkpoint",
    )
    i.add_argument("--hf_dir", required=True, help="a local Hugging Face model directory (config.json, safetensors)")
    i.add_argument(
        "--out",
        default="",
        help="a new run directory: checkpoints/step_00000000 (params only) and "
        "tokenizer.json. To train from the weights use train.py --init_from hf:DIR",
    )
    a = p.parse_args(argv)
    try:
        if a.cmd == "export":
            out = export(
                a.run_dir, a.out, step=a.step, dtype=a.dtype, tokenizer=a.tokenizer, max_shard_size=a.max_shard_size
            )
            print(f"wrote {out} ({ARCHITECTURE})")
            return 0
        cfg = model_config(hfio.read_config(a.hf_dir))
        flags = " ".join(
            f"--model.{k} {v}" for k, v in dataclasses.asdict(cfg).items() if v != getattr(model.ModelConfig(), k)
        )
        print(
            f"{a.hf_dir}: {ARCHITECTURE} -> {VARIANT}, {model.num_params(cfg) / 1e6:.2f}M params\n"
            f"flags: {flags or '(the defaults)'}"
        )
        if a.out:
            if os.path.exists(a.out):
                raise HFError(f"--out {a.out} exists; choose a new directory")
            mesh = jax.make_mesh(
                (1, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:1]
            )
            with jax.set_mesh(mesh):
                params = import_params(a.hf_dir, cfg)
                meta = {"config": {"model": dataclasses.asdict(cfg)}, "variant": VARIANT, "imported_from": a.hf_dir}
                path = checkpoint.save(os.path.join(a.out, "checkpoints"), 0, {"params": params}, meta)
            tok = os.path.join(a.hf_dir, "tokenizer.json")
            if os.path.isfile(tok):
                shutil.copyfile(tok, os.path.join(a.out, "tokenizer.json"))
            print(f"wrote {path}")
        return 0
    except (HFError, checkpoint.CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
