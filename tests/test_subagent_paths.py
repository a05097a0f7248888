"""Sub-agents (subgraphs a node's function runs) keep the node path of the node that runs them, however they
are run: several times in a row, in parallel (`.batch`, a `RunnableParallel`, a thread pool, `asyncio.gather`),
streamed, or from a tool of `create_agent`'s tools node. Issue 28 (attribution): every call is served by its
agent's policy; node paths, call keys and seeds never follow thread timing, and replay of an unchanged graph
finds no divergence."""

import asyncio
import concurrent.futures
import json
import time

import pytest
from langchain.agents import create_agent
from langchain_core.messages import HumanMessage
from langchain_core.runnables import RunnableLambda, RunnableParallel
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph

from drmas_graph import TraceStore, instrument
from drmas_graph.testing import scripted_policy
from drmas_graph.traces.replay import replay
from tests.test_instrument import Unreachable

APP_MODEL = Unreachable()
"""The app's own model: strict runs below prove no call reaches it (`APP_MODEL.calls` stays 0)."""


def question_of(prompt):
    """The text of the last user message of a rendered ChatML prompt."""
    return prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]


def answering(name="researcher"):
    """A policy that answers 'answer to <question>'."""
    return scripted_policy(lambda prompt: "answer to " + question_of(prompt), name=name)


def model(state):
    return {"messages": [APP_MODEL.invoke(state["messages"])]}


def sub_agent():
    b = StateGraph(MessagesState)
    b.add_node("model", model)
    b.add_edge(START, "model")
    b.add_edge("model", END)
    return b.compile()


SUB = sub_agent()


def one_node(work, name="work"):
    b = StateGraph(MessagesState)
    b.add_node(name, work)
    b.add_edge(START, name)
    b.add_edge(name, END)
    return b.compile()


def research(question, delay=0.0):
    time.sleep(delay)
    return SUB.invoke({"messages": [HumanMessage(question)]})["messages"][-1].content


def reply(*answers):
    return {"messages": [HumanMessage(" / ".join(answers))]}


def calls(episode):
    """(question, agent, node, call key, reply) of every call, in call order."""
    return [(t.messages[-1].content, t.agent, t.node, t.call_key, t.response_text) for t in episode.turns]


def test_a_sub_agent_run_twice_in_a_row_keeps_its_node_path():
    """LangGraph numbers the second run ('work:<id>|1|model:<id>'): the call was at 'work/1/model', had no
    policy, and the app's own model answered it."""
    policy = answering()
    app = instrument(one_node(lambda state: reply(research("q1"), research("q2"))), {"work/model": policy},
                     strict=True)
    episode = app.rollout({"messages": []})
    assert calls(episode) == [("q1", "work/model", "work/model", "work/model", "answer to q1"),
                              ("q2", "work/model", "work/model", "work/model", "answer to q2")]
    assert [t.node_call_index for t in episode.turns] == [0, 1] and APP_MODEL.calls == 0
    assert episode.final_state["messages"][-1].content == "answer to q1 / answer to q2"


def test_parallel_sub_agent_runs_give_the_same_keys_seeds_and_replay_whatever_finishes_first(tmp_path):
    """`.batch` runs the sub-agent twice at once; which run LangGraph numbers first follows the threads. Node
    path, call key and seed of each call (by its question) are the same under both timings, and the replay of
    the first episode under the other timing finds no divergence."""
    delays = {"q1": 0.0, "q2": 0.0}
    graph = one_node(lambda state: reply(*RunnableLambda(lambda q: research(q, delays[q])).batch(["q1", "q2"])))
    store = TraceStore(tmp_path / "traces.db")
    app = instrument(graph, {"researcher": answering()}, agents={"work/*": "researcher"}, store=store, strict=True)
    seen, episodes = [], []
    for first, second in (("q1", "q2"), ("q2", "q1")):
        delays.update({first: 0.0, second: 0.3})
        episodes.append(app.rollout({"messages": []}, metadata={"seed": 7}))
        turns = episodes[-1].turns
        assert [t.messages[-1].content for t in turns] == [first, second]  # the timing did change
        seen.append({t.messages[-1].content: (t.agent, t.node, t.call_key, t.sampling.seed) for t in turns})
    assert seen[0] == seen[1]
    assert {q: v[:3] for q, v in seen[0].items()} == {q: ("researcher", "work/model", "work/model") for q in seen[0]}
    assert seen[0]["q1"][3] != seen[0]["q2"][3]  # each call its own seed
    result = replay(graph, store, episodes[0].id)  # recorded with q1 first, replayed with q2 first
    assert result.divergences == [] and result.state_matches
    assert APP_MODEL.calls == 0


def test_calls_of_one_node_get_seeds_from_their_prompts_not_their_arrival_order():
    """Two concurrent calls in one node (an `llm.batch`): the seed of each follows its prompt, in either order;
    the same prompt asked again gets another seed."""
    delays = {"a": 0.0, "b": 0.0}

    def ask(question):
        time.sleep(delays[question])
        return APP_MODEL.invoke([HumanMessage(question)]).content

    def work(state):
        answers = RunnableLambda(ask).batch(["a", "b"])
        return reply(*answers, APP_MODEL.invoke([HumanMessage("a")]).content)

    app = instrument(one_node(work), {"work": answering()}, strict=True)
    seeds = []
    for first, second in (("a", "b"), ("b", "a")):
        delays.update({first: 0.0, second: 0.3})
        episode = app.rollout({"messages": []}, metadata={"seed": 7})
        assert [t.messages[-1].content for t in episode.turns] == [first, second, "a"]
        seeds.append(sorted((t.messages[-1].content, t.node_call_index == 2, t.sampling.seed) for t in episode.turns))
    assert seeds[0] == seeds[1] and len({s for _, _, s in seeds[0]}) == 3


def test_sub_agents_run_from_a_thread_pool_belong_to_the_submitting_node():
    """rev4_q: the worker thread did not see the node's run config, so the sub-agent ran as a top-level graph
    (node 'model', the app's own model answered, no warning). submit, map and run_in_executor."""
    policy = answering()

    def submitted(state):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            return reply(pool.submit(research, "q1").result())

    def mapped(state):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            return reply(*pool.map(research, ["q1", "q2"]))

    async def in_executor(state):
        loop = asyncio.get_running_loop()
        return reply(*await asyncio.gather(loop.run_in_executor(None, research, "q1"),
                                           loop.run_in_executor(None, research, "q2")))

    for work, questions in ((submitted, ["q1"]), (mapped, ["q1", "q2"])):
        episode = instrument(one_node(work), {"work/model": policy}, strict=True).rollout({"messages": []})
        assert sorted((q, a, n, t) for q, a, n, _, t in calls(episode)) == [
            (q, "work/model", "work/model", f"answer to {q}") for q in questions], work.__name__
        assert all(t.trainable for t in episode.turns)
    episode = asyncio.run(instrument(one_node(in_executor), {"work/model": policy}, strict=True).arollout(
        {"messages": []}))
    assert sorted((q, n, t) for q, _, n, _, t in calls(episode)) == [
        ("q1", "work/model", "answer to q1"), ("q2", "work/model", "answer to q2")]
    assert APP_MODEL.calls == 0


def test_async_sub_agents_gathered_in_a_node_belong_to_it():
    async def work(state):
        runs = [SUB.ainvoke({"messages": [HumanMessage(q)]}) for q in ("q1", "q2")]
        return reply(*[out["messages"][-1].content for out in await asyncio.gather(*runs)])

    episode = asyncio.run(instrument(one_node(work), {"work/model": answering()}, strict=True).arollout(
        {"messages": []}))
    assert sorted(calls(episode)) == [(q, "work/model", "work/model", "work/model", f"answer to {q}")
                                      for q in ("q1", "q2")]
    assert episode.final_state["messages"][-1].content == "answer to q1 / answer to q2" and APP_MODEL.calls == 0


def test_sub_agents_in_a_runnable_parallel_or_streamed_belong_to_the_node():
    def parallel(state):
        both = RunnableParallel(a=RunnableLambda(lambda _: research("q1")), b=RunnableLambda(lambda _: research("q2")))
        out = both.invoke(None)
        return reply(out["a"], out["b"])

    def streamed(state):
        chunks = list(SUB.stream({"messages": [HumanMessage("q1")]}, stream_mode="values"))
        again = [c for c in SUB.stream({"messages": [HumanMessage("q2")]}, stream_mode="updates")]
        return reply(chunks[-1]["messages"][-1].content, again[-1]["model"]["messages"][-1].content)

    for work in (parallel, streamed):
        episode = instrument(one_node(work), {"work/model": answering()}, strict=True).rollout({"messages": []})
        assert sorted(calls(episode)) == [(q, "work/model", "work/model", "work/model", f"answer to {q}")
                                          for q in ("q1", "q2")], work.__name__
        assert episode.final_state["messages"][-1].content == "answer to q1 / answer to q2"
    assert APP_MODEL.calls == 0


def tool_call(name, **args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def test_a_sub_agent_called_by_a_tool_belongs_to_the_tools_node():
    """create_agent sends each tool call of a reply to its tools node (a `Send` each, run in parallel); the
    sub-agent a tool runs is at 'tools/model', its call key names the tool call ('tools[1]/model' for the
    second), served by the researcher's policy."""

    @tool
    def ask_researcher(question: str) -> str:
        """Ask the research sub-agent a question."""
        return research(question)

    def lead(prompt):
        if "<|im_start|>tool" in prompt:
            return "done"
        return tool_call("ask_researcher", question="q1") + tool_call("ask_researcher", question="q2")

    agent = create_agent(APP_MODEL, tools=[ask_researcher], system_prompt="You lead.")
    app = instrument(agent, {"lead": scripted_policy(lead, name="lead"), "researcher": answering()},
                     agents={"model": "lead", "tools/*": "researcher"}, strict=True)
    episode = app.rollout({"messages": [HumanMessage("research q1 and q2")]})
    turns = [(t.agent, t.node, t.call_key) for t in episode.turns]
    assert turns[0] == turns[-1] == ("lead", "model", "model") and len(turns) == 4
    assert sorted(calls(episode)[1:3]) == [("q1", "researcher", "tools/model", "tools[0]/model", "answer to q1"),
                                           ("q2", "researcher", "tools/model", "tools[1]/model", "answer to q2")]
    tool_messages = [m.content for m in episode.final_state["messages"] if m.type == "tool"]
    assert sorted(tool_messages) == ["answer to q1", "answer to q2"] and APP_MODEL.calls == 0


@pytest.mark.parametrize("pool", [False, True])
def test_an_interrupt_in_a_sub_agent_names_the_sub_agents_node(pool):
    """A sub-agent node that calls interrupt(), run twice by one node (in a pool or not): interrupts are
    reported at 'work/ask', never with LangGraph's run counter, never at the top-level node alone."""
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.types import interrupt

    def ask(state):
        return {"messages": [HumanMessage(interrupt(state["messages"][-1].content))]}

    b = StateGraph(MessagesState)
    b.add_node("ask", ask)
    b.add_edge(START, "ask")
    b.add_edge("ask", END)
    asker = b.compile()

    def one(question):
        return asker.invoke({"messages": [HumanMessage(question)]})["messages"][-1].content

    def work(state):
        if pool:
            with concurrent.futures.ThreadPoolExecutor(1) as executor:
                return reply(*executor.map(one, ["first?", "second?"]))
        return reply(one("first?"), one("second?"))

    def then_model(state):
        return {"messages": [APP_MODEL.invoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("work", work)
    g.add_node("model", then_model)
    g.add_edge(START, "work")
    g.add_edge("work", "model")
    g.add_edge("model", END)
    app = instrument(g.compile(checkpointer=InMemorySaver()), {"model": answering()}, strict=True)
    episode = app.rollout({"messages": []}, {"configurable": {"thread_id": f"t{pool}"}},
                          resume=lambda ep, interrupts: interrupts[0].value.upper())
    assert [[(r["node"], r["value"]) for r in s.interrupts] for s in episode.segments] == [
        [("work/ask", "first?")], [("work/ask", "second?")], []]
    assert episode.final_state["messages"][-1].content == "answer to FIRST? / SECOND?"
