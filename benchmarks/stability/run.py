"""Vanilla multi-agent GRPO vs Dr. MAS vs global step-level normalization, same seeds, data and models.

    python benchmarks/stability/run.py [--steps 40] [--seeds 0 1] [--out benchmarks/stability]

The setting has the paper's condition: the agents' reward distributions differ. A solver and a
verifier (separate tiny random-weight models, so each model's gradient norm is its agent's) act on
prompts: the solver drafts DRAFTS times per episode, the verifier answers once. The team reward is the
fraction of drafts whose first token falls in a target quarter of the vocabulary (learnable from
scratch, ~0.25 at the start, small spread). The verifier must answer in at most 3 tokens, which the
random model almost never does, so nearly every verifier turn pays the invalid-turn penalty c = 1: its
samples sit ~1 below the solver's, and they are outnumbered DRAFTS to 1 in a pooled group. Pooled
statistics (step_global) then give the verifier E[A^2] = (sigma_k^2 + (mu_k - mu)^2) / sigma^2 >> 1;
per-agent statistics (agent) give ~1; episode_global shares one advantage per episode. Same seeds,
tasks and initial weights for every estimator; only `estimator` changes.

Writes grad_norm.png, reward.png and results.json next to this file (or --out) and prints the table
that benchmarks/stability/README.md reports. Spike = a step whose grad norm exceeds 5x the running
median of that model's previous grad norms (from the 3rd step on).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from langchain_core.messages import HumanMessage  # noqa: E402
from langgraph.graph import END, START, StateGraph  # noqa: E402

from benchmarks._apps import QA, AppModel  # noqa: E402
from benchmarks._deps import require  # noqa: E402
from drmas_graph import SamplingParams  # noqa: E402
from drmas_graph.env import Task  # noqa: E402
from drmas_graph.testing import tiny_policy  # noqa: E402
from drmas_graph.train.loop.trainer import train_graph  # noqa: E402

ESTIMATORS = ("episode_global", "step_global", "agent")
DRAFTS = 6


def build_graph():
    """solver (DRAFTS calls) -> verifier (one call): an ordinary LangGraph app."""
    llm = AppModel()

    def solver(state):
        drafts = [llm.invoke([HumanMessage(f"{state['question']} (draft {i})")]).content for i in range(DRAFTS)]
        return {"answer": " | ".join(drafts)}

    g = StateGraph(QA)
    g.add_node("solver", solver)
    g.add_node("verifier", lambda s: {"verdict": llm.invoke([HumanMessage(f"{s['question']} -> {s['answer']}")]).content})
    g.add_edge(START, "solver")
    g.add_edge("solver", "verifier")
    g.add_edge("verifier", END)
    return g.compile()


class QuarterEnv:
    invalid_penalty = 1.0

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self._tasks = {split: [Task(id=f"{split}-{i}", input={"question": f"{split} prompt {i}: say something"})
                               for i in range(n)] for split, n in (("train", 32), ("test", 16))}

    def tasks(self, split):
        return self._tasks[split]

    def reward(self, task, episode):
        drafts = [t.response_ids[0] < self.vocab // 4 for t in episode.turns if t.agent == "solver"]
        return sum(drafts) / len(drafts)

    def is_success(self, task, episode):
        return self.reward(task, episode) >= 0.5

    def turn_is_valid(self, task, turn):
        return turn.agent != "verifier" or len(turn.response_ids) <= 3


def run(estimator: str, seed: int, steps: int, tmp: Path) -> dict:
    solver = tiny_policy(seed=seed, name="solver-model", sampling=SamplingParams(max_new_tokens=4))
    verifier = tiny_policy(seed=seed + 100, name="verifier-model", sampling=SamplingParams(max_new_tokens=4))
    env = QuarterEnv(len(solver.tokenizer))
    t0 = time.time()
    result = train_graph(build_graph(), env, policies={"solver": solver, "verifier": verifier},
                         run_dir=str(tmp / f"{estimator}-{seed}"), seed=seed, steps=steps, tasks_per_step=4,
                         group_size=8, estimator=estimator, update={"lr": 3e-4, "backend": "torch", "grad_clip": 1.0},
                         eval={"k": 4, "n_tasks": 16, "before_training": False},
                         logging={"progress": False, "tensorboard": False})
    h = result.history
    return {"estimator": estimator, "seed": seed, "wall_s": time.time() - t0,
            "grad_norm": {a: [r[f"model/{a}-model/grad_norm"] for r in h] for a in ("solver", "verifier")},
            "reward": [r["reward/team_mean"] for r in h],
            "adv_sq": {a: [r[f"agent/{a}/advantage_std"] ** 2 + r[f"agent/{a}/advantage_mean"] ** 2 for r in h]
                       for a in ("solver", "verifier")},
            "final": result.evals[-1]}


def spikes(norms: list[float], factor: float = 5.0) -> int:
    return sum(1 for i in range(2, len(norms)) if norms[i] > factor * statistics.median(norms[:i]))


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"episode_global": "tab:red", "step_global": "tab:orange", "agent": "tab:blue"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, agent in zip(axes, ("solver", "verifier")):
        for r in results:
            ax.plot(r["grad_norm"][agent], color=colors[r["estimator"]], alpha=0.8,
                    label=f"{r['estimator']} (seed {r['seed']})")
        ax.set_title(f"{agent}: grad norm before clipping")
        ax.set_xlabel("step")
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "grad_norm.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for r in results:
        ax.plot(r["reward"], color=colors[r["estimator"]], alpha=0.8, label=f"{r['estimator']} (seed {r['seed']})")
    ax.set_title("team reward (training rollouts)")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = ap.parse_args()
    require({"matplotlib": "demo"}, "the stability plots")  # checked now, not after the runs
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for estimator in ESTIMATORS:
                results.append(run(estimator, seed, args.steps, Path(tmp)))
                print(f"done {estimator} seed {seed} in {results[-1]['wall_s']:.0f}s", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print("| estimator | seed | spikes solver | spikes verifier | median grad norm solver | median grad norm verifier "
          "| mean A^2 verifier | reward first 5 -> last 5 steps | avg@4 | pass@4 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        g, rw = r["grad_norm"], r["reward"]
        print(f"| {r['estimator']} | {r['seed']} | {spikes(g['solver'])} | {spikes(g['verifier'])} "
              f"| {statistics.median(g['solver']):.3f} | {statistics.median(g['verifier']):.3f} "
              f"| {statistics.mean(r['adv_sq']['verifier']):.2f} "
              f"| {statistics.mean(rw[:5]):.2f} -> {statistics.mean(rw[-5:]):.2f} "
              f"| {r['final']['avg@k']:.3f} | {r['final']['pass@k']:.3f} |")
    sys.stdout.flush()
    plot(results, args.out)  # after the table: the numbers never wait on the plot


if __name__ == "__main__":
    main()
