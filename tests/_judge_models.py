"""Scripted judge chat models for tests (`{"import": "tests._judge_models:<factory>"}` in a config's judge).

`ranking_judge()`: in group mode it scores attempt i of a group 0.25 * i; its very first reply (of the process's
model instance) is not JSON, so exactly one call is retried; every reply reports 100 input and 20 output tokens.
"""

import json
import re
import threading
from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import PrivateAttr

ATTEMPT = re.compile(r"^Attempt (\d+):$", flags=re.M)
UNUSABLE = "The attempts look fine to me."


class RankingJudge(BaseChatModel):
    """Group mode: attempt i of the group gets 0.25 * i (its reason says so); the first call's reply is unusable."""

    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _calls: int = PrivateAttr(default=0)

    @property
    def _llm_type(self) -> str:
        return "scripted-ranking-judge"

    def _generate(self, messages: list[Any], stop: Any = None, run_manager: Any = None, **kwargs: Any) -> ChatResult:
        with self._lock:
            self._calls += 1
            first = self._calls == 1
        attempts = [int(n) for n in ATTEMPT.findall(str(messages[1].content))]
        text = UNUSABLE if first else json.dumps(
            {f"attempt_{i}": {"reason": f"attempt {i} ranks {i}", "score": 0.25 * i} for i in attempts})
        usage = {"input_tokens": 100, "output_tokens": 20, "total_tokens": 120}
        return ChatResult(generations=[ChatGeneration(message=AIMessage(text, usage_metadata=usage))])


def ranking_judge() -> RankingJudge:
    return RankingJudge()
