"""The learning study (benchmarks/learning): its two apps (graphs/verified_math, graphs/lookup) with scripted
chat models and hand-worked rewards and rates, and the runner end to end on tiny random models."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from langchain_core.language_models.fake_chat_models import FakeListChatModel

from graphs.lookup.env import LookupEnv
from graphs.lookup.graph import build_graph as build_lookup, parse_call
from graphs.math.graph import build_graph as build_math
from graphs.verified_math.env import VerifiedMathEnv

ROOT = Path(__file__).resolve().parents[1]


def _math_episode(replies: list[str]) -> tuple[object, object, SimpleNamespace]:
    env = VerifiedMathEnv(seed=0, n_train=4, n_test=2, difficulty=(1.0,))
    task = env.tasks("train")[0]
    assert (task.input["question"], task.answer) == ("What is 0 + 7?", "7")
    state = build_math(FakeListChatModel(responses=replies), max_rounds=2).invoke(task.input)
    return env, task, SimpleNamespace(final_state=state)


def test_verifier_is_paid_per_verdict_and_a_rejected_answer_goes_back_to_the_solver():
    env, task, ep = _math_episode(["The answer is 8.", "No, check it.", "The answer is 7.", "Yes"])
    assert [e["agent"] for e in ep.final_state["transcript"]] == ["solver", "verifier", "solver", "verifier"]
    assert env.reward(task, ep) == {"solver": 1.0, "verifier": 1.0}   # both verdicts right
    assert env.verdict_counts(task, ep.final_state) == {"tp": 1, "fn": 0, "tn": 1, "fp": 0}
    assert env.is_success(task, ep)


def test_rubber_stamping_a_wrong_answer_pays_the_verifier_nothing():
    env, task, ep = _math_episode(["The answer is 8.", "Yes, correct."])
    assert env.reward(task, ep) == {"solver": 0.0, "verifier": 0.0}
    assert env.verdict_counts(task, ep.final_state) == {"tp": 0, "fn": 0, "tn": 0, "fp": 1}
    # rejecting a right answer, then an unreadable verdict on the wrong revision: 0 of 2 right
    env, task, ep = _math_episode(["The answer is 7.", "No.", "The answer is 2.", "maybe"])
    assert env.reward(task, ep) == {"solver": 0.0, "verifier": 0.0}
    assert env.verdict_counts(task, ep.final_state) == {"tp": 0, "fn": 1, "tn": 0, "fp": 1}


def test_lookup_tables_are_random_per_task_and_splits_disjoint():
    env = LookupEnv(seed=0, n_train=20, n_test=10)
    train, test = env.tasks("train"), env.tasks("test")
    assert len(train) == 20 and len(test) == 10 and not {t.id for t in train} & {t.id for t in test}
    for t in train + test:
        row, col = t.meta["row"], t.meta["column"]
        assert t.input["question"] == f"What is the {col} of {row}?"
        assert str(t.input["table"][row][col]) == t.answer and len(t.input["table"]) == 5
    assert [t.id for t in LookupEnv(seed=0, n_train=20, n_test=10).tasks("train")] == [t.id for t in train]
    assert len({json.dumps(t.input["table"], sort_keys=True) for t in train}) == 20


def test_lookup_caller_retries_until_it_names_a_row_and_the_answerer_sees_the_tool_result():
    env = LookupEnv(seed=0, n_train=4, n_test=2, difficulty=(0.0, 1.0))
    task = env.tasks("train")[0]
    row = task.meta["row"]
    graph = build_lookup(FakeListChatModel(responses=["I do not know.", f"lookup {row.lower()}",
                                                      f"The answer is {task.answer}."]), max_calls=2)
    state = graph.invoke(task.input)
    tool = [e["text"] for e in state["transcript"] if e["agent"] == "tool"]
    cols = task.input["table"][row]
    assert tool == [f"{row}: " + ", ".join(f"{c} {v}" for c, v in cols.items())]
    assert env.tool_calls(state) == (1, 2) and env.reward(task, SimpleNamespace(final_state=state)) == 1.0
    turn = lambda agent, text: SimpleNamespace(agent=agent, response_text=text)  # noqa: E731
    assert not env.turn_is_valid(task, turn("caller", "I do not know."))
    assert env.turn_is_valid(task, turn("caller", f"lookup {row}"))
    # never naming a row: max_calls caller turns, then the answerer without facts
    state = build_lookup(FakeListChatModel(responses=["no", "no", "The answer is 5."]), max_calls=2).invoke(task.input)
    assert env.tool_calls(state) == (0, 2) and state["answer"] == "5"
    assert parse_call("lookup Tolvik or Brena", ["Brena", "Tolvik"]) == "Tolvik"


def test_apps_do_not_import_drmas_graph():
    for path in [*(ROOT / "graphs/verified_math").glob("*.py"), *(ROOT / "graphs/lookup").glob("*.py")]:
        tree = ast.parse(path.read_text())
        mods = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in mods if m.split(".")[0] == "drmas_graph"], path


def test_runner_tiny_end_to_end(tmp_path):
    """The runner with tiny random models: results.json holds every run with the pre-registered keys and
    per-agent metrics, the plots exist, and the summary lines are printed."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/learning/run.py"), "--tiny", "--seeds", "0",
                          "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert sorted((r["app"], r["estimator"], r["seed"]) for r in runs) == [
        ("lookup", "agent", 0), ("lookup", "episode_global", 0),
        ("verified_math", "agent", 0), ("verified_math", "episode_global", 0)]
    for r in runs:
        agents = {"verified_math": {"solver", "verifier"}, "lookup": {"caller", "answerer"}}[r["app"]]
        assert len(r["steps"]) == 2 and [e["step"] for e in r["eval"]] == [0, 1, 2]
        for s in r["steps"]:
            assert set(s["agents"]) == agents
            for m in s["agents"].values():
                assert {"reward", "grad_norm", "adv_sq", "adv_mean", "clip_frac", "kl_start"} <= set(m)
                assert math.isfinite(m["grad_norm"]) and m["calls"] > 0
        rates = {"verified_math": {"verifier_tpr", "verifier_tnr"},
                 "lookup": {"tool_call_rate", "episodes_with_tool_call"}}[r["app"]]
        assert set(r["steps"][0]["rates"]) == rates and set(r["eval"][0]["rates"]) == rates
        assert {"avg@k", "pass@k"} <= set(r["eval"][-1])
    assert (tmp_path / "verified_math.png").stat().st_size > 0 and (tmp_path / "lookup.png").stat().st_size > 0
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("learning study: ")]
    assert [ln.split(":")[1].strip() for ln in lines] == ["verified_math", "lookup"]
    assert all(ln.endswith("(1 seeds)") and " agent vs episode_global final reward " in ln for ln in lines)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rollout"] == {"temperature": 0.6, "top_p": 0.95}  # amendment 1
    # run order: seed, then app, then estimator; each run keeps its own folder
    assert [(r["app"], r["estimator"]) for r in runs] == [
        ("verified_math", "episode_global"), ("verified_math", "agent"), ("lookup", "episode_global"), ("lookup", "agent")]
    assert (tmp_path / "runs/lookup-agent-s0/metrics.jsonl").exists()
    # --resume with every run done runs nothing and keeps results.json as it was
    again = subprocess.run([sys.executable, str(ROOT / "benchmarks/learning/run.py"), "--tiny", "--seeds", "0",
                            "--out", str(tmp_path), "--resume"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "--resume: all 4 runs are in" in again.stdout
    assert json.loads((tmp_path / "results.json").read_text()) == saved


def _fake_run(app: str, estimator: str, seed: int, avg: float, tnr: float, adv_sq: float) -> dict:
    agents = {"verified_math": ("solver", "verifier"), "lookup": ("caller", "answerer")}[app]
    rates = {"eval verifier_tnr": tnr} if app == "verified_math" else {"eval tool_call_rate": tnr}
    step = {"team_reward": avg, "agents": {a: {"reward": avg, "grad_norm": 1.0, "adv_sq": adv_sq} for a in agents}}
    return {"app": app, "estimator": estimator, "seed": seed, "steps": [step] * 4,
            "eval": [{"avg@k": avg, "pass@k": avg, "rates": {k.split(" ", 1)[1]: v for k, v in rates.items()}}]}


def test_hypothesis_verdicts_follow_the_preregistered_rule():
    """d = agent - episode_global per seed; 95% t interval (df = n - 1): supported when it excludes 0 in the
    stated direction, contradicted the other way, otherwise not resolved."""
    sys.path.insert(0, str(ROOT / "benchmarks/learning"))
    import run as study

    runs = []
    for s, d in enumerate([0.10, 0.12, 0.14]):  # math avg@4: d mean 0.12, sd 0.02, t(2) = 4.303: [0.070, 0.170]
        runs.append(_fake_run("verified_math", "episode_global", s, 0.5, 0.3, 1.0))
        runs.append(_fake_run("verified_math", "agent", s, 0.5 + d, 0.3 - d, 1.0))  # TNR falls: H1 contradicted
        runs.append(_fake_run("lookup", "episode_global", s, 0.4, 0.5, 1.0))
        runs.append(_fake_run("lookup", "agent", s, 0.4 + (-1) ** s * 0.1, 0.5, 1.0 - d))  # +-0.1: not resolved
    lines = {ln.split(": d = ")[0].removeprefix("hypothesis: "): ln for ln in study.hypothesis_lines(runs)}
    assert lines["H2 math (final held-out avg@k) [verified_math]"].endswith(
        "d = 0.120 [0.070, 0.170] over 3 pairs: supported")
    assert lines["H1 verifier catches errors (final held-out TNR) [verified_math]"].endswith(
        "d = -0.120 [-0.170, -0.070] over 3 pairs: contradicted")
    assert lines["H3 lookup (final held-out avg@k) [lookup]"].endswith("over 3 pairs: not resolved")
    assert lines["H5 stability: max per-agent E[A^2] [lookup]"].endswith(
        "d = -0.120 [-0.170, -0.070] over 3 pairs: supported")
