"""Agents by their own names: LangChain v1 `create_agent` (with middleware) and Deep Agents sub-agents,
mapped to policies with `agents={"agent:<name>": ...}` whatever LangGraph node they run in. Real packages;
the apps' own model is ChatOpenAI on a dead port (strict mode proves no call reaches it)."""

import json

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import HumanInTheLoopMiddleware
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph

from drmas_graph import SamplingParams, TraceStore, UnknownAgentError, instrument
from drmas_graph.env import Task
from drmas_graph.testing import scripted_policy
from drmas_graph.traces.replay import replay
from drmas_graph.train.loop.trainer import train_graph
from tests.test_instrument import assert_exact
from tests.test_trainer import small_config


def dead_model():
    """The app's own model: nothing listens on port 9, and no request may leave during a run."""
    return ChatOpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", model="app-model", max_retries=0, timeout=1)


def call(name, **args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def last_turn(prompt):
    """The role and text of the last message of a rendered ChatML prompt."""
    role, _, text = prompt.rsplit("<|im_start|>", 2)[-2].partition("\n")
    return role, text.split("<|im_end|>")[0]


def two_agents_in_one_node():
    """Two create_agent agents that one node runs. Both calls' node path is 'work/model' (LangGraph numbers a
    node's second subgraph run in its checkpoint namespace, 'work:<id>|1|model:<id>'; that counter names no node)."""
    calculator = create_agent(dead_model(), system_prompt="You are the calculator.", name="calculator")
    writer = create_agent(dead_model(), system_prompt="You are the writer.", name="writer")

    def work(state):
        number = calculator.invoke({"messages": [HumanMessage("6*7?")]})["messages"][-1].content
        poem = writer.invoke({"messages": [HumanMessage(f"a poem about {number}")]})["messages"][-1].content
        return {"messages": [HumanMessage(number), HumanMessage(poem)]}

    g = StateGraph(MessagesState)
    g.add_node("work", work)
    g.add_edge(START, "work")
    g.add_edge("work", END)
    return g.compile()


def test_agents_of_one_node_get_policies_by_their_names():
    calc = scripted_policy(["42"], name="calc")
    poet = scripted_policy(["roses"], name="poet", seed=1)
    app = instrument(two_agents_in_one_node(), {"calc": calc, "poet": poet},
                     agents={"agent:calculator": "calc", "agent:writer": "poet"}, strict=True)
    episode = app.rollout({"messages": []})
    assert [(t.agent, t.agent_name, t.node, t.policy) for t in episode.turns] == [
        ("calc", "calculator", "work/model", "calc"), ("poet", "writer", "work/model", "poet")]
    assert_exact(episode.turns[0], calc)
    assert_exact(episode.turns[1], poet)
    assert [m.content for m in episode.final_state["messages"]] == ["42", "roses"]
    # without an agent: entry, node globs decide (here one agent for both)
    same = instrument(two_agents_in_one_node(), {"work": calc}, agents={"work/*": "work"}, strict=True).rollout(
        {"messages": []})
    assert [(t.agent, t.agent_name) for t in same.turns] == [("work", "calculator"), ("work", "writer")]


def test_precedence_drmas_agent_then_agent_name_then_node_glob():
    calculator = create_agent(dead_model(), system_prompt="You are the calculator.", name="calculator")
    judged = calculator.with_config(metadata={"drmas_agent": "judge"})  # the runnable, not the model object
    plain = dead_model()

    def work(state):
        a = calculator.invoke({"messages": [HumanMessage("1+1?")]})["messages"][-1].content
        b = judged.invoke({"messages": [HumanMessage("2+2?")]})["messages"][-1].content
        c = plain.invoke([HumanMessage("3+3?")]).content  # the node's own call: no agent name
        return {"messages": [HumanMessage(f"{a} {b} {c}")]}

    g = StateGraph(MessagesState)
    g.add_node("work", work)
    g.add_edge(START, "work")
    g.add_edge("work", END)
    policy = scripted_policy(["x"])
    app = instrument(g.compile(), {"calc": policy, "judge": policy, "worker": policy},
                     agents={"work*": "worker", "agent:calc*": "calc"}, strict=True)
    episode = app.rollout({"messages": []})
    assert [(t.agent, t.agent_name, t.node) for t in episode.turns] == [
        ("calc", "calculator", "work/model"), ("judge", "calculator", "work/model"), ("worker", None, "work")]
    with pytest.raises(UnknownAgentError, match="names no agent"):
        instrument(g.compile(), {"calc": policy}, agents={"agent:": "calc"})


def deep_agent():
    from deepagents import create_deep_agent

    return create_deep_agent(
        model=dead_model(), system_prompt="You are the boss.", name="boss",
        subagents=[{"name": "calculator", "description": "does math", "system_prompt": "You are the calculator."},
                   {"name": "writer", "description": "writes poems", "system_prompt": "You are the writer."}])


def boss(prompt):
    """The main agent: notes the plan in a file (Deep Agents' file tools), hands work to the calculator, then
    to the writer, then answers."""
    steps = [call("write_file", file_path="/plan.md", content="1. compute 2. poem"),
             call("task", description="compute 6*7", subagent_type="calculator"),
             call("task", description="write a poem about 42", subagent_type="writer"), "42, and a poem."]
    return steps[prompt.count("<|im_start|>tool")]


def test_deep_agents_sub_agents_get_their_own_policies_and_replay(tmp_path):
    pytest.importorskip("deepagents")
    graph = deep_agent()
    policies = {"boss": scripted_policy(boss, name="boss"), "calc": scripted_policy(["42"], name="calc"),
                "poet": scripted_policy(["Roses."], name="poet")}
    with TraceStore(tmp_path / "t.db") as store:
        app = instrument(graph, policies, agents={"agent:boss": "boss", "agent:calculator": "calc",
                                                  "agent:writer": "poet"}, strict=True, store=store)
        episode = app.rollout({"messages": [HumanMessage("Compute 6*7 and write a poem about it.")]})
    assert [(t.agent, t.agent_name, t.node) for t in episode.turns] == [
        ("boss", "boss", "model"), ("boss", "boss", "model"), ("calc", "calculator", "tools/model"),
        ("boss", "boss", "model"), ("poet", "writer", "tools/model"), ("boss", "boss", "model")]
    assert [t.policy for t in episode.turns] == ["boss", "boss", "calc", "boss", "poet", "boss"]
    for turn in episode.turns:
        assert_exact(turn, policies[turn.agent])
    assert last_turn(policies["calc"].tokenizer.decode(episode.turns[2].prompt_ids)) == ("user", "compute 6*7")
    assert episode.final_state["messages"][-1].content == "42, and a poem."
    assert "1. compute 2. poem" in str(episode.final_state["files"]["/plan.md"])  # the file tool ran for real
    with TraceStore(tmp_path / "t.db", readonly=True) as store:
        assert [t.agent_name for t in store.load_episode(episode.id).turns] == [
            "boss", "boss", "calculator", "boss", "writer", "boss"]
    result = replay(graph, tmp_path / "t.db", episode.id)
    assert result.divergences == []  # every call as recorded; the state differs only where the app read the clock
    changed = [line.split('"')[1] for line in result.state_diff.splitlines()[2:] if line[:1] in "+-"]
    assert changed == ["created_at"] * 2 + ["modified_at"] * 2  # Deep Agents stamps files with the time of writing


@tool
def send_email(to: str, body: str) -> str:
    """Send an email."""
    SENT.append((to, body))
    return f"sent to {to}"


SENT: list = []


def mailer_graph():
    """create_agent with LangChain's human-in-the-loop middleware: every send_email waits for a person."""
    return create_agent(dead_model(), tools=[send_email], system_prompt="You send emails.", name="mailer",
                        middleware=[HumanInTheLoopMiddleware(interrupt_on={"send_email": True})],
                        checkpointer=InMemorySaver())


def mailer(prompt):
    role, text = last_turn(prompt)
    return call("send_email", to="alice", body="hi") if role == "user" else "Done."


class MailEnv:
    """A person approves every email; the reward is whether one was sent."""

    def tasks(self, split):
        return [Task(id=f"{split}-{i}", input={"messages": [HumanMessage(f"Email Alice #{i}.")]}) for i in range(2)]

    def resume(self, task, episode, interrupts):
        return {"decisions": [{"type": "approve"}]}

    def reward(self, task, episode):
        return float(any(m.type == "tool" for m in episode.final_state["messages"]))


def test_create_agent_with_human_in_the_loop_middleware_trains_and_replays(tmp_path):
    SENT.clear()
    policy = scripted_policy(mailer, sampling=SamplingParams(max_new_tokens=48))
    app = instrument(mailer_graph(), {"mail": policy}, agents={"agent:mailer": "mail"}, strict=True)
    env = MailEnv()
    task = env.tasks("train")[0]
    episode = app.rollout(task.input, {"configurable": {"thread_id": "m"}},
                          resume=lambda ep, its: env.resume(task, ep, its))
    assert [(t.agent, t.node, t.segment) for t in episode.turns] == [("mail", "model", 0), ("mail", "model", 1)]
    assert episode.segments[0].interrupts[0]["value"]["action_requests"][0]["name"] == "send_email"
    assert SENT == [("alice", "hi")] and env.reward(task, episode) == 1.0
    for turn in episode.turns:
        assert_exact(turn, policy)

    cfg = small_config(tmp_path, steps=2, tasks_per_step=2, group_size=2, node_agents={"agent:mailer": "mail"},
                       eval={"k": 1, "before_training": False})
    result = train_graph(mailer_graph(), env, cfg, policies={"mail": policy})
    assert [(r["episodes"], r["interrupted_episodes"], r["agent/mail/calls"]) for r in result.history] == [(4, 0, 8)] * 2
    assert len(SENT) == 1 + 2 * 4 + 2  # the rollout above, two steps of 4 episodes, the final evaluation
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        stored = store.load_episode(next(s.id for s in store.episodes(step=1)))
    replayed = replay(mailer_graph(), tmp_path / "run" / "traces.db", stored.id)
    assert replayed.divergences == [] and replayed.state_matches and [t.segment for t in replayed.turns] == [0, 1]
