"""resume=true on a run folder without a checkpoint is an error before anything is written (it used to start at
step 0 and append to the old traces.db); periodic checkpoints are the default."""

from typing import TypedDict

import pytest
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langgraph.graph import END, START, StateGraph

from drmas_graph import SamplingParams, Task, train_graph
from drmas_graph.config import TrainConfig
from drmas_graph.testing import tiny_policy
from drmas_graph.train import NothingToResumeError

llm = FakeListChatModel(responses=["4"])


class State(TypedDict, total=False):
    question: str
    answer: str


def solve(state: State) -> State:
    return {"answer": llm.invoke(state["question"]).content}


class Env:
    def tasks(self, split):
        return [Task(id=f"{split}-{i}", input={"question": f"{i} + {i}?"}, answer=str(2 * i)) for i in range(2)]

    def reward(self, task, episode):
        return 0.0


@pytest.mark.parametrize("earlier_run", [False, True])
def test_resume_without_a_checkpoint_is_refused_before_anything_is_written(tmp_path, earlier_run):
    run_dir = tmp_path / "run"
    if earlier_run:  # a run that crashed before its first checkpoint
        run_dir.mkdir()
        (run_dir / "traces.db").write_bytes(b"")
    graph = StateGraph(State).add_node("solve", solve).add_edge(START, "solve").add_edge("solve", END).compile()
    with pytest.raises(NothingToResumeError, match="holds no checkpoint"):
        train_graph(graph, Env(), policies={"solve": tiny_policy(sampling=SamplingParams(max_new_tokens=2))},
                    steps=1, tasks_per_step=1, group_size=2, run_dir=str(run_dir), resume=True,
                    update={"backend": "torch"}, eval={"k": 1, "before_training": False},
                    logging={"tensorboard": False, "progress": False})
    if earlier_run:
        assert [p.name for p in run_dir.iterdir()] == ["traces.db"] and (run_dir / "traces.db").read_bytes() == b""
    else:
        assert not run_dir.exists()


def test_checkpoints_are_periodic_by_default():
    cfg = TrainConfig()
    assert cfg.checkpoint_every == 25 and cfg.keep_checkpoints == 2
