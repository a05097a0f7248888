"""How fast the trace store writes and reads, and how big it gets.

    python benchmarks/bench_store.py [--episodes 200] [--turns 4] [--prompt 64] [--response 32] [--threads 4]

Writes synthetic episodes (every turn: a system and a user message whose text is about 4 characters per
prompt token, the token ids, float64 logprobs, a response text) to a fresh store, once from one thread and
once from several threads sharing the store, then loads every episode back. Prints turns written per
second, episodes loaded per second and bytes per 1,000 tokens (whole file, and token arrays alone).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from pathlib import Path

from langchain_core.messages import HumanMessage, SystemMessage

from drmas_graph.traces.store import TraceStore
from drmas_graph.types import Episode, SamplingParams, Turn

_WORDS = "the of and to in is that for it as with was on be by this are or from at which an have not".split()


def _text(rng: random.Random, n_chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < n_chars:
        words.append(rng.choice(_WORDS))
    return " ".join(words)


def synthetic_episode(rng: random.Random, n_turns: int, n_prompt: int, n_response: int, group: int) -> Episode:
    turns = []
    for i in range(n_turns):
        turns.append(
            Turn(
                agent=("planner", "solver", "verifier")[i % 3],
                node=("plan", "team/solve", "verify")[i % 3],
                step=i + 1,
                index=i,
                messages=(SystemMessage(_text(rng, 2 * n_prompt)), HumanMessage(_text(rng, 2 * n_prompt))),
                prompt_ids=tuple(rng.randrange(150_000) for _ in range(n_prompt)),
                response_ids=tuple(rng.randrange(150_000) for _ in range(n_response)),
                response_logprobs=tuple(-rng.expovariate(2.0) for _ in range(n_response)),
                response_text=_text(rng, 4 * n_response),
                policy="qwen",
                policy_version=1,
                latency_s=rng.random(),
                call_key=("plan", "team/solve", "verify")[i % 3],
                sampling=SamplingParams(temperature=1.0),
            )
        )
    return Episode(
        task_id=f"task-{group}",
        group_id=f"group-{group}",
        turns=turns,
        final_state={"answer": _text(rng, 40)},
        timings={"wall_s": 1.0},
    )


def _write(path: Path, episodes: list[Episode], n_threads: int) -> float:
    """Seconds to write `episodes` from `n_threads` threads sharing one store."""
    with TraceStore(path, config={"benchmark": True}) as store:
        chunks = [episodes[t::n_threads] for t in range(n_threads)]
        threads = [threading.Thread(target=lambda c=c: [store.write_episode(e) for e in c]) for c in chunks]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per turn")
    parser.add_argument("--response", type=int, default=32, help="response tokens per turn")
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()

    rng = random.Random(0)
    episodes = [
        synthetic_episode(rng, args.turns, args.prompt, args.response, group=i // 8) for i in range(args.episodes)
    ]
    n_turns = args.episodes * args.turns
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n_threads in (1, args.threads):
            seconds = _write(Path(tmp) / f"run-{n_threads}.sqlite", episodes, n_threads)
            rows.append((f"write, {n_threads} thread(s)", f"{n_turns / seconds:,.0f} turns/s"))
        with TraceStore(Path(tmp) / "run-1.sqlite", readonly=True) as store:
            ids = [s.id for s in store.episodes()]
            start = time.perf_counter()
            for episode_id in ids:
                store.load_episode(episode_id)
            seconds = time.perf_counter() - start
            stats = store.stats()
        rows.append(("load_episode", f"{len(ids) / seconds:,.0f} episodes/s ({n_turns / seconds:,.0f} turns/s)"))
        rows.append(("bytes per 1k tokens, whole store", f"{stats.bytes_per_1k_tokens:,.0f}"))
        rows.append(("bytes per 1k tokens, token arrays", f"{stats.token_bytes_per_1k_tokens:,.0f}"))
        rows.append(("store size", f"{stats.db_bytes / 2**20:.2f} MiB"))

    print(
        f"{args.episodes} episodes x {args.turns} turns x ({args.prompt} prompt + {args.response} response) tokens"
    )
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


if __name__ == "__main__":
    main()
