"""Synchronous vs asynchronous training, side by side in one run: `async.max_staleness` 0 (sync), 1 one step off
(async) and the free-running schedule (free: `async.schedule: free`, `max_staleness` = `--free-staleness`, 3).

Workloads:
  (a) `benchmarks/_tool_app.py`: planner -> simulated API (lognormal latency, mean 0.5 s, long tail) -> answerer,
      both agents on one tiny random Llama (`--hidden`, `--layers`); reward = the answerer's first token id is even.
  (b) the math graph (`graphs/math`, solver + verifier) with a tiny random policy (`--smollm2`: SmolLM2-135M-Instruct).
Each runs `--steps` training steps of `--tasks` groups x `--group` episodes per seed (`--seeds`), the modes
interleaved (sync seed 0, async seed 0, free seed 0, sync seed 1, ...), each in a fresh Trainer. Wall time covers
the training steps only (`Trainer.steps()`: no evaluation, no checkpoint); steps per hour = steps / wall. Reward
per step is the team reward of the step's episodes. Per asynchronous mode the table shows what staleness costs:
the stale tokens' importance weights pi_prox / pi_behav (mean after the cap, share capped: how far the policy moved
between sampling and training), and a line says whether its reward over the last half of the steps is within noise
of sync's (the difference of the means over seeds against twice its standard error). Numbers are ratios within this
run; on a loaded machine, re-run them on a quiet one. A PNG plot (`--plot`) shows the reward curves (per step and
against wall-clock time) and the throughput.

    python benchmarks/bench_async.py [--workloads a,b] [--modes sync,async,free] [--free-staleness 3]
                                     [--seeds 0,1,2] [--steps 24] [--lr 3e-3] [--max-concurrency N]
                                     [--plot runs/bench_async.png]

The result line reads `async/sync throughput: X.XXx` for workload (a), of its fastest asynchronous mode (named on
the line before); the plot (matplotlib: the `demo` extra, checked at start; `--plot ''` skips it) is drawn after.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WEAVE_DISABLED", "true")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks._deps import require  # noqa: E402

from drmas_graph import SamplingParams  # noqa: E402
from drmas_graph.cli._train import StandInChatModel  # noqa: E402
from drmas_graph.config import TrainConfig  # noqa: E402
from drmas_graph.testing import tiny_policy  # noqa: E402
from drmas_graph.train.loop.trainer import Trainer  # noqa: E402

MODES = {"sync": {"max_staleness": 0}, "async": {"max_staleness": 1},
         "free": {"max_staleness": 2, "schedule": "free"}}
"""Mode -> the `async` settings: synchronous, one step off, free-running (`--free-staleness`)."""


def _policy(args, seed: int, tokens: int):
    if args.smollm2:
        from drmas_graph.engine.models import smollm2_path
        from drmas_graph.engine.transformers_policy import TransformersPolicy

        return TransformersPolicy.from_pretrained(smollm2_path(), name="smollm2", seed=seed, device=args.device,
                                                  sampling=SamplingParams(max_new_tokens=tokens))
    return tiny_policy(seed=seed, hidden_size=args.hidden, num_layers=args.layers,
                       sampling=SamplingParams(max_new_tokens=tokens))


def _workload(name: str, args, seed: int):
    """(graph, env, agents, policy) of workload `name` for one seed."""
    if name == "a":
        from benchmarks._tool_app import ToolEnv, build_graph

        policy = tiny_policy(seed=seed, hidden_size=args.hidden, num_layers=args.layers,
                             sampling=SamplingParams(max_new_tokens=args.tokens))
        return build_graph(StandInChatModel(), seed=seed, mean_s=args.api_mean), ToolEnv(), ("planner", "answerer"), policy
    from graphs.math.env import MathEnv
    from graphs.math.graph import build_graph

    policy = _policy(args, seed, 12)
    env = MathEnv(seed=0, n_train=80, n_test=20, difficulty=[1.0])
    return build_graph(StandInChatModel(), max_rounds=2), env, ("solver", "verifier"), policy


def _concurrency(args) -> int:
    """`max_concurrency`, the same in every mode: `--max-concurrency`, by default room for the k+1 steps the free
    schedule rolls out at once (a synchronous step never runs more than its own tasks x group episodes)."""
    return args.max_concurrency or args.tasks * args.group * (args.free_staleness + 1)


def _async(mode: str, args) -> dict:
    return {**MODES[mode], "max_staleness": args.free_staleness} if mode == "free" else MODES[mode]


def run_one(name: str, mode: str, seed: int, args, root: str) -> dict:
    graph, env, agents, policy = _workload(name, args, seed)
    cfg = TrainConfig.model_validate({
        "run_dir": os.path.join(root, f"{name}-{mode}-s{seed}"), "seed": seed, "steps": args.steps,
        "tasks_per_step": args.tasks, "group_size": args.group, "max_concurrency": _concurrency(args),
        "update": {"lr": args.lr, "backend": "torch"}, "eval": {"k": 1, "n_tasks": 1, "before_training": False},
        "logging": {"progress": False, "tensorboard": False}, "async": _async(mode, args)})
    trainer = Trainer(graph, env, cfg, policies={a: policy for a in agents})
    try:
        t0, records, ends = time.perf_counter(), [], []
        for _, record in trainer.steps():
            records.append(record)
            ends.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t0
    finally:
        trainer.close()
        policy.close()
    return {"wall_s": wall, "steps_per_h": len(records) / wall * 3600, "ends_s": ends,
            "reward": [r["reward/team_mean"] for r in records],
            "rollout_s": statistics.mean(r["time/rollout_s"] for r in records),
            "update_s": statistics.mean(r["time/update_s"] for r in records),
            "wait_s": statistics.mean(r.get("async/wait_s", 0.0) for r in records[1:]) if len(records) > 1 else 0.0,
            **_importance(records)}


def _importance(records: list[dict]) -> dict:
    """How far the policy moved between sampling and training: the stale tokens' importance weights pi_prox /
    pi_behav (after the cap), mean over the steps and agents that had stale samples, and the share capped."""
    means = [v for r in records for k, v in r.items() if k.startswith("agent/") and k.endswith("/is_weight_mean")]
    capped = [v for r in records for k, v in r.items() if k.startswith("agent/") and k.endswith("/is_capped_frac")]
    return {"is_weight": statistics.mean(means) if means else float("nan"),
            "is_capped": statistics.mean(capped) if capped else float("nan")}


def _mean_sd(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} +- {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"


def report(name: str, runs: dict[str, list[dict]], args) -> float:
    """Print workload `name`'s table; return async/sync steps per hour (means over seeds)."""
    title = {"a": f"(a) tool graph, simulated API latency mean {args.api_mean:g} s (lognormal, sigma 1)",
             "b": "(b) math graph, " + ("SmolLM2-135M" if args.smollm2 else "tiny random policy")}[name]
    print(f"\n{title}: {args.steps} steps x {args.tasks} groups x {args.group} episodes, seeds {args.seeds}")
    print(f"{'mode':<6} {'steps/h':>9} {'wall s':>8} {'rollout s/step':>15} {'update s/step':>14} "
          f"{'trainer waits s/step':>21} {'IS weight':>10} {'capped':>7} {'reward, last half':>18}")
    half = args.steps // 2
    last_half = {mode: [statistics.mean(r["reward"][half:]) for r in rs] for mode, rs in runs.items()}
    for mode, rs in runs.items():
        print(f"{mode:<6} {statistics.mean(r['steps_per_h'] for r in rs):>9.0f} "
              f"{statistics.mean(r['wall_s'] for r in rs):>8.1f} {statistics.mean(r['rollout_s'] for r in rs):>15.2f} "
              f"{statistics.mean(r['update_s'] for r in rs):>14.2f} "
              f"{statistics.mean(r['wait_s'] for r in rs) if mode != 'sync' else float('nan'):>21.2f} "
              f"{statistics.mean(r['is_weight'] for r in rs):>10.2f} "
              f"{statistics.mean(r['is_capped'] for r in rs):>7.1%} {_mean_sd(last_half[mode]):>18}")
    print("reward per step (mean over seeds):")
    for mode, rs in runs.items():
        curve = [statistics.mean(r["reward"][s] for r in rs) for s in range(args.steps)]
        print(f"  {mode:<6} " + " ".join(f"{x:.3f}" for x in curve))
    sync = statistics.mean(r["steps_per_h"] for r in runs["sync"])
    ratios = {mode: statistics.mean(r["steps_per_h"] for r in rs) / sync for mode, rs in runs.items() if mode != "sync"}
    for mode, ratio in ratios.items():
        print(f"workload ({name}) {_label(mode, args)} reward, last half: {_noise(last_half[mode], last_half['sync'])}")
        print(f"workload ({name}) {_label(mode, args)}/sync throughput: {ratio:.2f}x")
    return ratios


def _noise(values: list[float], sync: list[float]) -> str:
    """The difference of two modes' means over seeds against twice its standard error (Welch): within noise when
    smaller."""
    diff = statistics.mean(values) - statistics.mean(sync)
    if len(values) < 2 or len(sync) < 2:
        return f"{diff:+.3f} against sync (one seed: no noise estimate)"
    se2 = 2 * (statistics.variance(values) / len(values) + statistics.variance(sync) / len(sync)) ** 0.5
    return f"{diff:+.3f} against sync, 2 standard errors {se2:.3f}: {'within' if abs(diff) <= se2 else 'NOT within'} noise"


def _label(mode: str, args) -> str:
    return {"async": "one-step-off", "free": f"free (max_staleness {args.free_staleness})"}.get(mode, mode)


def plot(path: str, results: dict[str, dict[str, list[dict]]], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 3, figsize=(16, 3.6 * len(results)), squeeze=False)
    for row, (name, runs) in zip(axes, results.items()):
        for i, (mode, rs) in enumerate(runs.items()):
            steps = range(args.steps)
            mean = [statistics.mean(r["reward"][s] for r in rs) for s in steps]
            lo = [min(r["reward"][s] for r in rs) for s in steps]
            hi = [max(r["reward"][s] for r in rs) for s in steps]
            row[0].plot(steps, mean, marker="o", label=_label(mode, args), color=f"C{i}")
            row[0].fill_between(steps, lo, hi, alpha=0.2, color=f"C{i}")
            # what a user pays for: the reward the rollouts reached by each moment of the run (mean over seeds)
            row[1].plot([statistics.mean(r["ends_s"][s] for r in rs) for s in steps], mean, marker="o",
                        label=_label(mode, args), color=f"C{i}")
        row[0].set(title=f"({name}): team reward per step (mean, min-max over seeds)", xlabel="step", ylabel="reward")
        row[1].set(title=f"({name}): team reward against wall-clock time", xlabel="seconds since the first step",
                   ylabel="reward")
        row[0].legend()
        modes = list(runs)
        row[2].bar([_label(m, args) for m in modes],
                   [statistics.mean(r["steps_per_h"] for r in runs[m]) for m in modes],
                   color=[f"C{i}" for i in range(len(modes))])
        row[2].set(title=f"({name}): training steps per hour", ylabel="steps / hour")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="a,b", help="a, b or a,b")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--tasks", type=int, default=4, help="groups per step")
    ap.add_argument("--group", type=int, default=8, help="episodes per group")
    ap.add_argument("--lr", type=float, default=3e-3, help="learning rate (3e-3: (a)'s synchronous reward rises from "
                    "0.5 to 0.8-0.9 in 24 steps; at 1e-2 one update moves the tiny policy so far that staleness costs "
                    "learning: see the IS weight column)")
    ap.add_argument("--hidden", type=int, default=256, help="tiny model width (a, and b without --smollm2)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24, help="max new tokens per call in (a)")
    ap.add_argument("--modes", default="sync,async,free", help="sync (max_staleness 0), async (one step off), "
                    "free (schedule free, max_staleness --free-staleness); sync is always run")
    ap.add_argument("--free-staleness", type=int, default=3, help="max_staleness of the free-running mode")
    ap.add_argument("--max-concurrency", type=int, default=0, help="episodes in flight at once, every mode (default: "
                    "tasks x group x (free-staleness + 1), room for the free schedule's steps)")
    ap.add_argument("--api-mean", type=float, default=0.5, help="mean simulated API latency in (a), seconds")
    ap.add_argument("--smollm2", action="store_true", help="(b) on SmolLM2-135M-Instruct instead of a tiny model")
    ap.add_argument("--device", default="cpu", help="device of (b)'s SmolLM2 policy (cuda on a GPU machine)")
    ap.add_argument("--plot", default="runs/bench_async.png")
    args = ap.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.modes = args.modes.split(",")
    if args.plot:  # checked now, not after the runs
        require({"matplotlib": "demo"}, "the plot (--plot)", skip="--plot ''")
    logging.disable(logging.WARNING)
    results: dict[str, dict[str, list[dict]]] = {}
    ratios = {}
    with tempfile.TemporaryDirectory() as root:
        for name in sorted(args.workloads.split(","), reverse=True):  # (b) first: (a)'s ratio is the last line
            # untimed: the first training run of a process pays one-time costs (imports, kernel selection)
            run_one(name, "sync", 0, argparse.Namespace(**{**vars(args), "steps": 1}), root + "/warmup")
            runs: dict[str, list[dict]] = {mode: [] for mode in MODES if mode == "sync" or mode in args.modes}
            for seed in args.seeds:
                for mode, rs in runs.items():
                    rs.append(run_one(name, mode, seed, args, root))
            results[name] = runs
            ratios[name] = report(name, runs, args)
    if "a" in ratios:  # the best asynchronous schedule of the run
        best = max(ratios["a"], key=ratios["a"].get)
        print(f"workload (a), best asynchronous schedule: {_label(best, args)}")
        print(f"async/sync throughput: {ratios['a'][best]:.2f}x", flush=True)
    if args.plot:  # after the result lines: the numbers never wait on the plot
        plot(args.plot, dict(sorted(results.items())), args)


if __name__ == "__main__":
    main()
