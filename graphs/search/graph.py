"""Search example app: router, searcher and answerer around a ``search`` tool, as a LangGraph graph.

This module knows nothing about training (it must not import ``drmas_graph``): it is the stand-in for an
existing application that the trainer instruments from the outside.

Flow::

    START -> router --answer--> answerer -> END
               ^  |
               |  +--search / unreadable--> searcher --(searches < max_steps)--> router
               |                                 |
               +---------------------------------+   (after max_steps searches: -> answerer)

Reply formats (what each agent is asked for, and what else parses):
- router, asked "Do the facts answer the question?": a reply opening with ``Yes`` (= answer) or ``No``
  (= search); a reply opening with ``answer`` or ``search`` also parses.
- searcher: the query itself, one line of at most 12 words; an optional ``Query:`` label is dropped.
  The graph runs it through the ``search`` tool (top-3 documents, appended to the evidence, each once).
- answerer: ``The answer is <short answer>.`` (or ``Answer: <short answer>``); the answer ends at the
  first sentence or clause break.
At most ``max_steps`` searches: after the last one the answerer runs.

Why these formats (SmolLM2-135M-Instruct, Q4_1 GGUF, temperature 0.7, a few samples, so rough): it never
opened with ``search``/``answer`` (0 of 8) nor wrote ``Query:`` (0 of 40, five wordings); it opened
with Yes/No in 3-5 of 8, often replied with a bare short query, and wrote "The answer is X." in 3 of 8
given the gold facts (2 right), but never "Answer: X". Through this graph (max_steps=2) on 6 one-hop
questions: router replies valid 5 of 12, searcher 4 of 8, answerer 4 of 6; no episode correct.

Choice for replies that break the format (the env's ``turn_is_valid`` flags them for the penalty):
- router: an unreadable decision counts as ``search`` (keep gathering, bounded by ``max_steps``).
- searcher: an unreadable query (empty, several lines, or over 12 words) falls back to the question.
- answerer: ``answer`` is ``None``.
"""

from __future__ import annotations

import operator
import re
from typing import Annotated, Any, Protocol, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage
from langchain_core.tools import BaseTool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph

__all__ = [
    "ANSWERER_PROMPT",
    "MAX_QUERY_WORDS",
    "ROUTER_PROMPT",
    "SEARCHER_PROMPT",
    "SearchState",
    "answerer_messages",
    "build_graph",
    "format_evidence",
    "parse_answer",
    "parse_decision",
    "parse_query",
    "router_messages",
    "searcher_messages",
]

ROUTER_PROMPT = "Do the facts answer the question? Start your reply with Yes or No."
SEARCHER_PROMPT = "Reply with only a short search query that finds a missing fact."
ANSWERER_PROMPT = "Answer the question from the facts in one short line, like: The answer is Tolvik."
MAX_QUERY_WORDS = 12
"""A searcher reply longer than this (or on several lines) is not a query."""


class SearchState(TypedDict, total=False):
    """Graph state. Input: ``{"question": ...}``; everything else is filled in by the nodes."""

    question: str
    """The question text."""
    evidence: list[dict[str, str]]
    """Documents retrieved so far (``id``, ``title``, ``text``), in retrieval order, each id once."""
    queries: Annotated[list[str], operator.add]
    """The queries actually run, in order (after the invalid-format fallback)."""
    searches: int
    """Searcher turns taken so far."""
    decision: str | None
    """The router's latest decision: ``"search"``, ``"answer"`` or ``None`` (unreadable: searches)."""
    answer: str | None
    """The answerer's parsed answer (``None`` if it broke the format or has not run)."""
    transcript: Annotated[list[dict[str, Any]], operator.add]
    """Every turn in order: ``{"agent": "router"|"searcher"|"answerer", "text": raw reply}``."""


class _HasTool(Protocol):
    def as_tool(self) -> BaseTool: ...


_LEAD = r"^[\s\"'*`_#>-]*"  # decoration a model may put before a keyword: quotes, markdown, bullets
_DECISION_RE = re.compile(_LEAD + r"(?:decision\s*[:=]?\s*\**\s*)?(yes|no|search|answer)\b", re.IGNORECASE)
_DECISIONS = {"yes": "answer", "answer": "answer", "no": "search", "search": "search"}
_QUERY_LABEL_RE = re.compile(_LEAD + r"query\s*\**\s*:", re.IGNORECASE)
_ANSWER_RE = re.compile(r"\banswer\s*\**\s*(?:is\b\s*:?|:)\s*(.*)$", re.IGNORECASE | re.MULTILINE)
_CLAUSE_END_RE = re.compile(r"[.,;!?](?:\s|$)")
_TRIM = " \t\"'`*"


def parse_decision(text: str) -> str | None:
    """``"answer"`` if the reply opens with Yes (or "answer"), ``"search"`` if with No (or "search"), else None.

    Case-insensitive; leading quotes, markdown and a ``Decision:`` label are tolerated.
    """
    match = _DECISION_RE.match(text or "")
    return _DECISIONS[match.group(1).lower()] if match else None


def parse_query(text: str) -> str | None:
    """The query: the reply as one line of 1..``MAX_QUERY_WORDS`` words, ``Query:`` label and quotes dropped.

    ``None`` for an empty reply, one on several lines, or one with more words (a model rambling).
    """
    query = (text or "").strip()
    query = _QUERY_LABEL_RE.sub("", query, count=1).strip(_TRIM + ".")
    if not query or "\n" in query or len(query.split()) > MAX_QUERY_WORDS:
        return None
    return query


def parse_answer(text: str) -> str | None:
    """The words after the last ``The answer is`` / ``Answer:``, up to the first sentence or clause break.

    ``parse_answer("The answer is Velmora. It lies...") == "Velmora"``; ``None`` if there is no such phrase
    or nothing follows it.
    """
    for match in reversed(list(_ANSWER_RE.finditer(text or ""))):
        answer = _CLAUSE_END_RE.split(match.group(1).strip(_TRIM), maxsplit=1)[0].strip(_TRIM + ".")
        if answer:
            return answer
    return None


def format_evidence(evidence: list[dict[str, str]]) -> str:
    """The facts block of every prompt: one ``- text`` line per document, or ``(none yet)``."""
    if not evidence:
        return "(none yet)"
    return "\n".join(f"- {doc['text']}" for doc in evidence)


def _user(question: str, evidence: list[dict[str, str]]) -> str:
    return f"Question: {question}\nFacts:\n{format_evidence(evidence)}"


def router_messages(question: str, evidence: list[dict[str, str]]) -> list[BaseMessage]:
    """The router's prompt: the question and the facts gathered so far."""
    return [SystemMessage(ROUTER_PROMPT), HumanMessage(_user(question, evidence))]


def searcher_messages(question: str, evidence: list[dict[str, str]], queries: list[str]) -> list[BaseMessage]:
    """The searcher's prompt: the question, the facts, and the queries already run (if any)."""
    user = _user(question, evidence)
    if queries:
        user += "\nQueries so far: " + "; ".join(queries)
    return [SystemMessage(SEARCHER_PROMPT), HumanMessage(user)]


def answerer_messages(question: str, evidence: list[dict[str, str]]) -> list[BaseMessage]:
    """The answerer's prompt: the question and the facts."""
    return [SystemMessage(ANSWERER_PROMPT), HumanMessage(_user(question, evidence))]


def build_graph(llm: BaseChatModel, retriever: BaseTool | _HasTool, *,
                max_steps: int = 4) -> CompiledStateGraph:
    """Compile the router/searcher/answerer graph; each node calls ``llm.invoke(messages)``.

    Args:
        llm: any LangChain chat model, shared by the three agents.
        retriever: a LangChain tool named ``search`` taking ``{"query": str}`` and returning a list of
            ``{"id", "title", "text"}`` dicts, or an object with ``as_tool()`` that makes one (``Retriever``).
        max_steps: most searches per episode (>= 1); after the last one the answerer runs.
    """
    if not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be an int >= 1 (searches per episode), got {max_steps!r}")
    tool = retriever if isinstance(retriever, BaseTool) else retriever.as_tool()
    if tool.name != "search":
        raise ValueError(f"the retrieval tool must be named 'search', got {tool.name!r}")

    def router(state: SearchState) -> dict[str, Any]:
        text = llm.invoke(router_messages(state["question"], state.get("evidence", []))).text
        return {"decision": parse_decision(text), "transcript": [{"agent": "router", "text": text}]}

    def searcher(state: SearchState) -> dict[str, Any]:
        evidence = list(state.get("evidence", []))
        messages = searcher_messages(state["question"], evidence, state.get("queries", []))
        text = llm.invoke(messages).text
        query = parse_query(text) or state["question"]
        docs = tool.invoke({"query": query})
        if not isinstance(docs, list) or not all(isinstance(d, dict) and {"id", "text"} <= d.keys() for d in docs):
            raise TypeError("the 'search' tool must return a list of dicts with 'id' and 'text', "
                            f"got {docs!r:.200}")
        seen = {doc["id"] for doc in evidence}
        evidence += [doc for doc in docs if doc["id"] not in seen]
        return {
            "evidence": evidence,
            "queries": [query],
            "searches": state.get("searches", 0) + 1,
            "transcript": [{"agent": "searcher", "text": text}],
        }

    def answerer(state: SearchState) -> dict[str, Any]:
        text = llm.invoke(answerer_messages(state["question"], state.get("evidence", []))).text
        return {"answer": parse_answer(text), "transcript": [{"agent": "answerer", "text": text}]}

    def after_router(state: SearchState) -> str:
        return "answerer" if state.get("decision") == "answer" else "searcher"

    def after_searcher(state: SearchState) -> str:
        return "answerer" if state.get("searches", 0) >= max_steps else "router"

    builder = StateGraph(SearchState)
    builder.add_node("router", router)
    builder.add_node("searcher", searcher)
    builder.add_node("answerer", answerer)
    builder.add_edge(START, "router")
    builder.add_conditional_edges("router", after_router, ["searcher", "answerer"])
    builder.add_conditional_edges("searcher", after_searcher, ["router", "answerer"])
    builder.add_edge("answerer", END)
    # 2 supersteps per search plus the answerer, plus slack: max_steps, not LangGraph's limit, ends an episode.
    return builder.compile(name="search").with_config(recursion_limit=2 * max_steps + 5)
