"""Run metrics: a JSONL file always, Weights & Biases when possible, and a progress bar.

The run directory gets metrics.jsonl (one JSON object per logged step, keys as the loop
names them: train/loss, eval/loss, optim/grad_norm, throughput/tokens_per_second, ...; NaN/inf
as strings; a resumed run first drops the rows after its checkpoint's step, which it redoes; a run that
branches back to an earlier checkpoint first moves those rows aside, `move_rows_after`) and config.json (the run's config, for tools such as tools/review/compare_runs.py, plus
what `Logger.record` adds once the run knows it: e.g. "kernels", the backend each kernel op
took, which is decided while the first step compiles).

wandb mode "auto": online when the user is logged in (WANDB_API_KEY, or `wandb login`'s
entry in ~/.netrc), otherwise offline with a one-line notice (sync later with
`wandb sync <run_dir>/wandb`). "disabled" turns it off (the tests do). Only process 0
logs; the other processes get a Logger that does nothing.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import sys

from tqdm import tqdm


def wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def _plain(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf
    return v


def write_config(run_dir: str, config: dict, name: str = "config.json") -> str:
    """Write `config` as run_dir/config.json (atomically: a temp file, then os.replace).

    config.json is the run's settings and nothing else: a valid `--config_path`, and what `--resume` starts
    from (shared/cli.py). tools/review/compare_runs.py reads batch_size and seq_len from it to put tokens on an
    axis. A resumed run rewrites it with the settings it resumed with. What the run adds once it has
    started (the peak MFU is against, the kernels its step chose) is run.json beside it (`Logger.record`)."""
    path = os.path.join(run_dir, name)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(config, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path


def drop_rows_after(path: str, step: int) -> int:
    """Remove the rows of `path` (metrics.jsonl) logged after `step`, atomically; returns how many.
    A line that is not JSON (cut short by a crash mid-write) goes too."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = f.read().splitlines()
    keep = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    if len(keep) == len(lines):
        return 0
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    return len(lines) - len(keep)


def move_rows_after(path: str, step: int, to: str) -> int:
    """Move the rows of `path` (metrics.jsonl) logged after `step` to the file `to` (a new file), then drop
    them from `path` atomically; returns how many. The rows of an abandoned branch, kept."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = f.read().splitlines()
    later = []
    for line in lines:
        try:
            if json.loads(line)["step"] > step:
                later.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    if later:
        with open(to, "x") as f:
            f.write("".join(line + "\n" for line in later))
        drop_rows_after(path, step)
    return len(later)


class Logger:
    def __init__(
        self,
        run_dir: str,
        config: dict,
        *,
        total_steps: int,
        wandb_mode: str = "auto",
        project: str = "stencil",
        name: str | None = None,
        start_step: int = 0,
        process_index: int = 0,
        progress: bool = True,
    ):
        self.active = process_index == 0
        self.run = None
        self.bar = None
        if not self.active:
            return
        if wandb_mode not in ("auto", "online", "offline", "disabled"):
            raise ValueError(f"wandb mode must be auto, online, offline or disabled, got {wandb_mode!r}")
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir, self.config, self.facts = run_dir, dict(config), {}
        write_config(run_dir, self.config)
        path = os.path.join(run_dir, "metrics.jsonl")
        drop_rows_after(path, start_step)  # a resumed run redoes the steps after its checkpoint: no row twice
        self.file = open(path, "a")
        mode = wandb_mode
        if mode == "auto":
            mode = "online" if wandb_logged_in() else "offline"
            if mode == "offline":
                print(f"wandb: not logged in, logging offline to {run_dir}/wandb (run `wandb login` for online)")
        if mode != "disabled":
            import wandb

            self.run = wandb.init(
                project=project, name=name, dir=run_dir, config=config, mode=mode, resume="allow", id=name
            )
        if progress:
            self.bar = tqdm(
                total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr, disable=None
            )

    def log(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.run is not None:
            self.run.log({k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}, step=step)

    def record(self, key: str, value) -> None:
        """Add `key` to the run's run.json (and wandb's config): facts known only once the run has started,
        such as which kernel backends its compiled step uses; never to config.json, its settings."""
        if not self.active:
            return
        self.facts[key] = value
        write_config(self.run_dir, self.facts, "run.json")
        if self.run is not None:
            self.run.config.update({key: value}, allow_val_change=True)

    def progress(self, step: int, **shown) -> None:
        """Advance the bar to `step` and show e.g. loss=..., tok_s=..., mfu=..."""
        if self.bar is None:
            return
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in shown.items()}, refresh=False)

    def write(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.run is not None:
            self.run.finish()
