"""Round 5 of attribution and replay (issue 40): across processes (set order), across rollouts of one thread
(resumed and time-travel starts, sub-agent memory), for every run method (streams), with the run's config and
context, with a node cache, with agents that share one prompt, and with an instrumented app nested in another."""

import asyncio
import operator
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, TypedDict

from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import HumanMessage
from langgraph.graph import END, START, StateGraph

from drmas_graph import instrument
from drmas_graph.instrumentation._seeds import call_seed, prompt_digest
from drmas_graph.testing import scripted_policy

ROOT = Path(__file__).resolve().parents[1]
llm = FakeListChatModel(responses=["the app's own model"])


class State(TypedDict, total=False):
    question: str
    log: Annotated[list, operator.add]
    votes: Annotated[list, operator.add]
    tags: set


def _one_node(fn, name="node", **compile_kwargs):
    b = StateGraph(State)
    b.add_node(name, fn)
    b.add_edge(START, name)
    b.add_edge(name, END)
    return b.compile(**compile_kwargs)


# ---- rev5_e: a set is stored in one order in every process --------------------------------------------------
def test_a_set_is_stored_in_the_same_order_whatever_the_hash_seed():
    code = ("from drmas_graph.traces._serde import to_json; "
            "print(to_json({'tags': {'billing', 'refund', 'urgent', 'escalate', 'policy'}}, 'state'))")
    outs = set()
    for seed in (1, 2, 3, 4):
        env = {**os.environ, "PYTHONHASHSEED": str(seed), "PYTHONPATH": str(ROOT)}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert outs == {'{"tags":["billing","escalate","policy","refund","urgent"]}'}


# ---- rev5_d: agents called at once with one prompt keep their own seeds ------------------------------------
def _voters(delays):
    async def vote(state):
        async def one(agent):
            await asyncio.sleep(delays[agent])
            reply = await llm.ainvoke([HumanMessage(state["question"])], config={"metadata": {"drmas_agent": agent}})
            return reply.content
        return {"votes": list(await asyncio.gather(one("voter_a"), one("voter_b")))}
    return _one_node(vote, "vote")


def test_same_prompt_calls_of_two_agents_keep_their_seeds_whatever_the_arrival_order():
    policy = scripted_policy(["yes"])
    seeds = []
    for delays in ({"voter_a": 0.0, "voter_b": 0.05}, {"voter_a": 0.05, "voter_b": 0.0}):
        app = instrument(_voters(delays), {"voter_a": policy, "voter_b": policy})
        episode = asyncio.run(app.arollout({"question": "Is 17 prime?"}, metadata={"seed": 7}))
        seeds.append({t.agent: t.sampling.seed for t in episode.turns})
    assert seeds[0] == seeds[1]
    assert seeds[0]["voter_a"] != seeds[0]["voter_b"]


def test_the_node_own_agent_keeps_the_seed_without_the_agent():
    """Calls routed by node path (every call of the CPU demo) keep the seed formula of earlier releases, so the
    demo's numbers do not move: H(episode seed, call_key, k, prompt digest)."""
    def ask(state):
        return {"log": [llm.invoke([HumanMessage(state["question"])]).content for _ in range(2)]}

    episode = instrument(_one_node(ask, "ask"), {"ask": scripted_policy(["a", "b"])}).rollout(
        {"question": "2+2?"}, metadata={"seed": 11})
    digest = prompt_digest(episode.turns[0].prompt_ids)
    assert [t.sampling.seed for t in episode.turns] == [call_seed(11, "ask", 0, digest), call_seed(11, "ask", 1, digest)]


# ---- rev5_h: a streamed run stores what invoke would have returned -------------------------------------------
def _solver():
    def solve(state):
        return {"log": [llm.invoke([HumanMessage(state["question"])]).content]}
    return _one_node(solve, "solve")


def _shape(chunk):
    """A chunk's form without the values that differ between the app's model and a policy."""
    if isinstance(chunk, tuple):
        return tuple(_shape(c) if isinstance(c, tuple) else type(c).__name__ if not isinstance(c, str) else c
                     for c in chunk)
    if isinstance(chunk, dict):
        return sorted(chunk) if "type" in chunk else sorted(chunk)
    return type(chunk).__name__


def test_streamed_runs_store_their_final_state_and_give_the_caller_its_own_chunks(tmp_path):
    from drmas_graph import TraceStore, replay

    graph = _solver()
    store = TraceStore(tmp_path / "traces.db")
    app = instrument(graph, {"solve": scripted_policy(["4"] * 10)}, store=store)
    variants = [{"stream_mode": "updates"}, {"stream_mode": ["updates", "custom"]}, {"stream_mode": "values"},
                {"stream_mode": "custom"}, {"stream_mode": "updates", "subgraphs": True},
                {"stream_mode": ["values"], "version": "v2"}, {}]
    for kwargs in variants:
        mine = list(app.stream({"question": "2+2?"}, **kwargs))
        plain = list(graph.stream({"question": "2+2?"}, **kwargs))
        assert [_shape(c) for c in mine] == [_shape(c) for c in plain], kwargs

    async def astreamed():
        async for _ in app.astream({"question": "2+2?"}, stream_mode="updates"):
            pass
        async for _ in app.astream_events({"question": "2+2?"}, version="v2"):
            pass
    asyncio.run(astreamed())
    episodes = [store.load_episode(s.id) for s in store.episodes()]
    assert len(episodes) == len(variants) + 2
    for episode in episodes:
        assert episode.final_state == {"question": "2+2?", "log": ["4"], "votes": []}  # invoke returns []
        assert replay(graph, store, episode.id).state_matches
    store.close()




def test_a_streamed_run_that_paused_stores_the_interrupt_as_invoke_returns_it(tmp_path):
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.types import interrupt

    from drmas_graph import TraceStore
    from drmas_graph.traces._compare import comparable

    def ask(state):
        return {"log": [llm.invoke([HumanMessage(state["question"])]).content, interrupt("why?")]}

    graph = _one_node(ask, "ask", checkpointer=InMemorySaver())
    with TraceStore(tmp_path / "traces.db") as store:
        app = instrument(graph, {"ask": scripted_policy(["-"])}, store=store)
        list(app.stream({"question": "q"}, {"configurable": {"thread_id": "t"}}, stream_mode="updates"))
        (summary,) = store.episodes()
        stored = store.load_episode(summary.id).final_state
    want = graph.invoke({"question": "q"}, {"configurable": {"thread_id": "u"}})
    assert "__interrupt__" in stored
    assert comparable(stored) == comparable(want)


# ---- rev5_a: the run's configurable values and context= are recorded and replayed --------------------------
def test_replay_runs_with_the_recorded_configurable_values_and_context(tmp_path):
    import dataclasses

    from langgraph.runtime import Runtime

    from drmas_graph import TraceStore, replay

    @dataclasses.dataclass
    class Ctx:
        user: str = "anonymous"

    def answer(state, config, runtime: Runtime[Ctx]):
        persona = config["configurable"].get("persona")
        return {"log": [llm.invoke([HumanMessage(f"{persona} greets {runtime.context.user}")]).content]}

    b = StateGraph(State, context_schema=Ctx)
    b.add_node("answer", answer)
    b.add_edge(START, "answer")
    b.add_edge("answer", END)
    graph = b.compile()
    client = object()  # a configurable value with no JSON form: named, not stored
    with TraceStore(tmp_path / "traces.db") as store:
        app = instrument(graph, {"answer": scripted_policy(["hi"] * 3)}, store=store)
        config = {"configurable": {"persona": "a pirate", "client": client}, "recursion_limit": 7}
        episode = app.rollout({"question": "?"}, config, context=Ctx(user="bob"))
        assert episode.turns[0].messages[0].content == "a pirate greets bob"
        app.invoke({"question": "?"}, config, context=Ctx(user="ann"))
        for summary in store.episodes():
            stored = store.load_episode(summary.id)
            assert stored.metadata["run_config"] == {"configurable": {"persona": "a pirate"}, "recursion_limit": 7,
                                                     "omitted": ["client"]}
            assert stored.metadata["context"]["user"] in ("bob", "ann")
            result = replay(graph, store, summary.id)
            assert result.divergences == [] and result.state_matches, [str(d) for d in result.divergences]
        overridden = replay(graph, store, episode.id, config={"configurable": {"persona": "a parrot"}})
        assert [d.kind for d in overridden.divergences] == ["prompt_changed"]  # the caller's config wins


# ---- rev5_b / rev5_g: the replay fork is the thread as the run found it -------------------------------------
def _review_graph(final_prompt, saver):
    from langgraph.graph import MessagesState
    from langgraph.types import interrupt

    def draft(state):
        return {"messages": [llm.invoke(state["messages"] + [HumanMessage("Draft a haiku.")])]}

    def review(state):
        note = interrupt({"draft": state["messages"][-1].content})
        return {"messages": [llm.invoke(state["messages"] + [HumanMessage(f"{final_prompt} {note}")])]}

    b = StateGraph(MessagesState)
    b.add_node("draft", draft)
    b.add_node("review", review)
    b.add_edge(START, "draft")
    b.add_edge("draft", "review")
    b.add_edge("review", END)
    return b.compile(checkpointer=saver)


def test_a_rollout_that_resumed_a_paused_thread_or_time_travelled_replays_its_resumed_node(tmp_path):
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.types import Command

    from drmas_graph import EpisodeInterruptedError, TraceStore, replay

    saver = InMemorySaver()
    graph = _review_graph("Revise it. Reviewer says:", saver)
    with TraceStore(tmp_path / "traces.db") as store:
        app = instrument(graph, {"draft": scripted_policy(["A long draft."]),
                                 "review": scripted_policy(["Short.", "Fine."], seed=1)}, store=store)
        thread = {"configurable": {"thread_id": "chat-1"}}
        try:
            app.rollout({"messages": [HumanMessage("Write a haiku.")]}, thread)
        except EpisodeInterruptedError:
            pass
        resumed = app.rollout(Command(resume="shorter please"), thread)
        assert resumed.metadata["thread_start"]["writes"] == [[resumed.metadata["thread_start"]["writes"][0][0],
                                                               "__interrupt__"]]
        same = replay(graph, store, resumed.id)
        assert same.divergences == [] and same.state_matches, [str(d) for d in same.divergences]
        edited = replay(_review_graph("Rewrite it completely. Reviewer says:", saver), store, resumed.id)
        assert [d.kind for d in edited.divergences] == ["prompt_changed"]
        assert "Rewrite it completely" in edited.divergences[0].diff

        before_review = next(s for s in app.get_state_history(thread) if s.next == ("review",))
        forked = app.rollout(Command(resume="fine"), before_review.config)
        assert forked.metadata["thread_start"]["superseded"] is True
        assert [t.agent for t in forked.turns] == ["review"]
        again = replay(graph, store, forked.id)
        assert again.divergences == [] and again.state_matches, [str(d) for d in again.divergences]


def test_the_replay_fork_carries_a_stateful_sub_agent_memory(tmp_path):
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import MessagesState

    from drmas_graph import TraceStore, replay

    def assistant(state):
        return {"messages": [llm.invoke(state["messages"])]}

    sub = StateGraph(MessagesState)
    sub.add_node("assistant", assistant)
    sub.add_edge(START, "assistant")
    sub.add_edge("assistant", END)
    expert = sub.compile(checkpointer=True)

    def consult(state):
        return {"messages": [expert.invoke({"messages": [state["messages"][-1]]})["messages"][-1]]}

    b = StateGraph(MessagesState)
    b.add_node("consult", consult)
    b.add_edge(START, "consult")
    b.add_edge("consult", END)
    graph = b.compile(checkpointer=InMemorySaver())
    with TraceStore(tmp_path / "traces.db") as store:
        app = instrument(graph, {"consult/assistant": scripted_policy(["Hello!", "Still here.", "Yes."])}, store=store)
        thread = {"configurable": {"thread_id": "user-1"}}
        app.rollout({"messages": [HumanMessage("Hi, I am Ann.")]}, thread)
        second = app.rollout({"messages": [HumanMessage("What is my name?")]}, thread)
        assert len(second.turns[0].messages) == 3  # the sub-agent remembers the first exchange
        assert list(second.metadata["thread_start"]["namespaces"]) == ["consult"]
        result = replay(graph, store, second.id)
        assert result.divergences == [] and result.state_matches, [str(d) for d in result.divergences]


# ---- rev5_f: a node's CachePolicy never serves an instrumented run -----------------------------------------
def test_a_cached_node_is_sampled_in_every_episode_and_replays(tmp_path):
    from langgraph.cache.memory import InMemoryCache
    from langgraph.types import CachePolicy

    from drmas_graph import TraceStore, replay

    def research(state):
        return {"log": [llm.invoke([HumanMessage(f"Research: {state['question']}")]).content]}

    b = StateGraph(State)
    b.add_node("research", research, cache_policy=CachePolicy(ttl=600))
    b.add_edge(START, "research")
    b.add_edge("research", END)
    graph = b.compile(cache=InMemoryCache())
    with TraceStore(tmp_path / "traces.db") as store:
        app = instrument(graph, {"research": scripted_policy(["notes A", "notes B", "notes C"])}, store=store)
        first = app.rollout({"question": "6*7?"}, group_id="g0")
        second = app.rollout({"question": "6*7?"}, group_id="g0")
        assert [t.response_text for t in first.turns + second.turns] == ["notes A", "notes B"]
        assert second.final_state["log"] == ["notes B"]
        assert replay(graph, store, first.id).divergences == []
    assert app.graph.cache is graph.cache  # the app's graph is untouched


# ---- rev5_c: an instrumented app run inside a node of another graph names its own nodes --------------------
def test_an_instrumented_app_nested_in_another_serves_its_own_nodes(tmp_path):
    from drmas_graph import TraceStore, replay

    def inner_node(state):
        return {"log": [llm.invoke([HumanMessage(f"inner: {state['question']}")]).content]}

    inner_graph = _one_node(inner_node, "inner")
    store = TraceStore(tmp_path / "inner.db")
    inner_app = instrument(inner_graph, {"inner": scripted_policy(["inner policy"] * 2, name="inner-pol")},
                           strict=True, store=store)

    def outer_node(state):
        sub = inner_app.invoke({"question": state["question"]})
        return {"log": sub["log"] + [llm.invoke([HumanMessage("outer: sum up")]).content]}

    for outer_graph in (_one_node(outer_node, "outer"), _one_node(lambda s: {"log": inner_app.invoke(s)["log"]}, "team")):
        outer_app = instrument(outer_graph, {"outer": scripted_policy(["outer policy"], name="outer-pol")})
        final = outer_app.invoke({"question": "2+2?"})
        assert final["log"][0] == "inner policy"
    episodes = [store.load_episode(s.id) for s in store.episodes()]
    assert [(t.node, t.call_key, t.agent, t.trainable) for e in episodes for t in e.turns] == \
        [("inner", "inner", "inner", True)] * 2
    assert replay(inner_graph, store, episodes[0].id).divergences == []
    store.close()
