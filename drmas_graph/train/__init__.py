"""Training: agent-wise GRPO (Dr. MAS) over an instrumented graph.

Three groups, each a job and each a boundary: a group uses another only through the names in that group's
`__init__` (its `__all__`); tests/test_layout.py checks it, and each group's docstring says what it may import.

    engines/   processes and optimizer backends: `distributed` (several processes under a launcher), `rank`,
               `world_size`, `ENGINES` (torch, DeepSpeed ZeRO) and the collectives they share, `UpdateSettings`,
               `LossSettings`
    optim/     the update: `ModelUpdater` (micro-batches packed into sequence trees, logprobs, the reference
               model, its metrics), `LoraUpdater` (one adapter per agent; both are `Updater`s),
               `compute_advantages`, the losses and the off-policy correction
    loop/      the run: `_setup.build_run` builds a `_state.RunState` from the config; `trainer` (the loop,
               `train_graph`) -> `_rollouts` (G concurrent episodes per task) -> `_scoring` (rewards, advantages,
               the step's metrics; `score_episodes` is the one scoring path of training, evaluation, check and
               rescore) -> `_learn` (every trained model's update) -> `_checkpoints` (weights to servers,
               checkpoints, resume) -> `evaluate` (avg@k, pass@k); `_pipeline` (asynchronous training), `_build`
               (policies and updaters from the config), `_check` (`drmas-graph check`), `rescore`, `metrics`

engines/ imports neither of the others, optim/ imports engines/, loop/ imports both. The names below are the
loop's face, offered here for the command line; they load lazily (importing `drmas_graph.train`
loads no torch).

May import: every layer below it (shared modules, instrumentation, engine, served, traces).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["NO_SIGNAL_EXIT", "AsyncTimeoutError", "CheckReport", "CheckpointSpaceError", "NothingToResumeError",
           "RunDirInUseError", "RunState", "TrainResult", "Trainer", "checkpoint_step", "free_run_dir",
           "load_checkpoint_adapters", "preflight", "reply_lines", "train_graph"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("drmas_graph.train.loop"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
