"""The run: `_setup.build_run` builds a `_state.RunState` once from the config; `trainer` (the loop) rolls out
(`_rollouts`), scores (`_scoring.score_episodes`, the one scoring path), updates (`_learn`), checkpoints
(`_checkpoints`) and evaluates (`evaluate`); `_pipeline` (asynchronous training), `_build` (policies and updaters
from the config), `_check` (`drmas-graph check`), `rescore` (a stored run, new rewards), `metrics` (where metrics
go) and `_metric_reference` (what each metric means).

May import: `train.optim`, `train.engines` and every layer below train (shared modules, instrumentation, engine,
served, traces).
"""
