"""Constrained decoding: the grammar a call's format asks for, and the tokens it allows at each position.

The APIs an app is written for guarantee the formats its calls ask for: OpenAI's JSON mode and structured
outputs, strict tools and a forced `tool_choice`; vLLM and SGLang do the same with a grammar library. A
policy standing in for them decodes under the same guarantee:

- `grammar_for` turns what a call asks for (the `_structured.output_spec` of its kwargs, its tools and its
  `tool_choice`) into an xgrammar *structural tag* (a JSON string): the one description of the constraint that
  is recorded with the turn (`SamplingParams.grammar`), compiled by the embedded engine, sent to a vLLM or SGLang
  server as `structural_tag`, and compiled again by the trainer to rebuild the masks of a recorded response.
- `Grammars` compiles grammars for one tokenizer (cached by their text) and gives a matcher per response: the
  bitmask of the tokens allowed next (`fill`), and `accept(token)` to move on. `masks(grammar, ids)` replays a
  recorded response and returns the bitmask of every position, for the update.
- `mask_logits` sets the logits of disallowed tokens to -inf: the sampler draws from softmax(masked logits / T),
  the recorded logprob is log_softmax(masked logits / T) at the drawn token, and the trainer computes the new
  policy's logprob under the same mask, so the importance ratio and the KL are those of the distributions the
  tokens were drawn from. A token the mask forces (the only one allowed) has logprob exactly 0 under any weights:
  its ratio is 1 and its gradient 0.

What each request becomes (the policy's `tool_parser` gives the tool-call syntax: hermes `<tool_call>{...}
</tool_call>`, mistral `[TOOL_CALLS] [...]`):

| the call asks for | the reply is |
|---|---|
| `response_format` json_object | one JSON object |
| json_schema (Chat Completions, Responses `text.format`, Anthropic `output_config`, `with_structured_output`) | one JSON object valid against the schema |
| a forced tool (`tool_choice` naming one) | the tool's arguments as one JSON object valid against its parameters |
| `tool_choice` required / any, several tools | one or more calls of the bound tools in the tool-call syntax, arguments valid |
| `tool_choice` auto (the default with tools) | free text; once the reply opens a call (the syntax's marker), a valid call |
| `tool_choice` none, with tools | free text that never opens a call |
| nothing (free text, no tools) | no grammar |

Whitespace inside JSON is bounded (`MAX_WHITESPACE` consecutive characters): a small model otherwise pads a JSON
reply with newlines until `max_new_tokens`. The library is xgrammar (docs/guide/structured-output.md: measured
against llguidance and outlines-core on this CPU with SmolLM2's 49k vocabulary, and what vLLM and SGLang use by
default, so a served policy's masks come from the same grammar).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from drmas_graph.errors import GrammarError

__all__ = ["MAX_WHITESPACE", "GrammarError", "Grammars", "Matcher", "grammar_for", "mask_logits", "allowed_tokens",
           "bitmask_width"]

MAX_WHITESPACE = 6
"""Most consecutive whitespace characters between the tokens of a constrained JSON value: room for JSON
pretty-printed two levels deep with a 2-space indent (`"\n    "`), not for a reply padded with whitespace until
`max_new_tokens` (what a small model does when whitespace is free)."""


# ---- what a call asks for, as a structural tag ------------------------------------------------------------


def _json(schema: Any) -> dict:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


def _parameters(tool: dict) -> dict:
    params = tool.get("function", tool).get("parameters") or {}
    return params if params else {"type": "object"}


def _call_schema(tools: Sequence[dict]) -> dict:
    """One tool call, {"name": <a bound tool>, "arguments": <its parameters>}: a schema per tool, any of them."""
    calls = [{"type": "object", "properties": {"name": {"const": t.get("function", t)["name"]},
                                               "arguments": _parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


_SPACE = {"type": "regex", "pattern": "[ \\n]{0,2}"}


def _hermes(tools: Sequence[dict]) -> tuple[str, dict]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one tag per call)."""
    content = {"type": "sequence", "elements": [_SPACE, _json(_call_schema(tools)), _SPACE]}
    return "<tool_call>", {"type": "tag", "begin": "<tool_call>", "content": content, "end": "</tool_call>"}


def _mistral(tools: Sequence[dict]) -> tuple[str, dict]:
    """`[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (one marked list of calls)."""
    content = {"type": "sequence", "elements": [_SPACE, _json({"type": "array", "items": _call_schema(tools),
                                                                "minItems": 1})]}
    return "[TOOL_CALLS]", {"type": "tag", "begin": "[TOOL_CALLS]", "content": content, "end": ""}


TOOL_SYNTAX: dict[str, Callable[[Sequence[dict]], tuple[str, dict]]] = {"hermes": _hermes, "mistral": _mistral}
"""Tool parser -> (the marker that opens a call, the tag of one call) for a list of tools. A parser missing here
(`none`) has no call syntax: its calls are not constrained (a forced single tool still is: bare arguments)."""


def _wrap(fmt: dict) -> str:
    # keys keep their order: a JSON schema's `properties` order is the order the reply writes them in
    return json.dumps({"type": "structural_tag", "format": fmt}, separators=(",", ":"))


def _tool_choice_none(kwargs: dict) -> bool:
    choice = kwargs.get("tool_choice")
    if choice == "none" or (isinstance(choice, dict) and choice.get("type") == "none"):
        return True
    calling = kwargs.get("tool_config")
    calling = calling.get("function_calling_config") if isinstance(calling, dict) else None
    return isinstance(calling, dict) and str(calling.get("mode", "")).upper() == "NONE"


def grammar_for(spec: dict | None, tools: Sequence[dict], kwargs: dict, tool_parser: str,
                special_tokens: Sequence[str] = ()) -> str | None:
    """The structural tag (JSON text) a call is decoded under; None where its reply is free text with no tools.

    `spec` is `_structured.output_spec(kwargs, tools, ...)`'s spec (None for free text), `tools` the call's tool
    schemas (OpenAI function format), `kwargs` its bound kwargs (for `tool_choice`), `tool_parser` the policy's.
    A marker that is one of `special_tokens` (Mistral's `[TOOL_CALLS]`) is matched as that token, not as text.
    """
    kind = spec["type"] if spec else None
    if kind == "json_object":
        return _wrap(_json({"type": "object"}))
    if kind == "json_schema":
        return _wrap(_json(spec["schema"] or {"type": "object"}))
    if kind == "tool":
        return _wrap(_json(spec["schema"] or {"type": "object"}))
    syntax = TOOL_SYNTAX.get(tool_parser)
    if syntax is None or not tools:
        return None
    if kind == "any_tool":
        chosen = [t for t in tools if t.get("function", t).get("name") in spec["names"]]
        marker, tag = _tokenised(*syntax(chosen), special_tokens)
        return _wrap(_triggered(marker, tag, special_tokens, at_least_one=True))
    marker, tag = _tokenised(*syntax(tools), special_tokens)
    if _tool_choice_none(kwargs):
        if marker in special_tokens:
            return _wrap({"type": "any_tokens", "exclude_tokens": [marker]})
        return _wrap({"type": "any_text", "excludes": [marker]})
    return _wrap(_triggered(marker, tag, special_tokens, at_least_one=False))


def _tokenised(marker: str, tag: dict, special_tokens: Sequence[str]) -> tuple[str, dict]:
    if marker in special_tokens:  # a special token never decodes as text: the tag opens with the token itself
        tag = {**tag, "begin": {"type": "token", "token": marker}}
    return marker, tag


def _triggered(marker: str, tag: dict, special_tokens: Sequence[str], *, at_least_one: bool) -> dict:
    if marker in special_tokens:
        return {"type": "token_triggered_tags", "trigger_tokens": [marker], "tags": [tag], "at_least_one": at_least_one}
    return {"type": "triggered_tags", "triggers": [marker], "tags": [tag], "at_least_one": at_least_one}


# ---- compiled grammars and masks -------------------------------------------------------------------------


def bitmask_width(vocab_size: int) -> int:
    """int32 words of one position's bitmask: bit j of word w allows token 32 w + j."""
    return (vocab_size + 31) // 32


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allowed_tokens(bitmask_XW: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool mask [..., V] of allowed tokens from an int32 bitmask [..., W] (on the bitmask's device). Tokens past
    the bitmask's 32 W bits are not allowed: a bitmask sized for the tokenizer masks the padding rows of a model
    whose logits have more (Qwen2.5: 151,936 rows, 151,665 tokens)."""
    shifts = _SHIFTS.get(bitmask_XW.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask_XW.device] = torch.arange(32, dtype=torch.int32, device=bitmask_XW.device)
    allowed = ((bitmask_XW.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., :vocab_size].bool()
    if allowed.shape[-1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[-1]), value=False)
    return allowed


def mask_logits(logits_XV: torch.Tensor, bitmask_XW: torch.Tensor) -> torch.Tensor:
    """`logits_XV` with -inf where the bitmask disallows the token (out of place; rows with every bit set are
    unchanged). Elementwise, so a row's result never depends on the other rows."""
    allowed_XV = allowed_tokens(bitmask_XW.to(logits_XV.device), logits_XV.shape[-1])
    return logits_XV.masked_fill(~allowed_XV, float("-inf"))


class Matcher:
    """Where one response stands in its grammar."""

    def __init__(self, compiled: Any, grammar: str) -> None:
        import xgrammar

        self.grammar = grammar
        self._m = xgrammar.GrammarMatcher(compiled)

    def fill(self, bitmask_BW: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of an int32 CPU bitmask."""
        self._m.fill_next_token_bitmask(bitmask_BW, row)

    def accept(self, token: int) -> bool:
        """Move past `token`; False (and no move) when the grammar does not allow it."""
        return bool(self._m.accept_token(int(token)))

    @property
    def done(self) -> bool:
        """Whether the grammar has ended (a stop token was accepted where the reply may end)."""
        return bool(self._m.is_terminated())


class Grammars:
    """Compiled grammars for one tokenizer and vocabulary (the model's logits may have more rows than the
    tokenizer has tokens: those are never allowed). Compiles once per grammar text; safe from any thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = tuple(int(t) for t in stop_ids)
        self._compiler: Any = None  # built at the first compile (reading the vocabulary takes 0.1-1 s)
        self._lock = threading.Lock()

    def compile(self, grammar: str) -> Any:
        """The compiled grammar (cached by its text); `GrammarError` when the library refuses it."""
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=list(self.stop_ids))
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            try:
                return self._compiler.compile_structural_tag(grammar)
            except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses
                raise GrammarError(f"the call's format cannot be decoded under a grammar ({type(exc).__name__}: "
                                   f"{exc}); turn constrained decoding off for its agent (agents.<agent>.constrain: "
                                   f"false) or model (models.<name>.constrain: false); grammar: {grammar[:300]}"
                                   ) from exc

    def matcher(self, grammar: str) -> Matcher:
        return Matcher(self.compile(grammar), grammar)

    def bitmask(self, rows: int) -> torch.Tensor:
        """A CPU int32 bitmask of `rows` positions, every token allowed."""
        return torch.full((rows, bitmask_width(self.vocab_size)), -1, dtype=torch.int32)

    def masks(self, grammar: str, token_ids: Sequence[int]) -> torch.Tensor:
        """The bitmask [T, W] of the tokens allowed at each position of a recorded response: the masks it was
        sampled under. Raises `GrammarError` naming the position where a token is not allowed (the response
        was not decoded under this grammar)."""
        m = self.matcher(grammar)
        out = self.bitmask(len(token_ids))
        for t, token in enumerate(token_ids):
            m.fill(out, t)
            if not m.accept(token):
                raise GrammarError(f"token {int(token)} at position {t} of the response is not allowed by its "
                                   f"grammar: the response was not decoded under it; grammar: {grammar[:300]}")
        return out
