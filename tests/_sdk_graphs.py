"""Apps whose nodes call LLM APIs through SDKs and raw HTTP, not LangChain (they know nothing about drmas_graph)."""

import httpx
import openai
from langgraph.graph import END, START, StateGraph

from tests._graphs import QA

GEMINI = "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.0-flash:generateContent"


def sdk_solver_gemini_verifier():
    """solver (the OpenAI SDK) -> verifier (a raw httpx POST to Gemini's API, which drmas-graph does not serve;
    the node goes on without a verdict when the request fails)."""
    client = openai.OpenAI(api_key="sk-never-sent", max_retries=0)

    def solver(state):
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=[
            {"role": "system", "content": "Solve it."}, {"role": "user", "content": state["question"]}])
        return {"answer": reply.choices[0].message.content}

    def verifier(state):
        try:
            reply = httpx.post(GEMINI, json={"contents": [{"parts": [{"text": state["answer"]}]}]}, timeout=2)
            return {"verdict": reply.text}
        except Exception:  # noqa: BLE001 - an app that shrugs off its verifier's failure
            return {"verdict": "unknown"}

    g = StateGraph(QA)
    g.add_node("solver", solver)
    g.add_node("verifier", verifier)
    g.add_edge(START, "solver")
    g.add_edge("solver", "verifier")
    g.add_edge("verifier", END)
    return g
