"""The embedded engine's sampler and continuous batching: counter-based noise, top-k/top-p, joins, shared prefill."""

import random
import threading

import pytest
import torch
from langchain_core.messages import HumanMessage

from drmas_graph import SamplingParams
from drmas_graph.engine._decode import StopMatcher
from drmas_graph.engine._sampling import RowParams, bits_to_uniform, hash_uniform, mix32, mix32_py, row_keys, sample_rows, vocab_hash
from drmas_graph.engine.transformers_policy import sample_batch
from tests._logprobs import recompute_logprobs

LOGITS_V = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0])


def _draws(params: SamplingParams, n: int, seed: int = 7) -> torch.Tensor:
    """n draws of one request's noise stream (positions 0..n-1) on fixed logits, as one batch."""
    rp = RowParams.build([params] * n, [seed] * n, LOGITS_V.numel(), "cpu")
    ids, _ = sample_rows(LOGITS_V.expand(n, -1), rp, torch.arange(n, dtype=torch.int32), vocab_hash(6, "cpu"))
    return ids


def test_int32_hash_matches_python_reference():
    rng = random.Random(0)
    xs = [rng.randrange(2**32) for _ in range(20000)] + [0, 1, 2**31 - 1, 2**31, 2**32 - 1]
    t = torch.tensor([x - 2**32 if x >= 2**31 else x for x in xs], dtype=torch.int32)
    assert [v % 2**32 for v in mix32(t).tolist()] == [mix32_py(x) for x in xs]


def test_uniforms_are_uniform_and_keyed_by_seed_and_position():
    seeds = torch.tensor([[5, 0], [5, 0], [6, 0]], dtype=torch.int32)
    keys = row_keys(seeds, torch.tensor([0, 1, 0], dtype=torch.int32))
    table = mix32(torch.arange(50000, dtype=torch.int32) * 2 + 1)
    u = hash_uniform(keys, table)
    assert 0 < float(u.min()) and float(u.max()) < 1
    ends = bits_to_uniform(torch.tensor([-1, 0], dtype=torch.int32))  # all bits set / none
    assert ends.tolist() == [1 - 2**-24, 2**-24] and bool((torch.log(ends) < 0).all())  # never rounded to 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])  # position and seed both matter
    assert torch.equal(u[0], hash_uniform(row_keys(seeds[:1], torch.tensor([0], dtype=torch.int32)), table)[0])


@pytest.mark.parametrize("params,allowed", [
    (SamplingParams(), [0, 1, 2, 3, 4, 5]),
    (SamplingParams(temperature=0.7, top_k=3), [0, 1, 2]),
    (SamplingParams(top_p=0.75), [0, 1, 2]),  # p = .38 .23 .14 .06 ...: mass before token 2 is .61 < .75
    (SamplingParams(top_k=2, top_p=0.9), [0, 1]),
    # top-p after top-k renormalises: p(0) = e^2 / (e^2 + e^1.5) = .62 >= .5 keeps token 0 alone (HF, vLLM);
    # on the untruncated softmax (p(0) = .44 < .5) token 1 would pass too
    (SamplingParams(top_k=2, top_p=0.5), [0]),
])
def test_empirical_distribution_matches_truncated_softmax(params, allowed):
    n = 40000
    ids = _draws(params, n)
    assert set(ids.tolist()) <= set(allowed)
    p = torch.softmax(LOGITS_V / params.temperature, -1)[allowed]
    expected = p / p.sum()
    freq = torch.bincount(ids, minlength=6)[allowed].float() / n
    sigma = (expected * (1 - expected) / n).sqrt()
    assert ((freq - expected).abs() <= 5 * sigma + 1e-9).all(), (freq, expected)
    chi2 = float(((freq - expected) ** 2 / expected).sum() * n)
    assert chi2 < 25  # <= 5 degrees of freedom: p < 1e-4 under the null


def test_top_k_then_top_p_keeps_the_tokens_hugging_face_keeps():
    """Random rows with both filters set: the support equals HF's TopKLogitsWarper then TopPLogitsWarper
    (the order `generate` and vLLM use), row by row, whatever the other rows ask."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from drmas_graph.engine._sampling import truncated_weights

    gen = torch.Generator().manual_seed(0)
    V, B = 50, 64
    logits_BV = torch.randn(B, V, generator=gen) * 2
    ks = torch.randint(1, 12, (B,), generator=gen).tolist()
    ps = (torch.rand(B, generator=gen) * 0.9 + 0.05).tolist()
    params = [SamplingParams(temperature=0.8, top_k=k, top_p=p) for k, p in zip(ks, ps)]
    scaled_BV = logits_BV / 0.8
    max_B = scaled_BV.amax(-1, keepdim=True)
    e_BV = torch.exp(scaled_BV - max_B)
    weights_BV = truncated_weights(scaled_BV, e_BV, e_BV.sum(-1, keepdim=True),
                                   RowParams.build(params, range(B), V, "cpu"))
    fewer = 0
    for i, (k, p) in enumerate(zip(ks, ps)):
        hf = TopPLogitsWarper(p)(None, TopKLogitsWarper(k)(None, scaled_BV[i:i + 1].clone()))[0]
        assert torch.equal(weights_BV[i] > 0, torch.isfinite(hf)), (i, k, p)
        untruncated = torch.softmax(scaled_BV[i], -1).sort(descending=True).values
        fewer += int((weights_BV[i] > 0).sum()) < min(k, int(((untruncated.cumsum(0) - untruncated) < p).sum()))
    assert fewer > 0  # rows where renormalising first keeps fewer tokens than the joint rule: the order matters


def test_two_level_race_is_exact_across_blocks():
    """V = 700: three blocks of 256 (the last padded); mass spread over tokens in every block."""
    V, n = 700, 40000
    logits = torch.full((V,), -4.0)
    hot = [3, 255, 256, 400, 699]
    logits[hot] = torch.tensor([1.0, 0.5, 0.8, 0.2, 1.2])
    p = torch.softmax(logits, -1)
    rp = RowParams.build([SamplingParams()] * n, [123] * n, V, "cpu")
    ids = sample_rows(logits.expand(n, -1), rp, torch.arange(n, dtype=torch.int32), vocab_hash(V, "cpu"))[0]
    freq = torch.bincount(ids, minlength=V).float() / n
    cold = torch.ones(V, dtype=torch.bool)
    cold[hot] = False
    groups = [freq[h] for h in hot] + [freq[cold].sum()]  # each hot token, and all the cold ones together
    expected = [p[h] for h in hot] + [p[cold].sum()]
    for f, e in zip(groups, expected):
        assert abs(float(f) - float(e)) <= 5 * float((e * (1 - e) / n).sqrt()), (groups, expected)
    assert set(ids.tolist()) - set(hot)  # cold tokens are drawn too (tiny mass each, ~30% together)


def test_logprobs_are_untruncated_log_softmax_at_temperature():
    logits = torch.randn(4, 40)
    params = [SamplingParams(temperature=0.5, top_k=5, seed=1), SamplingParams(top_p=0.3, seed=2),
              SamplingParams(temperature=0), SamplingParams(temperature=1.3)]
    ids, lps = sample_batch(logits, params, [1, 2, 3, 4], [0, 9, 3, 2])
    for i, (p, tok, lp) in enumerate(zip(params, ids, lps)):
        expected = torch.log_softmax(logits[i] / (p.temperature or 1.0), -1)[tok]
        assert abs(lp - float(expected)) < 1e-5
    assert ids[2] == int(logits[2].argmax())
    assert int(logits[0].topk(5).indices.eq(ids[0]).sum()) == 1


def test_a_rows_draw_does_not_depend_on_the_batch():
    V = 300
    logits = torch.randn(6, V) * 2
    params = [SamplingParams(seed=s, top_k=[0, 20][s % 2], top_p=[1.0, 0.8][s % 3 == 0]) for s in range(6)]
    seeds, positions = [11, 12, 13, 14, 15, 16], [0, 4, 2, 7, 1, 0]
    batched = [sample_batch(logits, params, seeds, positions)[0] for _ in range(2)]
    alone = [sample_batch(logits[i:i + 1], params[i:i + 1], seeds[i:i + 1], positions[i:i + 1])[0][0]
             for i in range(6)]
    shuffled = sample_batch(logits.flip(0), params[::-1], seeds[::-1], positions[::-1])[0][::-1]
    assert batched[0] == batched[1] == alone == shuffled


def test_stop_matcher_agrees_with_full_decoding(policy):
    tok = policy.tokenizer
    rng = random.Random(3)
    text = "What is 7 + 8? Answer: 15. <tool_call>é café ünï</tool_call> the answer"
    ids = tok.encode(text, add_special_tokens=False)
    for stop in ["Answer:", "15.", "</tool", "é c", "ünï", "swer", "zzz"]:
        m = StopMatcher(tok, [stop, "never-there"])
        hit = next((i for i in range(len(ids)) if m.feed(ids[: i + 1])), None)
        full = next((i for i in range(len(ids)) if stop in tok.decode(ids[: i + 1], skip_special_tokens=False)), None)
        assert hit == full, stop
    for trial in range(20):  # random token streams, special tokens and partial characters included
        noise = [rng.randrange(len(tok)) for _ in range(120)]
        for stop in ("e", "th", "an "):
            m = StopMatcher(tok, [stop])
            hit = next((i for i in range(120) if m.feed(noise[: i + 1])), None)
            full = next((i for i in range(120) if stop in tok.decode(noise[: i + 1], skip_special_tokens=False)),
                        None)
            assert hit == full, (trial, stop)


def test_top_k_top_p_logprobs_equal_a_fresh_forward(policy):
    prompt = policy.render([HumanMessage("What is 2+3?")])
    gen = policy.generate(prompt, SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=3))
    expected = recompute_logprobs(policy.model, prompt, gen.token_ids, 0.8)
    torch.testing.assert_close(torch.tensor(gen.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)


def _singles(policy, prompts, params):
    return [policy.generate(p, sp) for p, sp in zip(prompts, params)]


def test_requests_joining_mid_decode_and_shared_prompts_sample_as_if_alone(policy):
    """A long request decodes; after its 3rd forward pass three more arrive (two with the same prompt)."""
    long_prompt = policy.render([HumanMessage("Tell me a long story about the river town.")])
    short = policy.render([HumanMessage("What is 4 + 4?")])
    seeds = [s for s in range(40) if policy.generate(long_prompt, SamplingParams(max_new_tokens=40, seed=s))
             .finish_reason == "length"]
    first = SamplingParams(max_new_tokens=40, seed=seeds[0])
    late = [(short, SamplingParams(max_new_tokens=12, seed=1)), (short, SamplingParams(max_new_tokens=6, seed=2)),
            (policy.render([HumanMessage("hi")]), SamplingParams(max_new_tokens=9, seed=3, temperature=0.5))]
    alone = _singles(policy, [long_prompt] + [p for p, _ in late], [first] + [sp for _, sp in late])
    stats_before = (policy.stats.joined_mid_decode, policy.stats.shared_prefill_rows)
    futures, calls = [], [0]

    def hook(module, args, kwargs):
        calls[0] += 1
        if calls[0] == 3:
            futures.extend(policy.submit(p, sp) for p, sp in late)

    handle = policy.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        futures.insert(0, policy.submit(long_prompt, first))
        head = futures[0].result()
        while len(futures) < 4:
            threading.Event().wait(0.01)
        results = [head] + [f.result() for f in futures[1:]]
    finally:
        handle.remove()
    assert policy.stats.joined_mid_decode - stats_before[0] == 3
    assert policy.stats.shared_prefill_rows - stats_before[1] == 1
    for a, b in zip(alone, results):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_rows_leave_when_done_and_waiting_requests_take_their_slots():
    from drmas_graph.testing import tiny_policy

    policy = tiny_policy(seed=0, max_batch_size=2, batch_wait_s=0.2, max_batch_wait_s=0.5, prompt_cache_size=0)
    try:
        prompts = [policy.render([HumanMessage(f"q{i}")]) for i in range(5)]
        params = [SamplingParams(max_new_tokens=n, seed=i) for i, n in enumerate([3, 15, 4, 8, 2])]
        alone = _singles(policy, prompts, params)
        passes = policy.stats.forward_passes
        futures = [policy.submit(p, sp) for p, sp in zip(prompts, params)]
        results = [f.result() for f in futures]
        assert [r.token_ids for r in results] == [a.token_ids for a in alone]
        assert [len(a.token_ids) for a in alone] == [3, 15, 4, 8, 2]
        # schedule: rows 0+1 prefill together; 0 ends after 3 tokens, 2 joins 1; 2 ends, 3 joins 1; 1 and 3
        # end at 1's 15th token; 4 runs alone. 15 passes for row 1's life + 2 joining prefills + 2 for row 4.
        assert policy.stats.max_batch == 2
        assert policy.stats.joined_mid_decode == 2
        assert policy.stats.forward_passes - passes == 19
    finally:
        policy.close()


def _concurrently(policy, prompts, params):
    barrier = threading.Barrier(len(prompts))
    out = [None] * len(prompts)

    def run(i):
        barrier.wait()
        out[i] = policy.generate(prompts[i], params[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return out


def test_group_of_identical_prompts_is_prefilled_once():
    from drmas_graph.testing import tiny_policy

    policy = tiny_policy(seed=0, prompt_cache_size=0, batch_wait_s=0.2, max_batch_wait_s=1.0)
    try:
        prompt = policy.render([HumanMessage("What is 3 + 5?")])
        params = [SamplingParams(max_new_tokens=8, seed=100 + g) for g in range(8)]
        alone = _singles(policy, [prompt] * 8, params)
        assert policy.stats.prefill_rows == 8 and policy.stats.shared_prefill_rows == 0
        out = _concurrently(policy, [prompt] * 8, params)
        assert policy.stats.prefill_rows == 9 and policy.stats.shared_prefill_rows == 7  # one admission of 8
        assert policy.stats.prefill_tokens == 9 * len(prompt)
        assert [o.token_ids for o in out] == [a.token_ids for a in alone]
        assert len({o.token_ids for o in out}) > 1  # different seeds, different samples from one shared prefill
    finally:
        policy.close()


def test_recent_prompts_reuse_their_prefill_until_the_weights_change():
    from drmas_graph.testing import tiny_policy

    cached, uncached = tiny_policy(seed=0), tiny_policy(seed=0, prompt_cache_size=0)
    try:
        prompts = [cached.render([HumanMessage(f"What is {i} + 5?")]) for i in range(3)]
        first = SamplingParams(max_new_tokens=6, seed=1)
        for p in prompts:
            cached.generate(p, first)
        assert cached.stats.prefill_rows == 3 and cached.stats.prefix_cache_hits == 0
        # later arrivals with the same prompts (and one new prompt) sample as if prefilled themselves
        batch = prompts + [cached.render([HumanMessage("new")])]
        params = [SamplingParams(max_new_tokens=7, seed=10 + i, temperature=0.9) for i in range(4)]
        got = _concurrently(cached, batch, params)
        assert cached.stats.prefix_cache_hits == 3 and cached.stats.prefill_rows == 4
        want = [uncached.generate(p, sp) for p, sp in zip(batch, params)]
        for a, b in zip(got, want):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
        cached.load_state_dict({k: v + 0.1 * torch.randn_like(v) for k, v in cached.model.state_dict().items()})
        after = cached.generate(prompts[0], first)
        assert cached.stats.prefix_cache_hits == 3 and cached.stats.prefill_rows == 5  # stale KV not reused
        expected = recompute_logprobs(cached.model, prompts[0], after.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)
    finally:
        cached.close()
        uncached.close()


def test_weight_update_waits_for_decoding_rows():
    from drmas_graph.testing import tiny_policy

    policy = tiny_policy(seed=0)
    try:
        prompt = policy.render([HumanMessage("hello there")])
        params = SamplingParams(max_new_tokens=30, temperature=0)
        before = policy.generate(prompt, params)
        new_state = {k: v + 0.5 * torch.randn_like(v) for k, v in policy.model.state_dict().items()}
        started = threading.Event()
        handle = policy.model.register_forward_pre_hook(lambda *a: started.set())
        fut = policy.submit(prompt, params)
        started.wait()
        handle.remove()
        policy.load_state_dict(new_state)  # blocks until the row finished on the old weights
        old_run = fut.result()
        assert old_run.policy_version == 0 and old_run.token_ids == before.token_ids
        after = policy.generate(prompt, params)
        assert after.policy_version == 1
        expected = recompute_logprobs(policy.model, prompt, after.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)
    finally:
        policy.close()


@pytest.mark.skipif(not __import__("drmas_graph.engine._cpu_linear", fromlist=["x"]).packed_linear_available(),
                    reason="this torch build has no oneDNN")
def test_packed_cpu_linear_matches_plain_and_follows_weight_changes():
    from drmas_graph.engine._cpu_linear import PackedLinear

    torch.manual_seed(0)
    lin = PackedLinear.install(torch.nn.Linear(64, 96))
    x = torch.randn(5, 3, 64)
    mode = PackedLinear()
    with torch.inference_mode():
        with mode:
            a = lin(x)
        torch.testing.assert_close(a, lin(x), atol=1e-5, rtol=1e-5)
        assert mode.repacks == 1
        with mode:
            lin(x)
        assert mode.repacks == 1  # packed once per weights version
    with torch.no_grad():
        lin.weight.add_(1.0)  # an in-place update (load_state_dict, optimizer step) moves the version counter
    with torch.inference_mode():
        with mode:
            b = lin(x)
        torch.testing.assert_close(b, lin(x), atol=1e-5, rtol=1e-5)
        assert mode.repacks == 2
    with mode:  # autograd on: the plain op, so training through the module keeps its gradients
        y = lin(x).sum()
    y.backward()
    assert lin.weight.grad is not None and mode.repacks == 2


@pytest.fixture
def packed_and_plain():
    """Two policies on the same weights: linear layers on packed oneDNN weights, and plain."""
    from drmas_graph.testing import tiny_policy

    packed, plain = tiny_policy(seed=0), tiny_policy(seed=0, packed_cpu_linear=False)
    yield packed, plain
    packed.close()
    plain.close()


def assert_same_generation(a, b) -> None:
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_packed_and_plain_linear_sample_the_same_tokens(packed_and_plain):
    packed, plain = packed_and_plain
    prompt = packed.render([HumanMessage("What is 6 + 1?")])
    params = SamplingParams(max_new_tokens=16, seed=5)
    assert_same_generation(packed.generate(prompt, params), plain.generate(prompt, params))


def test_packed_weights_follow_an_update_that_leaves_the_tensor_version_counters_alone(packed_and_plain):
    """DeepSpeed ZeRO writes updated parameters through flat buffers: no parameter's `_version` moves (here:
    writes through `.data`, which has its own counter). The policy's weights version is what invalidates."""
    packed, plain = packed_and_plain
    prompt = packed.render([HumanMessage("What is 6 + 1?")])
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    assert_same_generation(packed.generate(prompt, params), plain.generate(prompt, params))
    torch.manual_seed(1)
    noise = {k: torch.randn_like(v) * 0.5 for k, v in plain.model.state_dict().items() if v.is_floating_point()}
    for policy in (packed, plain):
        versions = [p._version for p in policy.model.parameters()]
        with policy.updating_weights(), torch.no_grad():
            for name, p in policy.model.named_parameters():
                p.data.add_(noise[name])
        assert [p._version for p in policy.model.parameters()] == versions
    assert_same_generation(packed.generate(prompt, params), plain.generate(prompt, params))


def test_a_bfloat16_model_generates_with_packed_linear_layers_as_without():
    """oneDNN packs bf16 weights only on CPUs with its bf16 kernels (AVX-512 BW/VL/DQ or AVX-NE-CONVERT);
    on others (AVX2) packing raised, so a bf16 policy failed every request. Such layers keep the plain op."""
    from drmas_graph.testing import tiny_policy

    packed, plain = tiny_policy(seed=0), tiny_policy(seed=0, packed_cpu_linear=False)
    try:
        for policy in (packed, plain):
            policy.model.to(torch.bfloat16)
        prompt = packed.render([HumanMessage("What is 6 + 1?")])
        for params in (SamplingParams(max_new_tokens=12, temperature=0.0), SamplingParams(max_new_tokens=12, seed=3)):
            a, b = packed.generate(prompt, params), plain.generate(prompt, params)
            assert len(a.token_ids) == 12 and a.token_ids == b.token_ids
            # bf16 oneDNN and bf16 MKL kernels accumulate in different orders: logits differ in the last bits
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=0.05, rtol=0)
    finally:
        packed.close()
        plain.close()
