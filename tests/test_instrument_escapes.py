"""Every way of running an instrumented graph is instrumented; calls that escape the run are refused or warned
(issue 9 items 3, 4 and the instrumenting part of 9)."""

import asyncio
import concurrent.futures
import operator
import threading
from typing import Annotated, TypedDict

import pytest
from langchain_core.messages import HumanMessage
from langchain_core.runnables import RunnableLambda
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph

from drmas_graph import ConfigError, RolloutError, StrictModeError, UnknownAgentError, instrument
from drmas_graph.errors import UnservedCallWarning
from drmas_graph.testing import tiny_policy
from tests import _graphs
from tests.test_instrument import Unreachable


class ListStore:
    def __init__(self):
        self.episodes = []

    def write_episode(self, episode):
        self.episodes.append(episode)


class S(TypedDict, total=False):
    q: str
    a: list


def one_node(fn, name="solver"):
    g = StateGraph(S)
    g.add_node(name, fn)
    g.add_edge(START, name)
    g.add_edge(name, END)
    return g.compile()


def cause(exc, kind):
    while exc is not None and not isinstance(exc, kind):
        exc = exc.__cause__
    return exc


@pytest.mark.filterwarnings("ignore:astream_log is deprecated")
def test_every_runnable_run_method_is_an_instrumented_episode(policy):
    """rev_w: with_config/with_retry/with_listeners/batch/astream_events/astream_log/a pipe all record."""
    model, store = Unreachable(), ListStore()
    app = instrument(_graphs.solver_verifier(model).compile(), {"solver": policy, "verifier": policy}, strict=True,
                     store=store)
    ended = []
    outputs = [
        app.with_config(tags=["x"]).invoke({"question": "a"}),
        app.with_retry(stop_after_attempt=2).invoke({"question": "b"}),
        app.with_listeners(on_end=lambda run: ended.append(run)).invoke({"question": "c"}),
        (app | RunnableLambda(lambda out: out)).invoke({"question": "d"}),
        *app.batch([{"question": "e"}, {"question": "f"}], {"max_concurrency": 2}),
    ]

    async def events():
        final = None
        async for e in app.astream_events({"question": "g"}, version="v2"):
            if e["event"] == "on_chain_end" and e["name"] == "LangGraph":
                final = e["data"]["output"]
        async for _ in app.astream_log({"question": "h"}):
            pass
        return final

    outputs.append(asyncio.run(events()))
    assert model.calls == 0 and len(ended) == 1
    assert len(store.episodes) == 8 and all(ep.ok and len(ep.turns) == 2 for ep in store.episodes)
    by_question = {ep.input["question"]: ep for ep in store.episodes}
    for out in outputs:  # each output is the recorded episode's: the solver's answer came from the policy
        assert out["answer"] == policy.parse(by_question[out["question"]].turns[0].response_text).content.strip()


def test_only_read_only_attributes_are_forwarded(policy):
    graph = _graphs.solver_verifier(Unreachable()).compile(checkpointer=InMemorySaver())
    app = instrument(graph, {"solver": policy, "verifier": policy})
    config = {"configurable": {"thread_id": "t"}}
    app.with_config(config).invoke({"question": "q"})
    assert app.get_state(config).values["question"] == "q"  # read-only: forwarded
    assert app.with_config(config).rollout({"question": "r"}).metadata["thread_id"] == "t"  # binding merges config
    assert app.get_graph() is not None and app.get_name() == "LangGraph" and app.checkpointer is graph.checkpointer
    with pytest.raises(AttributeError, match=r"no attribute 'copy'.*app\.graph\.copy"):
        app.copy  # noqa: B018 - would return an uninstrumented graph
    with pytest.raises(ConfigError, match="version='v3'"):
        app.stream_events({"question": "q"}, version="v3")


def test_calls_from_thread_pools_inside_a_node_are_attributed(policy):
    """rev_t: ThreadPoolExecutor and run_in_executor work items carry the run (and the node) along."""
    model = Unreachable()

    def pooled(state):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda q: model.invoke([HumanMessage(q)]).content, [state["q"], state["q"] + "!"]))
        return {"a": outs}

    async def in_executor(state):
        loop = asyncio.get_running_loop()
        reply = await loop.run_in_executor(None, lambda: model.invoke([HumanMessage(state["q"])]))
        return {"a": [reply.content]}

    episode = instrument(one_node(pooled), {"solver": policy}, strict=True).rollout({"q": "2+2?"})
    assert model.calls == 0 and [(t.agent, t.node, t.step) for t in episode.turns] == [("solver", "solver", 1)] * 2
    assert sorted(episode.final_state["a"]) == sorted(policy.parse(t.response_text).content for t in episode.turns)
    episode = asyncio.run(instrument(one_node(in_executor), {"solver": policy}, strict=True).arollout({"q": "x"}))
    assert model.calls == 0 and [t.node for t in episode.turns] == ["solver"]
    assert episode.final_state["a"] == [policy.parse(episode.turns[0].response_text).content]


def test_calls_that_cannot_be_attributed_are_refused_or_warned(policy):
    """A plain thread has no run context: strict refuses the call (the episode fails although the thread
    swallowed the error), non-strict warns and lets the app's model answer. Never silent."""
    model = Unreachable()

    def threaded(state):
        out = []

        def work():
            try:
                out.append(model.invoke([HumanMessage(state["q"])]).content)
            except StrictModeError:
                out.append("refused")

        t = threading.Thread(target=work)
        t.start()
        t.join()
        return {"a": out}

    graph = one_node(threaded)
    with pytest.raises(RolloutError) as info:
        instrument(graph, {"solver": policy}, strict=True).rollout({"q": "q"})
    assert model.calls == 0 and "StrictModeError" in info.value.episode.error
    assert "plain threading.Thread" in str(cause(info.value, StrictModeError))
    with pytest.warns(UnservedCallWarning, match="cannot be attributed"):
        out = instrument(graph, {"solver": policy}).invoke({"q": "q"})
    assert out["a"] == ["original model"] and model.calls == 1
    assert graph.invoke({"q": "q"})["a"] == ["original model"]  # no run active: the app is untouched


@pytest.mark.filterwarnings("ignore:policies. agent")
def test_strict_refusal_swallowed_by_the_app_still_fails_the_episode(policy):
    model = Unreachable()

    def careful(state):
        try:
            return {"a": [model.invoke([HumanMessage(state["q"])]).content]}
        except Exception:  # noqa: BLE001 - the app's own blanket handler
            return {"a": ["fallback"]}

    app = instrument(_graphs.solver_verifier(model), {"solver": policy}, strict=True)
    app2 = instrument(one_node(careful, "judge"), {"solver": policy}, strict=True)
    with pytest.raises(RolloutError, match="StrictModeError") as info:
        app2.rollout({"q": "q"})
    assert info.value.episode.final_state is None and "caught this error" in info.value.episode.error
    with pytest.raises(StrictModeError, match="node 'judge'"):
        app2.invoke({"q": "q"})
    with pytest.raises(StrictModeError):
        list(app2.stream({"q": "q"}))
    assert model.calls == 0 and app.strict


def test_breaking_out_of_stream_stores_no_episode(policy):
    """rev_g: a consumer that stops early cancels the run; it is not stored as a failed episode."""
    store = ListStore()
    app = instrument(_graphs.solver_verifier(Unreachable()).compile(), {"solver": policy, "verifier": policy},
                     store=store)
    for _ in app.stream({"question": "q"}):
        break

    async def first():
        async for chunk in app.astream({"question": "q"}):
            return chunk

    assert asyncio.run(first()) is not None
    assert store.episodes == []
    list(app.stream({"question": "q"}))
    assert len(store.episodes) == 1 and store.episodes[0].ok and len(store.episodes[0].turns) == 2


def test_drmas_agent_metadata_names_an_agent_that_is_no_node():
    """policies={"judge": p}: only the call carrying drmas_agent='judge' goes to it; the node's other call
    keeps the node's agent."""
    worker, judge = tiny_policy(seed=1), tiny_policy(seed=2)
    model = Unreachable()

    def work(state):
        draft = model.invoke([HumanMessage(f"draft {state['q']}")]).content
        verdict = model.with_config(metadata={"drmas_agent": "judge"}).invoke([HumanMessage("grade it")]).content
        return {"a": [draft, verdict]}

    app = instrument(one_node(work, "work"), {"work": worker, "judge": judge})
    episode = app.rollout({"q": "q"})
    assert [(t.agent, t.node, t.policy) for t in episode.turns] == [("work", "work", worker.name),
                                                                     ("judge", "work", judge.name)]
    assert model.calls == 0


def test_agents_globs_reach_subgraphs_invoked_inside_a_node(policy):
    model = Unreachable()

    def research(state):  # the subgraph is built at call time, so get_graph(xray=True) cannot list its nodes
        inner = one_node(lambda s: {"a": [model.invoke([HumanMessage(s["q"])]).content]}, "search")
        return inner.invoke(state)

    graph = one_node(research, "research")
    assert instrument(graph, {"research": policy}).nodes == ["research"]
    app = instrument(graph, {"researcher": policy}, agents={"research/*": "researcher"}, strict=True)
    episode = app.rollout({"q": "q"})
    assert [(t.agent, t.node) for t in episode.turns] == [("researcher", "research/search")] and model.calls == 0
    with pytest.raises(UnknownAgentError, match="pattern 'reserch/\\*'"):
        instrument(graph, {"x": policy}, agents={"reserch/*": "x"})


def test_start_and_end_are_not_listed_as_nodes(policy):
    outer = StateGraph(_graphs.Fan)
    outer.add_node("agent", _graphs.react_agent(Unreachable()))
    outer.add_edge(START, "agent")
    outer.add_edge("agent", END)
    assert instrument(outer.compile(), {"agent/agent": policy}).nodes == ["agent/agent", "agent/tools"]


def test_distinct_policies_with_one_name_are_refused():
    """rev_n, instrument side: the names key traces and models."""
    a, b = tiny_policy(seed=0), tiny_policy(seed=0)
    graph = _graphs.solver_verifier(Unreachable()).compile()
    with pytest.raises(ConfigError, match=r"policies\['solver'\] and policies\['verifier'\].*same name"):
        instrument(graph, {"solver": a, "verifier": b})
    assert instrument(graph, {"solver": a, "verifier": a}).policies["verifier"] is a  # one shared model is fine


class Routed(TypedDict, total=False):
    q: str
    route: Annotated[list, operator.add]


def test_update_state_running_an_llm_router_is_refused_in_strict_mode(policy):
    model = Unreachable()

    def router(state):
        return END if model.invoke([HumanMessage("route?")]).content else "solver"

    g = StateGraph(Routed)
    g.add_node("solver", lambda s: {"route": ["solver"]})
    g.add_edge(START, "solver")
    g.add_conditional_edges("solver", router)
    app = instrument(g.compile(checkpointer=InMemorySaver()), {"solver": policy}, strict=True)
    with pytest.raises(StrictModeError, match="update_state"):
        app.update_state({"configurable": {"thread_id": "t"}}, {"q": "x"}, as_node="solver")
    assert model.calls == 0


@pytest.mark.filterwarnings("ignore::langchain_core._api.beta_decorator.LangChainBetaWarning")
def test_chat_model_stream_events_v3_inside_a_node_is_served(policy, monkeypatch):
    """The content-block streaming protocol drives the model without `_generate_with_cache`; it is served too."""
    from langchain_openai import ChatOpenAI

    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-used")
    llm = ChatOpenAI(model="gpt-4o-mini", base_url="http://127.0.0.1:9/v1", max_retries=0, timeout=2)

    def node(state):
        return {"a": [llm.stream_events([HumanMessage(state["q"])], version="v3").output.text]}

    async def anode(state):
        return {"a": [(await (await llm.astream_events([HumanMessage(state["q"])], version="v3"))).text]}

    for episode in (instrument(one_node(node), {"solver": policy}, strict=True).rollout({"q": "hi"}),
                    asyncio.run(instrument(one_node(anode), {"solver": policy}, strict=True).arollout({"q": "hi"}))):
        turn, = episode.turns
        assert turn.trainable and episode.final_state["a"] == [turn.response_text.strip()]


def test_app_models_marks_deliberate_calls_to_the_apps_own_model(policy):
    """An LLM judge next to active runs (a reward function) is neither refused nor warned inside app_models()."""
    import warnings

    from drmas_graph import app_models

    judge_model = Unreachable()
    seen = {}

    def node(state):
        def judge():
            with app_models():
                seen["reply"] = judge_model.invoke([HumanMessage("grade")]).content

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            t = threading.Thread(target=judge)
            t.start()
            t.join()
        return {"a": [policy_model.invoke([HumanMessage(state["q"])]).content]}

    policy_model = Unreachable()
    episode = instrument(one_node(node), {"solver": policy}, strict=True).rollout({"q": "q"})
    assert seen["reply"] == "original model" and judge_model.calls == 1 and policy_model.calls == 0
    assert [t.agent for t in episode.turns] == ["solver"]
