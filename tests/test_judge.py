"""`drmas_graph.rewards`: the judge reward, against a scripted judge model (exact prompts, parsed scores and
reasons, retries, failures, timeout, concurrency limit, SQLite cache, group and agent modes, counters)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import warnings
from typing import Any

import pytest
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict

from drmas_graph.env import Task, score_episode
from drmas_graph.errors import ConfigError, JudgeError
from drmas_graph.instrumentation import _intercept
from drmas_graph.rewards import METRIC_KEYS, Judge, JudgedEnv, Judgement, judge_model
from drmas_graph.types import Episode, SamplingParams, Turn

RUBRIC = "The answer must be the correct number."
TASK = Task(id="t1", input={"messages": [{"role": "user", "content": "What is 2 + 3?"}]}, answer="5")
HANG = object()


class Log:
    """What a scripted judge saw, shared by the copies `Judge` makes of it (temperature set on a copy)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[dict[str, Any]] = []
        self.active = 0
        self.max_active = 0
        self.release = threading.Event()


class ScriptedJudge(BaseChatModel):
    """Replies from `replies` in order (a str, an exception to raise, HANG to block until `log.release`), then
    `default`; records every call's messages and settings; usage: one token per whitespace-separated word."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    replies: list = []
    default: Any = None
    delay_s: float = 0.0
    model_name: str = "scripted-judge"
    temperature: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    log: Log

    @property
    def _llm_type(self) -> str:
        return "scripted-judge"

    def _next(self, messages) -> Any:
        with self.log.lock:
            self.log.active += 1
            self.log.max_active = max(self.log.max_active, self.log.active)
            self.log.calls.append({"messages": [(m.type, m.content) for m in messages], "temperature": self.temperature,
                                   "seed": self.seed, "max_tokens": self.max_tokens})
            return self.replies.pop(0) if self.replies else self.default

    def _generate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        reply = self._next(messages)
        try:
            time.sleep(self.delay_s)
            if reply is HANG:
                self.log.release.wait(30)
                raise TimeoutError("released after a hang")
            if isinstance(reply, BaseException):
                raise reply
            reply = reply(messages) if callable(reply) else reply
        finally:
            with self.log.lock:
                self.log.active -= 1
        words_in = sum(len(str(m.content).split()) for m in messages)
        usage = {"input_tokens": words_in, "output_tokens": len(reply.split()),
                 "total_tokens": words_in + len(reply.split())}
        return ChatResult(generations=[ChatGeneration(message=AIMessage(reply, usage_metadata=usage))])


def scripted(*replies, **fields) -> ScriptedJudge:
    return ScriptedJudge(replies=list(replies), log=Log(), **fields)


def make_scripted() -> ScriptedJudge:  # the {"import": ...} spec's factory
    return scripted(default='{"reason": "fine", "score": 1}')


def turn(agent: str, node: str, index: int, text: str, **changes) -> Turn:
    return Turn(agent=agent, node=node, step=index + 1, index=index, messages=(), prompt_ids=(1, 2),
                response_ids=(3, 4), response_logprobs=(-0.1, -0.2), response_text=text,
                sampling=SamplingParams(temperature=0.7), **changes)


def episode(answer: str, *, id: str, verdict: str = "ok", **changes) -> Episode:
    turns = [turn("solver", "solve", 0, f"The answer is {answer}."), turn("verifier", "verify", 1, verdict)]
    return Episode(id=id, task_id="t1", group_id="g1", input=TASK.input, turns=turns,
                   final_state={"answer": answer, "verdict": verdict}, **changes)


def tokens_of(call: dict) -> int:
    return sum(len(str(content).split()) for _, content in call["messages"])


SYSTEM_EPISODE = (
    "You are a judge. You score how well an AI system did a task, following the rubric below.\n\n"
    "You see the task and one attempt at it (its trajectory: every model call, in order, as 'agent (node): reply', "
    "then the outcome). Score the attempt from 0 (useless) to 1 (perfect).\n\n"
    "Rubric:\nThe answer must be the correct number.\n\n"
    "Give a short reason for each score. Reply with only a JSON object, and no other text, of this form: "
    '{"reason": "<one sentence>", "score": <a number from 0 to 1>}')
USER_EPISODE = (
    "Task:\nuser: What is 2 + 3?\nReference answer: 5\n\n"
    "Attempt:\n"
    "solver (solve): The answer is 5.\n"
    "verifier (verify): ok\n"
    "Outcome: finished\n"
    "Final output: answer: 5\n    verdict: ok")


def test_episode_mode_prompt_score_reason_and_record():
    model = scripted('{"reason": "5 is right", "score": 0.75}')
    judge = Judge(model, RUBRIC, mode="episode", seed=7, max_tokens=64)
    ep = episode("5", id="e1")
    judgement = judge.judge_episode(TASK, ep)
    call, = model.log.calls
    assert call["messages"] == [("system", SYSTEM_EPISODE), ("human", USER_EPISODE)]
    assert (call["temperature"], call["seed"], call["max_tokens"]) == (0.0, 7, 64)
    assert judge.settings == {"temperature": 0.0, "seed": 7, "max_tokens": 64} and not judge.structured
    assert judgement == Judgement(reward=0.75, error=None, record={
        "mode": "episode", "model": "scripted-judge", "rubric_sha": hashlib.sha256(RUBRIC.encode()).hexdigest()[:12],
        "prompt": [{"role": "system", "content": SYSTEM_EPISODE}, {"role": "user", "content": USER_EPISODE}],
        "replies": ['{"reason": "5 is right", "score": 0.75}'], "scores": 0.75, "reasons": "5 is right",
        "attempts": 1, "input_tokens": tokens_of(call), "output_tokens": 6, "cached": False,
        "seconds": judgement.record["seconds"], "group_size": None, "index": None, "error": None})
    assert 0 <= judgement.record["seconds"] < 5
    json.dumps(judgement.record)  # JSON-able, as Episode.judgement is stored
    assert judge.reward_metrics() == {"judge/calls": 1, "judge/retries": 0, "judge/failed_calls": 0,
                                      "judge/cache_hits": 0, "judge/input_tokens": tokens_of(call),
                                      "judge/output_tokens": 6, "judge/seconds": pytest.approx(0, abs=5)}
    assert judge.reward_metrics() == dict.fromkeys(METRIC_KEYS, 0.0)  # reset after each read


def test_rendering_clips_long_replies_and_shows_tool_calls_and_stops():
    long = "x" * 1000 + "THE END" + "y" * 1000
    ep = Episode(id="e2", task_id="t1", input={"question": "q?"}, turns=[
        turn("solver", "solve", 0, long),
        turn("searcher", "outer/search", 1, "", tool_calls=({"name": "search", "args": {"q": "2+3"}, "id": "c1",
                                                             "type": "tool_call"},))],
        truncated="max_llm_calls: 2 calls")
    model = scripted('{"reason": "cut", "score": 0}')
    Judge(model, RUBRIC, mode="episode").judge_episode(Task(id="t1", input={"question": "q?"}), ep)
    user = model.log.calls[0]["messages"][1][1]
    kept = "x" * 800 + " [... 807 characters cut ...] " + "y" * 400  # 1200 kept: head 2/3, tail 1/3
    assert user == ("Task:\nquestion: q?\n\nAttempt:\n"
                    f"solver (solve): {kept}\n"
                    'searcher (outer/search): [calls tool search({"q": "2+3"})]\n'
                    "Outcome: stopped early by a limit (max_llm_calls: 2 calls)")


def test_unusable_replies_are_retried_with_what_was_wrong():
    model = scripted("I think it is good", '{"reason": "too high", "score": 1.5}', RuntimeError("server down"),
                     '{"reason": "fine", "score": 0.5}')
    judge = Judge(model, RUBRIC, mode="episode", max_retries=3)
    judgement = judge.judge_episode(TASK, episode("5", id="e1"))
    assert judgement.reward == 0.5 and judgement.error is None
    assert judgement.record["attempts"] == 4
    assert judgement.record["replies"] == ["I think it is good", '{"reason": "too high", "score": 1.5}', "",
                                           '{"reason": "fine", "score": 0.5}']
    second = model.log.calls[1]["messages"]
    assert second[:2] == model.log.calls[0]["messages"] and second[2] == ("ai", "I think it is good")
    assert second[3] == ("human", "That reply cannot be used: the reply is not a JSON object: 'I think it is good'. "
                                  "Reply again with only the JSON object.")
    third = model.log.calls[2]["messages"]
    assert third[:2] == second[:2] and third[3][1].startswith(
        "That reply cannot be used: the reply does not match the format asked for (score: Input should be less than "
        "or equal to 1)")
    assert model.log.calls[3]["messages"] == third  # a raising call is retried with the same prompt
    metrics = judge.reward_metrics()
    assert (metrics["judge/calls"], metrics["judge/retries"], metrics["judge/failed_calls"]) == (4, 3, 3)
    assert metrics["judge/input_tokens"] == sum(tokens_of(c) for i, c in enumerate(model.log.calls) if i != 2)


def test_no_usable_reply_is_an_error_never_a_zero():
    model = scripted("nope", '{"score": 0.3}', "nope again", '{"reason": "late", "score": 0.3}')
    judge = Judge(model, RUBRIC, mode="episode", max_retries=1)
    ep = episode("5", id="e1")
    (result,) = judge.reward_group(TASK, [ep])
    assert isinstance(result, JudgeError)
    assert str(result).startswith("judge 'scripted-judge' gave no usable score for episode e1 (task 't1') after 2 "
                                  "call(s): attempt 1: the reply is not a JSON object: 'nope'; attempt 2: the reply "
                                  "does not match the format asked for (reason: Field required)")
    assert "Last reply: '{\"score\": 0.3}'" in str(result) and "raise the judge's max_retries" in str(result)
    assert ep.judgement["error"] == str(result) and ep.judgement["scores"] is None
    assert ep.judgement["replies"] == ["nope", '{"score": 0.3}'] and ep.judgement["attempts"] == 2
    assert judge.reward(TASK, ep) == 0.3  # a failure is not cached: the next run asks again
    assert len(model.log.calls) == 4 and ep.judgement["replies"] == ["nope again", '{"reason": "late", "score": 0.3}']
    assert judge.reward_metrics()["judge/failed_calls"] == 3  # the last reply scored: it is not failed


def test_a_call_past_timeout_fails_and_is_retried():
    model = scripted(HANG, '{"reason": "ok", "score": 1}')
    judge = Judge(model, RUBRIC, mode="episode", timeout_s=0.3, max_retries=1)
    start = time.monotonic()
    judgement = judge.judge_episode(TASK, episode("5", id="e1"))
    assert time.monotonic() - start < 5
    assert judgement.reward == 1.0 and judgement.record["replies"] == ["", '{"reason": "ok", "score": 1}']
    model.log.release.set()
    failing = Judge(scripted(HANG), RUBRIC, mode="episode", timeout_s=0.2, max_retries=0)
    bad = failing.judge_episode(TASK, episode("5", id="e9"))
    failing.model.log.release.set()
    assert bad.reward is None and "after 1 call(s): attempt 1: no reply within timeout_s=0.2." in bad.error
    assert failing.reward_metrics()["judge/failed_calls"] == 1


def test_at_most_max_concurrency_calls_at_once_across_threads():
    model = scripted(default='{"reason": "ok", "score": 0.5}', delay_s=0.15)
    judge = Judge(model, RUBRIC, mode="episode", max_concurrency=2)
    groups = [[episode(f"{g}{i}", id=f"e{g}{i}") for i in range(3)] for g in range(4)]
    threads = [threading.Thread(target=judge.reward_group, args=(TASK, group)) for group in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(model.log.calls) == 12 and model.log.max_active == 2
    assert all(e.judgement["scores"] == 0.5 for group in groups for e in group)


def test_sqlite_cache_makes_a_resumed_run_pay_nothing(tmp_path):
    reply = '{"attempt_1": {"reason": "a", "score": 1}, "attempt_2": {"reason": "b", "score": 0}}'
    group = [episode("5", id="e1"), episode("6", id="e2")]
    first = Judge(scripted(reply), RUBRIC, cache=tmp_path / "judge.db")
    assert first.reward_group(TASK, group) == [1.0, 0.0]
    assert first.reward_metrics()["judge/cache_hits"] == 0
    model = scripted()
    again = [episode("5", id="e1b"), episode("6", id="e2b")]  # other ids, same trajectories
    second = Judge(model, RUBRIC, cache=tmp_path / "judge.db")
    assert second.reward_group(TASK, again) == [1.0, 0.0] and model.log.calls == []
    assert again[0].judgement["cached"] is True and again[0].judgement["replies"] == [reply]
    assert group[0].judgement["cached"] is False
    assert {k: v for k, v in again[1].judgement.items() if k != "cached"} == \
           {k: v for k, v in group[1].judgement.items() if k != "cached"}
    metrics = second.reward_metrics()
    assert (metrics["judge/cache_hits"], metrics["judge/calls"], metrics["judge/input_tokens"]) == (1, 0, 0)
    other = Judge(scripted(reply), RUBRIC + " Be strict.", cache=tmp_path / "judge.db")
    other.reward_group(TASK, group)
    assert len(other.model.log.calls) == 1  # another rubric is another key


def test_a_corrupt_cache_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "judge.db"
    bad.write_text("not a database" * 100)
    with pytest.raises(ConfigError, match="judge cache .*judge.db.*delete it or give the judge another `cache`"):
        Judge(scripted(), RUBRIC, cache=bad)


def test_group_mode_one_call_scores_mapped_back_and_wrong_count_retried():
    two = '{"attempt_1": {"reason": "a", "score": 1}, "attempt_2": {"reason": "b", "score": 0}}'
    three = ('{"attempt_2": {"reason": "wrong", "score": 0.1}, "attempt_3": {"reason": "best", "score": 0.9}, '
             '"attempt_1": {"reason": "close", "score": 0.6}}')
    model = scripted(two, three)
    judge = Judge(model, RUBRIC)
    group = [episode("5", id="e1", verdict="yes"), episode("7", id="e2", verdict="no"),
             episode("5", id="e3", verdict="correct")]
    judgements = judge.judge_group(TASK, group)
    assert [j.reward for j in judgements] == [0.6, 0.1, 0.9]
    assert [j.record["reasons"] for j in judgements] == ["close", "wrong", "best"]
    assert [(j.record["group_size"], j.record["index"]) for j in judgements] == [(3, 0), (3, 1), (3, 2)]
    assert all(j.record["replies"] == [two, three] and j.record["attempts"] == 2 for j in judgements)
    first, second = model.log.calls
    assert first["messages"][1][1] == (
        "Task:\nuser: What is 2 + 3?\nReference answer: 5\n\n"
        "Attempt 1:\nsolver (solve): The answer is 5.\nverifier (verify): yes\nOutcome: finished\n"
        "Final output: answer: 5\n    verdict: yes\n\n"
        "Attempt 2:\nsolver (solve): The answer is 7.\nverifier (verify): no\nOutcome: finished\n"
        "Final output: answer: 7\n    verdict: no\n\n"
        "Attempt 3:\nsolver (solve): The answer is 5.\nverifier (verify): correct\nOutcome: finished\n"
        "Final output: answer: 5\n    verdict: correct")
    system = first["messages"][0][1]
    assert "You see the task and 3 attempts at it, numbered 1 to 3" in system
    assert "the best attempt gets the highest score" in system
    assert system.endswith('{"attempt_1": {"reason": "<one sentence>", "score": <a number from 0 to 1>}, ...} with '
                           "one entry for each attempt, attempt_1 to attempt_3")
    assert "(attempt_3: Field required)" in second["messages"][3][1]  # two scores for three attempts
    assert judgements[0].record["prompt"] == [{"role": r, "content": c} for r, c in
                                              zip(("system", "user"), (system, first["messages"][1][1]))]


def test_group_reply_with_an_extra_attempt_fails_every_episode_of_the_group():
    extra = ('{"attempt_1": {"reason": "a", "score": 1}, "attempt_2": {"reason": "b", "score": 0}, '
             '"attempt_3": {"reason": "c", "score": 0}}')
    judge = Judge(scripted(extra), RUBRIC, max_retries=0)
    results = judge.reward_group(TASK, [episode("5", id="e1"), episode("6", id="e2")])
    assert all(isinstance(r, JudgeError) for r in results)
    assert "(attempt_3: Extra inputs are not permitted)" in str(results[1])
    assert "episode e2 (task 't1', attempt 2 of a group of 2)" in str(results[1])


def test_agent_mode_scores_each_agent_of_the_episode():
    missing = '{"solver": {"reason": "right", "score": 1}}'
    both = '{"verifier": {"reason": "too vague", "score": 0.25}, "solver": {"reason": "right", "score": 1}}'
    model = scripted(missing, both)
    judge = Judge(model, RUBRIC, mode="agent")
    env = JudgedEnv(_Env(), judge)
    ep = episode("5", id="e1")
    (reward,) = env.reward_group(TASK, [ep])
    assert reward == {"solver": 1.0, "verifier": 0.25}
    assert ep.judgement["scores"] == {"solver": 1.0, "verifier": 0.25}
    assert ep.judgement["reasons"] == {"solver": "right", "verifier": "too vague"}
    first = model.log.calls[0]["messages"]
    assert first[1][1] == USER_EPISODE + "\n\nAgents to score: solver, verifier"
    assert "Score each agent from 0 (useless) to 1 (perfect), judging the agent on its own replies" in first[0][1]
    assert first[0][1].endswith("with one entry for each agent: solver, verifier")
    assert "(verifier: Field required)" in model.log.calls[1]["messages"][3][1]
    model.replies.append(both)  # the per-agent dict is the reward the trainer already takes
    score = score_episode(env, TASK, episode("5", id="e2"), invalid_penalty=0.1)
    assert score.rewards == {"solver": 1.0, "verifier": 0.25} and score.team == 0.625


def test_agent_mode_unknown_agent_is_retried_and_no_agent_is_an_error():
    wrong = '{"planner": {"reason": "x", "score": 1}, "solver": {"reason": "y", "score": 1}}'
    judge = Judge(scripted(wrong), RUBRIC, mode="agent", max_retries=0)
    bad = judge.judge_episode(TASK, episode("5", id="e1"))
    assert "(verifier: Field required; planner: Extra inputs are not permitted)" in bad.error
    empty = judge.judge_episode(TASK, Episode(id="e0", input=TASK.input))
    assert empty.reward is None and "the episode made no LLM call, so it has no agent to score" in empty.error
    assert empty.record["attempts"] == 0


class _Env:
    def tasks(self, split):
        return [TASK]

    def reward(self, task, episode):
        raise AssertionError("the judge scores, not the env")

    def turn_is_valid(self, task, turn):
        return turn.agent != "verifier"

    def reward_metrics(self):
        return {"env/own": 1.0}


def test_judged_env_passes_the_env_through():
    judge = Judge(scripted(default='{"reason": "ok", "score": 0.4}'), RUBRIC, mode="episode")
    env = JudgedEnv(_Env(), judge)
    assert env.tasks("train") == [TASK] and not hasattr(env, "is_success") and not hasattr(env, "resume")
    ep = episode("5", id="e1")
    assert env.reward(TASK, ep) == 0.4 and ep.judgement["scores"] == 0.4
    score = score_episode(env, TASK, ep, invalid_penalty=0.1)
    assert score.turn_rewards == [0.4, pytest.approx(0.3)]  # turn_is_valid is the env's
    metrics = env.reward_metrics()
    assert metrics["env/own"] == 1.0 and metrics["judge/calls"] == 1


def test_judge_calls_are_never_turns_of_a_running_episode():
    _intercept.install()
    handler = object()
    _intercept.register_run(handler)  # an instrumented run is active in the process (another thread)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an unattributed call would warn UnservedCallWarning
            judgement = Judge(scripted('{"reason": "ok", "score": 1}'), RUBRIC, mode="episode").judge_episode(
                TASK, episode("5", id="e1"))
    finally:
        _intercept.unregister_run(handler)
    assert judgement.reward == 1.0


def test_arguments_are_checked_at_construction():
    with pytest.raises(ConfigError, match=r"unknown mode 'pairs'; valid modes: \['episode', 'group', 'agent'\]"):
        Judge(scripted(), RUBRIC, mode="pairs")
    with pytest.raises(ConfigError, match="rubric must be a non-empty string"):
        Judge(scripted(), "  ")
    with pytest.raises(ConfigError, match="max_concurrency must be an integer >= 1"):
        Judge(scripted(), RUBRIC, max_concurrency=0)


class _NoSettings(BaseChatModel):
    """A chat model with no temperature/seed fields: none are set on it."""

    @property
    def _llm_type(self) -> str:
        return "no-settings"

    def _generate(self, messages, stop=None, run_manager=None, **kwargs):
        assert "seed" not in kwargs and "temperature" not in kwargs
        return ChatResult(generations=[ChatGeneration(message=AIMessage('{"reason": "r", "score": 0.2}'))])


def test_settings_go_only_where_the_model_takes_them():
    judge = Judge(_NoSettings(), RUBRIC, mode="episode")
    assert judge.settings == {} and judge.name == "_NoSettings"
    assert judge.judge_episode(TASK, episode("5", id="e1")).reward == 0.2


def test_judge_model_specs():
    imported = judge_model({"import": "tests.test_judge:make_scripted"})
    assert isinstance(imported, ScriptedJudge) and imported.default == '{"reason": "fine", "score": 1}'
    served = judge_model({"base_url": "http://127.0.0.1:9/v1", "model": "judge-model", "timeout": 30})
    assert type(served).__name__ == "ChatOpenAI" and served.model_name == "judge-model"
    assert served.openai_api_base == "http://127.0.0.1:9/v1" and served.openai_api_key.get_secret_value() == "EMPTY"
    assert served.request_timeout == 30
    # a config-built served judge times its requests out with the judge's timeout_s (its slot then frees)
    assert judge_model({"base_url": "http://127.0.0.1:9/v1", "model": "m"}, timeout_s=45).request_timeout == 45
    assert judge_model({"base_url": "http://127.0.0.1:9/v1", "model": "m", "timeout": 30}, timeout_s=45).request_timeout == 30
    judge = Judge(served, RUBRIC, seed=3, max_tokens=100)
    assert judge.structured and (judge.model.temperature, judge.model.seed, judge.model.max_tokens) == (0.0, 3, 100)
    with pytest.raises(ConfigError, match="names no model"):
        judge_model({"rubric": "x"})
    with pytest.raises(ConfigError, match="`model` must name the served model"):
        judge_model({"base_url": "http://127.0.0.1:9/v1"})
    with pytest.raises(ConfigError, match="judge model import 'tests.test_judge:nothing'"):
        judge_model({"import": "tests.test_judge:nothing"})
    with pytest.raises(ConfigError, match="judge model 'nosuchprovider:m'"):
        judge_model("nosuchprovider:m")


def test_embedded_judge_is_a_greedy_policy_with_structured_output():
    model = judge_model({"tiny": {"seed": 0}})
    assert type(model).__name__ == "PolicyChatModel" and model.temperature == 0.0
    judge = Judge(model, RUBRIC, mode="episode", max_retries=1, max_tokens=8)
    assert judge.structured and judge.name == 'judge:tiny{"seed": 0}'
    assert judge.settings == {"temperature": 0.0, "seed": 0, "max_tokens": 8}  # PolicyChatModel's fields
    judgement = judge.judge_episode(TASK, episode("5", id="e1"))
    # random weights: the reply is not the JSON (8 tokens), so the judge fails, with the replies kept
    assert judgement.reward is None and "after 2 call(s)" in judgement.error
    assert len(judgement.record["replies"]) == 2
    assert judgement.record["output_tokens"] == 16 and judgement.record["input_tokens"] > 100


class ToolScriptedJudge(ScriptedJudge):
    """A scripted judge with tool binding, so LangChain's `with_structured_output` forces a tool call: its
    scripted JSON comes back as the call's arguments."""

    def bind_tools(self, tools, **kwargs):
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

    def _generate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        self.log.calls.append({"bound": {k: kwargs[k] for k in ("tool_choice",) if k in kwargs},
                               "tool": kwargs["tools"][0]["function"]["name"]})
        text = self.replies.pop(0)
        call = {"name": "Verdict", "args": json.loads(text), "id": "c1", "type": "tool_call"}
        return ChatResult(generations=[ChatGeneration(message=AIMessage("", tool_calls=[call]))])


def test_structured_output_through_a_forced_tool_call_keeps_the_raw_arguments():
    model = ToolScriptedJudge(replies=['{"reason": "too much", "score": 2}', '{"reason": "ok", "score": 0.5}'],
                              log=Log())
    judge = Judge(model, RUBRIC, mode="episode")
    judgement = judge.judge_episode(TASK, episode("5", id="e1"))
    assert judge.structured and judgement.reward == 0.5
    assert judgement.record["replies"] == ['{"reason": "too much", "score": 2}', '{"reason": "ok", "score": 0.5}']
    assert model.log.calls[0] == {"bound": {"tool_choice": "any"}, "tool": "Verdict"}


def test_control_characters_inside_a_reply_string_are_tolerated():
    # what vLLM's guided decoding let a random model write (tests/test_judge_vllm.py): a raw newline in a string
    judge = Judge(scripted('{"reason": "line one\nline two\t.", "score": 0.5}'), RUBRIC, mode="episode")
    judgement = judge.judge_episode(TASK, episode("5", id="e1"))
    assert judgement.reward == 0.5 and judgement.record["reasons"] == "line one\nline two\t."


def test_a_reply_cut_at_max_tokens_is_recorded_counted_and_retried():
    """OpenAI's client raises LengthFinishReasonError for a structured reply cut at max_tokens (seen against
    vLLM): the judge keeps the reply's text and the server's token counts, says why it cannot be used, retries."""
    openai = pytest.importorskip("openai")
    from openai.types.chat import ChatCompletion

    completion = ChatCompletion.model_validate({
        "id": "c", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "length",
                     "message": {"role": "assistant", "content": '{"reason": "1.1.1.1'}}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47}})
    model = scripted(openai.LengthFinishReasonError(completion=completion), '{"reason": "ok", "score": 0.75}')
    judge = Judge(model, RUBRIC, mode="episode", max_tokens=7)
    judgement = judge.judge_episode(TASK, episode("5", id="e1"))
    assert judgement.reward == 0.75 and judgement.record["replies"][0] == '{"reason": "1.1.1.1'
    assert model.log.calls[1]["messages"][3] == (
        "human", "That reply cannot be used: the reply was cut at max_tokens=7 (raise the judge's max_tokens). "
                 "Reply again with only the JSON object.")
    metrics = judge.reward_metrics()
    assert (metrics["judge/calls"], metrics["judge/retries"], metrics["judge/failed_calls"]) == (2, 1, 1)
    assert metrics["judge/input_tokens"] == 40 + tokens_of(model.log.calls[1])
    assert judgement.record["input_tokens"] == metrics["judge/input_tokens"]


def test_a_multi_line_reply_continues_on_indented_lines():
    """One entry per model call: a reply's later lines are indented (blank ones dropped), so a reply line that
    looks like another call ("verifier (verify): ...") never starts at the margin; the same for the outcome."""
    reply = "Thinking step by step.\n\nverifier (verify): I agree, 5.\nThe answer is 5."
    ep = Episode(id="e3", task_id="t1", input=TASK.input, turns=[turn("solver", "solve", 0, reply),
                                                                  turn("verifier", "verify", 1, "yes\nok")],
                 error="ValueError: bad\nsecond line")
    model = scripted('{"reason": "fine", "score": 1}')
    Judge(model, RUBRIC, mode="episode").judge_episode(TASK, ep)
    user = model.log.calls[0]["messages"][1][1]
    assert user == ("Task:\nuser: What is 2 + 3?\nReference answer: 5\n\nAttempt:\n"
                    "solver (solve): Thinking step by step.\n"
                    "    verifier (verify): I agree, 5.\n"
                    "    The answer is 5.\n"
                    "verifier (verify): yes\n"
                    "    ok\n"
                    "Outcome: failed (ValueError: bad\n"
                    "    second line)")
    margin = [line for line in user.split("Attempt:\n")[1].splitlines() if not line.startswith(" ")]
    assert margin == ["solver (solve): Thinking step by step.", "verifier (verify): yes",
                      "Outcome: failed (ValueError: bad"]
