"""The judge's contract as docs/guide/judge.md writes it down ("Contract"): every example there is what the code
produces. The prompts are `build_prompt`'s for one helpdesk task (each mode); the request is the body a served
judge (`ChatOpenAI`, as `{base_url, model}` builds it) sends, caught by an httpx mock transport; the replies
are the ones that mock server answers, parsed into the scores the doc states.

`python -m tests.test_judge_contract` prints the doc's blocks, to paste after a deliberate change.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx

from drmas_graph.env import Task
from drmas_graph.rewards import Judge, JudgementRecord
from drmas_graph.rewards._render import build_prompt
from drmas_graph.types import Episode, SamplingParams, Turn

DOC = Path(__file__).resolve().parents[1] / "docs" / "guide" / "judge.md"
RUBRIC = ("Score each reply from 0 to 1 for the customer: 1 when it says the same as the reference answer, short "
          "and polite; 0 when it contradicts the reference answer or does not answer the question.")
QUESTION = "Can I return a trowel 10 days after delivery?"
TASK = Task(id="e01", input={"messages": [{"role": "user", "content": QUESTION}]},
            answer="Yes, within 30 days of delivery with the receipt.")
ATTEMPTS = [  # (drafter's reply, reviewer's reply): the first drafter reply spans two lines
    ("Yes. Our policy says:\nReturns are accepted within 30 days of delivery with the receipt.",
     "Yes, you can return it within 30 days of delivery with your receipt."),
    ("No, returns are not possible after delivery.", "Sorry, tools cannot be returned once they are delivered."),
]
REPLIES = {  # what the served judge answers, per mode (episode and agent mode: the first attempt)
    "episode": {"reason": "It says what the reference answer says, politely.", "score": 1.0},
    "group": {"attempt_1": {"reason": "Matches the reference: returns within 30 days with the receipt.",
                            "score": 1.0},
              "attempt_2": {"reason": "Contradicts the reference: it refuses a return the policy allows.",
                            "score": 0.0}},
    "agent": {"drafter": {"reason": "Right answer, quoting the policy.", "score": 0.8},
              "reviewer": {"reason": "Right, short and polite.", "score": 1.0}},
}
REWARDS = {"episode": [1.0], "group": [1.0, 0.0], "agent": [{"drafter": 0.8, "reviewer": 1.0}]}


def _turn(agent: str, index: int, text: str) -> Turn:
    return Turn(agent=agent, node=agent, step=index + 1, index=index, messages=(), prompt_ids=(1,),
                response_ids=(2,), response_logprobs=(-0.1,), response_text=text, sampling=SamplingParams())


def episodes() -> list[Episode]:
    """The helpdesk graph's episodes for the two attempts: drafter, then reviewer, whose reply ends the chat."""
    from langchain_core.messages import AIMessage, HumanMessage

    return [Episode(id=f"ep{i}", task_id=TASK.id, group_id="g0", input=TASK.input,
                    turns=[_turn("drafter", 0, draft), _turn("reviewer", 1, reply)],
                    final_state={"messages": [HumanMessage(QUESTION), AIMessage(reply)], "draft": draft,
                                 "reply": reply})
            for i, (draft, reply) in enumerate(ATTEMPTS)]


def _served_judge(mode: str, bodies: list[dict]) -> Judge:
    """A `{base_url, model}` judge (ChatOpenAI) whose server is an httpx mock: it keeps each request's body and
    answers with REPLIES[mode]."""
    from langchain_openai import ChatOpenAI

    def server(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        message = {"role": "assistant", "content": json.dumps(REPLIES[mode])}
        return httpx.Response(200, json={"id": "c1", "object": "chat.completion", "created": 0, "model": "judge",
                                         "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                                         "usage": {"prompt_tokens": 900, "completion_tokens": 60,
                                                   "total_tokens": 960}})

    model = ChatOpenAI(base_url="http://127.0.0.1:8000/v1", model="Qwen/Qwen2.5-7B-Instruct", api_key="EMPTY",
                       max_retries=0,
                       http_client=httpx.Client(transport=httpx.MockTransport(server)))
    return Judge(model, RUBRIC, mode=mode)


def contract_blocks() -> dict[str, str]:
    """The doc's blocks by name: '<mode> system' and '<mode> user' (the prompt), 'group request' (the body, the
    messages' contents elided), '<mode> reply'."""
    eps = episodes()
    blocks: dict[str, str] = {}
    for mode in ("episode", "group", "agent"):
        unit = eps if mode == "group" else eps[:1]
        system, user = build_prompt(mode, RUBRIC, TASK, unit, tuple(eps[0].agents) if mode == "agent" else ())
        blocks[f"{mode} system"], blocks[f"{mode} user"] = system["content"], user["content"]
        blocks[f"{mode} reply"] = json.dumps(REPLIES[mode], indent=2)
    bodies: list[dict] = []
    _served_judge("group", bodies).judge_group(TASK, eps)
    body = bodies[0]
    for message in body["messages"]:
        message["content"] = f"<the {message['role']} message above>"
    blocks["group request"] = json.dumps(body, indent=2)
    return blocks


_BLOCK = re.compile(r"<!-- contract: (\w+ \w+) -->\n```\w+\n(.*?)\n```", re.S)


def test_the_docs_contract_examples_are_what_the_code_sends():
    doc = dict(_BLOCK.findall(DOC.read_text()))
    want = contract_blocks()
    for name, text in want.items():
        assert doc.get(name) == text, f"docs/guide/judge.md's block '{name}' should be:\n{text}"
    assert sorted(doc) == sorted(want)


def test_a_served_judge_request_and_its_replies_per_mode():
    """What the doc states of the request (a json_schema response format with strict false, max_completion_tokens,
    temperature and seed, the prompt's two messages) and of the reply per mode (the scores it gives)."""
    from drmas_graph.rewards._schema import group_keys

    eps = episodes()
    for mode in ("episode", "group", "agent"):
        bodies: list[dict[str, Any]] = []
        unit = eps if mode == "group" else eps[:1]
        judgements = _served_judge(mode, bodies).judge_group(TASK, unit)
        assert [j.reward for j in judgements] == REWARDS[mode] and len(bodies) == 1
        assert all(list(j.record) == list(JudgementRecord.__annotations__) for j in judgements)  # the API reference
        body = bodies[0]
        fmt = body["response_format"]
        assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is False
        assert (body["max_completion_tokens"], body["temperature"], body["seed"]) == (512, 0.0, 0)
        assert "max_tokens" not in body and [m["role"] for m in body["messages"]] == ["system", "user"]
        assert body["messages"] == build_prompt(mode, RUBRIC, TASK, unit, ("drafter", "reviewer")
                                                if mode == "agent" else ())
        keys = {"episode": None, "group": group_keys(2), "agent": ["drafter", "reviewer"]}[mode]
        schema = fmt["json_schema"]["schema"]
        if keys is None:
            assert schema["required"] == ["reason", "score"]
        else:
            assert schema["required"] == keys and schema["additionalProperties"] is False


if __name__ == "__main__":
    for name, text in contract_blocks().items():
        language = "json" if name.endswith(("request", "reply")) else "text"
        print(f"<!-- contract: {name} -->\n```{language}\n{text}\n```\n")
