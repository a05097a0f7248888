"""A row of the embedded engine gives the same bits whatever it is batched with (`_row_attention`, `row_sums`).

Measured before (SmolLM2-135M, 2026-12-05): a row's logprobs moved by up to ~5e-5 with the padding and the
batch size it got, which depend on when requests arrive; two runs of the demo recorded different logprobs for
half of their first evaluation's calls.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from drmas_graph.engine import _row_attention
from drmas_graph.engine._sampling import row_sums
from drmas_graph.engine.tiny import tiny_policy
from drmas_graph.types import SamplingParams

PROMPTS = [[5 + i, 40, 41 + i, 42, 43 + 2 * i, 7, 9, 11 + i, 13][: 2 + (3 * i) % 8] for i in range(12)]


def _policy(**kwargs):
    policy = tiny_policy(seed=3, hidden_size=128, batch_wait_s=0.05, max_batch_wait_s=0.2, prompt_cache_size=0,
                         **kwargs)
    with torch.no_grad():  # random weights of a realistic scale: logits of a few units, not ~0
        for p in policy.model.parameters():
            p.mul_(4.0)
    return policy


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=6 + i % 7, seed=100 + i)


def _batched(policy):
    """Requests 0-5 together; 6-11 joining one at a time while those decode (hooked on forward passes)."""
    futures, passes = {}, [0]

    def hook(module, args, kwargs):
        passes[0] += 1
        if 2 <= passes[0] <= 7:
            i = 4 + passes[0]
            futures[i] = policy.submit(PROMPTS[i], _params(i))

    handle = policy.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for i in range(6):
            futures[i] = policy.submit(PROMPTS[i], _params(i))
        while len(futures) < 12:
            time.sleep(0.01)
        return [futures[i].result(timeout=120) for i in range(12)]
    finally:
        handle.remove()


def test_a_row_decodes_to_the_same_bits_alone_and_in_any_batch():
    policy = _policy()
    try:
        alone = [policy.generate(p, _params(i)) for i, p in enumerate(PROMPTS)]
        batched = _batched(policy)
        assert policy.stats.max_batch >= 6 and policy.stats.joined_mid_decode >= 6
    finally:
        policy.close()
    for a, b in zip(alone, batched):
        assert a.token_ids == b.token_ids
        assert list(a.logprobs) == list(b.logprobs)  # bit for bit, not within a tolerance


def test_rows_starting_at_different_columns_are_grouped_by_their_start():
    # rows 0-1 start at column 0, rows 2-3 at column 2, row 4 at column 3 (left padding); one decode query
    valid = torch.tensor([[1, 1, 1, 1, 1, 1]] * 2 + [[0, 0, 1, 1, 1, 1]] * 2 + [[0, 0, 0, 1, 1, 1]]).bool()
    groups = _row_attention._groups(valid[:, None, None, :], 5, 1, 6)
    assert [(g[0], g[1], g[2], g[3]) for g in groups] == [(slice(0, 2), 0, 0, True), (slice(2, 4), 0, 2, True),
                                                           (slice(4, 5), 0, 3, True)]
    # rows that are not neighbours are picked by index
    groups = _row_attention._groups(valid[[0, 2, 1, 3, 4]][:, None, None, :], 5, 1, 6)
    assert groups[0][0].tolist() == [0, 2] and groups[1][0].tolist() == [1, 3]
    # a prefill: the queries start where the keys do, and the causal mask from there on is the plain one
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    mask = causal[None].repeat(2, 1, 1)
    mask[1, :, :1] = False  # row 1 padded by one column
    groups = _row_attention._groups(mask[:, None], 2, 4, 4)
    assert [(g[1], g[2], g[3]) for g in groups] == [(0, 0, True), (1, 1, True)]
    # keys that are not one run up to the last column (a suffix prefilled after a gap): all rows at once
    gap = valid.clone()
    gap[0, 2] = False
    assert _row_attention._groups(gap[:, None, None, :], 5, 1, 6) is None


def test_the_engine_keeps_its_rows_longest_first_after_a_join():
    policy = _policy()
    seen = []
    try:
        original = _row_attention._groups

        def spy(mask, B, Q, K):
            groups = original(mask, B, Q, K)
            if Q == 1 and groups is not None:
                seen.append([g[0] for g in groups])
            return groups

        _row_attention._groups = spy
        _batched(policy)
    finally:
        _row_attention._groups = original
        policy.close()
    assert len(seen) >= 10 and any(len(g) > 1 for g in seen)
    assert all(isinstance(rows, slice) for g in seen for rows in g)  # every group one slice of the batch


def test_row_sums_are_the_same_bits_at_every_batch_size():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(40, 49_152, generator=g)  # a SmolLM2-sized vocabulary: one row alone is split over threads
    full = row_sums(x)
    assert torch.allclose(full[:, 0], x.double().sum(-1).float(), rtol=1e-6)
    for n in (1, 2, 3, 17):
        for i in range(0, 40 - n + 1, n):
            assert torch.equal(row_sums(x[i:i + n]), full[i:i + n])


@pytest.mark.parametrize("threads", [1, 4])
def test_the_wrapped_attention_is_hfs_own_outside_the_engines_passes(threads):
    """Training and other callers get HF's sdpa function: the same logits as before install(), on any thread."""
    policy = _policy()
    try:
        model = policy.model
        ids = torch.tensor([[0, 0, 5, 40, 41], [7, 9, 11, 13, 15]])
        mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
        results = []

        def run():
            with torch.no_grad():
                results.append(model(input_ids=ids, attention_mask=mask).logits)

        workers = [threading.Thread(target=run) for _ in range(threads)]
        [w.start() for w in workers]
        [w.join() for w in workers]
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        assert _row_attention.install() and ALL_ATTENTION_FUNCTIONS["sdpa"] is _row_attention._sdpa_rows_apart
        ALL_ATTENTION_FUNCTIONS._local_mapping["sdpa"] = _row_attention._sdpa  # HF's own, for the reference
        try:
            with torch.no_grad():
                plain = model(input_ids=ids, attention_mask=mask).logits
        finally:
            del ALL_ATTENTION_FUNCTIONS._local_mapping["sdpa"]
        assert all(torch.equal(r, plain) for r in results)
    finally:
        policy.close()
