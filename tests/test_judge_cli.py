"""A judged run through the command line: `check` set-up failures leave no folder behind, `eval` of a checkpoint
reads the run's judge cache (no judge call paid twice), and the summary's evaluation columns."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from drmas_graph.cli import main

ROWS = [{"id": "a1", "question": "What is 2 + 3?", "answer": "5"},
        {"id": "a2", "question": "What is 4 + 4?", "answer": "8"}]
RANKING = {"import": "tests._judge_models:ranking_judge"}


def write_config(tmp_path: Path, judge_model: dict, **top) -> Path:
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = {
        "name": "judged", "run_dir": str(tmp_path / "run"), "graph": "tests._graphs:solver_verifier",
        "env": {"tasks": str(tmp_path / "t.jsonl"), "input": {"question": "{question}"}, "answer": "answer",
                "id": "id", "reward": {"judge": {"model": judge_model, "mode": "group",
                                                 "rubric": "The verifier must agree with the reference answer."}}},
        "models": {"tiny": {"tiny": {"seed": 0}}},
        "agents": {"solver": {"model": "tiny", "sampling": {"max_new_tokens": 4}},
                   "verifier": {"model": "tiny", "sampling": {"max_new_tokens": 4}}},
        "update": {"lr": 1e-3, "backend": "torch"}, "steps": 1, "tasks_per_step": 2, "group_size": 2,
        "eval": {"k": 2, "n_tasks": 2, "before_training": False},
        "logging": {"progress": False, "tensorboard": False}, **top,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_check_that_fails_while_setting_up_leaves_no_folder(tmp_path, capsys):
    """The judge's cache folder is made before its model is built: a model that cannot be built used to leave
    run/check/base-g1 empty, and the next check wrote base-g1-2."""
    bad = write_config(tmp_path, {"import": "tests._judge_models:nothing"})
    for _ in range(2):
        assert main(["check", str(bad), "--groups", "1"]) == 2
        assert "judge model import 'tests._judge_models:nothing'" in capsys.readouterr().err
        assert sorted(p.name for p in (tmp_path / "run" / "check").iterdir()) == []
    good = write_config(tmp_path, RANKING)
    assert main(["check", str(good), "--groups", "1"]) in (0, 3)
    assert sorted(p.name for p in (tmp_path / "run" / "check").iterdir()) == ["base-g1"]
    assert (tmp_path / "run" / "check" / "base-g1" / "traces.db").is_file()


def test_the_summary_has_one_column_when_evaluation_ran_once(tmp_path):
    from drmas_graph import TrainResult

    ev = {"step": 2, "split": "test", "k": 2, "solver/reward": 0.5, "avg@k": 0.25, "pass@k": 0.5}
    once = TrainResult(run_dir=tmp_path, evals=[ev], history=[{"step": 0, "reward/team_mean": 0.375}])
    assert once.summary().splitlines() == [
        "evaluation on test           step 1 done",
        "  reward solver                    0.500",
        "  avg@2                            0.250",
        "  pass@2                           0.500",
        "training reward (team)            step 0",
        "                                   0.375",
        f"run folder: {tmp_path}"]
    late = TrainResult(run_dir=tmp_path, evals=[{**ev, "step": 0}, {**ev, "step": 12}], history=[])
    assert late.summary().splitlines()[0] == "evaluation on test                before step 11 done"  # not 'beforestep'
    twice = TrainResult(run_dir=tmp_path, evals=[{**ev, "step": 0, "avg@k": 0.125}, ev],
                        history=[{"step": 0, "reward/team_mean": 0.375}, {"step": 1, "reward/team_mean": 1}])
    assert twice.summary().splitlines()[:6] == [
        "evaluation on test                before step 1 done",
        "  reward solver                    0.500       0.500",
        "  avg@2                            0.125       0.250",
        "  pass@2                           0.500       0.500",
        "training reward (team)            step 0      step 1",
        "                                   0.375       1.000"]


def test_eval_of_a_judged_checkpoint_reads_the_runs_judge_cache(tmp_path, capsys):
    """The run judged its final evaluation; `drmas-graph eval --checkpoint` of that step rolls out the same
    episodes (the step's evaluation seeds) and must find every group in run_dir/judge_cache.db: 0 judge calls
    (it used to open a new cache in its eval folder and pay again)."""
    from drmas_graph.traces.store import TraceStore

    cfg = write_config(tmp_path, RANKING)
    assert main(["train", str(cfg)]) == 0
    run = tmp_path / "run"
    final = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"eval/avg@k"' in x][-1]
    assert final["step"] == 1 and final["eval/judge/calls"] >= 2 and final["eval/judge/cache_hits"] == 0
    assert main(["eval", str(cfg), "--checkpoint", str(run / "checkpoints" / "step_000001")]) == 0
    folder = run / "eval" / "step_000001-test-k2"
    record = json.loads((folder / "eval.json").read_text())
    assert (record["judge/calls"], record["judge/cache_hits"]) == (0, 2)  # 2 tasks: 2 groups, both cached
    assert record["solver/reward"] == final["eval/solver/reward"] == 0.375 and not (folder / "judge_cache.db").exists()
    with TraceStore(folder / "traces.db", readonly=True) as store:
        judged = [store.load_episode(s.id).judgement for s in store.episodes()]
    assert len(judged) == 4 and all(j["cached"] and j["error"] is None for j in judged)
