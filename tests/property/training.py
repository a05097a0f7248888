"""Generated training runs (issue 48): what the app suite (`apps.py`) does not reach, because it lives in the
trainer, drawn by Hypothesis and checked by `test_generated_training.py`.

A `TrainRun` is a small real training run: a two-agent chain (solver -> verifier, tiny sampling models) or a
tool-calling agent (`bind_tools` + `ToolNode`, scripted on Mistral's chat template, which renders tool-call
ids), a train split whose task ids are adversarial (':', '#', '/', spaces, unicode, blank-looking, equal to a
group id's prefix; unique in the split, as the trainer requires) and a step that may hold a task more than once
(`tasks_per_step` above the split's size: the task order wraps inside the step), an evaluation (at the end) rewarded without a judge,
unjudged (every episode a `JudgeError`) or empty (a split with no task), and a synchronous, one-step-off or
free-running schedule with one to three mini-batches per step. Rewards are per agent: the solver's (and the
tool agent's) alternate inside each group, the verifier's are constant, so its advantages are all 0 and
nothing of its update is measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from langchain_core.messages import HumanMessage

from drmas_graph import SamplingParams, Task
from drmas_graph.config import TrainConfig
from drmas_graph.errors import JudgeError
from drmas_graph.testing import scripted_policy, tiny_policy
from tests.property.scratch import fresh_dir

__all__ = ["TASK_IDS", "EVALS", "SCHEDULES", "TrainRun", "train_runs", "config", "GenEnv", "graph_and_policies"]

TASK_IDS = (":", "a:b", "#2", "train:0", "train:0#2:x", "eval", "eval:0:", "x/y/z", "with space", " ",
            "\u200b", "ünï ✓ 猫", "a", "-")
"""Adversarial task ids: group-id separators, another phase's prefix, a path, blank-looking, unicode."""
EVALS = ("plain", "unjudged", "empty")
SCHEDULES = ("sync", "one_step_off", "free")


@dataclass(frozen=True)
class TrainRun:
    app: str
    """'chain' (solver -> verifier) or 'tools' (a tool-calling agent)."""
    ids: tuple[str, ...]
    """The train split's task ids."""
    tasks_per_step: int
    """Up to twice the split's size: a step may hold a task twice."""
    steps: int
    group_size: int
    eval: str
    """One of EVALS."""
    schedule: str
    """One of SCHEDULES."""
    n_minibatches: int

    @property
    def agents(self) -> tuple[str, ...]:
        return ("solver", "verifier") if self.app == "chain" else ("agent",)

    @property
    def turns(self) -> int:
        """LLM calls per episode: solver + verifier; the tool agent's call, then its answer after the result."""
        return 2


@st.composite
def train_runs(draw: Any) -> TrainRun:
    ids = draw(st.lists(st.sampled_from(TASK_IDS), min_size=1, max_size=3, unique=True))
    return TrainRun(draw(st.sampled_from(("chain", "tools"))), tuple(ids),
                    draw(st.integers(1, min(2 * len(ids), 4))), draw(st.integers(1, 2)),
                    draw(st.integers(2, 3)), draw(st.sampled_from(EVALS)), draw(st.sampled_from(SCHEDULES)),
                    draw(st.integers(1, 3)))


class GenEnv:
    """The run's tasks and rewards (see the module docstring); the 'test' split is the evaluation's."""

    def __init__(self, run: TrainRun) -> None:
        self.run = run

    def tasks(self, split: str) -> list[Task]:
        ids = self.run.ids if split == "train" else (() if self.run.eval == "empty" else ("e0", "e:1"))
        return [Task(id=i, input=_input(self.run.app, f"{split} {k}")) for k, i in enumerate(ids)]

    def reward_group(self, task: Task, episodes: list) -> list:
        if episodes[0].metadata.get("phase") == "eval" and self.run.eval == "unjudged":
            return [JudgeError(f"judge gave no usable score for task {task.id!r}") for _ in episodes]
        if self.run.app == "tools":
            return [float(j % 2) for j in range(len(episodes))]
        return [{"solver": float(j % 2), "verifier": 1.0} for j in range(len(episodes))]


def _input(app: str, question: str) -> dict:
    return {"question": question} if app == "chain" else {"messages": [HumanMessage(f"What is 1 + 2? ({question})")]}


def config(run: TrainRun) -> TrainConfig:
    schedule = {"sync": {}, "one_step_off": {"async": {"max_staleness": 1}},
                "free": {"async": {"max_staleness": 2, "schedule": "free"}}}[run.schedule]
    return TrainConfig.model_validate({
        "run_dir": str(fresh_dir("train-") / "run"), "steps": run.steps,
        "tasks_per_step": run.tasks_per_step, "group_size": run.group_size, "strict": True, "eval": {"k": 2, "before_training": False},
        "update": {"lr": 1e-3, "backend": "torch", "n_minibatches": run.n_minibatches},
        "logging": {"progress": False, "tensorboard": False}, **schedule})


def graph_and_policies(run: TrainRun) -> tuple[Any, dict[str, Any]]:
    """The compiled app and its policies (fresh models for each run)."""
    if run.app == "chain":
        from tests._graphs import solver_verifier
        from tests.test_instrument import Unreachable

        policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=4))
        return solver_verifier(Unreachable()).compile(), {"solver": policy, "verifier": policy}
    from tests.test_tool_call_ids import MISTRAL_TEMPLATE, replies, tool_agent

    return tool_agent(), {"agent": scripted_policy(replies, chat_template=MISTRAL_TEMPLATE)}
