"""Demonstrations for the calculator team's warm start: OpenAI fine-tuning JSONL, written from the task generator.

``python -m graphs.calc_team.demos`` (re)writes ``graphs/calc_team/demos.jsonl``: 32 records, one JSON object per
line in OpenAI's chat fine-tuning format (``{"messages": [...], "tools": [...]}``, an assistant tool call as
``tool_calls`` with ``arguments`` a JSON string and ``content`` null, its result a ``role: "tool"`` message with
the call's id):

- 20 for the ``worker`` (the first 20 tasks of the ``train`` split of ``CalcTeamEnv(seed=1)``, train.yaml's
  tasks): the app's system prompt and user message (the problem and the plan ``Calculate <gold expression>.``),
  the assistant's ``calculator`` call of the gold expression, the tool's result, and ``The answer is <n>.``;
  ``tools`` is ``[CALCULATOR_TOOL]``.
- 12 for the ``critic`` (train tasks 20 to 31): the app's system prompt and user message, the reply
  ``{"correct": true}`` or ``{"correct": false}``; alternately a right answer and a wrong one (the calculator's
  result with a digit changed, or no calculator call and a wrong answer).

Two optional keys beside OpenAI's: ``"agent"``, the agent a record teaches (so one file serves every agent: the
warm start's ``warm_start.demonstrations: <file>``), and on the critic's records ``"response_format": {"type":
"json_object"}``, what the app's request asks for (so the warm start renders the prompt with the same JSON-mode
note the policy adds at rollout). `agent_of` checks the ``"agent"`` key against the system prompt that opens the
record. No record is from the ``test`` split, so the held-out evaluation never sees a demonstrated task. The
planner has no demonstrations (its reply is free text; it learns from the team's reward).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from graphs.calc_team.env import CalcTeamEnv
from graphs.calc_team.graph import (CALCULATOR_TOOL, CRITIC_PROMPT, PLANNER_PROMPT, WORKER_PROMPT, calculate,
                                    critic_user, worker_user)
from graphs.task import Task

__all__ = ["DEMOS", "N_CRITIC", "N_WORKER", "SEED", "agent_of", "critic_record", "records", "worker_record", "write"]

DEMOS = Path(__file__).resolve().parent / "demos.jsonl"
"""The committed demonstrations file."""
SEED = 1
"""The task generator's seed: train.yaml's ``env_kwargs.seed``."""
N_WORKER = 20
"""Worker records (train tasks 0..19)."""
N_CRITIC = 12
"""Critic records (train tasks 20..31)."""
_PROMPTS = {PLANNER_PROMPT: "planner", WORKER_PROMPT: "worker", CRITIC_PROMPT: "critic"}


def worker_record(task: Task, index: int) -> dict[str, Any]:
    """One worker demonstration: the call of the gold expression, its result and the answer."""
    expression = task.meta["expression"]
    call_id = f"call_{index}"
    return {"agent": "worker", "messages": [
        {"role": "system", "content": WORKER_PROMPT},
        {"role": "user", "content": worker_user(task.input["question"], f"Calculate {expression}.")},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
            "name": "calculator", "arguments": json.dumps({"expression": expression})}}]},
        {"role": "tool", "tool_call_id": call_id, "content": calculate(expression)},
        {"role": "assistant", "content": f"The answer is {task.answer}."},
    ], "tools": [CALCULATOR_TOOL]}


def _wrong(answer: str, index: int) -> str:
    """`answer` with one digit changed (which digit and by how much depend on `index`)."""
    digits = list(answer)
    position = index % len(digits)
    digits[position] = str((int(digits[position]) + 1 + index % 7) % 10)
    if digits[0] == "0":
        digits[0] = "1"
    return "".join(digits) if "".join(digits) != answer else str(int(answer) + 10)


def critic_record(task: Task, index: int) -> dict[str, Any]:
    """One critic demonstration: even `index` a right answer after the calculator's result (``true``), odd a wrong
    one (``false``): the result with a digit changed (index % 4 == 1) or no call and a wrong answer (== 3)."""
    expression, answer = task.meta["expression"], task.answer
    call = {"arguments": json.dumps({"expression": expression}), "result": calculate(expression)}
    if index % 2 == 0:
        calls, proposed, correct = [call], answer, True
    elif index % 4 == 1:
        calls, proposed, correct = [call], _wrong(answer, index), False
    else:
        calls, proposed, correct = [], _wrong(answer, index), False
    return {"agent": "critic", "messages": [
        {"role": "system", "content": CRITIC_PROMPT},
        {"role": "user", "content": critic_user(task.input["question"], calls, proposed)},
        {"role": "assistant", "content": json.dumps({"correct": correct})},
    ], "response_format": {"type": "json_object"}}


def records(env: CalcTeamEnv | None = None) -> list[dict[str, Any]]:
    """The demonstrations, worker records first, from `env`'s train split (default ``CalcTeamEnv(seed=SEED)``,
    train.yaml's tasks)."""
    train = (env or CalcTeamEnv(seed=SEED)).tasks("train")
    if len(train) < N_WORKER + N_CRITIC:
        raise ValueError(f"the demonstrations need {N_WORKER + N_CRITIC} train tasks; the env has {len(train)}")
    return ([worker_record(t, i) for i, t in enumerate(train[:N_WORKER])]
            + [critic_record(t, i) for i, t in enumerate(train[N_WORKER:N_WORKER + N_CRITIC])])


def agent_of(record: dict[str, Any]) -> str:
    """The agent a record demonstrates: its ``"agent"`` key, which must be the agent whose system prompt opens it;
    ValueError otherwise."""
    system = record["messages"][0]
    if system.get("role") != "system" or system.get("content") not in _PROMPTS:
        raise ValueError(f"record does not open with a calc_team system prompt: {str(system)[:80]!r}")
    opens = _PROMPTS[system["content"]]
    if record.get("agent") != opens:
        raise ValueError(f"record names agent {record.get('agent')!r} but opens with the {opens}'s system prompt")
    return record["agent"]


def write(path: Path = DEMOS) -> int:
    """Write `records()` to `path`, one JSON object per line; the number written."""
    rows = records()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEMOS, help=f"output file (default {DEMOS})")
    args = parser.parse_args(argv)
    print(f"wrote {write(args.out)} records to {args.out}")


if __name__ == "__main__":
    main()
