"""One `module:attr` importer (`drmas_graph._importing.import_spec`): the current folder is importable, like
`python -m`, for every setting that names an object (`--graph`, a config's `graph`/`env`, `--reward`,
`--judge`, `env.reward.python`, a judge model's `import`), and a bad spec names the setting, the spec and
the fix."""

from __future__ import annotations

import json
import os
import sys
import uuid
from types import SimpleNamespace

import pytest

from drmas_graph._importing import import_spec
from drmas_graph.errors import ConfigError

PROJECT = '''
from langchain_core.language_models.fake_chat_models import FakeListChatModel

SEEN = {}


def make_graph(llm):
    SEEN["llm"] = llm
    return "the graph"


class Env:
    def __init__(self, n=0):
        self.n = n


def reward(task, episode):
    return 0.5 if task.answer == "4" else 0.0


def judge_model():
    return FakeListChatModel(responses=["ok"])


class Judge:
    def reward_group(self, task, episodes):
        return [1.0 for _ in episodes]

    def tasks(self, split):
        return ["t-" + split]


class Nested:
    class Inner:
        value = 7
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A module `project_<hex>.py` in a fresh folder that is the current folder and not yet on sys.path; its
    name (unique per test, so no earlier import is reused). sys.path and sys.modules are restored after."""
    name = f"project_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PROJECT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield name
    sys.modules.pop(name, None)


def test_the_current_folder_is_importable_like_python_m(project, tmp_path):
    assert str(tmp_path) not in sys.path
    assert import_spec(f"{project}:Nested.Inner.value", setting="--graph") == 7
    assert sys.path[0] == os.getcwd() == str(tmp_path)
    import_spec(f"{project}:reward", setting="--reward")
    assert sys.path.count(str(tmp_path)) == 1  # put there once


def test_a_bad_spec_names_the_setting_the_spec_and_the_fix(project, tmp_path):
    with pytest.raises(ConfigError) as err:
        import_spec(project, setting="--graph")
    assert str(err.value) == (f"--graph {project!r} must look like 'package.module:attribute' (a module path, a "
                              "colon, the name of an object in it)")
    with pytest.raises(ConfigError) as err:
        import_spec("no_such_project_xyz.sub:f", setting="env")
    assert str(err.value) == (f"env 'no_such_project_xyz.sub:f': no module named 'no_such_project_xyz' (looked in "
                              f"the current folder {tmp_path} and the installed packages): run from the folder that "
                              "holds 'no_such_project_xyz', or install it")
    with pytest.raises(ConfigError) as err:
        import_spec(f"{project}:rewrad", setting="env.reward.python")
    assert str(err.value) == (f"env.reward.python '{project}:rewrad': {project!r} has no attribute 'rewrad'; did "
                              "you mean 'reward'?")
    with pytest.raises(ConfigError) as err:
        import_spec(f"{project}:Nested.Outer", setting="--judge")
    assert str(err.value) == f"--judge '{project}:Nested.Outer': '{project}.Nested' has no attribute 'Outer'"


def test_a_module_whose_own_import_fails_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "broken_project_q.py").write_text("import no_such_dependency_q\n")
    with pytest.raises(ConfigError) as err:
        import_spec("broken_project_q:f", setting="graph")
    assert str(err.value) == ("graph 'broken_project_q:f': importing module 'broken_project_q' failed "
                              "(ModuleNotFoundError: No module named 'no_such_dependency_q')")
    sys.modules.pop("broken_project_q", None)


# ---- every caller goes through it ----------------------------------------------------------------------------


def test_cli_graph_and_env_of_a_config(project):
    from drmas_graph.cli._imports import StandInChatModel, build_graph
    from drmas_graph.cli._train import build_graph_and_env

    assert build_graph(f"{project}:make_graph") == "the graph"
    assert isinstance(sys.modules[project].SEEN["llm"], StandInChatModel)
    cfg = SimpleNamespace(graph=f"{project}:make_graph", graph_kwargs={}, env=f"{project}:Env", env_kwargs={"n": 3})
    graph, env = build_graph_and_env(cfg)
    assert graph == "the graph" and type(env).__name__ == "Env" and env.n == 3
    with pytest.raises(ConfigError, match=rf"^env '{project}:Envv': '{project}' has no attribute 'Envv'"):
        build_graph_and_env(SimpleNamespace(**{**vars(cfg), "env": f"{project}:Envv"}))
    with pytest.raises(ConfigError, match=rf"^graph '{project}:nope': '{project}' has no attribute 'nope'"):
        build_graph_and_env(SimpleNamespace(**{**vars(cfg), "graph": f"{project}:nope"}))


def test_cli_judge_of_traces_rescore(project):
    from drmas_graph.cli._traces import _judge_and_tasks

    judge, tasks, _ = _judge_and_tasks(f"{project}:Judge", ["test"])
    assert type(judge).__name__ == "Judge" and tasks == ["t-test"]
    with pytest.raises(ConfigError, match=rf"^--judge '{project}:Jdge': '{project}' has no attribute 'Jdge'"):
        _judge_and_tasks(f"{project}:Jdge", None)


def test_the_python_reward_of_task_files(project, tmp_path):
    from drmas_graph.config import _validate
    from drmas_graph.task_files import env_from_config

    (tmp_path / "t.jsonl").write_text(json.dumps({"q": "2+2?", "answer": "4"}) + "\n")
    env_cfg = {"tasks": "t.jsonl", "input": {"messages": [{"role": "user", "content": "{q}"}]}, "answer": "answer",
               "reward": {"python": f"{project}:reward"}}
    env = env_from_config(_validate({"env": env_cfg}, "c").env, run_dir=tmp_path / "run")
    assert env.reward(env.tasks("train")[0], None) == 0.5
    env_cfg["reward"] = {"python": f"{project}.reward"}  # the old pkgutil form is refused with the fix
    with pytest.raises(ConfigError, match=r"must look like 'package.module:attribute'"):
        env_from_config(_validate({"env": env_cfg}, "c").env, run_dir=tmp_path / "run")


def test_a_judge_model_import(project):
    from drmas_graph.rewards import judge_model

    model = judge_model({"import": f"{project}:judge_model"})
    assert type(model).__name__ == "FakeListChatModel" and model.responses == ["ok"]
    with pytest.raises(ConfigError, match=rf"^judge model import '{project}:judge_modl': '{project}' has no "
                                          r"attribute 'judge_modl'; did you mean 'judge_model'\?"):
        judge_model({"import": f"{project}:judge_modl"})
