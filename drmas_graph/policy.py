"""The Policy interface: prompt token ids + sampling params in, sampled token ids + logprobs out.

Every backend (in-process transformers, vLLM, SGLang) implements `agenerate`; the instrumented graph,
the trainer and the tests depend on this interface only. Chat rendering lives here too, because the
prompt ids a policy sees must be exactly what its own tokenizer and chat template produce.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import threading
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import BaseMessage

from drmas_graph._chat import ParsedResponse, get_tool_parser, normalize_tools, to_chat_dicts, with_system_note
from drmas_graph._structured import instruction
from drmas_graph.config import check_chat_template
from drmas_graph.errors import PolicyError
from drmas_graph.grammar import Grammars, grammar_for
from drmas_graph.types import Generation, SamplingParams

__all__ = ["Policy"]


class Policy(abc.ABC):
    """A trainable chat model behind a tokenizer. Async-first; `generate` is a thin sync wrapper.

    Subclasses set `self.tokenizer` and implement `agenerate`. `version` is the weights version: it
    increases by one with every weight update and is returned with every `Generation`.
    """

    def __init__(self, tokenizer: Any, *, name: str, sampling: SamplingParams | None = None,
                 tool_parser: str = "hermes", chat_template: str | None = None, constrain: bool = True) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.sampling = sampling or SamplingParams()
        self.tool_parser = tool_parser
        self._parse = get_tool_parser(tool_parser)
        if chat_template is not None:
            check_chat_template(chat_template, f"the chat_template of policy {name!r}")
        self.chat_template = chat_template
        """A Jinja chat template rendering this policy's prompts instead of its tokenizer's own (None: the
        tokenizer's), e.g. one that renders `tools`; checked here, so a broken one fails at construction."""
        self.constrain = constrain
        """Decode each call under the grammar of the format it asks for (`drmas_graph.grammar`), where the agent's
        `SamplingParams.constrain` also says so; False: this policy's replies are free text, checked afterwards."""
        self._grammars: Grammars | None = None
        self.version = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, version={self.version})"

    # ---- generation -------------------------------------------------------------------------
    @abc.abstractmethod
    async def agenerate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Sample one response for `prompt_ids`."""

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Blocking `agenerate`, run on this policy's own event loop thread (safe from any thread)."""
        future = asyncio.run_coroutine_threadsafe(self.agenerate(prompt_ids, params), self._background_loop())
        return future.result()

    def _background_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name=f"{self.name}-loop", daemon=True).start()
                self._loop = loop
            return self._loop

    @contextlib.contextmanager
    def updating_weights(self):
        """Context around a weight change: generation is held (where the backend can) and `version` +1 on exit."""
        yield
        self.version += 1

    def announce(self) -> contextlib.AbstractContextManager:
        """Context in which a caller prepares a request; batching backends may wait for it."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Release background resources (threads, connections)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None

    # ---- chat rendering ---------------------------------------------------------------------
    def render(self, messages: Sequence[BaseMessage], tools: Sequence[Any] | None = None,
               response_format: dict | None = None) -> list[int]:
        """Prompt token ids for LangChain messages (and bound tool schemas, and a structured-output request
        as recorded in `Turn.response_format`), generation prompt appended."""
        text = self.render_text(messages, tools, response_format)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render_text(self, messages: Sequence[BaseMessage], tools: Sequence[Any] | None = None,
                    response_format: dict | None = None) -> str:
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise PolicyError(
                f"policy {self.name!r}: its tokenizer has no chat template; pass chat_template=... "
                "to the policy or use an instruct model's tokenizer"
            )
        return self.tokenizer.apply_chat_template(
            with_system_note(to_chat_dicts(messages), instruction(response_format)),
            tools=normalize_tools(tools) or None, chat_template=template, add_generation_prompt=True, tokenize=False,
        )

    def decode(self, token_ids: Sequence[int]) -> str:
        """Response text for sampled ids (special tokens such as end-of-turn skipped)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def parse(self, text: str) -> ParsedResponse:
        """Split generated text into content and tool calls with this policy's tool parser."""
        return self._parse(text)

    # ---- constrained decoding ---------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Rows of the model's logits (the tokenizer's length where the backend knows no more)."""
        return len(self.tokenizer)

    @property
    def grammars(self) -> Grammars:
        """Grammars compiled for this policy's tokenizer, vocabulary and end-of-turn tokens (built on first use)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def grammar_for(self, spec: dict | None, tools: Sequence[dict], kwargs: dict) -> str | None:
        """The grammar a call with this structured-output spec, tools and kwargs is decoded under (None: free text,
        or this policy does not constrain); compiled here, so a format the grammar library refuses fails the call
        (`GrammarError`) before it is queued."""
        if not self.constrain:
            return None
        grammar = grammar_for(spec, tools, kwargs, self.tool_parser, tuple(self.tokenizer.all_special_tokens))
        if grammar is not None:
            self.grammars.compile(grammar)
        return grammar

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end a response: the tokenizer's eos plus the model's generation config."""
        ids = set()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.add(int(eos))
        return tuple(sorted(ids))
