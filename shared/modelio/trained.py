"""The trained weights a command runs: a run directory (its newest complete checkpoint, or `step`), one
checkpoint (a `step_XXXXXXXX` path or URL), or `init_from` hf:DIR (a Hugging Face model directory,
through the `hf.py` of the folder whose class it is), read onto the folder's own mesh.

A checkpoint records the variant that saved it (`variant` in its metadata) and its model config: the
model is that folder's `model.py` (shared/variant.py), so one command serves every variant, and a
checkpoint of another variant than `variant` names is refused. Only the weights are read, not the
optimizer state: the moving average `ema` when the run kept one (`weights="auto"`; the weights
evaluation uses), else `params`. The tokenizer is the run's own `tokenizer.json` (or `tokenizer`).
`load_weights` serves `python -m shared.generate` and `python -m shared.lm_eval_model`; errors are
decode.GenerateError, naming what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import jax
import numpy as np

from shared.data import sources
from shared.storage import checkpoint
from shared.modelio import hf as hfio
from shared.data import DataError
from shared.decode import GenerateError
from shared.variant import ROOT, discover, load


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
        raise GenerateError(
            f"{where} has model fields this folder's ModelConfig lacks: {unknown} (was it saved "
            "by another version of the variant?)"
        )
    try:
        return model.ModelConfig(**saved)
    except (TypeError, ValueError) as e:
        raise GenerateError(f"{where}: its model config is refused: {e}") from e


def _checkpoint_path(source: str, step: int | None) -> tuple[str, str | None]:
    """(checkpoint path, the run directory or None) of a run directory or a checkpoint path."""
    try:
        if checkpoint.is_url(source) or os.path.basename(source.rstrip("/")).startswith("step_"):
            if step is not None:
                raise GenerateError(
                    f"--step {step} with a checkpoint's path ({source}): give its run directory instead"
                )
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
    path, run = _checkpoint_path(source, step)
    try:
        meta = checkpoint.read_metadata(path)
    except (OSError, ValueError) as e:
        raise GenerateError(f"{path}: metadata unreadable ({e})") from e
    saved = meta.get("variant")
    if not saved:
        raise GenerateError(f"{path} does not record the variant that saved it; pass --variant")
    if variant and os.path.basename(os.path.normpath(variant)) != saved:
        raise GenerateError(
            f"{path} was saved by variant {saved!r}, not {variant!r}: its weights are another "
            f"model's (leave out --variant, or pass --variant {saved})"
        )
    folder = _folder(variant or saved)
    model = load(os.path.join(folder if os.path.isabs(folder) else os.path.join(ROOT, folder), "model.py"))
    config = meta.get("config") or {}
    cfg = _model_config(model, config.get("model") or {}, path)
    has_ema = float((config.get("optim") or {}).get("ema", 0.0) or 0.0) > 0
    if weights == "ema" and not has_ema:
        raise GenerateError(f"--weights ema: {path} keeps no moving average (its run had optim.ema 0)")
    which = "ema" if weights == "ema" or (weights == "auto" and has_ema) else "params"
    return dict(
        path=path, run=run, folder=folder, model=model, cfg=cfg, which=which, meta=meta, seq_len=config.get("seq_len")
    )


def add_mesh_flags(p: argparse.ArgumentParser) -> None:
    """--mesh_data / --mesh_model / --mesh_expert: the mesh a command loads a model onto (also
    shared/lm_eval_model.py's)."""
    p.add_argument(
        "--mesh_data",
        type=int,
        default=-1,
        help="devices on the data axis (-1 = all of them / the others; fewer: only the first data x model x expert devices)",
    )
    p.add_argument("--mesh_model", type=int, default=1, help="devices on the model (tensor-parallel) axis")
    p.add_argument("--mesh_expert", type=int, default=1, help="devices on the expert axis (moe_hero)")


def _hf_folder(hf_dir: str, variant: str) -> str:
    """The folder whose hf.py imports the class of DIR's config.json."""
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
    raise GenerateError(
        f"--init_from {hf_dir}: no folder's hf.py imports model_type {hf_cfg.get('model_type')!r}; pass --variant"
    )


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


def load_weights(
    source: str,
    *,
    init_from: str = "",
    step=None,
    variant: str = "",
    weights: str = "auto",
    tokenizer: str = "",
    mesh_data: int = -1,
    mesh_model: int = 1,
    mesh_expert: int = 1,
) -> dict:
    """What a command needs to run a model: a run directory or checkpoint (`source`) or `init_from` hf:DIR, read
    onto the folder's mesh. A dict: model (the folder's module), cfg, params, mesh, tokenizer, eos_id, seq_len
    (the run's, or DIR's max_position_embeddings; None if not recorded), folder, where (a description).
    shared/lm_eval_model.py calls it too."""
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
            raise GenerateError(
                f"no tokenizer: {tok_path or 'the checkpoint is not in a run directory'} does not exist; "
                "pass --tokenizer (the tokenizer.json the run trained with)"
            )
        where = f"{info['path']} ({os.path.basename(folder)}, {info['which']})"
    try:
        tok, _ = sources.load_tokenizer(tok_path)
        eos = sources.eos_id_of(tok)
    except DataError as e:
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
    return dict(
        model=model,
        cfg=cfg,
        params=params,
        mesh=mesh,
        tokenizer=tok,
        eos_id=eos,
        seq_len=seq_len,
        folder=folder,
        where=where,
    )
