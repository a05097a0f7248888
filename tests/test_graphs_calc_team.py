"""graphs/calc_team end to end under instrumentation, on a tiny real model with scripted replies (no SmolLM2): the
planner, the worker's OpenAI SDK tool loop and the critic's JSON-mode call are each a turn of their own agent, the
calculator runs on the call the reply made and its result is in the next prompt, the critic's JSON is parsed into
the verdict, and the reward per agent is computed from the final state; the demonstrations file is valid OpenAI
fine-tuning JSONL whose tool calls the policy's parser reads back; the report counts format and skill apart; the
study runner (benchmarks/learning/calc_team.py) stops before any run while the warm start is missing, and its
pre-registered tests match hand-computed sign tests. No socket is opened (tests/_no_network.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from langchain_core.messages import convert_to_messages

from drmas_graph import instrument
from drmas_graph.config import load_config, read_chat_template
from drmas_graph.errors import RolloutError
from drmas_graph.testing import scripted_policy
from drmas_graph.traces.store import TraceStore
from graphs.calc_team import demos
from graphs.calc_team.env import CalcTeamEnv, episode_stats
from graphs.calc_team.graph import (CALCULATOR_TOOL, CRITIC_PROMPT, PLANNER_PROMPT, WORKER_PROMPT, build_graph,
                                    calculate, parse_answer, parse_verdict, run_tool)
from graphs.calc_team.report import eval_numbers
from tests._no_network import no_network  # noqa: F401 - a fixture

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = read_chat_template("builtin:smollm2-tools")  # what train.yaml's `models.smollm2.chat_template` loads
ENV = CalcTeamEnv(seed=0, n_train=32, n_test=4)


def _call(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def _team(task, *, worker=None, critic=('{"correct": true}',)):
    """Scripted team, told apart by the system prompt: the planner names the gold calculation; the worker calls the
    calculator on it (or replies `worker[i]` on its i-th opening reply) and then copies the tool's last result;
    the critic replies `critic[i]` on its i-th call. `seen` keeps each agent's prompts."""
    expression = task.meta["expression"]
    seen = {"planner": [], "worker": [], "critic": []}

    def reply(prompt: str) -> str:
        agent = next(a for a, p in (("planner", PLANNER_PROMPT), ("worker", WORKER_PROMPT), ("critic", CRITIC_PROMPT))
                     if prompt.startswith(f"<|im_start|>system\n{p}"))
        seen[agent].append(prompt)
        if agent == "planner":
            return f"Calculate {expression}."
        if agent == "critic":
            return critic[len(seen["critic"]) - 1]
        results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", prompt)
        if results:
            return f"The answer is {results[-1]}."
        opening = sum("<|im_start|>tool" not in p for p in seen["worker"]) - 1  # this opening reply's position
        scripted = worker[opening] if worker and opening < len(worker) else None
        return scripted if scripted is not None else _call(expression)

    return reply, seen


def _app(reply, **kwargs):
    policy = scripted_policy(reply, name="team-model", chat_template=TEMPLATE, **kwargs)
    client = openai.OpenAI(api_key="sk-never-sent", base_url="http://127.0.0.1:9/v1", max_retries=0)
    return policy, instrument(build_graph(client), {a: policy for a in ENV.agents}, strict=True)


def test_every_agent_is_a_turn_the_tool_loop_runs_the_calculator_and_the_critic_json_is_the_verdict(no_network):
    task = next(t for t in ENV.tasks("test") if t.meta["kind"] == "two_step")
    expression, answer = task.meta["expression"], task.answer
    reply, seen = _team(task)
    policy, app = _app(reply, constrain=True)  # the default: every reply decoded under its call's grammar
    episode = app.rollout(task.input)
    assert [t.agent for t in episode.turns] == ["planner", "worker", "worker", "critic"]
    assert {t.node for t in episode.turns} == {"planner", "worker", "critic"} and no_network == []
    planner, call, final, critic = episode.turns
    assert planner.tools == () and planner.sampling.grammar is None
    assert [t["function"]["name"] for t in call.tools] == ["calculator"]
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [("calculator", {"expression": expression})]
    assert '"triggers":["<tool_call>"]' in call.sampling.grammar  # tool_choice="auto": free text or a valid call
    # the tool loop: the assistant's call and the calculator's result are in the worker's second prompt
    assert seen["worker"][1].endswith(f"{_call(expression)}<|im_end|>\n<|im_start|>tool\n{answer}<|im_end|>\n"
                                      "<|im_start|>assistant\n")
    assert final.response_text == f"The answer is {answer}."
    assert critic.response_format == {"type": "json_object"}
    assert '"json_schema":{"type":"object"}' in critic.sampling.grammar  # JSON mode: any JSON object
    assert seen["critic"][0].endswith(f"Problem: {task.input['question']}\nCalculator: {expression} = {answer}\n"
                                      f"Proposed answer: {answer}<|im_end|>\n<|im_start|>assistant\n")
    # a critic demonstration, rendered with its response_format, has the system block the critic sees at rollout
    demo = demos.records()[demos.N_WORKER]
    system = policy.render_text(convert_to_messages(demo["messages"][:1]), None, demo["response_format"])
    assert "JSON object" in system and seen["critic"][0].startswith(system.removesuffix("<|im_start|>assistant\n"))
    state = episode.final_state
    assert state["plan"] == f"Calculate {expression}." and state["answer"] == answer and state["verdict"] is True
    assert [(c["round"], c["name"], json.loads(c["arguments"]), c["result"]) for c in state["tool_calls"]] == [
        (1, "calculator", {"expression": expression}, answer)]
    assert ENV.reward(task, episode) == {"planner": 1.0, "worker": pytest.approx(1.2), "critic": 1.0}
    policy.close()


def test_a_reject_sends_the_worker_back_with_the_rejected_answer_and_the_critic_is_paid_per_verdict():
    task = next(t for t in ENV.tasks("test") if t.meta["kind"] == "mul")
    reply, seen = _team(task, worker=["The answer is 5.", None], critic=['{"correct": false}', '{"correct": true}'])
    policy, app = _app(reply)
    episode = app.rollout(task.input)
    assert [t.agent for t in episode.turns] == ["planner", "worker", "critic", "worker", "worker", "critic"]
    assert "Proposed answer: 5<|im_end|>" in seen["critic"][0] and "Calculator: (none)" in seen["critic"][0]
    assert f"A critic said the answer 5 is wrong. Try again.<|im_end|>" in seen["worker"][1]
    state = episode.final_state
    assert state["rounds"] == 2 and state["answer"] == task.answer and state["verdict"] is True
    assert episode_stats(task, state)["verdicts"] == [(False, False), (True, True)]
    assert ENV.reward(task, episode) == {"planner": 1.0, "worker": pytest.approx(1.2), "critic": 1.0}
    policy.close()


def test_without_constraints_a_critic_reply_that_is_not_json_breaks_the_episode_on_the_critic_turn():
    task = ENV.tasks("test")[0]
    reply, _ = _team(task, critic=["Yes, the answer is right."])
    policy, app = _app(reply, constrain=False)
    with pytest.raises(RolloutError) as info:
        app.rollout(task.input)
    episode = info.value.episode
    assert episode.outcome == "model_error" and episode.model_error_turn == 3
    assert episode.turns[3].agent == "critic" and "JSON" in episode.turns[3].format_error
    policy.close()


def _episode(state):
    return SimpleNamespace(final_state=state)


def _state(answer, *, calls=(), critic=(), plan="Calculate it."):
    """`calls`: (name, expression, result) per calculator call."""
    return {"plan": plan, "answer": answer,
            "tool_calls": [{"round": 1, "name": n, "arguments": json.dumps({"expression": x}), "result": r}
                           for n, x, r in calls],
            "transcript": [{"agent": "critic", "round": i + 1, "text": text, "answer": judged}
                           for i, (judged, text) in enumerate(critic)]}


def test_the_reward_per_agent_on_hand_made_episodes():
    task = ENV.tasks("test")[0]
    right, wrong = task.answer, str(int(task.answer) + 1)
    yes, no = '{"correct": true}', '{"correct": false}'
    expression = task.meta["expression"]  # e.g. "38 * 43"
    # right with a call on the task's numbers, approved: everyone paid, the worker's call bonus too
    assert ENV.reward(task, _episode(_state(right, calls=[("calculator", expression, right)],
                                            critic=[(right, yes)]))) == {
        "planner": 1.0, "worker": pytest.approx(1.2), "critic": 1.0}
    # a call on the task's numbers with the wrong operation still earns the bonus; a call of a bare guess, or one
    # missing a number, or one the calculator refused does not
    a, b = expression.split(" * ")[:2] if " * " in expression else expression.split(" + ")[:2]
    for call, bonus in (((f"{a} + {b}", "1"), 0.2), ((wrong, wrong), 0.0), ((a, a), 0.0),
                        ((f"{a} ** {b}", "error: the calculator takes numbers, + - * / and parentheses"), 0.0)):
        state = _state(wrong, calls=[("calculator", *call)], critic=[(wrong, yes)])
        assert ENV.reward(task, _episode(state)) == {"planner": 0.0, "worker": pytest.approx(bonus), "critic": 0.0}
    # wrong rejected (right verdict), then right rejected (wrong verdict): the critic gets 1 of 2
    assert ENV.reward(task, _episode(_state(right, critic=[(wrong, no), (right, no)]))) == {
        "planner": 1.0, "worker": 1.0, "critic": 0.5}
    # a missing answer rejected is a right verdict; JSON without a boolean "correct" is no verdict
    assert ENV.reward(task, _episode(_state(None, critic=[(None, no)])))["critic"] == 1.0
    assert ENV.reward(task, _episode(_state(right, critic=[(right, '{"correct": "yes"}')])))["critic"] == 0.0
    valid = [ENV.turn_is_valid(task, SimpleNamespace(agent="critic", response_text=t))
             for t in (yes, '{"verdict": true}', "Yes.")]
    assert valid == [True, False, False]
    assert ENV.turn_is_valid(task, SimpleNamespace(agent="planner", response_text="?"))
    with pytest.raises(ValueError, match="unknown agent 'judge'"):
        ENV.turn_is_valid(task, SimpleNamespace(agent="judge", response_text=""))
    stats = episode_stats(task, _state(right, plan=f"Do {expression}", calls=[("calculator", expression, right)]))
    assert stats["plan_numbers"] and stats["right_call"] and stats["well_formed"] and stats["task_call"]


def test_the_calculator_the_tool_call_runner_and_the_parsers():
    assert calculate("37 * 24") == "888" and calculate("12 x 3 + 4") == "40" and calculate("1,234 + 5 =") == "1239"
    assert calculate("7 / 2") == "3.5" and calculate("-(2 - 5) * 4") == "12"
    assert calculate("2 ** 10") == "error: the calculator takes numbers, + - * / and parentheses"
    assert calculate("1 / 0") == "error: division by zero" and calculate(" ") == "error: the expression is empty"
    assert run_tool("calculator", '{"expression": "6 * 7"}') == "42"
    assert run_tool("search", "{}") == "error: unknown tool 'search'; the only tool is calculator"
    assert run_tool("calculator", '{"expr": "1"}') == 'error: calculator takes {"expression": "<arithmetic>"}'
    assert run_tool("calculator", "6*7") == "error: the arguments are not JSON"
    assert parse_answer("6 * 7 = 42, so the answer is 1,042.") == "1042" and parse_answer("got 17.0") == "17"
    assert parse_answer("no number") is None
    assert parse_verdict('{"correct": false, "reason": "x"}') is False and parse_verdict('{"ok": true}') is None
    with pytest.raises(json.JSONDecodeError):
        parse_verdict("Yes.")


def test_the_tasks_are_seeded_disjoint_and_the_calculator_solves_them():
    env = CalcTeamEnv(seed=3, n_train=40, n_test=20)
    train, test = env.tasks("train"), env.tasks("test")
    assert len(train) == 40 and len(test) == 20
    assert not {t.input["question"] for t in train} & {t.input["question"] for t in test}
    assert all(calculate(t.meta["expression"]) == t.answer and int(t.answer) > 0 for t in train + test)
    assert [sum(t.meta["level"] == lv for t in test) for lv in range(3)] == [6, 8, 6]  # (0.3, 0.4, 0.3) of 20
    assert [t.id for t in CalcTeamEnv(seed=3, n_train=40, n_test=20).tasks("test")] == [t.id for t in test]
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        env.tasks("dev")


def test_the_demonstrations_file_is_what_the_script_writes_and_valid_fine_tuning_jsonl():
    lines = demos.DEMOS.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records == demos.records() and len(records) == 32  # committed = generated, at most 32
    assert [demos.agent_of(r) for r in records] == ["worker"] * 20 + ["critic"] * 12
    test_questions = {t.input["question"] for t in CalcTeamEnv(seed=demos.SEED).tasks("test")}
    for record in records:
        # OpenAI's keys, plus the agent it teaches and, for the JSON-mode critic, what its request asks for
        extra = {"agent"} | ({"response_format"} if "tools" not in record else set())
        assert set(record) - {"messages", "tools"} == extra
        assert record["messages"][-1]["role"] == "assistant"
        assert not any(q in record["messages"][1]["content"] for q in test_questions)
        calls = {}
        for m in record["messages"]:
            assert m["role"] in ("system", "user", "assistant", "tool")
            for c in m.get("tool_calls", []):
                assert c["type"] == "function" and isinstance(c["function"]["arguments"], str)
                calls[c["id"]] = c
            if m["role"] == "tool":
                assert m["tool_call_id"] in calls
    critic_replies = [parse_verdict(r["messages"][-1]["content"]) for r in records[20:]]
    assert critic_replies == [True, False] * 6
    assert all(r["response_format"] == {"type": "json_object"} for r in records[20:])
    with pytest.raises(ValueError, match="names agent 'critic' but opens with the worker's system prompt"):
        demos.agent_of({**records[0], "agent": "critic"})


def test_the_demonstrated_tool_calls_render_in_the_app_template_and_parse_with_the_policy_parser():
    policy = scripted_policy(["unused"], chat_template=TEMPLATE)
    for record in demos.records()[:20]:
        system, user, call, tool, answer = record["messages"]
        text = policy.render_text(convert_to_messages(record["messages"]), record["tools"])
        before = policy.render_text(convert_to_messages([system, user]), record["tools"])
        assert text.startswith(before) and json.dumps(CALCULATOR_TOOL) in before
        rendered_call = text[len(before):].split("<|im_end|>")[0]
        parsed = policy.parse(rendered_call)
        expression = json.loads(call["tool_calls"][0]["function"]["arguments"])["expression"]
        assert [(c["name"], c["args"]) for c in parsed.tool_calls] == [("calculator", {"expression": expression})]
        assert tool["content"] == calculate(expression) and parse_answer(answer["content"]) == tool["content"]
    policy.close()


def test_the_train_config_loads_with_the_tool_template_and_constraints_on(monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "graphs" / "calc_team" / "train.yaml")
    assert cfg.models["smollm2"].chat_template == "builtin:smollm2-tools"
    assert cfg.models["smollm2"].constrain is True and list(cfg.agents) == ["planner", "worker", "critic"]
    assert cfg.graph == "graphs.calc_team.graph:build_graph" and cfg.env == "graphs.calc_team.env:CalcTeamEnv"
    off = load_config(ROOT / "graphs" / "calc_team" / "train.yaml", ["models.smollm2.constrain=false"])
    assert off.models["smollm2"].constrain is False
    assert cfg.env_kwargs["seed"] == demos.SEED  # the demonstrations come from the config's train split


def test_the_report_counts_format_and_skill_per_agent_from_the_store(tmp_path):
    tasks = ENV.tasks("test")[:2]
    store = TraceStore(tmp_path / "traces.db")
    for task, critic, worker in ((tasks[0], '{"correct": true}', None), (tasks[1], '{"ok": 1}', "The answer is 3.")):
        reply, _ = _team(task, worker=[worker], critic=[critic])
        policy = scripted_policy(reply, name="team-model", chat_template=TEMPLATE)
        client = openai.OpenAI(api_key="sk-never-sent", base_url="http://127.0.0.1:9/v1", max_retries=0)
        app = instrument(build_graph(client), {a: policy for a in ENV.agents}, strict=True, store=store)
        app.rollout(task.input, task_id=task.id, group_id=f"eval:0:{task.id}")
        policy.close()
    store.close()
    numbers = eval_numbers(tmp_path, ENV)[0]
    assert (numbers.critic_json.hits, numbers.critic_json.n) == (2, 2)
    assert (numbers.critic_verdict.hits, numbers.critic_right.hits, numbers.critic_right.n) == (1, 1, 2)
    assert (numbers.worker_tool_call.hits, numbers.worker_tool_call.n) == (1, 2)
    assert (numbers.worker_well_formed.hits, numbers.worker_well_formed.n) == (1, 1)
    assert (numbers.score.hits, numbers.score.n) == (1, 2) and numbers.critic_constrained.hits == 0
    assert (numbers.critic_approve.hits, numbers.critic_approve.n) == (1, 2)
    assert (numbers.task_call.hits, numbers.right_call.hits, numbers.evaluated.n) == (1, 1, 2)
    assert numbers.by_task == {tasks[0].id: (1.0, 1.0), tasks[1].id: (0.0, 0.0)}
    assert numbers.distinct_answers == 2 and numbers.model_errors == 0


def _runner():
    import importlib.util

    spec = importlib.util.spec_from_file_location("calc_team_study", ROOT / "benchmarks" / "learning" / "calc_team.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_study_runner_stops_before_any_run_naming_the_warm_start_until_the_config_has_one(tmp_path):
    from drmas_graph.config import TrainConfig

    runner = _runner()
    if "warm_start" in TrainConfig.model_fields:  # c57-warm merged: the runner's overrides must load
        overrides = runner.warm_start_overrides()
        assert overrides == [f"{k}={v}" for k, v in runner.WARM_START.items()]
        return
    with pytest.raises(runner.StudyBlocked, match=r"warm start from demonstrations \(issue 57 item 4.*c57-warm"):
        runner.warm_start_overrides()
    assert runner.main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "results.json")]) == 2
    assert not (tmp_path / "runs").exists() and not (tmp_path / "results.json").exists()  # nothing was run


def test_the_study_tests_by_hand():
    from graphs.calc_team.report import Rate

    runner = _runner()

    def numbers(by_task, json_hits=64):
        zero = Rate(0, 0)
        return SimpleNamespace(critic_json=Rate(json_hits, 64), by_task=by_task, critic_verdict=zero)

    # E0 -> E1: tool-call rate up on 3 tasks, down on none; E1 -> E2: score up on 1, down on 1
    e0 = numbers({"a": (0.0, 0.0), "b": (0.0, 0.0), "c": (0.0, 0.5), "d": (0.25, 0.0)}, json_hits=61)
    e1 = numbers({"a": (0.5, 0.0), "b": (0.25, 0.25), "c": (0.25, 0.5), "d": (0.25, 0.0)})
    e2 = numbers({"a": (0.5, 0.25), "b": (0.25, 0.0), "c": (0.25, 0.5), "d": (0.25, 0.0)})
    result = runner.tests([{"_numbers": {"E0": e0, "E1": e1, "E2": e2}}])
    assert result["H1"] == {"critic_json": {"hits": 61, "n": 64, "value": 61 / 64}, "supported": True}  # >= 0.95
    assert (result["H2"]["up"], result["H2"]["nonzero"], result["H2"]["p"]) == (3, 3, 1 / 8)  # P(X >= 3 | n=3)
    assert (result["H3"]["up"], result["H3"]["down"], result["H3"]["p"]) == (1, 1, 3 / 4)  # P(X >= 1 | n=2)
    assert not result["H2"]["supported"] and not result["H3"]["supported"]
