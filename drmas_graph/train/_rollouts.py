"""One step's episodes: G rollouts per task, concurrently, each with its own config, seed and limits.

Every episode gets
- its own RunnableConfig: the user's `rollout_config` and the config's `rollout.configurable`, a fresh
  `configurable.thread_id` (a graph compiled with a checkpointer needs one; sharing one would make
  concurrent episodes write to the same thread) and `rollout.recursion_limit`;
- a seed derived from (run seed, phase, step, group, index in the group) (`_seeds`), so its sampling
  does not depend on which episode reaches a policy first;
- the limits `rollout.max_llm_calls` and `rollout.timeout_s` (`_limits`), plus a wall-clock backstop
  for an episode stuck between LLM calls.
- the environment's optional `resume` / `next_input` hooks (`_segments`): interrupts answered and
  conversations continued on the episode's thread, at most `rollout.max_resumes` runs after the first.
Failed episodes are counted by kind and their errors kept (in job order), never returned as runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from drmas_graph.instrumentation._limits import EpisodeLimitError, limit_metadata
from drmas_graph.instrumentation._seeds import episode_seed
from drmas_graph.instrumentation._segments import EpisodeInterruptedError, continuation_from_env
from drmas_graph.config import RolloutConfig
from drmas_graph.errors import ConfigError, NoLLMCallError, RolloutError
from drmas_graph.types import Episode, new_id

__all__ = ["EpisodeJob", "RolloutBatch", "episode_config", "run_episodes"]

BACKSTOP_GRACE_S = 1.0
"""An episode past rollout.timeout_s is stopped at its next LLM call; one that starts none within this many
seconds more (stuck in a tool, or in a long generation) is cancelled."""


@dataclass(frozen=True)
class EpisodeJob:
    """One episode to run."""

    task: Any
    """The task (`.id`, `.input`)."""
    group_id: str
    """The GRPO group it belongs to."""
    group: int
    """Position of its group in the step's task batch."""
    index: int
    """Its index within the group (0..G-1)."""


@dataclass
class RolloutBatch:
    """What running a list of jobs produced."""

    runs: list[tuple[Any, Episode]] = field(default_factory=list)
    """(task, episode) of every episode that finished without error, in job order."""
    counts: dict[str, int] = field(default_factory=lambda: {"failed_episodes": 0, "no_llm_call_episodes": 0,
                                                            "interrupted_episodes": 0})
    """Failed episodes by kind; `interrupted_episodes` (left paused at an interrupt) are also `failed_episodes`."""
    errors: list[RolloutError] = field(default_factory=list)
    """The error of every failed episode, in job order."""


def episode_config(base: Mapping[str, Any] | None, rollout: RolloutConfig) -> dict[str, Any]:
    """The RunnableConfig of one episode: `base` (the user's rollout_config) over `rollout.configurable`, a
    fresh thread_id and `rollout.recursion_limit` (unless `base` sets one)."""
    config = dict(base or {})
    configurable = {**rollout.configurable, **(config.get("configurable") or {})}
    if "thread_id" in configurable:
        raise ConfigError("rollout_config: configurable.thread_id would be shared by every episode; the trainer "
                          "gives each episode its own thread_id, remove it")
    configurable["thread_id"] = f"drmas-{new_id()}"
    config["configurable"] = configurable
    if rollout.recursion_limit is not None:
        config.setdefault("recursion_limit", rollout.recursion_limit)
    return config


def rollout_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The event loop's default executor during rollouts: sync graph code (nodes, a sync `@entrypoint`, sync
    `@task`s) runs there. It starts a thread whenever every thread is busy and has no upper bound, because a
    thread may block on work queued behind it: a sync entrypoint waits in `task(...).result()` for a task that
    needs a thread of the same pool, so any fixed size deadlocks once that many entrypoints are in flight.
    Threads are reused, so their number is the peak of sync work in flight, not the number of calls."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=sys.maxsize, thread_name_prefix="rollout")


def run_episodes(app: Any, jobs: Sequence[EpisodeJob], *, phase: str, step: int, run_seed: int,
                 max_concurrency: int, rollout: RolloutConfig, base_config: Mapping[str, Any] | None = None,
                 env: Any = None) -> RolloutBatch:
    """Run `jobs` through the instrumented graph `app`, at most `max_concurrency` at a time. The environment's
    optional `resume` / `next_input` hooks continue an episode's thread (interrupts, conversations)."""

    async def main() -> list[Episode | RolloutError]:
        asyncio.get_running_loop().set_default_executor(rollout_executor())
        gate = asyncio.Semaphore(max_concurrency)

        async def one(job: EpisodeJob) -> Episode | RolloutError:
            async with gate:
                return await _run_one(app, job, phase=phase, step=step, run_seed=run_seed, rollout=rollout,
                                      base_config=base_config, env=env)

        return await asyncio.gather(*(one(job) for job in jobs))

    batch = RolloutBatch()
    for job, outcome in zip(jobs, asyncio.run(main())):
        if isinstance(outcome, Episode):
            batch.runs.append((job.task, outcome))
            continue
        kind = "no_llm_call_episodes" if isinstance(outcome, NoLLMCallError) else "failed_episodes"
        batch.counts[kind] += 1
        batch.counts["interrupted_episodes"] += isinstance(outcome, EpisodeInterruptedError)
        batch.errors.append(outcome)
    return batch


async def _run_one(app: Any, job: EpisodeJob, *, phase: str, step: int, run_seed: int, rollout: RolloutConfig,
                   base_config: Mapping[str, Any] | None, env: Any = None) -> Episode | RolloutError:
    metadata = {"phase": phase, "step": step, "seed": episode_seed(run_seed, phase, step, job.group, job.index),
                **limit_metadata(rollout.max_llm_calls, rollout.timeout_s)}
    cont = continuation_from_env(env, job.task, rollout.max_resumes)
    run = app.arollout(job.task.input, episode_config(base_config, rollout), task_id=job.task.id,
                       group_id=job.group_id, metadata=metadata, resume=cont.resume, next_input=cont.next_input,
                       max_resumes=cont.max_resumes)
    try:
        episode = await (run if rollout.timeout_s is None else asyncio.wait_for(run, rollout.timeout_s + BACKSTOP_GRACE_S))
    except RolloutError as exc:
        return exc
    except TimeoutError:  # stuck between LLM calls (a hung tool, a slow server): the backstop
        return EpisodeLimitError(f"an episode of task {job.task.id!r} ({job.group_id}) ran past "
                                 f"rollout.timeout_s={rollout.timeout_s:g} (+{BACKSTOP_GRACE_S:g} s) without starting "
                                 "another LLM call and was cancelled (it is not in the trace store)")
    if episode.error:  # the app swallowed an exception that must fail the episode (e.g. EpisodeLimitError)
        return RolloutError(f"episode {episode.id} (task {episode.task_id}) failed after {len(episode.turns)} LLM "
                            f"call(s): {episode.error}", episode)
    return episode
