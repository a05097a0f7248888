"""Prefix reuse in the embedded engine: a prompt that shares a prefix with a recent prompt or finished row
(an episode's next turn, agents with one system prompt) prefills only its suffix on the cached KV rows, and
samples the same tokens with the same logprobs as a full prefill (up to the order of floating-point sums)."""

import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from drmas_graph import SamplingParams
from drmas_graph.engine._decode import MIN_PREFIX, PromptCache
from tests._logprobs import recompute_logprobs

SYSTEM = "You are a careful solver. Show the work, then give the answer."
LOGPROB_ATOL = 1e-5  # measured: at most 4.8e-7 apart (float32 sums in another order); not bit-identical


def _submit_all(policy, prompts, params):
    futures = [policy.submit(p, sp) for p, sp in zip(prompts, params)]
    return [f.result() for f in futures]


@pytest.fixture
def cached_and_full():
    from drmas_graph.testing import tiny_policy

    kw = dict(seed=0, batch_wait_s=0.2, max_batch_wait_s=1.0)
    cached, full = tiny_policy(**kw, prefix_reuse=True), tiny_policy(**kw, prompt_cache_size=0)
    yield cached, full
    cached.close()
    full.close()


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0)], ids=["greedy", "seeded"])
def test_multi_turn_episodes_with_the_prefix_cache_sample_as_with_full_prefills(cached_and_full, sampling):
    cached, full = cached_and_full
    episodes = [[SystemMessage(SYSTEM), HumanMessage(f"What is {i} + {2 * i + 1}?")] for i in range(3)]
    max_diff, identical = 0.0, True
    for turn in range(4):  # every turn: the 3 episodes' prompts at once (different prefix and suffix lengths)
        prompts = [cached.render(m) for m in episodes]
        params = [SamplingParams(max_new_tokens=6 + 3 * e, seed=100 * turn + e, **sampling) for e in range(3)]
        got, want = _submit_all(cached, prompts, params), _submit_all(full, prompts, params)
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
            diff = (torch.tensor(g.logprobs, dtype=torch.float64) - torch.tensor(w.logprobs, dtype=torch.float64))
            max_diff = max(max_diff, diff.abs().max().item())
            identical &= g.logprobs == w.logprobs
        for m, g in zip(episodes, got):
            m += [AIMessage(cached.tokenizer.decode(g.token_ids, skip_special_tokens=True)),
                  HumanMessage(f"Now add {turn + 2}.")]
    assert max_diff <= LOGPROB_ATOL, max_diff
    s, f = cached.stats, full.stats
    assert s.partial_prefix_hits >= 9  # turns 2-4 of each episode (turn 1's prompts share the system prompt too)
    assert f.partial_prefix_hits == f.reused_prompt_tokens == 0
    assert s.prefill_tokens + s.reused_prompt_tokens == f.prefill_tokens  # every prompt token computed or reused
    assert s.prefill_tokens < 0.5 * f.prefill_tokens
    print(f"{sampling}: max |logprob difference| {max_diff:.3g}, bit-identical: {identical}")


def test_prefix_reuse_is_off_by_default():
    """Off unless asked (not bit-identical, and a hit depends on arrival order): the next turn's prompt is
    prefilled whole, while an identical prompt still reuses the cache."""
    from drmas_graph.testing import tiny_policy

    policy = tiny_policy(seed=0)
    try:
        msgs = [SystemMessage(SYSTEM), HumanMessage("What is 2 + 2?")]
        params = SamplingParams(max_new_tokens=8, seed=1)
        first = policy.generate(policy.render(msgs), params)
        policy.generate(policy.render(msgs), params)  # identical prompt: a whole-prompt hit
        msgs += [AIMessage(policy.tokenizer.decode(first.token_ids, skip_special_tokens=True)), HumanMessage("Sure?")]
        policy.generate(policy.render(msgs), params)
        assert policy.stats.prefix_cache_hits == 1
        assert policy.stats.partial_prefix_hits == 0
        assert policy.stats.reused_prompt_tokens == len(policy.render(msgs[:2]))
    finally:
        policy.close()


def test_a_weight_update_drops_the_cached_prefixes(cached_and_full):
    cached, _ = cached_and_full
    msgs = [SystemMessage(SYSTEM), HumanMessage("What is 2 + 2?")]
    params = SamplingParams(max_new_tokens=8, seed=1)
    first = cached.generate(cached.render(msgs), params)
    msgs += [AIMessage(cached.tokenizer.decode(first.token_ids, skip_special_tokens=True)), HumanMessage("Sure?")]
    cached.load_state_dict({k: v + 0.1 * torch.randn_like(v) for k, v in cached.model.state_dict().items()})
    prompt = cached.render(msgs)
    after = cached.generate(prompt, params)
    assert cached.stats.partial_prefix_hits == 0 and cached.stats.reused_prompt_tokens == 0  # stale KV not reused
    expected = recompute_logprobs(cached.model, prompt, after.token_ids, 1.0)
    torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)


def _kv(n: int, tag: float) -> list:
    return [(torch.full((1, 2, n, 4), tag), torch.full((1, 2, n, 4), -tag))]


def test_longest_prefix_takes_the_longest_shared_run_of_the_same_adapter():
    cache = PromptCache(size=4)
    base = tuple(range(100, 100 + MIN_PREFIX + 10))
    assert cache.get((None, base), version=0) is None  # sets the version
    cache.put((None, base), _kv(len(base), 1.0), torch.zeros(5), version=0)
    cache.put((None, base[:MIN_PREFIX + 4] + (7, 8)), _kv(MIN_PREFIX + 6, 2.0), None, version=0)
    cache.put(("lora-a", base + (9,)), _kv(len(base) + 1, 3.0), None, version=0)
    prompt = base[:MIN_PREFIX + 4] + (7, 8, 9)  # shares 22 tokens with the second entry, 20 with the first
    kv, k = cache.longest_prefix((None, prompt), version=0)
    assert k == MIN_PREFIX + 6 and kv[0][0][0, 0, 0, 0].item() == 2.0
    kv, k = cache.longest_prefix((None, base), version=0)  # an identical entry: all but the last token
    assert k == len(base) - 1 and kv[0][0][0, 0, 0, 0].item() == 1.0
    kv, k = cache.longest_prefix(("lora-a", base + (9, 10)), version=0)  # only the adapter's own entries
    assert k == len(base) + 1 and kv[0][0][0, 0, 0, 0].item() == 3.0
    assert cache.longest_prefix(("lora-b", base), version=0) is None
    assert cache.longest_prefix((None, base[:MIN_PREFIX - 1] + (0, 0)), version=0) is None  # too short to pay
    assert cache.get((None, base[:MIN_PREFIX + 4] + (7, 8)), version=0) is None  # a finished row has no logits
    assert cache.longest_prefix((None, prompt), version=1) is None and not cache.entries  # new weights


def test_agents_on_lora_adapters_reuse_only_their_own_adapters_prefixes():
    """Two agents with one system prompt on one conversation, each on its LoRA adapter: the KV rows of a
    prefix depend on the adapter, so each agent's prompts reuse its own earlier rows only."""
    pytest.importorskip("peft")
    from drmas_graph.config import LoraConfig
    from drmas_graph.engine.transformers_policy import TransformersPolicy
    from drmas_graph.testing import tiny_model, tiny_tokenizer
    from drmas_graph.train.optim.lora import attach_adapters

    tokenizer = tiny_tokenizer()
    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = attach_adapters(tiny_model(tokenizer, seed=0), lora, ["solver", "verifier"])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero B matrices: a fresh adapter equals the base model
        for name, p in model.named_parameters():
            if "lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    cached = TransformersPolicy(model, tokenizer, name="m", seed=0, prefix_reuse=True)
    full = TransformersPolicy(model, tokenizer, name="m", seed=0, prompt_cache_size=0)
    try:
        msgs = [SystemMessage(SYSTEM), HumanMessage("What is 3 + 4?")]
        for turn in range(3):
            for agent in ("solver", "verifier"):
                prompt = cached.render(msgs)
                params = SamplingParams(max_new_tokens=8, seed=10 * turn, adapter=agent)
                got, want = cached.generate(prompt, params), full.generate(prompt, params)
                assert got.token_ids == want.token_ids, (turn, agent)
                torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs),
                                           atol=LOGPROB_ATOL, rtol=0)
                msgs += [AIMessage(tokenizer.decode(got.token_ids, skip_special_tokens=True)),
                         HumanMessage(f"{agent} spoke; go on.")]
        # each agent's first prompt misses: the verifier's shares a prefix with the solver's rows, not its KV
        assert cached.stats.partial_prefix_hits == 4 and cached.stats.prefill_rows == 6
    finally:
        cached.close()
        full.close()
