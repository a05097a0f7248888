"""Constrained decoding (`drmas_graph.grammar`): what each request allows, and that it is exact in training.

- The grammar of each kind of request accepts the replies the real API would give and refuses the others.
- The embedded engine's recorded logprob of every token is the log-softmax of the logits over the tokens the
  grammar allows (an allowed set computed here independently, by asking the grammar library token by token).
- The update computes the same logprobs under the same masks; a forced token (one allowed) has logprob 0,
  ratio exactly 1 and no gradient.
- A constrained row gives the same bits alone and in a batch; two seeded runs are bit-identical.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from langchain_core.messages import HumanMessage

from drmas_graph.errors import GrammarError
from drmas_graph.grammar import MAX_WHITESPACE, Grammars, allowed_tokens, grammar_for, mask_logits
from drmas_graph.testing import tiny_policy
from drmas_graph.types import Sample, SamplingParams

CALC = {"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer"}}, "required": ["query"]}}}
VERDICT = {"type": "object", "properties": {"verdict": {"type": "string", "enum": ["yes", "no"]},
                                            "sure": {"type": "boolean"}},
           "required": ["verdict", "sure"], "additionalProperties": False}


@pytest.fixture(scope="module")
def policy():
    p = tiny_policy(seed=1, hidden_size=64, sampling=SamplingParams(max_new_tokens=96))
    with torch.no_grad():  # logits of a few units, so masked and unmasked distributions differ clearly
        for param in p.model.parameters():
            param.mul_(4.0)
    yield p
    p.close()


def _accepts(policy, grammar: str, text: str) -> bool:
    ids = policy.tokenizer.encode(text, add_special_tokens=False) + [policy.tokenizer.eos_token_id]
    try:
        policy.grammars.masks(grammar, ids)
    except GrammarError:
        return False
    return True


CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "2 + 3"}}</tool_call>'
CASES = [  # (spec, tools, kwargs, reply, accepted)
    ({"type": "json_object"}, [], {}, '{"a": [1, {"b": null}], "c": "x"}', True),
    ({"type": "json_object"}, [], {}, "The answer is yes.", False),
    ({"type": "json_object"}, [], {}, "[1, 2]", False),  # JSON mode's reply is an object
    ({"type": "json_object"}, [], {}, '{"a":' + "\n" * (MAX_WHITESPACE + 1) + "1}", False),
    ({"type": "json_schema", "name": "v", "schema": VERDICT}, [], {}, '{"verdict": "no", "sure": true}', True),
    ({"type": "json_schema", "name": "v", "schema": VERDICT}, [], {}, '{"verdict": "maybe", "sure": true}', False),
    ({"type": "json_schema", "name": "v", "schema": VERDICT}, [], {}, '{"verdict": "no"}', False),
    ({"type": "tool", "name": "calc", "schema": CALC["function"]["parameters"]}, [CALC], {},
     '{"expression": "1+1"}', True),
    ({"type": "tool", "name": "calc", "schema": CALC["function"]["parameters"]}, [CALC], {}, '{"expr": "1+1"}', False),
    ({"type": "any_tool", "names": ["calc", "search"]}, [CALC, SEARCH], {"tool_choice": "required"}, CALL, True),
    ({"type": "any_tool", "names": ["calc", "search"]}, [CALC, SEARCH], {"tool_choice": "required"}, "5", False),
    (None, [CALC, SEARCH], {}, "It is 5.", True),  # auto: free text
    (None, [CALC, SEARCH], {}, "Let me add. " + CALL, True),
    (None, [CALC, SEARCH], {}, '<tool_call>{"name": "calc", "arguments": {"x": "1"}}</tool_call>', False),
    (None, [CALC, SEARCH], {}, '<tool_call>{"name": "mul", "arguments": {}}</tool_call>', False),
    (None, [CALC, SEARCH], {"tool_choice": "none"}, "It is 5.", True),
    (None, [CALC, SEARCH], {"tool_choice": "none"}, CALL, False),
]


@pytest.mark.parametrize("spec, tools, kwargs, reply, accepted", CASES)
def test_each_request_allows_what_the_real_api_would_return(policy, spec, tools, kwargs, reply, accepted):
    grammar = grammar_for(spec, tools, kwargs, "hermes")
    assert _accepts(policy, grammar, reply) is accepted


def test_free_text_without_tools_and_a_parser_without_call_syntax_have_no_grammar():
    assert grammar_for(None, [], {}, "hermes") is None
    assert grammar_for(None, [CALC], {}, "none") is None
    assert grammar_for({"type": "tool", "name": "calc", "schema": {}}, [CALC], {}, "none") is not None


def test_mistral_calls_open_with_the_marker_token_when_it_is_special():
    from drmas_graph.engine.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "[TOOL_CALLS]"]})
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])
    grammar = grammar_for(None, [CALC], {}, "mistral", tok.all_special_tokens)
    call = '[TOOL_CALLS] [{"name": "calc", "arguments": {"expression": "1"}}]'
    ids = tok.encode(call, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("[TOOL_CALLS]")
    grammars.masks(grammar, ids + [tok.eos_token_id])  # accepted
    required = grammar_for({"type": "any_tool", "names": ["calc"]}, [CALC], {}, "mistral", tok.all_special_tokens)
    grammars.masks(required, ids + [tok.eos_token_id])
    with pytest.raises(GrammarError, match="position 0"):  # a call must open with the marker token
        grammars.masks(required, ids[1:] + [tok.eos_token_id])
    spelled = tok.encode("[", add_special_tokens=False) + tok.encode("TOOL_CALLS]", add_special_tokens=False)
    with pytest.raises(GrammarError, match="position 0"):  # the marker spelled as text is not the token
        grammars.masks(required, spelled + ids[1:] + [tok.eos_token_id])


def test_bitmask_bits_map_to_token_ids():
    bitmask = torch.zeros((1, 2), dtype=torch.int32)
    bitmask[0, 0] = (1 << 3) - (1 << 31)  # tokens 3 and 31 (the sign bit: the int32 pattern 0x80000008)
    bitmask[0, 1] = 1 << 1  # token 33
    assert allowed_tokens(bitmask, 40)[0].nonzero().flatten().tolist() == [3, 31, 33]
    masked = mask_logits(torch.zeros(1, 40), bitmask)
    assert torch.isfinite(masked).sum() == 3 and masked[0, 33] == 0


def _independent_allowed(policy, grammar: str, prefix: list[int]) -> torch.Tensor:
    """The tokens the grammar library accepts after `prefix`, asked one token at a time (accept, then roll back)."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(policy.grammars.compile(grammar))
    for t in prefix:
        assert matcher.accept_token(t)
    allowed = torch.zeros(policy.vocab_size, dtype=torch.bool)
    for t in range(policy.vocab_size):
        if matcher.accept_token(t):
            allowed[t] = True
            matcher.rollback(1)
    return allowed


def _prompt(policy, text="Is 2 + 2 = 4?"):
    return policy.render([HumanMessage(text)])


def test_recorded_logprobs_are_the_masked_log_softmax_of_the_sampled_distribution(policy):
    grammar = grammar_for({"type": "json_schema", "name": "v", "schema": VERDICT}, [], {}, "hermes")
    prompt = _prompt(policy)
    futures = [policy.submit(prompt, policy.sampling.replace(grammar=grammar, seed=s, temperature=0.7))
               for s in range(4)]
    gens = [f.result(timeout=120) for f in futures]
    for gen in gens:
        reply = json.loads(policy.decode(gen.token_ids))  # every reply is the schema's object
        assert reply["verdict"] in ("yes", "no") and isinstance(reply["sure"], bool)
        ids = list(gen.token_ids)
        with torch.no_grad():
            logits = policy.model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1].float()
        for t, token in enumerate(ids):
            allowed = _independent_allowed(policy, grammar, ids[:t])
            assert allowed[token]
            z = (logits[t] / 0.7).masked_fill(~allowed, float("-inf"))
            expected = torch.log_softmax(z, -1)[token].item()
            # a plain forward over prompt + response vs the engine's cached, packed passes: ~1e-6 apart
            assert gen.logprobs[t] == pytest.approx(expected, abs=2e-5)
            if int(allowed.sum()) == 1:
                assert gen.logprobs[t] == 0.0  # forced: exactly 0
        unmasked = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        assert (unmasked - torch.tensor(gen.logprobs)).abs().max() > 1e-3  # the mask changes them
    assert sum(lp == 0.0 for gen in gens for lp in gen.logprobs) >= 8  # '{"verdict": "' ... forced tokens


def test_the_sampler_records_the_log_softmax_over_the_allowed_tokens(policy):
    """On the same logits, the sampler's logprob is the masked log-softmax to 1e-6, and a draw is always allowed."""
    from drmas_graph.engine._sampling import RowParams, sample_rows, vocab_hash

    grammar = grammar_for(None, [CALC, SEARCH], {}, "hermes")
    prefixes = [[], policy.tokenizer.encode("<tool_call>", add_special_tokens=False),
                policy.tokenizer.encode('<tool_call>{"name": "', add_special_tokens=False)]
    V = policy.vocab_size
    gen = torch.Generator().manual_seed(0)
    logits_BV = torch.randn((len(prefixes), V), generator=gen) * 4
    allowed_BV = torch.stack([_independent_allowed(policy, grammar, p) for p in prefixes])
    bitmask_BW = policy.grammars.bitmask(len(prefixes))
    for b, prefix in enumerate(prefixes):
        matcher = policy.grammars.matcher(grammar)
        for t in prefix:
            assert matcher.accept(t)
        matcher.fill(bitmask_BW, b)
    assert torch.equal(allowed_tokens(bitmask_BW, V), allowed_BV)
    names = [policy.tokenizer.decode([t]) for t in allowed_BV[2].nonzero().flatten().tolist()]
    assert names and all("calc".startswith(n) or "search".startswith(n) for n in names)  # a tool's name goes on
    for seed in range(20):
        rp = RowParams.build([SamplingParams(temperature=0.8)] * len(prefixes), [seed] * len(prefixes), V, "cpu")
        ids_B, lp_B = sample_rows(logits_BV, rp, torch.zeros(len(prefixes), dtype=torch.int32), vocab_hash(V, "cpu"),
                                  bitmask_BW)
        expected_BV = torch.log_softmax((logits_BV / 0.8).masked_fill(~allowed_BV, float("-inf")), -1)
        assert allowed_BV.gather(1, ids_B[:, None]).all()
        assert torch.allclose(lp_B, expected_BV.gather(1, ids_B[:, None]).squeeze(1), atol=1e-6, rtol=0)


def test_a_constrained_row_is_the_same_bits_alone_and_in_a_batch(policy):
    grammar = grammar_for(None, [CALC, SEARCH], {}, "hermes")
    prompts = [_prompt(policy, f"What is {i} + {i}?") for i in range(6)]
    params = [policy.sampling.replace(grammar=grammar if i % 2 == 0 else None, seed=10 + i) for i in range(6)]
    alone = [policy.submit(p, q).result(timeout=120) for p, q in zip(prompts, params)]
    together = [f.result(timeout=120) for f in [policy.submit(p, q) for p, q in zip(prompts, params)]]
    assert [g.token_ids for g in alone] == [g.token_ids for g in together]
    assert [g.logprobs for g in alone] == [g.logprobs for g in together]  # bit for bit


def _update_samples(policy, grammar: str, n: int = 4) -> tuple[list[Sample], list]:
    prompt = _prompt(policy)
    gens = [policy.submit(prompt, policy.sampling.replace(grammar=grammar, seed=20 + s)).result(timeout=120)
            for s in range(n)]
    samples = [Sample(prompt_ids=tuple(prompt), response_ids=g.token_ids, old_logprobs=g.logprobs,
                      advantage=1.0 if i % 2 else -1.0, agent="judge", grammar=grammar) for i, g in enumerate(gens)]
    return samples, gens


def _updater(policy, **settings):
    from drmas_graph.train.engines import UpdateSettings
    from drmas_graph.train.optim.update import ModelUpdater

    return ModelUpdater(policy.model, name="tiny", settings=UpdateSettings(backend="torch", **settings),
                        grammars=policy.grammars)


@pytest.mark.parametrize("chunk_tokens", [0, 16])
def test_the_update_recomputes_the_masked_logprobs_and_forced_tokens_are_exact(chunk_tokens):
    policy = tiny_policy(seed=2, sampling=SamplingParams(max_new_tokens=96))
    grammar = grammar_for({"type": "json_schema", "name": "v", "schema": VERDICT}, [], {}, "hermes")
    samples, gens = _update_samples(policy, grammar)
    updater = _updater(policy, logprob_chunk_tokens=chunk_tokens)
    recomputed = updater.compute_logprobs(samples)
    for gen, lp in zip(gens, recomputed):
        assert torch.allclose(lp, torch.tensor(gen.logprobs), atol=1e-5)
        forced = torch.tensor([x == 0.0 for x in gen.logprobs])
        assert forced.sum() >= 2 and (lp[forced] == 0.0).all()  # ratio exp(0 - 0) = 1 exactly
    with pytest.raises(Exception, match="without the policy's grammars"):
        _updater(policy, logprob_chunk_tokens=chunk_tokens).__class__(
            policy.model, name="tiny", settings=updater.settings).compute_logprobs(samples)
    policy.close()


def test_a_forced_token_carries_no_gradient():
    from drmas_graph.train.optim._logprobs import collate, response_token_stats

    policy = tiny_policy(seed=2, sampling=SamplingParams(max_new_tokens=96))
    grammar = grammar_for({"type": "json_schema", "name": "v", "schema": VERDICT}, [], {}, "hermes")
    samples, gens = _update_samples(policy, grammar, n=2)
    batch = collate(samples, pad_id=0, device=torch.device("cpu"), grammars=policy.grammars)
    model = policy.model
    model.zero_grad()
    logprobs_BT, _ = response_token_stats(model, batch, lm_head=None, chunk_tokens=0, with_entropy=False)
    forced_BT = batch.mask_BT & torch.tensor([[x == 0.0 for x in g.logprobs] + [False] * (logprobs_BT.shape[1] -
                                               len(g.logprobs)) for g in gens])
    assert forced_BT.sum() >= 4
    assert (logprobs_BT[forced_BT] == 0.0).all()
    logprobs_BT[forced_BT].sum().backward(retain_graph=True)
    assert all(p.grad is None or (p.grad == 0).all() for p in model.parameters())  # no gradient at all
    free_BT = batch.mask_BT & ~forced_BT
    logprobs_BT[free_BT].sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad()
    policy.close()


def test_masked_entropy_is_that_of_the_allowed_tokens():
    from drmas_graph.engine._sampling import entropy_from_logits

    logits = torch.tensor([[0.0, math.log(3.0), 5.0, -2.0]])
    bitmask = torch.tensor([[0b0011]], dtype=torch.int32)  # tokens 0 and 1: p = 1/4, 3/4
    h = entropy_from_logits(mask_logits(logits, bitmask), masked=True)
    assert h.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
    forced = entropy_from_logits(mask_logits(logits, torch.tensor([[0b0100]], dtype=torch.int32)), masked=True)
    assert forced.item() == 0.0


def test_a_grammar_the_library_refuses_fails_that_call_only(policy):
    bad = json.dumps({"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"type": "nope"}}})
    with pytest.raises(GrammarError, match="agents.<agent>.constrain"):
        policy.submit(_prompt(policy), policy.sampling.replace(grammar=bad)).result(timeout=60)
    assert policy.submit(_prompt(policy), policy.sampling.replace(seed=1)).result(timeout=60).token_ids
