"""A config whose optional packages are missing is refused before any model is loaded or any file written, naming
the config key, the package and the extra (DeepSpeed for a deepspeed backend, peft for lora)."""

import sys
from typing import TypedDict

import pytest
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langgraph.graph import END, START, StateGraph

from drmas_graph import Task, train_graph
from drmas_graph.errors import ConfigError

llm = FakeListChatModel(responses=["4"])


class State(TypedDict, total=False):
    question: str
    answer: str


def solve(state: State) -> State:
    return {"answer": llm.invoke(state["question"]).content}


GRAPH = StateGraph(State).add_node("solve", solve).add_edge(START, "solve").add_edge("solve", END).compile()


class Env:
    def tasks(self, split):
        return [Task(id=f"{split}-{i}", input={"question": f"{i} + {i}?"}, answer=str(2 * i)) for i in range(2)]

    def reward(self, task, episode):
        return 0.0


def no_model(*args, **kwargs):
    raise AssertionError("refused before any model is built")


@pytest.mark.parametrize("package, settings, message", [
    ("deepspeed", {"update": {"backend": "deepspeed"}},
     r"update.backend 'deepspeed' needs the deepspeed package: pip install 'drmas-graph\[deepspeed\]'"),
    ("peft", {"update": {"backend": "torch"}, "lora": {"r": 4}},
     r"models.m.lora needs the peft package: pip install 'drmas-graph\[lora\]'"),
])
def test_a_missing_optional_package_is_refused_before_any_model_is_loaded(tmp_path, monkeypatch, package,
                                                                            settings, message):
    from drmas_graph.train.loop import _build

    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    monkeypatch.setattr(_build, "build_policies", no_model)
    model = {"tiny": {"seed": 0}, **({"lora": settings["lora"]} if "lora" in settings else {})}
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        train_graph(GRAPH, Env(), models={"m": model}, agents={"solve": {"model": "m"}}, update=settings["update"],
                    steps=1, tasks_per_step=1, group_size=2, run_dir=str(run_dir))
    assert not run_dir.exists()


def test_an_installed_package_passes_the_check(tmp_path, monkeypatch):
    from drmas_graph.train.loop import _build

    monkeypatch.setattr(_build, "build_policies", no_model)  # the check passed: the next stage runs
    with pytest.raises(AssertionError, match="refused before any model is built"):
        train_graph(GRAPH, Env(), models={"m": {"tiny": {"seed": 0}}}, agents={"solve": {"model": "m"}},
                    update={"backend": "deepspeed"}, steps=1, tasks_per_step=1, group_size=2,
                    run_dir=str(tmp_path / "run"))
