"""Property-based training runs (issue 48): generated runs (`training.py`) keep the trainer's guarantees.

Each drawn run trains for real (tiny models, CPU) and must: write one metrics line per step with every
episode trained on; store each step's episodes in groups whose ids are unique, name their task id and
position exactly, and hold `group_size` episodes each, whatever characters the task ids hold and however
often a task repeats in a step; give every call to the right agent (the tool agent: a call, then its answer
after a tool result whose call id the template rendered); take exactly `n_minibatches` optimizer steps per
update (or skip one whose advantages are all 0: `skipped_minibatches`); log no update metric for an agent
nothing was measured for (the verifier: all advantages 0) and no avg@k / pass@k for an evaluation that judged
nothing. Profiles: tests/conftest.py ('ci': 4 runs).
"""

import json
import re
from collections import Counter

import pytest
from hypothesis import given, note, settings

from drmas_graph import TraceStore
from drmas_graph.train.loop.trainer import Trainer
from tests.property.training import TrainRun, GenEnv, config, graph_and_policies, train_runs

pytestmark = [pytest.mark.property]
MEASURED = ("pg_loss", "clip_frac", "dual_clip_frac", "approx_kl", "ratio_max")
"""Update metrics that exist only where an agent's samples were forwarded."""


@settings(max_examples=max(3, settings().max_examples // 10))  # ci: 4 runs (~10 s each); long: 300
@given(run=train_runs())
def test_generated_training_runs_keep_counts_groups_agents_and_absent_metrics(run):
    note(f"run: {run!r}")
    cfg = config(run)
    graph, policies = graph_and_policies(run)
    trainer = Trainer(graph, GenEnv(run), cfg, policies=policies)
    try:
        batches = {s: [t.id for t in trainer.batch_tasks(s)] for s in range(run.steps)}
        result = trainer.run()
    finally:
        trainer.close()
        for policy in {id(p): p for p in policies.values()}.values():
            policy.close()
    per_step = run.tasks_per_step * run.group_size
    assert [r["step"] for r in result.history] == list(range(run.steps)), f"steps logged: {result.history}"
    for record in result.history:
        assert record["episodes"] == per_step and record["failed_episodes"] == 0, (
            f"step {record['step']}: {record['episodes']} episodes trained, {record['failed_episodes']} failed; "
            f"want {per_step}, 0\n{run!r}")
        check_update_metrics(run, record)
    with TraceStore(cfg.run_dir + "/traces.db") as store:
        for step, ids in batches.items():
            check_groups(run, store, step, ids)
    check_evaluation(run, result, cfg.run_dir)


def check_update_metrics(run: TrainRun, record: dict) -> None:
    (model,) = {k.split("/")[1] for k in record if k.startswith("model/") and k.endswith("/n_minibatches")}
    steps, skipped = record[f"model/{model}/n_minibatches"], record[f"model/{model}/skipped_minibatches"]
    assert steps + skipped == run.n_minibatches, (  # a mini-batch whose advantages are all 0 takes no step
        f"step {record['step']}: {steps} optimizer steps and {skipped} skipped, want {run.n_minibatches} in all"
        f"\n{run!r}")
    trained = "solver" if run.app == "chain" else "agent"
    missing = [k for k in MEASURED if f"agent/{trained}/{k}" not in record]
    assert not missing, f"step {record['step']}: {trained} has rewards that vary, yet no {missing}\n{run!r}"
    if run.app == "chain":
        assert record["agent/verifier/n_samples"] == per_step_samples(run), f"verifier samples\n{run!r}"
        logged = [k for k in MEASURED if f"agent/verifier/{k}" in record]
        assert not logged, (f"step {record['step']}: every verifier advantage is 0 (nothing forwarded), yet "
                            f"{logged} logged: {[record[f'agent/verifier/{k}'] for k in logged]}\n{run!r}")


def per_step_samples(run: TrainRun) -> float:
    return float(run.tasks_per_step * run.group_size)


def check_groups(run: TrainRun, store: TraceStore, step: int, ids: list[str]) -> None:
    """The step's episodes: one group per task position ('train:<step>[#k]:<task id>'), group_size each."""
    episodes = [e for e in store.episodes(step=step) if (e.group_id or "").startswith("train:")]
    want = []
    for k, task in enumerate(ids):
        occurrence = ids[:k + 1].count(task)
        want.append(f"train:{step}{f'#{occurrence}' if occurrence > 1 else ''}:{task}")
    got = Counter(e.group_id for e in episodes)
    assert got == Counter({g: run.group_size for g in want}), (
        f"step {step}: groups {dict(got)}, want {want} x {run.group_size}\n{run!r}")
    assert len(set(want)) == len(want), f"step {step}: group ids collide: {want}\n{run!r}"
    assert Counter(e.task_id for e in episodes) == Counter({t: run.group_size * ids.count(t) for t in ids}), (
        f"step {step}: task ids stored {Counter(e.task_id for e in episodes)}\n{run!r}")
    for summary in episodes:
        episode = store.load_episode(summary.id)
        assert [t.agent for t in episode.turns] == (
            ["solver", "verifier"] if run.app == "chain" else ["agent", "agent"]), (
            f"episode {summary.id} of {summary.group_id}: turns by {[t.agent for t in episode.turns]}\n{run!r}")
        if run.app == "tools":
            messages = episode.final_state["messages"]
            call_id = messages[1]["tool_calls"][0]["id"] if isinstance(messages[1], dict) else \
                messages[1].tool_calls[0]["id"]
            assert re.fullmatch(r"[0-9A-Za-z]{9}", call_id), f"tool call id {call_id!r}\n{run!r}"


def check_evaluation(run: TrainRun, result, run_dir: str) -> None:
    (record,) = result.evals
    lines = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    logged = [line for line in lines if any(k.startswith("eval/") for k in line)]
    assert len(logged) == 1, f"{len(logged)} evaluation lines in metrics.jsonl\n{run!r}"
    summary = result.summary().splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in summary if line.strip().startswith(("avg@2", "pass@2"))}
    if run.eval == "plain":
        for key in ("avg@k", "pass@k"):
            assert 0.0 <= record[key] <= 1.0, f"evaluation {key} = {record.get(key)!r}\n{run!r}"
        assert rows == {"avg@2": [f"{record['avg@k']:.3f}"], "pass@2": [f"{record['pass@k']:.3f}"]}, (
            f"summary rows {rows}\n{run!r}")
        return
    unjudged = 4 if run.eval == "unjudged" else 0  # 2 tasks x k=2, every one a JudgeError; an empty split: none
    assert record.get("unjudged_episodes", 0) == unjudged, f"evaluation record {record}\n{run!r}"
    assert rows == {"avg@2": ["-"], "pass@2": ["-"]}, f"summary rows where nothing was measured: {rows}\n{run!r}"
    values = {k: record.get(k) for k in ("avg@k", "pass@k")} | {
        k: v for k, v in logged[0].items() if k.startswith(("eval/avg@", "eval/pass@"))}
    numbers = {k: v for k, v in values.items() if isinstance(v, (int, float)) and v == v}
    assert not numbers, (f"an evaluation that measured nothing ({run.eval}) logs {numbers}\n{run!r}")
