"""Support example app: a customer-support chat on one checkpointed thread, with a human in the loop.

This module knows nothing about training (it must not import ``drmas_graph``). It is the kind of app
LangGraph's own tutorials build: every customer message is one ``invoke`` on the conversation's thread
(the checkpointer keeps the history), and a refund waits for a supervisor through ``interrupt()``.

Flow of one run (one customer message)::

    START -> agent --"REFUND <amount>"--> approve --> agent --> ... --> END
               |                        (interrupt: the supervisor answers "yes" or "no")
               +--any other reply--> END

``agent`` answers the conversation so far (system prompt ``AGENT_PROMPT``). A reply that asks for a
refund (``REFUND 30``, the amount in whole dollars) goes to ``approve``, which pauses the thread with
``interrupt({"refund": 30})``; the run ends there and the app resumes it with
``graph.invoke(Command(resume="yes"), config)``. The decision is added to the conversation as a
supervisor note and ``agent`` answers the customer again; a refund request right after a supervisor note
ends the run (one decision per request, no loop).
"""

from __future__ import annotations

import re
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import interrupt

__all__ = ["AGENT_PROMPT", "SupportState", "build_graph", "parse_refund"]

AGENT_PROMPT = ("You are a support agent. Answer the customer in one short line. To refund an order, reply "
                "only: REFUND <amount in dollars>. A supervisor approves refunds.")

_NOTE = "[supervisor]"
_REFUND = re.compile(r"\bREFUND\s+\$?(\d+)", re.IGNORECASE)


class SupportState(MessagesState, total=False):
    """Graph state: the conversation (`messages`) and the refunds decided on this thread."""

    refunds: list[dict[str, Any]]
    """Every refund the supervisor decided on: {'amount': int, 'approved': bool}."""


def parse_refund(text: str) -> int | None:
    """The amount of a ``REFUND <amount>`` reply, or None."""
    match = _REFUND.search(text or "")
    return int(match.group(1)) if match else None


def build_graph(llm: BaseChatModel, *, checkpointer: Any = None) -> CompiledStateGraph:
    """The support chat, compiled with `checkpointer` (a conversation needs one: `InMemorySaver()`,
    `SqliteSaver`, ...)."""

    def agent(state: SupportState) -> dict[str, Any]:
        reply = llm.invoke([SystemMessage(AGENT_PROMPT), *state["messages"]])
        return {"messages": [AIMessage(reply.content)]}

    def route(state: SupportState) -> str:
        wants = parse_refund(str(state["messages"][-1].content)) is not None
        after_note = len(state["messages"]) > 1 and str(state["messages"][-2].content).startswith(_NOTE)
        return "approve" if wants and not after_note else END

    def approve(state: SupportState) -> dict[str, Any]:
        amount = parse_refund(str(state["messages"][-1].content))
        decision = interrupt({"refund": amount})  # the run stops here until Command(resume="yes" / "no")
        approved = str(decision).strip().lower().startswith("y")
        note = f"{_NOTE} refund of ${amount} {'approved' if approved else 'denied'}"
        return {"messages": [HumanMessage(note)],
                "refunds": [*state.get("refunds", []), {"amount": amount, "approved": approved}]}

    g = StateGraph(SupportState)
    g.add_node("agent", agent)
    g.add_node("approve", approve)
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", route, ["approve", END])
    g.add_edge("approve", "agent")
    return g.compile(checkpointer=checkpointer)
