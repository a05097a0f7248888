"""Research example app: clarify the request, write a research brief, research with a search tool, report.

A re-creation, in this project's own code, of the *pattern* of open-deep-research's default setup: nodes
call OpenAI chat models through `with_structured_output(Schema)` (ChatOpenAI's default method, `json_schema`:
the schema travels as `response_format`) wrapped in `.with_retry(stop_after_attempt=3)`, and a researcher
calls a search tool and a `ResearchComplete` tool until it is done. It is not that project's code and it does
not depend on it. Like every app under `graphs/`, it knows nothing about training (no ``drmas_graph``
import).

Flow::

    START -> clarify --needs clarification--> END (the question is the last message)
               |
               +--> write_brief -> researcher --search calls--> researcher ... -> report -> END
                                       |  (ResearchComplete, no tool call, or max_iterations)
                                       +--> report

The app does not catch what its models' replies break: a reply that is not the JSON its schema asks for
fails the `with_structured_output` parser (after 3 attempts), and search arguments that fail the tool's
schema raise the tool's validation error.

`offline_openai_model()` is a ChatOpenAI pointed at a closed local port (``http://127.0.0.1:9/v1``): the app
is written against OpenAI's API as the original is by default; under training every call is served by a
policy and no request is ever sent. Outside training it fails to connect.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.graph.state import CompiledStateGraph
from pydantic import BaseModel, Field

__all__ = ["ClarifyWithUser", "ResearchBrief", "ResearchComplete", "ResearchState", "CORPUS", "build_graph",
           "offline_openai_model", "web_search"]

CLARIFY_PROMPT = ("Decide whether the user's request is clear enough to research. Reply in JSON with "
                  "need_clarification, question (what to ask if unclear) and verification (what you will research).")
BRIEF_PROMPT = "Turn the user's request into a one-sentence research brief. Reply in JSON."
RESEARCH_PROMPT = ("Research the brief with the web_search tool, one query at a time. Call ResearchComplete "
                   "when the notes answer it.")
REPORT_PROMPT = "Write a one-paragraph report that answers the brief from the notes."

CORPUS = (
    "The Ostrel river flows through the town of Vamberg.",
    "Vamberg was founded in 1291 by the merchant Ilsa Korrin.",
    "The Korrin bridge over the Ostrel was built in 1340.",
    "Lake Semmerin feeds the Ostrel river from the north.",
    "The glassworks of Vamberg were famous for blue glass.",
)
"""The documents `web_search` searches (invented facts)."""


class ClarifyWithUser(BaseModel):
    """Whether to ask the user a clarifying question before researching."""

    need_clarification: bool = Field(description="True when the request is too unclear to research.")
    question: str = Field(description="The question to ask the user when clarification is needed.")
    verification: str = Field(description="What will be researched, when no clarification is needed.")


class ResearchBrief(BaseModel):
    """The research brief written from the user's request."""

    research_brief: str = Field(description="One sentence saying what to find out.")


class ResearchComplete(BaseModel):
    """Call this when the notes answer the research brief."""


@tool
def web_search(query: str, max_results: int = 2) -> str:
    """Search the web for documents matching the query; returns the best matches, one per line."""
    words = {w.strip(".,?").lower() for w in query.split() if len(w) > 2}
    scored = sorted(CORPUS, key=lambda doc: -len(words & {w.strip(".,").lower() for w in doc.split()}))
    return "\n".join(scored[:max_results])


class ResearchState(TypedDict, total=False):
    """Graph state. Input: ``{"messages": [request]}``."""

    messages: Annotated[list[AnyMessage], add_messages]
    """The user's request, then the clarifier's question or verification and the final report."""
    need_clarification: bool
    """The clarifier asked the user a question (the run ends there)."""
    research_brief: str
    """What the researcher looks for."""
    notes: Annotated[list[str], operator.add]
    """Search results gathered by the researcher."""
    iterations: int
    """Researcher turns so far."""
    research_done: bool
    """The researcher's last turn called ResearchComplete or no search."""
    final_report: str
    """The report (the app's answer)."""


def offline_openai_model() -> BaseChatModel:
    """ChatOpenAI on a closed local port (see the module docstring); needs ``langchain-openai``."""
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="gpt-4.1", base_url="http://127.0.0.1:9/v1", api_key="not-used", max_retries=0)


def build_graph(llm: BaseChatModel | None = None, *, max_iterations: int = 2) -> CompiledStateGraph:
    """Compile the research app; every node calls `llm` (default: `offline_openai_model()`): nodes ``clarify``
    and ``write_brief`` with structured output, ``researcher`` with tools, ``report`` as free text."""
    llm = llm or offline_openai_model()

    def structured(schema: type[BaseModel]) -> Any:  # as the original: json_schema, 3 attempts
        return llm.with_structured_output(schema, method="json_schema").with_retry(
            stop_after_attempt=3, wait_exponential_jitter=False)

    def clarify(state: ResearchState) -> dict[str, Any]:
        answer = structured(ClarifyWithUser).invoke([SystemMessage(CLARIFY_PROMPT), *state["messages"]])
        text = answer.question if answer.need_clarification else answer.verification
        return {"need_clarification": answer.need_clarification, "messages": [AIMessage(text)]}

    def write_brief(state: ResearchState) -> dict[str, Any]:
        brief = structured(ResearchBrief).invoke([SystemMessage(BRIEF_PROMPT), state["messages"][0]])
        return {"research_brief": brief.research_brief}

    def researcher(state: ResearchState) -> dict[str, Any]:
        notes = "\n".join(state.get("notes", [])) or "(none yet)"
        prompt = [SystemMessage(RESEARCH_PROMPT), HumanMessage(f"Brief: {state['research_brief']}\nNotes:\n{notes}")]
        reply = llm.bind_tools([web_search, ResearchComplete]).invoke(prompt)
        found = [web_search.invoke(call["args"]) for call in reply.tool_calls if call["name"] == "web_search"]
        done = not found or any(call["name"] == "ResearchComplete" for call in reply.tool_calls)
        return {"notes": found, "iterations": state.get("iterations", 0) + 1, "research_done": done}

    def report(state: ResearchState) -> dict[str, Any]:
        notes = "\n".join(state.get("notes", [])) or "(no notes)"
        text = llm.invoke([SystemMessage(REPORT_PROMPT),
                           HumanMessage(f"Brief: {state['research_brief']}\nNotes:\n{notes}")]).text
        return {"final_report": text, "messages": [AIMessage(text)]}

    def after_clarify(state: ResearchState) -> str:
        return END if state["need_clarification"] else "write_brief"

    def after_research(state: ResearchState) -> str:
        return "report" if state["research_done"] or state["iterations"] >= max_iterations else "researcher"

    builder = StateGraph(ResearchState)
    for name, node in (("clarify", clarify), ("write_brief", write_brief), ("researcher", researcher),
                       ("report", report)):
        builder.add_node(name, node)
    builder.add_edge(START, "clarify")
    builder.add_conditional_edges("clarify", after_clarify, ["write_brief", END])
    builder.add_edge("write_brief", "researcher")
    builder.add_conditional_edges("researcher", after_research, ["researcher", "report"])
    builder.add_edge("report", END)
    return builder.compile(name="research")
