"""LangGraph's Functional API (`@entrypoint` / `@task`) in rollouts and training: no deadlock at any
`max_concurrency`, sync or async entrypoints and tasks; globs over task paths behave like globs over nodes."""

import re
import threading

import pytest
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.func import entrypoint, task

from drmas_graph import SamplingParams, UnknownAgentError, instrument
from drmas_graph.config import RolloutConfig
from drmas_graph.env import Task
from drmas_graph.testing import scripted_policy, tiny_policy
from drmas_graph.train.loop._rollouts import EpisodeJob, run_episodes
from drmas_graph.train.loop.trainer import train_graph
from tests.test_instrument import Unreachable
from tests.test_trainer import small_config

HANG_S = 180
"""A run that has not finished after this long is hung (each run here takes a few seconds, also on a busy CPU)."""


def finishes(fn, timeout=HANG_S):
    """fn()'s result; fails the test instead of hanging when fn deadlocks."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"did not finish within {timeout} s: deadlocked")
    if "error" in out:
        raise out["error"]
    return out["value"]


def essay_app(llm, *, sync_entry: bool, sync_task: bool):
    """An essay workflow as the Functional API docs write it: the entrypoint calls a `write` task."""
    if sync_task:
        @task
        def write(topic):
            return llm.invoke([HumanMessage(f"write about {topic}")]).content
    else:
        @task
        async def write(topic):
            return (await llm.ainvoke([HumanMessage(f"write about {topic}")])).content

    if sync_entry:
        @entrypoint(checkpointer=InMemorySaver())
        def essay_workflow(topic):
            return write(topic).result()  # blocks this thread until the task ran on another one
    else:
        @entrypoint(checkpointer=InMemorySaver())
        async def essay_workflow(topic):
            return await write(topic)
    return essay_workflow


@pytest.mark.parametrize("max_concurrency", [1, 2, 8])
@pytest.mark.parametrize("sync_entry,sync_task", [(True, True), (True, False), (False, True), (False, False)])
def test_functional_api_episodes_never_deadlock(max_concurrency, sync_entry, sync_task):
    # Before the fix the loop's executor had max_concurrency threads: with that many sync entrypoints in
    # flight, each held a thread and waited on a task queued behind them (no error, no timeout).
    policy = scripted_policy(lambda prompt: "essay on " + prompt.rsplit("write about ", 1)[1].split("<")[0])
    app = instrument(essay_app(Unreachable(), sync_entry=sync_entry, sync_task=sync_task), {"writer": policy},
                     agents={"essay_workflow/*": "writer"}, strict=True)
    jobs = [EpisodeJob(Task(id=f"t{i}", input=f"topic {i}"), f"g{i // 2}", i // 2, i % 2) for i in range(8)]
    batch = finishes(lambda: run_episodes(app, jobs, phase="train", step=0, run_seed=0,
                                          max_concurrency=max_concurrency, rollout=RolloutConfig()))
    assert batch.counts["interrupted_episodes"] == 0 and set(batch.counts.values()) == {0}  # nothing failed or cut
    assert [ep.final_state for _, ep in batch.runs] == [f"essay on topic {i}" for i in range(8)]
    for _, ep in batch.runs:
        assert [(t.agent, t.node, t.call_key) for t in ep.turns] == [
            ("writer", "essay_workflow/write", "essay_workflow/write[0]")]


class EssayEnv:
    def tasks(self, split):
        return [Task(id=f"{split}-{i}", input=f"topic {i}") for i in range(4)]

    def reward(self, task, episode):
        return float(episode.turns[0].response_ids[0] % 2)


def test_train_graph_on_a_sync_entrypoint_at_max_concurrency_2(tmp_path):
    """The issue's report: train_graph on a sync @entrypoint hung forever."""
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=3))
    graph = essay_app(Unreachable(), sync_entry=True, sync_task=True)
    cfg = small_config(tmp_path, steps=2, max_concurrency=2, node_agents={"*write": "writer"},
                       eval={"k": 1, "n_tasks": 1, "before_training": False})
    result = finishes(lambda: train_graph(graph, EssayEnv(), cfg, policies={"writer": policy}))
    assert [r["episodes"] + r["failed_episodes"] for r in result.history] == [8, 8]
    assert [r["failed_episodes"] for r in result.history] == [0, 0]
    assert all(r["agent/writer/calls"] == 8 for r in result.history)


def test_globs_over_task_paths_work_like_globs_over_node_paths(policy):
    graph = essay_app(Unreachable(), sync_entry=True, sync_task=True)
    for pattern in ("*write", "essay_workflow/write", "essay_*/w*", "*/write", "*"):
        episode = instrument(graph, {"writer": policy}, agents={pattern: "writer"}, strict=True).rollout(
            "cats", {"configurable": {"thread_id": pattern}})
        assert [(t.agent, t.node) for t in episode.turns] == [("writer", "essay_workflow/write")], pattern
    for typo in ("essay_flow/*", "write", "writer/*"):  # can match no path under any node: refused at once
        with pytest.raises(UnknownAgentError, match=re.escape(f"pattern {typo!r} (agent 'writer') matches no node")):
            instrument(graph, {"writer": policy}, agents={typo: "writer"})
    # a glob that could match a task path is accepted; when no call matched it, the first episode says so
    app = instrument(graph, {"writer": policy, "essay_workflow/write": policy}, agents={"*wrote": "writer"})
    with pytest.warns(UserWarning, match=re.escape("agents: ['*wrote'] matched no LLM call in the first episode; "
                                                   "calls came from node paths ['essay_workflow/write']")):
        episode = app.rollout("cats", {"configurable": {"thread_id": "typo"}})
    assert [t.agent for t in episode.turns] == ["essay_workflow/write"]


def test_a_functional_api_app_that_asks_a_human_is_resumed_stored_and_replayed(tmp_path):
    from langgraph.types import interrupt

    from drmas_graph import TraceStore
    from drmas_graph.traces.replay import replay

    llm = Unreachable()

    @task
    def write(topic):
        return llm.invoke([HumanMessage(f"write about {topic}")]).content

    @task
    def revise(essay, note):
        return llm.invoke([HumanMessage(f"revise '{essay}': {note}")]).content

    @entrypoint(checkpointer=InMemorySaver())
    def essay_workflow(topic):
        essay = write(topic).result()
        note = interrupt({"essay": essay})  # the run stops; the task's result is kept in the checkpoint
        return revise(essay, note).result()

    policy = scripted_policy(["a draft", "the revision"])
    with TraceStore(tmp_path / "t.db") as store:
        app = instrument(essay_workflow, {"writer": policy}, agents={"*write": "writer", "*revise": "writer"},
                         strict=True, store=store)
        episode = finishes(lambda: app.rollout("cats", {"configurable": {"thread_id": "e"}},
                                               resume=lambda ep, its: f"shorter than {its[0].value['essay']!r}"))
    assert [(t.node, t.segment, t.response_text) for t in episode.turns] == [
        ("essay_workflow/write", 0, "a draft"), ("essay_workflow/revise", 1, "the revision")]  # write ran once
    assert episode.turns[1].messages[-1].content == "revise 'a draft': shorter than 'a draft'"
    assert episode.final_state == "the revision"
    assert episode.segments[0].interrupts == ({"node": "essay_workflow", "id": episode.segments[0].interrupts[0]["id"],
                                               "value": {"essay": "a draft"}},)
    result = replay(essay_workflow, tmp_path / "t.db", episode.id)
    assert result.divergences == [] and result.state_matches and result.final_state == "the revision"


def test_an_interrupt_in_a_task_is_reported_at_the_task_path(tmp_path):
    """The thread's state shows a `@task`'s interrupt at its entrypoint only; the README promises the node path of
    the task that called `interrupt()`: 'essay_workflow/review', in the error, the segments and replay."""
    from langgraph.types import interrupt

    from drmas_graph import EpisodeInterruptedError, TraceStore
    from drmas_graph.traces.replay import replay

    llm = Unreachable()

    @task
    def write(topic):
        return llm.invoke([HumanMessage(f"write about {topic}")]).content

    @task
    def review(essay):  # resumed, the task runs again: its second interrupt is raised under the same namespace
        return interrupt({"essay": essay}) + " " + interrupt({"again": essay})

    @entrypoint(checkpointer=InMemorySaver())
    def essay_workflow(topic):
        essay = write(topic).result()
        return f"{essay} ({review(essay).result()})"

    app = instrument(essay_workflow, {"writer": scripted_policy(["a draft"])}, agents={"*write": "writer"},
                     strict=True)
    with pytest.raises(EpisodeInterruptedError, match=re.escape(
            "interrupted at node 'essay_workflow/review' (value {'essay': 'a draft'})")):
        finishes(lambda: app.rollout("cats", {"configurable": {"thread_id": "paused"}}))
    with TraceStore(tmp_path / "t.db") as store:
        app = instrument(essay_workflow, {"writer": scripted_policy(["a draft"])}, agents={"*write": "writer"},
                         strict=True, store=store)
        episode = finishes(lambda: app.rollout("cats", {"configurable": {"thread_id": "e"}},
                                               resume=lambda ep, its: f"ok{len(ep.segments)}"))
    assert [[(r["node"], r["value"]) for r in s.interrupts] for s in episode.segments] == [
        [("essay_workflow/review", {"essay": "a draft"})], [("essay_workflow/review", {"again": "a draft"})], []]
    assert episode.final_state == "a draft (ok1 ok2)"
    result = replay(essay_workflow, tmp_path / "t.db", episode.id)
    assert result.divergences == [] and result.state_matches
