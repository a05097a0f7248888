"""Every run of a multi-run episode is a `Segment` (also one that raised), graphs without a checkpointer, answering
an interrupt with None, and the node threads' busy count (review 4: m, u, v, d)."""

import asyncio
import datetime
import threading
import time

import pytest
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import Command, Send, interrupt

from drmas_graph import ConfigError, RolloutError, TraceStore, instrument
from drmas_graph.config import RolloutConfig
from drmas_graph.env import Task
from drmas_graph.instrumentation._limits import StuckEpisodeError
from drmas_graph.testing import scripted_policy
from drmas_graph.traces.replay import replay
from drmas_graph.train.loop._rollouts import EpisodeJob, _NodeThreads, run_episodes
from drmas_graph.types import Episode, Segment
from tests import _graphs
from tests.test_instrument import Unreachable
from tests.test_interrupts import Two, review_graph, thread


def approve_graph(llm, *, final_calls=2):
    """draft -> approve (interrupt) -> final, which makes `final_calls` calls in the run that resumes."""

    def draft(state):
        return {"messages": [llm.invoke(state["messages"])]}

    def approve(state):
        return {"messages": [HumanMessage(f"editor: {interrupt('approve?')}")]}

    def final(state):
        out = []
        for _ in range(final_calls):
            out.append(llm.invoke(state["messages"] + out))
        return {"messages": out}

    g = StateGraph(MessagesState)
    for name, fn in (("draft", draft), ("approve", approve), ("final", final)):
        g.add_node(name, fn)
    g.add_edge(START, "draft")
    g.add_edge("draft", "approve")
    g.add_edge("approve", "final")
    g.add_edge("final", END)
    return g.compile(checkpointer=InMemorySaver())


def _policies():
    return {"draft": scripted_policy(["a draft"], name="d"), "final": scripted_policy(["a", "b"], name="f")}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_resume_run_stopped_by_a_limit_is_a_segment_and_replays_to_where_it_stopped(tmp_path, mode):
    """rev4_m: the run that resumed the interrupt raised (max_llm_calls at its 2nd call): its Segment and its
    Command are recorded, its turn points at it, and replay re-runs it up to the call the limit refused."""
    graph = approve_graph(Unreachable())
    with TraceStore(tmp_path / "t.db") as store:
        app = instrument(graph, _policies(), strict=True, store=store)
        kwargs = dict(resume=lambda ep, its: "shorter", metadata={"max_llm_calls": 2})
        with pytest.raises(RolloutError) as info:
            if mode == "sync":
                app.rollout({"messages": [HumanMessage("write")]}, thread("t1"), **kwargs)
            else:
                asyncio.run(app.arollout({"messages": [HumanMessage("write")]}, thread("t1"), **kwargs))
    episode = info.value.episode
    assert episode.outcome == "truncated" and episode.truncated_by == "max_llm_calls"
    assert [(t.agent, t.segment, t.response_text) for t in episode.turns] == [("draft", 0, "a draft"), ("final", 1, "a")]
    assert [(s.kind, s.input, [r["node"] for r in s.interrupts]) for s in episode.segments] == [
        ("start", None, ["approve"]), ("resume", Command(resume="shorter"), [])]
    with TraceStore(tmp_path / "t.db", readonly=True) as store:
        stored = store.load_episode(episode.id)
    assert stored.segments == episode.segments
    result = replay(graph, tmp_path / "t.db", episode.id)
    assert result.divergences == [] and result.stopped  # before: missing_call at final#0
    assert [(t.agent, t.segment) for t in result.turns] == [("draft", 0), ("final", 1)]


def test_a_conversation_run_that_raises_is_a_segment_with_its_input(tmp_path):
    """rev4_m: a later run started by next_input that fails (a node raises) keeps that input in the trace."""

    def answer(state):
        if state["messages"][-1].content == "break":
            raise ValueError("the tool broke on 'break'")
        return {"messages": [Unreachable().invoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("answer", answer)
    g.add_edge(START, "answer")
    g.add_edge("answer", END)
    with TraceStore(tmp_path / "t.db") as store:
        app = instrument(g.compile(checkpointer=InMemorySaver()), {"answer": scripted_policy(["hi"])}, store=store)
        with pytest.raises(RolloutError, match="the tool broke") as info:
            app.rollout({"messages": [HumanMessage("hello")]}, thread("c"),
                        next_input=lambda ep: {"messages": [HumanMessage("break")]})
        stored = store.load_episode(info.value.episode.id)
    assert stored.outcome == "failed" and [t.segment for t in stored.turns] == [0]
    assert [s.kind for s in stored.segments] == ["start", "input"] and stored.segments[0].input is None
    assert [(type(m).__name__, m.content) for m in stored.segments[1].input["messages"]] == [("HumanMessage", "break")]


def _answer_graph(**compile_kwargs):
    g = StateGraph(_graphs.QA)
    g.add_node("solver", lambda state: {"answer": Unreachable().invoke([HumanMessage(state["question"])]).content})
    g.add_edge(START, "solver")
    g.add_edge("solver", END)
    return g.compile(**compile_kwargs)


def test_a_graph_compiled_with_checkpointer_false_rolls_out_and_trains_with_a_thread_id():
    """rev4_u: checkpointer=False is no saver (like None): the run's state is not read from a checkpointer."""
    graph = _answer_graph(checkpointer=False)
    app = instrument(graph, {"solver": scripted_policy(["2"])})
    episode = app.rollout({"question": "1+1?"}, thread("t1"))
    assert episode.final_state == {"question": "1+1?", "answer": "2"} and episode.segments == []
    jobs = [EpisodeJob(Task(id="t", input={"question": "1+1?"}), "g", 0, 0)]
    batch = run_episodes(app, jobs, phase="train", step=0, run_seed=0, max_concurrency=1, rollout=RolloutConfig())
    assert batch.counts["failed_episodes"] == 0 and [ep.final_state["answer"] for _, ep in batch.runs] == ["2"]
    with pytest.raises(ConfigError, match="next_input continues a conversation.*needs a checkpointer"):
        app.rollout({"question": "1+1?"}, thread("t2"), next_input=lambda ep: None)


def test_command_resume_none_answers_the_interrupt_with_none_and_replays(tmp_path):
    """rev4_v: the advice in the 'returned None' error works: Command(resume=None) resumes with None (as a
    resume map {interrupt id: None}: LangGraph reads resume=None as no resume value)."""
    graph = review_graph(Unreachable())
    with TraceStore(tmp_path / "t.db") as store:
        app = instrument(graph, {"draft": scripted_policy(["d"], name="d"), "final": scripted_policy(["f"], name="f")},
                         store=store)
        with pytest.raises(RolloutError, match=r"return Command\(resume=None\) to resume with None"):
            app.rollout({"messages": [HumanMessage("hi")]}, thread("a"), resume=lambda ep, its: None)
        ids = []
        episode = app.rollout({"messages": [HumanMessage("hi")]}, thread("b"),
                              resume=lambda ep, its: ids.extend(i.id for i in its) or Command(resume=None))
    assert [m.content for m in episode.final_state["messages"]] == ["hi", "d", "reviewer: None", "f"]
    assert episode.segments[1].input == Command(resume={ids[0]: None})
    result = replay(graph, tmp_path / "t.db", episode.id)  # the map is re-keyed to the new thread's interrupt
    assert result.divergences == [] and result.state_matches


def test_command_resume_none_at_a_breakpoint_goes_on_and_with_two_interrupts_asks_which():
    graph = _graphs.solver_verifier(Unreachable()).compile(checkpointer=InMemorySaver(), interrupt_before=["verifier"])
    policy = scripted_policy(["2", "yes"])
    app = instrument(graph, {"solver": policy, "verifier": policy})
    episode = app.rollout({"question": "1+1?"}, thread("b"), resume=lambda ep, its: Command(resume=None))
    assert [(t.agent, t.segment) for t in episode.turns] == [("solver", 0), ("verifier", 1)]

    def branch(name):
        def node(state):
            return {"notes": [f"{name}: {interrupt(name + '?')}"]}
        return node

    g = StateGraph(Two)
    g.add_node("a", branch("a"))
    g.add_node("b", branch("b"))
    g.add_edge(START, "a")
    g.add_edge(START, "b")
    g.add_edge(["a", "b"], END)
    app = instrument(g.compile(checkpointer=InMemorySaver()), {"a": scripted_policy(["x"])})
    with pytest.raises(RolloutError, match=r"several pending interrupts say which one\(s\) to answer") as info:
        app.rollout({"notes": []}, thread("p"), resume=lambda ep, its: Command(resume=None))
    assert "node 'a' (value 'a?'), node 'b' (value 'b?')" in str(info.value)


def test_a_node_thread_is_not_busy_once_its_result_is_handed_back():
    """rev4_d: the event loop may finish the step as soon as a node's result is set; the thread must not count
    as busy (a node 'left behind') by then."""
    threads = _NodeThreads()
    seen = []
    try:
        for fn in (lambda: 42, lambda: 1 / 0):
            future = threads.submit(fn)
            done = threading.Event()
            future.add_done_callback(lambda f: (seen.append(threads.busy), done.set()))  # runs in the node thread
            assert done.wait(30)
    finally:
        threads.shutdown()
    assert seen == [0, 0]


def _two_calls(llm, *, sync):
    """solver -> judge, one LLM call each, as sync or async nodes."""

    def solver(state):
        return {"answer": llm.invoke([HumanMessage(state["question"])]).content}

    def judge(state):
        return {"verdict": llm.invoke([HumanMessage(f"judge {state['answer']}")]).content}

    async def asolver(state):
        return {"answer": (await llm.ainvoke([HumanMessage(state["question"])])).content}

    async def ajudge(state):
        return {"verdict": (await llm.ainvoke([HumanMessage(f"judge {state['answer']}")])).content}

    g = StateGraph(_graphs.QA)
    g.add_node("solver", solver if sync else asolver)
    g.add_node("judge", judge if sync else ajudge)
    g.add_edge(START, "solver")
    g.add_edge("solver", "judge")
    g.add_edge("judge", END)
    return g.compile()


def _slow_judge(prompt):
    if "judge" in prompt:
        time.sleep(2.5)  # a generation that straddles timeout_s + the backstop's grace
    return "ok"


@pytest.mark.parametrize("sync", [True, False], ids=["sync_nodes", "async_nodes"])
def test_an_episode_whose_time_cap_elapses_inside_a_generation_is_truncated_not_failed(tmp_path, sync):
    """The backstop cancels an episode that is still generating at timeout_s + 1 s: it is truncated by timeout_s
    (kept, with its turns so far), not failed as stuck in a tool."""
    with TraceStore(tmp_path / "t.db") as store:
        app = instrument(_two_calls(Unreachable(), sync=sync), {"solver": scripted_policy(_slow_judge),
                                                                 "judge": scripted_policy(_slow_judge, seed=1)},
                         store=store)
        jobs = [EpisodeJob(Task(id="t", input={"question": "1+1?"}), "g", 0, 0)]
        batch = run_episodes(app, jobs, phase="train", step=0, run_seed=0, max_concurrency=1,
                             rollout=RolloutConfig(timeout_s=0.3))
        assert batch.errors == [] and batch.counts["truncated/timeout_s"] == 1
        ((_, episode),) = batch.runs
        stored = store.load_episode(episode.id)
    for ep in (episode, stored):
        assert ep.outcome == "truncated" and ep.error is None and ep.truncated_by == "timeout_s"
        assert "inside an LLM call that had not returned, after 1 LLM call(s)" in ep.truncated
        assert [(t.agent, t.response_text) for t in ep.turns] == [("solver", "ok")]


def test_an_episode_stuck_between_calls_is_stored_with_stuck_episode_error(tmp_path):
    llm = Unreachable()

    async def solver(state):
        return {"answer": (await llm.ainvoke([HumanMessage(state["question"])])).content}

    async def tool(state):
        await asyncio.sleep(3600)  # never answers

    g = StateGraph(_graphs.QA)
    g.add_node("solver", solver)
    g.add_node("tool", tool)
    g.add_edge(START, "solver")
    g.add_edge("solver", "tool")
    g.add_edge("tool", END)
    with TraceStore(tmp_path / "t.db") as store:
        app = instrument(g.compile(), {"solver": scripted_policy(["2"])}, store=store)
        jobs = [EpisodeJob(Task(id="t", input={"question": "1+1?"}), "g", 0, 0)]
        batch = run_episodes(app, jobs, phase="train", step=0, run_seed=0, max_concurrency=1,
                             rollout=RolloutConfig(timeout_s=0.3))
        (error,) = batch.errors
        stored = store.load_episode(error.episode.id)
    assert isinstance(error, StuckEpisodeError) and batch.counts["failed_episodes"] == 1
    assert stored.error.startswith("StuckEpisodeError: episode ") and "task 't'" in stored.error  # was CancelledError
    assert "rollout.timeout_s=0.3 (+1 s) without starting another LLM call, after 1 LLM call(s)" in stored.error
    assert [t.response_text for t in stored.turns] == ["2"] and stored.truncated is None


class _EndlessChat:
    def next_input(self, task, episode):
        return {"messages": [HumanMessage(f"and then? ({len(episode.turns)})")]}


def test_a_conversation_still_going_at_max_resumes_is_truncated():
    g = StateGraph(MessagesState)
    g.add_node("answer", lambda state: {"messages": [Unreachable().invoke(state["messages"])]})
    g.add_edge(START, "answer")
    g.add_edge("answer", END)
    app = instrument(g.compile(checkpointer=InMemorySaver()), {"answer": scripted_policy(["sure"])})
    with pytest.raises(RolloutError, match=r"stopped after 3 LLM call\(s\): max_resumes: .*rollout.max_resumes=2") as info:
        app.rollout({"messages": [HumanMessage("hi")]}, thread("c"), max_resumes=2,
                    next_input=lambda ep: _EndlessChat().next_input(None, ep))
    episode = info.value.episode
    assert episode.outcome == "truncated" and episode.truncated_by == "max_resumes" and episode.error is None
    assert [s.kind for s in episode.segments] == ["start", "input", "input"] and [t.segment for t in episode.turns] == [0, 1, 2]
    assert [m.content for m in episode.final_state["messages"]] == ["hi", "sure", "and then? (1)", "sure", "and then? (2)", "sure"]
    jobs = [EpisodeJob(Task(id="t", input={"messages": [HumanMessage("hi")]}), "g", 0, 0)]
    batch = run_episodes(app, jobs, phase="train", step=0, run_seed=0, max_concurrency=1, env=_EndlessChat(),
                         rollout=RolloutConfig(max_resumes=1))
    assert batch.errors == [] and batch.counts["truncated/max_resumes"] == batch.counts["truncated_episodes"] == 1


SEGMENT_INPUTS = [
    Command(resume="approved"), Command(resume={"0123abc": None, "4567def": "x"}),
    Command(update={"k": 1, "messages": [HumanMessage("note", id="n1")]}),
    Command(update=[("k", 1), ("messages", [HumanMessage("note", id="n1")])]), Command(update=(("k", 1),)),
    Command(goto="node"), Command(goto=["a", "b"]), Command(goto=("a", "b")),
    Command(goto=Send("node", {"x": 1})), Command(goto=Send("node", {"x": 1}, timeout=2.5)),
    Command(goto=[Send("a", {"messages": [HumanMessage("hi", id="h1")]}), Send("b", 3)]),
    Command(graph=Command.PARENT, goto="outer", update={"done": True}),
    Command(resume="ok", update=[("k", 2)], goto=[Send("a", None)]),
    {"messages": [HumanMessage("next", id="u1")]}, {"question": "2+2?", "hints": [1, 2], "meta": {"a": None}},
]


@pytest.mark.parametrize("value", SEGMENT_INPUTS, ids=repr)
def test_every_segment_input_comes_back_from_the_store_as_the_same_object(tmp_path, value):
    """A later run's input (Command update as dict / pairs, goto as name(s) / Send(s), resume value / map, graph=,
    plain inputs with messages) is stored losslessly, as the episode input: the reconstructed value is equal."""
    episode = Episode(input=value, segments=[Segment("start", None, ({"node": "n", "id": "i", "value": 1},)),
                                             Segment("resume", value, ())])
    with TraceStore(tmp_path / "t.db") as store:
        store.write_episode(episode)
        stored = store.load_episode(episode.id)
    assert stored.segments[1].input == value and stored.input == value
    assert type(stored.segments[1].input) is type(value)


def test_a_resume_command_with_pair_updates_and_a_send_replays_from_the_store(tmp_path):
    """Command(resume=..., update=[(key, value)]) and a conversation's Command(goto=Send(...)) replay as recorded
    (stored as lists and reprs, LangGraph read them as other updates / could not run them)."""
    graph = review_graph(Unreachable())
    note = HumanMessage("a note from the editor", id="note-1")
    answer = Command(resume="fine", update=[("messages", [note])])
    sent = Command(goto=Send("final", {"messages": [HumanMessage("once more", id="again-1")]}))
    inputs = iter([sent, None])
    with TraceStore(tmp_path / "t.db") as store:
        app = instrument(graph, {"draft": scripted_policy(["d"], name="d"), "final": scripted_policy(["f1", "f2"], name="f")},
                         store=store)
        episode = app.rollout({"messages": [HumanMessage("hi")]}, thread("r"), resume=lambda ep, its: answer,
                              next_input=lambda ep: next(inputs))
    assert [(s.kind, s.input) for s in episode.segments] == [("start", None), ("resume", answer), ("input", sent)]
    assert [t.messages[-1].content for t in episode.turns] == ["hi", "reviewer: fine", "once more"]
    with TraceStore(tmp_path / "t.db", readonly=True) as store:
        assert store.load_episode(episode.id).segments == episode.segments
    result = replay(graph, tmp_path / "t.db", episode.id)
    assert result.divergences == [] and result.state_matches and [t.segment for t in result.turns] == [0, 1, 2]


def test_replay_names_a_later_run_whose_input_was_stored_as_its_repr_and_needs_a_real_saver(tmp_path):
    """A resume value with no JSON form (a datetime: the checkpointer keeps it, the trace store its repr) is stored as its repr: replay says the run it started is not reproducible
    (before: only the episode's first input was checked, so the replay claimed to be exact). A graph compiled
    with checkpointer=False cannot replay a multi-run episode: a clear ConfigError, as without a checkpointer."""
    graph = approve_graph(Unreachable(), final_calls=1)
    with TraceStore(tmp_path / "t.db") as store:
        episode = instrument(graph, _policies(), strict=True, store=store).rollout(
            {"messages": [HumanMessage("write")]}, thread("t1"), resume=lambda ep, its: Command(resume=datetime.datetime(2026, 12, 2)))
    assert [s.kind for s in episode.segments] == ["start", "resume"]
    result = replay(graph, tmp_path / "t.db", episode.id)
    assert result.unreproducible == ("the input of run 1 (resume) had no JSON form and was stored as its repr; "
                                     "replay ran on that repr")
    no_saver = approve_graph(Unreachable(), final_calls=1).builder.compile(checkpointer=False)
    with pytest.raises(ConfigError, match="2 runs of one thread.*needs the graph compiled with a checkpointer"):
        replay(no_saver, tmp_path / "t.db", episode.id)
