"""The run: `_setup.build_run` builds a `_state.RunState` (a `ModelSlot` per model) once from the config; `trainer`
(one step as `collect`, `learn`, `publish`, and the loop) rolls out (`_rollouts.roll_out`), scores
(`_scoring.score_episodes`, the one scoring path; `_scoring.store_scores`, the one writer of scores to the store),
updates (`_learn`), checkpoints (`_checkpoints`) and evaluates (`evaluate`); `_pipeline` (asynchronous training),
`_build` (policies and updaters from the config), `_check` (`drmas-graph check`), `rescore` (a stored run, new
rewards), `metrics` (where metrics go) and `_metric_reference` (what each metric means).

The names below, and the public modules `trainer`, `evaluate`, `rescore` and `metrics`, are what the command line
and the package's own exports use; the modules starting with `_` are this package's own.

May import: `train.optim`, `train.engines` and every layer below train (shared modules, instrumentation, engine,
served, traces).
"""

from drmas_graph.train.loop._check import NO_SIGNAL_EXIT, CheckReport, preflight
from drmas_graph.train.loop._checkpoints import (CheckpointSpaceError, NothingToResumeError, checkpoint_step,
                                                 load_checkpoint_adapters)
from drmas_graph.train.loop._pipeline import AsyncTimeoutError
from drmas_graph.train.loop._setup import RunDirInUseError, free_run_dir
from drmas_graph.train.loop._state import RunState
from drmas_graph.train.loop.evaluate import reply_lines
from drmas_graph.train.loop.trainer import Trainer, TrainResult, train_graph

__all__ = ["NO_SIGNAL_EXIT", "AsyncTimeoutError", "CheckReport", "CheckpointSpaceError", "NothingToResumeError",
           "RunDirInUseError", "RunState", "TrainResult", "Trainer", "checkpoint_step", "free_run_dir",
           "load_checkpoint_adapters", "preflight", "reply_lines", "train_graph"]
