"""Hugging Face export and import (each folder's hf.py, shared/modelio/hf.py), the same checks for every folder
that has an hf.py (found as the contract finds model.py + train.py):

- export: the directory run by transformers (fp32, eager attention) gives stencil's logits, packed
  rows included (positions as position_ids); the tokenizer and the configs name the eos token;
- round trip: import(export(params)) gives the same logits, and exporting it again writes the same
  tensors bit for bit (an export may fold what import cannot tell apart, as swa_hybrid's head gate);
- import of a random transformers model of the mapped class (built from the config export writes),
  with transformers' logits, then a few train steps from it with `--init_from hf:DIR`;
- greedy decoding with the cache (shared/decode.py) continues a prompt as transformers' `generate`;
- the command line: a run's checkpoint -> a Hugging Face directory -> a stencil checkpoint;
- refusals every hf.py makes: another architecture, a tensor it has no place for, a leaf its table
  does not map.

These need torch and transformers (the `hf` extra after a CPU torch, as .ci/run installs them) and are
in the integration tier; the refusals need neither and are fast. A folder's own cases (the options its
import refuses, its layer pattern) go in its own <folder>/test_<name>.py (AGENTS.md, "A variant's own tests").
"""

import dataclasses
import json
import logging
import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from shared.data import sources
from shared.modelio import hf as hfio
from shared.variant import ROOT, discover, load


FOLDERS = [f for f in discover() if os.path.isfile(os.path.join(ROOT, f, "hf.py"))]
NAMES = [os.path.basename(f) for f in FOLDERS]
TOL = 1e-4
SMALL = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128)
MAX_DIFF = {}  # measured max |logit difference| per case, printed with -s


def hf_module(folder):
    return load(os.path.join(ROOT, folder, "hf.py"))


def tiny(folder, **kw):
    """The folder's model at a small size: SMALL, then its CONTRACT_TINY model options (so its own path
    runs: a window shorter than a row, both layer kinds), then `kw`; fields it lacks are left out."""
    mod = hf_module(folder).model
    own = load(os.path.join(ROOT, folder, "train.py")).CONTRACT_TINY.get("model", {})
    fields = {f.name for f in dataclasses.fields(mod.ModelConfig)}
    return mod.ModelConfig(**{k: v for k, v in {**SMALL, **own, **kw}.items() if k in fields})


def mesh(data_=4, model_=2):
    return jax.make_mesh(
        (data_, model_), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[: data_ * model_]
    )


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    docs = ["def f(x):\n    return x + 1\n" * 40, "class A:\n    pass\n" * 40, "import os\nprint(os.getcwd())\n" * 40]
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    sources.train_tokenizer(docs, 512).save(path)
    return path


# ---------------------------------------------------------------- against transformers


class Collect(logging.Handler):
    """The messages of a logger, as they are logged."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


# ---------------------------------------------------------------- refusals every hf.py makes (fast)


@pytest.mark.parametrize("folder", FOLDERS, ids=NAMES)
def test_import_refuses_another_architecture(folder):
    hf = hf_module(folder)
    config = dict(hf.hf_config(tiny(folder), "float32", 64), architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(hfio.HFError, match="^model_type: "):
        hf.model_config(config)


@pytest.mark.parametrize("folder", FOLDERS, ids=NAMES)
def test_import_refuses_a_tensor_without_a_place(folder, tmp_path, tokenizer_file):
    """A directory holding a tensor the model has no place for (a bias) is refused, naming the tensor."""
    hf = hf_module(folder)
    cfg = tiny(folder)
    with jax.set_mesh(mesh(1, 1)):
        out = hf.export_params(
            hf.model.init(cfg, jax.random.key(0)),
            cfg,
            str(tmp_path / "hf"),
            tokenizer_file,
            max_length=64,
            progress=False,
        )
    extra = hfio.Tensor(
        "model.layers.0.self_attn.q_proj.bias",
        (cfg.n_heads * cfg.head_dim,),
        np.dtype("float32"),
        lambda: np.zeros(cfg.n_heads * cfg.head_dim, np.float32),
    )
    os.makedirs(tmp_path / "extra")
    (shard,) = hfio.write_safetensors(str(tmp_path / "extra"), [extra], 1 << 30, progress=False)
    shutil.move(str(tmp_path / "extra" / shard), os.path.join(out, "extra.safetensors"))
    index_file = os.path.join(out, "model.safetensors.index.json")  # export always writes one
    index = json.load(open(index_file))
    index["weight_map"][extra.name] = "extra.safetensors"
    hfio.write_json(index_file, index)
    with pytest.raises(hfio.HFError, match=r"^model\.layers\.0\.self_attn\.q_proj\.bias: a tensor"):
        hf.read_params(out, cfg)


@pytest.mark.parametrize("folder", FOLDERS, ids=NAMES)
def test_export_refuses_a_leaf_the_table_does_not_map(folder, monkeypatch):
    """A copied hf.py next to a model that gained a weight refuses to export instead of dropping it."""
    hf = hf_module(folder)
    rows = hf.tensor_map
    monkeypatch.setattr(hf, "tensor_map", lambda cfg: [r for r in rows(cfg) if r[1] != ("final_norm",)])
    with pytest.raises(
        hfio.HFError, match=r"^hf.py: \w+'s params have leaves this file does not map: \['final_norm'\]"
    ):
        hf.export_tensors(tiny(folder), None, np.dtype("float32"))


def test_init_from_is_checked(tmp_path):
    """--init_from takes hf:DIR of a folder with an hf.py; what DIR's config.json asks that the model cannot
    compute is refused before anything runs."""
    for folder in discover():
        train = load(os.path.join(ROOT, folder, "train.py"))
        name = os.path.basename(folder)
        with pytest.raises(train.model.ConfigError, match="^init_from: must be '' or hf:DIR"):
            train.TrainConfig(init_from="runs/x")
        if folder not in FOLDERS:
            with pytest.raises(train.model.ConfigError, match=f"^init_from: {name} has no hf.py"):
                train.TrainConfig(init_from="hf:/x")
    folder = FOLDERS[0]
    train = load(os.path.join(ROOT, folder, "train.py"))
    config = dict(
        hf_module(folder).hf_config(tiny(folder), "float32", 64), architectures=["GPT2LMHeadModel"], model_type="gpt2"
    )
    hfio.write_json(str(tmp_path / "config.json"), config)
    with pytest.raises(train.model.ConfigError, match="^init_from: model_type: "):
        train.main(train.TrainConfig(init_from=f"hf:{tmp_path}", run_dir=str(tmp_path / "run")))


def test_init_from_checks_the_window_of_dir_not_the_default_against_the_context_split(tmp_path, tokenizer_file):
    """A sliding window is checked against each device's slice of a row (seq_len / mesh_context) once DIR's
    config.json has given it: the default model's window does not refuse a run whose DIR's window fits."""
    folder = os.path.join("variants", "swa_hybrid")
    hf, train = hf_module(folder), load(os.path.join(ROOT, folder, "train.py"))
    for window, d in ((16, tmp_path / "w16"), (64, tmp_path / "w64")):
        d.mkdir()
        hfio.write_json(str(d / "config.json"), hf.hf_config(tiny(folder, window=window), "float32", 64))
        shutil.copyfile(tokenizer_file, d / "tokenizer.json")
    kw = dict(seq_len=32, mesh_context=2, run_dir=str(tmp_path / "run"))
    with pytest.raises(train.model.ConfigError, match="^mesh_context: a window of 64"):
        train.TrainConfig(**kw)  # the default model's window: refused at this split
    assert hf.init_config(train.TrainConfig(init_from=f"hf:{tmp_path / 'w16'}", **kw)).model.window == 16
    with pytest.raises(train.model.ConfigError, match=r"^mesh_context: a window of 64 .* \(the model of hf:"):
        hf.init_config(train.TrainConfig(init_from=f"hf:{tmp_path / 'w64'}", **kw))
