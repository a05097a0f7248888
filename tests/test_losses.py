"""Loss pieces against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from drmas_graph.errors import ConfigError
from drmas_graph.train.optim.losses import (
    agg_loss,
    entropy_from_logits,
    kl_penalty,
    list_kl_estimators,
    list_loss_aggregations,
    policy_loss,
    token_logprobs,
)

NAN = math.nan


def one_token(ratio: float, advantage: float, **kwargs) -> tuple[torch.Tensor, torch.Tensor, object]:
    """policy_loss on a single token with the given ratio; returns (loss, d loss / d logprob, stats)."""
    logprobs_BT = torch.tensor([[math.log(ratio) - 1.0]], requires_grad=True)
    old_logprobs_BT = torch.tensor([[-1.0]])
    advantages_B, mask_BT = torch.tensor([advantage]), torch.ones(1, 1)
    loss, stats = policy_loss(logprobs_BT, old_logprobs_BT, advantages_B, mask_BT, **kwargs)
    loss.backward()
    return loss, logprobs_BT.grad[0, 0], stats


# --- policy_loss -------------------------------------------------------------------------------------------


def test_ratio_inside_clip_is_plain_surrogate():
    # r = 1.1, A = 2: -A r = -2.2, -A clip(r) = -2.2, loss = -2.2; d/dlogp (-A r) = -A r = -2.2.
    loss, grad, stats = one_token(1.1, 2.0)
    assert_close(loss, torch.tensor(-2.2))
    assert_close(grad, torch.tensor(-2.2))
    assert stats.clip_frac == 0.0 and stats.dual_clip_frac == 0.0


def test_ratio_above_clip_high_with_positive_advantage_is_clipped():
    # r = 1.5, A = 1: max(-1.5, -1 * 1.2) = -1.2, a constant in logp, so the gradient is 0.
    loss, grad, stats = one_token(1.5, 1.0)
    assert_close(loss, torch.tensor(-1.2))
    assert grad.item() == 0.0
    assert stats.clip_frac == 1.0


def test_asymmetric_clip_high():
    # clip_high = 0.28 (DAPO's clip-higher): r = 1.25 is inside [0.8, 1.28], loss = -1.25, gradient -1.25;
    # r = 1.4 is clipped to 1.28.
    loss, grad, _ = one_token(1.25, 1.0, clip_high=0.28)
    assert_close((loss, grad), (torch.tensor(-1.25), torch.tensor(-1.25)))
    loss, grad, _ = one_token(1.4, 1.0, clip_high=0.28)
    assert_close((loss, grad), (torch.tensor(-1.28), torch.tensor(0.0)))


def test_ratio_below_clip_low_with_negative_advantage_is_clipped():
    # r = 0.5, A = -1: max(0.5, 1 * 0.8) = 0.8 (< the dual-clip cap 3), gradient 0.
    loss, grad, stats = one_token(0.5, -1.0)
    assert_close(loss, torch.tensor(0.8))
    assert grad.item() == 0.0
    assert stats.clip_frac == 1.0 and stats.dual_clip_frac == 0.0


def test_dual_clip_caps_negative_advantage_loss():
    # r = 5, A = -2: max(-A r, -A clip(r)) = max(10, 2.4) = 10 > cap -c A = 3 * 2 = 6, so loss = c |A| = 6.
    loss, grad, stats = one_token(5.0, -2.0)
    assert_close(loss, torch.tensor(6.0))
    assert grad.item() == 0.0
    assert stats.dual_clip_frac == 1.0 and stats.clip_frac == 0.0
    # Without the dual clip the unclipped branch wins: loss = 10, gradient -A r = 10.
    loss, grad, stats = one_token(5.0, -2.0, dual_clip=None)
    assert_close((loss, grad), (torch.tensor(10.0), torch.tensor(10.0)))
    assert stats.dual_clip_frac == 0.0


def ragged_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Ratios (A per sequence):  seq0 (A = +1): 1.0, 1.5
    #                           seq1 (A = -1): 5.0, <pad>
    #                           seq2 (A = -1): 0.5, 1.0
    old_logprobs_BT = torch.tensor([[-1.0, -2.0], [-0.5, -3.0], [-2.0, -1.0]])
    log_ratios_BT = torch.tensor([[0.0, math.log(1.5)], [math.log(5.0), 0.0], [math.log(0.5), 0.0]])
    logprobs_BT = old_logprobs_BT + log_ratios_BT
    logprobs_BT[1, 1] = NAN  # garbage under the mask must not leak into loss, stats or gradients
    mask_BT = torch.tensor([[1, 1], [1, 0], [1, 1]])
    return logprobs_BT.requires_grad_(), old_logprobs_BT, torch.tensor([1.0, -1.0, -1.0]), mask_BT


def test_policy_loss_on_a_ragged_batch():
    # Token losses: seq0: r=1 -> -1;  r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped)
    #               seq1: r=5 -> max(5, 1.2) = 5, capped by the dual clip at 3
    #               seq2: r=0.5 -> max(0.5, 0.8) = 0.8 (clipped);  r=1 -> 1
    # token-mean over 5 valid tokens: (-1 - 1.2 + 3 + 0.8 + 1) / 5 = 2.6 / 5 = 0.52.
    # clip_frac = 2/5, dual_clip_frac = 1/5; approx_kl = mean(-log r) = -ln(1 * 1.5 * 5 * 0.5 * 1) / 5
    # = -ln(3.75) / 5 = -0.264353; ratio_mean = (1 + 1.5 + 5 + 0.5 + 1) / 5 = 1.8; ratio_max = 5.
    # Gradient (token-mean): only unclipped tokens, d/dlogp = -A r / 5: seq0 t0 -> -0.2, seq2 t1 -> +0.2.
    logprobs_BT, old_logprobs_BT, advantages_B, mask_BT = ragged_batch()
    loss, stats = policy_loss(logprobs_BT, old_logprobs_BT, advantages_B, mask_BT)
    loss.backward()
    assert_close(loss, torch.tensor(0.52))
    assert stats.pg_loss == pytest.approx(0.52, abs=1e-6)
    assert stats.clip_frac == pytest.approx(0.4)
    assert stats.dual_clip_frac == pytest.approx(0.2)
    assert stats.approx_kl == pytest.approx(-math.log(3.75) / 5, abs=1e-6)
    assert stats.ratio_mean == pytest.approx(1.8, abs=1e-6)
    assert stats.ratio_max == pytest.approx(5.0, abs=1e-5)
    assert_close(logprobs_BT.grad, torch.tensor([[-0.2, 0.0], [0.0, 0.0], [0.0, 0.2]]))


def test_policy_loss_passes_aggregation_through():
    # seq-mean-token-sum: sequence sums -2.2, 3, 1.8 -> mean 2.6 / 3 = 0.866667.
    logprobs_BT, old_logprobs_BT, advantages_B, mask_BT = ragged_batch()
    loss, _ = policy_loss(logprobs_BT, old_logprobs_BT, advantages_B, mask_BT, agg="seq-mean-token-sum")
    assert_close(loss, torch.tensor(2.6 / 3))


def test_policy_loss_with_empty_mask_is_zero_not_nan():
    logprobs_BT = torch.zeros(2, 3, requires_grad=True)
    loss, stats = policy_loss(logprobs_BT, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and stats.ratio_max == 0.0 and stats.clip_frac == 0.0
    assert torch.equal(logprobs_BT.grad, torch.zeros(2, 3))


def test_policy_loss_rejects_bad_arguments():
    lp = torch.zeros(2, 3)
    with pytest.raises(ConfigError, match=r"advantages_B must have one entry per sequence, shape \(2,\)"):
        policy_loss(lp, lp, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ConfigError, match="mask_BT has shape"):
        policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 2))
    with pytest.raises(ConfigError, match="dual_clip must be > 1"):
        policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 3), dual_clip=0.5)
    with pytest.raises(ConfigError, match="valid modes: token-mean"):
        policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 3), agg="mean")


# --- agg_loss ----------------------------------------------------------------------------------------------

# Sequences of length 3, 2 and 1 (padding holds garbage):
#   [1, 2, 3]        sum 6, mean 2
#   [4, 5, -]        sum 9, mean 4.5
#   [6, -, -]        sum 6, mean 6
LOSS_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, NAN], [6.0, 100.0, math.inf]])
MASK_BT = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 21 / 6),  # (1 + 2 + 3 + 4 + 5 + 6) / 6 tokens = 3.5
        ("seq-mean-token-sum", 7.0),  # (6 + 9 + 6) / 3
        ("seq-mean-token-mean", 12.5 / 3),  # (2 + 4.5 + 6) / 3 = 4.166667
        ("seq-mean-token-sum-norm", 7 / 3),  # (6/3 + 9/3 + 6/3) / 3 with norm_len = T = 3
    ],
)
def test_agg_modes_on_a_ragged_mask(mode, expected):
    assert_close(agg_loss(LOSS_BT, MASK_BT, mode), torch.tensor(expected))


def test_seq_mean_token_sum_norm_uses_norm_len():
    # (6 + 9 + 6) / 10 / 3 = 0.7
    assert_close(agg_loss(LOSS_BT, MASK_BT, "seq-mean-token-sum-norm", norm_len=10), torch.tensor(0.7))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 3.5),  # the empty sequence adds no tokens
        ("seq-mean-token-sum", 21 / 4),  # (6 + 9 + 6 + 0) / 4 = 5.25
        ("seq-mean-token-mean", 12.5 / 4),  # (2 + 4.5 + 6 + 0) / 4 = 3.125
        ("seq-mean-token-sum-norm", 7 / 4),  # (2 + 3 + 2 + 0) / 4 = 1.75
    ],
)
def test_zero_length_sequence_contributes_zero_and_counts_as_a_sequence(mode, expected):
    loss_BT = torch.cat([LOSS_BT, torch.tensor([[NAN, 7.0, 7.0]])]).requires_grad_()
    mask_BT = torch.cat([MASK_BT, torch.zeros(1, 3, dtype=MASK_BT.dtype)])
    loss = agg_loss(loss_BT, mask_BT, mode)
    assert_close(loss, torch.tensor(expected))
    loss.backward()
    assert torch.isfinite(loss_BT.grad).all()
    assert torch.equal(loss_BT.grad[3], torch.zeros(3))


@pytest.mark.parametrize("mode", list_loss_aggregations())
def test_all_empty_batch_gives_zero(mode):
    assert agg_loss(torch.ones(2, 4), torch.zeros(2, 4), mode).item() == 0.0


def test_agg_unknown_mode_and_bad_shapes():
    with pytest.raises(ConfigError) as info:
        agg_loss(LOSS_BT, MASK_BT, "mean")
    for name in ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]:
        assert name in str(info.value)
    with pytest.raises(ConfigError, match=r"must both be \[B, T\]"):
        agg_loss(LOSS_BT, MASK_BT[:, :2], "token-mean")
    with pytest.raises(ConfigError, match="norm_len"):
        agg_loss(LOSS_BT, MASK_BT, "seq-mean-token-sum-norm", norm_len=0)


# --- kl_penalty --------------------------------------------------------------------------------------------


def test_kl_kinds_on_known_numbers():
    # p = 0.5, p_ref = 0.25:  k1 = ln 0.5 - ln 0.25 = ln 2 = 0.693147;  k2 = 0.5 (ln 2)^2 = 0.240227;
    # k3 with d = ln p_ref - ln p = -ln 2:  e^d - d - 1 = 0.5 + 0.693147 - 1 = 0.193147.
    # Equal logprobs give 0 for every kind.
    logprobs = torch.tensor([math.log(0.5), -1.3])
    ref_logprobs = torch.tensor([math.log(0.25), -1.3])
    ln2 = math.log(2)
    assert_close(kl_penalty(logprobs, ref_logprobs, "kl"), torch.tensor([ln2, 0.0]))
    assert_close(kl_penalty(logprobs, ref_logprobs, "mse"), torch.tensor([0.5 * ln2**2, 0.0]))
    assert_close(kl_penalty(logprobs, ref_logprobs, "low_var_kl"), torch.tensor([ln2 - 0.5, 0.0]))
    assert_close(kl_penalty(logprobs, ref_logprobs), torch.tensor([ln2 - 0.5, 0.0]))


def test_low_var_kl_is_clamped():
    # d = 30 -> clamped to 20: e^20 - 21 -> 10;  d = -30 -> -20: e^-20 + 19 = 19 -> 10.
    out = kl_penalty(torch.tensor([-30.0, 0.0]), torch.tensor([0.0, -30.0]), "low_var_kl")
    assert out.tolist() == [10.0, 10.0]


def test_kl_unknown_kind_lists_valid_ones():
    assert list_kl_estimators() == ["kl", "mse", "low_var_kl"]
    with pytest.raises(ConfigError, match="valid kinds: kl, mse, low_var_kl"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


# --- logits ------------------------------------------------------------------------------------------------


def test_entropy_of_uniform_is_log_v():
    logits_BTV = torch.stack([torch.zeros(2, 7), torch.full((2, 7), 1000.0)])  # 1000: no overflow
    assert_close(entropy_from_logits(logits_BTV), torch.full((2, 2), math.log(7)))


def test_entropy_of_a_two_token_distribution():
    # p = [0.25, 0.75]: H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.346574 + 0.215762 = 0.562335.
    logits_BTV = torch.tensor([[[math.log(0.25), math.log(0.75)]]]) + 3.0
    assert_close(entropy_from_logits(logits_BTV), torch.tensor([[0.562335]]))


def test_entropy_gradient_matches_the_direct_formula():
    torch.manual_seed(0)
    logits_BTV = (torch.randn(2, 3, 5) * 3).requires_grad_()
    entropy_from_logits(logits_BTV).sum().backward()
    ours = logits_BTV.grad.clone()
    logits_BTV.grad = None
    log_p = torch.log_softmax(logits_BTV, dim=-1)
    (-(log_p.exp() * log_p).sum(-1)).sum().backward()
    assert_close(ours, logits_BTV.grad)


def test_token_logprobs_with_temperature():
    # logits [1, 2, 3], T = 0.5 -> scaled [2, 4, 6]; logsumexp = 6 + ln(1 + e^-2 + e^-4) = 6.142932.
    # Token 2: 6 - 6.142932 = -0.142932; token 0: 2 - 6.142932 = -4.142932.
    logits_BTV = torch.tensor([[[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]])
    ids_BT = torch.tensor([[2, 0]])
    assert_close(token_logprobs(logits_BTV, ids_BT, temperature=0.5), torch.tensor([[-0.142932, -4.142932]]))
    # Against log_softmax(logits / T)[token], the way a sampler records it, on random bf16 logits.
    torch.manual_seed(0)
    logits_BTV = (torch.randn(2, 3, 11) * 4).to(torch.bfloat16)
    ids_BT = torch.randint(0, 11, (2, 3))
    manual_BT = torch.log_softmax(logits_BTV.float() / 0.7, dim=-1).gather(-1, ids_BT[..., None])[..., 0]
    out_BT = token_logprobs(logits_BTV, ids_BT, temperature=0.7)
    assert out_BT.dtype == torch.float32
    assert_close(out_BT, manual_BT)


def test_token_logprobs_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="temperature"):
        token_logprobs(torch.zeros(1, 1, 3), torch.zeros(1, 1, dtype=torch.long), temperature=0.0)
    with pytest.raises(ConfigError, match="ids_BT has shape"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 1, dtype=torch.long))
