"""Per-episode config and limits (config `rollout`, `train_graph(rollout_config=...)`): checkpointed graphs,
recursion_limit, caps on LLM calls and wall time, and what a step does when every episode fails."""

import asyncio

import pytest
from langchain_core.messages import HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import MemorySaver
from langgraph.errors import GraphRecursionError
from langgraph.graph import END, START, StateGraph

from drmas_graph import SamplingParams
from drmas_graph.instrumentation._limits import EpisodeLimitError
from drmas_graph.env import Task
from drmas_graph.errors import ConfigError, RolloutError
from drmas_graph.traces.store import TraceStore
from drmas_graph.testing import tiny_policy
from drmas_graph.train.trainer import train_graph
from tests import _graphs
from tests._envs import ParityEnv
from tests.test_instrument import Unreachable
from tests.test_trainer import small_config


def _policy():
    return tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=3))


def _cfg(tmp_path, **kw):
    kw.setdefault("eval", {"k": 1, "n_tasks": 1, "before_training": False})
    return small_config(tmp_path, steps=1, **kw)


def _judge_loop(llm, *, swallow=False, rounds_if_easy=1):
    """solver -> judge -> solver ... : an untrained judge never approves, so a hard task loops forever;
    an 'easy' task ends after `rounds_if_easy` rounds. With `swallow`, the judge's node catches every exception
    (as apps do) and ends the episode."""

    def solver(state):
        return {"answer": llm.invoke([HumanMessage(state["question"])]).content, "rounds": state.get("rounds", 0) + 1}

    def judge(state):
        try:
            verdict = llm.invoke([HumanMessage(f"{state['question']} -> {state['answer']}")]).content
        except Exception:  # noqa: BLE001 - what a defensive app does
            if swallow:
                return {"verdict": "fallback", "done": True}
            raise
        return {"verdict": verdict}

    def route(state):
        if state.get("done") or (state["question"].startswith("easy") and state["rounds"] >= rounds_if_easy):
            return END
        return "solver"

    g = StateGraph(Loop)
    g.add_node("solver", solver)
    g.add_node("judge", judge)
    g.add_edge(START, "solver")
    g.add_edge("solver", "judge")
    g.add_conditional_edges("judge", route, ["solver", END])
    return g.compile()


class Loop(_graphs.QA, total=False):
    rounds: int
    done: bool


class LoopEnv(ParityEnv):
    def __init__(self, questions):
        super().__init__()
        self.train = [Task(id=f"train-{i}", input={"question": q}) for i, q in enumerate(questions)]
        self.test = self.train[:1]

    def turn_is_valid(self, task, turn):
        return True


def test_checkpointed_graph_trains_with_one_thread_per_episode(tmp_path):
    seen = []

    def solver(state, config: RunnableConfig):
        seen.append((config["configurable"]["thread_id"], config["configurable"]["user_key"],
                     config["recursion_limit"]))
        return {"answer": llm.invoke([HumanMessage(state["question"])]).content}

    llm = Unreachable()
    g = StateGraph(_graphs.QA)
    g.add_node("solver", solver)
    g.add_node("verifier", lambda s: {"verdict": llm.invoke([HumanMessage(s["answer"])]).content})
    g.add_edge(START, "solver")
    g.add_edge("solver", "verifier")
    g.add_edge("verifier", END)
    app = g.compile(checkpointer=MemorySaver())  # without a thread_id every invoke raises
    policy = _policy()
    cfg = _cfg(tmp_path, rollout={"recursion_limit": 7})
    result = train_graph(app, ParityEnv(), cfg, policies={"solver": policy, "verifier": policy},
                         rollout_config={"configurable": {"user_key": "k"}})
    rec = result.history[0]
    assert rec["episodes"] == 8 and rec["failed_episodes"] == 0 and policy.version == 1
    train_threads = [t for t, *_ in seen[:8]]
    assert len(set(t for t, *_ in seen)) == len(seen) == 9  # 8 training + 1 eval episode, one thread each
    assert {(k, r) for _, k, r in seen} == {("k", 7)}
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        stored = {store.load_episode(e.id).metadata["thread_id"] for e in store.episodes(step=0)}
    assert stored == set(train_threads)
    assert all(app.get_state({"configurable": {"thread_id": t}}).values["verdict"] for t in train_threads)


def test_a_shared_thread_id_is_refused_at_construction(tmp_path):
    policy = _policy()
    with pytest.raises(ConfigError, match="thread_id"):
        train_graph(_graphs.solver_verifier(Unreachable()).compile(), ParityEnv(), _cfg(tmp_path),
                    policies={"solver": policy, "verifier": policy},
                    rollout_config={"configurable": {"thread_id": "one-for-all"}})
    with pytest.raises(ValueError, match="thread_id is set per episode"):
        _cfg(tmp_path, rollout={"configurable": {"thread_id": "x"}})


def test_llm_call_cap_stops_looping_episodes_and_counts_them_failed(tmp_path):
    policy = _policy()
    env = LoopEnv(["easy one", "hard one"])  # easy ends after 2 calls; hard loops until the cap
    cfg = _cfg(tmp_path, tasks_per_step=2, group_size=2, rollout={"max_llm_calls": 5})
    result = train_graph(_judge_loop(Unreachable()), env, cfg, policies={"solver": policy, "judge": policy})
    rec = result.history[0]
    assert rec["failed_episodes"] == 2 and rec["episodes"] == 2
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        failed = [store.load_episode(e.id) for e in store.episodes(failed=True)]
    assert len(failed) == 2 and all(ep.task_id == "train-1" for ep in failed)
    assert all(len(ep.turns) == 5 and "rollout.max_llm_calls=5" in ep.error for ep in failed)


def test_an_app_that_swallows_the_limit_error_still_fails_the_episode(tmp_path):
    policy = _policy()
    env = LoopEnv(["hard", "hard too"])
    cfg = _cfg(tmp_path, tasks_per_step=2, group_size=2, rollout={"max_llm_calls": 3})
    with pytest.raises(RolloutError, match="all 4 episodes failed") as info:
        train_graph(_judge_loop(Unreachable(), swallow=True), env, cfg, policies={"solver": policy, "judge": policy})
    first = info.value.__cause__
    assert "EpisodeLimitError" in first.episode.error and "rollout.max_llm_calls=3" in first.episode.error
    assert first.episode.final_state["verdict"] == "fallback"  # the graph itself ended normally


def test_every_episode_stopped_stops_the_run_with_the_limit_error_chained(tmp_path):
    policy = _policy()
    cfg = _cfg(tmp_path, tasks_per_step=1, group_size=2, rollout={"max_llm_calls": 4, "recursion_limit": 1000})
    with pytest.raises(RolloutError, match="step 0: all 2 episodes failed") as info:
        train_graph(_judge_loop(Unreachable()), LoopEnv(["hard"]), cfg, policies={"solver": policy, "judge": policy})
    assert isinstance(info.value.__cause__.__cause__, EpisodeLimitError)


def test_recursion_limit_applies_to_every_episode(tmp_path):
    policy = _policy()
    cfg = _cfg(tmp_path, tasks_per_step=1, group_size=2, rollout={"recursion_limit": 3})
    with pytest.raises(RolloutError) as info:
        train_graph(_judge_loop(Unreachable()), LoopEnv(["hard"]), cfg, policies={"solver": policy, "judge": policy})
    first = info.value.__cause__
    assert isinstance(first.__cause__, GraphRecursionError) and len(first.episode.turns) == 3


def test_wall_time_cap_stops_a_looping_episode_at_its_next_call(tmp_path):
    policy = _policy()
    cfg = _cfg(tmp_path, tasks_per_step=1, group_size=2, rollout={"timeout_s": 0.3, "recursion_limit": 100_000})
    with pytest.raises(RolloutError) as info:
        train_graph(_judge_loop(Unreachable()), LoopEnv(["hard"]), cfg, policies={"solver": policy, "judge": policy})
    first = info.value.__cause__
    assert isinstance(first.__cause__, EpisodeLimitError) and "rollout.timeout_s=0.3" in first.episode.error
    assert first.episode.turns  # it ran until a call found the time was up


def test_wall_time_cap_cancels_an_episode_stuck_between_calls(tmp_path):
    llm = Unreachable()

    async def solver(state):
        return {"answer": (await llm.ainvoke([HumanMessage(state["question"])])).content}

    async def stuck(state):
        await asyncio.sleep(3600)  # a tool that never answers

    g = StateGraph(_graphs.QA)
    g.add_node("solver", solver)
    g.add_node("tool", stuck)
    g.add_edge(START, "solver")
    g.add_edge("solver", "tool")
    g.add_edge("tool", END)
    policy = _policy()
    cfg = _cfg(tmp_path, tasks_per_step=1, group_size=2, rollout={"timeout_s": 0.5})
    with pytest.raises(RolloutError, match="without starting another LLM call") as info:
        train_graph(g.compile(), ParityEnv(), cfg, policies={"solver": policy})
    assert isinstance(info.value.__cause__, EpisodeLimitError)
