"""The embedded engine's lean forward (`drmas_graph.engine._lean`): the model's own function, fewer ops.

Its logits equal the Hugging Face forward's up to float summation order on every kind of pass the engine makes
(a left-padded prefill, decode steps on the cache, a suffix prefilled on a cached prefix with masked gaps), for
Llama (grouped-query heads) and Qwen2 (q/k/v biases); the engine with it draws the same tokens as without it;
models it does not cover, and a model whose logits differ on its probe, take the HF forward. It is opt-in
(`TransformersPolicy(lean_forward=True, batch_invariant=False)`): off, the engine runs the model's own forward.
"""

from __future__ import annotations

import pytest
import torch

from drmas_graph.engine import _lean
from drmas_graph.engine._cpu_linear import PackedLinear, packed_linear_available
from drmas_graph.engine._lean import LeanDecoder
from drmas_graph.engine.tiny import tiny_model, tiny_tokenizer
from drmas_graph.types import SamplingParams

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="torch without oneDNN's packed linear ops")


def _model(arch: str, seed: int = 0):
    model = tiny_model(tiny_tokenizer(), seed=seed, arch=arch)
    with torch.no_grad():  # random weights of a realistic scale, so that gaps are not hidden by tiny logits
        for p in model.parameters():
            p.mul_(4.0)
    return PackedLinear.install(model)


def _cache(model):
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=model.config)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_logits_equal_the_models_own_on_every_pass(arch):
    model = _model(arch)  # built outside inference mode, as the engine's model is
    with torch.inference_mode():
        _lean_equals_hf(model)


def _lean_equals_hf(model):
    assert LeanDecoder.refusal(model) is None
    mode = PackedLinear()
    lean = LeanDecoder(model, mode)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 500, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    mask[2, :8] = 0  # a one-token prompt
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with mode:
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        got, cache = lean(ids, mask, pos, _cache(model))
        scale = ref.logits.abs().max().item()
        assert scale > 1.0
        assert (got - ref.logits[:, -1]).abs().max().item() <= 1e-5 * scale
        ref_cache = ref.cache
        for step in range(3):  # decode steps on the two caches
            nxt = got.argmax(-1, keepdim=True)
            mask = torch.cat([mask, mask.new_ones(3, 1)], 1)
            pos = pos[:, -1:] + 1
            ref = model(input_ids=nxt, attention_mask=mask, position_ids=pos, cache=ref_cache,
                        use_cache=True, logits_to_keep=1)
            ref_cache = ref.cache
            got, cache = lean(nxt, mask, pos, cache)
            assert (got - ref.logits[:, -1]).abs().max().item() <= 1e-5 * scale, step
            assert torch.equal(got.argmax(-1), ref.logits[:, -1].argmax(-1))
        # a suffix on cached prefix rows, with a masked gap between them (the engine's `_forward_suffixes`)
        from drmas_graph.engine._kv_cache import _stack_prompts

        prefix = [(k[1:2, :, -4:], v[1:2, :, -4:]) for k, v in ((layer.keys, layer.values) for layer in cache.layers)]
        ref_prefix = [(k[1:2, :, -4:], v[1:2, :, -4:]) for k, v in ((layer.keys, layer.values)
                                                                    for layer in ref_cache.layers)]
        suffix_ids = torch.tensor([[0, 7, 8, 9]])
        suffix_mask = torch.tensor([[0, 1, 1, 1]])
        suffix_pos = torch.tensor([[4, 4, 5, 6]])
        lean_cache, mask_K = _stack_prompts([prefix], [4], torch.device("cpu"))
        hf_cache, _ = _stack_prompts([ref_prefix], [4], torch.device("cpu"))
        full_mask = torch.cat([mask_K, suffix_mask], 1)
        ref = model(input_ids=suffix_ids, attention_mask=full_mask, position_ids=suffix_pos, cache=hf_cache,
                    use_cache=True, logits_to_keep=1)
        got, _ = lean(suffix_ids, full_mask, suffix_pos, lean_cache)
        assert (got - ref.logits[:, -1]).abs().max().item() <= 1e-5 * scale


def _generate(policy, prompts, n=12):
    params = SamplingParams(temperature=1.0, max_new_tokens=n)
    futures = [policy.submit(p, params.replace(seed=100 + i)) for i, p in enumerate(prompts)]
    return [f.result(timeout=120) for f in futures]


def test_the_engine_draws_the_same_tokens_with_and_without_it():
    from drmas_graph.engine.tiny import tiny_policy

    prompts = [[5 + i, 40, 41 + i, 42, 43 + 2 * i][: 2 + i % 4] for i in range(6)]
    out = {}
    for lean in (True, False):
        # off by default, and only with batch_invariant off (its attention is not computed row by row)
        policy = tiny_policy(seed=3, **({"lean_forward": True, "batch_invariant": False} if lean else {}))
        with torch.no_grad():
            for p in policy.model.parameters():
                p.mul_(4.0)
        try:
            out[lean] = _generate(policy, prompts)
            stats = policy.stats
        finally:
            policy.close()
        assert stats.forward_passes >= 12
        assert stats.lean_passes == (stats.forward_passes if lean else 0)
    for a, b in zip(out[True], out[False]):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5


def test_models_it_does_not_cover_are_named():
    model = _model("llama")
    model.config.model_type = "gemma"
    assert "architecture is 'gemma'" in LeanDecoder.refusal(model)
    model = _model("llama")
    model.config.sliding_window, model.config.use_sliding_window = 16, True
    assert "sliding attention window (16)" in LeanDecoder.refusal(model)
    model = _model("llama")
    model.model.layers[1].mlp.down_proj = torch.nn.Identity()
    assert "not plain nn.Linear" in LeanDecoder.refusal(model)
    model = _model("llama").to(torch.bfloat16)
    assert "torch.bfloat16 on cpu" in LeanDecoder.refusal(model)


def test_a_model_whose_probe_differs_runs_its_own_forward(monkeypatch, caplog):
    model = _model("llama")
    lean = LeanDecoder(model, PackedLinear())
    monkeypatch.setattr(_lean, "_rotate", lambda x, cos, sin: x)  # positions ignored: not the model's function
    with caplog.at_level("WARNING"):
        assert lean.check() is False
    assert lean.checked is False
    assert "lean forward is off for this model: its logits differ" in caplog.text


def test_a_hooked_or_patched_model_runs_its_own_forward():
    """A forward hook (or a forward set on the instance) sees every pass, as without the lean forward."""
    from drmas_graph.engine.tiny import tiny_policy

    policy = tiny_policy(seed=3, lean_forward=True, batch_invariant=False)
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=7)
        plain = policy.generate([5, 6, 7], params)
        lean_passes, passes = policy.stats.lean_passes, policy.stats.forward_passes
        assert lean_passes == passes > 0
        seen = []
        handle = policy.model.model.layers[0].register_forward_hook(lambda m, a, o: seen.append(1))
        try:
            hooked = policy.generate([5, 6, 7], params)
        finally:
            handle.remove()
        # 4 decode steps (the prompt's prefill is cached), every one through the hooked model
        assert len(seen) == policy.stats.forward_passes - passes == 4 and policy.stats.lean_passes == lean_passes
        assert hooked.token_ids == plain.token_ids
        assert max(abs(a - b) for a, b in zip(hooked.logprobs, plain.logprobs)) <= 1e-5
        assert policy.generate([5, 6, 7], params).token_ids == plain.token_ids
        assert policy.stats.lean_passes > lean_passes  # hook removed: lean again
    finally:
        policy.close()
