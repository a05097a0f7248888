"""What the judge reads: a compact, deterministic rendering of a task and its trajectories, and the prompt.

Deterministic (the same episode renders to the same text in every process) because the judge's cache is
keyed by the rendered prompt. A trajectory is one entry per LLM call, `agent (node): reply`, long texts
clipped (head and tail kept: an answer often ends a reply), then the episode's outcome and final output.
An entry's text that spans lines continues on lines indented by `INDENT`, so only an entry's first line
starts at the margin: a reply line such as "reviewer (review): yes" can never pass for another call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import BaseMessage

from drmas_graph._chat import _text
from drmas_graph.types import Episode, Turn

__all__ = ["clip", "render_task", "render_trajectory", "build_prompt", "MODES"]

MODES = ("episode", "group", "agent")
"""The judge's modes: one episode per call, a whole group per call, one score per agent of an episode."""

MAX_INPUT_CHARS = 2000
"""Characters kept of the task input and of the reference answer."""
MAX_REPLY_CHARS = 1200
"""Characters kept of one LLM reply."""
MAX_OUTCOME_CHARS = 600
"""Characters kept of the final output and of an error/truncation message."""
INDENT = "    "
"""What starts each continuation line of a multi-line reply, outcome or final output."""

_ROLES = {"human": "user", "ai": "assistant"}

_INTRO = "You are a judge. You score how well an AI system did a task, following the rubric below."
_TASKS = {
    "episode": "You see the task and one attempt at it (its trajectory: every model call, in order, as "
               "'agent (node): reply', then the outcome). Score the attempt from 0 (useless) to 1 (perfect).",
    "group": "You see the task and {n} attempts at it, numbered 1 to {n} (each a trajectory: every model call, in "
             "order, as 'agent (node): reply', then the outcome). Score each attempt from 0 to 1, relative to the "
             "others: the best attempt gets the highest score, equally good attempts get equal scores, and a "
             "score also says how well the attempt meets the rubric.",
    "agent": "You see the task and one attempt at it by a team of agents (its trajectory: every model call, in "
             "order, as 'agent (node): reply', then the outcome). Score each agent from 0 (useless) to 1 "
             "(perfect), judging the agent on its own replies and on the outcome.",
}
_FORMATS = {
    "episode": '{{"reason": "<one sentence>", "score": <a number from 0 to 1>}}',
    "group": '{{"attempt_1": {{"reason": "<one sentence>", "score": <a number from 0 to 1>}}, ...}} with one entry '
             "for each attempt, attempt_1 to attempt_{n}",
    "agent": '{{"<agent name>": {{"reason": "<one sentence>", "score": <a number from 0 to 1>}}, ...}} with one '
             "entry for each agent: {agents}",
}


def clip(text: str, limit: int) -> str:
    """`text` stripped and, when longer than `limit` characters, its head (2/3) and tail (1/3) with the number
    of characters cut between them."""
    text = text.strip()
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    return f"{text[:head]} [... {len(text) - limit} characters cut ...] {text[len(text) - (limit - head):]}"


def _entry(label: str, text: str) -> str:
    """`label` and `text`, the text's later lines indented (blank ones dropped), so the entry's first line
    is its only line at the margin."""
    lines = [line for line in text.splitlines() if line.strip()] or [""]
    return label + lines[0] + "".join(f"\n{INDENT}{line}" for line in lines[1:])


def _message_line(message: Any) -> str:
    if isinstance(message, BaseMessage):
        return f"{_ROLES.get(message.type, message.type)}: {_text(message.content)}"
    if isinstance(message, Mapping) and "content" in message:
        return f"{message.get('role', 'user')}: {_text(message['content'])}"
    if isinstance(message, (tuple, list)) and len(message) == 2 and isinstance(message[0], str):
        return f"{_ROLES.get(message[0], message[0])}: {_text(message[1])}"
    return _value_text(message)


def _value_text(value: Any) -> str:
    """A graph input/output as text: messages one per line ('role: content'), a mapping as 'key: value'
    lines, a string as is, anything else as sorted JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, BaseMessage):
        return _message_line(value)
    if isinstance(value, Mapping):
        if isinstance(value.get("messages"), (list, tuple)):
            rest = {k: v for k, v in value.items() if k != "messages"}
            lines = [_message_line(m) for m in value["messages"]]
            return "\n".join(lines + ([_value_text(rest)] if rest else []))
        return "\n".join(f"{k}: {_value_text(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, BaseMessage) for m in value):
        return "\n".join(_message_line(m) for m in value)
    return json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)


def render_task(task: Any) -> str:
    """'Task:' and the task's input; 'Reference answer:' when the task has one (`task.answer`)."""
    text = "Task:\n" + clip(_value_text(getattr(task, "input", task)), MAX_INPUT_CHARS)
    answer = getattr(task, "answer", None)
    if answer is not None:
        text += "\nReference answer: " + clip(_value_text(answer), MAX_INPUT_CHARS)
    return text


def _turn_line(turn: Turn) -> str:
    reply = turn.response_text
    for call in turn.tool_calls:
        args = json.dumps(call.get("args", {}), sort_keys=True, default=str, ensure_ascii=False)
        reply += f" [calls tool {call.get('name')}({args})]"
    return _entry(f"{turn.agent} ({turn.node}): ", clip(reply, MAX_REPLY_CHARS))


def _outcome(episode: Episode) -> str:
    kind = episode.outcome
    if kind == "finished":
        return "Outcome: finished"
    why = {"truncated": "stopped early by a limit", "model_error": "the app failed on a malformed model reply",
           "failed": "failed"}[kind]
    return _entry(f"Outcome: {why} (", clip(str(episode.stop_reason), MAX_OUTCOME_CHARS) + ")")


def _final_output(state: Any) -> str | None:
    if state is None:
        return None
    if isinstance(state, Mapping) and isinstance(state.get("messages"), (list, tuple)) and state["messages"]:
        return _message_line(state["messages"][-1])
    return _value_text(state)


def render_trajectory(episode: Episode) -> str:
    """One entry per LLM call ('agent (node): reply', tool calls appended), then the outcome and the final
    output (the last message of a messages state, else the state); an entry's later lines are indented."""
    lines = [_turn_line(t) for t in episode.turns] or ["(no model calls)"]
    lines.append(_outcome(episode))
    final = _final_output(episode.final_state)
    if final is not None:
        lines.append(_entry("Final output: ", clip(final, MAX_OUTCOME_CHARS)))
    return "\n".join(lines)


def build_prompt(mode: str, rubric: str, task: Any, episodes: Sequence[Episode],
                 agents: Sequence[str] = ()) -> list[dict[str, str]]:
    """The judge's prompt as role/content dicts: the instructions, rubric and reply format (system), then the
    task and the trajectories (user). `agents`: the agents to score (agent mode)."""
    n = len(episodes)
    reply = _FORMATS[mode].format(n=n, agents=", ".join(agents))
    system = "\n\n".join([_INTRO, _TASKS[mode].format(n=n), "Rubric:\n" + rubric.strip(),
                          "Give a short reason for each score. Reply with only a JSON object, and no other text, "
                          "of this form: " + reply])
    if mode == "group":
        body = "\n\n".join(f"Attempt {i}:\n{render_trajectory(e)}" for i, e in enumerate(episodes, 1))
    else:
        body = "Attempt:\n" + render_trajectory(episodes[0])
    user = f"{render_task(task)}\n\n{body}"
    if mode == "agent":
        user += "\n\nAgents to score: " + ", ".join(agents)
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
