"""`--graph module:attr` and a config's `graph:`: build the graph the spec names (imported by the one
`module:attr` importer, `drmas_graph._importing.import_spec`); a factory's `llm` gets a stand-in chat model:
policies answer every call."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel

from drmas_graph._importing import import_spec
from drmas_graph.errors import ConfigError

__all__ = ["build_graph", "StandInChatModel"]


class StandInChatModel(BaseChatModel):
    """What a graph factory gets as its `llm` under `drmas-graph train` and `traces replay`: inside
    instrumented runs (and replays) every call is served by the agent's policy (or the recording); a call
    outside one is an error (it would otherwise go nowhere)."""

    @property
    def _llm_type(self) -> str:
        return "drmas-stand-in"

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        from langchain_core.utils.function_calling import convert_to_openai_tool

        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("the stand-in chat model was called outside an instrumented run; only policies answer")


def build_graph(spec: str, kwargs: Mapping[str, Any] | None = None, *, setting: str = "--graph") -> Any:
    """The graph `spec` names: a compiled graph or builder as is; a factory called with `kwargs` (a config's
    `graph_kwargs`), its `llm` parameter given a `StandInChatModel` unless `kwargs` sets it. `setting` names
    the spec's source in errors (`--graph`, a config's `graph`)."""
    graph = import_spec(spec, setting=setting)
    if not callable(graph) or hasattr(graph, "invoke") or hasattr(graph, "compile"):
        return graph
    kwargs = dict(kwargs or {})
    signature = inspect.signature(graph)
    if "llm" in signature.parameters:
        kwargs.setdefault("llm", StandInChatModel())
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"graph factory {spec!r} cannot be called with {sorted(kwargs) or 'no arguments'} ({e}): "
                          "its `llm` gets a stand-in model, other parameters come from the config's graph_kwargs "
                          "(none under `traces replay`: give them defaults there, or name a compiled graph)") from e
    return graph(**kwargs)
