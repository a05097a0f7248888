"""Per-episode limits: a cap on LLM calls and on wall time, checked when each LLM call starts.

The trainer puts the limits in the rollout's metadata (`max_llm_calls`, `timeout_s`); the instrumented call
handler calls `enforce_limits` before serving a call. A looping graph (an untrained judge that never says
"done") therefore stops at its next LLM call, also when its nodes run in worker threads that cancelling
the episode's task could not stop. The episode is *truncated*, not failed: the limit is written to
`episode.truncated` before raising (so an app that swallows the exception, `except Exception`, does not hide
it), and the turns recorded so far stay exactly as they were (the refused call records no turn).

An episode stuck *between* LLM calls (a tool that never returns) never reaches this check; the trainer's
backstop cancels it (`StuckEpisodeError`, see `drmas_graph.train._rollouts`).
"""

from __future__ import annotations

import time
from typing import Any

from drmas_graph.errors import RolloutError

__all__ = ["EpisodeLimitError", "StuckEpisodeError", "enforce_limits", "limit_metadata", "LIMITS"]

LIMITS = ("max_llm_calls", "timeout_s", "recursion_limit")
"""The limits that truncate an episode (`Episode.truncated` starts with one of them)."""


class EpisodeLimitError(RolloutError):
    """An episode was stopped at an LLM call because it reached `rollout.max_llm_calls` or `rollout.timeout_s`
    (`limit` says which); the episode is truncated."""

    def __init__(self, message: str, episode: Any = None, *, limit: str = "") -> None:
        super().__init__(message, episode)
        self.limit = limit


class StuckEpisodeError(RolloutError):
    """An episode ran past `rollout.timeout_s` (plus a grace) without starting an LLM call and was cancelled:
    a node stuck in a tool or a blocking call. It fails (a hang is not the policy's doing); a node thread
    that does not return is left behind."""


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
        _stop(episode, "max_llm_calls",
              f"episode {episode.id} (task {episode.task_id}) made {calls_before} LLM calls, the cap "
              f"(rollout.max_llm_calls={cap}); it was stopped at its next call. A graph that loops until an "
              "agent says it is done needs a cap; raise it if episodes legitimately need more calls")
    timeout = metadata.get("timeout_s")
    start = (episode.timings or {}).get("start")
    if timeout is not None and start is not None and time.time() - start > timeout:
        _stop(episode, "timeout_s",
              f"episode {episode.id} (task {episode.task_id}) ran {time.time() - start:.1f} s, past "
              f"rollout.timeout_s={timeout:g}, after {calls_before} LLM calls; it was stopped at its next call")


def _stop(episode: Any, limit: str, reason: str) -> None:
    if not episode.truncated:  # the first limit reached is the one that truncated it
        episode.truncated = f"{limit}: {reason}"
    raise EpisodeLimitError(reason, episode, limit=limit)
