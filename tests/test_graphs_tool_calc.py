"""graphs/tool_calc end to end under instrumentation, on a tiny real model with scripted replies (no SmolLM2):
the worker's OpenAI SDK call becomes a turn whose prompt ids carry the tool schema (the built-in chat template its
train.yaml names, `models.<name>.chat_template: builtin:smollm2-tools`), the tool's result is in the next turn's
prompt, and the reward is computed from the final state. No socket is opened (tests/_no_network.py): nothing leaves
the process."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
from langchain_core.messages import HumanMessage, SystemMessage, convert_to_messages

from drmas_graph import instrument
from drmas_graph.config import load_config, read_chat_template
from drmas_graph.testing import scripted_policy
from graphs.tool_calc.env import ToolCalcEnv, episode_stats
from graphs.tool_calc.graph import EXAMPLE, MULTIPLY_TOOL, SYSTEM_PROMPT, build_graph, parse_answer, run_tool
from tests._no_network import no_network  # noqa: F401 - a fixture

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = read_chat_template("builtin:smollm2-tools")  # what train.yaml's `models.smollm2.chat_template` loads


def _calculator(prompt: str) -> str:
    """Scripted worker: calls multiply on the question's numbers, then copies the tool's result."""
    results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", prompt)
    if len(results) == 2:  # the worked example's result and this question's
        return f"The answer is {results[-1]}."
    a, b = re.findall(r"What is (\d+) \* (\d+)\?", prompt)[-1]
    return f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


def _app(replies):
    policy = scripted_policy(replies, name="worker-model", chat_template=TEMPLATE)
    client = openai.OpenAI(api_key="sk-never-sent", base_url="http://127.0.0.1:9/v1", max_retries=0)
    return policy, instrument(build_graph(client), {"worker": policy}, strict=True)


def test_the_sdk_tool_call_is_two_turns_with_the_tool_in_the_prompts_and_the_reward_is_computed(no_network):
    env = ToolCalcEnv(seed=0, n_train=4, n_test=2)
    task = env.tasks("test")[0]
    a, b = task.meta["a"], task.meta["b"]
    policy, app = _app(_calculator)
    episode = app.rollout(task.input)
    assert [t.agent for t in episode.turns] == ["worker", "worker"]
    first, second = episode.turns
    tool_json = json.dumps(MULTIPLY_TOOL)  # the template's `tojson` (no sorting: the schema's own key order)
    expected_first = (f"<|im_start|>system\n{SYSTEM_PROMPT}\nYou can call these tools:\n<tools>\n{tool_json}\n</tools>\n"
                      "To call a tool, reply with only:\n"
                      '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call><|im_end|>\n'
                      "<|im_start|>user\nWhat is 1234 * 5678?<|im_end|>\n<|im_start|>assistant\n"  # the worked example
                      '<tool_call>{"name": "multiply", "arguments": {"a": 1234, "b": 5678}}</tool_call><|im_end|>\n'
                      "<|im_start|>tool\n7006652<|im_end|>\n<|im_start|>assistant\nThe answer is 7006652.<|im_end|>\n"
                      f"<|im_start|>user\nWhat is {a} * {b}?<|im_end|>\n<|im_start|>assistant\n")
    assert list(first.prompt_ids) == policy.tokenizer.encode(expected_first, add_special_tokens=False)
    example = convert_to_messages(EXAMPLE)
    assert list(first.prompt_ids) == policy.render([SystemMessage(SYSTEM_PROMPT), *example,
                                                    HumanMessage(task.input["question"])], [MULTIPLY_TOOL])
    assert [(c["name"], c["args"]) for c in first.tool_calls] == [("multiply", {"a": a, "b": b})]
    # the second request carries the assistant's tool call and the tool's result, rendered by the same template
    expected_second = (expected_first + f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}'
                       f"</tool_call><|im_end|>\n<|im_start|>tool\n{a * b}<|im_end|>\n<|im_start|>assistant\n")
    assert list(second.prompt_ids) == policy.tokenizer.encode(expected_second, add_special_tokens=False)
    assert second.response_text == f"The answer is {a * b}."
    state = episode.final_state
    assert state["answer"] == task.answer == str(a * b)
    assert state["tool_calls"] == [{"name": "multiply", "arguments": json.dumps({"a": a, "b": b}),
                                    "result": str(a * b)}]
    assert episode_stats(task, state) == {"called": True, "well_formed": True, "right_args": True, "right": True}
    assert env.reward(task, episode) == pytest.approx(1.2) and env.score(task, state) == 1.0
    assert no_network == []
    policy.close()


def test_a_reply_without_a_tool_call_is_the_answer_and_earns_nothing_when_wrong():
    env = ToolCalcEnv(seed=0, n_train=4, n_test=2)
    task = env.tasks("train")[1]
    policy, app = _app(["The answer is 12."])
    episode = app.rollout(task.input)
    assert len(episode.turns) == 1 and episode.turns[0].tool_calls == ()
    assert "<tools>" in policy.tokenizer.decode(list(episode.turns[0].prompt_ids))
    assert episode.final_state["answer"] == "12" and episode.final_state["tool_calls"] == []
    assert env.reward(task, episode) == 0.0
    policy.close()


def test_tool_errors_and_the_answer_parser():
    assert run_tool("multiply", '{"a": 12, "b": 34}') == "408"
    assert run_tool("add", '{"a": 1, "b": 2}') == "error: unknown tool 'add'; the only tool is multiply"
    assert run_tool("multiply", '{"a": "12", "b": 34}') == 'error: multiply takes two integers, {"a": <int>, "b": <int>}'
    assert run_tool("multiply", "a=1") == "error: the arguments are not JSON"
    assert parse_answer("So 2 * 3 = 6. The answer is 1,234.") == "1234"
    assert parse_answer(" 77 ") == "77" and parse_answer("no number here") is None


def test_the_tasks_are_seeded_disjoint_four_digit_products():
    env = ToolCalcEnv(seed=3, n_train=40, n_test=20)
    train, test = env.tasks("train"), env.tasks("test")
    assert len(train) == 40 and len(test) == 20
    assert not {t.input["question"] for t in train} & {t.input["question"] for t in test}
    assert all(1000 <= t.meta["a"] <= 9999 and t.answer == str(t.meta["a"] * t.meta["b"]) for t in train + test)
    assert [t.id for t in ToolCalcEnv(seed=3, n_train=40, n_test=20).tasks("test")] == [t.id for t in test]


def test_the_train_config_loads_with_the_builtin_template():
    cfg = load_config(ROOT / "graphs" / "tool_calc" / "train.yaml")
    assert cfg.models["smollm2"].chat_template == "builtin:smollm2-tools"
    assert cfg.graph == "graphs.tool_calc.graph:build_graph" and list(cfg.agents) == ["worker"]


def test_the_report_sign_test_by_hand():
    from graphs.tool_calc.report import sign_test

    # 3 ups of 4 non-zero changes: P(X >= 3 | n=4, 1/2) = (4 + 1) / 16
    assert sign_test([1.0, 0.5, -0.5, 0.0, 1.0]) == (3, 4, 5 / 16)
    assert sign_test([0.5] * 5) == (5, 5, 1 / 32) and sign_test([0.0, 0.0]) == (0, 0, 1.0)


def test_a_template_that_drops_the_tool_is_refused_in_strict_mode_naming_the_yaml_fix():
    from drmas_graph.errors import RolloutError, StrictModeError

    chatml_without_tools = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                            "<|im_start|>assistant\n")  # like SmolLM2's own template: `tools` is never read
    policy = scripted_policy(["The answer is 1."], name="worker-model", chat_template=chatml_without_tools)
    client = openai.OpenAI(api_key="sk-never-sent", base_url="http://127.0.0.1:9/v1", max_retries=0)
    app = instrument(build_graph(client), {"worker": policy}, strict=True)
    with pytest.raises(RolloutError) as info:
        app.rollout(ToolCalcEnv(seed=0, n_train=1, n_test=1).tasks("test")[0].input)
    cause = info.value.__cause__
    assert isinstance(cause, StrictModeError)
    assert "does not render the bound tool(s) ['multiply']" in str(cause)
    assert "`models.<name>.chat_template: <a template file>`" in str(cause)
    policy.close()
