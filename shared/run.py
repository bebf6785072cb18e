"""The run around a train loop: everything a train.py's `main()` needs that no variant edits.

A variant's train.py keeps its model, its step and its loop; this module keeps the surroundings:

    with run.Run(cfg, HERE, mesh) as r, jax.set_mesh(mesh):  # run dir, lock, resume refusals, data
        state = r.restore(abstract_state) if r.checkpoint else init(...)
        r.begin(n_params, flops_per_token, schedule)           # logger, saver, stop signals, watchdog, clock
        for step in r.steps():                                 # start+1 .. end; opens the profiler window
            state, metrics = train_step(state, batch)
            due = r.step_done(step, metrics)                   # fetches the previous step's metrics; what is due
            if not due: continue
            row = r.fetch()                                    # this step's metrics, on the host, checked
            ... evaluate (with r.clock.aside()), r.log, r.save, sample, r.preempted
        return r.finish(state)

Each piece is a small function or class of its own, read top to bottom:
  pick_run_dir        the run directory: --run_dir, a --resume_from path's run, the newest runs/<variant>-*
                      for --resume, or a new runs/<variant>-<time>
  find_checkpoint     the checkpoint to resume from (or None), refusing a fresh run over checkpoints
  later_branch        the checkpoints after the one a run resumes from (a branch back to an earlier step):
                      `set_aside` moves them and their metric rows into <run_dir>/abandoned-after-<step>-<time>/
  schedule_change     the warning when a resumed run's learning rate at its first step differs from the saved run's
  refuse_resume       every refusal that is the same for every variant: another model or data config,
                      another data stream, another optimizer, a weight average turned on or off, a checkpoint
                      past the end (one at the end is a complete run: `Run.complete`, nothing trains, exit 0)
  Clock               tokens/s and MFU between log lines, less the time set aside (eval, saves, samples); the peak
                      MFU is against is named once at the start and kept in run.json ("peak")
  Profiler            a jax.profiler trace of the steps A..B (--profile_steps), with the compiled program's text
  Fetch               the one-step-late metric fetch: the host reads step N's metrics while step N+1 runs, and
                      a non-finite loss or gradient norm stops the run naming the last good checkpoint
  Due                 what is due after a step: log, eval, save, sample, stop (a signal), the profile's end
  Run                 the above for one run, as a context manager that releases everything on the way out

The loop stays in train.py because a variant may change it (another schedule of evaluations, a
second optimizer step, a curriculum); nothing here calls back into the variant.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import time
from dataclasses import dataclass

import jax

from shared import config, data, flops, kernels
from shared.config import check_fields
from shared.runtime import distributed, guard, metrics
from shared.storage import checkpoint
from shared.errors import StencilError

RUN_FIELDS: dict[str, config.Rule] = {
    "log_every": config.positive,
    "save_every": config.at_least(0),
    "keep_checkpoints": config.positive,
    "run_dir": config.path,
    "checkpoint_dir": lambda v: v and checkpoint.location_error(v) or None,
    "resume_from": config.step_or_path,
    "watchdog_s": config.at_least(0),
    "wandb": config.one_of("auto", "online", "offline", "disabled"),
}  # their ranges (shared/config.py's rules); the evaluation's: shared/evals/__init__.py's EVAL_FIELDS


@dataclass
class RunConfig:
    """The settings of a run's surroundings, the same in every folder: every TrainConfig derives from it, so
    they are flags of every train.py (`--run_dir`, `--resume true`, ...). A folder changes a default by
    declaring the field again in its TrainConfig."""

    log_every: int = 10  # a metrics row and a log line every this many steps (and the first and last step)
    save_every: int = 100  # also saved at the end; 0 = only at the end
    keep_checkpoints: int = 3
    run_dir: str = ""  # "" = runs/<variant>-<time>; with --resume, the newest runs/<variant>-*
    checkpoint_dir: str = ""  # "" = <run_dir>/checkpoints; or a path, file://, gs://bucket/prefix, s3://bucket/prefix
    resume: bool = False  # continue from the newest good checkpoint in run_dir
    resume_from: str = ""  # continue from this checkpoint: a step of run_dir's, or a checkpoint's path
    watchdog_s: int = 1800  # abort (exit 70, every thread's stack written) if no step completes this long; 0 = off
    wandb: str = "auto"  # auto | online | offline | disabled
    profile_steps: str = ""  # "A:B": a jax.profiler trace of steps A..B into <run_dir>/profile ("" = none)

    def __post_init__(self):
        check_fields(self, RUN_FIELDS)


PER_PROCESS = ("resume", "resume_from", "stop_at")  # how one process starts and stops, not settings of the run


def settings(cfg) -> dict:
    """What config.json records of a run's config: every field, with how this process started and stops
    (PER_PROCESS: --resume, --resume_from, --stop_at) at its default, so that the file is the run's settings, a
    valid --config_path and what a resume starts from (shared/cli.py)."""
    out = dataclasses.asdict(cfg)
    for f in dataclasses.fields(cfg):
        if f.name in PER_PROCESS:
            out[f.name] = f.default
    return out


class TrainingError(StencilError, RuntimeError):
    """The run cannot go on (a non-finite loss, a checkpoint that does not match this run)."""


class Preempted(Exception):
    """Stopped on SIGTERM, SIGINT or SIGUSR1 after saving a checkpoint; exit with guard.EXIT_PREEMPTED."""


# ---------------------------------------------------------------- where the run lives


def pick_run_dir(cfg, variant: str) -> str:
    """--run_dir; else the run of a local --resume_from path; else for --resume (or a --resume_from step) the
    newest runs/<variant>-* with a checkpoint; else a new runs/<variant>-<time> (process 0's clock)."""
    if cfg.run_dir:
        return cfg.run_dir
    if cfg.resume_from and not cfg.resume_from.isdigit() and not checkpoint.is_url(cfg.resume_from):  # a local step_X
        return os.path.dirname(os.path.dirname(os.path.abspath(cfg.resume_from)))
    if cfg.resume or (cfg.resume_from and not checkpoint.is_url(cfg.resume_from)):  # a URL's: a new run dir
        runs = sorted(d for d in os.listdir("runs") if d.startswith(variant + "-")) if os.path.isdir("runs") else []
        runs = [os.path.join("runs", d) for d in runs if checkpoint.latest(os.path.join("runs", d, "checkpoints"))]
        if not runs:
            raise TrainingError(f"--resume: no runs/{variant}-*/ with a checkpoint in {os.getcwd()}; pass --run_dir")
        return runs[-1]
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(distributed.start_time()))
    return os.path.join("runs", f"{variant}-{stamp}")


def find_checkpoint(cfg, run_dir: str, ckpt_dir: str) -> str | None:
    """The checkpoint this run continues from: --resume_from's, or with --resume the newest complete one;
    None for a fresh run. A fresh run over existing checkpoints is refused (never overwritten)."""
    resume = cfg.resume or bool(cfg.resume_from)
    last = checkpoint.find(ckpt_dir, cfg.resume_from) if cfg.resume_from else checkpoint.latest(ckpt_dir)
    if last and not resume:
        raise TrainingError(
            f"{run_dir} already has checkpoints ({os.path.basename(last)}); "
            "pass --resume true to continue it, or another --run_dir"
        )
    if resume and not last:
        raise TrainingError(f"--resume: no complete checkpoint in {ckpt_dir}")
    return last


def _local(location: str) -> str | None:
    """The local path of a checkpoint location (a path or file://PATH); None for object storage."""
    if location.startswith("file://"):
        return location[len("file://") :]
    return None if checkpoint.is_url(location) else location


def later_branch(ckpt_dir: str, path: str, step: int) -> list[str]:
    """The checkpoints in `ckpt_dir` after `step`, which this run (resuming from `path`, at `step`) branches
    away from: left there, `--resume` would continue the abandoned branch from the newest of them. On a local
    disk `set_aside` moves them aside; on object storage (where a move is a copy of every file) the run is
    refused, saying how to branch into a new run directory instead."""
    later = checkpoint.later(ckpt_dir, step)
    if later and _local(ckpt_dir) is None:
        names = ", ".join(os.path.basename(p) for p in later)
        raise TrainingError(
            f"--resume_from: {ckpt_dir} holds checkpoints after step {step} ({names}), which a later "
            f"--resume would continue instead of this branch; on object storage they are not moved "
            f"aside. Branch into a new run directory: --run_dir NEW --resume_from {path} (with "
            f"--checkpoint_dir elsewhere than {ckpt_dir})"
        )
    return later


def set_aside(run_dir: str, ckpt_dir: str, later: list[str], step: int) -> str:
    """Move the checkpoints `later` (local, after `step`) and the rows of metrics.jsonl after `step` into a
    new <run_dir>/abandoned-after-<step>-<time>/ (checkpoints/, metrics.jsonl); kept, never deleted. Returns
    the line that says so."""
    aside = os.path.join(run_dir, f"abandoned-after-{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while os.path.exists(aside + (f"-{n}" if n > 1 else "")):
        n += 1
    aside += f"-{n}" if n > 1 else ""
    os.makedirs(os.path.join(aside, "checkpoints"))
    rows = metrics.move_rows_after(os.path.join(run_dir, "metrics.jsonl"), step, os.path.join(aside, "metrics.jsonl"))
    names = []
    for path in later:
        names.append(os.path.basename(path))
        shutil.move(os.path.join(_local(ckpt_dir), names[-1]), os.path.join(aside, "checkpoints", names[-1]))
    return (
        f"branching back to step {step}: the later checkpoints ({', '.join(names)}) and the {rows} metric rows "
        f"after step {step} were moved aside to {aside} (kept: delete it when it is no longer wanted); "
        f"--resume continues this branch"
    )


def data_stream(cfg, corpus) -> dict:
    """What decides the data a step sees and what its token ids mean: saved with every checkpoint."""
    return {"corpus": corpus.digest, "tokenizer": corpus.tokenizer_digest, "seq_len": cfg.seq_len}


def refuse_resume(cfg, meta: dict, stream: dict, path: str) -> None:
    """Raise TrainingError when the checkpoint at `path` (its metadata `meta`) cannot continue as this run."""
    saved = meta["config"]
    for part in ("model", "data"):
        now = dataclasses.asdict(getattr(cfg, part))
        paths = ("source", "tokenizer", "cache_dir", "eval") if part == "data" else ()  # content: compared below
        diff = {k: (saved[part].get(k), v) for k, v in now.items() if saved[part].get(k) != v and k not in paths}
        if diff:
            raise TrainingError(f"--resume: {part} config differs from {path}: {diff} (saved, now)")
    was = meta.get("stream", {})
    diff = {k: (was[k], v) for k, v in stream.items() if k in was and was[k] != v}
    if diff:
        raise TrainingError(
            f"--resume: the data stream differs from {path}'s: {diff} (saved, now). A changed "
            "corpus, tokenizer or seq_len would change the data or the meaning of token ids"
        )
    if saved.get("optimizer", "adamw") != cfg.optimizer:  # another optimizer state: its tree does not match
        raise TrainingError(
            f"--resume: {path} holds the state of --optimizer {saved.get('optimizer', 'adamw')}, "
            f"and this run asks for --optimizer {cfg.optimizer}: an optimizer state does not "
            f"carry over to another optimizer; resume with --optimizer "
            f"{saved.get('optimizer', 'adamw')}"
        )
    if (saved.get("optim", {}).get("ema", 0.0) > 0) != (cfg.optim.ema > 0):  # the average is in the state or not
        raise TrainingError(
            f"--resume: {path} was saved with --optim.ema {saved.get('optim', {}).get('ema', 0.0)}"
            f" and this run asks for --optim.ema {cfg.optim.ema}: a weight average can be "
            "retuned on resume, not turned on or off"
        )
    if meta["step"] > (cfg.stop_at or cfg.steps):  # at the end itself the run is complete (Run.complete)
        raise TrainingError(
            f"--resume: {path} is at step {meta['step']}, past the end of this run at step "
            f"{cfg.stop_at or cfg.steps} (--steps / --stop_at): it holds more steps than this "
            f"run asks for; pass --steps (or --stop_at) {meta['step']} or more"
        )


SCHEDULE_FIELDS = (
    "lr",
    "steps",
    "warmup_steps",
    "min_lr_ratio",
    "optim.schedule",
    "optim.decay_frac",
    "optim.schedule_steps",
)


def schedule_change(cfg, meta: dict, lr_now: float, step: int) -> str | None:
    """The warning when this run's learning rate for the step after `step` (`lr_now`) differs from the one the
    checkpoint's run would have used (its metadata's `next_learning_rate`), naming the settings that changed;
    None when they agree (or the checkpoint predates the record)."""
    saved = meta.get("next_learning_rate")
    if saved is None or math.isclose(saved, lr_now, rel_tol=1e-5, abs_tol=1e-12):
        return None
    was, now = meta["config"], dataclasses.asdict(cfg)

    def get(d, name):
        part, _, field = name.rpartition(".")
        return (d.get(part, {}) if part else d).get(field)

    changed = [k for k in SCHEDULE_FIELDS if get(was, k) != get(now, k)]
    text = (
        f"warning: the learning-rate schedule changed at the resumed step {step}: step {step + 1} was to run at "
        f"lr {saved:.3g} and runs at {lr_now:.3g} "
        f"({', '.join(f'--{k} {get(was, k)} -> {get(now, k)}' for k in changed) or 'another schedule'})"
    )
    if changed == ["steps"]:  # an extended (or shortened) run: the schedule is computed from --steps
        text += (
            f". The schedule spans --steps, so extending a run reshapes it: to keep the saved one pass "
            f"--optim.schedule_steps {get(was, 'optim.schedule_steps') or get(was, 'steps')}; for a fresh decay, "
            f"train with --optim.schedule wsd and resume from a checkpoint of its stable phase "
            f"(docs/train-loop.md, 'Extending a run')"
        )
    return text


def profile_range(cfg) -> tuple[int, int] | None:
    """`profile_steps` "A:B" as (A, B), None when it is empty or malformed."""
    a, sep, b = cfg.profile_steps.partition(":")
    if not (sep and a.isdigit() and b.isdigit() and 0 < int(a) <= int(b) <= cfg.steps):
        return None
    return int(a), int(b)


# ---------------------------------------------------------------- the pieces of a running loop


class Clock:
    """Training throughput between log lines: tokens over wall time, less the time spent `aside()` (evaluation,
    saves, samples, the profile's end). Starts after the first step (compiled and run once)."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.t, self.step, self.set_aside = 0.0, 0, 0.0

    def start(self, step: int) -> None:
        self.t, self.step, self.set_aside = time.perf_counter(), step, 0.0

    @contextlib.contextmanager
    def aside(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.set_aside += time.perf_counter() - t0

    def tokens_per_second(self, step: int) -> float | None:
        """Since the last call (or the start), then restarts; None when no step completed since."""
        if step <= self.step:
            return None
        tok_s = self.tokens_per_step * (step - self.step) / (time.perf_counter() - self.t - self.set_aside)
        self.start(step)
        return tok_s


class Profiler:
    """--profile_steps A:B: a jax.profiler trace of steps A..B into <run_dir>/profile, and the compiled
    step's text beside it (which scope each op comes from: tools/bench/profile_top.py reads both)."""

    def __init__(self, window: tuple[int, int] | None, run_dir: str):
        self.window, self.dir = window, os.path.join(run_dir, "profile")

    def before(self, step: int) -> None:
        if self.window and step == self.window[0]:
            jax.profiler.start_trace(self.dir)

    def ends_at(self, step: int) -> bool:
        return bool(self.window) and step == self.window[1]

    def stop(self, state, lowered) -> str:
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        if jax.process_index() == 0:
            with open(os.path.join(self.dir, "jit_train_step.hlo.txt"), "w") as f:
                f.write(lowered.compile().as_text())
        return (
            f"profile of steps {self.window[0]}-{self.window[1]}: {self.dir}; the top ops: "
            f"python tools/bench/profile_top.py {self.dir}"
        )


class Fetch:
    """Step N's metrics are read on the host while step N+1 runs, so the host never stalls the device. `push`
    hands over a step's metrics (still on the device); `pull` returns the pending ones, checked."""

    def __init__(self, on_bad):
        self.pending = None  # (step, metrics on the device)
        self.on_bad = on_bad  # called before the error is raised (waits for a save in flight, names the last good)
        self.losses: dict[int, float] = {}

    def push(self, step: int, m) -> None:
        self.pending = (step, m)

    def pull(self) -> dict:
        step, m = self.pending
        self.pending, m = None, {k: float(v) for k, v in jax.device_get(m).items()}
        if not (math.isfinite(m["train/loss"]) and math.isfinite(m["optim/grad_norm"])):  # a bad update too
            raise TrainingError(
                f"loss {m['train/loss']}, grad_norm {m['optim/grad_norm']} at step {step}; stopped "
                f"without saving. Last good checkpoint: {self.on_bad()} (untouched)"
            )
        self.losses[step] = m["train/loss"]
        return m


@dataclass
class Due:
    """What the loop does after a step, beyond stepping."""

    log: bool = False
    eval: bool = False
    save: bool = False
    sample: bool = False
    stop: bool = False  # a stop signal arrived: save, then exit 75
    profile_end: bool = False

    def __bool__(self) -> bool:
        return any(dataclasses.astuple(self))


# ---------------------------------------------------------------- the run


class Run:
    """One training run's surroundings. Entering it picks the run directory, takes its lock, finds the
    checkpoint to continue (refusing one that does not fit this run) and opens the data; `begin` starts
    the logger, the saver, the stop signals and the watchdog; leaving it releases all of them, also on
    an error. Attributes a loop reads: `checkpoint`, `start`, `end`, `loader`, `evals`, `corpus`, `clock`."""

    def __init__(self, cfg, folder: str, mesh, evaluator=None):
        self.cfg, self.mesh, self.variant = cfg, mesh, os.path.basename(os.path.abspath(folder))
        self.evaluator = evaluator  # evaluation beyond the held-out loss (shared/evals: probes, lm-eval), or None
        self.folder = os.path.abspath(folder)
        self.run_dir = pick_run_dir(cfg, self.variant)
        self.ckpt_dir = cfg.checkpoint_dir or os.path.join(self.run_dir, "checkpoints")
        self.logger = self.saver = self.stop = self.watchdog = None
        # Every refusal comes before anything is written, so that a refused run leaves no directory behind:
        guard.RunLock.refuse_if_held(self.run_dir)  # another run in it (said first)
        self._open(cfg)  # the checkpoint to continue, the data, the resume refusals: reads only
        if guard.STOP is not None:  # the command line's: a signal before the first step names the checkpoint
            guard.STOP.resume_from = self.checkpoint
        self.lock = guard.RunLock(self.run_dir, self.ckpt_dir)  # one run per directory (creates it)
        self.notes = []  # lines for the log once it is open
        try:
            if jax.process_index() == 0:  # the lock's holder; under it a run that wrote here meanwhile is not overrun
                if find_checkpoint(cfg, self.run_dir, self.ckpt_dir) != self.checkpoint or (
                    self.checkpoint and checkpoint.later(self.ckpt_dir, self.start) != self.later
                ):
                    raise TrainingError(
                        f"the checkpoints in {self.ckpt_dir} changed while this run started "
                        f"(another run?); start it again"
                    )
                if self.later:  # a branch back: the abandoned future is moved aside, kept
                    self.notes.append(set_aside(self.run_dir, self.ckpt_dir, self.later, self.start))
        except BaseException:
            self.lock.release()
            raise

    def _open(self, cfg) -> None:
        """Find the checkpoint, open the data, refuse a resume that does not fit: reads only, writes nothing."""
        self.checkpoint = find_checkpoint(cfg, self.run_dir, self.ckpt_dir)
        self.tokenizer_file = os.path.join(self.run_dir, "tokenizer.json")
        data_cfg = cfg.data
        if self.checkpoint and not data_cfg.tokenizer and os.path.exists(self.tokenizer_file):
            data_cfg = dataclasses.replace(data_cfg, tokenizer=self.tokenizer_file)  # the run's own: ids keep meaning
        p, n = jax.process_index(), jax.process_count()
        self.corpus = data.load_corpus(data_cfg, cfg.model.vocab_size, progress=p == 0)
        self.stream = data_stream(cfg, self.corpus)
        self.loader = data.make_loader(
            self.corpus, cfg.seq_len, cfg.batch_size, cfg.data.seed, process_index=p, process_count=n
        )
        self.evals = data.eval_sets(
            self.corpus,
            cfg.seq_len,
            cfg.batch_size // cfg.grad_accum,
            cfg.eval_batches,
            process_index=p,
            process_count=n,
        )
        if self.evaluator:  # its sets and checks, before anything is written (a refusal leaves no directory)
            self.evaluator.open(self.corpus, self.evals)
        self.start, self.end = 0, cfg.stop_at or cfg.steps
        self.skipped = []  # partial checkpoint folders a resume passed over: named in the run's first lines
        if self.checkpoint:
            self.meta = meta = checkpoint.read_metadata(self.checkpoint)
            refuse_resume(cfg, meta, self.stream, self.checkpoint)
            self.start = meta["step"]
            self.skipped = checkpoint.partial(self.ckpt_dir) if jax.process_index() == 0 else []
        # re-run after it finished (a retry wrapper, a requeued job): nothing to train, main() returns (exit 0)
        self.complete = self.checkpoint is not None and self.start == self.end
        self.later = later_branch(self.ckpt_dir, self.checkpoint, self.start) if self.checkpoint else []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.saver is not None:
            self.saver.close()  # an error on the way out: the save in flight still ends (or is reported)
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.stop is not None:
            self.stop.restore()
        if self.logger is not None:
            self.logger.close()
        self.lock.release()
        return False

    def restore(self, abstract_state):
        """The checkpoint's state, placed as `abstract_state`'s shardings say; the loader continues where it was."""
        state, meta = checkpoint.restore(self.checkpoint, abstract_state)
        self.loader.restore(meta["loader"])
        return state

    def begin(self, n_params: int, flops_per_token: float, schedule) -> None:
        """Start logging (metrics.jsonl, wandb, the bar), the saver, the stop signals and the watchdog, and write
        the run's first line. `schedule`: step -> learning rate, the optimizer's (its value after each saved step
        is recorded with the checkpoint, and a resume whose schedule differs there says so). A run that is
        complete already (a no-op resume) says so and does nothing else: no peak measured, no wandb run opened."""
        cfg, mesh, quiet = self.cfg, self.mesh, self.complete
        self.stop = guard.STOP or guard.StopSignals()  # SIGTERM / SIGINT / SIGUSR1: finish the step, save, exit 75
        self.stop.install()  # again: what ran since the command line's parse may have set handlers of its own
        self.stop.starting, self.stop.last_saved = False, lambda: checkpoint.latest_name(self.ckpt_dir)
        self.flops_per_token, self.schedule = flops_per_token, schedule
        self.peak, self.peak_src = (None, "") if quiet else flops.device_peak(cfg.model.compute_dtype)
        self.clock = Clock(cfg.batch_size * cfg.seq_len)
        self.logger = metrics.Logger(
            self.run_dir,
            settings(cfg),
            total_steps=self.end,
            wandb_mode="disabled" if quiet else cfg.wandb,
            name=os.path.basename(self.run_dir),
            start_step=self.start,
            process_index=jax.process_index(),
            progress=not quiet,
        )
        if self.corpus.tokenizer is not None and jax.process_index() == 0 and not os.path.exists(self.tokenizer_file):
            self.corpus.tokenizer.save(self.tokenizer_file)  # never over the run's own
        self.write(
            f"{self.variant}: {n_params / 1e6:.2f}M params, {flops_per_token / 1e6:.1f} MFLOP/token, mesh "
            f"{dict(mesh.shape)}, {cfg.batch_size * cfg.seq_len} tokens/step, steps {self.start}->{self.end}, "
            f"run dir {self.run_dir}"
        )
        for name, why in self.skipped:
            self.write(f"resume: ignored {checkpoint.join(self.ckpt_dir, name)}: {why}")
        if self.complete:
            self.write(
                f"this run is complete: {self.checkpoint} is at step {self.end}, its last step (--steps / "
                f"--stop_at); nothing to train. To train further, raise --steps (or --stop_at)"
            )
        if (
            not quiet
        ):  # the peak MFU is against: said once, kept in run.json (tools/review/compare_runs.py compares peaks)
            self.write(f"MFU is against {self.peak / 1e9:,.1f} GFLOP/s per device: {self.peak_src}")
            self.logger.record("peak", {"per_device": self.peak, "source": self.peak_src})
        if self.checkpoint:
            self.notes.append(schedule_change(cfg, self.meta, float(schedule(self.start)), self.start))
        for note in filter(None, self.notes):
            self.write(note)
        self.saver = checkpoint.Saver()  # asynchronous saves, one in flight
        self.watchdog = guard.Watchdog(cfg.watchdog_s, self.run_dir)
        self.profiler = Profiler(profile_range(cfg), self.run_dir)
        self.fetched = Fetch(self._last_good)
        self.val_loss, self.sample, self.saved = None, "", None

    def _last_good(self) -> str:
        self.saver.wait()  # an earlier step's save in flight ends first, so the message names it
        return checkpoint.latest_name(self.ckpt_dir)

    def steps(self):
        """The steps to run, start+1 .. end; the profiler's window opens before its first step."""
        for step in range(self.start + 1, self.end + 1):
            self.profiler.before(step)
            yield step

    def due(self, every: int, step: int) -> bool:
        """A cadence: every `every` steps and at the end; 0 = only at the end."""
        return step == self.end or (every > 0 and step % every == 0)

    def step_done(self, step: int, m) -> Due:
        """Hand over this step's metrics (on the device); fetch and check the previous step's meanwhile; say
        what is due now. A background save that failed stops the run here."""
        cfg = self.cfg
        self.saver.check()
        if self.fetched.pending is not None:
            self._pull()  # the step before, while this one runs
        self.fetched.push(step, m)
        first, stopping = step == self.start + 1, step != self.end and self.stop.requested()  # every process agrees
        eval_now = self.due(cfg.eval_every, step)
        can_sample = cfg.sample_tokens > 0 and self.corpus.tokenizer is not None
        return Due(
            log=first or self.due(cfg.log_every, step) or eval_now,
            eval=eval_now,
            save=self.due(cfg.save_every, step) or stopping,
            sample=self.due(cfg.sample_every, step) and can_sample,
            stop=stopping,
            profile_end=self.profiler.ends_at(step),
        )

    def _pull(self) -> dict:
        m = self.fetched.pull()
        self.watchdog.beat()  # a step completed (the first beat arms it: compilation is not counted)
        return m

    def fetch(self) -> dict:
        """This step's metrics, on the host and checked. After the first step (compiled and run once) the
        throughput clock starts and the kernels its program chose are recorded in run.json."""
        step = self.fetched.pending[0]
        row = self._pull()
        if step == self.start + 1:
            self.clock.start(step)
            self.logger.record("kernels", kernels.choices())  # the backends the compiled step uses, per op
        return row

    def end_profile(self, state, lowered) -> None:
        with self.clock.aside():
            self.write(self.profiler.stop(state, lowered))

    def log(self, step: int, row: dict, shown: dict) -> None:
        """tokens/s and MFU since the last line join the row, which goes to metrics.jsonl and wandb; `shown`
        ({metric: (label, format)}) picks what the progress bar and the log line show; the rest of an
        evaluation (eval/*) follows on one line of its own."""
        tok_s = self.clock.tokens_per_second(step)
        if tok_s is not None:
            row |= {
                "throughput/tokens_per_second": tok_s,
                "throughput/mfu": flops.mfu(self.flops_per_token, tok_s, self.mesh.size, self.peak),
            }
        if "eval/loss" in row:
            self.val_loss = row["eval/loss"]
        self.logger.log(step, row)
        text = {label: format(row[k], f) for k, (label, f) in shown.items() if k in row}
        self.logger.progress(step, **text)
        self.write(f"step {step:6d}  " + "  ".join(f"{k} {v}" for k, v in text.items()))
        more = {k[len("eval/") :]: v for k, v in row.items() if k.startswith("eval/") and k not in shown}
        if more:  # the rest of an evaluation, on one line: bpb, each source and set, the probes, lm-eval
            self.write("       eval  " + "  ".join(f"{k} {v:.4g}" for k, v in sorted(more.items())))

    def save(self, step: int, state) -> str:
        """Save asynchronously (the loop waits for the host copy only) with what a resume needs."""
        meta = {
            "config": dataclasses.asdict(self.cfg),
            "loader": self.loader.state(),
            "variant": self.variant,
            "stream": self.stream,
            "next_learning_rate": float(self.schedule(step)),
        }  # the lr of step + 1
        with self.clock.aside():
            self.saved = self.saver.save(self.ckpt_dir, step, state, meta, keep=self.cfg.keep_checkpoints)
        return self.saved

    def evaluate(self, eval_batch, params=None) -> dict:
        """eval/loss of the held-out rows, eval/<source>/loss of each source of a mixture and eval/<name>/loss of
        every named set (--data.eval), each with its bits per byte (eval/bpb, eval/<name>/bpb) when the set's
        text is known. `eval_batch(rows)` gives (summed loss, tokens) of one batch of host rows. With `params`
        (the weights evaluation uses), the run's evaluator too (probes, lm-eval tasks: shared/evals), when it
        has any. Not counted in tokens/s."""
        row = {}
        if self.evaluator and params is None:
            raise TypeError("Run.evaluate: this run has probes or lm-eval tasks; pass the weights (params=)")
        with self.clock.aside():
            if self.evaluator:
                row |= self.evaluator(params)
            for name, s in self.evals.items():
                nll, n = 0.0, 0.0
                for b in s.batches:
                    sums, count = eval_batch(b)
                    nll, n = nll + float(sums), n + float(count)
                key = f"eval/{name}/" if name else "eval/"
                row[key + "loss"] = nll / max(n, 1.0)
                if s.bpb(row[key + "loss"]) is not None:
                    row[key + "bpb"] = s.bpb(row[key + "loss"])
        return row

    def show_sample(self, step: int, make_text) -> None:
        """Run `make_text()` (a sample of the model; not counted in tokens/s) and print what it returns."""
        with self.clock.aside():
            self.sample = make_text()
        self.write(f"--- sample after {step} steps ---\n{self.sample}\n---")

    def write(self, text: str) -> None:
        """A line on the console (process 0), without breaking the progress bar."""
        self.logger.write(text)

    def preempted(self, step: int) -> None:
        """After a stop signal: wait for this step's save, say how to continue, raise Preempted (exit 75)."""
        self.saver.wait()
        self.write(
            f"stopped by a signal after step {step}: saved {self.saved}; exiting with code "
            f"{guard.EXIT_PREEMPTED}. Continue with --resume true --run_dir {self.run_dir}"
        )
        raise Preempted(f"preempted after step {step}; checkpoint {self.saved}")

    def finish(self, state) -> dict:
        """Wait for the last save to complete; what main() returns."""
        self.saver.wait()
        return {
            "run_dir": self.run_dir,
            "losses": self.fetched.losses,
            "val_loss": self.val_loss,
            "step": self.end,
            "sample": self.sample,
            "state": state,
            "already_complete": self.complete,
        }
