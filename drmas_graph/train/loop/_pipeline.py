"""Asynchronous training: later steps' rollouts run while the trainer updates, on a fixed or a free schedule.

Versions count the updates applied (v0 = the initial weights). With `async.max_staleness` >= 1 and
`async.schedule: one_step_off` (the default; `OneStepOff`):

    rollout thread  | step 0 on v0 | step 1 on v0 | step 2 on v1 | step 3 on v2 | ...
    trainer (main)  |              | update 0     | update 1     | update 2     | ...
                                   ^ boundary 1: rollouts of step 1 done, update 0 done (the trainer holds v1)

At boundary u the trainer's weights v(u) become the rollout weights (`install`), the rollouts of step u+1 start on
a background thread, and update u trains on step u's groups, sampled by v(u-1): 1 update stale (step 0's by v0:
0). Every group's weights are a function of its step, never of timing, so a seeded run is reproducible to the
last digit at any `max_concurrency`, as the synchronous loop is: the proximal logprobs are the trainer's (as with
`old_logprobs: trainer`), and an embedded policy's behaviour logprobs are recomputed by the weights that sampled
them (its serving module, right after the step's rollouts: the rollout's own carry batching noise); a served
policy's are the server's, as recorded. The off-policy correction is `offpolicy` (decoupled PPO).

Groups stay whole: a step's rollouts end when every episode of every group has; a group trained in update u is
dropped (and counted in `async/dropped_groups`) if any of its trained turns was sampled more than
`max_staleness` versions before u (never one step off, where staleness is at most 1). A group is started under
one version (installs happen only at boundaries, when no episode runs). Metrics per step: `async/wait_s` (the
trainer waiting for rollouts), `async/install_s`, staleness per agent (mean, max) and the importance weights.

How weights reach the rollouts, per trained model:
- embedded (`TransformersPolicy`): the trainer trains a copy of the module (`trainer_copies`: one more copy of
  the weights in memory, 4 bytes x parameters in float32, 2 in bfloat16; where it does not fit in the device's
  free memory the run trains synchronously, with a warning and the metric `async/synchronous_fallback`), and
  the policy decodes with its own module (given `update.attn_implementation` first, so both compute alike; its
  behaviour logprobs are packed as a probe of that module says); install copies the weights in, inside
  `policy.updating_weights()`. The update runs on the main thread while the policy decodes on its own (on CPU
  the two share the cores).
- served (SGLang, vLLM): the trainer already trains a local copy; install pushes it (`_checkpoints.push_weights`),
  at a boundary, so no request is in flight. The servers load v0 from run_dir/sync at the first boundary, so
  that a checkpoint can copy what they serve.

Kill-and-resume: a checkpoint at step c (saved at the end of update c-1, while step c rolls out) holds the
trainer's weights v(c) and the rollout weights v(c-1) (`save_serving`); the resumed run rolls step c out again
on v(c-1): the same groups, so no group is lost or trained twice.

A run that stops early (an error, a kill) cancels the steps still rolling out and joins their threads
(`OneStepOff.stop`, from `Trainer.run` and `Trainer.close`) before the trace store is closed: nothing writes to
it afterwards, and no rollout thread outlives the run (a graph node stuck in user code is left behind, as ever).

Every wait has a timeout (`async.timeout_s`): a step's rollouts, a weight push, the other processes at a boundary
(`AsyncTimeoutError`, naming the step; a push that fails names the server).

`async.schedule: free` (`FreeRunning`), k = max_staleness: step s starts as soon as the rollout weights are
v(s-k) or newer (steps 0..k at once), and each update's weights reach the rollouts right after it, while other
steps' episodes are in flight:

    rollouts  | steps 0, 1, 2 on v0 ...     | step 3 starts on v1 ...      | step 4 on v2 ...
    trainer   | (waits for step 0) update 0 | install v1, update 1         | install v2, update 2 ...   (k = 2)

A step's slow episodes no longer hold the next step: up to k+1 steps roll out together (sharing `max_concurrency`:
a later step's episodes take the slots an earlier step's free, `_rollouts.EpisodeSlots`), and the trainer waits
only when step u is not done when update u-1 is. The batch of update u is still step u's groups, whole (a group
is trained when all of its episodes are done, never split); its episodes start under the version installed
when the step starts (one waiting for a `max_concurrency` slot: when it gets one), and a later call of an
episode samples with whatever version is installed then (the embedded engine finishes the rows decoding on the
old weights and starts new ones on the new; a served policy's push waits for, or SGLang pauses and retries, its
requests in flight: `drmas_graph.served`). Each Turn records its version, so staleness at update u is
u - version, from 0 to k: no group is ever dropped. Behaviour logprobs are the ones the rollout recorded (the
weights that sampled a turn may be gone). What is reproducible: the tasks, groups and sampling seeds of each
step; not the versions that sample each call (they depend on timing), so not the weights to the last digit.
Kill-and-resume: the checkpoint after update c-1 holds v(c) for the trainer and the rollouts; the resumed run
starts steps c..c+k on it, so no trained group is lost or repeated. Every process runs the same schedule
(installs and launches follow the updates, which are collective).
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import functools
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from drmas_graph.env import Group
from drmas_graph.errors import ConfigError, DrmasError, PolicyError
from drmas_graph.train.engines import distributed
from drmas_graph.train.loop import _build, _checkpoints
from drmas_graph.train.loop._rollouts import StepBatch, slots_key
from drmas_graph.train.optim import (CorrectionStats, LoraUpdater, ModelUpdater, OffPolicyCorrection,
                                     set_attn_implementation)

if TYPE_CHECKING:
    from drmas_graph.config import AgentConfig, TrainConfig
    from drmas_graph.policy import Policy
    from drmas_graph.train.loop._state import ModelSlot, RunState

__all__ = ["AsyncTimeoutError", "Collect", "FreeRunning", "Learn", "OneStepOff", "Publish", "drop_stale", "pipeline",
           "trainer_copies"]

log = logging.getLogger(__name__)

_COPY_HEADROOM = 1.1
"""A copy of a model's weights is made only if the device has this many times its size free."""


class AsyncTimeoutError(DrmasError, TimeoutError):
    """A wait of asynchronous training (a step's rollouts, the other processes at a step boundary) ran past
    `async.timeout_s`; the message names the step."""


# --- the trainer's copies of embedded models ----------------------------------------------------------------


def trainer_copies(cfg: TrainConfig, model_policies: Mapping[str, Policy], agent_policies: Mapping[str, Policy],
                   agent_cfgs: Mapping[str, AgentConfig], train_models: dict[str, Any]
                   ) -> tuple[dict[str, Any], str | None]:
    """A copy of every trained embedded model for the trainer to train (put in `train_models`; its policy keeps
    decoding with the original); or ({}, why) when a copy does not fit in its device's free memory.

    The policy's module first gets the configured attention kernel (`update.attn_implementation`: embedded policies
    generate with it too), so that the copy and the module that samples (and recomputes the behaviour logprobs of
    the one-step-off schedule) compute alike."""
    names = [n for n, p in model_policies.items()
             if _trained(cfg, n, p, agent_policies, agent_cfgs, train_models) and not _build.is_served(p)]
    for name in names:
        set_attn_implementation(train_models[name], _build.model_update(cfg, name).attn_implementation)
    shared = {name: _frozen_base(train_models[name], _build.model_update(cfg, name).zero()) for name in names}
    for name in names:
        module = train_models[name]
        need = sum(t.numel() * t.element_size() for _, t in [*module.named_parameters(), *module.named_buffers()]
                   if id(t) not in shared[name])
        free, device = _free_bytes(module), next(module.parameters()).device
        if free is not None and need * _COPY_HEADROOM > free:
            reason = (f"model {name!r}: asynchronous training needs a second copy of its weights ({need / 2**20:.0f} "
                      f"MB) and {device} has {free / 2**20:.0f} MB free; training synchronously")
            log.warning(reason)
            return {}, reason
    copies = {name: copy.deepcopy(train_models[name], shared[name]) for name in names}
    train_models.update(copies)
    return copies, None


def _frozen_base(module: Any, zero_stage: int) -> dict[int, torch.Tensor]:
    """A LoRA model's base tensors (every parameter and buffer outside its adapters), as a `copy.deepcopy`
    memo: the trainer's copy shares them with the policy's module (nobody trains them) and copies only the
    adapters. Empty for other models, and under ZeRO-3 (which partitions every parameter of the trained module)."""
    from drmas_graph.engine import is_peft_model

    if not is_peft_model(module) or zero_stage == 3:
        return {}
    adapters = set(module.peft_config)
    return {id(t): t for name, t in [*module.named_parameters(), *module.named_buffers()]
            if not adapters & set(name.split("."))}


def _trained(cfg: TrainConfig, name: str, policy: Policy, agent_policies: Mapping[str, Policy],
             agent_cfgs: Mapping[str, AgentConfig], train_models: Mapping[str, Any]) -> bool:
    """Whether model `name` gets an updater (`_build.build_updaters`): trainable, with an agent that is not frozen."""
    mc = cfg.models.get(name)
    return ((mc is None or mc.trainable) and name in train_models
            and any(p is policy and not agent_cfgs[a].frozen for a, p in agent_policies.items()))


def _free_bytes(module: torch.nn.Module) -> int | None:
    """Free memory of the module's device (CUDA: the driver's; CPU: MemAvailable); None if unknown."""
    device = next(module.parameters()).device
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


# --- how the weights reach the rollouts ---------------------------------------------------------------------


class _Embedded:
    """An embedded policy that decodes with its own module while the trainer trains a copy."""

    def __init__(self, model: ModelSlot) -> None:
        self.policy, self.updater = model.policy, model.updater
        self.source = model.trained
        serving = self.policy.model.state_dict()
        self.keys = [k for k, t in self.source.state_dict().items() if t.data_ptr() != serving[k].data_ptr()]
        """The tensors install copies: all of them, or a LoRA model's adapters (the base is shared)."""

    def install(self, version: int) -> None:
        """The trainer's weights into the policy's module (rows decoding finish first); version = `version`."""
        with self.updater.full_weights(), self.policy.updating_weights():
            source = self.source.state_dict()
            weights = {k: source[k] for k in self.keys}
            self.policy.run_on_worker(functools.partial(self.policy.model.load_state_dict, weights,
                                                        strict=len(weights) == len(source)))
        self.policy.version = version

    def behaviour_logprobs(self, samples: list[Any]) -> list[tuple[float, ...]]:
        """The samples' logprobs under the policy's weights (those that sampled them), on its decoding thread."""
        logprobs = self.policy.run_on_worker(functools.partial(self.updater.compute_logprobs, samples,
                                                               module=self.policy.model))
        return [tuple(float(x) for x in t.tolist()) for t in logprobs]

    def save(self, directory: Path) -> None:
        from safetensors.torch import save_model

        directory.mkdir(parents=True, exist_ok=True)
        save_model(self.policy.model, str(directory / "model.safetensors"))

    def restore(self, directory: Path, version: int) -> None:
        from safetensors.torch import load_model

        with self.policy.updating_weights():
            self.policy.run_on_worker(functools.partial(load_model, self.policy.model,
                                                        str(directory / "model.safetensors")))
        self.policy.version = version


class _Served:
    """A served policy: the trainer trains a local copy and pushes it to the servers."""

    def __init__(self, run_dir: Path, model: ModelSlot, timeout_s: float) -> None:
        self.run_dir, self.name, self.timeout_s = run_dir, model.name, timeout_s
        self.policy, self.model, self.updater = model.policy, model.trained, model.updater

    def install(self, version: int) -> None:
        _checkpoints.push_weights(self.run_dir, self.name, self.model, self.policy, self.updater, version=version,
                                  timeout_s=self.timeout_s)

    def behaviour_logprobs(self, samples: list[Any]) -> list[tuple[float, ...]]:
        """The servers' logprobs, as recorded (the weights that sampled them are on the servers only)."""
        return [s.old_logprobs for s in samples]

    def save(self, directory: Path) -> None:
        shutil.copytree(_checkpoints.sync_dir(self.run_dir, self.name), directory)

    def restore(self, directory: Path, version: int) -> None:
        _checkpoints.load_into_servers(self.run_dir, self.name, self.policy, directory, version=version,
                                       timeout_s=self.timeout_s)


def _model_updaters(name: str, updater: Any) -> list[ModelUpdater]:
    """The `ModelUpdater`s that train model `name`: itself, or a `LoraUpdater`'s one per adapter."""
    if isinstance(updater, ModelUpdater):
        return [updater]
    if isinstance(updater, LoraUpdater):
        return list(updater.updaters.values())
    raise ConfigError(f"model {name!r}: asynchronous training supports ModelUpdater and LoraUpdater, not "
                      f"{type(updater).__name__}; set async.max_staleness to 0")


# --- stale groups -------------------------------------------------------------------------------------------


def drop_stale(batch: StepBatch, update: int, max_staleness: int) -> tuple[StepBatch, int, int]:
    """The batch without the groups that have a trained sample sampled more than `max_staleness` versions before
    update `update` (staleness = update - the turn's policy_version), the groups dropped and their samples."""
    version = _sample_versions(batch)
    group = {ep.id: g.id for g in batch.groups for ep in g.episodes}
    stale = {group[s.episode_id] for s in batch.samples if update - version[(s.episode_id, s.turn_index)] > max_staleness}
    if not stale:
        return batch, 0, 0
    groups = [g for g in batch.groups if g.id not in stale]
    kept_ids = {ep.id for g in groups for ep in g.episodes}
    samples = [s for s in batch.samples if s.episode_id in kept_ids]
    return dataclasses.replace(batch, groups=groups, samples=samples), len(stale), len(batch.samples) - len(samples)


def _sample_versions(batch: StepBatch) -> dict[tuple[str, int], int]:
    """(episode id, turn index) -> the weights version that sampled the turn."""
    return {(ep.id, t.index): int(t.policy_version or 0) for g in batch.groups for ep in g.episodes for t in ep.turns}


# --- the loop -----------------------------------------------------------------------------------------------


Collect = Callable[[int], StepBatch]
"""Step `step`'s rollouts, scored, with advantages and samples (`trainer.collect` over the run)."""
Learn = Callable[[StepBatch], dict[str, Any]]
"""The update on a batch, its scores stored; the step's metrics record (`trainer.learn`, pipelined)."""
Publish = Callable[[int, Sequence[Group]], None]
"""Merge every process's traces, write the step's trained groups, export step `step` (`trainer.publish`)."""


class OneStepOff:
    """The pipelined loop (module docstring): `steps` yields what `Trainer.steps` does, driving a step's three
    functions (`collect`, `learn`, `publish`: the synchronous loop's, `trainer`)."""

    def __init__(self, run: RunState, *, collect: Collect, learn: Learn, publish: Publish) -> None:
        acfg = run.cfg.async_
        self.run = run
        self.collect, self.learn, self.publish = collect, learn, publish
        """The step's functions; `collect` runs on the rollout threads, the others on the trainer's."""
        self.timeout_s = acfg.timeout_s
        self.max_staleness = acfg.max_staleness
        for model in run.trained_models():
            for one in _model_updaters(model.name, model.updater):
                one.correction = OffPolicyCorrection(acfg.correction, acfg.is_cap)
        self.servings: dict[str, _Embedded | _Served] = {
            m.name: _Embedded(m) if m.copy is not None else _Served(run.run_dir, m, acfg.timeout_s)
            for m in run.trained_models()}
        self.trained_version = 0
        """Updates the trainer applied."""
        self.serving_version = 0
        """The weights version the rollouts sample with."""
        self._servers_hold_sync = False
        """Whether run_dir/sync holds what the servers serve (pushed at the first boundary, or restored)."""
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._threads: dict[int, threading.Thread] = {}
        """Each started step's rollout thread, until `stop` joined it (or its result was taken)."""
        self._unpublished: StepBatch | None = None
        """The last trained step, until the next boundary merges every process's traces and exports it."""

    # ---- the steps --------------------------------------------------------------------------------------
    def steps(self, start: int) -> Iterator[tuple[int, dict[str, Any]]]:
        steps = self.run.cfg.steps
        for u in range(start, steps):
            t0 = time.perf_counter()
            batch = self._result(u)
            wait_s = time.perf_counter() - t0
            install_s = self._boundary(u)
            if u + 1 < steps:
                self._start(u + 1)
            record = self._learn(u, batch)
            record.update({"async/wait_s": wait_s, "async/install_s": install_s, "time/score_s": batch.times.laps["score"],
                           "time/step_s": time.perf_counter() - t0})
            yield u, record
        self._publish()

    def settle(self) -> None:
        """The rollouts in flight finish, then the trainer's weights reach the rollouts (before an evaluation)."""
        for step in sorted(self._pending):
            self._result(step, keep=True)
        self._install(self.trained_version)

    def _start(self, step: int) -> None:
        """Step `step`'s rollouts, scoring and behaviour logprobs, on a daemon thread (`_produce`)."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def work() -> None:
            try:
                future.set_result(self._produce(step))
            except BaseException as exc:  # noqa: BLE001 - the trainer re-raises it
                future.set_exception(exc)
            finally:  # (failed before its rollouts started: it no longer holds later steps' episodes)
                slots.close(key)

        # its place among the steps rolling out: its episodes get their slots before later steps'
        slots, key = self.run.episode_slots, slots_key("train", step)
        slots.announce(key)
        self._pending[step] = future
        thread = self._threads[step] = threading.Thread(target=work, name=f"rollouts-step-{step}", daemon=True)
        thread.start()

    def stop(self) -> None:
        """The run stops (it ended, failed or was killed): the steps still rolling out are cancelled and their
        threads joined, so that nothing writes to the trace store once the run closes it. A thread that does not
        end within `async.timeout_s` raises `AsyncTimeoutError` (the caller must then leave the store open)."""
        for step in self._threads:
            self.run.episode_slots.cancel(slots_key("train", step))
        deadline = time.monotonic() + self.timeout_s
        for step, thread in sorted(self._threads.items()):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise AsyncTimeoutError(
                    f"step {step}: its rollouts, cancelled because the run stopped, did not end within "
                    f"async.timeout_s={self.timeout_s:g} s (scoring or a judge that does not return?)")
        self._threads.clear()
        self._pending.clear()

    def _result(self, step: int, keep: bool = False) -> StepBatch:
        """Step `step`'s batch (started now if it is not in flight: the first step, a resumed run)."""
        if step not in self._pending:
            self._start(step)
        future = self._pending[step] if keep else self._pending.pop(step)
        try:
            batch = future.result(timeout=self.timeout_s)
            if not keep:
                self._threads.pop(step).join()  # it ends right after setting the result
            return batch
        except concurrent.futures.TimeoutError:
            raise AsyncTimeoutError(
                f"step {step}: its rollouts did not finish within async.timeout_s={self.timeout_s:g} s (an episode "
                "stuck past rollout.timeout_s, or a server that stopped answering); stopping") from None

    def _produce(self, step: int) -> StepBatch:
        """`collect(step)`, with the behaviour logprobs of the stale samples (sampled before v(step)), those
        with advantage 0 too: the update replaces their old logprobs by the proximal ones, and `kl_start` reads the
        sampling policy's from `behaviour_logprobs`."""
        batch = self.collect(step)
        version = _sample_versions(batch)
        for name, serving in self.servings.items():
            agents = self.run.models[name].agents
            rows = [i for i, s in enumerate(batch.samples) if s.agent in agents
                    and version[(s.episode_id, s.turn_index)] < step]
            if not rows:
                continue
            behaviour = self._behaviour(serving, [batch.samples[i] for i in rows])
            for i, logprobs in zip(rows, behaviour):
                batch.samples[i] = dataclasses.replace(batch.samples[i], behaviour_logprobs=logprobs)
        return batch

    def _behaviour(self, serving: _Embedded | _Served, samples: list[Any]) -> list[tuple[float, ...]]:
        """The stale samples' behaviour logprobs: those of the weights that sampled them (the step's version)."""
        return serving.behaviour_logprobs(samples)

    def _boundary(self, u: int) -> float:
        """Between update u-1 and update u: every process is here, step u-1's traces are merged and exported, the
        trainer's weights v(u) reach the rollouts. Returns the seconds spent installing them."""
        self._meet(u)
        return self._install(u)

    def _meet(self, u: int) -> None:
        """Before update u: every process is here; step u-1's traces are merged and exported."""
        try:
            distributed.barrier(timeout_s=self.timeout_s)
        except RuntimeError as exc:
            raise AsyncTimeoutError(f"step {u}: not every process reached the step boundary within async.timeout_s="
                                    f"{self.timeout_s:g} s (its rollouts or its update hang): {exc}") from exc
        self._publish()

    def _publish(self) -> None:
        if self._unpublished is not None:
            self.publish(self._unpublished.step, self._unpublished.trained)
            self._unpublished = None

    def _install(self, version: int) -> float:
        if self.serving_version >= version and (self._servers_hold_sync or not self._any_served()):
            return 0.0
        t0 = time.perf_counter()
        for name, serving in self.servings.items():
            try:
                serving.install(version)
            except PolicyError as exc:
                raise type(exc)(f"installing weights version {version} of model {name!r}: {exc}") from exc
        self.serving_version, self._servers_hold_sync = version, True
        return time.perf_counter() - t0

    def _any_served(self) -> bool:
        return any(isinstance(s, _Served) for s in self.servings.values())

    def _learn(self, u: int, batch: StepBatch) -> dict[str, Any]:
        batch, dropped_groups, dropped_samples = drop_stale(batch, u, self.max_staleness)
        record = self.learn(batch)
        self._unpublished = batch
        self.trained_version = u + 1
        record.update(self._metrics(u, batch, dropped_groups, dropped_samples))
        return record

    def _metrics(self, u: int, batch: StepBatch, dropped_groups: int, dropped_samples: int) -> dict[str, float]:
        """Staleness per agent (mean, max), dropped groups and samples, importance weights: over every process."""
        version = _sample_versions(batch)
        staleness: dict[str, list[int]] = {}
        for s in batch.samples:
            staleness.setdefault(s.agent, []).append(u - version[(s.episode_id, s.turn_index)])
        weights: dict[str, CorrectionStats] = {}
        for model in self.run.trained_models():
            for one in _model_updaters(model.name, model.updater):
                for agent, stats in one.correction.pop_stats().items():
                    weights[agent] = weights.get(agent, CorrectionStats()).merge(stats)
        parts = distributed.gather((staleness, weights, dropped_groups, dropped_samples))
        all_staleness: dict[str, list[int]] = {}
        all_weights: dict[str, CorrectionStats] = {}
        for part_staleness, part_weights, _, _ in parts:
            for agent, values in part_staleness.items():
                all_staleness.setdefault(agent, []).extend(values)
            for agent, stats in part_weights.items():
                all_weights[agent] = all_weights.get(agent, CorrectionStats()).merge(stats)
        values = [v for vs in all_staleness.values() for v in vs]
        record: dict[str, float] = {
            "async/staleness_mean": sum(values) / max(len(values), 1), "async/staleness_max": max(values, default=0),
            "async/dropped_groups": sum(p[2] for p in parts), "async/dropped_samples": sum(p[3] for p in parts)}
        for agent, vs in sorted(all_staleness.items()):
            record[f"agent/{agent}/staleness_mean"] = sum(vs) / len(vs)
            record[f"agent/{agent}/staleness_max"] = max(vs)
        for agent, stats in sorted(all_weights.items()):
            record.update(stats.metrics(agent))
        return record

    # ---- checkpoints ------------------------------------------------------------------------------------
    def save_serving(self, directory: Path) -> int:
        """Write the rollout weights into checkpoint folder `directory` (`<model>/serving`) when they are not the
        trainer's (the next step rolls out on them); return their version."""
        if self.serving_version < self.trained_version and distributed.is_main():
            for name, serving in self.servings.items():
                serving.save(directory / name / "serving")
        return self.serving_version

    def restore(self, directory: Path, trained: int, serving: int | None) -> None:
        """After the trainer loaded checkpoint `directory` (v(trained)): the rollout weights it holds (version
        `serving`), or the trainer's when it holds none (serving None: a synchronous run's checkpoint)."""
        self.trained_version = trained
        if serving is None or serving >= trained:
            self.serving_version = -1
            self._install(trained)
            return
        for name, s in self.servings.items():
            s.restore(directory / name / "serving", serving)
        self.serving_version, self._servers_hold_sync = serving, True


class FreeRunning(OneStepOff):
    """`async.schedule: free` (module docstring): step s starts as soon as the rollout weights are at most
    `max_staleness` versions behind it, and every update's weights reach the rollouts at once, while other steps'
    episodes are in flight. Metric `async/steps_in_flight`: steps rolling out during the update."""

    def __init__(self, run: RunState, *, collect: Collect, learn: Learn, publish: Publish) -> None:
        super().__init__(run, collect=collect, learn=learn, publish=publish)
        self._next = 0
        """The first step not started yet."""

    def steps(self, start: int) -> Iterator[tuple[int, dict[str, Any]]]:
        steps = self.run.cfg.steps
        self._next = start
        self._launch()
        for u in range(start, steps):
            t0 = time.perf_counter()
            batch = self._result(u)
            wait_s = time.perf_counter() - t0
            self._meet(u)
            in_flight = len(self._pending)
            record = self._learn(u, batch)
            install_s = self._install(u + 1)  # the last one too: a checkpoint then holds one version
            self._launch()
            record.update({"async/wait_s": wait_s, "async/install_s": install_s, "time/score_s": batch.times.laps["score"],
                           "async/steps_in_flight": float(in_flight),
                           "time/step_s": time.perf_counter() - t0})
            yield u, record
        self._publish()

    def _launch(self) -> None:
        """Start every step whose groups may sample with the rollout weights: s <= serving_version + max_staleness."""
        last = min(self.run.cfg.steps, self.serving_version + self.max_staleness + 1)
        while self._next < last:
            if self._next not in self._pending:
                self._start(self._next)
            self._next += 1

    def _behaviour(self, serving: _Embedded | _Served, samples: list[Any]) -> list[tuple[float, ...]]:
        """The logprobs the rollout recorded: the weights that sampled a turn may have been replaced since."""
        return [s.old_logprobs for s in samples]


def pipeline(run: RunState, *, collect: Collect, learn: Learn, publish: Publish) -> OneStepOff:
    """The loop of `async.schedule`: `OneStepOff` (one_step_off) or `FreeRunning` (free), driving a step's
    functions."""
    cls = FreeRunning if run.cfg.async_.schedule == "free" else OneStepOff
    return cls(run, collect=collect, learn=learn, publish=publish)
