"""drmas-graph ui: how fast the episode list of a 100,000-episode store and an episode page of 50 turns x 1,000
response tokens answer (the issues' bounds: 300 ms for every list page, 500 ms for the episode page, on a 2-core
CPU).

    python benchmarks/bench_ui.py [--episodes 100000] [--repeat 5]

Builds the store in a temporary folder (a few minutes for 100,000 episodes of two calls each), then times
`UiApp.handle` (the whole page: count, query, replies, template, HTML) for the list's first page, filtered and
sorted pages (an agent's own reward bounded and sorted by), deep keyset pages (the cursor of row 50,000), a reply
search, a group, the answers view and the big episode. Prints the median of --repeat runs in milliseconds, as
the Markdown table docs/guide/ui.md shows.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from langchain_core.messages import HumanMessage

from drmas_graph.traces.store import EpisodeFilter, TraceStore
from drmas_graph.types import Episode, Turn
from drmas_graph.ui._app import UiApp


def build(folder: Path, n_episodes: int) -> None:
    def turn(agent: str, index: int, text: str) -> Turn:
        return Turn(agent=agent, node=agent, step=index + 1, index=index, messages=(HumanMessage("2 + 2?"),),
                    prompt_ids=(1,) * 20, response_ids=(7,) * 8, response_logprobs=(-0.5,) * 8, response_text=text,
                    policy="p", call_key=agent)

    with TraceStore(folder / "traces.db") as store:
        for i in range(n_episodes):
            step, phase = i // 64, "eval" if i % 640 >= 576 else "train"  # the last 64 of every 640: evaluation
            episode = Episode(id=f"e{i:07d}", task_id=f"t{i % 500}", group_id=f"{phase}:{step}:{i // 8}",
                              turns=[turn("solver", 0, f"the answer is {i % 13}"), turn("checker", 1, "yes")],
                              rewards={"solver": (i % 7) / 7, "checker": (i % 3) / 2},
                              metadata={"phase": phase, "step": step, "group_index": i % 8})
            store.write_episode(episode, step=step if phase == "train" else None)
        big = [Turn(agent=f"a{k % 3}", node=f"n{k % 3}", step=k, index=k,
                    messages=(HumanMessage("x " * 400),), prompt_ids=(1,) * 400, response_ids=tuple(range(1000)),
                    response_logprobs=tuple(-k / 1000 for k in range(1000)), response_text="y" * 3000, policy="p",
                    call_key=f"n{k % 3}") for k in range(50)]
        store.write_episode(Episode(id="big", task_id="t0", turns=big, advantages=[0.1] * 50))


def deep(folder: Path, where: EpisodeFilter, sort: str, descending: bool, row: int) -> str:
    """The cursor after `row` rows of a sorted list (what following 'next' `row / 50` times reaches)."""
    with TraceStore(folder / "traces.db", readonly=True) as store:
        return store.query(where, sort=sort, descending=descending, limit=row).next


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
        by_reward = deep(folder, EpisodeFilter(phase="train"), "reward", False, 50_000)
        solver = EpisodeFilter(phase="train", agent="solver", min_reward=0.5)
        solver_deep = deep(folder, solver, "reward", True, 30_000)
        cases = [
            ("episode list, first page (training episodes)", "/runs/bench-run/episodes", {}),
            ("step + reward filter, sorted by reward", "/runs/bench-run/episodes",
             {"step": ["100"], "min_reward": ["0.5"], "sort": ["reward"], "desc": ["1"]}),
            ("agent + min_reward, sorted by its reward", "/runs/bench-run/episodes",
             {"agent": ["solver"], "min_reward": ["0.5"], "sort": ["reward"], "desc": ["1"]}),
            ("agent + min_reward, sorted by its reward, row 30,000", "/runs/bench-run/episodes",
             {"agent": ["solver"], "min_reward": ["0.5"], "sort": ["reward"], "desc": ["1"], "after": [solver_deep]}),
            ("sorted by reward, row 50,000 (page 1000)", "/runs/bench-run/episodes",
             {"sort": ["reward"], "after": [by_reward]}),
            ("task filter, sorted by turns", "/runs/bench-run/episodes", {"task": ["t7"], "sort": ["turns"]}),
            ("every phase, sorted by tokens", "/runs/bench-run/episodes", {"phase": ["all"], "sort": ["tokens"]}),
            ("reply search ('answer is 12'), agent solver", "/runs/bench-run/episodes",
             {"reply": ["answer is 12"], "agent": ["solver"]}),
            ("group page (8 episodes)", "/runs/bench-run/group",
             {"id": ["train:42:336" if args.episodes > 2688 else "train:0:0"]}),
            ("answers view (every reply counted)", "/runs/bench-run/answers", {}),
            ("episode page, 50 turns x 1,000 tokens", "/runs/bench-run/episodes/big", {}),
        ]
        print("| page | time |\n|---|---|")
        for name, path, params in cases:
            print(f"| {name} | {timed(app, path, params, args.repeat):.1f} ms |")
        app.close()


if __name__ == "__main__":
    main()
