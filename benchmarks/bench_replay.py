"""Replay speed against the original run.

    python benchmarks/bench_replay.py [--episodes 8] [--new-tokens 32]

Records episodes of a two-node graph (solver -> verifier) with the tiny model into a trace store, then
replays each one from the store (no model: every LLM call answered from the recording) and prints the
time of the original runs, of the replays, and their ratio. Every replay must reproduce its final state.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._apps import solver_verifier  # noqa: E402
from drmas_graph import SamplingParams, TraceStore, instrument, replay  # noqa: E402
from drmas_graph.testing import tiny_policy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    graph = solver_verifier()
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
