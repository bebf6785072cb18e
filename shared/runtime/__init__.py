"""The process around a run: `distributed` (jax.distributed from the launcher's environment), `guard`
(the run lock, stop signals, the hang watchdog), `metrics` (metrics.jsonl, wandb, the console and its
progress bar) and `memory` (what a step will hold on a device). AGENTS.md's map says what each module does."""
