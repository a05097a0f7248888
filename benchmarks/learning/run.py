"""Learning study: agent-wise GRPO (Dr. MAS, `agent`) vs vanilla multi-agent GRPO (`episode_global`) trained
with the real trainer on SmolLM2-135M-Instruct, on two apps whose agents differ (see README.md, the
pre-registration).

    python benchmarks/learning/run.py                  # the full, pre-registered study (results.json, plots)
    python benchmarks/learning/run.py --quick          # 2 seeds, few steps, both apps (<= 10 min on 2 cores)
    python benchmarks/learning/run.py --tiny --out DIR # tiny random models (seconds): the test's wiring check
    python benchmarks/learning/run.py --tune           # base-model evaluation of the frozen task settings
    python benchmarks/learning/run.py --v2 [--quick | --tiny | --resume | --report]   # study v2 (PREREG_v2.md)

Apps (ordinary LangGraph apps in graphs/, none imports drmas_graph):
- ``verified_math``: `graphs.verified_math` (solver + verifier; the verifier is paid for its verdicts, a rejected
  answer goes back to the solver). App rates: verifier TPR (approves right answers), TNR (rejects wrong ones).
- ``lookup``: `graphs.lookup` (caller must call a lookup tool on a per-task random table; answerer writes
  the answer; team reward). App rate: tool-call rate (share of caller turns that called the tool) and
  episodes with a tool call.

Each agent has its own copy of the model (non-sharing), so each model's gradient norm is its agent's. Every
run of one app uses the same settings; only `estimator` and `seed` change. Per step and agent it records
reward, gradient norm before clipping, E[A^2], advantage mean, clip fraction, KL to the start weights (k3,
`update.kl_coef` > 0 makes the trainer compute it) and the app's rates; held-out avg@k / pass@k at the start,
middle and end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WEAVE_DISABLED", "true")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # study_stats and v2, also when run by runpy.run_path

from langchain_core.language_models.fake_chat_models import FakeListChatModel  # noqa: E402

from benchmarks._deps import require  # noqa: E402
from drmas_graph.config import TrainConfig  # noqa: E402
from graphs.lookup.env import LookupEnv  # noqa: E402
from graphs.lookup.graph import build_graph as build_lookup  # noqa: E402
from graphs.verified_math.env import VerifiedMathEnv  # noqa: E402
from graphs.verified_math.graph import build_graph as build_math  # noqa: E402
from study_stats import band, fmt_ci, in_own_process, t_interval, verdict  # noqa: E402

HERE = Path(__file__).resolve().parent
ESTIMATORS = ("episode_global", "agent")
"""The compared estimators; `--estimators` may add step_global."""

# -- the frozen, pre-registered settings (README.md "Pre-registration") -------------------------------------
APPS: dict[str, dict[str, Any]] = {
    "verified_math": {
        "build": build_math, "graph_kwargs": {"max_rounds": 2},
        "env": VerifiedMathEnv, "env_kwargs": {"n_train": 96, "n_test": 24, "difficulty": (0.7, 0.3)},
        "agents": {"solver": 12, "verifier": 6},  # agent -> max_new_tokens
    },
    "lookup": {
        "build": build_lookup, "graph_kwargs": {"max_calls": 2},
        "env": LookupEnv, "env_kwargs": {"n_train": 96, "n_test": 24, "n_rows": 5, "difficulty": (0.4, 0.4, 0.2)},
        "agents": {"caller": 8, "answerer": 12},
    },
}
FULL = {"seeds": [0, 1, 2, 3, 4], "steps": 16, "tasks_per_step": 4, "group_size": 8, "eval_k": 4, "eval_tasks": 24}
QUICK = {"seeds": [0, 1], "steps": 2, "tasks_per_step": 2, "group_size": 4, "eval_k": 4, "eval_tasks": 4}
TINY = {"seeds": [0, 1], "steps": 2, "tasks_per_step": 2, "group_size": 4, "eval_k": 4, "eval_tasks": 2}
ROLLOUT = {"temperature": 0.6, "top_p": 0.95}
"""Rollout sampling. Amendment 1 (before any comparison run; README.md): the pre-registration said temperature
1.0; the `--quick` smoke run showed the untrained solver's replies 100% invalid at 1.0 (the difficulty was tuned
at 0.6 / 0.95, the evaluation's sampling), so rollouts now sample as the tuning and the evaluation do."""
UPDATE = {"lr": 1.0e-5, "grad_clip": 1.0, "n_minibatches": 2, "kl_coef": 0.001, "backend": "torch"}
"""Optimizer and loss, the same for every estimator. n_minibatches 2 makes the PPO ratio (and the clip
fraction) non-trivial; kl_coef 0.001 (the reference code's value when its KL loss is on) makes the trainer
compute the KL to the start weights."""
SPIKE_FACTOR = 3.0
"""A gradient-norm spike: a step whose norm exceeds this times the run's median (per agent)."""
NO_SIGNAL = 0.05
"""Post hoc (not pre-registered): a gradient norm below this is a step without signal (all advantages ~0)."""


class RecordingEnv:
    """The app's env, recording app-specific rates per (phase, step) as the trainer scores episodes."""

    def __init__(self, app: str, env: Any) -> None:
        self.app, self.env = app, env
        self.counts: dict[tuple[str, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._seen: set[str] = set()

    def __getattr__(self, name: str) -> Any:  # tasks, turn_is_valid, invalid_penalty, is_success, agents
        return getattr(self.env, name)

    def reward(self, task: Any, episode: Any) -> Any:
        if episode.id not in self._seen:  # an episode scored twice is counted once
            self._seen.add(episode.id)
            c = self.counts[(episode.metadata.get("phase", "?"), int(episode.metadata.get("step", -1)))]
            if self.app == "verified_math":
                for key, n in self.env.verdict_counts(task, episode.final_state).items():
                    c[key] += n
            else:
                calls, turns = self.env.tool_calls(episode.final_state)
                c["tool_calls"] += calls
                c["caller_turns"] += turns
                c["episodes_with_call"] += calls > 0
                c["episodes"] += 1
        return self.env.reward(task, episode)

    def rates(self, phase: str, step: int) -> dict[str, float]:
        c = self.counts.get((phase, step), {})
        ratio = lambda a, b: c.get(a, 0) / c[b] if c.get(b) else math.nan  # noqa: E731
        if self.app == "verified_math":
            return {"verifier_tpr": (c.get("tp", 0) / (c.get("tp", 0) + c.get("fn", 0))
                                     if c.get("tp", 0) + c.get("fn", 0) else math.nan),
                    "verifier_tnr": (c.get("tn", 0) / (c.get("tn", 0) + c.get("fp", 0))
                                     if c.get("tn", 0) + c.get("fp", 0) else math.nan)}
        return {"tool_call_rate": ratio("tool_calls", "caller_turns"),
                "episodes_with_tool_call": ratio("episodes_with_call", "episodes")}


def make_config(app: str, estimator: str, seed: int, plan: dict[str, Any], run_dir: Path, tiny: bool) -> TrainConfig:
    spec = APPS[app]
    models = {f"{a}_model": ({"tiny": {"seed": seed, "vocab_size": 512}} if tiny else {"path": "smollm2", "max_batch_size": 32})
              for a in spec["agents"]}
    agents = {a: {"model": f"{a}_model", "sampling": {**ROLLOUT, "max_new_tokens": n},
                  "loss": {"micro_batch_size": 8}} for a, n in spec["agents"].items()}
    return TrainConfig.model_validate({
        "name": f"{app}-{estimator}-s{seed}", "run_dir": str(run_dir), "seed": seed,
        "models": models, "agents": agents, "update": UPDATE, "estimator": estimator,
        "steps": plan["steps"], "tasks_per_step": plan["tasks_per_step"], "group_size": plan["group_size"],
        "max_concurrency": 32, "checkpoint_every": 0,
        "eval": {"k": plan["eval_k"], "n_tasks": plan["eval_tasks"], "every": max(plan["steps"] // 2, 1),
                 "before_training": True},
        "logging": {"progress": False, "tensorboard": False}})


def make_app(app: str, seed: int) -> tuple[Any, RecordingEnv]:
    """The app's graph (its own model is a stand-in: training serves every call) and recording env. The
    tasks do not depend on the run's seed: every run of an app sees the same train and test tasks."""
    spec = APPS[app]
    graph = spec["build"](FakeListChatModel(responses=["(stand-in)"]), **spec["graph_kwargs"])
    return graph, RecordingEnv(app, spec["env"](seed=0, **spec["env_kwargs"]))


def run_one(app: str, estimator: str, seed: int, plan: dict[str, Any], root: Path, tiny: bool) -> dict[str, Any]:
    from drmas_graph.train.loop.trainer import train_graph

    graph, env = make_app(app, seed)
    cfg = make_config(app, estimator, seed, plan, root / f"{app}-{estimator}-s{seed}", tiny)
    t0 = time.perf_counter()
    result = train_graph(graph, env, cfg)
    wall = time.perf_counter() - t0
    steps = []
    for rec in result.history:
        agents = {}
        for a in APPS[app]["agents"]:
            mean, std = rec.get(f"agent/{a}/advantage_mean", math.nan), rec.get(f"agent/{a}/advantage_std", math.nan)
            agents[a] = {"reward": rec.get(f"agent/{a}/reward_mean", math.nan),
                         "grad_norm": rec.get(f"model/{a}_model/grad_norm", math.nan),
                         "grad_norm_max": rec.get(f"model/{a}_model/grad_norm_max", math.nan),
                         "adv_sq": mean**2 + std**2, "adv_mean": mean,
                         "clip_frac": rec.get(f"agent/{a}/clip_frac", math.nan),
                         "kl_start": rec.get(f"agent/{a}/kl_ref", math.nan),
                         "calls": rec.get(f"agent/{a}/calls", 0), "invalid_rate": rec.get(f"agent/{a}/invalid_rate", math.nan)}
        steps.append({"step": rec["step"], "team_reward": rec["reward/team_mean"], "agents": agents,
                      "rates": env.rates("train", rec["step"]), "time_s": rec["time/step_s"],
                      "rollout_s": rec["time/rollout_s"], "update_s": rec["time/update_s"]})
    evals = [{"step": e["step"], "k": e["k"], "tasks": e["tasks"], "avg@k": e["avg@k"], "pass@k": e["pass@k"],
              "agents": {a: e.get(f"{a}/reward", math.nan) for a in APPS[app]["agents"]},
              "rates": env.rates("eval", e["step"])} for e in result.evals]
    return {"app": app, "estimator": estimator, "seed": seed, "wall_s": wall, "steps": steps, "eval": evals}


# -- statistics -------------------------------------------------------------------------------------------
def spikes(run: dict[str, Any], agent: str, signal_only: bool = False) -> int:
    """Steps whose gradient norm exceeds SPIKE_FACTOR x the run's median (the pre-registered count). With
    `signal_only` (post hoc, not pre-registered) the median and the count use only the steps that had a
    gradient (norm >= NO_SIGNAL): a step whose groups all got equal rewards has zero advantages and a zero
    norm, and enough of them pull the median near 0 so that ordinary steps count as spikes."""
    norms = [s["agents"][agent]["grad_norm"] for s in run["steps"] if not math.isnan(s["agents"][agent]["grad_norm"])]
    if signal_only:
        norms = [n for n in norms if n >= NO_SIGNAL]
    med = statistics.median(norms) if norms else math.nan
    return sum(n > SPIKE_FACTOR * med for n in norms)


def no_signal_steps(run: dict[str, Any], agent: str) -> int:
    """Steps where the agent's gradient norm was below NO_SIGNAL (every group's rewards equal: nothing learnt)."""
    return sum(s["agents"][agent]["grad_norm"] < NO_SIGNAL for s in run["steps"])


def run_metrics(run: dict[str, Any]) -> dict[str, float]:
    """The table's per-run numbers: final held-out avg@k / pass@k and app rates, final training reward (mean of
    the last quarter of the steps, per agent), gradient-norm spikes (summed over agents), max per-agent E[A^2]."""
    last = run["eval"][-1]
    out = {"avg@k": last["avg@k"], "pass@k": last["pass@k"], **{f"eval {k}": v for k, v in last["rates"].items()}}
    tail = run["steps"][-max(len(run["steps"]) // 4, 1):]
    out["final reward"] = statistics.fmean(s["team_reward"] for s in tail)
    for a in APPS[run["app"]]["agents"]:
        out[f"final reward {a}"] = statistics.fmean(s["agents"][a]["reward"] for s in tail)
    out["spikes"] = sum(spikes(run, a) for a in APPS[run["app"]]["agents"])
    out["max E[A^2]"] = max(s["agents"][a]["adv_sq"] for s in run["steps"] for a in APPS[run["app"]]["agents"])
    # post hoc (added after the results, not pre-registered; see README): what the spike count depends on
    agents = APPS[run["app"]]["agents"]
    out["post hoc: spikes w/ signal"] = sum(spikes(run, a, signal_only=True) for a in agents)
    out["post hoc: no-signal steps"] = sum(no_signal_steps(run, a) for a in agents)
    out["post hoc: max grad norm"] = max(s["agents"][a]["grad_norm"] for s in run["steps"] for a in agents)
    return out


def table(runs: list[dict[str, Any]], estimators: list[str]) -> str:
    """Per app: mean [95% t interval] over seeds per estimator, and the paired difference to episode_global."""
    lines = []
    for app in APPS:
        mine = [r for r in runs if r["app"] == app]
        if not mine:
            continue
        by = {(r["estimator"], r["seed"]): run_metrics(r) for r in mine}
        names = list(next(iter(by.values())))
        seeds = sorted({s for _, s in by})
        cols = [e for e in estimators if any(k[0] == e for k in by)]
        pairs = [e for e in cols if e != "episode_global" and "episode_global" in cols]
        k = mine[0]["eval"][-1]["k"]
        lines.append(f"\n{app} ({len(seeds)} seeds; mean [95% t interval]; diff = paired by seed, minus episode_global)")
        header = f"| {'metric':<26} | " + " | ".join(f"{e:<24}" for e in cols) + "".join(f" | {'diff ' + e:<24}" for e in pairs) + " |"
        lines += [header, "|" + "|".join("-" * (len(c) + 0) for c in header.split("|")[1:-1]) + "|"]
        for name in names:
            cells = []
            for e in cols:
                cells.append(fmt_ci(t_interval([by[(e, s)][name] for s in seeds if (e, s) in by])))
            for e in pairs:
                diffs = [by[(e, s)][name] - by[("episode_global", s)][name] for s in seeds
                         if (e, s) in by and ("episode_global", s) in by]
                cells.append(fmt_ci(t_interval(diffs)))
            lines.append(f"| {name.replace('@k', f'@{k}'):<26} | " + " | ".join(f"{c:<24}" for c in cells) + " |")
    return "\n".join(lines)


def verdict_lines(runs: list[dict[str, Any]]) -> list[str]:
    out = []
    for app in APPS:
        final = {e: [run_metrics(r)["final reward"] for r in runs if r["app"] == app and r["estimator"] == e]
                 for e in ("agent", "episode_global")}
        if final["agent"] and final["episode_global"]:
            n = min(len(final["agent"]), len(final["episode_global"]))
            out.append(f"learning study: {app}: agent vs episode_global final reward "
                       f"{statistics.fmean(final['agent']):.3f} vs {statistics.fmean(final['episode_global']):.3f} ({n} seeds)")
    return out


HYPOTHESES = [  # (name, app, metric of run_metrics, direction in which it supports the hypothesis)
    ("H1 verifier catches errors (final held-out TNR)", "verified_math", "eval verifier_tnr", +1),
    ("H2 math (final held-out avg@k)", "verified_math", "avg@k", +1),
    ("H3 lookup (final held-out avg@k)", "lookup", "avg@k", +1),
    ("H4 tool use (final held-out tool-call rate)", "lookup", "eval tool_call_rate", +1),
    ("H5 stability: max per-agent E[A^2]", "verified_math", "max E[A^2]", -1),
    ("H5 stability: max per-agent E[A^2]", "lookup", "max E[A^2]", -1),
    ("H5 stability: grad-norm spikes (not higher)", "verified_math", "spikes", -1),
    ("H5 stability: grad-norm spikes (not higher)", "lookup", "spikes", -1),
]
"""The pre-registered hypotheses as (metric, direction): d = agent - episode_global, paired by seed."""


def hypothesis_lines(runs: list[dict[str, Any]]) -> list[str]:
    """Each hypothesis's verdict by the pre-registered rule: supported when the 95% t interval of the paired
    difference excludes 0 in the stated direction, contradicted when it excludes 0 the other way, else not
    resolved. (H5's spikes clause says "not higher": an interval below 0 or containing 0 does not contradict it.)"""
    out = []
    for name, app, metric, sign in HYPOTHESES:
        by = {(r["estimator"], r["seed"]): run_metrics(r)[metric] for r in runs if r["app"] == app}
        d = [by[("agent", s)] - by[("episode_global", s)] for e, s in by if e == "agent" and ("episode_global", s) in by]
        m, lo, hi = t_interval(d)
        out.append(f"hypothesis: {name} [{app}]: d = {fmt_ci((m, lo, hi))} over {len(d)} pairs: {verdict(lo, hi, sign)}")
    return out


def runs_markdown(runs: list[dict[str, Any]]) -> str:
    """Every run as one markdown row: held-out avg@k at each evaluation, the final training reward, the app's
    final held-out rate, spikes, max E[A^2] and wall time (the README's per-run table)."""
    lines = ["| app | estimator | seed | avg@k at steps | final reward | final held-out rate | spikes | "
             "max E[A^2] | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        m = run_metrics(r)
        rate = {k: v for k, v in r["eval"][-1]["rates"].items() if k in ("verifier_tnr", "tool_call_rate")}
        avgs = " / ".join(f"{e['avg@k']:.3f}" for e in r["eval"])
        lines.append(f"| {r['app']} | {r['estimator']} | {r['seed']} | {avgs} | {m['final reward']:.3f} | "
                     + ", ".join(f"{k} {v:.3f}" for k, v in rate.items())
                     + f" | {m['spikes']} | {m['max E[A^2]']:.3f} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


# -- plots ------------------------------------------------------------------------------------------------
def plots(runs: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    # (what, per-agent getter, title, feasible range the band is cut to: a t interval does not know that a
    # rate lies in [0, 1]; a reward with the invalid-turn penalty can be below 0)
    panels = [(lambda s, a: s["agents"][a]["reward"], "reward per agent", (None, 1.0)),
              (lambda s, a: s["agents"][a]["grad_norm"], "grad norm (before clipping)", (0.0, None))]
    for app in APPS:
        mine = [r for r in runs if r["app"] == app]
        if not mine:
            continue
        agents = list(APPS[app]["agents"])
        rates = list(mine[0]["steps"][0]["rates"])
        fig, axes = plt.subplots(3, 2, figsize=(11, 10))
        for row, (get, title, bounds) in enumerate(panels):
            for col, a in enumerate(agents):
                band(axes[row][col], mine, lambda s, a=a, get=get: get(s, a), f"{app}: {title}: {a}", bounds)
        for col, rate in enumerate(rates[:2]):
            band(axes[2][col], mine, lambda s, r=rate: s["rates"][r], f"{app}: {rate} (training rollouts)",
                  (0.0, 1.0))
        fig.suptitle(f"{app}: mean over seeds per step; band = 95% t interval of the mean (cut to the "
                     "feasible range)", fontsize=10)
        fig.tight_layout(rect=(0, 0, 1, 0.97))
        path = out / f"{app}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


# -- difficulty tuning ------------------------------------------------------------------------------------
def tune(apps: list[str], k: int, n_tasks: int) -> None:
    """avg@k / pass@k and app rates of the untrained model on each app's test split (the frozen settings)."""
    from drmas_graph.train.loop.trainer import Trainer, evaluate

    for app in apps:
        graph, env = make_app(app, 0)
        plan = dict(FULL, eval_k=k, eval_tasks=n_tasks)
        with tempfile.TemporaryDirectory() as d:
            cfg = make_config(app, "agent", 0, plan, Path(d), tiny=False)
            trainer = Trainer(graph, env, cfg, train=False)
            try:
                t0 = time.perf_counter()
                rec = evaluate(trainer, step=0)
            finally:
                trainer.close()
        print(f"tune {app} {APPS[app]['env_kwargs']}: avg@{k} {rec['avg@k']:.3f} pass@{k} {rec['pass@k']:.3f} "
              f"rates {env.rates('eval', 0)} "
              + " ".join(f"{a} reward {rec.get(a + '/reward', math.nan):.3f} invalid {rec.get(a + '/invalid_rate', math.nan):.2f}"
                         for a in APPS[app]["agents"])
              + f" ({rec['tasks']} tasks, {time.perf_counter() - t0:.0f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--v2" in argv:  # study v2 (PREREG_v2.md): its own app, arms, plan and results_v2.json
        sys.path.insert(0, str(HERE))
        import v2

        return v2.main([a for a in argv if a != "--v2"])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="2 seeds, 2 steps, both apps (<= 10 min on 2 cores)")
    mode.add_argument("--tiny", action="store_true", help="tiny random-weight models (seconds; the test)")
    mode.add_argument("--tune", action="store_true", help="evaluate the untrained model on the frozen task settings")
    p.add_argument("--apps", nargs="+", choices=list(APPS), default=list(APPS))
    p.add_argument("--estimators", nargs="+", default=list(ESTIMATORS))
    p.add_argument("--seeds", nargs="+", type=int, help="override the plan's seeds")
    p.add_argument("--steps", type=int, help="override the plan's steps (not for the pre-registered study)")
    p.add_argument("--out", type=Path, help="folder for results.json and the plots (default: this folder for the "
                                            "full study, a temporary folder otherwise)")
    p.add_argument("--report", action="store_true", help="only print the table, verdicts and plots of OUT/results.json "
                                                          "(with --resume: a study still running or stopped)")
    p.add_argument("--resume", action="store_true", help="keep the finished runs in OUT/results.json (same "
                                                          "settings) and run only the missing ones")
    args = p.parse_args(argv)
    require({"matplotlib": "demo"}, "the study's plots")  # checked now, not after hours of runs
    if args.tune:
        tune(args.apps, k=4, n_tasks=APPS[args.apps[0]]["env_kwargs"]["n_test"])
        return 0
    plan = dict(TINY if args.tiny else QUICK if args.quick else FULL)
    if args.seeds:
        plan["seeds"] = args.seeds
    if args.steps:
        plan["steps"] = args.steps
    out = args.out or (HERE if not (args.quick or args.tiny) else Path(tempfile.mkdtemp(prefix="learning-")))
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.json"
    runs: list[dict[str, Any]] = []
    if args.report and not results.exists():
        p.error(f"--report: no {results}")
    if (args.resume or args.report) and results.exists():
        saved = json.loads(results.read_text())
        if (saved.get("plan"), saved.get("update"), saved.get("rollout")) != (plan, UPDATE, ROLLOUT):
            p.error(f"--resume/--report: {results} was written with other settings (plan, update or rollout); "
                    "use another --out or remove it")
        runs = saved["runs"]
    done = {(r["app"], r["estimator"], r["seed"]) for r in runs}
    root = out / "runs"  # the runs' own folders (trace stores, metrics.jsonl), kept for the UI
    # seed outermost, then app, then estimator: a stopped study has whole pairs of both apps
    todo = [(app, est, seed) for seed in plan["seeds"] for app in args.apps for est in args.estimators
            if (app, est, seed) not in done and not args.report]
    for app, est, seed in todo:
        shutil.rmtree(root / f"{app}-{est}-s{seed}", ignore_errors=True)  # a run cut off before: start it again
        run = in_own_process(run_one, app, est, seed, plan, root, tiny=args.tiny)
        shutil.rmtree(root / f"{app}-{est}-s{seed}" / "checkpoints", ignore_errors=True)  # ~3 GB a run; not kept
        runs.append(run)
        print(f"{app} {est} seed {seed}: {len(run['steps'])} steps in {run['wall_s']:.0f} s, final "
              f"avg@{run['eval'][-1]['k']} {run['eval'][-1]['avg@k']:.3f}", flush=True)
        tmp = results.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(
            {"plan": plan, "update": UPDATE, "rollout": ROLLOUT,
             "apps": {a: {k: v for k, v in s.items() if k not in ("build", "env")} for a, s in APPS.items()},
             "runs": runs}, indent=1, default=str))
        tmp.replace(results)  # a crash while writing keeps the previous file
    if len(done) and not todo and not args.report:
        print(f"--resume: all {len(done)} runs are in {results}; nothing to run")
    print(table(runs, args.estimators))
    if args.report:
        print("\n" + runs_markdown(runs))
    print(f"results: {out / 'results.json'}")
    for line in verdict_lines(runs) + hypothesis_lines(runs):
        print(line)
    sys.stdout.flush()
    for path in plots(runs, out):  # after the results: the numbers never wait on the plots
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
