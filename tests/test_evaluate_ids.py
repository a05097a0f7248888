"""evaluate() counts avg@k and pass@k per task id, so a split with one id twice is refused, naming it (rev5_i)."""

from types import SimpleNamespace

import pytest

from drmas_graph import Task
from drmas_graph.errors import ConfigError
from drmas_graph.train.loop.evaluate import evaluate


class Env:
    def tasks(self, split):
        return [Task(id="q", input={"question": "1 + 1?"}, answer="2"),
                Task(id="r", input={"question": "2 + 2?"}, answer="4"),
                Task(id="q", input={"question": "1 + 1?"}, answer="2")]


def test_a_split_with_a_repeated_task_id_is_refused_before_any_rollout():
    def no_rollouts(*args, **kwargs):
        raise AssertionError("refused before any rollout")

    state = SimpleNamespace(cfg=SimpleNamespace(eval=SimpleNamespace(split="test", n_tasks=None)), env=Env(),
                            roll_out=no_rollouts)
    with pytest.raises(ConfigError, match=r"task id 'q' more than once \(again at position 2\)"):
        evaluate(SimpleNamespace(state=state), step=0)  # a trainer: its run state


def _solver_graph():
    from typing import TypedDict

    from langchain_core.language_models.fake_chat_models import FakeListChatModel
    from langgraph.graph import END, START, StateGraph

    llm = FakeListChatModel(responses=["4"])

    class State(TypedDict, total=False):
        question: str
        answer: str

    def solve(state: State) -> State:
        return {"answer": llm.invoke(f"Answer with a number. {state['question']}").content}

    return StateGraph(State).add_node("solver", solve).add_edge(START, "solver").add_edge("solver", END).compile()


class JudgeDownEnv:
    """Rewards from a judge that is down during evaluation (every eval episode a JudgeError); `n` tasks a split."""

    def __init__(self, n: int = 3):
        self.n = n

    def tasks(self, split):
        return [Task(id=f"{split}-{i}", input={"question": f"{i} + {i}?"}) for i in range(self.n if split == "test"
                                                                                         else 3)]

    def reward_group(self, task, episodes):
        from drmas_graph.errors import JudgeError

        if episodes[0].metadata.get("phase") == "eval":
            return [JudgeError("judge gave no usable score (timeout)") for _ in episodes]
        return [float(j % 2) for j in range(len(episodes))]


@pytest.mark.parametrize("n_test", [3, 0])
def test_an_evaluation_that_measured_nothing_logs_no_avg_or_pass_at_k(tmp_path, n_test):
    """rev6_e: the judge scored no evaluation episode (or the split is empty): avg@k and pass@k are absent from
    the record, metrics.jsonl and the summary ('-'), not 0.0."""
    import json

    from drmas_graph import SamplingParams, train_graph
    from drmas_graph.testing import tiny_policy
    result = train_graph(_solver_graph(), JudgeDownEnv(n_test), steps=1, tasks_per_step=1, group_size=2,
                         policies={"solver": tiny_policy(sampling=SamplingParams(max_new_tokens=3))},
                         run_dir=str(tmp_path / "run"), update={"backend": "torch"},
                         eval={"k": 2, "before_training": False}, logging={"tensorboard": False, "progress": False})
    record = result.evals[-1]
    assert "avg@k" not in record and "pass@k" not in record
    assert (record["tasks"], record["unjudged_episodes"]) == (n_test, 2 * n_test)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    eval_line = next(r for r in lines if "eval/tasks" in r)
    assert "eval/avg@k" not in eval_line and "eval/pass@k" not in eval_line
    summary = result.summary().splitlines()
    assert [ln.split() for ln in summary if ln.strip().startswith(("avg@2", "pass@2"))] == [["avg@2", "-"],
                                                                                           ["pass@2", "-"]]


def test_eval_n_tasks_below_one_is_refused_naming_the_key():
    """rev6_e: eval.n_tasks -1 silently dropped the split's last task (tasks[:-1]), 0 evaluated nothing."""
    from drmas_graph.config import merge_overrides

    for bad in (0, -1):
        with pytest.raises(ConfigError) as err:
            merge_overrides(None, {"eval": {"n_tasks": bad}})
        assert str(err.value) == ("train_graph() arguments: invalid training config\n"
                                  "  eval.n_tasks: Input should be greater than or equal to 1")
    assert merge_overrides(None, {"eval": {"n_tasks": 1}}).eval.n_tasks == 1
