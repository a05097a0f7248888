"""instrument(): every LLM call of every node is served by its agent's policy and recorded exactly."""

import asyncio
import threading

import pytest
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from drmas_graph import (
    ConfigError,
    InstrumentedGraph,
    NoLLMCallError,
    PolicyError,
    RolloutError,
    SamplingParams,
    StrictModeError,
    UnknownAgentError,
    instrument,
)
from drmas_graph.testing import scripted_policy, tiny_policy
from tests import _graphs


class Unreachable(BaseChatModel):
    """A chat model that must never be called inside an instrumented run."""

    calls: int = 0

    @property
    def _llm_type(self) -> str:
        return "unreachable"

    def bind_tools(self, tools, **kwargs):
        from langchain_core.utils.function_calling import convert_to_openai_tool

        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

    def _generate(self, messages, stop=None, run_manager=None, **kwargs):
        self.calls += 1
        return ChatResult(generations=[ChatGeneration(message=AIMessage("original model"))])


def assert_exact(turn, policy):
    """The recorded prompt is what the policy renders; the text is the decoding of the sampled ids."""
    assert turn.trainable and turn.policy == policy.name
    assert list(turn.prompt_ids) == policy.render(turn.messages, turn.tools)
    assert policy.decode(turn.response_ids) == turn.response_text
    assert len(turn.response_ids) == len(turn.response_logprobs) > 0
    assert all(lp <= 0 for lp in turn.response_logprobs)


def test_sequential_graph_routes_each_node_to_its_agent(policy):
    model = Unreachable()
    graph = _graphs.solver_verifier(model).compile()
    app = instrument(graph, policies={"solver": policy, "verifier": policy})
    episode = app.rollout({"question": "2+3?"}, task_id="t1", group_id="g1")
    assert model.calls == 0
    assert [(t.agent, t.node, t.step, t.index) for t in episode.turns] == [("solver", "solver", 1, 0),
                                                                           ("verifier", "verifier", 2, 1)]
    for t in episode.turns:
        assert_exact(t, policy)
    solver, verifier = episode.turns
    assert episode.final_state["answer"] == solver.response_text.strip()  # no tool markup from this model
    assert solver.messages[1].content == "2+3?"
    assert verifier.messages[1].content == f"2+3? -> {episode.final_state['answer']}"
    assert episode.task_id == "t1" and episode.group_id == "g1" and episode.ok
    assert list(episode.by_agent()) == ["solver", "verifier"]
    assert episode.timings["wall_s"] >= episode.timings["llm_s"] > 0
    # outside an instrumented run the app's own model answers
    assert graph.invoke({"question": "2+3?"})["answer"] == "original model" and model.calls == 2


def test_invoke_returns_the_graphs_output_type(policy):
    graph = _graphs.solver_verifier(Unreachable()).compile()
    app = instrument(graph, {"solver": policy, "verifier": policy})
    out = app.invoke({"question": "1+1?"})
    assert isinstance(out, dict) and set(out) == {"question", "answer", "verdict"}


def test_builder_is_compiled_and_decorator_form_works(policy):
    app = instrument(_graphs.solver_verifier(Unreachable()), {"solver": policy})
    assert isinstance(app, InstrumentedGraph) and app.nodes == ["solver", "verifier"]

    @instrument(policies={"solver": policy, "verifier": policy})
    def build_app(llm):
        return _graphs.solver_verifier(llm).compile()

    built = build_app(Unreachable())
    assert isinstance(built, InstrumentedGraph)
    assert [t.agent for t in built.rollout({"question": "q"}).turns] == ["solver", "verifier"]


def test_unknown_agents_and_bad_policies_are_named():
    graph = _graphs.solver_verifier(Unreachable()).compile()
    p = tiny_policy()
    # a name that is no node path is accepted (drmas_agent metadata may reach it); a typo is named after the
    # first episode, in which it did not act
    app = instrument(graph, {"solvr": p})
    with pytest.warns(UserWarning, match=r"agent\(s\) \['solvr'\] made no LLM call.*nodes: \['solver', 'verifier'\]"):
        app.invoke({"question": "q"})
    with pytest.raises(UnknownAgentError, match=r"pattern 'research/\*'.*matches no node"):
        instrument(graph, {"solver": p}, agents={"research/*": "researcher"})
    with pytest.raises(ConfigError, match=r"policies\['solver'\] is a str"):
        instrument(graph, {"solver": "gpt-4o"})
    with pytest.raises(ConfigError, match="needs policies"):
        instrument(graph)


def test_node_without_policy_uses_original_model_and_is_not_trainable(policy):
    original = FakeListChatModel(responses=["looks right"])
    graph = _graphs.solver_verifier(Unreachable(), verifier_llm=original).compile()
    episode = instrument(graph, {"solver": policy}).rollout({"question": "2+3?"})
    solver, verifier = episode.turns
    assert solver.trainable and not verifier.trainable
    assert verifier.response_text == "looks right" and verifier.prompt_ids == () and verifier.policy is None
    assert episode.final_state["verdict"] == "looks right"


def test_strict_mode_names_the_node_and_known_agents(policy):
    graph = _graphs.solver_verifier(Unreachable()).compile()
    app = instrument(graph, {"solver": policy}, strict=True)
    with pytest.raises(RolloutError) as info:
        app.rollout({"question": "q"})
    cause = info.value.__cause__
    while cause is not None and not isinstance(cause, StrictModeError):
        cause = cause.__cause__
    assert isinstance(cause, StrictModeError)
    assert "node 'verifier'" in str(cause) and "known agents: ['solver']" in str(cause)
    assert [t.agent for t in info.value.episode.turns] == ["solver"]


def test_parallel_branches_are_served_together(policy):
    app = instrument(_graphs.parallel_branches(Unreachable()), {"left": policy, "right": policy, "join": policy})
    episode = app.rollout({"question": "q", "notes": []})
    steps = {t.agent: t.step for t in episode.turns}
    assert steps["left"] == steps["right"] == 1 and steps["join"] == 2
    assert sorted(t.agent for t in episode.turns[:2]) == ["left", "right"]
    for t in episode.turns:
        assert_exact(t, policy)
    notes = dict(episode.final_state["notes"])  # the message content: the response minus any tool-call markup
    assert {notes[t.agent] for t in episode.turns} == {policy.parse(t.response_text).content.strip()
                                                       for t in episode.turns}


def test_send_fanout_calls_are_keyed_by_send_index(policy):
    app = instrument(_graphs.send_fanout(Unreachable(), n=3), {"worker": policy})
    episode = app.rollout({"question": "q", "notes": []})
    assert sorted(t.call_key for t in episode.turns) == ["worker[0]", "worker[1]", "worker[2]"]
    assert all(t.node == "worker" and t.agent == "worker" and t.node_call_index == 0 for t in episode.turns)
    by_item = {int(t.messages[0].content.split()[1]): policy.parse(t.response_text).content.strip()
               for t in episode.turns}
    assert dict(episode.final_state["notes"]) == by_item


def test_subgraph_paths_globs_and_drmas_agent_metadata():
    planner, researcher, judge = tiny_policy(seed=1), tiny_policy(seed=2), tiny_policy(seed=3)
    graph = _graphs.with_subgraph(Unreachable())
    assert sorted(instrument(graph, {"plan": planner}).nodes) == ["grade", "plan", "research/search_llm"]
    app = instrument(graph, {"plan": planner, "researcher": researcher, "judge": judge},
                     agents={"research/*": "researcher", "grade": "judge"})
    episode = app.rollout({"question": "who?", "notes": []})
    assert [(t.agent, t.node, t.policy) for t in episode.turns] == [
        ("plan", "plan", planner.name), ("researcher", "research/search_llm", researcher.name),
        ("judge", "grade", judge.name)]
    assert_exact(episode.turns[1], researcher)
    # the metadata override wins over the node path even without an `agents` entry for the node
    app2 = instrument(graph, {"plan": planner, "judge": judge}, agents={"grade": "judge"})
    assert app2.rollout({"question": "q", "notes": []}).turns[2].agent == "judge"


def test_chatopenai_and_init_chat_model_never_leave_the_machine(policy, monkeypatch):
    from langchain_openai import ChatOpenAI

    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-used")
    llm = ChatOpenAI(model="gpt-4o-mini", base_url="http://127.0.0.1:9/v1", max_retries=0, timeout=2)
    graph = _graphs.solver_verifier(llm).compile()
    episode = instrument(graph, {"solver": policy, "verifier": policy}).rollout({"question": "2+3?"})
    assert len(episode.turns) == 2
    for t in episode.turns:
        assert_exact(t, policy)
    with pytest.raises(Exception, match="Connection"):  # the same graph, uninstrumented, really calls out
        graph.invoke({"question": "2+3?"})


def test_init_chat_model_is_intercepted(policy, monkeypatch):
    init_chat_model = pytest.importorskip("langchain.chat_models").init_chat_model
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-used")
    llm = init_chat_model("openai:gpt-4o-mini", base_url="http://127.0.0.1:9/v1", max_retries=0)
    episode = instrument(_graphs.solver_verifier(llm).compile(), {"solver": policy, "verifier": policy}).rollout(
        {"question": "q"})
    assert [t.agent for t in episode.turns] == ["solver", "verifier"]


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
def test_bound_tools_are_rendered_and_tool_calls_parsed(monkeypatch):
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-used")
    llm = ChatOpenAI(model="gpt-4o-mini", base_url="http://127.0.0.1:9/v1", max_retries=0)
    agent = create_react_agent(llm, [add])
    policy = scripted_policy(['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
                              "The sum is 5."])
    episode = instrument(agent, {"agent": policy}).rollout({"messages": [HumanMessage("What is 2 + 3?")]})
    first, second = episode.turns
    assert first.finish_reason == "tool_calls"
    assert [(c["name"], c["args"]) for c in first.tool_calls] == [("add", {"a": 2, "b": 3})]
    assert first.tools[0]["function"]["name"] == "add"
    assert '"name": "add"' in policy.tokenizer.decode(list(first.prompt_ids))  # schema is in the prompt
    tool_message = episode.final_state["messages"][2]
    assert tool_message.type == "tool" and tool_message.content == "5"
    assert "<|im_start|>tool\n5<|im_end|>" in policy.tokenizer.decode(list(second.prompt_ids))
    assert episode.final_state["messages"][-1].content == "The sum is 5."
    for t in episode.turns:
        assert_exact(t, policy)


def test_llm_stream_inside_a_node_is_served(policy):
    from langgraph.graph import END, START, StateGraph

    model = Unreachable()

    def node(state):
        chunks = list(model.stream([HumanMessage(state["question"])]))
        return {"answer": "".join(c.content for c in chunks)}

    g = StateGraph(_graphs.QA)
    g.add_node("solver", node)
    g.add_edge(START, "solver")
    g.add_edge("solver", END)
    episode = instrument(g.compile(), {"solver": policy}).rollout({"question": "hi"})
    assert model.calls == 0 and episode.final_state["answer"] == episode.turns[0].response_text.strip()


def test_graph_stream_and_astream_record_an_episode(policy):
    class Store:
        def __init__(self):
            self.episodes = []

        def write_episode(self, episode):
            self.episodes.append(episode)

    store = Store()
    app = instrument(_graphs.solver_verifier(Unreachable()).compile(), {"solver": policy, "verifier": policy},
                     store=store)
    updates = list(app.stream({"question": "q"}, stream_mode="updates"))
    assert [list(u) for u in updates] == [["solver"], ["verifier"]]
    assert updates[0]["solver"]["answer"] == store.episodes[0].turns[0].response_text.strip()

    async def collect():
        return [u async for u in app.astream({"question": "q2"}, stream_mode="updates")]

    aupdates = asyncio.run(collect())
    assert [list(u) for u in aupdates] == [["solver"], ["verifier"]]
    assert len(store.episodes) == 2 and [t.agent for t in store.episodes[1].turns] == ["solver", "verifier"]
    assert store.episodes[1].turns[0].messages[1].content == "q2"


def test_checkpointer_thread_id_and_state_passthrough(policy):
    graph = _graphs.solver_verifier(Unreachable()).compile(checkpointer=InMemorySaver())
    app = instrument(graph, {"solver": policy, "verifier": policy})
    config = {"configurable": {"thread_id": "th-1"}}
    episode = app.rollout({"question": "q"}, config)
    assert episode.metadata["thread_id"] == "th-1"
    assert app.get_state(config).values["answer"] == episode.final_state["answer"]


async def test_concurrent_async_episodes_do_not_cross_talk(policy):
    app = instrument(_graphs.async_solver_verifier(Unreachable()), {"solver": policy, "verifier": policy})
    questions = [f"question number {i}" for i in range(6)]
    episodes = await asyncio.gather(*(app.arollout({"question": q}, task_id=str(i)) for i, q in enumerate(questions)))
    for q, ep in zip(questions, episodes):
        assert [t.agent for t in ep.turns] == ["solver", "verifier"]
        assert ep.turns[0].messages[0].content == q
        assert ep.turns[1].messages[0].content.startswith(f"check {q}:")
        assert ep.final_state["answer"] == policy.parse(ep.turns[0].response_text).content.strip()
    assert policy.stats.max_batch >= 2  # concurrent episodes shared forward passes


def test_threaded_batch_of_episodes(policy):
    app = instrument(_graphs.solver_verifier(Unreachable()).compile(), {"solver": policy, "verifier": policy})
    outs = app.batch([{"question": f"q{i}"} for i in range(4)])
    assert [o["question"] for o in outs] == ["q0", "q1", "q2", "q3"]

    async def run():
        return await app.abatch([{"question": "a"}, {"question": "b"}])

    assert [o["question"] for o in asyncio.run(run())] == ["a", "b"]


def test_policy_failure_is_recorded_and_isolated():
    good, bad = tiny_policy(seed=0), tiny_policy(seed=1)
    calls = {"n": 0}
    real_forward = bad.model.forward

    def flaky(*args, **kwargs):
        calls["n"] += 1
        raise RuntimeError("device lost")

    bad.model.forward = flaky
    graph = _graphs.solver_verifier(Unreachable()).compile()
    app = instrument(graph, {"solver": good, "verifier": bad})
    ok_app = instrument(graph, {"solver": good, "verifier": good})
    results = {}

    def run_bad():
        try:
            app.rollout({"question": "bad"})
        except RolloutError as exc:
            results["bad"] = exc

    def run_good():
        results["good"] = ok_app.rollout({"question": "good"})

    threads = [threading.Thread(target=run_bad), threading.Thread(target=run_good)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    failed = results["bad"].episode
    assert "PolicyError" in failed.error and "device lost" in failed.error and not failed.ok
    assert [t.agent for t in failed.turns] == ["solver"]  # the solver turn is kept, nothing half-recorded
    assert isinstance(results["bad"].__cause__, PolicyError)
    assert results["good"].ok and [t.agent for t in results["good"].turns] == ["solver", "verifier"]
    assert all(t.messages[1].content.startswith("good") for t in results["good"].turns)
    bad.model.forward = real_forward


def test_graph_without_llm_calls_is_an_error(policy):
    app = instrument(_graphs.no_llm(), {"echo": policy})
    with pytest.raises(NoLLMCallError, match="made no LLM call") as info:
        app.rollout({"question": "q"})
    assert info.value.episode.final_state == {"question": "q", "answer": "q"}
    assert app.invoke({"question": "q"}) == {"question": "q", "answer": "q"}  # plain invoke is fine


def test_per_agent_sampling_and_call_stop_strings(policy):
    app = instrument(_graphs.solver_verifier(Unreachable()).compile(), {"solver": policy, "verifier": policy})
    app.sampling["verifier"] = SamplingParams(max_new_tokens=3, temperature=0)
    episode = app.rollout({"question": "q"})
    solver, verifier = episode.turns
    assert len(solver.response_ids) == policy.sampling.max_new_tokens and solver.finish_reason == "length"
    assert len(verifier.response_ids) == 3 and verifier.sampling.temperature == 0


def test_heterogeneous_team_uses_each_policys_tokenizer():
    a = tiny_policy(seed=0)
    b = tiny_policy(seed=1, arch="qwen2", vocab_size=384)
    app = instrument(_graphs.solver_verifier(Unreachable()).compile(), {"solver": a, "verifier": b})
    solver, verifier = app.rollout({"question": "2+3?"}).turns
    assert_exact(solver, a)
    assert_exact(verifier, b)
    assert max(verifier.response_ids) < len(b.tokenizer)
