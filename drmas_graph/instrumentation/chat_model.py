"""`PolicyChatModel`: a LangChain chat model backed by a drmas_graph Policy.

Use it to run a graph outside training with a trained checkpoint, or as the stand-in model a graph
factory receives when `drmas-graph train` builds the graph (inside an instrumented run every call is
served by the agent's policy anyway).
"""

from __future__ import annotations

from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict

from drmas_graph._chat import ParsedResponse, normalize_tools
from drmas_graph.instrumentation._recorder import RAW_BRANCH_TAG, _cut_at_stop
from drmas_graph._structured import InvalidReplyError, apply_spec, output_spec
from drmas_graph.policy import Policy

__all__ = ["PolicyChatModel"]


class PolicyChatModel(BaseChatModel):
    """Chat model whose answers come from `policy` (its chat template, sampling and tool parser)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    policy: Policy

    @property
    def _llm_type(self) -> str:
        return "drmas-policy"

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

    def _generate(self, messages, stop=None, run_manager=None, **kwargs: Any) -> ChatResult:
        params = self.policy.sampling
        if stop:
            params = params.replace(stop=tuple(params.stop) + tuple(stop))
        tools = normalize_tools(kwargs.get("tools"))
        where = f"PolicyChatModel(policy {self.policy.name!r})"
        spec, model_class = output_spec(kwargs, tools, where)  # with_structured_output / tool_choice
        prompt_ids = self.policy.render(messages, tools, spec)
        gen = self.policy.generate(prompt_ids, params)
        text = _cut_at_stop(self.policy.decode(gen.token_ids), params.stop)
        parsed, extra = self.policy.parse(text), {}
        if spec is not None:
            try:
                parsed, extra = apply_spec(spec, model_class, text, self.policy.parse, where)
            except InvalidReplyError:  # include_raw=True: LangChain's parser reports it as parsing_error
                if RAW_BRANCH_TAG not in (getattr(run_manager, "tags", None) or ()):
                    raise
                parsed = ParsedResponse(content=text.strip())
        finish = "tool_calls" if parsed.tool_calls and gen.finish_reason == "stop" else gen.finish_reason
        message = AIMessage(content=parsed.content, tool_calls=parsed.tool_calls,
                            invalid_tool_calls=parsed.invalid_tool_calls, additional_kwargs=extra,
                            response_metadata={"finish_reason": finish, "model_name": self.policy.name})
        return ChatResult(generations=[ChatGeneration(message=message)])
