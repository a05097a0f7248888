"""What a run is made of, built once from its config: `RunState` (frozen), and `RunNotes`, its mutable bookkeeping.

`_setup.build_run` turns a `TrainConfig` (and the graph, env and any policies given in Python) into a `RunState`: the
policies by agent and by model, the agents' configs, the updaters and the modules they train, the trace store, the
instrumented app, the run folder, the rollout config, the invalid-turn penalty and the rewards of unfinished
episodes. The loop (`trainer`), evaluation, the preflight check, checkpoints and the asynchronous pipeline take
this object, or only the fields they need; nothing reads the trainer's attributes.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from drmas_graph.config import AgentConfig, TrainConfig
from drmas_graph.env import BadRewardError, Group
from drmas_graph.instrumentation.instrumented import InstrumentedGraph
from drmas_graph.policy import Policy
from drmas_graph.traces.store import TraceStore
from drmas_graph.train.engines import distributed
from drmas_graph.train.loop import _scoring
from drmas_graph.train.loop._rollouts import EpisodeJob, EpisodeSlots, RolloutBatch, group_ids, run_episodes
from drmas_graph.train.optim import Updater
from drmas_graph.types import Episode

__all__ = ["RunState", "RunNotes", "HasRunState", "run_state", "on_model_thread", "abandon"]

log = logging.getLogger(__name__)


@dataclass
class RunNotes:
    """What a run remembers from one step (or evaluation) to the next; the only mutable part of a run."""

    logged_failures: set[str] = field(default_factory=set)
    """The metrics (`bad_reward_episodes`, `judge_failed_episodes`) whose first training exception was logged."""
    threshold_warned: bool = False
    """Whether an evaluation warned that success_threshold is above every team reward (once per run)."""
    zero_signal: _scoring.ZeroSignalWatch = field(default_factory=_scoring.ZeroSignalWatch)
    """Warns when most advantage pools had zero variance for several steps in a row."""


@dataclass(frozen=True)
class RunState:
    """A run's pieces, built once from its config by `_setup.build_run`; the fields never change (the objects they hold
    do: policies get new weights, the store new episodes)."""

    cfg: TrainConfig
    """The run's config, overrides applied."""
    env: Any
    """The environment: tasks(split), reward(task, episode) or reward_group, optional turn_is_valid."""
    run_dir: Path
    """The run folder (traces.db, metrics.jsonl, checkpoints/, sync/)."""
    rollout_config: dict[str, Any]
    """The LangGraph RunnableConfig merged into every episode's config."""
    agent_policies: dict[str, Policy]
    """Agent -> the policy that serves its calls."""
    model_policies: dict[str, Policy]
    """Model name -> its policy (agents sharing a model share the object)."""
    agent_cfgs: dict[str, AgentConfig]
    """Agent -> its config (`agents.<a>`, else one naming its model)."""
    train_models: dict[str, Any]
    """Model name -> the module its updater trains (the embedded policy's own, a served model's local copy, or
    the trainer's copy of an embedded model in asynchronous training)."""
    copies: dict[str, Any]
    """Model name -> the trainer's own copy of an embedded model (asynchronous training); else empty."""
    updaters: dict[str, Updater]
    """Model name -> its updater, for every trained model (empty for evaluation and checks)."""
    store: TraceStore
    """This process's trace store (rank r > 0: traces.rank<r>.db)."""
    app: InstrumentedGraph
    """The app's graph, instrumented: it rolls out episodes and records every model call."""
    train_tasks: list[Any]
    """`env.tasks('train')`, checked (not empty, unique ids)."""
    invalid_penalty: float
    """Subtracted from an invalid turn's reward (`invalid_penalty`, else the env's attribute, else 0)."""
    truncated_reward: float | None
    """Team reward of a truncated episode (`rollout.truncated_reward`; None: the environment scores it)."""
    model_error_reward: float | None
    """Team reward of a model-error episode (`rollout.model_error_reward`; None: the environment scores it)."""
    episode_slots: EpisodeSlots
    """`max_concurrency`: episodes in flight in this process, over every step rolling out."""
    built: list[Policy]
    """The policies built from `models` (closed with the run; a served one stops its launched server)."""
    async_fallback: str | None
    """Why a run configured as asynchronous trains synchronously (a second copy of a model did not fit)."""
    new_store: bool
    """Whether this run created its trace store (a run that never starts removes it again: `abandon`)."""
    notes: RunNotes
    """The run's mutable bookkeeping."""

    @property
    def unfinished_rewards(self) -> dict[str, float | None]:
        """`score_episode` keywords: the rewards of truncated and model-error episodes."""
        return {"truncated_reward": self.truncated_reward, "model_error_reward": self.model_error_reward}

    def model_of(self, agent: str) -> str:
        """The name of the model that serves `agent`."""
        policy = self.agent_policies[agent]
        return next(name for name, p in self.model_policies.items() if p is policy)

    def trained_agents(self) -> list[str]:
        """Agents whose model has an updater and who are not frozen."""
        return [a for a in self.agent_policies if self.model_of(a) in self.updaters and not self.agent_cfgs[a].frozen]

    def on_model_thread(self, name: str, fn: Callable[[], Any]) -> Any:
        """`on_model_thread(self.model_policies, self.copies, name, fn)`."""
        return on_model_thread(self.model_policies, self.copies, name, fn)

    def task_order(self, start: int, n: int) -> list[Any]:
        """The training tasks at positions start ... start + n - 1 of an endless sequence of seeded shuffles of
        the split."""
        n_tasks, out = len(self.train_tasks), []
        for p in range(start, start + n):
            epoch, i = divmod(p, n_tasks)
            order = list(range(n_tasks))
            random.Random(f"{self.cfg.seed}:{epoch}").shuffle(order)
            out.append(self.train_tasks[order[i]])
        return out

    def roll_out(self, tasks: Sequence[Any], step: int, group_size: int, *, phase: str,
                 progress: Callable[[int, int], None] | None = None) -> RolloutBatch:
        """G rollouts per task of this process's share, concurrently (`_rollouts.run_episodes`); the first error
        is logged. `progress(done, total)` hears each episode that ends."""
        ids = group_ids(tasks, phase, step)  # over the whole batch: every rank names the groups alike
        jobs = [EpisodeJob(task, ids[b], b, j) for b, task in distributed.owned(tasks) for j in range(group_size)]
        batch = run_episodes(self.app, jobs, phase=phase, step=step, run_seed=self.cfg.seed,
                             max_concurrency=self.episode_slots, rollout=self.cfg.rollout,
                             base_config=self.rollout_config, env=self.env,
                             on_done=None if progress is None else lambda done: progress(done, len(jobs)))
        if batch.errors:
            log.warning("%s step %d: %d of %d episodes failed; the first: %s", phase, step, len(batch.errors),
                        len(jobs), batch.errors[0])
        return batch

    def score(self, runs: list[tuple[Any, Episode]], counts: dict[str, int]
              ) -> tuple[list[Group], list[_scoring.Unscored]]:
        """`_scoring.score_runs` with this run's env, penalty and rollout settings, the first failures logged."""
        return _scoring.score_runs(self.env, runs, counts, invalid_penalty=self.invalid_penalty,
                                   rollout=self.cfg.rollout, on_error=self._log_reward_failure)

    def _log_reward_failure(self, exc: BadRewardError) -> None:
        """The first env.reward / reward_group / turn_is_valid exception of the run, with its traceback, and the
        first judge failure (later ones are counted)."""
        metric = _scoring.failure_metric(exc)
        if exc.__cause__ is not None and metric not in self.notes.logged_failures:
            self.notes.logged_failures.add(metric)
            kind = "a judge-failed" if metric == "judge_failed_episodes" else "a bad-reward"
            log.warning("%s; the episode counts as %s episode (metric %s), it is not trained on; later ones are "
                        "counted, not logged", exc, kind, metric, exc_info=exc.__cause__)

    def close(self) -> None:
        """Close the store and the policies built from `models`."""
        self.store.close()
        for policy in self.built:
            policy.close()

    def abandon(self) -> None:
        """Undo a run that never starts (`abandon`)."""
        abandon(self.built, self.store, distributed.store_path(self.run_dir) if self.new_store else None)


class HasRunState(Protocol):
    """An object holding a run (a `Trainer`)."""

    state: RunState


def run_state(run: RunState | HasRunState) -> RunState:
    """The `RunState` of `run` (itself, or a trainer's)."""
    return run if isinstance(run, RunState) else run.state


def on_model_thread(model_policies: Mapping[str, Policy], copies: Mapping[str, Any], name: str,
                    fn: Callable[[], Any]) -> Any:
    """Run `fn()` (compute on model `name`) on its embedded policy's generation thread, else here.

    On CPU, torch compute from a second OS thread slows the embedded engine's decoding for the rest of
    the process (see `transformers_policy`): the update, the logprob passes and checkpoints of an
    embedded model run on the thread that decodes with it. A model the trainer trains a copy of
    (asynchronous training, `copies`) is computed here: its policy keeps decoding meanwhile.
    """
    if name in copies:
        return fn()
    run = getattr(model_policies[name], "run_on_worker", None)
    return run(fn) if run is not None else fn()


def abandon(built: Sequence[Policy], store: TraceStore | None, new_store: Path | None) -> None:
    """Undo a run that never starts: close the policies built (e.g. servers launched for it) and the store, and
    remove `new_store` (a store this run created: no episode yet, the folder stays free for the corrected run)."""
    for policy in built:
        policy.close()
    if store is not None:
        store.close()
        if new_store is not None:
            for path in (new_store, *(new_store.with_name(new_store.name + s) for s in ("-wal", "-shm"))):
                path.unlink(missing_ok=True)
