"""tools/review/compare_runs.py on hand-written run directories (no training): the plotted curves
against step and tokens, resume duplicates, val-loss lines, summary.md, the config sources,
CLI errors; and the Logger's config.json that the tokens axis relies on."""

import json
import math
import os
import subprocess
import sys

import pytest

from shared.runtime import metrics
from shared.variant import ROOT, load

TOOL = os.path.join(ROOT, "tools", "review", "compare_runs.py")
cr = load(TOOL)


def write_run(path, rows, config=None, lines=None):
    """A run directory: metrics.jsonl from `rows` (dicts, step first) or raw `lines`, and config.json."""
    path.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) if lines is None else "".join(x + "\n" for x in lines)
    (path / "metrics.jsonl").write_text(text)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return str(path)


def row(step, loss, val=None, tok_s=1000.0, mfu=0.1):
    r = {
        "step": step,
        "train/loss": loss,
        "train/z": 1.0,
        "optim/grad_norm": 0.5,
        "optim/learning_rate": 1e-3,
        "throughput/tokens_per_second": tok_s,
        "throughput/mfu": mfu,
    }
    if val is not None:
        r["eval/loss"] = val
    return r


def test_runs_logged_under_the_old_names_load_the_same(tmp_path):
    """metrics.jsonl rows from before the train/, eval/, throughput/ names (loss, val_loss, tokens_per_s, mfu)."""
    rows = [row(10, 5.0, val=5.5, tok_s=100.0, mfu=0.1), row(20, 4.0, val=4.5, tok_s=200.0, mfu=0.2)]
    new = cr.load_run(write_run(tmp_path / "new", rows), "new")
    back = {v: k for k, v in cr.OLD_NAMES.items()}
    old_rows = [{back.get(k, k): v for k, v in r.items()} for r in rows]
    old = cr.load_run(write_run(tmp_path / "old", old_rows), "old")
    assert "loss" in old_rows[0] and "val_loss" in old_rows[0]
    assert (
        (old.steps, old.loss, old.val_steps, old.val_loss, old.tokens_per_s, old.mfu)
        == (new.steps, new.loss, new.val_steps, new.val_loss, new.tokens_per_s, new.mfu)
        == ([10, 20], [5.0, 4.0], [10, 20], [5.5, 4.5], [100.0, 200.0], [0.1, 0.2])
    )


@pytest.fixture
def two_runs(tmp_path):
    """a: batch 4 x seq 8, val at 20 and 30, resumed at 20 (steps 20 and 30 logged twice);
    b: batch 8 x seq 16, no val_loss, a NaN loss and a NaN throughput row."""
    a = write_run(
        tmp_path / "x" / "a",
        [
            row(10, 5.0, tok_s="nan", mfu="nan"),
            row(20, 4.0, val=4.5, tok_s=100.0, mfu=0.01),
            row(30, 3.9, val=4.6, tok_s=999.0, mfu=0.5),  # the first attempt; replaced after the resume
            row(20, 4.1, val=4.4, tok_s=200.0, mfu=0.02),
            row(30, 3.5, val=4.2, tok_s=300.0, mfu=0.03),
            row(40, 3.0, val=4.3, tok_s=1000.0, mfu=0.5),
        ],
        {"batch_size": 4, "seq_len": 8, "lr": 3e-3},
    )
    b = write_run(
        tmp_path / "y" / "b",
        [
            row(10, 6.0, tok_s="nan"),
            row(20, "nan", tok_s=50.0),
            row(30, 2.0, tok_s=70.0),
        ],
        {"batch_size": 8, "seq_len": 16},
    )
    return a, b


def lines_of(ax):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def same(xs, ys):
    return len(xs) == len(ys) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(xs, ys))


def test_plotted_curves_by_step_and_tokens(two_runs):
    runs = [cr.load_run(p, lab) for p, lab in zip(two_runs, ["a", "b"])]
    fig = cr.plot(runs)
    by_step, by_tokens = fig.axes
    left, right = lines_of(by_step), lines_of(by_tokens)
    assert sorted(left) == sorted(right) == ["a train", "a val", "b train"]  # b has no val_loss: no dashed line
    # after the resume the last row for a step wins (20: 4.1 not 4.0, 30: 3.5 not 3.9)
    assert left["a train"] == ([10, 20, 30, 40], [5.0, 4.1, 3.5, 3.0])
    assert left["a val"] == ([20, 30, 40], [4.4, 4.2, 4.3])
    assert right["a train"] == ([320, 640, 960, 1280], [5.0, 4.1, 3.5, 3.0])  # 4 * 8 tokens per step
    assert right["a val"] == ([640, 960, 1280], [4.4, 4.2, 4.3])
    assert left["b train"][0] == [10, 20, 30] and same(left["b train"][1], [6.0, math.nan, 2.0])
    assert right["b train"][0] == [1280, 2560, 3840]  # 8 * 16 tokens per step
    styles = {
        line.get_label(): (line.get_linestyle(), line.get_marker(), line.get_color()) for line in by_step.get_lines()
    }
    assert styles["a train"][:2] == ("-", "None") and styles["a val"][:2] == ("--", "o")
    assert styles["a train"][2] == styles["a val"][2] != styles["b train"][2]  # one colour per run
    assert [t.get_text() for t in by_step.get_legend().get_texts()] == ["a train", "a val", "b train"]


def test_compare_writes_png_and_summary(two_runs, tmp_path):
    out = tmp_path / "out"
    res = cr.compare(list(two_runs), str(out))
    assert res["png"] == str(out / "loss.png") and res["md"] == str(out / "summary.md")
    with open(res["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(res["png"]) > 10_000
    a, b = res["runs"]
    assert (a["label"], b["label"]) == ("a", "b")
    assert a["last_step"] == 40 and a["final_loss"] == 3.0 and a["final_val_loss"] == 4.3
    assert (a["best_val_loss"], a["best_val_step"]) == (4.2, 30)
    assert a["median_tokens_per_s"] == 300.0  # 200, 300, 1000 (step 10's NaN left out, 999 replaced)
    assert a["median_mfu"] == 0.03 and a["total_tokens"] == 40 * 32 and a["params"] is None
    assert b["final_val_loss"] is None and b["best_val_loss"] is None
    assert b["median_tokens_per_s"] == 60.0 and b["total_tokens"] == 30 * 128
    md = (out / "summary.md").read_text()
    table = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert len(table) == 3 and "final val loss" in table[0]
    assert table[1].split(" | ")[:7] == ["| a", f"`{two_runs[0]}`", "40", "3.0000", "4.3000", "4.2000 (30)", "300"]
    assert table[2].split(" | ")[2:6] == ["30", "2.0000", "–", "–"]
    assert "1,280" in table[1] and "3,840" in table[2]
    assert "s × batch_size × seq_len" in md


def test_config_fallbacks_labels_and_params(tmp_path, capsys):
    rows = [row(5, 3.0, val=3.5), row(10, 2.5)]
    # config only in the newest checkpoint's metadata (an older checkpoint and a .tmp are ignored)
    one = write_run(tmp_path / "p" / "run", rows)
    for step, batch in ((5, 99), (10, 2), (15, 77)):
        d = tmp_path / "p" / "run" / "checkpoints" / (f"step_{step:08d}" + (".tmp" if step == 15 else ""))
        d.mkdir(parents=True)
        leaves = {
            "params.embed": {"shape": [10, 4], "dtype": "float32"},
            "params.norm": {"shape": [4], "dtype": "float32"},
            "opt.0.mu.embed": {"shape": [10, 4], "dtype": "float32"},
            "step": {"shape": [], "dtype": "int32"},
        }
        (d / "metadata.json").write_text(
            json.dumps({"step": step, "config": {"batch_size": batch, "seq_len": 3}, "leaves": leaves})
        )
    two = write_run(tmp_path / "q" / "run", rows)  # neither config.json nor a checkpoint
    res = cr.compare([one, two], str(tmp_path / "out"))
    assert [s["label"] for s in res["runs"]] == ["p/run", "q/run"]  # same basename: parent/basename
    first, second = res["runs"]
    assert first["tokens_per_step"] == 6 and first["total_tokens"] == 60 and first["params"] == 44
    assert first["config_source"].endswith(os.path.join("step_00000010", "metadata.json"))
    assert second["tokens_per_step"] is None and second["total_tokens"] is None
    assert f"{two}: no config.json" in capsys.readouterr().err
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "**q/run**" in md and "tokens axis is missing" in md and md.splitlines()[4].endswith("| 44 |")
    fig = cr.plot([cr.load_run(one, "p"), cr.load_run(two, "q")])
    assert sorted(lines_of(fig.axes[0])) == ["p train", "p val", "q train", "q val"]
    assert sorted(lines_of(fig.axes[1])) == ["p train", "p val"]  # q has no tokens axis
    assert cr.default_labels(["r/x", "r/x/"]) == ["r/x #1", "r/x #2"]
    res = cr.compare([one, two], str(tmp_path / "out2"), labels=["base", "new"])
    assert [s["label"] for s in res["runs"]] == ["base", "new"]


def cli(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=60)


def test_cli(two_runs, tmp_path):
    ok = cli(*two_runs, "--out", str(tmp_path / "o"), "--labels", "first,second")
    assert ok.returncode == 0, ok.stderr
    assert str(tmp_path / "o" / "loss.png") in ok.stdout and str(tmp_path / "o" / "summary.md") in ok.stdout
    assert "| first |" in (tmp_path / "o" / "summary.md").read_text()

    missing = cli(two_runs[0], str(tmp_path / "nope"), "--out", str(tmp_path / "o2"))
    assert missing.returncode == 2 and missing.stderr == f"error: {tmp_path / 'nope'}: no such run directory\n"

    (tmp_path / "empty").mkdir()
    no_metrics = cli(str(tmp_path / "empty"), "--out", str(tmp_path / "o2"))
    assert no_metrics.returncode == 2
    assert no_metrics.stderr.startswith(f"error: {tmp_path / 'empty' / 'metrics.jsonl'}: no such file")

    bad = write_run(tmp_path / "bad", [], lines=[json.dumps(row(10, 3.0)), '{"step": 20, "loss": 2.', ""])
    corrupt = cli(two_runs[0], bad, "--out", str(tmp_path / "o2"))
    assert corrupt.returncode == 2 and "Traceback" not in corrupt.stderr
    assert corrupt.stderr.startswith(f"error: {bad}/metrics.jsonl: line 2 is not valid JSON")
    assert len(corrupt.stderr.splitlines()) == 1 and not (tmp_path / "o2").exists()

    again = cli(*two_runs, "--out", str(tmp_path / "o"))  # as generate, lm-eval and export: nothing overwritten
    assert again.returncode == 2 and "--out" in again.stderr and "nothing is overwritten" in again.stderr

    labels = cli(*two_runs, "--out", str(tmp_path / "o3"), "--labels", "one")
    assert labels.returncode == 2 and labels.stderr.startswith("error: --labels")

    usage = cli("--help")
    assert usage.returncode == 0 and "--out" in usage.stdout and "python tools/review/compare_runs.py" in usage.stdout


def test_logger_writes_config_json(tmp_path):
    log = metrics.Logger(
        str(tmp_path / "run"), {"batch_size": 4, "seq_len": 8}, total_steps=1, wandb_mode="disabled", progress=False
    )
    log.close()
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"batch_size": 4, "seq_len": 8}
    assert sorted(os.listdir(tmp_path / "run")) == ["config.json", "metrics.jsonl"]  # no temp file left
    metrics.Logger(
        str(tmp_path / "p1"), {"batch_size": 4}, total_steps=1, wandb_mode="disabled", process_index=1
    ).close()
    assert not (tmp_path / "p1").exists()


def test_any_logged_metric_is_plotted_and_summarized(tmp_path, capsys):
    """--metric: eval/bpb (how runs with different tokenizers compare), a named set's by pattern, a probe."""
    a = write_run(
        tmp_path / "a",
        [
            row(10, 5.0) | {"eval/bpb": 2.0, "eval/code/bpb": 1.5},
            row(20, 4.0) | {"eval/bpb": 1.6, "eval/code/bpb": 1.7, "probe/acc": 0.25},
            row(20, 4.1) | {"eval/bpb": 1.8, "eval/code/bpb": 1.4, "probe/acc": 0.5},
        ],
        {"batch_size": 2, "seq_len": 4},
    )
    b = write_run(tmp_path / "b", [row(10, 5.5) | {"eval/bpb": "nan"}, row(20, 4.5) | {"eval/bpb": 1.9}])
    runs = [cr.load_run(a, "a"), cr.load_run(b, "b")]
    assert cr.expand_metrics(runs, ["eval/bpb", "eval/*/bpb", "eval/bpb"]) == ["eval/bpb", "eval/code/bpb"]
    fig = cr.plot_metric(runs, "eval/bpb")
    by_step, by_tokens = fig.axes
    left, right = lines_of(by_step), lines_of(by_tokens)
    assert left["a"] == ([10, 20], [2.0, 1.8])  # the last row of a step wins
    assert left["b"][0] == [10, 20] and same(left["b"][1], [math.nan, 1.9])
    assert right == {"a": ([80, 160], [2.0, 1.8])}  # b has no config: no tokens axis
    assert by_step.get_ylabel() == "eval/bpb"
    assert sorted(lines_of(cr.plot_metric(runs, "eval/code/bpb").axes[0])) == ["a"]  # b never logged it

    res = cr.compare([a, b], str(tmp_path / "out"), ["a", "b"], ["eval/bpb", "eval/*/bpb", "probe/acc"])
    assert res["metrics"] == {
        m: str(tmp_path / "out" / f)
        for m, f in (
            ("eval/bpb", "eval_bpb.png"),
            ("eval/code/bpb", "eval_code_bpb.png"),
            ("probe/acc", "probe_acc.png"),
        )
    }
    for png in res["metrics"].values():
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert f"{b}: no eval/code/bpb logged" in capsys.readouterr().err
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| `eval/bpb` | a | 1.8 (20) | 1.8 (20) |" in md
    assert "| `eval/bpb` | b | 1.9 (20) | 1.9 (20) |" in md  # the NaN is not the lowest
    assert "| `eval/code/bpb` | a | 1.4 (20) | 1.4 (20) |" in md
    assert "| `eval/code/bpb` | b | not logged | – |" in md
    assert "| `probe/acc` | a | 0.5 (20) | 0.5 (20) |" in md

    ok = cli(a, b, "--out", str(tmp_path / "o"), "--metric", "eval/bpb", "--metric", "eval/*/bpb")
    assert ok.returncode == 0, ok.stderr
    assert sorted(os.listdir(tmp_path / "o")) == ["eval_bpb.png", "eval_code_bpb.png", "loss.png", "summary.md"]
    assert str(tmp_path / "o" / "eval_bpb.png") in ok.stdout
    unknown = cli(a, b, "--out", str(tmp_path / "o2"), "--metric", "eval/bits")
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: --metric eval/bits: no run logged it; logged:")
    assert "eval/bpb" in unknown.stderr and not (tmp_path / "o2").exists()


def test_runs_with_different_peaks_are_compared_by_tokens_per_second(tmp_path, capsys):
    """MFU is against each run's own peak (config.json's "peak"; on CPU measured in each run): the table gives
    tokens/s as a ratio to the first run and the peak of each, and says when the peaks differ."""
    cfg = {"batch_size": 2, "seq_len": 4}
    peak = {"per_device": 20e9, "source": "measured fp32 matmul, 160 GFLOP/s at start"}
    a = write_run(tmp_path / "a", [row(10, 5.0, tok_s=1000.0, mfu=0.5)], cfg | {"peak": peak})
    b = write_run(tmp_path / "b", [row(10, 5.0, tok_s=1500.0, mfu=0.3)], cfg | {"peak": peak | {"per_device": 50e9}})
    c = write_run(tmp_path / "c", [row(10, 5.0, tok_s=900.0, mfu=0.45)], cfg | {"peak": peak | {"per_device": 20.5e9}})
    res = cr.compare([a, b], str(tmp_path / "ab"))
    assert [s["peak_per_device"] for s in res["runs"]] == [20e9, 50e9]
    md = (tmp_path / "ab" / "summary.md").read_text()
    table = [ln.split(" | ") for ln in md.splitlines() if ln.startswith("| ")]
    assert table[0][6:10] == ["median tokens/s", "tokens/s vs first", "median MFU", "MFU's peak (GFLOP/s per device)"]
    assert table[1][6:10] == ["1,000", "1.00x", "50.00%", "20.0"]
    assert table[2][6:10] == ["1,500", "1.50x", "30.00%", "50.0"]
    assert "**The runs' peaks differ** (a: 20.0 GFLOP/s per device, measured fp32 matmul" in md
    assert "b: 50.0 GFLOP/s per device" in md and "compare the runs by tokens/s" in md
    assert "different peaks" in capsys.readouterr().err
    cr.compare([a, c], str(tmp_path / "ac"))  # within 5%: the same peak, nothing to say
    assert "peaks differ" not in (tmp_path / "ac" / "summary.md").read_text() and not capsys.readouterr().err
