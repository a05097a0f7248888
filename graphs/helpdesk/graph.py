"""Helpdesk example app: a drafter writes an answer to a customer's question, a reviewer turns it into the reply.

This module knows nothing about training (it must not import ``drmas_graph``). It is the kind of app that has
no reward function: whether a reply is right and helpful is a judgement call, so `train.yaml` trains it with
a judge model that compares each reply with a reference answer (see ``docs/guide/judge.md``).

Flow::

    START -> drafter -> reviewer -> END

Input: ``{"messages": [{"role": "user", "content": QUESTION}]}`` (the customer's question, a chat message).
``drafter`` answers it from the shop's policy (``POLICY``, in both system prompts) and stores the text in
``draft``; ``reviewer`` sees the question and the draft, fixes what contradicts the policy, shortens it, and
its reply is the final answer: ``reply``, and the last message of ``messages``.
"""

from __future__ import annotations

from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph

__all__ = ["POLICY", "DRAFTER_PROMPT", "REVIEWER_PROMPT", "HelpdeskState", "build_graph"]

POLICY = (
    "Pebble & Pine is an online shop for garden tools. Policy: Returns are accepted within 30 days of delivery "
    "with the receipt; refunds go back to the original payment method within 5 business days. Shipping is free "
    "on orders over $50, else $6. Standard delivery takes 3 to 5 business days, express takes 1 day and costs "
    "$15. Every tool has a 2-year warranty against defects, not against wear. Support hours are Monday to "
    "Friday, 9am to 5pm. We ship only within the country. Gift cards never expire and cannot be refunded."
)
DRAFTER_PROMPT = f"You are a helpdesk agent. {POLICY} Answer the customer's question from this policy."
REVIEWER_PROMPT = (f"You review a helpdesk agent's draft reply. {POLICY} Rewrite the draft as the final reply to "
                   "the customer: correct anything that contradicts the policy, keep it to one or two sentences.")


class HelpdeskState(MessagesState, total=False):
    """Graph state: the conversation (`messages`), the drafter's text and the final reply."""

    draft: str
    """The drafter's answer."""
    reply: str
    """The reviewer's final reply (also the last message)."""


def build_graph(llm: BaseChatModel, *, reviewer_llm: BaseChatModel | None = None) -> CompiledStateGraph:
    """The helpdesk graph; `reviewer_llm` defaults to `llm`."""
    reviewer_llm = reviewer_llm or llm

    def drafter(state: HelpdeskState) -> dict[str, Any]:
        reply = llm.invoke([SystemMessage(DRAFTER_PROMPT), *state["messages"]])
        return {"draft": str(reply.content)}

    def reviewer(state: HelpdeskState) -> dict[str, Any]:
        question = str(state["messages"][-1].content)
        reply = reviewer_llm.invoke([SystemMessage(REVIEWER_PROMPT),
                                     HumanMessage(f"Customer: {question}\nDraft: {state['draft']}")])
        return {"reply": str(reply.content), "messages": [AIMessage(str(reply.content))]}

    g = StateGraph(HelpdeskState)
    g.add_node("drafter", drafter)
    g.add_node("reviewer", reviewer)
    g.add_edge(START, "drafter")
    g.add_edge("drafter", "reviewer")
    g.add_edge("reviewer", END)
    return g.compile()
