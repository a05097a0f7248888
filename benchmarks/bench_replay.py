"""Replay speed against the original run.

    python benchmarks/bench_replay.py [--episodes 8] [--new-tokens 32]

Records episodes of a two-node graph (solver -> verifier) with the tiny model into a trace store, then
replays each one from the store (no model: every LLM call answered from the recording) and prints the
time of the original runs, of the replays, and their ratio. Every replay must reproduce its final state.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import TypedDict

warnings.filterwarnings("ignore")

from langchain_core.language_models.chat_models import BaseChatModel  # noqa: E402
from langchain_core.messages import HumanMessage  # noqa: E402
from langgraph.graph import END, START, StateGraph  # noqa: E402

from drmas_graph import SamplingParams, TraceStore, instrument, replay  # noqa: E402
from drmas_graph.testing import tiny_policy  # noqa: E402


class AppModel(BaseChatModel):
    @property
    def _llm_type(self) -> str:
        return "app-model"

    def _generate(self, *a, **k):
        raise AssertionError("never called inside instrumented runs or replays")


class QA(TypedDict, total=False):
    question: str
    answer: str
    verdict: str


def build_graph():
    llm = AppModel()
    g = StateGraph(QA)
    g.add_node("solver", lambda s: {"answer": llm.invoke([HumanMessage(s["question"])]).content})
    g.add_node("verifier", lambda s: {"verdict": llm.invoke([HumanMessage(f"{s['question']} {s['answer']}")]).content})
    g.add_edge(START, "solver")
    g.add_edge("solver", "verifier")
    g.add_edge("verifier", END)
    return g.compile()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    graph = build_graph()
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=args.new_tokens))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.db"
        with TraceStore(path) as store:
            app = instrument(graph, {"solver": policy, "verifier": policy}, store=store)
            app.rollout({"question": "warm-up"})
            originals, ids = [], []
            for i in range(args.episodes):
                t0 = time.perf_counter()
                ids.append(app.rollout({"question": f"What is {i} + {i}?"}).id)
                originals.append(time.perf_counter() - t0)
            replays = []
            for episode_id in ids:
                t0 = time.perf_counter()
                result = replay(graph, store, episode_id)
                replays.append(time.perf_counter() - t0)
                assert result.state_matches and not result.divergences
    orig, rep = statistics.median(originals), statistics.median(replays)
    print(f"original run: {orig * 1e3:.1f} ms/episode (median of {args.episodes}, {args.new_tokens} new tokens "
          f"per call); replay from the store: {rep * 1e3:.1f} ms/episode; replay is {orig / rep:.1f}x faster")


if __name__ == "__main__":
    main()
