"""The final output of a streamed run: what `invoke` would have returned, for the episode's `final_state`.

`stream()` / `astream()` (and `astream_events`, which drives `astream`) yield what the caller asked for
(`stream_mode` "updates", "messages", "custom", ...), not the graph's output. LangGraph's own `invoke` is a
stream with modes ["updates", "values"]: its output is the last "values" chunk of the root graph, plus the
interrupts the "updates" chunks carried (`__interrupt__`). `StreamFold` asks the graph for those two modes
as well, keeps the output as `invoke` would, and gives the caller exactly the chunks of the modes it asked
for, in the shape it asked for (a single mode: bare payloads; a list: (mode, payload); `subgraphs=True`: the
namespace first; `version="v2"`: LangGraph's StreamPart dicts).

`invoke_by_supersteps` / `ainvoke_by_supersteps` run a graph as its `invoke` does (that same stream, folded) and
say after every completed superstep what `invoke` would have returned had the run ended there: a run that raises
(a limit, a model error) leaves the state of its last completed superstep, with or without a checkpointer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["StreamFold", "invoke_by_supersteps", "ainvoke_by_supersteps"]

_INTERRUPT = "__interrupt__"
_SKIP = object()


class StreamFold:
    """Folds a streamed run's chunks into `output` (what `invoke` returns) while passing the caller's own."""

    def __init__(self, graph: Any, kwargs: Mapping[str, Any]) -> None:
        mode = kwargs.get("stream_mode")
        if mode is None:
            mode = getattr(graph, "stream_mode", "values")
        self.single = isinstance(mode, str)
        self.modes: list[str] = [mode] if self.single else list(mode)
        self.subgraphs = bool(kwargs.get("subgraphs", False))
        self.v2 = kwargs.get("version") == "v2"
        self.kwargs = {**kwargs, "stream_mode": self.modes + [m for m in ("updates", "values") if m not in self.modes]}
        self._output_keys = kwargs.get("output_keys")
        self._graph_output = getattr(graph, "output_channels", None)
        self._latest: Any = None
        self._interrupts: list[Any] = []

    def feed(self, chunk: Any) -> Any:
        """The chunk as the caller's stream gives it, or `_SKIP` (a mode only the fold asked for)."""
        ns, mode, payload = self._parts(chunk)
        if not ns:
            if mode == "values":
                self._latest = payload
                if self.v2:
                    self._interrupts.extend(chunk.get("interrupts") or ())
            elif mode == "updates" and not self.v2 and isinstance(payload, Mapping) and _INTERRUPT in payload:
                self._interrupts.extend(payload[_INTERRUPT])
        if mode not in self.modes:
            return _SKIP
        if self.v2 or not self.single:
            return chunk
        return (ns, payload) if self.subgraphs else payload

    @staticmethod
    def skipped(chunk: Any) -> bool:
        return chunk is _SKIP

    def _parts(self, chunk: Any) -> tuple[tuple, str, Any]:
        if self.v2:
            return tuple(chunk.get("ns") or ()), chunk.get("type"), chunk.get("data")
        if self.subgraphs:
            ns, mode, payload = chunk
            return tuple(ns), mode, payload
        mode, payload = chunk
        return (), mode, payload

    @property
    def output(self) -> Any:
        """What `invoke` would have returned (the graph's output channels; `__interrupt__` when it paused)."""
        latest = self._latest
        if self._output_keys is None and isinstance(latest, Mapping) and isinstance(self._graph_output, list | tuple):
            latest = {k: v for k, v in latest.items() if k in self._graph_output}  # stream values: every channel
        if self._interrupts:
            return {**latest, _INTERRUPT: list(self._interrupts)} if isinstance(latest, Mapping) else \
                {_INTERRUPT: list(self._interrupts)}
        return latest


def _as_invoke(graph: Any, kwargs: Mapping[str, Any]) -> StreamFold:
    """The fold of a stream that gives what `graph.invoke(..., **kwargs)` returns (the output channels, as invoke
    asks for them, unless `output_keys` says otherwise)."""
    kwargs = {**kwargs, "stream_mode": "values"}
    output = getattr(graph, "output_channels", None)
    if kwargs.get("output_keys") is None and output is not None:
        kwargs["output_keys"] = output
    return StreamFold(graph, kwargs)


def invoke_by_supersteps(graph: Any, input: Any, config: Any, on_state: Callable[[Any], None], **kwargs: Any) -> Any:
    """What `graph.invoke(input, config, **kwargs)` returns, run as LangGraph's `invoke` runs it (its `stream` of
    "updates" and "values"); `on_state(output)` hears, after each completed superstep (and once the input is
    applied), what `invoke` would have returned had the run ended there."""
    fold = _as_invoke(graph, kwargs)
    for chunk in graph.stream(input, config, **fold.kwargs):
        if not fold.skipped(fold.feed(chunk)):
            on_state(fold.output)
    return fold.output


async def ainvoke_by_supersteps(graph: Any, input: Any, config: Any, on_state: Callable[[Any], None],
                                **kwargs: Any) -> Any:
    """`invoke_by_supersteps` through the graph's `astream` (what its `ainvoke` runs)."""
    fold = _as_invoke(graph, kwargs)
    async for chunk in graph.astream(input, config, **fold.kwargs):
        if not fold.skipped(fold.feed(chunk)):
            on_state(fold.output)
    return fold.output
