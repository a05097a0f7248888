"""drmas-graph ui: how fast the episode list of a 100,000-episode store and an episode page of 50 turns x 1,000
response tokens answer (the issue's bounds: 300 ms and 500 ms on a 2-core CPU).

    python benchmarks/bench_ui.py [--episodes 100000] [--repeat 5]

Builds the store in a temporary folder (about a minute for 100,000 episodes), then times `UiApp.handle` (the
whole page: query, template, HTML) for the first page, a filtered and sorted page, a deep page, a group and the
big episode. Prints the median of --repeat runs in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from langchain_core.messages import HumanMessage

from drmas_graph.traces.store import TraceStore
from drmas_graph.types import Episode, Turn
from drmas_graph.ui._app import UiApp


def build(folder: Path, n_episodes: int) -> None:
    turn = Turn(agent="solver", node="solve", step=1, index=0, messages=(HumanMessage("2 + 2?"),), prompt_ids=(1,) * 20,
                response_ids=(7,) * 8, response_logprobs=(-0.5,) * 8, response_text="4", policy="p", call_key="solve")
    with TraceStore(folder / "traces.db") as store:
        for i in range(n_episodes):
            store.write_episode(Episode(id=f"e{i:07d}", task_id=f"t{i % 500}", group_id=f"train:{i // 8}",
                                        turns=[turn], rewards={"solver": (i % 7) / 7}), step=i // 64)
        big = [Turn(agent=f"a{k % 3}", node=f"n{k % 3}", step=k, index=k,
                    messages=(HumanMessage("x " * 400),), prompt_ids=(1,) * 400, response_ids=tuple(range(1000)),
                    response_logprobs=tuple(-k / 1000 for k in range(1000)), response_text="y" * 3000, policy="p",
                    call_key=f"n{k % 3}") for k in range(50)]
        store.write_episode(Episode(id="big", task_id="t0", turns=big, advantages=[0.1] * 50))


def timed(app: UiApp, path: str, params: dict, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        response = app.handle(path, params)
        times.append(time.perf_counter() - start)
        assert response.status == 200, response.body[:300]
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "bench-run"
        start = time.perf_counter()
        build(folder, args.episodes)
        print(f"built {args.episodes} episodes in {time.perf_counter() - start:.1f}s")
        app = UiApp([folder])
        cases = [
            ("episode list, first page", "/runs/bench-run/episodes", {}),
            ("episode list, step + reward filter, sorted by reward", "/runs/bench-run/episodes",
             {"step": ["100"], "min_reward": ["0.5"], "sort": ["reward"], "desc": ["1"]}),
            ("episode list, task filter, page 5", "/runs/bench-run/episodes", {"task": ["t7"], "page": ["5"]}),
            ("episode list, sorted by reward, page 1000", "/runs/bench-run/episodes", {"sort": ["reward"], "page": ["1000"]}),
            ("group page (8 episodes)", "/runs/bench-run/group", {"id": ["train:42"]}),
            ("episode page, 50 turns x 1,000 tokens", "/runs/bench-run/episodes/big", {}),
        ]
        for name, path, params in cases:
            print(f"{name:55s} {timed(app, path, params, args.repeat):8.1f} ms")
        app.close()


if __name__ == "__main__":
    main()
