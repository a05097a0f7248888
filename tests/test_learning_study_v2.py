"""Learning study v2 (benchmarks/learning/PREREG_v2.md): the checked-math app with scripted chat models and
hand-worked rewards (per agent and per call), and the v2 runner end to end on tiny random models."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from langchain_core.language_models.fake_chat_models import FakeListChatModel

from drmas_graph.env import score_episode
from graphs.checked_math.env import VERDICT_PAY, CheckedMathEnv
from graphs.checked_math.graph import build_graph

ROOT = Path(__file__).resolve().parents[1]


def _episode(replies: list[str]):
    """The first training task (4 + 9 = 13, planted ['13', '14']) played by scripted replies; turns as the
    trainer records them (agent and reply per LLM call)."""
    env = CheckedMathEnv(seed=0)
    task = env.tasks("train")[0]
    assert (task.input, task.answer) == ({"question": "What is 4 + 9?", "candidates": ["13", "14"]}, "13")
    state = build_graph(FakeListChatModel(responses=replies)).invoke(task.input)
    agents = ["solver", "checker", "checker", "checker"]
    turns = [SimpleNamespace(agent=a, response_text=t, format_error=None) for a, t in zip(agents, replies)]
    episode = SimpleNamespace(final_state=state, turns=turns, agents=["solver", "checker"], outcome="finished",
                              model_error_turn=None)
    return env, task, episode


def test_checker_judges_the_solvers_answer_then_the_planted_ones_and_is_paid_per_verdict():
    # solver wrong (12); checker: rejects 12 (right), approves 13 (right), approves 14 (wrong)
    env, task, ep = _episode(["The answer is 12.", "No, it is 13.", "Yes", "Yes."])
    assert [(j["answer"], j["from"], j["approved"]) for j in ep.final_state["judged"]] == [
        ("12", "solver", False), ("13", "candidate", True), ("14", "candidate", True)]
    assert env.reward(task, ep) == {"solver": 0.0, "checker": pytest.approx(2 / 3)}
    assert env.turn_rewards(task, ep) == {1: VERDICT_PAY, 2: VERDICT_PAY, 3: 0.0}
    assert env.verdict_counts(task, ep.final_state) == {"tp": 1, "fn": 0, "tn": 1, "fp": 1}
    assert not env.is_success(task, ep)
    # through the trainer's scoring: R_i per call; solver 0, checker 1/3, 1/3, 0
    score = score_episode(env, task, ep, invalid_penalty=env.invalid_penalty)
    assert score.turn_rewards == pytest.approx([0.0, 1 / 3, 1 / 3, 0.0])


def test_unreadable_verdicts_and_a_missing_answer_cost_the_penalty():
    # solver gives no number (invalid; answer None, so rejecting it is right); checker: rejects None (right),
    # "maybe" on 13 (unreadable: wrong and invalid), rejects 14 (right)
    env, task, ep = _episode(["thirteen", "No", "maybe", "No"])
    assert ep.final_state["answer"] is None
    assert env.turn_rewards(task, ep) == {1: VERDICT_PAY, 2: 0.0, 3: VERDICT_PAY}
    assert env.verdict_counts(task, ep.final_state) == {"tp": 0, "fn": 1, "tn": 2, "fp": 0}
    # R_i: solver 0 - 0.1; checker 1/3, 0 - 0.1, 1/3
    assert score_episode(env, task, ep, invalid_penalty=0.1).turn_rewards == pytest.approx(
        [-0.1, 1 / 3, -0.1, 1 / 3])
    env, task, ep = _episode(["The answer is 13.", "Yes", "Yes", "No"])  # all right: 1 + 3 x 1/3
    assert score_episode(env, task, ep, invalid_penalty=0.1).turn_rewards == pytest.approx([1.0, 1 / 3, 1 / 3, 1 / 3])
    assert env.reward(task, ep) == {"solver": 1.0, "checker": pytest.approx(1.0)} and env.is_success(task, ep)


def test_tasks_are_seeded_disjoint_and_plant_one_right_and_one_wrong_answer():
    env = CheckedMathEnv(seed=0)
    train, test = env.tasks("train"), env.tasks("test")
    assert (len(train), len(test)) == (80, 48) and not {t.id for t in train} & {t.id for t in test}
    for t in train + test:
        assert sorted(t.input["candidates"], key=lambda c: c != t.answer)[0] == t.answer
        wrong = [c for c in t.input["candidates"] if c != t.answer]
        assert len(wrong) == 1 and int(wrong[0]) - int(t.answer) in (-10, -2, -1, 1, 2, 10) and int(wrong[0]) >= 0
    assert [t.input for t in CheckedMathEnv(seed=0).tasks("test")] == [t.input for t in test]
    assert sum(t.input["candidates"][0] == t.answer for t in train + test) not in (0, 128)  # order shuffled


def test_checked_math_does_not_import_drmas_graph():
    for path in (ROOT / "graphs/checked_math").glob("*.py"):
        tree = ast.parse(path.read_text())
        mods = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in mods if m.split(".")[0] == "drmas_graph"], path


def test_v2_runner_tiny_end_to_end(tmp_path):
    """`run.py --v2 --tiny`: both arms of seed 0 recorded with the library's per-agent metrics, the manipulation
    check and the verdict lines printed; a second call without --resume refuses to overwrite."""
    cmd = [sys.executable, str(ROOT / "benchmarks/learning/run.py"), "--v2", "--tiny", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    saved = json.loads((tmp_path / "results_v2.json").read_text())
    assert [(r["estimator"], r["seed"]) for r in saved["runs"]] == [("step_global", 0), ("agent", 0)]
    assert saved["update"]["kl_start_metric"] is True and saved["update"]["kl_coef"] == 0.0
    for r in saved["runs"]:
        assert [e["step"] for e in r["eval"]] == [0, 1] and len(r["steps"]) == 1
        for a in ("solver", "checker"):
            m = r["steps"][0]["agents"][a]
            assert {"grad_norm", "adv_sq", "kl_start", "reward", "calls"} <= set(m)
            assert m["kl_start"] == m["kl_start"]  # logged (not NaN)
            # a step whose advantages are all 0 (the tiny models' rewards do not vary) takes no optimizer step:
            # no gradient norm was measured, so none is logged (issue 58; it was a step's 0.0)
            assert m["grad_norm"] == m["grad_norm"] or m["adv_sq"] == 0.0
        assert r["steps"][0]["agents"]["checker"]["calls"] == 3 * r["steps"][0]["agents"]["solver"]["calls"]
    assert "manipulation check v2: solver E[A^2] over the first 4 steps under step_global" in out.stdout
    assert sum(ln.startswith("hypothesis v2: ") for ln in out.stdout.splitlines()) == 7
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert again.returncode != 0 and "pass --resume" in again.stderr


def _fake_run(estimator: str, seed: int, bal: float, solver_sq: list[float], norms: list[tuple[float, float]]) -> dict:
    steps = [{"team_reward": 0.5, "grad_norm": s + c,
              "agents": {"solver": {"reward": 0.5, "adv_sq": q, "grad_norm": s, "kl_start": 0.01},
                         "checker": {"reward": 0.4, "adv_sq": 0.5 if c > 0 else 0.0, "grad_norm": c, "kl_start": 0.02}}}
             for q, (s, c) in zip(solver_sq, norms)]
    rates = {"checker_tpr": bal, "checker_tnr": bal, "checker_balanced_accuracy": bal}
    return {"estimator": estimator, "seed": seed, "steps": steps,
            "eval": [{"avg@k": 0.2, "pass@k": 0.4, "rates": rates}, {"avg@k": 0.5, "pass@k": 0.6, "rates": rates}]}


def test_v2_statistics_on_hand_worked_runs():
    sys.path.insert(0, str(ROOT / "benchmarks/learning"))
    import v2

    # solver E[A^2] over the first 4 steps: (2 + 3 + 1 + 2) / 4 = 2.0 (the 5th step is not counted)
    norms = [(1.0, 2.0), (1.0, 2.0), (4.0, 0.0), (1.0, 0.0), (1.0, 0.5)]
    run = _fake_run("step_global", 0, 0.5, [2.0, 3.0, 1.0, 2.0, 9.0], norms)
    assert v2.manipulation(run) == 2.0
    # solver norms 1, 1, 4, 1, 1: median 1, one spike (4 > 3). Checker: only steps with a gradient (E[A^2] > 0)
    # count: 2, 2, 0.5, median 2, no spike (counting its two zero steps the median would be 0.5 and both 2s spikes)
    assert (v2.spikes(run, "solver"), v2.spikes(run, "checker")) == (1, 0)
    # solver share over steps where both have a gradient: 1/3, 1/3, 1/1.5 -> 4/9
    assert v2.solver_share(run) == pytest.approx(4 / 9)
    runs = []
    for s, d in enumerate([0.10, 0.12, 0.14]):  # balanced accuracy d: mean 0.12, sd 0.02, t(2) 4.303: [0.070, 0.170]
        runs.append(_fake_run("step_global", s, 0.5, [2.0] * 4, norms[:4]))
        runs.append(_fake_run("agent", s, 0.5 + d, [0.9] * 4, norms[:4]))
    lines = v2.hypothesis_lines(runs)
    assert lines[0] == ("hypothesis v2: P1 checker judges better (final held-out balanced accuracy): "
                        "d = 0.120 [0.070, 0.170] over 3 pairs: supported")
    assert lines[1].endswith("d = 0.000 [0.000, 0.000] over 3 pairs: not resolved")
    assert v2.manipulation_line(runs).endswith("= 2.000 [2.000, 2.000] over 3 runs (threshold 1.5): holds")


def test_v2_runs_table_and_plot(tmp_path):
    """--report's per-run table: one row per run, seed by seed, step_global before agent, with the run's own
    numbers; the plot is written as a PNG."""
    sys.path.insert(0, str(ROOT / "benchmarks/learning"))
    import v2

    norms = [(1.0, 2.0), (1.0, 2.0), (4.0, 0.0), (1.0, 0.0)]
    runs = [_fake_run("agent", 1, 0.6, [0.9] * 4, norms), _fake_run("step_global", 1, 0.5, [2.0] * 4, norms),
            _fake_run("agent", 0, 0.7, [1.0, 2.0, 3.0, 4.0], norms)]
    for r, wall in zip(runs, (300.0, 330.0, 360.0)):
        r["wall_s"] = wall
        for step, e in zip((0, 4), r["eval"]):
            e["step"] = step
            e["rates"] = {**e["rates"], "solver_format_rate": 0.75, "solver_accuracy_parsed": 0.5}
    rows = v2.runs_markdown(runs).splitlines()
    assert len(rows) == 2 + 3
    assert rows[2] == ("| `agent` | 0 | 6.0 min | 0.200 -> 0.500 | 0.400 -> 0.600 | 0.700 -> 0.700 (0.700 / 0.700) "
                       "| 0.750, 0.500 | 2.500 | 1 | 4.00 |")
    assert rows[3].startswith("| `step_global` | 1 | 5.5 min |") and rows[4].startswith("| `agent` | 1 | 5.0 min |")
    path = v2.plots(runs, tmp_path)
    assert path == tmp_path / "checked_math.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_v2_solver_by_step_on_hand_worked_runs():
    """--report's step table: per training step the mean over an arm's runs of the solver's format rate, accuracy
    among parsable answers, accuracy over all answers (their product: an unparsable answer is wrong) and E[A^2],
    and E[A^2] averaged over the steps so far."""
    sys.path.insert(0, str(ROOT / "benchmarks/learning"))
    import v2

    def run(estimator, steps):  # steps: (format, accuracy among parsable, E[A^2]) per step
        return {"estimator": estimator, "steps": [
            {"rates": {"solver_format_rate": f, "solver_accuracy_parsed": a}, "agents": {"solver": {"adv_sq": q}}}
            for f, a, q in steps]}

    runs = [run("agent", [(0.25, 0.5, 0.8), (1.0, 0.5, 0.2)]), run("agent", [(0.75, 1.0, 0.6), (1.0, 0.75, 0.0)]),
            run("step_global", [(0.5, 0.5, 2.0), (1.0, 1.0, 1.0), (1.0, 1.0, 1.0)])]
    rows = v2.solver_by_step(runs, "agent")
    # step 0: format (0.25 + 0.75) / 2 = 0.5; accuracy among parsable (0.5 + 1.0) / 2 = 0.75; over all
    # (0.125 + 0.75) / 2 = 0.4375 (not 0.5 x 0.75); E[A^2] (0.8 + 0.6) / 2 = 0.7, so far the same
    assert rows[0] == pytest.approx({"format": 0.5, "accuracy among parsable": 0.75, "accuracy over all": 0.4375,
                                     "E[A^2]": 0.7, "E[A^2] so far": 0.7})
    # step 1: E[A^2] (0.2 + 0.0) / 2 = 0.1; so far: run 1 (0.8 + 0.2) / 2 = 0.5, run 2 (0.6 + 0) / 2 = 0.3 -> 0.4
    assert rows[1] == pytest.approx({"format": 1.0, "accuracy among parsable": 0.625, "accuracy over all": 0.625,
                                     "E[A^2]": 0.1, "E[A^2] so far": 0.4})
    assert len(v2.solver_by_step(runs, "step_global")) == 3
    table = v2.solver_steps_markdown(runs, ["step_global", "agent", "episode_global"]).splitlines()
    assert len(table) == 2 + 2  # two steps: the shortest arm's; episode_global has no run and no column
    assert table[2] == "| 0 | 0.500, 0.500 / 0.250, 2.000 (2.000) | 0.500, 0.750 / 0.438, 0.700 (0.700) |"
    for r, norms in zip(runs, ([0.5, 1.5], [1.0, 2.0], [3.0, 3.0, 0.9])):  # above 1.0: 1 + 1 of 4; 2 of 3
        for step, norm in zip(r["steps"], norms):
            step["grad_norm"] = norm
    assert v2.clipped_line(runs, ["step_global", "agent", "episode_global"]) == (
        "steps with a mean pre-clip model gradient norm above grad_clip 1.0: step_global 2 of 3, agent 2 of 4")
