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
    temperature: float | None = None
    """Sampling temperature of every call (0 = greedy); None = the policy's own `sampling`."""
    max_tokens: int | None = None
    """Most tokens of a reply; None = the policy's own `sampling.max_new_tokens`."""
    seed: int | None = None
    """Sampler seed of every call; None = the policy's own."""

    def _sampling(self, stop: list[str] | None) -> Any:
        changes = {k: v for k, v in (("temperature", self.temperature), ("max_new_tokens", self.max_tokens),
                                     ("seed", self.seed)) if v is not None}
        if stop:
            changes["stop"] = tuple(self.policy.sampling.stop) + tuple(stop)
        return self.policy.sampling.replace(**changes)

    @property
    def _llm_type(self) -> str:
        return "drmas-policy"

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

    def _generate(self, messages, stop=None, run_manager=None, **kwargs: Any) -> ChatResult:
        params = self._sampling(stop)
        tools = normalize_tools(kwargs.get("tools"))
        where = f"PolicyChatModel(policy {self.policy.name!r})"
        spec, model_class = output_spec(kwargs, tools, where)  # with_structured_output / tool_choice
        prompt_ids = self.policy.render(messages, tools, spec)
        if params.constrain:  # decoded under the format it asks for (`drmas_graph.grammar`)
            params = params.replace(grammar=self.policy.grammar_for(spec, tools, kwargs))
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
                            response_metadata={"finish_reason": finish, "model_name": self.policy.name},
                            usage_metadata={"input_tokens": len(prompt_ids), "output_tokens": len(gen.token_ids),
                                            "total_tokens": len(prompt_ids) + len(gen.token_ids)})
        return ChatResult(generations=[ChatGeneration(message=message)])
