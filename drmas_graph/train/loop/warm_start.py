"""`warm_start(graph, env, config)`: the warm start alone, supervised fine-tuning of each agent on its demonstrations
(`warm_start:` in the config). `train_graph` (and `drmas-graph train`) runs it first when the config has it, and
starts the RL from its checkpoint; run alone (here, or `drmas-graph warm-start`), a later `train_graph` on the same
run folder starts from it without doing it again. What it does: `_warm` (docs/guide/warm-start.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from drmas_graph.config import TrainConfig, merge_overrides
from drmas_graph.errors import ConfigError
from drmas_graph.policy import Policy
from drmas_graph.train.engines import distributed
from drmas_graph.train.loop._setup import build_run
from drmas_graph.train.loop._state import close
from drmas_graph.train.loop._warm import WarmStartResult, holds_only_warm_start, warm_start_done

__all__ = ["warm_start", "WarmStartResult", "warm_start_state"]


def warm_start(graph: Any, env: Any, config: TrainConfig | None = None, *,
               policies: Mapping[str, Policy] | None = None, train_models: Mapping[str, Any] | None = None,
               rollout_config: Mapping[str, Any] | None = None, **overrides: Any) -> WarmStartResult:
    """Fine-tune each agent's policy (or its LoRA adapter) on its demonstrations, before RL, into `run_dir`.

    Args are those of `train_graph`; the config's `warm_start` section says what to learn from and how
    (`WarmStartConfig`: `demonstrations`, a fine-tuning JSONL file or {agent: file}, and/or `traces`, a trace store
    recorded with the app's own models; `epochs`, `lr`, `batch_size`, `eval_tasks`, ...). Writes the warm-started
    weights to run_dir/checkpoints/warm_start, its metrics to run_dir/metrics.jsonl (negative steps) and the held-out
    episodes to run_dir/traces.db. A run folder whose warm start is done is only reported. Embedded policies given in
    `policies` keep the warm-started weights.

        result = warm_start(graph, env, cfg)          # cfg.warm_start = {"demonstrations": "demos.jsonl", ...}
        print(result.summary())
        train_graph(graph, env, cfg)                   # the RL, from the warm-started weights
    """
    cfg = merge_overrides(config, overrides)
    if cfg.warm_start is None:
        raise ConfigError("warm_start(): the config has no `warm_start` section; add one, e.g. warm_start: "
                          "{demonstrations: demos.jsonl} (an OpenAI fine-tuning JSONL file whose records name their "
                          "\"agent\")")
    run = build_run(graph, env, cfg, policies=policies, train_models=train_models, rollout_config=rollout_config,
                    warm_only=True)
    try:
        if distributed.is_main():
            cfg.to_yaml(run.run_dir / "config.yaml")
        distributed.remove_rank_stores(run.run_dir, run.store.close)
        return run.warm_start
    finally:
        close(run.built, run.store)


def warm_start_state(run_dir: str | Path) -> str | None:
    """What a run folder holds of a warm start: 'done' (its checkpoint is complete: the RL starts from it, with
    `resume` also after the RL began, before its first checkpoint), 'begun' (it did not finish and nothing of the RL
    followed: it starts over), None (neither)."""
    run_dir = Path(run_dir)
    if warm_start_done(run_dir):
        return "done"
    return "begun" if holds_only_warm_start(run_dir) else None
