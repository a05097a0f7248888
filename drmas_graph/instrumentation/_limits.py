"""Per-episode limits: a cap on LLM calls and on wall time, checked when each LLM call starts.

The trainer puts the limits in the rollout's metadata (`max_llm_calls`, `timeout_s`); the instrumented call
handler calls `enforce_limits` before serving a call. A looping graph (an untrained judge that never says
"done") therefore stops at its next LLM call, also when its nodes run in worker threads that cancelling
the episode's task could not stop. The episode is *truncated*, not failed: the limit is written to
`episode.truncated` before raising (so an app that swallows the exception, `except Exception`, does not hide
it), and the turns recorded so far stay exactly as they were (the refused call records no turn). A
conversation still going after `max_resumes` later runs is truncated the same way (`_segments`).

An episode that does not reach its next LLM call within `timeout_s` plus a grace is cancelled by the trainer's
backstop (`Backstop`, see `drmas_graph.train.loop._rollouts`): one cancelled inside an LLM call (a generation that
straddles the time cap) is truncated by `timeout_s` with its turns so far; one stuck *between* LLM calls (a
tool that never returns) fails with `StuckEpisodeError`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NoReturn

from drmas_graph.errors import RolloutError

__all__ = ["EpisodeLimitError", "StuckEpisodeError", "Backstop", "enforce_limits", "limit_metadata", "truncate",
           "LIMITS"]

LIMITS = ("max_llm_calls", "timeout_s", "recursion_limit", "max_resumes")
"""The limits that truncate an episode (`Episode.truncated` starts with one of them)."""


class EpisodeLimitError(RolloutError):
    """An episode was stopped because it reached `rollout.max_llm_calls` or `rollout.timeout_s` (at an LLM call,
    or cancelled inside one by the backstop) or `rollout.max_resumes` (`limit` says which); the episode is
    truncated."""

    def __init__(self, message: str, episode: Any = None, *, limit: str = "") -> None:
        super().__init__(message, episode)
        self.limit = limit


class StuckEpisodeError(RolloutError):
    """An episode ran past `rollout.timeout_s` (plus a grace) without starting an LLM call and was cancelled:
    a node stuck in a tool or a blocking call. It fails (a hang is not the policy's doing; `episode.error`
    starts with 'StuckEpisodeError'); a node thread that does not return is left behind."""


@dataclass(frozen=True)
class Backstop:
    """What the trainer's backstop cancels an episode's task with (`task.cancel(Backstop(...))`): `arollout`
    then ends the episode with `stop` and raises its error instead of `CancelledError`."""

    timeout_s: float
    """The episode's `rollout.timeout_s`."""
    grace_s: float
    """How much longer it ran without reaching its next LLM call."""

    def stop(self, episode: Any, in_llm_call: bool) -> RolloutError:
        """Record on `episode` how the backstop ended it and return the error to raise: truncated by timeout_s
        when it was cancelled inside an LLM call (or a limit had truncated it already), else stuck (failed)."""
        where = (f"episode {episode.id} (task {episode.task_id!r}, {episode.group_id}) ran past rollout.timeout_s="
                 f"{self.timeout_s:g} (+{self.grace_s:g} s)")
        calls = f"after {len(episode.turns)} LLM call(s)"
        if in_llm_call and not episode.truncated:
            episode.truncated = (f"timeout_s: {where} inside an LLM call that had not returned, {calls}; it was "
                                 "cancelled (the unfinished call records no turn)")
        if episode.truncated:
            episode.error = None
            return EpisodeLimitError(episode.truncated.split(": ", 1)[1], episode, limit=episode.truncated_by)
        reason = (f"{where} without starting another LLM call, {calls}: stuck in a node (a tool or a blocking call "
                  "that does not return); it was cancelled and fails")
        episode.error = f"{StuckEpisodeError.__name__}: {reason}"
        return StuckEpisodeError(reason, episode)


def limit_metadata(max_llm_calls: int | None, timeout_s: float | None) -> dict[str, Any]:
    """The rollout metadata entries that `enforce_limits` reads (only the limits that are set)."""
    out: dict[str, Any] = {}
    if max_llm_calls is not None:
        out["max_llm_calls"] = int(max_llm_calls)
    if timeout_s is not None:
        out["timeout_s"] = float(timeout_s)
    return out


def enforce_limits(episode: Any, calls_before: int) -> None:
    """Raise `EpisodeLimitError` if the call about to start (after `calls_before` calls) breaks a limit."""
    metadata = episode.metadata or {}
    cap = metadata.get("max_llm_calls")
    if cap is not None and calls_before >= cap:
        truncate(episode, "max_llm_calls",
              f"episode {episode.id} (task {episode.task_id}) made {calls_before} LLM calls, the cap "
              f"(rollout.max_llm_calls={cap}); it was stopped at its next call. A graph that loops until an "
              "agent says it is done needs a cap; raise it if episodes legitimately need more calls")
    timeout = metadata.get("timeout_s")
    start = (episode.timings or {}).get("start")
    if timeout is not None and start is not None and time.time() - start > timeout:
        truncate(episode, "timeout_s",
              f"episode {episode.id} (task {episode.task_id}) ran {time.time() - start:.1f} s, past "
              f"rollout.timeout_s={timeout:g}, after {calls_before} LLM calls; it was stopped at its next call")


def truncate(episode: Any, limit: str, reason: str) -> NoReturn:
    """Record that `limit` (one of `LIMITS`) stopped `episode` and raise `EpisodeLimitError`."""
    if not episode.truncated:  # the first limit reached is the one that truncated it
        episode.truncated = f"{limit}: {reason}"
    raise EpisodeLimitError(reason, episode, limit=limit)
