"""Off-policy correction for asynchronous training: per-token weights of the policy-gradient loss.

With `async.max_staleness` >= 1 a trained response may have been sampled by weights older than the
trainer's: the behaviour policy pi_behav. Decoupled PPO (Hilton, Cobbe, Schulman 2021, "Batch size-invariance
for policy optimization", the objective AReaL trains with) separates the two jobs the "old" policy does in PPO:

    l_t = w_t * max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high))       (then the dual clip, as in `losses`)
    r_t = pi_theta(y_t) / pi_prox(y_t)      the trust region, around pi_prox = the trainer's weights at the
                                            start of this update (the ratio's denominator, `old_logprobs`)
    w_t = pi_prox(y_t) / pi_behav(y_t)      the importance weight of the sampling policy: data, no gradient

Unbounded, w_t makes the gradient's variance explode on tokens the behaviour policy found unlikely; the
corrections bound it by name (`CORRECTIONS`), with cap C (`async.is_cap`):

    truncate:  w_t = min(w_t, C)                     truncated importance sampling (verl's `tis_imp_ratio_cap`,
                                                     after IMPALA's truncated rho: Espeholt et al. 2018)
    mask:      w_t = w_t if w_t <= C else 0          AReaL's `behav_imp_weight_cap`: such tokens leave the loss
    none:      w_t = 1                               the ratio against pi_prox alone (biased; an ablation)

w_t >= 0 is a constant, so weighting the clipped loss equals clipping with per-token advantages A w_t; the
loss's normaliser (tokens or sequences) is unchanged, as in both references. A sample that is not stale (the
trainer's weights sampled it, `Sample.behaviour_logprobs` None) has w_t = 1 exactly.

Axis suffixes: ``_B`` samples of a micro-batch, ``_T`` response tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from drmas_graph.errors import ConfigError
from drmas_graph.types import Sample

__all__ = ["CORRECTIONS", "CorrectionStats", "OffPolicyCorrection", "importance_weights"]

# exp() of a log-weight beyond this is treated as this (as `losses` clamps log-ratios)
_MAX_LOG_WEIGHT = 20.0


def _truncate(w_BT: torch.Tensor, cap: float) -> torch.Tensor:
    """min(w, C)."""
    return w_BT.clamp(max=cap)


def _mask(w_BT: torch.Tensor, cap: float) -> torch.Tensor:
    """w where w <= C, else 0."""
    return torch.where(w_BT <= cap, w_BT, 0.0)


def _none(w_BT: torch.Tensor, cap: float) -> torch.Tensor:
    """1 everywhere."""
    return torch.ones_like(w_BT)


CORRECTIONS: Mapping[str, Callable[[torch.Tensor, float], torch.Tensor]] = MappingProxyType(
    {"truncate": _truncate, "mask": _mask, "none": _none})
"""Bounded importance weights by name: f(w_BT, C) (module docstring)."""


def importance_weights(prox_logprobs_BT: torch.Tensor, behaviour_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor,
                       *, correction: str = "truncate", cap: float = 2.0) -> torch.Tensor:
    """w_bt = f(exp(logp_prox_bt - logp_behav_bt), C) at valid tokens, 0 at masked ones (f by `correction`).

    The log-weight is clamped to +-20 before exp (values at masked positions may be anything, inf included).
    """
    if correction not in CORRECTIONS:
        raise ConfigError(f"unknown off-policy correction {correction!r}; valid: {', '.join(CORRECTIONS)}")
    if not cap >= 1.0:
        raise ConfigError(f"the importance-weight cap must be >= 1, got {cap}")
    if prox_logprobs_BT.shape != behaviour_logprobs_BT.shape or prox_logprobs_BT.shape != mask_BT.shape:
        raise ConfigError(f"prox, behaviour logprobs and mask must have one shape; got {tuple(prox_logprobs_BT.shape)}, "
                          f"{tuple(behaviour_logprobs_BT.shape)}, {tuple(mask_BT.shape)}")
    valid_BT = mask_BT.bool()
    log_w_BT = torch.where(valid_BT, prox_logprobs_BT.detach() - behaviour_logprobs_BT.detach(), 0.0)
    w_BT = torch.exp(log_w_BT.clamp(-_MAX_LOG_WEIGHT, _MAX_LOG_WEIGHT))
    return torch.where(valid_BT, CORRECTIONS[correction](w_BT, cap), 0.0)


@dataclass
class CorrectionStats:
    """Importance weights of one agent's stale tokens over an update (one process)."""

    tokens: int = 0
    """Valid tokens of stale samples."""
    weight_sum: float = 0.0
    """Sum of their weights after the correction."""
    raw_max: float = 0.0
    """Largest weight before the correction, pi_prox / pi_behav."""
    capped: int = 0
    """Tokens whose weight exceeded the cap (truncated or masked)."""

    def merge(self, other: CorrectionStats) -> CorrectionStats:
        return CorrectionStats(self.tokens + other.tokens, self.weight_sum + other.weight_sum,
                               max(self.raw_max, other.raw_max), self.capped + other.capped)

    def metrics(self, agent: str) -> dict[str, float]:
        """`agent/<a>/is_weight_mean`, `is_weight_max` (before the cap) and `is_capped_frac`."""
        n = max(self.tokens, 1)
        return {f"agent/{agent}/is_weight_mean": self.weight_sum / n, f"agent/{agent}/is_weight_max": self.raw_max,
                f"agent/{agent}/is_capped_frac": self.capped / n}


@dataclass
class OffPolicyCorrection:
    """The updater's hook (`ModelUpdater.correction`): the loss weights of a micro-batch, and their statistics."""

    correction: str = "truncate"
    """Name in `CORRECTIONS`."""
    cap: float = 2.0
    """The cap C."""
    stats: dict[str, CorrectionStats] = field(default_factory=dict)
    """Per agent, since the last `pop_stats`."""

    def __post_init__(self) -> None:
        importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), correction=self.correction,
                           cap=self.cap)  # refuse a bad name or cap now

    def token_weights(self, samples: Sequence[Sample], mask_BT: torch.Tensor
                      ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """For one micro-batch (one agent): a function of the ratio's denominator logp_prox_BT giving w_BT, or None
        when no sample is stale (or the correction is `none`): then every weight is 1."""
        stale = [s.behaviour_logprobs is not None for s in samples]
        if not any(stale) or self.correction == "none":
            return None
        behaviour_BT = torch.zeros(mask_BT.shape, dtype=torch.float32)
        for b, s in enumerate(samples):
            if s.behaviour_logprobs is not None:
                if len(s.behaviour_logprobs) != len(s.response_ids):
                    raise ConfigError(f"sample of agent {s.agent!r} (episode {s.episode_id!r}, turn {s.turn_index}) "
                                      f"has {len(s.response_ids)} response ids but {len(s.behaviour_logprobs)} "
                                      "behaviour logprobs")
                behaviour_BT[b, : len(s.behaviour_logprobs)] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        behaviour_BT = behaviour_BT.to(mask_BT.device)
        stale_BT = torch.tensor(stale, device=mask_BT.device)[:, None] & mask_BT.bool()
        agent = samples[0].agent

        def weights(prox_BT: torch.Tensor) -> torch.Tensor:
            prox_BT = prox_BT.detach().float()
            behav_BT = torch.where(stale_BT, behaviour_BT, prox_BT)  # not stale: w = exp(0) = 1 exactly
            w_BT = importance_weights(prox_BT, behav_BT, mask_BT, correction=self.correction, cap=self.cap)
            self._record(agent, prox_BT - behav_BT, w_BT, stale_BT)
            return w_BT

        return weights

    @torch.no_grad()
    def _record(self, agent: str, log_w_BT: torch.Tensor, w_BT: torch.Tensor, stale_BT: torch.Tensor) -> None:
        raw = torch.exp(log_w_BT[stale_BT].clamp(max=_MAX_LOG_WEIGHT))
        if raw.numel() == 0:
            return
        part = CorrectionStats(tokens=int(raw.numel()), weight_sum=float(w_BT[stale_BT].sum()),
                               raw_max=float(raw.max()), capped=int((raw > self.cap).sum()))
        self.stats[agent] = self.stats.get(agent, CorrectionStats()).merge(part)

    def pop_stats(self) -> dict[str, CorrectionStats]:
        """The statistics since the last call, per agent; resets them."""
        out, self.stats = self.stats, {}
        return out
