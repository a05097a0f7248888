"""The answer a recorded call gave, rebuilt for replay: the message the node received when the episode was
recorded, from the `Turn` (its reply read again by the tool parser that read it then)."""

from __future__ import annotations

import json

from collections.abc import Callable
from typing import Any

from langchain_core.outputs import ChatGeneration, ChatResult

from drmas_graph._chat import TOOL_PARSERS, ParsedResponse, get_tool_parser
from drmas_graph._structured import InvalidReplyError
from drmas_graph.errors import ConfigError
from drmas_graph.instrumentation.instrumented import served_message, structured_parts
from drmas_graph.instrumentation.replaying import RAW_BRANCH_TAG, CallSite, cut_at_stop, stop_hit
from drmas_graph.types import Turn

__all__ = ["recorded_answer"]


def recorded_answer(turn: Turn, site: CallSite) -> ChatResult:
    """Rebuild the AIMessage the node received when the episode was recorded (the reply read by the policy's
    tool parser, `_tool_parser`); for structured output the same answer, or the same error, again
    (`_recorder._served`)."""
    stops = turn.sampling.stop if turn.sampling else ()
    text = cut_at_stop(turn.response_text, stops)
    content, invalid = turn.response_text, []
    if turn.trainable:
        parse = _tool_parser(turn, text)
        parsed = parse(text)
        content, invalid = parsed.content, parsed.invalid_tool_calls
    answer = ParsedResponse(content=content, tool_calls=[dict(c) for c in turn.tool_calls], invalid_tool_calls=invalid)
    extra: dict = {}
    if turn.trainable and turn.response_format:
        try:
            answer, extra = structured_parts(turn, parse)
        except InvalidReplyError as failure:
            failure.turn_index = turn.index  # names the turn, as the recorder's error did
            if RAW_BRANCH_TAG not in site.tags:
                raise
            answer = ParsedResponse(content=text.strip())  # include_raw=True: LangChain reports a parsing_error
    message = served_message(answer, finish=turn.finish_reason, policy_name=turn.policy,
                             policy_version=turn.policy_version, agent=turn.agent, index=turn.index,
                             n_prompt=len(turn.prompt_ids), n_response=len(turn.response_ids),
                             message_id=turn.message_id, additional_kwargs=extra)
    info = None  # the recorder's (`_recorder._served`): the reply as generated, the stop string it ended at
    if turn.trainable:
        info = {"text": text, "stop_sequence": stop_hit(turn.response_text, stops)}
    return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])


def _tool_parser(turn: Turn, text: str) -> Callable[[str], ParsedResponse]:
    """The tool parser that read the turn's reply (`text`, cut at its stop strings): `Turn.tool_parser`. A turn
    from a store that predates that field is read with Hermes (the default parser, the one replay always
    used), unless Hermes does not find the tool calls the turn recorded and another parser does: then with
    the first such parser of `TOOL_PARSERS` (a Mistral policy's calls)."""
    if turn.tool_parser is not None:
        if turn.tool_parser not in TOOL_PARSERS:
            raise ConfigError(f"turn {turn.index} (agent {turn.agent!r}, node {turn.node!r}) was read with tool parser "
                              f"{turn.tool_parser!r}, which this version of drmas-graph lacks (it has "
                              f"{sorted(TOOL_PARSERS)}); replay it with the version that recorded it")
        return get_tool_parser(turn.tool_parser)
    recorded = [_what(c) for c in turn.tool_calls]
    for name in ("hermes", *(n for n in TOOL_PARSERS if n != "hermes")):
        found = [_what(c) for c in TOOL_PARSERS[name](text).tool_calls]
        if all(call in found for call in recorded):
            return TOOL_PARSERS[name]
    return TOOL_PARSERS["hermes"]


def _what(call: dict) -> tuple[Any, str]:
    """A tool call's name and arguments: what a parser finds, without the id (the recorder makes ids unique in the
    episode from more than the reply: `_chat.EpisodeCallIds`)."""
    return call.get("name"), json.dumps(call.get("args"), sort_keys=True, default=str)
