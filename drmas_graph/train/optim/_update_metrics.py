"""What one `ModelUpdater.update` call did: per-agent and per-model metrics, and the tally that gathers
them over micro-batches and processes."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from drmas_graph.train.engines._engines import _world_size
from drmas_graph.types import Sample

__all__ = ["AgentUpdateMetrics", "UpdateMetrics"]


@dataclass(frozen=True)
class AgentUpdateMetrics:
    """What one `update` did to one agent's samples; token means are over valid response tokens. (The samples'
    advantages and response lengths are the step's metrics `agent/<a>/advantage_mean`, `advantage_std` and
    `response_length`, `_scoring.step_record`.)"""

    n_samples: int
    """Samples of this agent (all processes)."""
    pg_loss: float
    """Policy-gradient loss over this agent's samples (aggregated with loss_agg, before loss_weight)."""
    clip_frac: float
    """Fraction of tokens where the clipped PPO branch was active."""
    dual_clip_frac: float
    """Fraction of tokens capped by the dual clip."""
    approx_kl: float
    """Mean of old_logprob - logprob (k1 estimate of KL(old || new)), at the time of each forward pass."""
    ratio_max: float
    """Largest importance ratio seen."""
    entropy: float | None
    """Mean entropy of the sampling distribution softmax(logits / T) (only when entropy_coef > 0)."""
    logprob_mismatch: float
    """Mean |old_logprob - logprob| on the first mini-batch before any step, old_logprob being the samples'
    recorded one (the rollout's, or the trainer's recomputation): rollout vs trainer numerics."""
    kl_ref: float | None = None
    """Mean k3 KL to the reference model (only when kl_coef > 0)."""
    rollout_logprob_gap: float | None = None
    """Mean |rollout - trainer| logprob on the first mini-batch, when the ratio's old logprobs are the update's own
    (old_logprobs='current'); the trainer reports it itself when it recomputes them."""


@dataclass(frozen=True)
class UpdateMetrics:
    """What one `ModelUpdater.update` call did; `to_dict` gives flat logging keys."""

    model: str
    """The updater's name."""
    loss: float
    """Total loss (pg + kl - entropy, weighted) per mini-batch, mean over mini-batches."""
    grad_norm: float
    """Global gradient 2-norm before clipping, mean over mini-batches."""
    grad_norm_max: float
    """Largest pre-clip gradient norm over mini-batches."""
    lr: float
    """Learning rate of the last step."""
    n_samples: int
    """Samples trained on (all processes)."""
    n_tokens: int
    """Response tokens processed (all processes)."""
    n_minibatches: int
    """Optimizer steps taken."""
    forward_tokens: int = 0
    """Token positions the training forward passes computed (all processes): padded rows x length, or the
    distinct prefixes of packed micro-batches."""
    packed: bool = False
    """Whether micro-batches were packed into sequence trees (`update.pack_prefixes` and a model that takes it)."""
    agents: Mapping[str, AgentUpdateMetrics] = field(default_factory=dict)
    """Per-agent metrics, by agent name."""

    def to_dict(self) -> dict[str, float]:
        """Flat keys: ``model/<name>/grad_norm``, ``agent/<agent>/pg_loss``, ..."""
        out: dict[str, float] = {}
        for key in ("loss", "grad_norm", "grad_norm_max", "lr", "n_samples", "n_tokens", "n_minibatches",
                    "forward_tokens", "packed"):
            out[f"model/{self.model}/{key}"] = float(getattr(self, key))
        for agent, metrics in self.agents.items():
            for key, value in vars(metrics).items():
                if value is not None:
                    out[f"agent/{agent}/{key}"] = float(value)
        return out


class _Tally:
    """Weighted sums and maxima of metrics, mergeable over processes. Keys are tuples."""

    def __init__(self) -> None:
        self.sums: dict[tuple, float] = defaultdict(float)
        self.weights: dict[tuple, float] = defaultdict(float)
        self.maxima: dict[tuple, float] = {}

    def add(self, key: tuple, value: float, weight: float = 1.0) -> None:
        self.sums[key] += value * weight
        self.weights[key] += weight

    def count(self, key: tuple, value: float) -> None:
        self.sums[key] += value

    def max(self, key: tuple, value: float) -> None:
        self.maxima[key] = max(self.maxima.get(key, -math.inf), value)

    def mean(self, key: tuple) -> float:
        weight = self.weights.get(key, 0.0)
        return self.sums.get(key, 0.0) / weight if weight > 0 else 0.0

    def merged(self) -> _Tally:
        """The tally of all processes together (a collective call when torch.distributed runs)."""
        if _world_size() == 1:
            return self
        parts: list[Any] = [None] * _world_size()
        torch.distributed.all_gather_object(parts, (dict(self.sums), dict(self.weights), self.maxima))
        out = _Tally()
        for sums, weights, maxima in parts:
            for key, value in sums.items():
                out.sums[key] += value
            for key, value in weights.items():
                out.weights[key] += value
            for key, value in maxima.items():
                out.max(key, value)
        return out


def _tally_samples(tally: _Tally, samples: Sequence[Sample]) -> None:
    for s in samples:
        tally.count(("agent", s.agent, "n_samples"), 1.0)


def _agent_metrics(tally: _Tally, agent: str, with_kl: bool, with_entropy: bool,
                   rollout_gap: bool) -> AgentUpdateMetrics:
    def mean(name: str) -> float:
        return tally.mean(("agent", agent, name))

    return AgentUpdateMetrics(
        n_samples=int(tally.sums[("agent", agent, "n_samples")]), pg_loss=mean("pg_loss"),
        clip_frac=mean("clip_frac"), dual_clip_frac=mean("dual_clip_frac"), approx_kl=mean("approx_kl"),
        ratio_max=tally.maxima.get(("agent", agent, "ratio_max"), 0.0), entropy=mean("entropy") if with_entropy else None,
        logprob_mismatch=mean("logprob_mismatch"), kl_ref=mean("kl_ref") if with_kl else None,
        rollout_logprob_gap=mean("rollout_logprob_gap") if rollout_gap else None,
    )
