"""Scripted judge chat models for tests (`{"import": "tests._judge_models:<factory>"}` in a config's judge).

`ranking_judge()`: in group mode it scores attempt i of a group 0.25 * i; its very first reply (of the process's
model instance) is not JSON, so exactly one call is retried; every reply reports 100 input and 20 output tokens.

`flaky_judge()`: scores like `ranking_judge` (every reply usable), except on the tasks whose text (the prompt's
"Task:" block) has a CRC-32 of 1 modulo 4 (about a quarter): there every call raises TimeoutError, as a judge
server that times out on some tasks, so their episodes are never judged (the same tasks in every process;
graphs/helpdesk: 3 of its 8 test tasks, 6 of its 24 training tasks).
"""

import json
import re
import threading
import zlib
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


def task_fails(prompt: str) -> bool:
    """Whether `flaky_judge` fails on the task of this user message: its "Task:" block's CRC-32 is 1 modulo 4."""
    return zlib.crc32(prompt.split("\n\nAttempt")[0].encode()) % 4 == 1


class FlakyJudge(BaseChatModel):
    """Group mode: attempt i gets 0.25 * i; on the tasks `task_fails` picks every call raises TimeoutError."""

    @property
    def _llm_type(self) -> str:
        return "scripted-flaky-judge"

    def _generate(self, messages: list[Any], stop: Any = None, run_manager: Any = None, **kwargs: Any) -> ChatResult:
        prompt = str(messages[1].content)
        if task_fails(prompt):
            raise TimeoutError("the judge server did not answer in time (scripted)")
        attempts = [int(n) for n in ATTEMPT.findall(prompt)]
        text = json.dumps({f"attempt_{i}": {"reason": f"attempt {i} ranks {i}", "score": 0.25 * i} for i in attempts})
        usage = {"input_tokens": 100, "output_tokens": 20, "total_tokens": 120}
        return ChatResult(generations=[ChatGeneration(message=AIMessage(text, usage_metadata=usage))])


def flaky_judge() -> FlakyJudge:
    return FlakyJudge()
