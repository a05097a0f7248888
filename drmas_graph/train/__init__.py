"""Training: agent-wise GRPO (Dr. MAS) over an instrumented graph.

Three groups, each a job (each group's docstring says what it may import; tests/test_layout.py checks it):

    engines/   processes and optimizer backends: `_world` (rank, world size), `_distributed` (several processes
               under a launcher), `_engines` (torch, DeepSpeed ZeRO), `_settings` (UpdateSettings, LossSettings)
    optim/     the update: `update.ModelUpdater` (micro-batches packed into sequence trees in `_packing`, logprobs in
               `_logprobs`, `_old_logprobs`, the reference model in `_reference`, metrics in `_update_metrics`),
               `lora.LoraUpdater` (one adapter per agent; both implement `_updater.Updater`), `losses`,
               `advantages`, `offpolicy`
    loop/      the run: `_setup.build_run` builds a `_state.RunState` from the config; `trainer` (the loop,
               `train_graph`) -> `_rollouts` (G concurrent episodes per task) -> `_scoring` (rewards, advantages,
               the step's metrics; `score_episodes` is the one scoring path of training, evaluation, check and
               rescore) -> `_learn` (every trained model's update) -> `_checkpoints` (weights to servers,
               checkpoints, resume) -> `evaluate` (avg@k, pass@k); `_pipeline` (asynchronous training), `_build`
               (policies and updaters from the config), `_check` (`drmas-graph check`), `rescore`, `metrics`

The names below are this package's public seam for the command line and the judge; they load lazily.

May import: every layer below it (shared modules, instrumentation, engine, served, traces).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, tuple[str, str | None]] = {
    "train_graph": ("drmas_graph.train.loop.trainer", "train_graph"),
    "TrainResult": ("drmas_graph.train.loop.trainer", "TrainResult"),
    "Trainer": ("drmas_graph.train.loop.trainer", "Trainer"),
    "reply_lines": ("drmas_graph.train.loop.evaluate", "reply_lines"),
    "RunDirInUseError": ("drmas_graph.train.loop._setup", "RunDirInUseError"),
    "free_run_dir": ("drmas_graph.train.loop._setup", "free_run_dir"),
    "NothingToResumeError": ("drmas_graph.train.loop._checkpoints", "NothingToResumeError"),
    "RunState": ("drmas_graph.train.loop._state", "RunState"),
    "AsyncTimeoutError": ("drmas_graph.train.loop._pipeline", "AsyncTimeoutError"),
    "build_policy": ("drmas_graph.train.loop._build", "build_policy"),
    "checkpoint_step": ("drmas_graph.train.loop._checkpoints", "checkpoint_step"),
    "load_checkpoint_adapters": ("drmas_graph.train.loop._checkpoints", "load_checkpoint_adapters"),
    "preflight": ("drmas_graph.train.loop._check", "preflight"),
    "NO_SIGNAL_EXIT": ("drmas_graph.train.loop._check", "NO_SIGNAL_EXIT"),
    "CheckReport": ("drmas_graph.train.loop._check", "CheckReport"),
    "distributed": ("drmas_graph.train.engines._distributed", None),
}
"""Public name -> (the module that defines it, its attribute there; None: the module itself)."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = importlib.import_module(module)
    return value if attr is None else getattr(value, attr)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
