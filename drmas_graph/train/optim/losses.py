"""Policy-gradient loss pieces: pure functions over tensors.

- `policy_loss`: PPO clipped surrogate with separate low/high clip and dual-clip, one scalar advantage
  per sequence broadcast over its response tokens.
- `agg_loss`: reduce a per-token loss matrix to a scalar; modes chosen by name from `LOSS_AGGREGATIONS`.
- `kl_penalty`: per-token KL estimators against a reference policy, by name from `KL_ESTIMATORS`.
- `token_logprobs`, `entropy_from_logits`: from the model's logits (defined next to the sampler whose
  recorded logprobs they must reproduce, `drmas_graph.engine._sampling`).

Axis suffixes: ``_B`` sequences (samples) in the batch, ``_T`` response tokens, ``_V`` vocabulary.
Masks are 0/1 (or bool) with 1 on valid response tokens; values at masked positions are ignored, even if
they are inf or NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import torch

from drmas_graph.engine import entropy_from_logits, token_logprobs
from drmas_graph.errors import ConfigError

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "LossAggregation",
    "PolicyLossStats",
    "agg_loss",
    "entropy_from_logits",
    "kl_penalty",
    "list_kl_estimators",
    "list_loss_aggregations",
    "masked_mean",
    "policy_loss",
    "token_logprobs",
]

# exp() of a log-ratio beyond this is treated as this; e^20 ~ 5e8 is already far outside any clip range.
_MAX_LOG_RATIO = 20.0


def masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the valid tokens; 0 when there are none."""
    valid_BT = mask_BT.bool()
    total = torch.where(valid_BT, values_BT, 0.0).sum()
    return total / valid_BT.sum().clamp(min=1)


# --- loss aggregation --------------------------------------------------------------------------------------


class LossAggregation(Protocol):
    """Reduces loss_BT over the valid tokens of mask_BT to a scalar."""

    def __call__(self, loss_BT: torch.Tensor, valid_BT: torch.Tensor, norm_len: int) -> torch.Tensor: ...


def _token_sums_B(loss_BT: torch.Tensor, valid_BT: torch.Tensor) -> torch.Tensor:
    return torch.where(valid_BT, loss_BT, 0.0).sum(dim=-1)


def _token_mean(loss_BT: torch.Tensor, valid_BT: torch.Tensor, norm_len: int) -> torch.Tensor:
    """``L = sum_{b,t} m_bt l_bt / sum_{b,t} m_bt``: every valid token weighs the same (verl default)."""
    return _token_sums_B(loss_BT, valid_BT).sum() / valid_BT.sum().clamp(min=1)


def _seq_mean_token_sum(loss_BT: torch.Tensor, valid_BT: torch.Tensor, norm_len: int) -> torch.Tensor:
    """``L = (1/B) sum_b sum_t m_bt l_bt``: sum over each sequence's tokens, mean over sequences."""
    return _token_sums_B(loss_BT, valid_BT).mean()


def _seq_mean_token_mean(loss_BT: torch.Tensor, valid_BT: torch.Tensor, norm_len: int) -> torch.Tensor:
    """``L = (1/B) sum_b (sum_t m_bt l_bt / sum_t m_bt)``: the original GRPO length normalisation."""
    lengths_B = valid_BT.sum(dim=-1).clamp(min=1)
    return (_token_sums_B(loss_BT, valid_BT) / lengths_B).mean()


def _seq_mean_token_sum_norm(loss_BT: torch.Tensor, valid_BT: torch.Tensor, norm_len: int) -> torch.Tensor:
    """``L = (1/B) sum_b sum_t m_bt l_bt / L_norm`` with a constant L_norm.

    Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") replaces GRPO's per-sequence
    division by |o_b| with one constant, so long wrong answers are not penalised less per token.
    Note: verl's mode of the same name sums (not averages) over sequences, which is B times larger.
    """
    return (_token_sums_B(loss_BT, valid_BT) / norm_len).mean()


LOSS_AGGREGATIONS: Mapping[str, LossAggregation] = MappingProxyType(
    {
        "token-mean": _token_mean,
        "seq-mean-token-sum": _seq_mean_token_sum,
        "seq-mean-token-mean": _seq_mean_token_mean,
        "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
    }
)


def list_loss_aggregations() -> list[str]:
    """Names accepted by ``agg_loss(mode=...)`` and ``policy_loss(agg=...)``."""
    return list(LOSS_AGGREGATIONS)


def agg_loss(
    loss_mat_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, *, norm_len: int | None = None
) -> torch.Tensor:
    """Reduce a per-token loss matrix to a scalar with the aggregation named ``mode``.

    ``norm_len`` is the constant of ``seq-mean-token-sum-norm`` (default: T, the padded response length;
    keep it fixed across training, e.g. the max generation length); other modes ignore it.
    A sequence with no valid tokens contributes 0 and still counts as one of the B sequences in the
    ``seq-mean-*`` modes; it contributes nothing to ``token-mean``. An all-empty batch gives 0.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ConfigError(f"unknown loss aggregation {mode!r}; valid modes: {', '.join(LOSS_AGGREGATIONS)}")
    if loss_mat_BT.dim() != 2 or loss_mat_BT.shape != mask_BT.shape:
        raise ConfigError(
            f"loss_mat_BT and mask_BT must both be [B, T]; got {tuple(loss_mat_BT.shape)} "
            f"and {tuple(mask_BT.shape)}"
        )
    if norm_len is None:
        norm_len = loss_mat_BT.shape[-1]
    if norm_len <= 0:
        raise ConfigError(f"norm_len must be a positive token count, got {norm_len}")
    return LOSS_AGGREGATIONS[mode](loss_mat_BT, mask_BT.bool(), norm_len)


# --- PPO clipped surrogate ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLossStats:
    """Diagnostics of one `policy_loss` call; token fractions and means are over valid tokens (0 if none)."""

    pg_loss: float
    """The aggregated policy-gradient loss (the value returned next to these stats)."""
    clip_frac: float
    """Fraction of tokens where the clipped branch of the surrogate was the active one."""
    dual_clip_frac: float
    """Fraction of tokens with A < 0 whose loss was capped at -c * A by the dual clip."""
    approx_kl: float
    """Mean of (old_logprob - logprob): a k1 estimate of KL(old || new)."""
    ratio_mean: float
    """Mean importance ratio exp(logprob - old_logprob)."""
    ratio_max: float
    """Largest importance ratio."""


def _check_policy_loss_args(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> None:
    if logprobs_BT.dim() != 2:
        raise ConfigError(f"logprobs_BT must be [B, T], got shape {tuple(logprobs_BT.shape)}")
    for name, tensor in (("old_logprobs_BT", old_logprobs_BT), ("mask_BT", mask_BT)):
        if tensor.shape != logprobs_BT.shape:
            raise ConfigError(
                f"{name} has shape {tuple(tensor.shape)} but logprobs_BT has {tuple(logprobs_BT.shape)}"
            )
    if advantages_B.shape != logprobs_BT.shape[:1]:
        raise ConfigError(
            f"advantages_B must have one entry per sequence, shape ({logprobs_BT.shape[0]},); "
            f"got {tuple(advantages_B.shape)}"
        )
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ConfigError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low} and {clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ConfigError(f"dual_clip must be > 1 (or None to disable it), got {dual_clip}")


def policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    norm_len: int | None = None,
    token_weights: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO clipped surrogate loss with dual-clip, aggregated by ``agg``; returns (loss, stats).

    Per token, with ``r = exp(logprob - old_logprob)`` and A the sequence's advantage:

        l = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))        (PPO, Schulman et al. 2017)
        l = min(l, -c * A)   for A < 0, c = dual_clip                       (dual-clip PPO, Ye et al. 2020)

    The separate low/high bounds and the dual clip follow verl's ``compute_policy_loss``
    (``core_algos.py``): the dual clip stops a token with A < 0 and a huge ratio from dominating the loss.
    The log-ratio is clamped to +-20 before exp, as verl does. ``old_logprobs_BT`` and ``advantages_B``
    are treated as constants (detached). ``agg`` and ``norm_len`` go to `agg_loss`.

    ``token_weights(old_logprobs_BT)``, when given, returns constant weights w_BT >= 0 that multiply l per token:
    the off-policy correction of asynchronous training, w = f(pi_old / pi_behav) (`drmas_graph.train.optim.offpolicy`).
    """
    _check_policy_loss_args(
        logprobs_BT, old_logprobs_BT, advantages_B, mask_BT, clip_low, clip_high, dual_clip
    )
    valid_BT = mask_BT.bool()
    log_ratio_BT = torch.where(valid_BT, logprobs_BT - old_logprobs_BT.detach(), 0.0)
    ratio_BT = torch.exp(log_ratio_BT.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    advantages_BT = advantages_B.detach().to(ratio_BT)[:, None].expand_as(ratio_BT)

    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    clip_active_BT = clipped_BT > unclipped_BT
    if dual_clip is None:
        dual_active_BT = torch.zeros_like(valid_BT)
    else:
        cap_BT = -dual_clip * advantages_BT
        dual_active_BT = (advantages_BT < 0) & (loss_BT > cap_BT)
        loss_BT = torch.where(dual_active_BT, cap_BT, loss_BT)
    if token_weights is not None:
        loss_BT = loss_BT * token_weights(old_logprobs_BT.detach())

    loss = agg_loss(loss_BT, valid_BT, agg, norm_len=norm_len)
    with torch.no_grad():
        any_valid = bool(valid_BT.any())
        stats = PolicyLossStats(
            pg_loss=loss.item(),
            clip_frac=masked_mean(clip_active_BT.float(), valid_BT).item(),
            dual_clip_frac=masked_mean(dual_active_BT.float(), valid_BT).item(),
            approx_kl=masked_mean(-log_ratio_BT, valid_BT).item(),
            ratio_mean=masked_mean(ratio_BT, valid_BT).item(),
            ratio_max=ratio_BT[valid_BT].max().item() if any_valid else 0.0,
        )
    return loss, stats


# --- KL to a reference policy ------------------------------------------------------------------------------


def _kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log p - log p_ref: unbiased for KL(p || p_ref), high variance, can be negative."""
    return logprobs - ref_logprobs


def _kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log p - log p_ref)^2: biased, low variance, >= 0."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def _kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(d) - d - 1 with d = log p_ref - log p: unbiased for KL(p || p_ref), low variance, >= 0.

    From J. Schulman, "Approximating KL Divergence" (2020). As in verl's ``kl_penalty`` (low_var_kl), d is
    clamped to [-20, 20] before exp and the result to [-10, 10], so one far-off token cannot explode.
    """
    d = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)


KL_ESTIMATORS: Mapping[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = MappingProxyType(
    {"kl": _kl_k1, "mse": _kl_k2, "low_var_kl": _kl_k3}
)


def list_kl_estimators() -> list[str]:
    """Names accepted by ``kl_penalty(kind=...)``."""
    return list(KL_ESTIMATORS)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference), same shape as the inputs; aggregate with `agg_loss`.

    ``kind``: ``"kl"`` (k1), ``"mse"`` (k2) or ``"low_var_kl"`` (k3, the reference setting).
    """
    if kind not in KL_ESTIMATORS:
        raise ConfigError(f"unknown KL estimator {kind!r}; valid kinds: {', '.join(KL_ESTIMATORS)}")
    if logprobs.shape != ref_logprobs.shape:
        raise ConfigError(
            f"ref_logprobs has shape {tuple(ref_logprobs.shape)} but logprobs has {tuple(logprobs.shape)}"
        )
    return KL_ESTIMATORS[kind](logprobs, ref_logprobs)
