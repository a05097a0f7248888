"""How replay compares a re-run with its recording: calls (prompt, tools, structured-output request, the call's
own stop strings and max_tokens), final states and interrupts, each side in the form the trace store keeps.

A stored episode holds what `_serde.to_json` made of the live values (a set became a list, an Enum its
value, a tuple a list, a mapping key a string, a dataclass its fields), so every live value is put through
that same conversion (`stored`) before it is compared; a recording that was never stored is converted too,
so both sides always agree on the form. On top of that, `comparable` renames the ids LangChain and LangGraph
draw at random.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import BaseMessage

from drmas_graph._chat import _text
from drmas_graph._structured import output_spec
from drmas_graph.errors import StructuredOutputError
from drmas_graph.instrumentation.replaying import CallSite, call_sampling
from drmas_graph.traces._serde import from_json, to_json
from drmas_graph.types import Turn

__all__ = ["stored", "comparable", "render_prompt", "Request", "diff", "state_text", "interrupts_text"]


def stored(value: Any) -> Any:
    """`value` as the trace store gives it back (`_serde.to_json`, then `from_json`): the form a recording
    holds. A value with no JSON form becomes its repr (with the store's `TraceStoreWarning`)."""
    return from_json(to_json(value, "a value replay compares (in the trace store's form)"))


def render_prompt(messages: Sequence[BaseMessage], tools: Sequence[dict] = (), response_format: Any = None) -> str:
    """A prompt as readable lines: one 'role: content' block per message, tool calls, tool names and the
    structured output the call asks for (`Turn.response_format`; a str says why the request cannot be honoured)."""
    lines = []
    for m in messages:
        lines.append(f"[{m.type}] {_text(m.content)}")
        for call in getattr(m, "tool_calls", None) or ():
            lines.append(f"  -> tool call {call['name']}({json.dumps(call.get('args', {}), sort_keys=True)})")
    if tools:
        lines.append("[tools] " + ", ".join(t.get("function", {}).get("name", "?") for t in tools))
    if response_format is not None:
        text = response_format if isinstance(response_format, str) else json.dumps(response_format, sort_keys=True)
        lines.append(f"[response_format] {text}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Request:
    """What a call asks a model, in the stored form: the prompt, the bound tools, (for a call a policy served)
    the structured output, and the call's own stop strings and max_tokens. A live call is the recorded one when
    their requests are equal."""

    prompt: str
    """`render_prompt` of the messages."""
    tools: list
    """The bound tools' function schemas."""
    response_format: Any
    """`Turn.response_format` (None for free text); for a live call, what `_structured.output_spec` makes of
    its kwargs, or why it cannot be honoured (a str)."""
    sampling: dict | None = None
    """`Turn.call_sampling`: the stop strings and max_tokens the call passed; None when not compared (a recording
    from a store that predates them, and a live call compared with one: `without_sampling`)."""

    @staticmethod
    def of_turn(turn: Turn) -> Request:
        return Request(render_prompt(stored(list(turn.messages))), _functions(turn.tools),
                       stored(turn.response_format), stored(turn.call_sampling))

    @staticmethod
    def of_call(site: CallSite) -> Request:
        """The live call's request; its structured output only once `with_format` asks for it (a call the
        app's own model answered records none, and may bind kwargs a policy could not honour)."""
        return Request(render_prompt(stored(list(site.messages))), _functions(site.tools), None,
                       stored(call_sampling(site)))

    def without_sampling(self) -> Request:
        """This request with its stop strings and max_tokens left out of the comparison."""
        return dataclasses.replace(self, sampling=None)

    def with_format(self, site: CallSite, agent: str) -> Request:
        try:
            spec, _ = output_spec(site.kwargs, site.tools, f"agent {agent!r} (node {site.node!r})")
        except StructuredOutputError as exc:
            spec = f"cannot be honoured: {exc}"
        return dataclasses.replace(self, response_format=stored(spec))

    def changed(self, recorded: Request) -> str:
        """The divergence kind between this request and a recorded one that does not match it."""
        if self.prompt != recorded.prompt:
            return "prompt_changed"
        if self.tools != recorded.tools:
            return "tools_changed"
        return "format_changed" if self.response_format != recorded.response_format else "sampling_changed"

    def text(self, sampling: Sequence[str] = ()) -> str:
        """The request as `render_prompt` lines (tool names and structured output included), for diffs; with
        a line '[stop] [...]' or '[max_tokens] n' for each parameter in `sampling` and each the call set."""
        tools = "[tools] " + ", ".join(t.get("name", "?") for t in self.tools) if self.tools else ""
        fmt = "" if self.response_format is None else render_prompt((), (), self.response_format)
        return "\n".join(part for part in (self.prompt, tools, fmt, *self.sampling_lines(sampling)) if part)

    def sampling_lines(self, shown: Sequence[str] = ()) -> list[str]:
        """'[stop] ["."]', '[max_tokens] 5' for the parameters the call set and those in `shown` (unset: [] and
        none), so a diff names the parameter with its old and new value."""
        values = self.sampling or {}
        return [f"[{key}] {json.dumps(values.get(key), ensure_ascii=False) if values.get(key) else _UNSET[key]}"
                for key in ("stop", "max_tokens") if values.get(key) or key in shown]

    def set_sampling(self, other: Request) -> list[str]:
        """The parameters (stop, max_tokens) either request set: shown on both sides of a diff."""
        both = (self.sampling or {}, other.sampling or {})
        return [key for key in ("stop", "max_tokens") if any(values.get(key) for values in both)]


_UNSET = {"stop": "[]", "max_tokens": "none"}


def _functions(tools: Sequence[dict]) -> list:
    return stored([t.get("function", t) for t in tools])


def diff(recorded: str, new: str, old_name: str = "recorded prompt", new_name: str = "new prompt") -> str:
    return "\n".join(difflib.unified_diff(recorded.splitlines(), new.splitlines(), old_name, new_name, lineterm=""))


_GENERATED_ID_KEYS = frozenset({"id", "tool_call_id"})
"""Keys inside a message whose values are drawn at random: the message id (LangGraph's add_messages
reducer, LangChain's run ids), tool-call ids (drawn by parsers and by third-party code such as
langgraph-supervisor's handoff messages) and the ToolMessage's reference to one."""


def comparable(value: Any) -> Any:
    """A JSON-like form of a graph state for equality, in the trace store's form (`stored`: a set compares
    as the list the store writes, an Enum as its value) and up to generated ids: inside LangChain messages,
    every id (message id, tool-call id, a ToolMessage's tool_call_id) is renamed '<id:k>' in order of first
    appearance, and so is the id of every LangGraph `Interrupt` (compared by value). The renaming is
    consistent, so a ToolMessage still has to answer the same tool call as in the recording, while two runs
    that drew different uuids compare equal. Dataclasses compare as their fields."""
    return _Canonical().walk(stored(value), in_message=False)


class _Canonical:
    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def rename(self, generated: str) -> str:
        return self.names.setdefault(generated, f"<id:{len(self.names)}>")

    def walk(self, value: Any, in_message: bool) -> Any:
        if isinstance(value, BaseMessage):
            return {"__message__": self.walk(value.model_dump(), in_message=True)}
        if isinstance(value, Mapping):
            return {str(k): self.entry(k, v, in_message) for k, v in value.items()}
        if isinstance(value, list):
            return [self.walk(v, in_message) for v in value]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a Command (revived by the store)
            return self.walk({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, in_message)
        return value

    def entry(self, key: Any, value: Any, in_message: bool) -> Any:
        if in_message and key in _GENERATED_ID_KEYS and isinstance(value, str):
            return self.rename(value)
        if key == "__interrupt__" and isinstance(value, list):  # a run that stopped at interrupt()
            return [self.interrupt(i) if isinstance(i, Mapping) else self.walk(i, in_message) for i in value]
        return self.walk(value, in_message)

    def interrupt(self, stored_interrupt: Mapping[str, Any]) -> dict[str, Any]:
        """An interrupt by value: its id hashes the task's checkpoint namespace, new on every thread."""
        interrupt_id = stored_interrupt.get("id")
        return {"value": self.walk(stored_interrupt.get("value"), False),
                "id": self.rename(interrupt_id) if isinstance(interrupt_id, str) else interrupt_id}


def state_text(state: Any) -> str:
    return json.dumps(comparable(state), indent=1, sort_keys=True, default=repr, ensure_ascii=False)


def interrupts_text(records: Sequence[Mapping[str, Any]]) -> str:
    """Interrupts as lines of node and value (ids differ from thread to thread: they are left out)."""
    return "\n".join(f"{r['node']}: {json.dumps(comparable(r['value']), sort_keys=True, default=repr)}"
                     for r in records)
