"""`--graph module:attr` and config `graph:`/`env:` specs: import the object they name, and build the graph a
factory makes (its `llm` gets a stand-in chat model: policies answer every call)."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Mapping
from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel

from drmas_graph.errors import ConfigError

__all__ = ["import_object", "build_graph", "StandInChatModel"]


def import_object(spec: str) -> Any:
    """``package.module:attr.sub`` -> the object; a ConfigError naming the spec otherwise."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ConfigError(f"--graph {spec!r} must look like 'package.module:attribute'")
    if os.getcwd() not in sys.path:  # like `python -m`, find modules of the current project
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"--graph {spec!r}: cannot import module {module_name!r} ({e})") from e
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ConfigError(f"--graph {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    return obj


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


def build_graph(spec: str, kwargs: Mapping[str, Any] | None = None) -> Any:
    """The graph `spec` names: a compiled graph or builder as is; a factory called with `kwargs` (a config's
    `graph_kwargs`), its `llm` parameter given a `StandInChatModel` unless `kwargs` sets it."""
    graph = import_object(spec)
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
