"""Found by the property suite (test_a_changed_reply_is_reported_where_it_flows): replaying an episode that ran
once (no interrupt) into a run that now stops at an `interrupt()` reports `missing_call` for the calls after it,
never that the run stopped at an interrupt the recording does not have.

`_Runs.after` compares the interrupts a run stopped at with the recording only when the episode recorded its
runs (`Episode.segments`, kept for episodes of more than one run or that ended paused). A one-run episode has
no segments, so when the replayed run stops at `interrupt()` (here: a node on the other side of a conditional
edge, taken because one reply differs; equally, an edited node that now asks a human) the replay just ends:
`divergences` is `[missing_call at 'write']`, `stopped` False, and the pause is not mentioned.
README: "the interrupts each run stops at are compared by node and value (`Divergence.kind ==
"interrupt_changed"` when they differ)".

Expected: the first divergence is `interrupt_changed` at node 'ask' (its diff shows the new interrupt's value).
Run: PYTHONPATH=. python tests/property/found_replay_ignores_new_interrupt.py (exit 1 while the defect is present).
"""

import sys
import warnings
from typing import TypedDict

from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt

from drmas_graph import instrument
from drmas_graph.testing import scripted_policy
from drmas_graph.traces.replay import replay_episode

warnings.simplefilter("ignore")
llm = FakeListChatModel(responses=["the app's own model: never called"])


class State(TypedDict, total=False):
    topic: str
    draft: str


def draft(state):
    return {"draft": llm.invoke([HumanMessage(f"draft about {state['topic']}")]).content}


def ask(state):  # the other branch asks a human first
    return {"draft": llm.invoke([HumanMessage(f"revise per {interrupt({'draft': state['draft']})}")]).content}


def write(state):
    return {"draft": llm.invoke([HumanMessage(f"polish {state['draft']}")]).content}


def build(with_interrupt_on_write: bool):
    g = StateGraph(State)
    g.add_node("draft", draft)
    g.add_node("ask", ask)
    g.add_node("write", ask if with_interrupt_on_write else write)
    g.add_edge(START, "draft")
    g.add_conditional_edges("draft", lambda s: "ask" if "long" in s["draft"] else "write", ["ask", "write"])
    g.add_edge("ask", END)
    g.add_edge("write", END)
    return g.compile(checkpointer=InMemorySaver())


policy = scripted_policy(["short draft", "polished"])
app = instrument(build(False), {"draft": policy, "write": policy, "ask": policy})
episode = app.rollout({"topic": "cats"}, {"configurable": {"thread_id": "t"}})
assert [t.node for t in episode.turns] == ["draft", "write"] and not episode.segments

result = replay_episode(build(True), episode)  # the edited app: 'write' now asks a human first
kinds = [d.kind for d in result.divergences]
if not kinds or kinds[0] != "interrupt_changed":
    print(f"DEFECT: the replayed run stopped at interrupt() in node 'write' (the recording did not); replay reports "
          f"{[str(d).splitlines()[0] for d in result.divergences]} (stopped={result.stopped}, "
          f"state_matches={result.state_matches})")
    sys.exit(1)
print(f"ok: {result.divergences[0]}")
