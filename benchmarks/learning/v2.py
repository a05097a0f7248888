"""Learning study v2 (PREREG_v2.md): agent-wise normalization (`agent`, Dr. MAS) against the global step-level
ablation (`step_global`: the same per-call rewards, one pool per group) on `graphs/checked_math`, whose two agents'
reward distributions differ for the whole run, with one SmolLM2-135M-Instruct shared by both agents.

    python benchmarks/learning/run.py --v2                 # the pre-registered study (results_v2.json here)
    python benchmarks/learning/run.py --v2 --resume        # continue it (runs only the missing ones)
    python benchmarks/learning/run.py --v2 --quick         # 1 seed, 2 steps, both arms (a smoke, not a result)
    python benchmarks/learning/run.py --v2 --tiny --out D  # tiny random models (seconds; tests/test_learning_study.py)
    python benchmarks/learning/run.py --v2 --report        # tables and verdicts from results_v2.json

Every run is recorded in results_v2.json as it ends (rewritten atomically); a stopped study resumes from it.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from langchain_core.language_models.fake_chat_models import FakeListChatModel

from drmas_graph.config import TrainConfig
from graphs.checked_math.env import CheckedMathEnv
from graphs.checked_math.graph import build_graph

HERE = Path(__file__).resolve().parent
AGENTS = {"solver": 12, "checker": 6}
"""agent -> max_new_tokens."""
ENV_KWARGS = {"n_train": 80, "n_test": 48, "difficulty": (0.6, 0.4)}
ESTIMATORS = ("step_global", "agent")
"""The primary arms; `--estimators` may add episode_global (the secondary arm, if the budget allows)."""
FULL = {"seeds": list(range(10)), "steps": 10, "tasks_per_step": 4, "group_size": 8, "eval_k": 4, "eval_tasks": 48}
QUICK = {"seeds": [0], "steps": 2, "tasks_per_step": 2, "group_size": 4, "eval_k": 4, "eval_tasks": 4}
TINY = {"seeds": [0], "steps": 1, "tasks_per_step": 1, "group_size": 2, "eval_k": 2, "eval_tasks": 1}
ROLLOUT = {"temperature": 0.6, "top_p": 0.95}
UPDATE = {"lr": 1.0e-5, "grad_clip": 1.0, "n_minibatches": 2, "kl_coef": 0.0, "kl_start_metric": True,
          "backend": "torch"}
"""No KL loss; `kl_start_metric` logs the KL to the start weights."""
MANIPULATION = {"agent": "solver", "steps": 4, "threshold": 1.5}
"""The manipulation check: under step_global, the solver's E[A^2] averaged over the first 4 steps >= 1.5."""
SPIKE_FACTOR = 3.0


class RecordingEnv:
    """CheckedMathEnv, counting the checker's verdicts per (phase, step) as the trainer scores episodes."""

    def __init__(self, env: CheckedMathEnv) -> None:
        self.env = env
        self.counts: dict[tuple[str, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._seen: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    def reward(self, task: Any, episode: Any) -> Any:
        if episode.id not in self._seen:
            self._seen.add(episode.id)
            c = self.counts[(episode.metadata.get("phase", "?"), int(episode.metadata.get("step", -1)))]
            for key, n in self.env.verdict_counts(task, episode.final_state).items():
                c[key] += n
            answer = (episode.final_state or {}).get("answer")
            c["solver_parsed"] += answer is not None
            c["solver_right"] += self.env.score(task, episode.final_state or {})
            c["episodes"] += 1
        return self.env.reward(task, episode)

    def rates(self, phase: str, step: int) -> dict[str, float]:
        c = self.counts.get((phase, step), {})
        div = lambda a, b: a / b if b else math.nan  # noqa: E731
        tpr = div(c.get("tp", 0), c.get("tp", 0) + c.get("fn", 0))
        tnr = div(c.get("tn", 0), c.get("tn", 0) + c.get("fp", 0))
        return {"checker_tpr": tpr, "checker_tnr": tnr, "checker_balanced_accuracy": (tpr + tnr) / 2,
                "solver_format_rate": div(c.get("solver_parsed", 0), c.get("episodes", 0)),
                "solver_accuracy_parsed": div(c.get("solver_right", 0), c.get("solver_parsed", 0))}


def make_config(estimator: str, seed: int, plan: dict[str, Any], run_dir: Path, tiny: bool) -> TrainConfig:
    model = {"tiny": {"seed": seed, "vocab_size": 512}} if tiny else {"path": "smollm2", "max_batch_size": 32}
    agents = {a: {"model": "shared", "sampling": {**ROLLOUT, "max_new_tokens": n}, "loss": {"micro_batch_size": 8}}
              for a, n in AGENTS.items()}
    return TrainConfig.model_validate({
        "name": f"checked_math-{estimator}-s{seed}", "run_dir": str(run_dir), "seed": seed,
        "models": {"shared": model}, "agents": agents, "update": UPDATE, "estimator": estimator,
        "steps": plan["steps"], "tasks_per_step": plan["tasks_per_step"], "group_size": plan["group_size"],
        "max_concurrency": 32, "checkpoint_every": 0,
        "eval": {"k": plan["eval_k"], "n_tasks": plan["eval_tasks"], "every": plan["steps"], "before_training": True},
        "logging": {"progress": False, "tensorboard": False}})


def run_one(estimator: str, seed: int, plan: dict[str, Any], root: Path, tiny: bool) -> dict[str, Any]:
    from drmas_graph.train.loop.trainer import train_graph

    graph = build_graph(FakeListChatModel(responses=["(stand-in)"]))
    env = RecordingEnv(CheckedMathEnv(seed=0, **ENV_KWARGS))
    cfg = make_config(estimator, seed, plan, root / f"checked_math-{estimator}-s{seed}", tiny)
    t0 = time.perf_counter()
    result = train_graph(graph, env, cfg)
    wall = time.perf_counter() - t0
    steps = []
    for rec in result.history:
        agents = {a: {"reward": rec.get(f"agent/{a}/reward_mean", math.nan),
                      "grad_norm": rec.get(f"agent/{a}/grad_norm", math.nan),
                      "adv_sq": rec.get(f"agent/{a}/advantage_sq_mean", math.nan),
                      "adv_mean": rec.get(f"agent/{a}/advantage_mean", math.nan),
                      "clip_frac": rec.get(f"agent/{a}/clip_frac", math.nan),
                      "kl_start": rec.get(f"agent/{a}/kl_start", math.nan),
                      "calls": rec.get(f"agent/{a}/calls", 0), "invalid_rate": rec.get(f"agent/{a}/invalid_rate", math.nan)}
                  for a in AGENTS}
        steps.append({"step": rec["step"], "team_reward": rec["reward/team_mean"], "agents": agents,
                      "grad_norm": rec.get("model/shared/grad_norm", math.nan),
                      "grad_norm_max": rec.get("model/shared/grad_norm_max", math.nan),
                      "rates": env.rates("train", rec["step"]), "time_s": rec["time/step_s"],
                      "rollout_s": rec["time/rollout_s"], "update_s": rec["time/update_s"]})
    evals = [{"step": e["step"], "k": e["k"], "tasks": e["tasks"], "avg@k": e["avg@k"], "pass@k": e["pass@k"],
              "agents": {a: e.get(f"{a}/reward", math.nan) for a in AGENTS}, "rates": env.rates("eval", e["step"])}
             for e in result.evals]
    return {"app": "checked_math", "estimator": estimator, "seed": seed, "wall_s": wall, "steps": steps,
            "eval": evals}


# -- statistics (PREREG_v2.md "Endpoints" and "Test") ----------------------------------------------------------
def manipulation(run: dict[str, Any]) -> float:
    """The solver's E[A^2] averaged over the run's first MANIPULATION["steps"] steps."""
    head = run["steps"][:MANIPULATION["steps"]]
    return statistics.fmean(s["agents"][MANIPULATION["agent"]]["adv_sq"] for s in head)


def spikes(run: dict[str, Any], agent: str) -> int:
    """Steps with a gradient (the agent's E[A^2] > 0: some advantage is not 0) whose per-agent gradient norm
    exceeds SPIKE_FACTOR x the median over those steps."""
    norms = [s["agents"][agent]["grad_norm"] for s in run["steps"] if s["agents"][agent]["adv_sq"] > 0]
    if not norms:
        return 0
    med = statistics.median(norms)
    return sum(n > SPIKE_FACTOR * med for n in norms)


def solver_share(run: dict[str, Any]) -> float:
    """Mean over steps where both agents have a gradient of solver norm / (solver norm + checker norm)."""
    shares = [s["agents"]["solver"]["grad_norm"] / (s["agents"]["solver"]["grad_norm"] + s["agents"]["checker"]["grad_norm"])
              for s in run["steps"] if s["agents"]["solver"]["adv_sq"] > 0 and s["agents"]["checker"]["adv_sq"] > 0]
    return statistics.fmean(shares) if shares else math.nan


def run_metrics(run: dict[str, Any]) -> dict[str, float]:
    first, last = run["eval"][0], run["eval"][-1]
    tail = run["steps"][-max(len(run["steps"]) // 4, 1):]
    out = {"avg@k": last["avg@k"], "pass@k": last["pass@k"], "avg@k gain": last["avg@k"] - first["avg@k"],
           **{f"eval {k}": v for k, v in last["rates"].items()},
           "final reward solver": statistics.fmean(s["agents"]["solver"]["reward"] for s in tail),
           "final reward checker": statistics.fmean(s["agents"]["checker"]["reward"] for s in tail),
           "manipulation: solver E[A^2] first 4": manipulation(run),
           "spikes (steps with a gradient)": sum(spikes(run, a) for a in AGENTS),
           "max model grad norm": max(s["grad_norm"] for s in run["steps"]),
           "solver share of grad norm": solver_share(run),
           "final kl_start solver": run["steps"][-1]["agents"]["solver"]["kl_start"],
           "final kl_start checker": run["steps"][-1]["agents"]["checker"]["kl_start"]}
    return out


HYPOTHESES = [  # (name, metric, direction in which d = agent - step_global supports it)
    ("P1 checker judges better (final held-out balanced accuracy)", "eval checker_balanced_accuracy", +1),
    ("P2 solver solves more (final held-out avg@k)", "avg@k", +1),
    ("S1 checker catches wrong answers (final held-out TNR)", "eval checker_tnr", +1),
    ("S2 pass@k", "pass@k", +1),
    ("S3 solver's share of the gradient norm is lower", "solver share of grad norm", -1),
    ("S4 spikes on steps with a gradient (not higher)", "spikes (steps with a gradient)", -1),
    ("S5 max model grad norm lower", "max model grad norm", -1),
]


def paired(runs: list[dict[str, Any]], metric: str, base: str = "step_global") -> list[float]:
    """d_s = metric(agent, s) - metric(base, s) over the seeds that have both runs."""
    by = {(r["estimator"], r["seed"]): run_metrics(r)[metric] for r in runs}
    return [by[("agent", s)] - by[(base, s)] for e, s in sorted(by) if e == "agent" and (base, s) in by]


def hypothesis_lines(runs: list[dict[str, Any]]) -> list[str]:
    from study_stats import fmt_ci, t_interval, verdict

    out = []
    for name, metric, sign in HYPOTHESES:
        d = paired(runs, metric)
        m, lo, hi = t_interval(d)
        out.append(f"hypothesis v2: {name}: d = {fmt_ci((m, lo, hi))} over {len(d)} pairs: {verdict(lo, hi, sign)}")
    return out


def manipulation_line(runs: list[dict[str, Any]]) -> str:
    from study_stats import fmt_ci, t_interval

    values = [manipulation(r) for r in runs if r["estimator"] == "step_global"]
    m, lo, hi = t_interval(values)
    ok = "holds" if values and m >= MANIPULATION["threshold"] else "fails"
    return (f"manipulation check v2: solver E[A^2] over the first {MANIPULATION['steps']} steps under step_global = "
            f"{fmt_ci((m, lo, hi))} over {len(values)} runs (threshold {MANIPULATION['threshold']}): {ok}")


def table(runs: list[dict[str, Any]], estimators: list[str]) -> str:
    from study_stats import fmt_ci, t_interval

    by = {(r["estimator"], r["seed"]): run_metrics(r) for r in runs}
    names = list(next(iter(by.values()))) if by else []
    cols = [e for e in estimators if any(k[0] == e for k in by)]
    pairs = [e for e in cols if e != "agent"] if "agent" in cols else []
    lines = ["| metric | " + " | ".join(cols) + "".join(f" | agent - {e}" for e in pairs) + " |",
             "|---" * (1 + len(cols) + len(pairs)) + "|"]
    for name in names:
        cells = [fmt_ci(t_interval([v[name] for (e, _), v in by.items() if e == c])) for c in cols]
        cells += [fmt_ci(t_interval(paired(runs, name, base=e))) for e in pairs]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SOLVER_BY_STEP = {"format": lambda s: s["rates"]["solver_format_rate"],
                  "accuracy among parsable": lambda s: s["rates"]["solver_accuracy_parsed"],
                  "accuracy over all": lambda s: s["rates"]["solver_format_rate"] * s["rates"]["solver_accuracy_parsed"],
                  "E[A^2]": lambda s: s["agents"]["solver"]["adv_sq"]}
"""What `solver_by_step` reads of a training step's record: the solver's format rate, its accuracy among its
parsable answers, its accuracy over all its answers (an unparsable answer counts as wrong) and its E[A^2]."""


def solver_by_step(runs: list[dict[str, Any]], estimator: str) -> list[dict[str, float]]:
    """Per training step, the mean over the arm's runs of each `SOLVER_BY_STEP` quantity, and (key "E[A^2] so far")
    the mean over runs of the solver's E[A^2] averaged over the steps up to this one. Each step rolls out tasks the
    run has not trained on yet (4 of 80 per step, one shuffle: 40 in 10 steps), on the weights before its update."""
    arm = [r for r in runs if r["estimator"] == estimator]
    n = min(len(r["steps"]) for r in arm)
    out = []
    for i in range(n):
        row = {name: statistics.fmean(get(r["steps"][i]) for r in arm) for name, get in SOLVER_BY_STEP.items()}
        row["E[A^2] so far"] = statistics.fmean(statistics.fmean(SOLVER_BY_STEP["E[A^2]"](s) for s in r["steps"][:i + 1])
                                                for r in arm)
        out.append(row)
    return out


def clipped_line(runs: list[dict[str, Any]], estimators: list[str]) -> str:
    """Per arm, the training steps whose model gradient norm before clipping (the mean over the step's mini-batches)
    is above `update.grad_clip`: each of those steps has at least one clipped mini-batch."""
    clip = UPDATE["grad_clip"]
    counts = [f"{e} {sum(s['grad_norm'] > clip for r in arm for s in r['steps'])} of {sum(len(r['steps']) for r in arm)}"
              for e in estimators if (arm := [r for r in runs if r["estimator"] == e])]
    return f"steps with a mean pre-clip model gradient norm above grad_clip {clip}: " + ", ".join(counts)


def solver_steps_markdown(runs: list[dict[str, Any]], estimators: list[str]) -> str:
    """The solver in the training rollouts, step by step, per arm (`solver_by_step`): format rate, accuracy among
    parsable answers, accuracy over all answers, E[A^2] (and its mean over the steps so far)."""
    arms = [e for e in estimators if any(r["estimator"] == e for r in runs)]
    rows = {e: solver_by_step(runs, e) for e in arms}
    lines = ["| step | " + " | ".join(f"`{e}`: format, accuracy among parsable / over all, E[A^2] (so far)"
                                      for e in arms) + " |", "|---" * (1 + len(arms)) + "|"]
    for i in range(min(len(v) for v in rows.values())):
        cells = [f"{r['format']:.3f}, {r['accuracy among parsable']:.3f} / {r['accuracy over all']:.3f}, "
                 f"{r['E[A^2]']:.3f} ({r['E[A^2] so far']:.3f})" for r in (rows[e][i] for e in arms)]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def runs_markdown(runs: list[dict[str, Any]]) -> str:
    """Every run as one markdown row (the README's per-run table): held-out avg@k, pass@k and checker balanced
    accuracy at step 0 and at the end (TPR / TNR at the end), the solver's format rate and accuracy among parsable
    answers at the end, the manipulation quantity, spikes, the largest model gradient norm and wall time."""
    lines = ["| arm | seed | wall | avg@k 0 -> end | pass@k 0 -> end | checker balanced accuracy 0 -> end "
             "(TPR / TNR at end) | solver format, accuracy among parsable at end | solver E[A^2] first 4 | "
             "spikes | max model grad norm |", "|---" * 10 + "|"]
    for r in sorted(runs, key=lambda r: (r["seed"], ESTIMATORS.index(r["estimator"])
                                         if r["estimator"] in ESTIMATORS else len(ESTIMATORS))):
        first, last = r["eval"][0], r["eval"][-1]
        fr, lr = first["rates"], last["rates"]
        m = run_metrics(r)  # the study's own definitions of the manipulation quantity, spikes and max norm
        lines.append(
            f"| `{r['estimator']}` | {r['seed']} | {r['wall_s'] / 60:.1f} min | {first['avg@k']:.3f} -> "
            f"{last['avg@k']:.3f} | {first['pass@k']:.3f} -> {last['pass@k']:.3f} | "
            f"{fr['checker_balanced_accuracy']:.3f} -> {lr['checker_balanced_accuracy']:.3f} "
            f"({lr['checker_tpr']:.3f} / {lr['checker_tnr']:.3f}) | {lr['solver_format_rate']:.3f}, "
            f"{lr['solver_accuracy_parsed']:.3f} | {m['manipulation: solver E[A^2] first 4']:.3f} | "
            f"{m['spikes (steps with a gradient)']} | {m['max model grad norm']:.2f} |")
    return "\n".join(lines)


def plots(runs: list[dict[str, Any]], out: Path) -> Path:
    """checked_math.png: per step, mean over seeds per arm with a 95% band, of each agent's E[A^2] (the
    manipulation: 1 is where per-agent normalization puts it) and per-agent gradient norm; below, the two primary
    endpoints per seed at step 0 and at the end, one line per run (the pairs a paired t test compares)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from study_stats import band

    fig, axes = plt.subplots(3, 2, figsize=(11, 10))
    for col, a in enumerate(AGENTS):
        band(axes[0][col], runs, lambda s, a=a: s["agents"][a]["adv_sq"], f"{a}: E[A^2] per step", (0.0, None))
        axes[0][col].axhline(1.0, color="grey", lw=0.8, ls=":")
        band(axes[1][col], runs, lambda s, a=a: s["agents"][a]["grad_norm"],
              f"{a}: gradient norm of its part of the loss (before clipping)", (0.0, None))
    endpoints = [("checker balanced accuracy (held out)", lambda e: e["rates"]["checker_balanced_accuracy"]),
                 ("avg@k (held out: the solver's answer right)", lambda e: e["avg@k"])]
    arms = sorted({r["estimator"] for r in runs})  # band's order, so each arm keeps its color
    colors = {e: f"C{i}" for i, e in enumerate(arms)}
    shifts = {e: 0.3 * (i - (len(arms) - 1) / 2) for i, e in enumerate(arms)}  # arms side by side
    for col, (title, get) in enumerate(endpoints):
        ax = axes[2][col]
        for r in runs:
            xs = [e["step"] + shifts[r["estimator"]] for e in r["eval"]]
            ax.plot(xs, [get(e) for e in r["eval"]], color=colors[r["estimator"]], alpha=0.5, marker="o", ms=3)
        for est, c in colors.items():
            ax.plot([], [], color=c, label=est)
        ax.set_title(f"{title}, per run", fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    n = len({r["seed"] for r in runs})
    fig.suptitle(f"checked_math, study v2 ({n} seeds): rows 1-2 mean over seeds per step, band = 95% t interval "
                 "of the mean; row 3 one line per run", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path = out / "checked_math.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    from benchmarks._deps import require
    from study_stats import in_own_process

    p = argparse.ArgumentParser(prog="run.py --v2", description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="1 seed, 2 steps, both arms (a smoke)")
    mode.add_argument("--tiny", action="store_true", help="tiny random-weight models (seconds; the test)")
    p.add_argument("--estimators", nargs="+", default=list(ESTIMATORS))
    p.add_argument("--seeds", nargs="+", type=int, help="override the plan's seeds (not for the pre-registered study)")
    p.add_argument("--out", type=Path, help="folder for results_v2.json (default: this folder for the study, a "
                                            "temporary one for --quick / --tiny)")
    p.add_argument("--report", action="store_true", help="only print the tables and verdicts of OUT/results_v2.json")
    p.add_argument("--resume", action="store_true", help="keep OUT/results_v2.json's runs, run the missing ones")
    args = p.parse_args(argv)
    require({"matplotlib": "demo"}, "the study's plot")  # checked now, not after hours of runs
    plan = dict(TINY if args.tiny else QUICK if args.quick else FULL)
    if args.seeds:
        plan["seeds"] = args.seeds
    out = args.out or (HERE if not (args.quick or args.tiny) else Path(tempfile.mkdtemp(prefix="learning-v2-")))
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results_v2.json"
    runs: list[dict[str, Any]] = []
    if results.exists() and not (args.resume or args.report):
        p.error(f"{results} exists: pass --resume to continue it, --report to read it, or another --out")
    if args.report and not results.exists():
        p.error(f"--report: no {results}")
    if results.exists():
        saved = json.loads(results.read_text())
        if (saved.get("plan"), saved.get("update"), saved.get("rollout")) != (plan, UPDATE, ROLLOUT):
            p.error(f"{results} was written with other settings (plan, update or rollout); use another --out")
        runs = saved["runs"]
    done = {(r["estimator"], r["seed"]) for r in runs}
    root = out / "runs_v2"
    todo = [] if args.report else [(e, s) for s in plan["seeds"] for e in args.estimators if (e, s) not in done]
    for est, seed in todo:  # seed outermost: a stopped study holds whole pairs
        shutil.rmtree(root / f"checked_math-{est}-s{seed}", ignore_errors=True)
        run = in_own_process(run_one, est, seed, plan, root, tiny=args.tiny)
        shutil.rmtree(root / f"checked_math-{est}-s{seed}" / "checkpoints", ignore_errors=True)  # ~1.5 GB; not kept
        runs.append(run)
        print(f"checked_math {est} seed {seed}: {len(run['steps'])} steps in {run['wall_s']:.0f} s, final "
              f"avg@{run['eval'][-1]['k']} {run['eval'][-1]['avg@k']:.3f}", flush=True)
        tmp = results.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"plan": plan, "update": UPDATE, "rollout": ROLLOUT, "agents": AGENTS,
                                   "env_kwargs": ENV_KWARGS, "runs": runs}, indent=1, default=str))
        tmp.replace(results)
    if runs:
        print(table(runs, args.estimators))
        print(manipulation_line(runs))
        for line in hypothesis_lines(runs):
            print(line)
        if args.report:
            print("\n" + runs_markdown(runs))
            print("\n" + solver_steps_markdown(runs, args.estimators))
            print(clipped_line(runs, args.estimators))
    print(f"results: {results}", flush=True)
    if runs:
        print(f"plot: {plots(runs, out)}")  # after the results: the numbers never wait on the plot
    return 0
