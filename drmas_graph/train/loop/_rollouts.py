"""One step's episodes: G rollouts per task, concurrently, each with its own config, seed and limits.

A group (the G rollouts of one task) is identified by its position b in the step's task batch: the seeds of
its episodes are derived from b (`_seeds`), processes own contiguous blocks of positions (`distributed.owned`),
and its id (`group_ids`: pooling in advantages, traces) is unique per position, also when a step holds a task
twice (a step that straddles the end of a small split).

Every episode gets
- its own RunnableConfig: the user's `rollout_config` and the config's `rollout.configurable`, a fresh
  `configurable.thread_id` (a graph compiled with a checkpointer needs one; sharing one would make
  concurrent episodes write to the same thread) and `rollout.recursion_limit`;
- a seed derived from (run seed, phase, step, group position, index in the group), so its sampling does not
  depend on which episode reaches a policy first;
- the limits `rollout.max_llm_calls` and `rollout.timeout_s` (`_limits`), plus a backstop for an episode
  that starts no LLM call past timeout_s + `BACKSTOP_GRACE_S`: its task is cancelled (`_limits.Backstop`);
  cancelled inside an LLM call (a generation that straddles the time cap) it is truncated by timeout_s,
  between calls (stuck in a tool) it fails (`StuckEpisodeError`); either way its run is stored with its
  turns so far and the reason;
- the environment's optional `resume` / `next_input` hooks (`_segments`): interrupts answered and
  conversations continued on the episode's thread, at most `rollout.max_resumes` runs after the first.

Sync graph code (nodes, a sync `@entrypoint`, sync `@task`s) runs on daemon threads that are never joined
(`_NodeThreads`), with no upper bound on their number: a node stuck in a tool that never returns costs its
episode, not the step or the process (such a thread is left behind with a warning), and a sync entrypoint
waiting in `task(...).result()` for a task that needs another thread never deadlocks the pool.

Episodes that finished, were truncated by a limit or broke on their policy's output (model errors, see
`drmas_graph.instrumentation._outcomes`) are returned as runs; the others are counted by kind and their
errors kept (in job order).

`max_concurrency` bounds the episodes in flight in this process: steps that roll out at once (the free-running
schedule, `_pipeline.FreeRunning`) share one `EpisodeSlots`, which gives every episode of an earlier step its slot
before a later step's episodes get any.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import queue
import sys
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from drmas_graph.config import RolloutConfig
from drmas_graph.env import Group
from drmas_graph.errors import ConfigError, NoLLMCallError, RolloutError
from drmas_graph.instrumentation import (
    LIMITS,
    Backstop,
    EpisodeInterruptedError,
    StuckEpisodeError,
    continuation_from_env,
    episode_seed,
    limit_metadata,
)
from drmas_graph.train.engines import distributed
from drmas_graph.train.loop._scoring import Unscored
from drmas_graph.train.loop.metrics import Stopwatch
from drmas_graph.train.optim import AdvantageStats
from drmas_graph.types import Episode, Sample, new_id

__all__ = ["EpisodeJob", "EpisodeSlots", "RolloutBatch", "StepBatch", "episode_config", "group_ids", "roll_out",
           "run_episodes", "slots_key"]

log = logging.getLogger(__name__)
T = TypeVar("T")

BACKSTOP_GRACE_S = 1.0
"""An episode past rollout.timeout_s is stopped at its next LLM call; one that starts none within this many
seconds more (stuck in a tool, or in a long generation) is cancelled."""
CANCEL_GRACE_S = 5.0
"""How long a cancelled episode (and, at the end of a step, any task left over) may take to unwind before it
is abandoned."""


@dataclass(frozen=True)
class EpisodeJob:
    """One episode to run."""

    task: Any
    """The task (`.id`, `.input`)."""
    group_id: str
    """The GRPO group it belongs to (`group_ids`)."""
    group: int
    """Position of its group in the step's task batch (seeds and sharding use it)."""
    index: int
    """Its index within the group (0..G-1)."""


@dataclass
class RolloutBatch:
    """What running a list of jobs produced."""

    runs: list[tuple[Any, Episode]] = field(default_factory=list)
    """(task, episode) of every episode kept for scoring (finished, truncated or a model error), in job order."""
    counts: dict[str, int] = field(default_factory=lambda: {
        "failed_episodes": 0, "no_llm_call_episodes": 0, "interrupted_episodes": 0, "truncated_episodes": 0,
        "model_error_episodes": 0, **{f"truncated/{limit}": 0 for limit in LIMITS}})
    """Episodes by kind: failed (of which `interrupted_episodes` were left paused at an interrupt) and without LLM
    calls (dropped), truncated (also by limit) and model errors (kept)."""
    errors: list[RolloutError] = field(default_factory=list)
    """The error of every dropped episode, in job order."""


@dataclass
class StepBatch:
    """One training step's groups on their way to the update: rollouts, scores, advantages, samples."""

    step: int
    """The training step."""
    n_episodes: int
    """Episodes the step ran on all processes (tasks_per_step x group_size)."""
    counts: dict[str, int]
    """Episodes by kind (`RolloutBatch.counts`, plus the scoring's bad-reward and masked counts)."""
    rollout_errors: list[RolloutError]
    """Errors of this process's dropped episodes, in job order."""
    groups: list[Group]
    """This process's groups, each with its episodes that got a usable reward and their scores."""
    unscored: list[Unscored]
    """This process's episodes left out for their reward (bad reward, judge failure), with the error."""
    samples: list[Sample]
    """The trained agents' `Sample`s, with advantages."""
    adv_stats: AdvantageStats | None
    """The advantage estimator's pool statistics (None: no policy-served turn)."""
    times: Stopwatch
    """The step's phases so far: `rollout`, `score` (with the advantages); `learn` adds `update`."""
    trained: list[Group] = field(default_factory=list)
    """Every process's trained groups (episodes slimmed, with scores and advantages): filled by `Trainer.learn`."""


def group_ids(tasks: Sequence[Any], phase: str, step: int) -> list[str]:
    """The group id of each position of a step's task batch: 'phase:step:task_id', and 'phase:step#k:task_id'
    for the k-th (k >= 2) occurrence of a task the batch holds more than once; each group is one GRPO pool.
    Collision-free for any task ids: the task id is all that follows the second ':', and the field before it
    is the bare step number only in a first occurrence."""
    seen: dict[str, int] = {}
    out = []
    for task in tasks:
        seen[task.id] = seen.get(task.id, 0) + 1
        occurrence = f"#{seen[task.id]}" if seen[task.id] > 1 else ""
        out.append(f"{phase}:{step}{occurrence}:{task.id}")
    return out


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


@dataclass
class _Call:
    """One `run_episodes` call's place in `EpisodeSlots`: episodes not granted a slot yet (None: announced, not
    started), and those waiting for one, in the order they asked."""

    left: int | None = None
    waiting: collections.deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = field(
        default_factory=collections.deque)


class EpisodeSlots:
    """At most `n` episodes in flight at once, over every thread and event loop that shares it (the steps of a
    free-running schedule each roll out on their own thread).

    Slots go to the calls (one `run_episodes` per step, named by a key) in the order they were announced
    (`announce`, called by the pipeline in step order before a step's thread starts) or, unannounced, opened:
    every episode of an earlier call gets its slot before any of a later call's does, so the steps after the one
    the trainer needs next never hold it up. Within a call, first come, first served. A slot handed to an
    episode that was cancelled meanwhile is passed on."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {n}")
        self.free = n
        self._lock = threading.Lock()
        self._calls: dict[Any, _Call] = {}
        """Key -> the calls with episodes still to be granted, in their order (dicts keep insertion order)."""
        self._running: dict[Any, tuple[asyncio.AbstractEventLoop, asyncio.Task]] = {}
        """Key -> the event loop and task of a call whose episodes are running (`cancel` stops them)."""
        self._cancelled: set[Any] = set()
        """Keys `cancel`led: such a call never starts its episodes."""

    def announce(self, key: Any) -> None:
        """Reserve call `key`'s place in the order (before its thread starts); it holds later calls until it ends."""
        with self._lock:
            self._calls.setdefault(key, _Call())

    def open(self, key: Any, episodes: int) -> None:
        """Call `key` starts with `episodes` episodes (at its announced place, else last)."""
        with self._lock:
            self._calls.setdefault(key, _Call()).left = episodes
            if episodes == 0:
                self._calls.pop(key)
            self._dispatch()

    def close(self, key: Any) -> None:
        """Call `key` ended (or failed before it opened): it no longer holds later calls."""
        with self._lock:
            self._calls.pop(key, None)
            self._dispatch()

    def cancel(self, key: Any) -> None:
        """Stop call `key` (its run stopped): its running episodes are cancelled (they unwind as `_run_loop` says),
        and if it has not started yet it never does (`run_episodes` raises `asyncio.CancelledError`)."""
        with self._lock:
            self._cancelled.add(key)
            running = self._running.get(key)
        if running is not None:
            loop, task = running
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its event loop is closed: the call has ended
                pass

    @contextlib.contextmanager
    def _running_as(self, key: Any, task: asyncio.Task) -> Iterator[None]:
        """Call `key`'s episodes run in `task` (on the running loop): `cancel(key)` cancels it."""
        with self._lock:
            if key in self._cancelled:
                raise asyncio.CancelledError(f"rollouts {key} were stopped before they started")
            self._running[key] = (asyncio.get_running_loop(), task)
        try:
            yield
        finally:
            with self._lock:
                self._running.pop(key, None)

    @contextlib.asynccontextmanager
    async def slot(self, key: Any) -> AsyncIterator[None]:
        """Hold a slot for one episode of (opened) call `key`."""
        await self._acquire(key)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, key: Any) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            call = self._calls[key]
            if self.free > 0 and next(iter(self._calls.values())) is call and not call.waiting:
                self._grant(key, call)
                return
            granted = loop.create_future()
            call.waiting.append((loop, granted))
        try:
            await granted
        except asyncio.CancelledError:
            with self._lock:
                queued = (loop, granted) in call.waiting
                if queued:  # it will never take its slot
                    call.waiting.remove((loop, granted))
                    self._one_less(key, call)
                    self._dispatch()
            if not queued and granted.done() and not granted.cancelled():
                self._release()  # the slot came, then the episode was cancelled: pass it on
            raise  # (a slot on its way to a cancelled waiter is passed on by `_hand_over`)

    def _release(self) -> None:
        with self._lock:
            self.free += 1
            self._dispatch()

    def _grant(self, key: Any, call: _Call) -> None:
        self.free -= 1
        self._one_less(key, call)
        self._dispatch()

    def _one_less(self, key: Any, call: _Call) -> None:
        """Under the lock: one episode of `call` took its slot or will never ask again; a call with none left
        leaves the order."""
        call.left = (call.left or 1) - 1
        if call.left == 0:
            self._calls.pop(key, None)

    def _dispatch(self) -> None:
        """Under the lock: free slots to the first call's waiting episodes. When its episodes have not asked yet
        (or it has not started), the slots wait for them."""
        while self.free > 0 and self._calls:
            key, call = next(iter(self._calls.items()))
            if not call.waiting:
                return
            loop, granted = call.waiting.popleft()
            try:
                loop.call_soon_threadsafe(self._hand_over, granted)
                self.free -= 1
            except RuntimeError:  # its event loop is closed: the episode is gone
                pass
            self._one_less(key, call)

    def _hand_over(self, granted: asyncio.Future) -> None:
        """On the waiter's event loop: the slot is its, unless it was cancelled meanwhile."""
        if granted.done():
            self._release()
        else:
            granted.set_result(None)


def slots_key(phase: str, step: int) -> tuple[str, int]:
    """The name of `run_episodes(phase=phase, step=step)`'s call in its `EpisodeSlots` (`announce` takes it)."""
    return phase, step


def roll_out(app: Any, env: Any, tasks: Sequence[Any], step: int, group_size: int, *, phase: str, seed: int,
             rollout: RolloutConfig, base_config: Mapping[str, Any] | None, slots: EpisodeSlots,
             progress: Callable[[int, int], None] | None = None) -> RolloutBatch:
    """G rollouts per task of this process's share (`distributed.owned`), concurrently (`run_episodes`, within
    `slots`); the first error is logged. `progress(done, total)` hears each episode that ends."""
    ids = group_ids(tasks, phase, step)  # over the whole batch: every rank names the groups alike
    jobs = [EpisodeJob(task, ids[b], b, j) for b, task in distributed.owned(tasks) for j in range(group_size)]
    batch = run_episodes(app, jobs, phase=phase, step=step, run_seed=seed, max_concurrency=slots, rollout=rollout,
                         base_config=base_config, env=env,
                         on_done=None if progress is None else lambda done: progress(done, len(jobs)))
    if batch.errors:
        log.warning("%s step %d: %d of %d episodes failed; the first: %s", phase, step, len(batch.errors),
                    len(jobs), batch.errors[0])
    return batch


def run_episodes(app: Any, jobs: Sequence[EpisodeJob], *, phase: str, step: int, run_seed: int,
                 max_concurrency: int | EpisodeSlots, rollout: RolloutConfig,
                 base_config: Mapping[str, Any] | None = None, env: Any = None,
                 on_done: Callable[[int], None] | None = None) -> RolloutBatch:
    """Run `jobs` through the instrumented graph `app`, at most `max_concurrency` at a time (an `EpisodeSlots`:
    shared with other calls running at once, in which this one is named (phase, step)). The environment's optional
    `resume` / `next_input` hooks continue an episode's thread (interrupts, conversations). `on_done(n)`, when
    given, hears how many jobs have ended (finished or failed) each time one ends (progress)."""
    ended = 0
    slots = max_concurrency if isinstance(max_concurrency, EpisodeSlots) else EpisodeSlots(max_concurrency)
    key = slots_key(phase, step)

    async def main() -> list[Episode | RolloutError]:
        async def one(job: EpisodeJob) -> Episode | RolloutError:
            nonlocal ended
            async with slots.slot(key):
                outcome = await _run_one(app, job, phase=phase, step=step, run_seed=run_seed, rollout=rollout,
                                         base_config=base_config, env=env)
            ended += 1
            if on_done is not None:
                on_done(ended)
            return outcome

        with slots._running_as(key, asyncio.current_task()):
            return await asyncio.gather(*(one(job) for job in jobs))

    threads = _NodeThreads()
    slots.open(key, len(jobs))
    try:
        outcomes = _run_loop(main(), threads)
    finally:
        slots.close(key)
    if threads.busy:
        log.warning("%s step %d: %d graph node thread(s) are still running after their episode was cancelled "
                    "(a tool or a blocking call that does not return, or a generation the backstop cut short); they "
                    "are left behind (daemon threads, they end with the process)", phase, step, threads.busy)
    batch = RolloutBatch()
    for job, outcome in zip(jobs, outcomes):
        if isinstance(outcome, Episode):
            batch.runs.append((job.task, outcome))
            if outcome.outcome in ("truncated", "model_error"):
                batch.counts[f"{outcome.outcome}_episodes"] += 1
            if outcome.truncated_by is not None:
                key = f"truncated/{outcome.truncated_by}"
                batch.counts[key] = batch.counts.get(key, 0) + 1
            continue
        kind = "no_llm_call_episodes" if isinstance(outcome, NoLLMCallError) else "failed_episodes"
        batch.counts[kind] += 1
        batch.counts["interrupted_episodes"] += isinstance(outcome, EpisodeInterruptedError)
        batch.errors.append(outcome)
    return batch


async def _run_one(app: Any, job: EpisodeJob, *, phase: str, step: int, run_seed: int, rollout: RolloutConfig,
                   base_config: Mapping[str, Any] | None, env: Any = None) -> Episode | RolloutError:
    metadata = {"phase": phase, "step": step, "group_index": job.index,
                "seed": episode_seed(run_seed, phase, step, job.group, job.index),
                **limit_metadata(rollout.max_llm_calls, rollout.timeout_s)}
    cont = continuation_from_env(env, job.task, rollout.max_resumes)
    run = asyncio.ensure_future(app.arollout(job.task.input, episode_config(base_config, rollout),
                                             task_id=job.task.id, group_id=job.group_id, metadata=metadata,
                                             resume=cont.resume, next_input=cont.next_input,
                                             max_resumes=cont.max_resumes))
    deadline = None if rollout.timeout_s is None else rollout.timeout_s + BACKSTOP_GRACE_S
    done, _ = await asyncio.wait({run}, timeout=deadline)
    if not done:  # no LLM call started past timeout_s: stuck in a node, or inside a long generation
        run.cancel(Backstop(rollout.timeout_s, BACKSTOP_GRACE_S))  # arollout ends the episode (`Backstop.stop`)
        done, _ = await asyncio.wait({run}, timeout=CANCEL_GRACE_S)
        if not done or run.cancelled():
            return StuckEpisodeError(
                f"an episode of task {job.task.id!r} ({job.group_id}, #{job.index}) ran past rollout.timeout_s="
                f"{rollout.timeout_s:g} (+{BACKSTOP_GRACE_S:g} s) without starting another LLM call: stuck in a "
                "node (a tool or a blocking call that does not return); it was cancelled and fails; "
                + (f"it did not unwind within {CANCEL_GRACE_S:g} s of being cancelled and is not in the trace store"
                   if not done else "it was cancelled before its episode started"))
    try:
        episode = run.result()
    except RolloutError as exc:
        return _kept(exc)
    if episode.error:  # the app swallowed an exception that must fail the episode
        return RolloutError(f"episode {episode.id} (task {episode.task_id}) failed after {len(episode.turns)} LLM "
                            f"call(s): {episode.error}", episode)
    return episode


def _kept(exc: RolloutError) -> Episode | RolloutError:
    """The episode of a run that raised, if training keeps it (truncated, or a model error, with at least one
    LLM call); else the error (the episode is dropped)."""
    episode = exc.episode
    if episode is None or episode.outcome not in ("truncated", "model_error"):
        return exc
    if not episode.turns:
        return NoLLMCallError(f"episode {episode.id} (task {episode.task_id}) was stopped before its first LLM "
                              f"call ({episode.stop_reason}); there is nothing to train on", episode)
    return episode


class _NodeThreads(concurrent.futures.ThreadPoolExecutor):
    """The event loop's executor for one step's sync graph nodes: daemon threads that are never joined.

    `asyncio.run` joins its default executor's threads when the loop closes, and the interpreter joins every
    `ThreadPoolExecutor` thread at exit: a node stuck in a tool that never returns would hold the step, and
    then the process, forever. These threads are daemons; one still busy when the step ends is left behind
    (`busy` counts them). A thread starts only when none is idle, and there is no upper bound: a sync
    `@entrypoint` waits in `task(...).result()` for a task that needs a thread of the same pool, so any fixed
    size deadlocks once that many entrypoints are in flight (threads are reused: their number is the peak of
    sync work in flight). Each work item runs in a copy of the submitter's context (LangChain copies it
    too), so the episode's call handler follows it. A ThreadPoolExecutor only because asyncio requires one.
    """

    def __init__(self) -> None:
        super().__init__(max_workers=sys.maxsize)  # no bound: a thread may block on work queued behind it
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._n_threads = 0
        self._busy = 0

    @property
    def busy(self) -> int:
        """Threads running a work item now."""
        with self._lock:
            return self._busy

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._work.put((future, functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)))
        with self._lock:
            start = not self._idle.acquire(blocking=False) and self._n_threads < self._max_workers
            self._n_threads += start
        if start:
            threading.Thread(target=self._serve, name=f"rollout-{self._n_threads}", daemon=True).start()
        return future

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            future, call = item
            if future.set_running_or_notify_cancel():
                with self._lock:
                    self._busy += 1
                try:
                    result, error = call(), None
                except BaseException as exc:  # noqa: BLE001 - handed to the future, as ThreadPoolExecutor does
                    result, error = None, exc
                with self._lock:  # not busy before the result is handed back: the step may end right after
                    self._busy -= 1
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)
                del result, error  # the thread holds no result while it waits for the next item
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop the threads once their work item is done; never waits (see the class docstring)."""
        for _ in range(self._n_threads):
            self._work.put(None)


def _run_loop(main: Coroutine[Any, Any, T], threads: _NodeThreads) -> T:
    """`asyncio.run(main)` with `threads` as the default executor, without its last step (joining the
    executor's threads, forever for a thread stuck in a tool). Tasks left over are cancelled and given
    `CANCEL_GRACE_S` to unwind."""
    loop = asyncio.new_event_loop()
    loop.set_default_executor(threads)
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            leftover = asyncio.all_tasks(loop)
            for task in leftover:
                task.cancel()
            if leftover:
                loop.run_until_complete(asyncio.wait(leftover, timeout=CANCEL_GRACE_S))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()  # shuts `threads` down without waiting
