"""Installing the judge: every documented judge form with its package missing is a one-line CLI error (exit 2)
naming the install, and the `judge` extra's packages build an API judge (construction only, no network)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from drmas_graph.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXTRA = "pip install 'drmas-graph[judge]'"

# Run in a fresh interpreter: a meta-path finder makes the named top-level modules unimportable, as on a machine
# without their packages, then `drmas-graph check` runs with the judge model given by --set.
_RUNNER = """
import sys
blocked = set(sys.argv[1].split(","))
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
from drmas_graph.cli import main
sys.exit(main(["check", sys.argv[2], "--groups", "1", "--set", "env.reward.judge.model=" + sys.argv[3]]))
"""


def _config(tmp_path: Path) -> Path:
    (tmp_path / "t.jsonl").write_text(json.dumps({"id": "a", "question": "2 + 3?", "answer": "5"}) + "\n")
    cfg = {"run_dir": str(tmp_path / "run"), "graph": "tests._graphs:solver_verifier",
           "env": {"tasks": str(tmp_path / "t.jsonl"), "input": {"question": "{question}"}, "answer": "answer",
                   "reward": {"judge": {"model": {"import": "tests._judge_models:ranking_judge"},
                                        "rubric": "Agree with the reference answer."}}},
           "models": {"tiny": {"tiny": {"seed": 0}}},
           "agents": {"solver": {"model": "tiny"}, "verifier": {"model": "tiny"}}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


FORMS = [  # (judge model, modules missing, what the error must say)
    ("openai:gpt-4.1-mini", "langchain", "is built by langchain's init_chat_model, and langchain is not installed: "
                                         + EXTRA),
    ("openai:gpt-4.1-mini", "langchain_openai", "needs the package langchain-openai, which is not installed: " + EXTRA),
    ("openai:gpt-4.1-mini", "openai", "needs the package openai, which is not installed: " + EXTRA),
    ("anthropic:claude-3-5-haiku-latest", "langchain_anthropic",
     "needs the package langchain-anthropic, which is not installed: pip install langchain-anthropic"),
    ("{base_url: 'http://127.0.0.1:9/v1', model: m}", "langchain_openai",
     "needs langchain-openai, and langchain-openai is not installed: " + EXTRA),
]


@pytest.mark.parametrize("model,missing,says", FORMS, ids=[f"{m.split(':')[0]}-{x}" for m, x, _ in FORMS])
def test_a_missing_judge_package_is_one_line_with_exit_2(tmp_path, model, missing, says):
    done = subprocess.run([sys.executable, "-c", _RUNNER, missing, str(_config(tmp_path)), model], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "WEAVE_DISABLED": "true", "OPENAI_API_KEY": "sk-dummy",
                               "ANTHROPIC_API_KEY": "dummy", "PYTHONPATH": str(ROOT)})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("drmas-graph: error: judge model") and lines[0].endswith(says), \
        done.stderr
    assert done.stdout == "" and not (tmp_path / "run" / "check" / "base-g1").exists()  # no empty folder left


def test_the_judge_extra_holds_the_packages_the_documented_forms_import():
    """pyproject's `judge` extra names the distributions of langchain's init_chat_model ('provider:model') and of
    ChatOpenAI ('openai:...' and {base_url, model}), and nothing else."""
    from importlib.metadata import packages_distributions

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["judge"]
    names = {spec.split(">")[0].split("=")[0].split("[")[0] for spec in extra}
    dists = packages_distributions()
    assert names == {dists["langchain"][0], dists["langchain_openai"][0]} == {"langchain", "langchain-openai"}


def test_with_the_judge_extra_an_api_judge_is_constructed(monkeypatch):
    """init_chat_model("openai:...") builds a ChatOpenAI (construction only: no request is sent), and so do the
    config's forms, into a Judge asking for structured output."""
    from langchain.chat_models import init_chat_model
    from langchain_openai import ChatOpenAI

    from drmas_graph.rewards import Judge, judge_model

    monkeypatch.setenv("OPENAI_API_KEY", "sk-dummy-never-sent")
    model = init_chat_model("openai:gpt-4.1-mini")
    assert isinstance(model, ChatOpenAI) and model.model_name == "gpt-4.1-mini"
    judge = Judge(judge_model("openai:gpt-4.1-mini"), "Agree with the reference answer.", max_tokens=300)
    assert isinstance(judge.model, ChatOpenAI) and judge.structured and judge.name == "gpt-4.1-mini"
    assert (judge.model.temperature, judge.model.seed, judge.model.max_tokens) == (0.0, 0, 300)


def test_an_api_judge_without_its_key_is_a_one_line_error(monkeypatch):
    from drmas_graph.rewards import judge_model

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ConfigError) as err:
        judge_model("openai:gpt-4.1-mini")
    message = str(err.value)
    assert message.startswith("judge model 'openai:gpt-4.1-mini' could not be built: OpenAIError: Missing credentials")
    assert "OPENAI_API_KEY" in message and "\n" not in message
    with pytest.raises(ConfigError) as err:
        judge_model("nosuchprovider:m")
    assert str(err.value).startswith("judge model 'nosuchprovider:m': Unable to infer model provider") \
        and "\n" not in str(err.value)
