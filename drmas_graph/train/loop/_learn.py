"""One step's update of every trained model on its samples (`update_models`), with the old logprobs of the PPO
ratio chosen by `cfg.old_logprobs` (`old_logprobs`).

An embedded policy serves the very module its updater trains: the update runs inside `policy.updating_weights()`
(which bumps its version), on the policy's decoding thread. A served policy's local copy is trained here and
pushed to its servers (`_checkpoints.sync_weights`); in asynchronous training (`pipelined`) every model's new weights
reach the rollouts at the next step boundary instead (`_pipeline`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

from drmas_graph.train.loop._build import is_served
from drmas_graph.train.loop._checkpoints import sync_weights
from drmas_graph.train.optim import with_trainer_logprobs
from drmas_graph.train.loop._state import ModelSlot, RunState, on_model_thread
from drmas_graph.types import Sample

__all__ = ["update_models", "old_logprobs"]


def update_models(run: RunState, samples: Sequence[Sample], *, step: int, pipelined: bool
                  ) -> tuple[dict[str, float], float]:
    """Update every trained model on its agents' samples; return the updaters' metrics and the seconds spent
    pushing weights to servers (`model/<name>/sync_s` each, in the metrics too)."""
    metrics: dict[str, float] = {}
    sync_s = 0.0
    for model in run.trained_models():
        name, policy, updater = model.name, model.policy, model.updater
        model_samples, old = old_logprobs(run, model, [s for s in samples if s.agent in model.agents],
                                          metrics, pipelined=pipelined)
        if not pipelined and not is_served(policy):
            with policy.updating_weights():  # the policy serves the trained module itself
                done = on_model_thread(model, functools.partial(updater.update, model_samples, old_logprobs=old))
                metrics.update(done.to_dict())
            continue
        # the trainer trains its own copy: pushed to the servers now, or (asynchronous training) installed
        # at the next step boundary (`_pipeline`)
        metrics.update(updater.update(model_samples, old_logprobs=old).to_dict())
        if not pipelined:
            metrics[f"model/{name}/sync_s"] = sync_weights(run, name, version=step + 1)
            sync_s += metrics[f"model/{name}/sync_s"]
    return metrics, sync_s


def old_logprobs(run: RunState, model: ModelSlot, samples: list[Sample], metrics: dict[str, float], *,
                 pipelined: bool) -> tuple[list[Sample], str]:
    """The model's samples and the `update(old_logprobs=...)` mode, by `cfg.old_logprobs` (auto: the
    trainer's for embedded policies, see `_old_logprobs`; as rolled out for served ones). The trainer's are
    the update's own (detached) when it takes one step (n_minibatches 1), else recomputed here first."""
    mode = run.cfg.old_logprobs
    if mode == "auto":  # asynchronous training: the trainer's (the proximal policy of decoupled PPO)
        mode = "rollout" if is_served(model.policy) and not pipelined else "trainer"
    if mode == "rollout" or not samples:
        return samples, "given"
    updater = model.updater
    if updater.settings.n_minibatches == 1:
        return samples, "current"
    started = time.perf_counter()
    logprobs = on_model_thread(model, functools.partial(updater.compute_logprobs, samples))
    metrics[f"model/{model.name}/old_logprobs_s"] = time.perf_counter() - started
    samples, gaps = with_trainer_logprobs(samples, logprobs)
    metrics.update(gaps)
    return samples, "given"
