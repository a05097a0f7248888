"""TransformersPolicy: exact ids and logprobs, seeded sampling, stop rules, dynamic batching, weight updates."""

import threading
import time

import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from drmas_graph import Generation, PolicyError, SamplingParams
from drmas_graph._chat import parse_hermes
from drmas_graph.testing import scripted_policy, tiny_policy
from tests._logprobs import recompute_logprobs

MSGS = [SystemMessage("You are a solver."), HumanMessage("What is 2+3?")]


def test_generation_ids_and_logprobs_are_exact(policy):
    prompt = policy.render(MSGS)
    gen = policy.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0.7, seed=3))
    assert len(gen.token_ids) == len(gen.logprobs) == 12
    assert gen.finish_reason == "length" and gen.policy_version == 0
    # logprobs recorded while sampling equal a fresh full forward pass: log_softmax(logits / T)
    expected = torch.tensor(recompute_logprobs(policy.model, prompt, gen.token_ids, 0.7))
    torch.testing.assert_close(torch.tensor(gen.logprobs), expected, atol=1e-4, rtol=0)


def test_seeded_sampling_is_reproducible_and_seed_sensitive(policy):
    prompt = policy.render(MSGS)
    a = policy.generate(prompt, SamplingParams(max_new_tokens=10, seed=1))
    b = policy.generate(prompt, SamplingParams(max_new_tokens=10, seed=1))
    c = policy.generate(prompt, SamplingParams(max_new_tokens=10, seed=2))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids


def test_greedy_equals_top_k_1_and_argmax(policy):
    prompt = policy.render(MSGS)
    greedy = policy.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0))
    top1 = policy.generate(prompt, SamplingParams(max_new_tokens=8, top_k=1, seed=5))
    assert greedy.token_ids == top1.token_ids
    ids = torch.tensor([prompt])
    with torch.no_grad():
        first = int(policy.model(input_ids=ids).logits[0, -1].argmax())
    assert greedy.token_ids[0] == first


def test_top_p_restricts_support(policy):
    prompt = policy.render(MSGS)
    # top_p tiny -> only the most likely token survives -> same as greedy
    nucleus = policy.generate(prompt, SamplingParams(max_new_tokens=8, top_p=1e-6, seed=9))
    greedy = policy.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0))
    assert nucleus.token_ids == greedy.token_ids


def test_stop_token_and_stop_string(policy):
    prompt = policy.render(MSGS)
    free = policy.generate(prompt, SamplingParams(max_new_tokens=10, seed=4))
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    stopped = policy.generate(prompt, SamplingParams(max_new_tokens=10, seed=4, stop_token_ids=(stop_id,)))
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"
    piece = policy.tokenizer.decode(list(free.token_ids[:5]))[-2:]
    by_text = policy.generate(prompt, SamplingParams(max_new_tokens=10, seed=4, stop=(piece,)))
    assert by_text.finish_reason == "stop" and len(by_text.token_ids) <= 5
    assert piece in policy.tokenizer.decode(list(by_text.token_ids))
    assert by_text.token_ids == free.token_ids[: len(by_text.token_ids)]


def test_concurrent_requests_are_batched_and_match_single_requests(policy):
    prompts = [policy.render([HumanMessage(f"Question {i}: what is {i} + {i}?")]) for i in range(8)]
    singles = [policy.generate(p, SamplingParams(max_new_tokens=8, seed=i)) for i, p in enumerate(prompts)]
    batches_before = policy.stats.batches
    results = [None] * 8
    barrier = threading.Barrier(8)

    def run(i):
        barrier.wait()
        results[i] = policy.generate(prompts[i], SamplingParams(max_new_tokens=8, seed=i))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert policy.stats.batches - batches_before < 8  # some requests shared a forward pass
    assert policy.stats.max_batch >= 2
    for single, batched in zip(singles, results):  # left padding does not change what is sampled
        assert batched.token_ids == single.token_ids
        torch.testing.assert_close(torch.tensor(batched.logprobs), torch.tensor(single.logprobs), atol=1e-4, rtol=0)


async def test_async_generate_batches(policy):
    import asyncio

    prompts = [policy.render([HumanMessage(f"q{i}")]) for i in range(6)]
    gens = await asyncio.gather(*(policy.agenerate(p, SamplingParams(max_new_tokens=4, seed=i))
                                  for i, p in enumerate(prompts)))
    assert all(len(g.token_ids) == 4 for g in gens)
    assert policy.stats.max_batch >= 2


def test_weight_update_bumps_version_and_changes_output(policy):
    prompt = policy.render(MSGS)
    before = policy.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0))
    state = {k: v + 0.5 * torch.randn_like(v) for k, v in policy.model.state_dict().items()}
    policy.load_state_dict(state)
    after = policy.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0))
    assert policy.version == 1 and after.policy_version == 1 and before.policy_version == 0
    assert after.token_ids != before.token_ids


def test_backend_failure_reaches_every_waiter(policy):
    def broken(*a, **k):
        raise RuntimeError("CUDA out of memory (simulated)")

    policy.model.forward = broken
    with pytest.raises(PolicyError, match="tiny-llama.*CUDA out of memory"):
        policy.generate(policy.render(MSGS), SamplingParams(max_new_tokens=4))


def test_generation_requires_one_logprob_per_token():
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        Generation(token_ids=(1, 2), logprobs=(-0.1,), finish_reason="stop", policy_version=0)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_render_messages_tools_and_tool_results(policy):
    tools = [{"type": "function", "function": {"name": "search", "description": "look up",
                                               "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
    history = MSGS + [AIMessage("", tool_calls=[{"name": "search", "args": {"q": "Ana"}, "id": "c1"}]),
                      ToolMessage("Ana lives in Borvik.", tool_call_id="c1")]
    text = policy.render_text(history, tools)
    assert text.startswith("<|im_start|>system\nYou are a solver.\nTools:\n")
    assert '"name": "search"' in text
    assert '<|im_start|>assistant\n<tool_call>{"name": "search", "arguments": {"q": "Ana"}}</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\nAna lives in Borvik.<|im_end|>\n<|im_start|>assistant\n" in text
    assert policy.tokenizer.decode(policy.render(history, tools)) == text


def test_hermes_tool_call_parsing():
    parsed = parse_hermes('Let me look.<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>')
    assert parsed.content == "Let me look."
    assert [(c["name"], c["args"]) for c in parsed.tool_calls] == [("search", {"q": "x"})]
    broken = parse_hermes("<tool_call>{not json}</tool_call>")
    assert broken.tool_calls == [] and broken.invalid_tool_calls[0]["args"] == "{not json}"
    assert parse_hermes("plain answer").content == "plain answer"


def test_scripted_policy_teacher_forces_real_logprobs():
    p = scripted_policy(["Answer: 5"])
    prompt = p.render(MSGS)
    gen = p.generate(prompt, SamplingParams(max_new_tokens=32))
    assert p.decode(gen.token_ids) == "Answer: 5" and gen.token_ids[-1] == p.tokenizer.eos_token_id
    torch.testing.assert_close(torch.tensor(gen.logprobs), torch.tensor(recompute_logprobs(p.model, prompt, gen.token_ids, 1.0)),
                               atol=1e-5, rtol=0)


def test_heterogeneous_tiny_policies_have_different_tokenizers():
    a, b = tiny_policy(seed=0), tiny_policy(seed=1, arch="qwen2", vocab_size=384)
    assert len(a.tokenizer) != len(b.tokenizer)
    assert a.render(MSGS) != b.render(MSGS)
    assert type(a.model).__name__ == "LlamaForCausalLM" and type(b.model).__name__ == "Qwen2ForCausalLM"


def test_run_on_worker_runs_on_the_decoding_thread_after_rows_in_flight(policy):
    worker = {}
    policy.generate(policy.render(MSGS), SamplingParams(max_new_tokens=1, seed=0))  # the worker exists
    assert policy.run_on_worker(lambda: threading.current_thread()) is policy._worker
    # a call queued while a row decodes runs after it finished (it may touch the weights), and requests
    # queued after the call wait for it
    long = policy.submit(policy.render(MSGS), SamplingParams(max_new_tokens=40, seed=1))
    while not long.running():
        pass

    def call():
        worker["long_done"] = long.done()
        return 7

    assert policy.run_on_worker(call) == 7
    assert worker["long_done"] and len(long.result().token_ids) == 40
    # inside updating_weights (the trainer's update) it does not deadlock; errors reach the caller
    with policy.updating_weights():
        assert policy.run_on_worker(lambda: threading.current_thread().name) == f"{policy.name}-batcher"
        with pytest.raises(ZeroDivisionError):
            policy.run_on_worker(lambda: 1 / 0)
    assert policy.version == 1
    # a call from the worker itself runs at once
    assert policy.run_on_worker(lambda: policy.run_on_worker(lambda: 3)) == 3


def test_run_on_worker_inside_updating_weights_serves_a_request_that_arrived_meanwhile(policy):
    """rev3_h: an idle worker that picks up a request while an update holds the weights must not block on
    them, or the update's run_on_worker call (queued behind the request) would wait for it forever."""
    prompt = policy.render(MSGS)
    policy.generate(prompt, SamplingParams(max_new_tokens=2, seed=0))  # the worker exists
    time.sleep(0.2)  # and goes idle, waiting on its queue for the next request (not a timing assertion)
    holding, requested = threading.Event(), threading.Event()
    out = {}

    def update():
        with policy.updating_weights():  # the trainer's pattern: the update runs on the worker thread
            holding.set()
            requested.wait()
            out["call"] = policy.run_on_worker(lambda: threading.current_thread().name)

    updater = threading.Thread(target=update, daemon=True)
    updater.start()
    holding.wait()
    request = policy.submit(prompt, SamplingParams(max_new_tokens=3, seed=1))  # queued before the call
    requested.set()
    updater.join(timeout=60)
    assert not updater.is_alive(), "run_on_worker deadlocked with a request that arrived during the update"
    gen = request.result(timeout=60)
    assert out["call"] == f"{policy.name}-batcher"
    assert gen.policy_version == 1 and len(gen.token_ids) == 3  # served after the update, on its weights


def test_a_prompt_past_the_context_fails_alone_and_generation_stops_where_the_context_ends():
    """rev6_a: GPT-2 (learned positions, n_positions 64): an 80-token prompt decoded with a 10-token one made
    both fail (IndexError for the whole batch); now only it fails, naming the context. A rotary model (Llama,
    max_position_embeddings 24) decoded on past its positions silently; now a 20-token prompt gets 4 tokens
    ('length'), and a 30-token prompt is refused."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from drmas_graph.engine.tiny import tiny_model, tiny_tokenizer
    from drmas_graph.engine.transformers_policy import TransformersPolicy

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=1, n_head=2,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    policy = TransformersPolicy(gpt2, tok, name="gpt2-tiny", batch_wait_s=0.3, max_batch_wait_s=1.0)
    try:
        short = policy.submit(list(range(10, 20)), SamplingParams(max_new_tokens=4, seed=1))
        too_long = policy.submit(list(range(10, 90)), SamplingParams(max_new_tokens=4, seed=2))
        assert len(short.result(timeout=120).token_ids) == 4
        with pytest.raises(PolicyError) as err:
            too_long.result(timeout=120)
        assert str(err.value) == ("policy 'gpt2-tiny': the prompt has 80 tokens, more than the model's context of 64 "
                                  "positions: shorten the prompt (the messages the node sends) or serve a model with "
                                  "a longer context")
        at_edge = policy.generate(list(range(10, 70)), SamplingParams(max_new_tokens=8, seed=3, stop_token_ids=()))
        assert (len(at_edge.token_ids), at_edge.finish_reason) == (4, "length")  # positions 60..63, no IndexError
    finally:
        policy.close()
    llama = tiny_model(tok)
    llama.config.max_position_embeddings = 24
    rotary = TransformersPolicy(llama, tok, name="llama-24")
    try:
        assert rotary.context_size == 24
        gen = rotary.generate(list(range(10, 30)), SamplingParams(max_new_tokens=10, temperature=0.0))
        assert (len(gen.token_ids), gen.finish_reason) == (4, "length")  # positions 20..23
        with pytest.raises(PolicyError, match="the prompt has 30 tokens, more than the model's context of 24"):
            rotary.generate(list(range(10, 40)), SamplingParams(max_new_tokens=2))
    finally:
        rotary.close()
