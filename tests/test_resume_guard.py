"""resume=true on a run folder without a checkpoint is an error before anything is written (it used to start at
step 0 and append to the old traces.db); periodic checkpoints are the default."""

import errno
import shutil
from typing import TypedDict

import pytest
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langgraph.graph import END, START, StateGraph

from drmas_graph import SamplingParams, Task, train_graph
from drmas_graph.config import TrainConfig
from drmas_graph.testing import tiny_policy
from drmas_graph.train import CheckpointSpaceError, NothingToResumeError

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


def _run_with_a_failing_second_checkpoint(tmp_path, monkeypatch, error, free):
    """Two steps with a checkpoint after each; checkpoint 2's write leaves a partial file and raises `error`
    while the disk reports `free` bytes."""
    from drmas_graph.train.loop import _checkpoints

    real, calls = _checkpoints.on_model_thread, []

    def save(model, fn):
        calls.append(fn)
        if len(calls) == 2:
            folder = fn.args[0]
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "model.safetensors").write_bytes(b"\0" * 4096)  # what got written before the disk filled
            usage = shutil.disk_usage
            monkeypatch.setattr(_checkpoints.shutil, "disk_usage", lambda path: usage(path)._replace(free=free))
            raise error
        return real(model, fn)

    monkeypatch.setattr(_checkpoints, "on_model_thread", save)
    graph = StateGraph(State).add_node("solve", solve).add_edge(START, "solve").add_edge("solve", END).compile()
    train_graph(graph, Env(), policies={"solve": tiny_policy(sampling=SamplingParams(max_new_tokens=2))},
                steps=2, tasks_per_step=1, group_size=2, run_dir=str(tmp_path / "run"), checkpoint_every=1,
                update={"backend": "torch"}, eval={"k": 1, "before_training": False},
                logging={"tensorboard": False, "progress": False})


def test_a_full_disk_at_a_checkpoint_says_so_removes_the_partial_one_and_keeps_the_last_whole_one(tmp_path, monkeypatch):
    full = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4096 vs 8192")  # torch.save's
    with pytest.raises(CheckpointSpaceError) as info:
        _run_with_a_failing_second_checkpoint(tmp_path, monkeypatch, full, free=2**20)
    message = str(info.value)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert message.startswith(f"checkpoint step_000002 could not be written: the disk of {checkpoints} is full "
                              "(1.0 MiB free; the 0.0 MiB of it written so far are removed). The latest whole "
                              "checkpoint, step_000001 (")
    assert "is intact: --resume continues from it. Free disk space, or keep fewer checkpoints" in message
    assert info.value.__cause__ is full
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001"]  # the partial one removed
    assert (checkpoints / "step_000001" / "trainer_state.json").is_file()


def test_a_failed_checkpoint_with_room_on_the_disk_raises_its_own_error(tmp_path, monkeypatch):
    other = RuntimeError("something else went wrong")
    with pytest.raises(RuntimeError) as info:
        _run_with_a_failing_second_checkpoint(tmp_path, monkeypatch, other, free=10 * 2**30)
    assert info.value is other


def test_enospc_is_a_full_disk_whatever_the_free_space_says(tmp_path, monkeypatch):
    with pytest.raises(CheckpointSpaceError, match="step_000002 could not be written: the disk .* is full"):
        _run_with_a_failing_second_checkpoint(tmp_path, monkeypatch, OSError(errno.ENOSPC, "No space left on device"),
                                              free=10 * 2**30)
