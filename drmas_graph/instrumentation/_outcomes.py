"""Why a run that raised did not finish, and whether that is learning signal (`note_stop`).

A run that raised is exactly one of:

- **truncated**: a limit stopped it. `rollout.max_llm_calls` and `rollout.timeout_s` are checked when an LLM
  call starts and recorded on the episode before the limit error is raised (`_limits`), whatever the app
  does with that error afterwards; LangGraph's `GraphRecursionError` (`recursion_limit`) is recognised here.
- **a model error**: the policy's own output broke the app. The exception, or one on its `__cause__` chain,
  is one of
    * `InvalidReplyError` (raised by the recorder): the reply is not the JSON or the tool call a
      structured-output call asked for; it names its turn;
    * LangChain's `OutputParserException`: an output parser of the app could not parse a reply; its turn
      is the latest one whose text contains the parser's `llm_output` (without one: the latest turn);
    * a tool's argument validation error: pydantic's `ValidationError` whose title is the name of a tool
      that a turn called (what a LangChain tool raises for bad arguments), or LangGraph's
      `ToolInvocationError`; its turn is the latest one that called that tool;
  and that turn was served by a policy. The same exceptions caused by a turn the app's own model served
  are not the policy's doing.
- **failed**: anything else (the app's or the environment's bug, a connection error of a model that is
  not trained, a call refused in strict mode, a structured-output request that cannot be honoured).

Truncated and model-error episodes are kept for training; failed ones are dropped and counted.
"""

from __future__ import annotations

from collections.abc import Iterator

from langchain_core.exceptions import OutputParserException
from langgraph.errors import GraphRecursionError
from pydantic import ValidationError
from pydantic.v1 import ValidationError as ValidationErrorV1

from drmas_graph._structured import InvalidReplyError
from drmas_graph.types import Episode

__all__ = ["note_stop", "model_error_turn"]


def note_stop(episode: Episode, exc: BaseException) -> None:
    """Record on `episode` why its run raised `exc`: exactly one of `truncated`, `model_error` (with
    `model_error_turn`) or `error` is set afterwards. Call it once the episode's turns are in place."""
    episode.error = None
    if episode.truncated:  # a limit stopped the run; whatever the app raised afterwards follows from it
        return
    if any(isinstance(e, GraphRecursionError) for e in _chain(exc)):
        episode.truncated = (f"recursion_limit: episode {episode.id} (task {episode.task_id}) reached the "
                             f"recursion limit after {len(episode.turns)} LLM call(s): {exc}")
        return
    found = model_error_turn(episode, exc)
    if found is not None:
        position, cause = found
        turn = episode.turns[position]
        episode.model_error = (f"turn {position} (agent {turn.agent!r}, node {turn.node!r}): "
                               f"{type(cause).__name__}: {cause}")
        episode.model_error_turn = position
        return
    episode.error = f"{type(exc).__name__}: {exc}"


def model_error_turn(episode: Episode, exc: BaseException) -> tuple[int, BaseException] | None:
    """(position of the policy-served turn whose output caused `exc`, the model-caused exception), or None
    when `exc` is not caused by a policy's output (see the module docstring for the exact rule)."""
    for cause in _chain(exc):
        position = _offending_turn(episode, cause)
        if position is not None:
            return (position, cause) if episode.turns[position].trainable else None
    return None


def _offending_turn(episode: Episode, exc: BaseException) -> int | None:
    turns = episode.turns
    if isinstance(exc, InvalidReplyError):
        return next((i for i, t in enumerate(turns) if t.index == exc.turn_index), None)
    if isinstance(exc, OutputParserException):
        output = str(exc.llm_output or "").strip()
        matching = [i for i, t in enumerate(turns) if output and output in t.response_text]
        return (matching or list(range(len(turns))) or [None])[-1]
    tool = _invalid_tool_arguments(exc)
    if tool is not None:
        calling = [i for i, t in enumerate(turns) if any(c.get("name") == tool for c in t.tool_calls)]
        return calling[-1] if calling else None
    return None


def _invalid_tool_arguments(exc: BaseException) -> str | None:
    """The tool whose arguments failed validation, if `exc` is such a failure (else None)."""
    name = getattr(exc, "tool_name", None)  # LangGraph's ToolInvocationError (ToolNode)
    if isinstance(name, str) and isinstance(getattr(exc, "source", None), (ValidationError, ValidationErrorV1)):
        return name
    if isinstance(exc, ValidationError):
        return exc.title
    if isinstance(exc, ValidationErrorV1):
        return getattr(exc.model, "__name__", None)
    return None


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc` and its explicit causes (`raise ... from`), outermost first."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__
