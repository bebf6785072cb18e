#!/usr/bin/env python3
"""Compare training runs: loss curves in one picture, any other logged metric in its own, and a Markdown table.

Each RUN is a run directory written by a variant's train.py (e.g. runs/dense-20261203-101010/).
From its metrics.jsonl (one JSON object per logged step; NaN/inf written as strings; after a
resume a step can appear twice, and the last row for a step wins) this writes:

    OUT/loss.png    two panels: train loss (solid) and val loss (dashed, with markers)
                    against optimizer step (left) and against tokens seen (right), one
                    colour per run
    OUT/<metric>.png  for each --metric (e.g. eval/bpb -> OUT/eval_bpb.png): that metric of every
                    run against step (left) and tokens seen (right); a pattern (`eval/*/bpb`)
                    stands for every logged metric it matches
    OUT/summary.md  one row per run: last step, final train loss, final and best val loss,
                    median tokens/s (and as a ratio to the first run's) and MFU with the peak it
                    is against (run.json's "peak"), total tokens, parameter count when known;
                    a note when the runs' peaks differ (on CPU each run measures its own: compare
                    tokens/s then); and for each --metric, every run's final and lowest value

Tokens seen at step s = s * batch_size * seq_len, read from RUN/config.json (written by
shared/runtime/metrics.py's Logger) or, when that is missing, from the newest
RUN/checkpoints/step_*/metadata.json. A run with neither is plotted against step only, and
summary.md and stderr say so. The parameter count comes from the newest checkpoint's leaf
shapes (the `params.*` leaves), so it is known only for runs with a checkpoint.

Importable without side effects (matplotlib is imported only when plotting):
`compare(runs, out, labels, metrics)` returns {"png", "md", "runs": [per-run summary dicts],
"metrics": {metric: png}}; `load_run`, `plot`, `plot_metric` (each returns a matplotlib Figure),
`expand_metrics` and `summarize` are its parts.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import math
import os
import re
import statistics
import sys

EXAMPLES = """\
examples:
  python tools/review/compare_runs.py /tmp/runs/dense /tmp/runs/my_idea --out /tmp/cmp-my_idea
  python tools/review/compare_runs.py runs/dense-A runs/dense-B --out /tmp/cmp --labels lr3e-3,lr1e-3
  python tools/review/compare_runs.py runs/A runs/B --out /tmp/cmp --metric eval/bpb --metric 'eval/*/bpb'

Writes OUT/loss.png (train loss solid, val loss dashed, against optimizer step and
against tokens seen = step x batch_size x seq_len, from RUN/config.json or the newest
checkpoint's metadata.json) and OUT/summary.md (final/best loss, median tokens/s, its ratio to
the first run's, and MFU with the peak it is against; a note when the runs' peaks differ),
and prints their paths. Each --metric NAME (repeatable; a name as metrics.jsonl logs it, or
a pattern with * such as 'eval/*/bpb') also writes OUT/NAME.png (/ as _) and its final and
lowest values to summary.md: runs with different tokenizers compare by eval/bpb, not loss.
Labels default to each run directory's basename (parent/basename
where two basenames are the same). Where a step was logged twice (a resume), the last
row wins.

exit status: 0 = written; 2 = a run directory that does not exist, has no metrics.jsonl,
or has a line that is not a JSON object with an integer "step" (also bad --labels, or a
--metric that no run logged).
"""

_STEP_DIR = re.compile(r"^step_(\d{8})$")  # as in shared/storage/checkpoint.py
PNG, MD = "loss.png", "summary.md"
TOKENS_NOTE = (
    "Tokens seen at step s = s × batch_size × seq_len (rows per optimizer step × tokens per row), "
    "from each run's config.json, or its newest checkpoint's metadata.json when config.json is missing."
)


class RunError(Exception):
    """A run directory that cannot be read; str() is `<path>: <cause>`."""


@dataclasses.dataclass
class Run:
    label: str
    path: str
    steps: list[int]  # logged steps, ascending, one per step (the last row for a step wins)
    loss: list[float]  # train loss at each step (NaN where missing or not finite)
    val_steps: list[int]  # the steps that have a val_loss
    val_loss: list[float]
    tokens_per_s: list[float]  # finite values only
    mfu: list[float]  # finite values only
    tokens_per_step: int | None  # batch_size * seq_len; None when no config was found
    config_source: str | None  # the file batch_size/seq_len came from
    params: int | None  # parameter count from the newest checkpoint's leaves
    rows: list[dict] = dataclasses.field(default_factory=list)  # every logged row, by step (names as logged now)
    peak: dict | None = None  # run.json's "peak": the FLOP/s per device its MFU is against, and their source

    def tokens(self, steps: list[int]) -> list[int] | None:
        return None if self.tokens_per_step is None else [s * self.tokens_per_step for s in steps]


# ---------------------------------------------------------------- reading a run


def _float(v) -> float:
    """A logged number: floats, ints, or the strings "nan"/"inf" the Logger writes; else NaN."""
    if isinstance(v, bool):
        return math.nan
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return math.nan
    return math.nan


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics.jsonl, one per step (the last row for a step wins), by step."""
    rows: dict[int, dict] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise RunError(f"{path}: line {n} is not valid JSON ({e})") from None
                if (
                    not isinstance(row, dict)
                    or isinstance(row.get("step"), bool)
                    or not isinstance(row.get("step"), int)
                ):
                    raise RunError(f'{path}: line {n} is not a JSON object with an integer "step"')
                rows[row["step"]] = row
    except UnicodeDecodeError as e:
        raise RunError(f"{path}: not UTF-8 text ({e})") from None
    except OSError as e:
        raise RunError(f"{path}: cannot read ({e.strerror or e})") from None
    return [rows[s] for s in sorted(rows)]


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise RunError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(d, dict):
        raise RunError(f"{path}: not a JSON object")
    return d


def newest_checkpoint_metadata(run_dir: str) -> str | None:
    """RUN/checkpoints/step_XXXXXXXX/metadata.json of the newest complete checkpoint, if any."""
    ckpts = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(ckpts):
        return None
    found = sorted(
        d for d in os.listdir(ckpts) if _STEP_DIR.match(d) and os.path.isfile(os.path.join(ckpts, d, "metadata.json"))
    )
    return os.path.join(ckpts, found[-1], "metadata.json") if found else None


def _tokens_per_step(config: dict) -> int | None:
    b, t = config.get("batch_size"), config.get("seq_len")
    if isinstance(b, int) and isinstance(t, int) and not isinstance(b, bool) and not isinstance(t, bool):
        return b * t
    return None


# metrics.jsonl's names before the train loop named them train/, eval/, throughput/: runs logged then still load
OLD_NAMES = {
    "loss": "train/loss",
    "val_loss": "eval/loss",
    "tokens_per_s": "throughput/tokens_per_second",
    "mfu": "throughput/mfu",
}


def load_run(path: str, label: str) -> Run:
    """Read a run directory. Raises RunError for a missing directory or metrics.jsonl, or a bad line."""
    if not os.path.exists(path):
        raise RunError(f"{path}: no such run directory")
    if not os.path.isdir(path):
        raise RunError(f"{path}: not a directory")
    mpath = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(mpath):
        raise RunError(f"{mpath}: no such file (is {path} a run directory?)")
    rows = [{OLD_NAMES.get(k, k): v for k, v in r.items()} for r in read_metrics(mpath)]

    meta_path = newest_checkpoint_metadata(path)
    meta = _read_json(meta_path) if meta_path else None
    cpath = os.path.join(path, "config.json")
    tokens_per_step, source, peak = None, None, None
    if os.path.isfile(cpath):
        config = _read_json(cpath)
        tokens_per_step, source = _tokens_per_step(config), cpath
        facts = _read_json(os.path.join(path, "run.json")) if os.path.isfile(os.path.join(path, "run.json")) else config
        peak = facts.get("peak") if isinstance(facts.get("peak"), dict) else None  # config.json's in older runs
    elif meta is not None and isinstance(meta.get("config"), dict):
        tokens_per_step, source = _tokens_per_step(meta["config"]), meta_path
    if tokens_per_step is None:
        source = None

    params = None
    if meta is not None and isinstance(meta.get("leaves"), dict):
        shapes = [v.get("shape") for k, v in meta["leaves"].items() if k.startswith("params.") and isinstance(v, dict)]
        if shapes and all(isinstance(s, list) for s in shapes):
            params = sum(math.prod(s) for s in shapes)

    def finite(key):
        return [x for x in (_float(r.get(key)) for r in rows) if math.isfinite(x)]

    val = [r for r in rows if "eval/loss" in r]
    return Run(
        label=label,
        path=path,
        steps=[r["step"] for r in rows],
        loss=[_float(r.get("train/loss")) for r in rows],
        val_steps=[r["step"] for r in val],
        val_loss=[_float(r["eval/loss"]) for r in val],
        tokens_per_s=finite("throughput/tokens_per_second"),
        mfu=finite("throughput/mfu"),
        tokens_per_step=tokens_per_step,
        config_source=source,
        params=params,
        rows=rows,
        peak=peak,
    )


def series(run: Run, metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows of `run` that logged `metric`; a value that is not a number is NaN."""
    have = [r for r in run.rows if metric in r]
    return [r["step"] for r in have], [_float(r[metric]) for r in have]


def logged_metrics(runs: list[Run]) -> list[str]:
    """Every metric name some run logged, sorted."""
    return sorted({k for run in runs for r in run.rows for k in r if k != "step"})


def expand_metrics(runs: list[Run], wanted: list[str]) -> list[str]:
    """The metrics to plot: each name in `wanted` as it is, or a pattern with * (fnmatch) as every logged
    name it matches, in order, each once. Raises RunError for a name or pattern that no run logged."""
    logged, out = logged_metrics(runs), []
    for w in wanted:
        found = fnmatch.filter(logged, w) if any(c in w for c in "*?[") else [w] if w in logged else []
        if not found:
            raise RunError(f"--metric {w}: no run logged it; logged: {', '.join(logged) or 'nothing'}")
        out += [m for m in found if m not in out]
    return out


def default_labels(paths: list[str]) -> list[str]:
    """Basenames; parent/basename for the runs whose basename is shared; made unique if still equal."""
    norm = [os.path.normpath(os.path.abspath(p)) for p in paths]
    base = [os.path.basename(p) for p in norm]
    labels = [
        os.path.join(os.path.basename(os.path.dirname(p)), b) if base.count(b) > 1 else b for p, b in zip(norm, base)
    ]
    out = []
    for i, lab in enumerate(labels):
        out.append(lab if labels.count(lab) == 1 else f"{lab} #{labels[: i + 1].count(lab)}")
    return out


# ---------------------------------------------------------------- the picture and the table


def _plot_y(values: list[float]) -> list[float]:
    return [v if math.isfinite(v) else math.nan for v in values]  # inf breaks autoscaling; NaN leaves a gap


def plot(runs: list[Run]):
    """The two-panel matplotlib Figure (Agg canvas, no pyplot state). Lines carry labels
    "<run label> train" and "<run label> val"; the right panel holds only runs with tokens."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter, MaxNLocator

    fig = Figure(figsize=(13, 5), layout="constrained")
    FigureCanvasAgg(fig)
    by_step, by_tokens = fig.subplots(1, 2)
    missing = []
    for i, run in enumerate(runs):
        colour = f"C{i % 10}"
        panels = [(by_step, run.steps, run.val_steps)]
        if run.tokens_per_step is None:
            missing.append(run.label)
        else:
            panels.append((by_tokens, run.tokens(run.steps), run.tokens(run.val_steps)))
        for ax, x, vx in panels:
            ax.plot(x, _plot_y(run.loss), "-", color=colour, linewidth=1.5, label=f"{run.label} train")
            if run.val_steps:
                ax.plot(
                    vx,
                    _plot_y(run.val_loss),
                    "--o",
                    color=colour,
                    linewidth=1.2,
                    markersize=4,
                    label=f"{run.label} val",
                )
    by_step.set(title="loss against optimizer step", xlabel="optimizer step", ylabel="loss (cross-entropy, nats)")
    by_tokens.set(
        title="loss against tokens seen",
        xlabel="tokens seen (step × batch_size × seq_len)",
        ylabel="loss (cross-entropy, nats)",
    )
    by_step.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    by_tokens.xaxis.set_major_formatter(EngFormatter())
    if missing:
        by_tokens.text(
            0.02,
            0.02,
            "no batch_size/seq_len (no config.json or checkpoint) for: " + ", ".join(missing),
            transform=by_tokens.transAxes,
            fontsize=8,
            color="0.3",
            va="bottom",
        )
    for ax in (by_step, by_tokens):
        ax.grid(True, alpha=0.3)
    by_step.legend(loc="upper right", fontsize=8)
    fig.suptitle("train loss (solid) and val loss (dashed)")
    return fig


def metric_file(metric: str) -> str:
    """The picture's file name of a metric: eval/bpb -> eval_bpb.png."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", metric) + ".png"


def plot_metric(runs: list[Run], metric: str):
    """One metric of every run against optimizer step (left) and tokens seen (right), one colour per run
    (the same as in loss.png); a line's label is the run's label. A run that did not log the metric
    has no line, and the picture says so."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter, MaxNLocator

    fig = Figure(figsize=(13, 5), layout="constrained")
    FigureCanvasAgg(fig)
    by_step, by_tokens = fig.subplots(1, 2)
    absent, no_tokens = [], []
    for i, run in enumerate(runs):
        steps, values = series(run, metric)
        if not steps:
            absent.append(run.label)
            continue
        style = {
            "color": f"C{i % 10}",
            "linewidth": 1.5,
            "label": run.label,
            "markersize": 3,
            "marker": "o" if len(steps) < 30 else None,
        }
        by_step.plot(steps, _plot_y(values), "-", **style)
        if run.tokens_per_step is None:
            no_tokens.append(run.label)
        else:
            by_tokens.plot(run.tokens(steps), _plot_y(values), "-", **style)
    by_step.set(title=f"{metric} against optimizer step", xlabel="optimizer step", ylabel=metric)
    by_tokens.set(
        title=f"{metric} against tokens seen", xlabel="tokens seen (step × batch_size × seq_len)", ylabel=metric
    )
    by_step.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    by_tokens.xaxis.set_major_formatter(EngFormatter())
    notes = ([f"not logged by: {', '.join(absent)}"] if absent else []) + (
        [f"no batch_size/seq_len for: {', '.join(no_tokens)}"] if no_tokens else []
    )
    for ax in (by_step, by_tokens):
        ax.grid(True, alpha=0.3)
    if notes:
        by_step.text(0.02, 0.02, "; ".join(notes), transform=by_step.transAxes, fontsize=8, color="0.3", va="bottom")
    if by_step.get_lines():
        by_step.legend(loc="best", fontsize=8)
    fig.suptitle(metric)
    return fig


def summarize_metric(run: Run, metric: str) -> dict:
    """A run's final and lowest value of `metric` (NaN left out of the lowest), with their steps; None when
    the run did not log it."""
    steps, values = series(run, metric)
    finite = [(v, s) for v, s in zip(values, steps) if math.isfinite(v)]
    low = min(finite) if finite else None
    return {
        "final": values[-1] if values else None,
        "final_step": steps[-1] if steps else None,
        "min": low[0] if low else None,
        "min_step": low[1] if low else None,
    }


def summarize(run: Run) -> dict:
    """One run's numbers, as in a summary.md row (None where unknown)."""
    finite_val = [(v, s) for v, s in zip(run.val_loss, run.val_steps) if math.isfinite(v)]
    best = min(finite_val) if finite_val else None
    last = run.steps[-1] if run.steps else None
    return {
        "label": run.label,
        "run_dir": run.path,
        "last_step": last,
        "final_loss": run.loss[-1] if run.loss else None,
        "final_val_loss": run.val_loss[-1] if run.val_loss else None,
        "best_val_loss": best[0] if best else None,
        "best_val_step": best[1] if best else None,
        "median_tokens_per_s": statistics.median(run.tokens_per_s) if run.tokens_per_s else None,
        "median_mfu": statistics.median(run.mfu) if run.mfu else None,
        "peak_per_device": _float((run.peak or {}).get("per_device")) if run.peak else None,
        "peak_source": (run.peak or {}).get("source"),
        "tokens_per_step": run.tokens_per_step,
        "total_tokens": last * run.tokens_per_step if last is not None and run.tokens_per_step is not None else None,
        "params": run.params,
        "config_source": run.config_source,
    }


def _cell(v, fmt: str = "{}") -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return fmt.format(v).replace("|", "\\|")


def _params(n: int | None) -> str:
    if n is None:
        return "–"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def metrics_markdown(metrics: dict[str, list[dict]], labels: list[str]) -> list[str]:
    """summary.md's table of the --metric metrics: one row per run and metric, final and lowest value."""
    if not metrics:
        return []
    lines = ["", "## Other metrics", "", "| metric | run | final (step) | lowest (step) |", "|---|---|---|---|"]
    for metric, per_run in metrics.items():
        for lab, m in zip(labels, per_run):
            final = "not logged" if m["final"] is None else f"{_cell(m['final'], '{:.6g}')} ({m['final_step']})"
            low = "–" if m["min"] is None else f"{_cell(m['min'], '{:.6g}')} ({m['min_step']})"
            lines.append(f"| `{metric}` | {_cell(lab)} | {final} | {low} |")
    return lines


def summary_markdown(summaries: list[dict], metrics: dict[str, list[dict]] | None = None) -> str:
    head = [
        "run",
        "run dir",
        "last step",
        "final loss",
        "final val loss",
        "best val loss (step)",
        "median tokens/s",
        "tokens/s vs first",
        "median MFU",
        "MFU's peak (GFLOP/s per device)",
        "total tokens",
        "params",
    ]
    lines = ["# Run comparison", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    first = summaries[0]["median_tokens_per_s"] if summaries else None
    for s in summaries:
        best = "–" if s["best_val_loss"] is None else f"{s['best_val_loss']:.4f} ({s['best_val_step']})"
        vs = s["median_tokens_per_s"] / first if first and s["median_tokens_per_s"] is not None else None
        peak = None if s["peak_per_device"] is None else s["peak_per_device"] / 1e9
        cells = [
            _cell(s["label"]),
            _cell(s["run_dir"], "`{}`"),
            _cell(s["last_step"]),
            _cell(s["final_loss"], "{:.4f}"),
            _cell(s["final_val_loss"], "{:.4f}"),
            best,
            _cell(s["median_tokens_per_s"], "{:,.0f}"),
            _cell(vs, "{:.2f}x"),
            _cell(s["median_mfu"], "{:.2%}"),
            _cell(peak, "{:,.1f}"),
            _cell(s["total_tokens"], "{:,}"),
            _params(s["params"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        TOKENS_NOTE,
        "Medians are over the logged rows whose value is not NaN. Params come from the newest checkpoint's "
        "`params.*` leaf shapes (– without a checkpoint).",
    ]
    for s in summaries:
        if s["tokens_per_step"] is None:
            lines.append(
                f"- **{s['label']}**: no config.json or checkpoint metadata with batch_size and seq_len in "
                f"`{s['run_dir']}`; the tokens axis is missing for this run (plotted against step only)."
            )
    differ = peaks_differ(summaries)
    if differ:
        lines += [
            "",
            f"**The runs' peaks differ** ({differ}): each run's MFU is against its own peak, so compare "
            "the runs by tokens/s (on the same hardware), not by MFU.",
        ]
    lines += metrics_markdown(metrics or {}, [s["label"] for s in summaries])
    return "\n".join(lines) + "\n"


PEAK_TOLERANCE = 0.05  # peaks within 5% of each other count as the same


def peaks_differ(summaries: list[dict]) -> str:
    """Which peak each run's MFU is against, when they are not all the same (within PEAK_TOLERANCE); else "".
    On CPU each run measures its own; runs from other machines have other peaks; a run logged before the
    peak was recorded has none (nothing is said when no run has one)."""
    peaks = [s["peak_per_device"] for s in summaries]
    known = [p for p in peaks if p is not None and math.isfinite(p) and p > 0]
    if len(summaries) < 2 or not known:
        return ""
    if len(known) == len(peaks) and max(known) <= min(known) * (1 + PEAK_TOLERANCE):
        return ""
    return "; ".join(
        f"{s['label']}: "
        + (
            "not recorded"
            if p is None
            else f"{p / 1e9:,.1f} GFLOP/s per device" + (f", {s['peak_source']}" if s["peak_source"] else "")
        )
        for s, p in zip(summaries, peaks)
    )


def compare(runs: list[str], out: str, labels: list[str] | None = None, metrics: list[str] = ()) -> dict:
    """Read `runs`, write OUT/loss.png, OUT/<metric>.png for each of `metrics` (names or * patterns) and
    OUT/summary.md. Returns {"png", "md", "runs": [summaries], "metrics": {metric: png}}.

    Raises RunError for an unreadable run or a metric no run logged, ValueError for labels that do not
    match the runs."""
    if not runs:
        raise ValueError("no runs given")
    if labels is None:
        labels = default_labels(runs)
    if len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
    loaded = [load_run(p, lab) for p, lab in zip(runs, labels)]
    chosen = expand_metrics(loaded, list(metrics))  # before anything is written
    for m in chosen:
        for r in loaded:
            if not series(r, m)[0]:
                print(f"warning: {r.path}: no {m} logged; it has no line in {metric_file(m)}", file=sys.stderr)
    for r in loaded:
        if r.tokens_per_step is None:
            print(
                f"warning: {r.path}: no config.json or checkpoint metadata with batch_size and seq_len; "
                "the tokens axis is missing for this run",
                file=sys.stderr,
            )
    os.makedirs(out, exist_ok=True)
    png, md = os.path.join(out, PNG), os.path.join(out, MD)
    fig = plot(loaded)
    fig.savefig(png, dpi=110)
    pictures = {}
    for m in chosen:
        pictures[m] = os.path.join(out, metric_file(m))
        plot_metric(loaded, m).savefig(pictures[m], dpi=110)
    summaries = [summarize(r) for r in loaded]
    if peaks_differ(summaries):
        print(
            "warning: the runs' MFU are against different peaks (summary.md names them): compare them by tokens/s",
            file=sys.stderr,
        )
    per_metric = {m: [summarize_metric(r, m) for r in loaded] for m in chosen}
    with open(md, "w", encoding="utf-8") as f:
        f.write(summary_markdown(summaries, per_metric))
    return {"png": png, "md": md, "runs": summaries, "metrics": pictures}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="compare_runs.py",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("runs", nargs="+", metavar="RUN", help="run directory holding metrics.jsonl (from a train.py)")
    ap.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder for loss.png and summary.md")
    ap.add_argument("--labels", metavar="A,B,...", help="comma-separated legend labels, one per RUN")
    ap.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="NAME",
        help="also plot this logged metric (e.g. eval/bpb, or a pattern: 'eval/*/bpb') into "
        "OUT/NAME.png and add its final and lowest values to summary.md; repeatable",
    )
    args = ap.parse_args(argv)
    labels = None
    if args.labels is not None:
        labels = [s.strip() for s in args.labels.split(",")]
        if len(labels) != len(args.runs):
            print(f"error: --labels: {len(labels)} labels for {len(args.runs)} runs", file=sys.stderr)
            return 2
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        print(
            f"error: --out {args.out} exists and is not an empty folder; choose a new one (nothing is overwritten)",
            file=sys.stderr,
        )
        return 2
    try:
        result = compare(args.runs, args.out, labels, args.metric)
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"error: matplotlib is needed for the picture ({e}); pip install -e '.[tools]'", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.filename or args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {result['png']}")
    for path in result["metrics"].values():
        print(f"wrote {path}")
    print(f"wrote {result['md']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
