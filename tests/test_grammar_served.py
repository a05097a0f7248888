"""Constrained decoding end to end: an instrumented app's calls get the format they ask for, through the embedded
engine, the SGLang protocol double and (with DRMAS_VLLM_PYTHON) a real vLLM CPU server, and the logprobs the trainer
compares against are those of the masked distribution the server sampled from.
"""

from __future__ import annotations

import json
import os
from typing import Literal, TypedDict

import pytest
import torch
from langchain_core.messages import HumanMessage
from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel

from drmas_graph import SamplingParams, instrument
from drmas_graph.errors import RolloutError
from drmas_graph.grammar import grammar_for, mask_logits
from drmas_graph.testing import scripted_policy, tiny_model, tiny_policy, tiny_tokenizer

VLLM_PYTHON = os.environ.get("DRMAS_VLLM_PYTHON")


class Verdict(BaseModel):
    verdict: Literal["yes", "no"]  # bounded: a random model's free string would run past max_new_tokens
    sure: bool


class S(TypedDict, total=False):
    q: str
    v: object


def _judge_graph(make_runnable):
    def judge(state):
        return {"v": make_runnable().invoke([HumanMessage(state["q"])])}

    return StateGraph(S).add_node("judge", judge).add_edge(START, "judge").add_edge("judge", END).compile()


def _rollout(app, state):
    """The episode, also when the run failed (the app's parser raised on a reply that is not the JSON)."""
    try:
        return app.rollout(state)
    except RolloutError as exc:
        return exc.episode


@pytest.fixture
def openai_llm(monkeypatch):
    from langchain_openai import ChatOpenAI

    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-used")
    return ChatOpenAI(model="gpt-4o-mini", base_url="http://127.0.0.1:9/v1", max_retries=0, timeout=2)


def _masked_recompute(model, grammars, grammar, prompt_ids, response_ids, temperature):
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1: -1].float() / temperature
    z = mask_logits(logits, grammars.masks(grammar, response_ids))
    return torch.log_softmax(z, -1).gather(1, torch.tensor(list(response_ids))[:, None]).squeeze(1).tolist()


@pytest.mark.parametrize("constrain", [True, False])
def test_with_structured_output_is_valid_from_the_first_call_when_constrained(openai_llm, constrain):
    """A random tiny model never writes the schema's JSON by chance; under the grammar every reply parses."""
    policy = tiny_policy(seed=4, sampling=SamplingParams(max_new_tokens=64, temperature=1.0), constrain=constrain)
    app = instrument(_judge_graph(lambda: openai_llm.with_structured_output(Verdict, method="json_schema")),
                     {"judge": policy})
    episodes = [_rollout(app, {"q": f"Is {i} even?"}) for i in range(6)]
    parsed = [e for e in episodes if isinstance((e.final_state or {}).get("v"), Verdict)]
    turns = [e.turns[0] for e in episodes]
    if constrain:
        assert len(parsed) == 6, [e.error for e in episodes]
        assert all(t.sampling.grammar is not None and t.format_error is None for t in turns)
        schema = json.loads(turns[0].sampling.grammar)["format"]["json_schema"]
        assert schema["required"] == ["verdict", "sure"]
    else:
        assert parsed == [] and all(t.sampling.grammar is None for t in turns)
    policy.close()


def test_the_per_agent_switch_keeps_todays_behaviour(openai_llm):
    policy = tiny_policy(seed=4, sampling=SamplingParams(max_new_tokens=16))
    app = instrument(_judge_graph(lambda: openai_llm.with_structured_output(Verdict, method="json_schema")),
                     {"judge": policy})
    app.sampling["judge"] = SamplingParams(max_new_tokens=16, constrain=False)  # agents.judge.constrain: false
    episode = _rollout(app, {"q": "Is 2 even?"})
    assert episode.turns[0].sampling.grammar is None and episode.turns[0].format_error is not None
    policy.close()


def test_a_scripted_policy_sends_its_replies_as_written_unless_asked_to_constrain(openai_llm):
    graph = _judge_graph(lambda: openai_llm.with_structured_output(Verdict, method="json_schema"))
    loose = scripted_policy(["not json"])
    assert _rollout(instrument(graph, {"judge": loose}), {"q": "?"}).turns[0].response_text == "not json"
    strict = scripted_policy(['{"verdict": "yes", "sure": true}', "not json"], constrain=True)
    app = instrument(graph, {"judge": strict})
    good = app.rollout({"q": "?"})
    assert good.ok and good.final_state["v"] == Verdict(verdict="yes", sure=True)
    assert good.turns[0].sampling.grammar is not None
    bad = _rollout(app, {"q": "?"})
    assert "GrammarError" in (bad.error or "") and "not allowed by its grammar" in bad.error


def test_sglang_receives_the_structural_tag_and_returns_masked_logprobs(tmp_path):
    from drmas_graph.served import SGLangPolicy
    from tests.sglang_double import SGLangDouble

    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, seed=0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    double = SGLangDouble(str(tmp_path), weight_version="0").start()
    policy = SGLangPolicy(double.url, tokenizer, name="sg", sampling=SamplingParams(max_new_tokens=48, temperature=0.8),
                          timeout_s=60)
    try:
        grammar = grammar_for({"type": "json_schema", "name": "v", "schema": Verdict.model_json_schema()}, [], {},
                              "hermes")
        prompt = policy.render([HumanMessage("Reply in JSON.")])
        gen = policy.generate(prompt, policy.sampling.replace(grammar=grammar, seed=3))
        _, body = next(r for r in double.requests if r[0] == "POST /generate")
        assert body["sampling_params"]["structural_tag"] == grammar
        policy.grammars.masks(grammar, gen.token_ids)  # every token allowed by the grammar we recorded
        ours = _masked_recompute(model, policy.grammars, grammar, prompt, gen.token_ids, 0.8)
        assert gen.logprobs == pytest.approx(ours, abs=1e-4)
        assert json.loads(policy.decode(gen.token_ids))["verdict"] in ("yes", "no")
        assert sum(lp == 0.0 for lp in gen.logprobs) >= 2  # the keys' tokens are forced: logprob exactly 0
    finally:
        policy.close()
        double.stop()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON, reason="set DRMAS_VLLM_PYTHON to the python of the vLLM venv "
                                            "(bash scripts/setup_vllm.sh prints it)")
def test_vllm_decodes_under_the_same_grammar_with_masked_processed_logprobs(tmp_path):
    """vLLM's `processed_logprobs` (the mode launch_vllm sets) are taken after its grammar bitmask: they equal our
    masked recomputation, and a token the grammar forces has logprob 0."""
    from drmas_graph.served import VLLMPolicy, launch_vllm

    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, seed=0, hidden_size=128)  # head_dim 32: vLLM's CPU attention supports it
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    server = launch_vllm(str(tmp_path), python=VLLM_PYTHON, ready_timeout_s=400, extra_args=["--enforce-eager"])
    policy = VLLMPolicy(server.url, tokenizer, name="vllm", sampling=SamplingParams(max_new_tokens=48, temperature=0.8))
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
    try:
        prompt = policy.render([HumanMessage("Add 2 and 3.")], tools)
        for spec, kwargs in [({"type": "json_object"}, {}), ({"type": "any_tool", "names": ["calc"]},
                                                              {"tool_choice": "required"})]:
            grammar = grammar_for(spec, tools, kwargs, "hermes")
            gens = [policy.generate(prompt, policy.sampling.replace(grammar=grammar, seed=s)) for s in range(3)]
            for gen in gens:
                policy.grammars.masks(grammar, gen.token_ids)  # vLLM kept to the grammar we recorded
                ours = _masked_recompute(model, policy.grammars, grammar, prompt, gen.token_ids, 0.8)
                assert gen.logprobs == pytest.approx(ours, abs=1e-4)
            forced = [lp for gen in gens for lp in gen.logprobs if abs(lp) < 1e-6]
            assert forced, "a grammar this strict forces some tokens (logprob 0)"
        assert all(policy.decode(g.token_ids).startswith("<tool_call>") for g in gens)  # required: a call at once
    finally:
        policy.close()
        server.close()


def test_a_constrained_episode_replays_from_the_store(openai_llm, tmp_path):
    """Stored with its grammar and masked logprobs, then replayed offline: the same answer, no divergence."""
    from drmas_graph import TraceStore
    from drmas_graph.traces.replay import replay_episode

    policy = tiny_policy(seed=4, sampling=SamplingParams(max_new_tokens=64))
    graph = _judge_graph(lambda: openai_llm.with_structured_output(Verdict, method="json_schema"))
    store = TraceStore(tmp_path / "traces.db")
    episode = instrument(graph, {"judge": policy}, store=store).rollout({"q": "Is 3 even?"})
    stored = store.load_episode(episode.id)
    assert stored.turns[0].sampling.grammar == episode.turns[0].sampling.grammar is not None
    assert stored.turns[0].response_logprobs == episode.turns[0].response_logprobs
    result = replay_episode(graph, stored)
    assert not result.divergences and result.final_state["v"] == episode.final_state["v"]
    policy.close()


def test_training_on_constrained_turns_compares_masked_logprobs(openai_llm, tmp_path):
    """Two GRPO steps on a judge in JSON-schema mode: every reply parses, the rollout and the update's logprobs
    agree (they would differ by the mask's mass without it), and the weights move."""
    from drmas_graph import Task, train_graph

    class Env:
        def tasks(self, split):
            return [Task(id=f"{split}-{i}", input={"q": f"Is {i} even?"}, answer="yes" if i % 2 == 0 else "no")
                    for i in range(4)]

        def reward(self, task, episode):
            return float(episode.final_state["v"].verdict == task.answer)

    policy = tiny_policy(seed=5, sampling=SamplingParams(max_new_tokens=64))
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    graph = _judge_graph(lambda: openai_llm.with_structured_output(Verdict, method="json_schema"))
    result = train_graph(graph, Env(), policies={"judge": policy}, steps=2, tasks_per_step=2, group_size=4,
                         run_dir=str(tmp_path / "run"), update={"backend": "torch", "lr": 1e-3}, eval={"n_tasks": 1},
                         logging={"tensorboard": False})
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "agent/judge/rollout_logprob_gap" in r]
    assert len(steps) == 2
    assert all(r["agent/judge/rollout_logprob_gap"] < 1e-4 for r in steps), steps
    assert all(r.get("agent/judge/model_error_episodes", 0) == 0 for r in steps)
    assert any(not torch.equal(before[k], v) for k, v in policy.model.state_dict().items())
    assert result.checkpoint
    policy.close()
