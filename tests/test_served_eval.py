"""Evaluation of a vLLM-served model uses the eval sampling (top_p 0.95): its logprobs are never trained on,
so VLLMPolicy serves it; a training request with top_p < 1 is still refused (rev_v)."""

import pytest

from drmas_graph import SamplingParams
from drmas_graph.config import EvalConfig
from drmas_graph.errors import ConfigError
from drmas_graph.served import VLLMPolicy
from drmas_graph.testing import tiny_tokenizer
from drmas_graph.train.loop.trainer import Trainer, evaluate
from drmas_graph.types import Generation
from tests._envs import ParityEnv
from tests.test_trainer import graph, small_config


class RecordingVLLM(VLLMPolicy):
    """A VLLMPolicy whose HTTP call is replaced: it builds the real request body and answers 'even' tokens."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bodies = []

    async def _generate_once(self, url, prompt_ids, params):
        self.bodies.append(self.completion_body(prompt_ids, params))  # raises where vLLM would be refused
        return Generation(token_ids=(2, 4), logprobs=(-0.5, -0.5), finish_reason="stop", policy_version=self.version)


def test_vllm_evaluation_uses_top_p_and_scores(tmp_path):
    policy = RecordingVLLM("http://127.0.0.1:9", tiny_tokenizer(), name="m", model="m")
    cfg = small_config(tmp_path, eval={"k": 2, "n_tasks": 3})
    trainer = Trainer(graph(), ParityEnv(), cfg, policies={"solver": policy, "verifier": policy}, train=False)
    try:
        record = evaluate(trainer, step=0)
    finally:
        trainer.close()
    assert record["failed_episodes"] == 0 and record["avg@k"] == 1.0 and record["pass@k"] == 1.0
    assert len(policy.bodies) == 12 and {b["top_p"] for b in policy.bodies} == {0.95}
    assert {b["temperature"] for b in policy.bodies} == {0.6}


def test_vllm_training_requests_still_refuse_truncated_sampling():
    policy = VLLMPolicy("http://127.0.0.1:9", tiny_tokenizer(), name="m", model="m")
    ec = EvalConfig()
    train = SamplingParams(temperature=ec.temperature, top_p=ec.top_p)
    with pytest.raises(ConfigError, match="training request"):
        policy.completion_body([1, 2, 3], train)
    body = policy.completion_body([1, 2, 3], train.replace(train_logprobs=False))
    assert (body["top_p"], body["top_k"], body["temperature"]) == (0.95, -1, 0.6)
    with pytest.raises(ConfigError, match="training request"):
        policy.completion_body([1, 2, 3], SamplingParams(top_k=5))
    policy.close()


def test_truncated_training_sampling_for_vllm_is_refused_at_construction(tmp_path):
    policy = RecordingVLLM("http://127.0.0.1:9", tiny_tokenizer(), name="m", model="m")
    cfg = small_config(tmp_path, agents={"solver": {"model": "m", "sampling": {"top_p": 0.9}},
                                         "verifier": {"model": "m"}})
    with pytest.raises(ConfigError, match=r"agents.solver.sampling: policy 'm': top_k=0, top_p=0.9 in a training"):
        Trainer(graph(), ParityEnv(), cfg, policies={"solver": policy, "verifier": policy}, train=False)
    assert policy.bodies == []
    policy.close()
