"""The share of each agent's calls decoded under a grammar (constrained decoding, `Turn.sampling.grammar` set):
`agent/<a>/constrained_rate` per training step in metrics.jsonl, and the `constrained` column of `drmas-graph check`.

The app: a writer answering in free text (never constrained) and a judge that makes two calls, one asking for a
JSON schema (`response_format` json_schema: constrained, a bounded schema the tiny random model always completes)
and one in free text; so the writer's share is 0 and the judge's exactly 1/2."""

from __future__ import annotations

import json
from typing import TypedDict

from langchain_core.messages import HumanMessage
from langgraph.graph import END, START, StateGraph

from drmas_graph.cli import main
from tests._envs import ParityEnv
from tests.test_cli_train import write_config


class S(TypedDict, total=False):
    question: str
    answer: str
    verdict: str
    note: str


VERDICT = {"type": "json_schema", "json_schema": {"name": "verdict", "strict": True, "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}


def writer_judge(llm):
    def writer(state):
        return {"answer": llm.invoke([HumanMessage(state["question"])]).content}

    def judge(state):
        verdict = llm.bind(response_format=VERDICT).invoke([HumanMessage(state["answer"])])
        note = llm.invoke([HumanMessage("Why?")])
        return {"verdict": verdict.content, "note": note.content}

    return (StateGraph(S).add_node("writer", writer).add_node("judge", judge)
            .add_edge(START, "writer").add_edge("writer", "judge").add_edge("judge", END))


class WriterParityEnv(ParityEnv):
    """Team reward 1 when the writer's first response token id is even."""

    def reward(self, task, episode):
        return float(next(t for t in episode.turns if t.agent == "writer").response_ids[0] % 2 == 0)

    def turn_is_valid(self, task, turn):
        return True


def _config(tmp_path):
    return write_config(tmp_path, graph="tests.test_constrained_share:writer_judge",
                        env="tests.test_constrained_share:WriterParityEnv",
                        agents={"writer": {"model": "tiny", "sampling": {"max_new_tokens": 4}},
                                "judge": {"model": "tiny", "sampling": {"max_new_tokens": 32}}},
                        eval={"k": 1, "n_tasks": 1})


def test_training_logs_each_agents_constrained_rate(tmp_path):
    assert main(["train", str(_config(tmp_path))]) == 0
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if "reward/team_mean" in r]
    assert len(steps) == 1
    assert steps[0]["agent/writer/calls"] == 4 and steps[0]["agent/judge/calls"] == 8  # 2 tasks x group 2
    assert steps[0]["agent/writer/constrained_rate"] == 0.0
    assert steps[0]["agent/judge/constrained_rate"] == 0.5


def test_check_shows_each_agents_constrained_share(tmp_path, capsys):
    assert main(["check", str(_config(tmp_path)), "--groups", "2"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("agent "))
    assert header.split()[-1] == "constrained"
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("writer ", "judge "))}
    assert rows["writer"][-1] == "0%" and rows["judge"][-1] == "50%"
