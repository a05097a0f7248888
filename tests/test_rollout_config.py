"""Per-episode config and limits (config `rollout`, `train_graph(rollout_config=...)`): checkpointed graphs,
recursion_limit, caps on LLM calls and wall time (episodes they stop are truncated and trained on), the default
caps, masking truncated episodes, and the backstop for an episode stuck between LLM calls."""

import asyncio
import threading
import time

import pytest
from langchain_core.messages import HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import MemorySaver
from langgraph.graph import END, START, StateGraph

from drmas_graph import SamplingParams
from drmas_graph.config import TrainConfig
from drmas_graph.instrumentation._limits import StuckEpisodeError
from drmas_graph.env import Task
from drmas_graph.errors import ConfigError, RolloutError
from drmas_graph.traces.store import TraceStore
from drmas_graph.testing import tiny_policy
from drmas_graph.train.loop._rollouts import roll_out
from drmas_graph.train.loop.trainer import Trainer, train_graph
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


def _stored(tmp_path, **filters):
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        return [store.load_episode(e.id) for e in store.episodes(**filters)]


def test_llm_call_cap_truncates_looping_episodes_and_trains_them(tmp_path):
    policy = _policy()
    env = LoopEnv(["easy one", "hard one"])  # easy ends after 2 calls; hard loops until the cap
    cfg = _cfg(tmp_path, tasks_per_step=2, group_size=2, rollout={"max_llm_calls": 5})
    result = train_graph(_judge_loop(Unreachable()), env, cfg, policies={"solver": policy, "judge": policy})
    rec = result.history[0]
    assert rec["failed_episodes"] == 0 and rec["episodes"] == 4
    assert rec["truncated_episodes"] == rec["truncated/max_llm_calls"] == 2
    # samples: 2 x 2 calls of the easy group + 2 x 5 of the hard one; 10 of 14 come from truncated episodes
    assert rec["samples/truncated_share"] == pytest.approx(10 / 14)
    truncated = [ep for ep in _stored(tmp_path, step=0) if ep.truncated]
    assert len(truncated) == 2 and all(ep.task_id == "train-1" and ep.error is None for ep in truncated)
    assert all(len(ep.turns) == 5 and ep.truncated.startswith("max_llm_calls: ") for ep in truncated)
    assert all("rollout.max_llm_calls=5" in ep.truncated for ep in truncated)
    assert all([t.index for t in ep.turns] == [0, 1, 2, 3, 4] for ep in truncated)  # the refused 6th call: no turn
    assert all(ep.turn_rewards == [0.0] * 5 for ep in truncated)  # rollout.truncated_reward (0.0), env not asked


def test_an_app_that_swallows_the_limit_error_still_truncates_the_episode(tmp_path):
    policy = _policy()
    env = LoopEnv(["hard", "hard too"])
    cfg = _cfg(tmp_path, tasks_per_step=2, group_size=2, rollout={"max_llm_calls": 3})
    result = train_graph(_judge_loop(Unreachable(), swallow=True), env, cfg,
                         policies={"solver": policy, "judge": policy})
    rec = result.history[0]
    assert rec["truncated_episodes"] == 4 and rec["episodes"] == 4 and rec["failed_episodes"] == 0
    stored = _stored(tmp_path, step=0)
    assert all(ep.truncated_by == "max_llm_calls" and "rollout.max_llm_calls=3" in ep.truncated for ep in stored)
    assert all(ep.final_state["verdict"] == "fallback" and len(ep.turns) == 3 for ep in stored)  # the graph ended


def test_recursion_limit_truncates_every_episode_that_reaches_it(tmp_path):
    policy = _policy()
    cfg = _cfg(tmp_path, tasks_per_step=1, group_size=2, rollout={"recursion_limit": 3})
    result = train_graph(_judge_loop(Unreachable()), LoopEnv(["hard"]), cfg,
                         policies={"solver": policy, "judge": policy})
    assert result.history[0]["truncated/recursion_limit"] == 2
    stored = _stored(tmp_path, step=0)
    assert len(stored) == 2 and all(len(ep.turns) == 3 and ep.truncated_by == "recursion_limit" for ep in stored)
    assert all("Recursion limit of 3" in ep.truncated for ep in stored)
    # the state after the 3 supersteps (solver, judge, solver) the limit allowed (issue 58: None before)
    assert all(ep.final_state["rounds"] == 2 and ep.final_state["question"] == "hard" for ep in stored)


def test_wall_time_cap_truncates_a_looping_episode_at_its_next_call(tmp_path):
    policy = _policy()
    cfg = _cfg(tmp_path, tasks_per_step=1, group_size=2,
               rollout={"timeout_s": 0.3, "recursion_limit": 100_000, "max_llm_calls": None})
    result = train_graph(_judge_loop(Unreachable()), LoopEnv(["hard"]), cfg,
                         policies={"solver": policy, "judge": policy})
    assert result.history[0]["truncated/timeout_s"] == 2
    stored = _stored(tmp_path, step=0)
    assert all(ep.truncated_by == "timeout_s" and "rollout.timeout_s=0.3" in ep.truncated for ep in stored)
    assert all(ep.turns for ep in stored)  # it ran until a call found the time was up


def test_mask_truncated_drops_the_episodes_of_the_limits_it_names(tmp_path):
    policy = _policy()
    env = LoopEnv(["easy one", "hard one"])
    for mask, kept in ((True, 2), (["timeout_s"], 4), (["max_llm_calls"], 2)):
        run = tmp_path / str(mask)
        cfg = _cfg(run, tasks_per_step=2, group_size=2, rollout={"max_llm_calls": 5, "mask_truncated": mask})
        rec = train_graph(_judge_loop(Unreachable()), env, cfg, policies={"solver": policy, "judge": policy}).history[0]
        assert rec["episodes"] == kept and rec["truncated_episodes"] == 2
        assert rec["masked_truncated_episodes"] == 4 - kept
        assert rec["samples/truncated_share"] == (0.0 if kept == 2 else pytest.approx(10 / 14))


def test_the_default_caps_bound_an_app_that_loops_forever(tmp_path, caplog):
    rollout = TrainConfig().rollout
    assert (rollout.max_llm_calls, rollout.timeout_s, rollout.truncated_reward) == (50, 1800.0, 0.0)
    policy = _policy()
    cfg = _cfg(tmp_path, tasks_per_step=1, group_size=1)  # no rollout section: the defaults
    result = train_graph(_judge_loop(Unreachable()), LoopEnv(["hard"]), cfg,
                         policies={"solver": policy, "judge": policy})
    assert result.history[0]["truncated/max_llm_calls"] == 1
    (episode,) = _stored(tmp_path, step=0)
    assert len(episode.turns) == 50 and "rollout.max_llm_calls=50" in episode.truncated
    assert "step 0: 1 of 1 episodes did not finish: 1 truncated (max_llm_calls 1;" in caplog.text  # one warning


def test_wall_time_cap_cancels_an_episode_stuck_between_calls_and_stores_it(tmp_path):
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
    assert isinstance(info.value.__cause__, StuckEpisodeError)
    stored = _stored(tmp_path, outcome="failed")
    assert len(stored) == 2 and all(len(ep.turns) == 1 and "stuck in a node" in ep.error for ep in stored)


def test_a_sync_node_blocked_in_a_tool_costs_its_episode_not_the_step(tmp_path, caplog):
    """rev3_d: the backstop cancels the stuck episode, and the step does not wait for its thread (asyncio.run
    would join it, forever for a tool that never returns)."""
    release = threading.Event()
    llm = Unreachable()

    def solver(state):
        answer = llm.invoke([HumanMessage(state["question"])]).content
        if state["question"] == "slow":
            release.wait(120)  # a blocking tool call (an HTTP request without a timeout, a subprocess, ...)
        return {"answer": answer}

    g = StateGraph(_graphs.QA)
    g.add_node("solver", solver)
    g.add_edge(START, "solver")
    g.add_edge("solver", END)
    env = LoopEnv(["fast", "slow"])
    cfg = _cfg(tmp_path, tasks_per_step=2, group_size=1, max_concurrency=2, rollout={"timeout_s": 1.0})
    policy = _policy()
    trainer = Trainer(g.compile(), env, cfg, policies={"solver": policy})
    try:
        start = time.perf_counter()
        run = trainer.state
        batch = roll_out(run.app, env, env.train, 0, 1, phase="train", seed=cfg.seed, rollout=cfg.rollout,
                         base_config=run.rollout_config, slots=run.episode_slots)
        elapsed = time.perf_counter() - start
    finally:
        release.set()
        trainer.close()
    assert elapsed < 60  # a hang bound (the tool blocks for 120 s), not a speed measurement
    assert [task.id for task, _ in batch.runs] == ["train-0"] and batch.counts["failed_episodes"] == 1
    (error,) = batch.errors
    assert isinstance(error, StuckEpisodeError) and "'train-1'" in str(error)
    assert "left behind" in caplog.text
    (stuck,) = _stored(tmp_path, outcome="failed")
    assert stuck.task_id == "train-1" and len(stuck.turns) == 1 and "rollout.timeout_s=1" in stuck.error


def test_train_graph_keyword_async_underscore_is_the_async_section():
    """`train_graph(..., async_={...})` (the Python spelling of the `async` section) and `async__max_staleness=`
    set the section; before, the override landed beside the dumped `async` key and was refused as extra."""
    from drmas_graph.config import merge_overrides

    assert merge_overrides(None, {"async_": {"max_staleness": 1}}).async_.max_staleness == 1
    assert merge_overrides(None, {"async__max_staleness": 2}).async_.max_staleness == 2
    cfg = merge_overrides(None, {"async_": {"max_staleness": 1, "schedule": "free"}, "steps": 3})
    assert (cfg.async_.max_staleness, cfg.async_.schedule, cfg.steps) == (1, "free", 3)
