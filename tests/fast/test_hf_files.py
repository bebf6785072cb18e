"""The files of an exported Hugging Face directory (shared/modelio/hf.py's write_model_dir), without transformers:
what each JSON file holds, and that an existing directory is never overwritten. tests/fast/test_hf.py runs
the exported models in transformers itself (the integration tier)."""

import json

import numpy as np
import pytest

from shared.modelio import hf
from shared.data import sources


def test_model_dir_files(tmp_path):
    tok = str(tmp_path / "tokenizer.json")
    sources.train_tokenizer(["def f(x):\n    return x\n" * 20, "class A:\n    pass\n" * 20], 300).save(tok)
    eos, eos_id = hf.tokenizer_eos(tok)
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = hf.write_model_dir(
        str(tmp_path / "hf"),
        {"max_position_embeddings": 64},
        [hf.Tensor("w", (2, 3), np.dtype("float32"), lambda: w)],
        tok,
        max_length=64,
        max_shard_bytes=1 << 20,
        progress=False,
    )
    ids = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
    read = lambda name: json.loads((tmp_path / "hf" / name).read_text())  # noqa: E731
    # the row length is the model's context (config.json, tokenizer_config.json), not a generation length:
    # transformers warns when generation_config.json's max_length meets generate(max_new_tokens=...)
    assert read("generation_config.json") == ids
    assert read("config.json") == {"max_position_embeddings": 64, **ids}
    assert read("tokenizer_config.json")["model_max_length"] == 64 and read("tokenizer_config.json")["eos_token"] == eos
    np.testing.assert_array_equal(hf.Safetensors(out).get("w"), w)
    with pytest.raises(hf.HFError, match="exists"):
        hf.write_model_dir(out, {}, [], tok, max_length=64, max_shard_bytes=1 << 20, progress=False)
