"""The math example app (graphs/math): the solver/verifier graph with scripted chat models, the parsers,
and the environment's generator, reward and format check; the CPU demo's checked app (`checked_graph`,
`checked_env`) and its end-of-run table (`report`) on hand-made episodes."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, Callable

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import Field

from graphs.math import checked_graph
from graphs.math.checked_env import CheckedMathEnv, verdict_reward, verdicts
from graphs.math.checked_graph import CHECKER_PROMPT
from graphs.math.env import MathEnv, normalize_number
from graphs.math.report import agent_rates, eval_rates, rates_table
from graphs.math.graph import SOLVER_PROMPT, VERIFIER_PROMPT, build_graph, parse_answer, parse_verdict
from graphs.task import Task, split_counts

GRAPHS = Path(__file__).resolve().parents[1] / "graphs"


class ScriptedChat(BaseChatModel):
    """A chat model whose reply is ``respond(agent, user_text)``; the agent is read off the system prompt."""

    respond: Callable[[str, str], str]
    calls: list[tuple[str, str]] = Field(default_factory=list)
    """(agent, user message) of every call, in order."""

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        assert isinstance(messages[0], SystemMessage) and len(messages) == 2
        agent = {SOLVER_PROMPT: "solver", VERIFIER_PROMPT: "verifier", CHECKER_PROMPT: "verifier"}[messages[0].content]
        self.calls.append((agent, messages[1].content))
        reply = self.respond(agent, messages[1].content)
        return ChatResult(generations=[ChatGeneration(message=AIMessage(reply))])


def scripted(solver: list[str], verifier: list[str]) -> ScriptedChat:
    """Replies taken in order from per-agent scripts."""
    queues = {"solver": iter(solver), "verifier": iter(verifier)}
    return ScriptedChat(respond=lambda agent, _user: next(queues[agent]))


def agents(state: dict) -> list[str]:
    return [turn["agent"] for turn in state["transcript"]]


# --- graph ------------------------------------------------------------------------------------------


def test_nodes_are_solver_and_verifier():
    graph = build_graph(scripted([], []))
    assert set(graph.nodes) - {"__start__"} == {"solver", "verifier"}


def test_approve_ends_after_one_round():
    llm = scripted(["Answer: 7"], ["approve"])
    state = build_graph(llm).invoke({"question": "What is 3 + 4?"})
    assert state["answer"] == "7" and state["rounds"] == 1 and state["verdict"] == "approve"
    assert agents(state) == ["solver", "verifier"]
    assert llm.calls == [("solver", "What is 3 + 4?"),
                         ("verifier", "Question: What is 3 + 4?\nProposed answer: 7")]


def test_reject_makes_the_solver_revise_with_the_reason():
    llm = scripted(["The answer is 8.", "The answer is 7."], ["No, 3 + 4 is not 8.", "Yes."])
    state = build_graph(llm, max_rounds=3).invoke({"question": "What is 3 + 4?"})
    assert state["answer"] == "7" and state["rounds"] == 2 and state["verdict"] == "approve"
    assert agents(state) == ["solver", "verifier", "solver", "verifier"]
    revision_prompt = llm.calls[2][1]
    assert revision_prompt == ("What is 3 + 4?\nYour previous answer: 8\n"
                               "A checker said it is wrong: 3 + 4 is not 8.\nTry again.")
    assert llm.calls[3][1].endswith("Proposed answer: 7")


def test_max_rounds_caps_solver_turns_and_keeps_the_last_answer():
    llm = scripted(["Answer: 1", "Answer: 2", "Answer: 3", "Answer: 4"], ["reject: no"] * 4)
    state = build_graph(llm, max_rounds=3).invoke({"question": "q"})
    assert state["rounds"] == 3 and state["answer"] == "3" and state["verdict"] == "reject"
    assert agents(state) == ["solver", "verifier"] * 3


def test_unreadable_verdict_counts_as_approve():
    state = build_graph(scripted(["Answer: 7"], ["looks right to me"])).invoke({"question": "q"})
    assert state["rounds"] == 1 and state["verdict"] is None and state["answer"] == "7"


def test_solver_reply_without_answer_gives_none_and_the_verifier_sees_none():
    llm = scripted(["I think seven", "Answer: 7"], ["reject: no answer given", "approve"])
    state = build_graph(llm).invoke({"question": "q"})
    assert llm.calls[1] == ("verifier", "Question: q\nProposed answer: (none)")
    assert "Your previous answer: (none)" in llm.calls[2][1]
    assert state["answer"] == "7"
    # An unreadable last answer is the final answer: None, not an earlier one.
    llm = scripted(["Answer: 5", "no idea"], ["reject: wrong", "reject: no answer"])
    state = build_graph(llm).invoke({"question": "q"})
    assert state["rounds"] == 2 and state["answer"] is None


def test_separate_verifier_model_gets_only_verifier_calls():
    solver_llm = scripted(["Answer: 8", "Answer: 7"], [])
    verifier_llm = scripted([], ["reject: off by one", "approve"])
    state = build_graph(solver_llm, verifier_llm=verifier_llm).invoke({"question": "q"})
    assert [a for a, _ in solver_llm.calls] == ["solver", "solver"]
    assert [a for a, _ in verifier_llm.calls] == ["verifier", "verifier"]
    assert state["answer"] == "7"


def test_any_chat_model_works_generic_fake():
    llm = GenericFakeChatModel(messages=iter([AIMessage("Answer: 12"), AIMessage("approve")]))
    assert build_graph(llm).invoke({"question": "What is 3 * 4?"})["answer"] == "12"


def test_model_calls_carry_the_node_name_in_run_metadata():
    """The trainer tells agents apart by LangGraph's ``langgraph_node`` run metadata."""

    class Nodes(BaseCallbackHandler):
        def __init__(self) -> None:
            self.seen: list[str] = []

        def on_chat_model_start(self, serialized, messages, *, metadata=None, **kwargs):
            self.seen.append(metadata["langgraph_node"])

    handler = Nodes()
    llm = scripted(["Answer: 8", "Answer: 7"], ["reject: no", "approve"])
    build_graph(llm).invoke({"question": "q"}, {"callbacks": [handler]})
    assert handler.seen == ["solver", "verifier", "solver", "verifier"]


def test_bad_max_rounds_is_rejected_at_build_time():
    with pytest.raises(ValueError, match="max_rounds"):
        build_graph(scripted([], []), max_rounds=0)


def test_graph_modules_do_not_import_drmas_graph():
    for path in GRAPHS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "drmas_graph" for n in names), path


# --- parsers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("The answer is 7.", "7"),
    ("So, the answer is 15.", "15"),
    ('The answer is "7"', "7"),
    ("The answer is: 7", "7"),
    ("Answer: 7", "7"),
    ("answer:7", "7"),
    ("  Answer: -3", "-3"),
    ("Answer: 5.0", "5.0"),
    ("**Answer:** 12", "12"),
    ("Answer = 1,000", "1000"),
    ("Answer: $42$", "42"),
    ("3 + 4 = 7.\nAnswer: 7", "7"),
    ("Answer: 6\nWait, no. Answer: 7", "7"),  # the last one wins
    ("3 + 4 = 7", None),
    ("The answer is seven", None),
    ("Answer: seven", None),
    ("The answer to this is 7", None),
    ("", None),
    ("7", "7"),  # a reply that is only a number is an answer too
    (" 12. ", "12"),
    ("7 apples", None),
])
def test_parse_answer(text, expected):
    assert parse_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("Yes.", (True, "")),
    ("yes, 2 + 5 is 7", (True, "")),
    ("No, 2 + 5 is 7, not 8.", (False, "2 + 5 is 7, not 8.")),
    ("No.", (False, "")),
    ("Not sure", (None, "")),
    ("The proposed answer is 10.", (None, "")),
    ("approve", (True, "")),
    ("Approve.", (True, "")),
    ("**Approved**", (True, "")),
    ("Verdict: approve", (True, "")),
    ("reject: 3 + 4 is 7, not 8", (False, "3 + 4 is 7, not 8")),
    ("Reject - wrong sum", (False, "wrong sum")),
    ("reject", (False, "")),
    ("I approve", (None, "")),
    ("looks good", (None, "")),
    ("", (None, "")),
    ("approves", (None, "")),
])
def test_parse_verdict(text, expected):
    assert parse_verdict(text) == expected


# --- environment ------------------------------------------------------------------------------------


def _recompute(question: str) -> int:
    """The answer of a generated question, recomputed from its text."""
    if m := re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", question):
        a, op, b = int(m[1]), m[2], int(m[3])
        return {"+": a + b, "-": a - b, "*": a * b}[op]
    n = [int(x) for x in re.findall(r"\d+", question)]
    if "buys" in question:
        return n[0] + n[1] - n[2]
    if "bags" in question:
        return n[0] * n[1] + n[2]
    assert "lost" in question, question
    return n[0] - n[1] + n[2]


def test_same_seed_same_tasks_other_seed_other_tasks():
    a, b, c = MathEnv(seed=3), MathEnv(seed=3), MathEnv(seed=4)
    for split in ("train", "test"):
        assert a.tasks(split) == b.tasks(split)
    assert [t.input for t in a.tasks("train")] != [t.input for t in c.tasks("train")]


def test_splits_have_requested_sizes_unique_ids_and_disjoint_questions():
    env = MathEnv(seed=0, n_train=100, n_test=40)
    train, test = env.tasks("train"), env.tasks("test")
    assert (len(train), len(test)) == (100, 40)
    ids = [t.id for t in train + test]
    assert len(set(ids)) == len(ids)
    train_q = {t.input["question"] for t in train}
    test_q = {t.input["question"] for t in test}
    assert len(train_q) == 100 and len(test_q) == 40 and not train_q & test_q
    assert all(t.meta["split"] == "train" for t in train) and all(t.meta["split"] == "test" for t in test)


def test_default_mix_has_all_levels_with_single_digit_addition_the_majority():
    env = MathEnv()
    for split in ("train", "test"):
        tasks = env.tasks(split)
        levels = [t.meta["level"] for t in tasks]
        assert set(levels) == {0, 1, 2, 3}
        assert levels.count(0) > len(tasks) / 2
        assert {t.meta["kind"] for t in tasks if t.meta["level"] == 0} == {"add1"}
    level0 = [t for t in env.tasks("train") if t.meta["level"] == 0]
    assert all(re.fullmatch(r"What is \d \+ \d\?", t.input["question"]) for t in level0)
    assert {t.meta["kind"] for t in env.tasks("train")} == {"add1", "add2", "sub2", "mul", "word"}


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_every_answer_is_correct(level):
    env = MathEnv(seed=1, n_train=70, n_test=30, difficulty=tuple(float(i == level) for i in range(4)))
    tasks = env.tasks("train") + env.tasks("test")
    assert {t.meta["level"] for t in tasks} == {level}
    for task in tasks:
        assert int(task.answer) == _recompute(task.input["question"]), task
        assert int(task.answer) >= 0


def test_word_problem_example():
    env = MathEnv(seed=0, difficulty=(0, 0, 0, 1), n_train=5, n_test=0)
    task = env.tasks("train")[0]
    assert task.meta == {"level": 3, "kind": "word", "split": "train"}
    assert re.search(r"[A-Z][a-z]+ (has|had) \d+ [a-z]+", task.input["question"])


def test_asking_for_more_distinct_problems_than_a_level_has_fails_loudly():
    with pytest.raises(ValueError, match="level 0 has only 100 distinct problems"):
        MathEnv(n_train=100, n_test=1, difficulty=(1.0,))


def test_split_counts_largest_remainder():
    assert split_counts(10, (0.55, 0.2, 0.15, 0.1)) == [6, 2, 1, 1]  # 5.5, 2, 1.5, 1 -> ties go left
    assert split_counts(7, (1, 1)) == [4, 3]
    assert sum(split_counts(33, (0.5, 0.3, 0.2))) == 33


@pytest.mark.parametrize("got, reward", [
    ("5", 1.0), ("5.0", 1.0), (" 5 ", 1.0), ("5.00", 1.0), ("6", 0.0), ("five", 0.0), (None, 0.0), ("", 0.0),
    (parse_answer("Answer: 5.0"), 1.0), (parse_answer("blah"), 0.0),
])
def test_reward_is_numeric_exact_match(got, reward):
    task = Task(id="t", input={"question": "What is 2 + 3?"}, answer="5", meta={"level": 0})
    assert MathEnv(n_train=1, n_test=1).score(task, {"answer": got}) == reward


def test_reward_of_a_state_without_answer_is_zero_and_end_to_end_reward():
    env = MathEnv(n_train=4, n_test=1)
    task = env.tasks("train")[0]
    assert env.score(task, {}) == 0.0
    llm = scripted([f"Answer: {task.answer}.0"], ["approve"])
    assert env.score(task, build_graph(llm).invoke(task.input)) == 1.0


def test_normalize_number():
    assert normalize_number(" 1,000 ") == normalize_number("1000.0")
    assert normalize_number("nan") is None and normalize_number("abc") is None


def test_turn_is_valid_and_penalty():
    env = MathEnv(n_train=1, n_test=1)
    assert env.invalid_penalty == 0.1 and env.agents == ("solver", "verifier")
    assert env.reply_is_valid("solver", "The answer is 5.") and env.reply_is_valid("solver", "Answer: 5")
    assert not env.reply_is_valid("solver", "the answer is five")
    assert env.reply_is_valid("verifier", "Yes") and env.reply_is_valid("verifier", "No, it is 6.")
    assert env.reply_is_valid("verifier", "approve") and env.reply_is_valid("verifier", "Reject: wrong sum")
    assert not env.reply_is_valid("verifier", "%$#@ garbage")
    with pytest.raises(ValueError, match="unknown agent 'judge'"):
        env.reply_is_valid("judge", "approve")
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        env.tasks("dev")


# --- optional: a real (tiny, random-weight) model behind the graph ----------------------------------


class PolicyChat(BaseChatModel):
    """Adapts a ``drmas_graph`` Policy to LangChain's chat-model interface (render -> generate -> decode)."""

    policy: Any

    @property
    def _llm_type(self) -> str:
        return "policy"

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        generation = self.policy.generate(self.policy.render(messages), self.policy.sampling)
        text = self.policy.decode(generation.token_ids)
        return ChatResult(generations=[ChatGeneration(message=AIMessage(text))])


@pytest.mark.slow
def test_graph_with_a_tiny_random_policy_stays_consistent():
    """Random-weight replies almost never follow the format; the graph must still end within its caps
    and its state must agree with the parsers and the env's format check."""
    testing = pytest.importorskip("drmas_graph.testing")
    if not hasattr(testing, "tiny_policy"):
        pytest.skip("drmas_graph.testing.tiny_policy is not available")
    policy = testing.tiny_policy(0)
    try:
        env = MathEnv(n_train=4, n_test=1)
        for task in env.tasks("train")[:2]:
            state = build_graph(PolicyChat(policy=policy), max_rounds=2).invoke(task.input)
            turns = state["transcript"]
            assert [t["agent"] for t in turns] == ["solver", "verifier"] * state["rounds"]
            assert 1 <= state["rounds"] <= 2
            assert state["answer"] == parse_answer(turns[-2]["text"])
            approved, _ = parse_verdict(turns[-1]["text"])
            assert state["verdict"] == {True: "approve", False: "reject", None: None}[approved]
            for turn in turns:
                valid = env.reply_is_valid(turn["agent"], turn["text"])
                assert valid == (parse_answer(turn["text"]) is not None if turn["agent"] == "solver"
                                 else parse_verdict(turn["text"])[0] is not None)
            assert env.score(task, state) in (0.0, 1.0)
    finally:
        policy.close()


# --- the CPU demo's checked app: planted answers, a verifier that works the problem out, per-agent rewards ---


def checked_env() -> CheckedMathEnv:
    return CheckedMathEnv(seed=0, n_train=80, n_test=20, difficulty=(1.0,))


def test_planted_answers_are_half_right_and_near_misses_otherwise():
    env = checked_env()
    for split in ("train", "test"):
        tasks = env.tasks(split)
        right = [t for t in tasks if t.input["proposed"] == t.answer]
        assert len(right) == len(tasks) // 2 and all(t.meta["planted_right"] for t in right)
        for task in tasks:
            if not task.meta["planted_right"]:
                off = int(task.input["proposed"]) - int(task.answer)
                assert off != 0 and abs(off) <= 3 and int(task.input["proposed"]) >= 0
    assert [t.id for t in env.tasks("test")] == [t.id for t in MathEnv(seed=0, n_train=80, n_test=20,
                                                                         difficulty=(1.0,)).tasks("test")]


def test_checked_graph_judges_the_planted_answer_then_the_solvers_and_revises_on_a_reject():
    # 3 + 4, planted 8: the verifier gets 7 (reject the planted), then 5 for the solver's 6 (reject: the solver
    # sees the checker's 5), then 7 for the solver's 7 (approve) -> end
    llm = scripted(["The answer is 6.", "The answer is 7."], ["The answer is 7.", "5", "The answer is 7."])
    state = checked_graph.build_graph(llm, max_rounds=2).invoke({"question": "What is 3 + 4?", "proposed": "8"})
    assert [(t["agent"], t["round"], t.get("judged"), t.get("planted")) for t in state["transcript"]] == [
        ("solver", 1, None, None), ("verifier", 0, "8", True), ("verifier", 1, "6", False),
        ("solver", 2, None, None), ("verifier", 2, "7", False)]
    assert llm.calls[1] == ("verifier", "Question: What is 3 + 4?")  # it never sees the answer it judges
    shown = scripted(["The answer is 6."], ["The answer is 8.", "6"])
    checked_graph.build_graph(shown, max_rounds=1, show_answer=True).invoke({"question": "Q", "proposed": "8"})
    assert [c[1] for c in shown.calls[1:]] == ["Question: Q\nProposed answer: 8", "Question: Q\nProposed answer: 6"]
    assert llm.calls[3][1] == "What is 3 + 4?\nYour previous answer: 6\nA checker got 5.\nTry again."
    assert (state["answer"], state["verdict"], state["rounds"]) == ("7", "approve", 2)
    task = Task(id="t", input={}, answer="7")
    assert verdicts(task, state) == [(False, False, True), (False, False, False), (True, True, False)]
    reward = checked_env().reward(task, type("E", (), {"final_state": state})())
    # rejected the planted 8 with the right 7 (1), the solver's 6 with a wrong 5 (0.5), approved the right 7 (1)
    assert reward == {"solver": 1.0, "verifier": pytest.approx(2.5 / 3)}
    state["transcript"][2]["text"] = "The answer is 6."  # had it approved the wrong 6: 1 + 0 + 1
    reward = checked_env().reward(task, type("E", (), {"final_state": state})())
    assert reward == {"solver": 1.0, "verifier": pytest.approx(2 / 3)}


@pytest.mark.parametrize("judged, reply, paid", [
    ("7", "The answer is 7.", 1.0),   # approves a right answer
    ("8", "The answer is 7.", 1.0),   # rejects a wrong answer with the right number
    ("8", "The answer is 3.", 0.5),   # rejects a wrong answer, but its correction is wrong (an echo of 3 + 4)
    (None, "The answer is 3.", 0.5),  # an unreadable solver answer is a wrong one
    ("8", "The answer is 8.", 0.0),   # approves a wrong answer
    ("7", "The answer is 3.", 0.0),   # rejects a right answer
    ("8", "Yes or No", 0.0),          # no number: no verdict
])
def test_verdict_reward(judged, reply, paid):
    task = Task(id="t", input={"question": "What is 3 + 4?"}, answer="7")
    assert verdict_reward(task, {"agent": "verifier", "text": reply, "judged": judged, "planted": False}) == paid


def test_checked_verifier_echoing_its_instruction_is_no_verdict_and_invalid():
    llm = scripted(["The answer is 7."], ["The answer is 7.", "Yes or No"])
    state = checked_graph.build_graph(llm, max_rounds=2).invoke({"question": "What is 3 + 4?", "proposed": "7"})
    assert state["verdict"] is None and state["rounds"] == 1  # no verdict ends the episode, no extra turn
    task = Task(id="t", input={}, answer="7")
    assert verdicts(task, state) == [(True, True, True), (True, None, False)]
    env = checked_env()
    assert env.reward(task, type("E", (), {"final_state": state})()) == {"solver": 1.0, "verifier": 0.5}
    assert not env.reply_is_valid("verifier", "Yes or No") and env.reply_is_valid("verifier", "The answer is 7.")
    assert not env.reply_is_valid("solver", "3 + 4 = 7")


def _episode(task_id: str, *turns: tuple[str, str, str | None, bool | None]) -> Any:
    """A hand-made evaluation episode: (agent, reply, judged, planted) per turn."""
    transcript = [{"agent": a, "round": 0, "text": text, **({} if a == "solver" else
                                                              {"judged": judged, "planted": planted})}
                  for a, text, judged, planted in turns]
    return type("Ep", (), {"task_id": task_id, "final_state": {"transcript": transcript}})()


def hand_made_eval() -> tuple[dict[str, Task], list[Any]]:
    tasks = {"t1": Task(id="t1", input={}, answer="7"), "t2": Task(id="t2", input={}, answer="4")}
    a7, a5, a4 = "The answer is 7.", "The answer is 5.", "The answer is 4."
    episodes = [
        _episode("t1", ("solver", a7, None, None), ("verifier", a7, "7", True), ("verifier", a7, "7", False)),
        _episode("t1", ("solver", "I think 8", None, None), ("verifier", "Yes or No", "7", True),
                 ("verifier", a7, None, False)),
        _episode("t2", ("solver", a5, None, None), ("verifier", a5, "5", True), ("verifier", a4, "5", False),
                 ("solver", a4, None, None), ("verifier", a4, "4", False)),
        _episode("t2", ("solver", a7, None, None), ("verifier", a7, "5", True), ("verifier", a7, "7", False)),
        _episode("t2", ("solver", a5, None, None), ("verifier", a5, "5", True)),
    ]
    return tasks, episodes


def test_agent_rates_on_hand_made_episodes():
    rates = agent_rates(*hand_made_eval())
    solver, verifier = rates["solver"], rates["verifier"]
    # solver replies: 7 (right), "I think 8" (no number), 5 (wrong), 4 (right), 7 (wrong on t2), 5 (wrong)
    assert (solver.replies, solver.format_rate, solver.skill) == (6, 5 / 6, 2 / 5)
    # final answers: t1 7 right, none wrong -> 1/2; t2 4 right, 7 and 5 wrong -> 1/3; pass 1
    assert (solver.avg_k, solver.pass_k) == (pytest.approx((1 / 2 + 1 / 3) / 2), 1.0)
    # 4 distinct; "The answer is 7." twice of 6 (as often as 5, but on two tasks: t1 (right) and t2 (wrong))
    assert (solver.tasks, solver.distinct, solver.top_reply, solver.top_share) == (2, 4, "The answer is 7.", 2 / 6)
    assert (solver.top_tasks, solver.top_right_tasks) == (2, 1)
    assert solver.tpr is None and solver.balanced_accuracy is None
    # verifier: 10 replies, 9 with a number; right verdicts: e1 2, e2 1 (reject of an unreadable answer),
    # e3 2 (approved the wrong planted 5), e4 1 (approved the wrong 7), e5 0 (copied the wrong planted 5) -> 6 of 9
    assert (verifier.replies, verifier.format_rate, verifier.skill) == (10, 9 / 10, 6 / 9)
    # all verdicts right only in e1 -> t1 0.5, t2 0 -> avg 0.25, pass 0.5
    assert (verifier.avg_k, verifier.pass_k) == (0.25, 0.5)
    # "The answer is 7." 5 of 10: t1 right every time, t2 once wrong
    assert (verifier.distinct, verifier.top_share, verifier.top_tasks, verifier.top_right_tasks) == (4, 0.5, 2, 1)
    # right answers judged: 7, 7, 7 (echo: not approved), 4 -> TPR 3/4; wrong readable ones: 5 (approved),
    # 5 (rejected), 5 (rejected), 7 (approved), 5 (approved) -> TNR 2/5; the unreadable solver answer is left out
    assert (verifier.tpr, verifier.tnr) == (0.75, 0.4) and verifier.balanced_accuracy == pytest.approx(0.575)


def test_eval_rates_reads_a_run_folder_and_the_table_shows_both_steps(tmp_path):
    import json
    import sqlite3

    env = checked_env()
    test = env.tasks("test")
    (tmp_path / "config.yaml").write_text("env_kwargs: {seed: 0, n_train: 80, n_test: 20, difficulty: [1.0]}\n"
                                          "eval: {k: 1}\n")
    conn = sqlite3.connect(tmp_path / "traces.db")
    conn.execute("CREATE TABLE episodes (id TEXT, task_id TEXT, group_id TEXT, final_state TEXT)")
    right = {"transcript": [{"agent": "solver", "round": 1, "text": f"The answer is {test[0].answer}."},
                            {"agent": "verifier", "round": 1, "text": "No", "judged": test[0].answer,
                             "planted": False}]}
    wrong = {"transcript": [{"agent": "solver", "round": 1, "text": "Yes"},
                            {"agent": "verifier", "round": 1, "text": "Yes", "judged": None, "planted": False}]}
    rows = [("a", test[0].id, f"eval:0:{test[0].id}", json.dumps(wrong)),
            ("b", test[0].id, "train:0:x", json.dumps(right)),  # a training episode: not counted
            ("c", test[0].id, f"eval:12:{test[0].id}", json.dumps(right))]
    conn.executemany("INSERT INTO episodes VALUES (?, ?, ?, ?)", rows)
    conn.commit()
    conn.close()
    by_step = eval_rates(tmp_path)
    assert sorted(by_step) == [0, 12]
    assert (by_step[0]["solver"].format_rate, by_step[12]["solver"].skill, by_step[12]["solver"].avg_k) == (0, 1, 1)
    assert by_step[12]["verifier"].tpr == 0.0 and by_step[12]["verifier"].format_rate == 0.0
    table = rates_table(by_step, k=1)
    assert f"  {'avg@1':<32}{'0.000':>10}{'1.000':>10}" in table.splitlines()
    assert "top reply of solver at step 12: 'The answer is " in table


def test_seeds_table_gives_mean_and_range_over_runs():
    from graphs.math.report import seeds_table

    rates = agent_rates(*hand_made_eval())
    worse = {a: r.__class__(**{**r.__dict__, "skill": r.skill - 0.5}) for a, r in rates.items()}
    table = seeds_table({"s0": {0: worse, 12: rates}, "s1": {0: rates, 12: rates}})
    lines = table.splitlines()
    assert lines[0] == "2 runs (s0, s1): mean [min, max]"
    # solver skill: first evaluation -0.1 and 0.4 -> mean 0.15; last 0.4 and 0.4
    assert f"  {'skill':<24}{'0.150 [-0.10, 0.40]':>24}{'0.400 [0.40, 0.40]':>24}" in lines
    assert f"  {'balanced accuracy':<24}{'0.575 [0.57, 0.57]':>24}{'0.575 [0.57, 0.57]':>24}" in lines


def test_criteria_compare_the_first_and_last_evaluation():
    from graphs.math.report import criteria

    rates = agent_rates(*hand_made_eval())
    better = {a: r.__class__(**{**r.__dict__, "skill": r.skill + 0.1, "avg_k": r.avg_k + 0.1,
                                "tpr": None if r.tpr is None else r.tpr + 0.1}) for a, r in rates.items()}
    checks = criteria({0: rates, 12: better})
    # the hand-made top replies go to 2 of 2 tasks and are right on 1: a collapse by the rule
    assert checks == {"avg@k rises": True, "pass@k does not fall": True, "solver skill rises": True,
                      "solver no one-reply collapse": False, "verifier skill rises": True,
                      "verifier no one-reply collapse": False, "verifier balanced accuracy rises": True}
    assert not criteria({0: better, 12: rates})["verifier balanced accuracy rises"]


def test_criteria_call_a_verifier_that_approves_everything_no_rise():
    from graphs.math.report import criteria

    rates = agent_rates(*hand_made_eval())
    stamp = {**rates, "verifier": rates["verifier"].__class__(**{**rates["verifier"].__dict__, "tpr": 1.0, "tnr": 0.0})}
    low = {**rates, "verifier": rates["verifier"].__class__(**{**rates["verifier"].__dict__, "tpr": 0.5, "tnr": 0.49})}
    assert stamp["verifier"].balanced_accuracy > low["verifier"].balanced_accuracy
    assert not criteria({0: low, 12: stamp})["verifier balanced accuracy rises"]
