"""dense's own cases. Its Hugging Face mapping (variants/dense/hf.py, LlamaForCausalLM) runs the checks
every hf.py gets in tests/fast/test_hf.py; here, what dense's import refuses, each with its own message."""

import os

import pytest

from shared.modelio import hf as hfio
from shared.variant import load

HERE = os.path.dirname(os.path.abspath(__file__))  # this folder: a copy's tests test the copy

hf = load(os.path.join(HERE, "hf.py"))

LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    rope_parameters={"rope_type": "default", "rope_theta": 1e4},
)


def test_a_plain_llama_config_imports():
    cfg = hf.model_config(LLAMA)
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.rope_theta, cfg.tie_embeddings) == (2, 4, 2, 1e4, False)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope_parameters.rope_type"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "model_type"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
    ],
)
def test_hf_import_refuses(change, field):
    with pytest.raises(hfio.HFError, match=f"^{field}: "):
        hf.model_config({**LLAMA, **change})


def test_init_from_names_the_refused_field(tmp_path):
    train = load(os.path.join(HERE, "train.py"))
    hfio.write_json(str(tmp_path / "config.json"), {**LLAMA, "hidden_act": "relu"})
    with pytest.raises(train.model.ConfigError, match="^init_from: hidden_act: 'relu'"):
        train.main(train.TrainConfig(init_from=f"hf:{tmp_path}", run_dir=str(tmp_path / "run")))
