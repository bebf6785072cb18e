"""shared/flops counts what the masks let through; shared/runtime/metrics writes what it is given."""

import json
import math
import os

import jax
import numpy as np
import pytest

from shared import flops
from shared.runtime import metrics
from shared.variant import ROOT, load


@pytest.mark.parametrize("T,W", [(16, None), (16, 4), (7, 7), (7, 20), (100, 1)])
def test_attention_pairs_count_the_mask(T, W):
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = (s <= t) & ((t - s < W) if W else True)
    assert flops.attention_pairs_per_token(T, W) == pytest.approx(allowed.sum() / T)


def test_dense_flops_per_token_counts_every_matmul_once():
    model = load(os.path.join(ROOT, "variants", "dense", "model.py"))
    cfg = model.ModelConfig(vocab_size=100, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=12)
    shapes = model.param_shapes(cfg)
    matmul = sum(math.prod(s) for k, s in shapes["layers"].items() if "norm" not in k) + math.prod(shapes["unembed"])
    attn = 2 * 3 * 2 * 2 * cfg.n_heads * cfg.head_dim * (10 + 1) / 2
    assert model.flops_per_token(cfg, 10) == pytest.approx(6 * matmul + attn)


def test_mfu_and_peaks(monkeypatch):
    assert flops.mfu(1e9, 1e3, 2, 1e12) == pytest.approx(0.5)

    class Dev:
        platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    assert flops.device_peak("bfloat16", Dev()) == (989e12, "data sheet H100")
    Dev.device_kind = "TPU v6 lite"
    assert flops.device_peak("bfloat16", Dev())[0] == 918e12
    Dev.device_kind = "Mystery 9000"
    with pytest.raises(ValueError, match="Mystery 9000"):
        flops.device_peak("bfloat16", Dev())
    # CPU: measured in this process on the first call, never read from a file
    monkeypatch.setenv("STENCIL_CACHE", "/nonexistent")
    monkeypatch.setattr(flops, "_measured", {})
    calls = []
    measured = flops.CpuPeak(4e11, 1024, 2, (3e11, 3.5e11, 4e11), {512: 3.8e11, 1024: 4e11}, 1e11)
    monkeypatch.setattr(flops, "cpu_peak", lambda: calls.append(1) or measured)
    peak, src = flops.device_peak("float32")
    assert peak == 4e11 / jax.local_device_count()
    assert src == (
        "fp32 matmul measured at start, 400 GFLOP/s = 200 per CPU-second x 2 cores (best of 7 after a "
        "warm-up, n=1024; its repetitions 300-400, median 350; sizes 512: 380, 1024: 400); by the wall "
        "clock 100 GFLOP/s, 25% of it"
    )
    assert flops.device_peak("float32")[0] == peak and calls == [1]  # once per process


def test_the_cpu_peak_is_counted_in_cpu_time_best_of_several_with_its_spread():
    """The same measurement every run: warmed up, several sizes, the best repetition of the best size, with
    that size's spread; FLOPs per CPU-second of the process times its cores, so the load of other jobs on a
    shared machine does not move it (by the wall clock it varied about 2x between identical runs)."""
    a = flops.cpu_peak(sizes=(256, 384), repeats=3)
    assert a.cores == flops.usable_cores() >= 1 and a.size in (256, 384)
    assert a.flops == a.spread[2] == a.by_size[a.size] == max(a.by_size.values())
    assert a.spread[0] <= a.spread[1] <= a.spread[2] and 0 < a.wall
    b = flops.cpu_peak(sizes=(256, 384), repeats=3)
    assert 0.6 < b.flops / a.flops < 1.6, (a, b)  # loose: two measurements in one process agree


def test_logger_writes_jsonl_and_only_on_process_zero(tmp_path):
    log = metrics.Logger(str(tmp_path), {"a": 1}, total_steps=3, wandb_mode="disabled", progress=False)
    log.log(1, {"loss": 2.5, "nan": float("nan")})
    log.log(2, {"loss": np.float32(2.0)})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 2.5, "nan": "nan"}, {"step": 2, "loss": 2.0}]
    other = metrics.Logger(str(tmp_path / "p1"), {}, total_steps=3, wandb_mode="disabled", process_index=1)
    other.log(1, {"loss": 1.0})
    other.close()
    assert not (tmp_path / "p1").exists()
    # a run resumed from step 1 redoes step 2: its old row goes (and a line cut short by a crash)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')
    metrics.Logger(str(tmp_path), {"a": 1}, total_steps=3, wandb_mode="disabled", progress=False, start_step=1).close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == rows[:1]
    with pytest.raises(ValueError, match="wandb mode"):
        metrics.Logger(str(tmp_path), {}, total_steps=1, wandb_mode="sometimes")
