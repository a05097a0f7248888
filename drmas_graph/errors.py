"""Exceptions raised by drmas-graph.

One base class, `DrmasError`; each specific error also subclasses the stdlib type it stands in for, so
``except ValueError`` in user code keeps working.
"""

from __future__ import annotations

__all__ = [
    "DrmasError",
    "ConfigError",
    "UnknownAgentError",
    "StrictModeError",
    "UnservedCallWarning",
    "StructuredOutputError",
    "GrammarError",
    "InvalidReplyError",
    "PolicyError",
    "RolloutError",
    "NoLLMCallError",
    "EpisodeInterruptedError",
    "JudgeError",
]


class DrmasError(Exception):
    """Base class of every error drmas-graph raises on purpose."""


class ConfigError(DrmasError, ValueError):
    """A configuration value, argument or name is invalid."""


class UnknownAgentError(ConfigError):
    """An agent or node name in ``policies``/``agents`` does not exist in the graph."""


class StrictModeError(DrmasError, LookupError):
    """``strict=True`` and a node made an LLM call that no policy serves."""


class UnservedCallWarning(UserWarning):
    """A chat-model call made while an instrumented run was active could not be attributed to it; the app's
    own model answered (a strict run would have refused it with `StrictModeError`)."""


class StructuredOutputError(DrmasError, ValueError):
    """A call asked for structured output (`with_structured_output`, a forced `tool_choice`) that cannot be
    honoured, or the policy's reply does not satisfy it (the reply's Turn is recorded first)."""


class InvalidReplyError(StructuredOutputError):
    """The policy's reply does not satisfy the structured-output request of its call (not the JSON, not the
    forced tool call): the policy's own output broke the call, not the app."""

    turn_index: int | None = None
    """`Turn.index` of the call in its episode, set by the recorder once the reply's turn is recorded."""


class GrammarError(StructuredOutputError):
    """A call's format cannot be decoded under a grammar (a JSON schema the grammar library does not support), or
    a recorded response was not decoded under the grammar it names (`drmas_graph.grammar`). The message says which
    switch turns constrained decoding off (`agents.<a>.constrain`, `models.<m>.constrain`)."""


class PolicyError(DrmasError, RuntimeError):
    """A policy backend failed or returned something unusable (no token ids, no logprobs)."""


class RolloutError(DrmasError, RuntimeError):
    """A rollout failed. ``.episode`` holds what was recorded before the failure (``episode.error`` set)."""

    def __init__(self, message: str, episode=None):
        super().__init__(message)
        self.episode = episode


class NoLLMCallError(RolloutError):
    """A rollout finished without a single LLM call, so there is nothing to train on."""


class EpisodeInterruptedError(RolloutError):
    """An episode ended paused at `interrupt()` (or a static breakpoint) that nobody answered: no `resume`
    hook, the hook returned None, or `max_resumes` was reached."""


class JudgeError(DrmasError, RuntimeError):
    """The judge gave no usable score for an episode after its retries (the message says why, with the last raw
    reply); `drmas_graph.rewards.Judge.reward_group` returns it in place of the episode's reward."""


class TraceStoreError(DrmasError, OSError):
    """A trace store cannot be opened, read or written; the message names the file."""


class StoreNotFoundError(TraceStoreError, FileNotFoundError):
    """A trace store opened read-only does not exist."""


class CorruptStoreError(TraceStoreError):
    """The file is not an SQLite database, or not a drmas-graph trace store, or is damaged."""


class SchemaVersionError(TraceStoreError):
    """The store was written with a schema version this drmas-graph cannot read."""


class EpisodeNotFoundError(DrmasError, KeyError):
    """No episode with this id in the trace store."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


__all__ += [
    "TraceStoreError",
    "StoreNotFoundError",
    "CorruptStoreError",
    "SchemaVersionError",
    "EpisodeNotFoundError",
]
