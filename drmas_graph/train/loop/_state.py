"""What a run is made of, built once from its config: `RunState` (frozen), and `RunNotes`, its mutable bookkeeping.

`_setup.build_run` turns a `TrainConfig` (and the graph, env and any policies given in Python) into a `RunState`: one
`ModelSlot` per model (its policy, agents, trained module, the trainer's copy, updater), the policies by agent, the
agents' configs, the trace store, the instrumented app, the run folder, the rollout config and the invalid-turn
penalty (the rewards of unfinished episodes are the config's, `cfg.rollout`). The loop (`trainer`), evaluation, the preflight check, checkpoints and the asynchronous pipeline take
this object, or only the fields they need; nothing reads the trainer's attributes.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from drmas_graph.config import AgentConfig, TrainConfig
from drmas_graph.instrumentation.instrumented import InstrumentedGraph
from drmas_graph.policy import Policy
from drmas_graph.traces.store import TraceStore
from drmas_graph.train.loop import _scoring
from drmas_graph.train.loop._rollouts import EpisodeSlots
from drmas_graph.train.optim import Updater

__all__ = ["ModelSlot", "RunState", "RunNotes", "HasRunState", "run_state", "on_model_thread", "close", "abandon"]


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
class ModelSlot:
    """One model of the run: the policy that serves its agents and what trains it."""

    name: str
    """The model's name (`models.<name>`, or the name of a policy given in Python); keys metrics and checkpoints."""
    policy: Policy
    """The policy that serves its agents' calls (agents sharing a model share the object)."""
    agents: tuple[str, ...]
    """The agents it serves, in the run's agent order."""
    trained: Any = None
    """The module its updater trains (the embedded policy's own, a served model's local copy, or `copy`); None
    for a served model without a local copy."""
    copy: Any = None
    """The trainer's own copy of an embedded model (asynchronous training: the policy decodes with its module
    meanwhile); None otherwise."""
    updater: Updater | None = None
    """Its updater; None when it is not trained (frozen, not trainable, evaluation and checks)."""


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
    models: dict[str, ModelSlot]
    """Model name -> its record: policy, agents, trained module, the trainer's copy, updater."""
    agent_policies: dict[str, Policy]
    """Agent -> the policy that serves its calls (what the instrumented app routes by)."""
    agent_cfgs: dict[str, AgentConfig]
    """Agent -> its config (`agents.<a>`, else one naming its model)."""
    store: TraceStore
    """This process's trace store (rank r > 0: traces.rank<r>.db)."""
    app: InstrumentedGraph
    """The app's graph, instrumented: it rolls out episodes and records every model call."""
    train_tasks: list[Any]
    """`env.tasks('train')`, checked (not empty, unique ids)."""
    invalid_penalty: float
    """Subtracted from an invalid turn's reward (`invalid_penalty`, else the env's attribute, else 0)."""
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
    warm_start: Any = None
    """What the warm start before the RL did (`warm_start.WarmStartResult`), run now or read from its checkpoint;
    None without `warm_start` in the config."""

    def trained_models(self) -> list[ModelSlot]:
        """The models with an updater, in the run's model order."""
        return [m for m in self.models.values() if m.updater is not None]

    def trained_agents(self) -> list[str]:
        """Agents whose model has an updater and who are not frozen."""
        trained = {a for m in self.trained_models() for a in m.agents}
        return [a for a in self.agent_policies if a in trained and not self.agent_cfgs[a].frozen]

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


class HasRunState(Protocol):
    """An object holding a run (a `Trainer`)."""

    state: RunState


def run_state(run: RunState | HasRunState) -> RunState:
    """The `RunState` of `run` (itself, or a trainer's)."""
    return run if isinstance(run, RunState) else run.state


def on_model_thread(model: ModelSlot, fn: Callable[[], Any]) -> Any:
    """Run `fn()` (compute on `model`) on its embedded policy's generation thread, else here.

    On CPU, torch compute from a second OS thread slows the embedded engine's decoding for the rest of
    the process (see `transformers_policy`): the update, the logprob passes and checkpoints of an
    embedded model run on the thread that decodes with it. A model the trainer trains a copy of
    (asynchronous training, `ModelSlot.copy`) is computed here: its policy keeps decoding meanwhile.
    """
    if model.copy is not None:
        return fn()
    run = getattr(model.policy, "run_on_worker", None)
    return run(fn) if run is not None else fn()


def close(built: Sequence[Policy], store: TraceStore) -> None:
    """Close a run: its store and the policies built from `models` (a served one stops its launched server)."""
    store.close()
    for policy in built:
        policy.close()


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
