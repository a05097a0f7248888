"""The calculator team's pre-registered study (graphs/calc_team/PREREG.md): step 0, warm start, RL, per seed.

    python benchmarks/learning/calc_team.py               # the study: seeds 0, 1, 2 (needs the warm start)
    python benchmarks/learning/calc_team.py --resume      # continue: steps whose outputs exist are not run again
    python benchmarks/learning/calc_team.py --report      # rebuild the results file from the run folders
    python benchmarks/learning/calc_team.py --smoke       # wiring: seed 0, 1 warm-start epoch, 2 RL steps, train tasks
    python benchmarks/learning/calc_team.py --power       # the pre-registration's power table

Per seed S, in runs/calc-team-study/sS (each step a `drmas-graph` command in its own process, from the repository
root, `graphs/calc_team/train.yaml` with ``--set seed=S``):

1. ``base``: `drmas-graph eval` of the untrained model on the held-out tasks (E0: step 0, no training).
2. ``warm start`` (issue 57 item 4, `warm_start:`): supervised fine-tuning on `graphs/calc_team/demos.jsonl`,
   which `drmas-graph train` runs before RL when given `WARM_START`'s overrides. `warm_start_overrides` stops the
   study before any run, naming the missing feature, in a drmas_graph without it (``TrainConfig`` has no
   ``warm_start`` field), and validates the overrides against the config before any run.
3. ``train``: `drmas-graph train` with those overrides: the warm start, then its evaluation before the first RL
   step (E1, after the warm start) and after the last (E2, after RL).

Every run's numbers (`graphs.calc_team.report`, each share with its n; the training steps' rewards per agent;
the manipulation checks; the commands) go to the results file (default
`benchmarks/learning/calc_team_results.json`), rewritten after each step, with the pre-registered tests: H1
the critic's JSON share at E0 >= 0.95 pooled over seeds; H2 the worker's tool-call rate E0 -> E1 and H3 the team
score E1 -> E2, each a one-sided exact sign test over (seed, task) units at alpha 0.05.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from graphs.calc_team.report import EvalNumbers, as_dict, eval_numbers, sign_test, task_changes  # noqa: E402

CONFIG = "graphs/calc_team/train.yaml"
"""The study's config (relative to the repository root), as committed with PREREG.md."""
SEEDS = (0, 1, 2)
RUNS = Path("runs/calc-team-study")
RESULTS = Path(__file__).resolve().parent / "calc_team_results.json"
WARM_START = {"warm_start.demonstrations": "graphs/calc_team/demos.jsonl"}
"""`--set` overrides that turn the warm start on: one file whose records each name their ``"agent"`` (worker 20,
critic 12), the form of c57-warm's work in progress when this was written (`WarmStartConfig.demonstrations`); its
other settings (epochs, lr, batch size, held-out tasks scored before and after) are its defaults. Check the keys
against c57-warm as merged; `warm_start_overrides` validates them before any run."""
SMOKE = ["steps=2", "tasks_per_step=2", "group_size=2", "eval.n_tasks=2", "eval.k=1", "eval.split=train"]
"""The smoke run's overrides: the wiring, not a measurement; its evaluations use train tasks, so no held-out task of
the study is looked at."""
SMOKE_WARM = ["warm_start.epochs=1", "warm_start.eval_tasks=0"]
"""The smoke run's warm start (when this drmas_graph has one): one epoch, no held-out scoring."""
ALPHA = 0.05
H1_THRESHOLD = 0.95


class StudyBlocked(RuntimeError):
    """A step of the study cannot run in this checkout (a feature it needs is missing)."""


def warm_start_overrides() -> list[str]:
    """The `--set` overrides of step 2; `StudyBlocked` naming the missing feature while drmas_graph has no warm
    start, and the config error while `WARM_START` does not match its schema."""
    from drmas_graph.config import TrainConfig, load_config

    if "warm_start" not in TrainConfig.model_fields:
        raise StudyBlocked(
            "step 2 of the study, the warm start from demonstrations (issue 57 item 4: supervised fine-tuning per "
            "agent from an OpenAI fine-tuning JSONL file before RL, branch c57-warm), is not in this drmas_graph: "
            "drmas_graph.config.TrainConfig has no `warm_start` field. H2 and H3 need it; nothing was run. Merge "
            "c57-warm, set WARM_START in benchmarks/learning/calc_team.py to its keys, and run this again.")
    overrides = [f"{key}={value}" for key, value in WARM_START.items()]
    load_config(ROOT / CONFIG, overrides)  # a key c57-warm does not have fails here, before any run
    return overrides


def _smoke_warm_start() -> list[str]:
    try:
        return warm_start_overrides() + SMOKE_WARM
    except StudyBlocked as exc:
        print(f"smoke run without a warm start: {exc}", flush=True)
        return []


def _cli(args: list[str], log: Path) -> list[str]:
    """Run `drmas-graph ARGS` from the repository root in its own process, output to `log`; the command."""
    command = [sys.executable, "-m", "drmas_graph.cli", *args]
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path, "WEAVE_DISABLED": "true", "TOKENIZERS_PARALLELISM": "false"}
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"$ drmas-graph {' '.join(args)}   (log: {log})", flush=True)
    with log.open("w") as out:
        code = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"`drmas-graph {' '.join(args)}` exited with {code}; see {log}")
    return ["drmas-graph", *args]


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def run_seed(seed: int, root: Path, *, smoke: bool, resume: bool) -> dict[str, Any]:
    """Steps 1 to 3 for one seed (module docstring); the record of what ran."""
    base, train = root / f"s{seed}" / "base", root / f"s{seed}" / "train"
    extra = SMOKE if smoke else []
    record: dict[str, Any] = {"seed": seed, "smoke": smoke, "commands": [], "started": time.strftime("%F %T")}
    base_eval = _eval_folder(base)
    if not (resume and base_eval is not None):
        record["commands"].append(_cli(["eval", CONFIG, *_sets([f"seed={seed}", f"run_dir={base}", *extra])],
                                       root / f"s{seed}" / "base.log"))
    warm = _smoke_warm_start() if smoke else warm_start_overrides()
    record["warm_start"] = warm or None
    if not (resume and (train / "traces.db").is_file() and _finished(train)):
        record["commands"].append(_cli(["train", CONFIG, *_sets([f"seed={seed}", f"run_dir={train}", *extra, *warm])],
                                       root / f"s{seed}" / "train.log"))
    record["finished"] = time.strftime("%F %T")
    return record


def _eval_folder(base: Path) -> Path | None:
    """The finished `drmas-graph eval` folder of `base` (run_dir/eval/base-<split>-k<k>, with its eval.json)."""
    found = sorted(p.parent for p in (base / "eval").glob("base-*-k*/eval.json")) if (base / "eval").is_dir() else []
    return found[-1] if found else None


def _finished(train: Path) -> bool:
    """The run evaluated after its last step (metrics.jsonl has an `eval/` record at step == its config's steps)."""
    import yaml

    metrics, config = train / "metrics.jsonl", train / "config.yaml"
    if not (metrics.is_file() and config.is_file()):
        return False
    steps = yaml.safe_load(config.read_text())["steps"]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return any("eval/avg@k" in row and row["step"] == steps for row in rows)


_STEP_KEYS = ("reward/team_mean", "adv/pools", "adv/zero_variance_pools", "model_error_episodes")


def _steps(train: Path) -> list[dict[str, Any]]:
    """Per training step: the team reward, the advantage pools (all, zero-variance), model-error episodes, and each
    agent's reward mean, invalid rate and model-error share (metrics.jsonl)."""
    out = []
    path = train / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        row = json.loads(line)
        if "reward/team_mean" not in row:
            continue
        out.append({k: v for k, v in row.items() if k == "step" or k in _STEP_KEYS or (
            k.startswith("agent/") and k.rsplit("/", 1)[-1] in ("reward_mean", "invalid_rate", "model_error_share"))})
    return out


def _replies(db: Path, where: str) -> list[tuple[str, int, str, str]]:
    """(task id, position, agent, reply) of the evaluation episodes `where` selects, in a fixed order."""
    import sqlite3

    conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT e.task_id, e.group_id, t.position, t.agent, t.response_text FROM turns t JOIN "
                            f"episodes e ON e.id = t.episode_id WHERE {where}").fetchall()
    finally:
        conn.close()
    # a task's k episodes share a group; order them by their replies so the two evaluations line up
    return sorted((task, position, agent, text) for task, _, position, agent, text in rows)


def _warm_start_changed_e1(base_eval: Path | None, train: Path) -> bool | None:
    """Manipulation check 2: E1's replies differ from E0's. E0 (`drmas-graph eval`) and E1 (the training run's
    evaluation before its first step) sample with the same seeds, so with unchanged weights their replies are
    identical (the smoke run: bit-identical); a warm start that ran before E1 changes them. None: a folder is
    missing."""
    if base_eval is None or not (train / "traces.db").is_file():
        return None
    return _replies(base_eval / "traces.db", "e.group_id LIKE 'eval:0:%'") != \
        _replies(train / "traces.db", "e.group_id LIKE 'eval:0:%'")


def _warm_start_tokens(train: Path) -> dict[str, int] | None:
    """Per agent the response tokens the warm start trained on in its last epoch (c57-warm's
    ``agent/<a>/warm_start_tokens`` lines in metrics.jsonl); None without a metrics file."""
    path = train / "metrics.jsonl"
    if not path.is_file():
        return None
    out: dict[str, int] = {}
    for line in path.read_text().splitlines():
        for key, value in json.loads(line).items():
            if key.startswith("agent/") and key.endswith("/warm_start_tokens"):
                out[key.split("/")[1]] = value
    return out


def collect(seed: int, root: Path, record: dict[str, Any] | None = None) -> dict[str, Any]:
    """One seed's numbers from its run folders: E0 (base), E1 and E2 (the train run's first and last evaluation)."""
    base, train = root / f"s{seed}" / "base", root / f"s{seed}" / "train"
    out: dict[str, Any] = dict(record or {"seed": seed})
    base_eval = _eval_folder(base)
    e0 = eval_numbers(base_eval)[0] if base_eval is not None else None
    trained = eval_numbers(train) if (train / "traces.db").is_file() else {}
    # E1 is the evaluation before RL's first step (0); the warm start's own held-out scores are at negative steps
    e1 = trained.get(0)
    e2 = trained[max(trained)] if trained and max(trained) > 0 else None
    out["evals"] = {name: as_dict(n) if n is not None else None for name, n in (("E0", e0), ("E1", e1), ("E2", e2))}
    out["steps"] = _steps(train)
    out["checks"] = {
        "critic_and_worker_constrained_at_E0": _all_constrained(e0),
        "warm_start_changed_E1": _warm_start_changed_e1(base_eval, train),
        "warm_start_tokens": _warm_start_tokens(train),
        "E2_served_by_trained_weights": (max(e2.versions) > max(e1.versions)) if e1 and e2 else None,
    }
    out["_numbers"] = {"E0": e0, "E1": e1, "E2": e2}
    return out


def _all_constrained(numbers: EvalNumbers | None) -> bool | None:
    if numbers is None:
        return None
    return numbers.critic_constrained.hits == numbers.critic_constrained.n and \
        numbers.worker_constrained.hits == numbers.worker_constrained.n


def tests(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The pre-registered tests over the runs that have the evaluations they need (PREREG.md)."""
    e0 = [r["_numbers"]["E0"] for r in runs if r["_numbers"]["E0"] is not None]
    hits, n = sum(x.critic_json.hits for x in e0), sum(x.critic_json.n for x in e0)
    out: dict[str, Any] = {"H1": {"critic_json": {"hits": hits, "n": n, "value": hits / n if n else None},
                                  "supported": bool(n) and hits / n >= H1_THRESHOLD}}
    for name, before, after, which in (("H2", "E0", "E1", 0), ("H3", "E1", "E2", 1)):
        changes = [d for r in runs if r["_numbers"][before] and r["_numbers"][after]
                   for d in task_changes(r["_numbers"][before].by_task, r["_numbers"][after].by_task, which)]
        ups, nonzero, p = sign_test(changes)
        out[name] = {"units": len(changes), "up": ups, "down": sum(d < 0 for d in changes), "nonzero": nonzero,
                     "p": p, "supported": bool(nonzero) and p < ALPHA}
    return out


def write_results(runs: list[dict[str, Any]], path: Path) -> None:
    body = {"config": CONFIG, "warm_start": WARM_START, "runs": [{k: v for k, v in r.items() if k != "_numbers"}
                                                                 for r in runs], "tests": tests(runs)}
    path.write_text(json.dumps(body, indent=1) + "\n")


def power(units: int = 48, k: int = 4, sims: int = 4000, seed: int = 0) -> list[tuple[float, float, float]]:
    """(p_before, p_after, power) of the one-sided exact sign test over `units` (seed, task) units of k episodes
    before and k after, independent Bernoulli episodes (simulated `sims` times)."""
    import random

    rng = random.Random(seed)
    rows = []
    for p0, p1 in ((0.0, 0.02), (0.0, 0.05), (0.0, 0.1), (0.05, 0.1), (0.1, 0.15), (0.1, 0.2), (0.2, 0.3),
                   (0.3, 0.4), (0.4, 0.5)):
        found = 0
        for _ in range(sims):
            changes = [sum(rng.random() < p1 for _ in range(k)) - sum(rng.random() < p0 for _ in range(k))
                       for _ in range(units)]
            found += sign_test([float(c) for c in changes])[2] < ALPHA
        rows.append((p0, p1, found / sims))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--runs", type=Path, default=RUNS, help=f"folder of the run folders (default {RUNS})")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the results file")
    parser.add_argument("--resume", action="store_true", help="skip the steps whose outputs exist")
    parser.add_argument("--report", action="store_true", help="only rebuild the results file from the run folders")
    parser.add_argument("--smoke", action="store_true",
                        help="seed 0, 1 warm-start epoch, 2 RL steps, tiny evaluations on train tasks (wiring)")
    parser.add_argument("--power", action="store_true", help="print the power table of PREREG.md")
    args = parser.parse_args(argv)
    if args.power:
        print("| before | after | power (48 units x k = 4, one-sided sign test, alpha 0.05) |\n|---|---|---|")
        for p0, p1, pw in power():
            print(f"| {p0:.2f} | {p1:.2f} | {pw:.2f} |")
        return 0
    runs_root = (ROOT / args.runs) if not args.runs.is_absolute() else args.runs
    seeds = [0] if args.smoke else args.seeds
    if not args.smoke and not args.report:
        try:
            warm_start_overrides()  # before any run: the study needs it
        except StudyBlocked as exc:
            print(f"calc_team study: {exc}", file=sys.stderr)
            return 2
    records: list[dict[str, Any]] = []
    for seed in seeds:
        record = None
        if not args.report:
            try:
                record = run_seed(seed, runs_root, smoke=args.smoke, resume=args.resume)
            except RuntimeError as exc:  # a run that failed is reported with what it recorded
                record = {"seed": seed, "smoke": args.smoke, "error": str(exc)}
        records.append(collect(seed, runs_root, record))
        write_results(records, args.out)
    for r in records:
        print(f"seed {r['seed']}: " + "; ".join(
            f"{name} critic JSON {e['critic_json']['value']} (n={e['critic_json']['n']}), worker tool call "
            f"{e['worker_tool_call']['value']} (n={e['worker_tool_call']['n']}), team score {e['score']['value']} "
            f"(n={e['score']['n']})" for name, e in r["evals"].items() if e is not None) + f"; checks {r['checks']}")
    print(json.dumps(tests(records), indent=1))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
