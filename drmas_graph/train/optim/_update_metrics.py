"""What one `ModelUpdater.update` call did: per-agent and per-model metrics, and the tally that gathers
them over micro-batches and processes."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from drmas_graph.engine import world_size
from drmas_graph.types import Sample

__all__ = ["AgentUpdateMetrics", "UpdateMetrics"]


@dataclass(frozen=True)
class AgentUpdateMetrics:
    """What one `update` did to one agent's samples; token means are over valid response tokens. (The samples'
    advantages and response lengths are the step's metrics `agent/<a>/advantage_mean`, `advantage_std` and
    `response_length`, `_scoring.step_record`.)"""

    n_samples: int
    """Samples of this agent (all processes)."""
    pg_loss: float | None
    """Policy-gradient loss over this agent's samples (aggregated with loss_agg, before loss_weight); None (absent
    from the logs) when no sample of the agent was forwarded, as for ratio_max."""
    clip_frac: float | None
    """Fraction of tokens where the clipped PPO branch was active; None (absent from the logs) when no sample of
    the agent was forwarded."""
    dual_clip_frac: float | None
    """Fraction of tokens capped by the dual clip; None (absent from the logs) when no sample of the agent was
    forwarded."""
    approx_kl: float | None
    """Mean of old_logprob - logprob (k1 estimate of KL(old || new)), at the time of each forward pass; None
    (absent from the logs) when no sample of the agent was forwarded."""
    ratio_max: float | None
    """Largest importance ratio seen; None (absent from the logs) when no sample of the agent was forwarded (each
    had advantage 0 and was skipped: no ratio was taken, so none is reported, rather than 0)."""
    entropy: float | None
    """Mean entropy of the sampling distribution softmax(logits / T) (only when entropy_coef > 0); None (absent from
    the logs) when none of the agent's response tokens was forwarded."""
    logprob_mismatch: float | None
    """Mean |old_logprob - logprob| on the first mini-batch before any step, old_logprob being the samples'
    recorded one (the rollout's, or the trainer's recomputation): rollout vs trainer numerics. Stale samples
    (asynchronous training: older weights sampled them) are left out; None when every sample is stale."""
    kl_ref: float | None = None
    """Mean k3 KL to the reference model (only when kl_coef > 0); None (absent from the logs) when none of the
    agent's response tokens was forwarded."""
    rollout_logprob_gap: float | None = None
    """Mean |rollout - trainer| logprob over the agent's fresh samples (not stale), whenever the PPO ratio's old
    logprobs are the trainer's own (config `old_logprobs: trainer`, or `auto` on an embedded policy or in
    asynchronous training): measured on the update's first mini-batch with `update.n_minibatches: 1`, else by the
    recomputation before the update. Absent with the rollout's (`old_logprobs: rollout`, or `auto` on a served
    policy in synchronous training)."""
    grad_norm: float | None = None
    """Per-agent gradient norm: the 2-norm of the gradient of this agent's part of the loss, before clipping, mean
    over the update's optimizer steps (0 for a step without its samples; None, absent, when no step was taken). Its part of a mini-batch's loss is the
    sum of its micro-batches' terms w_a * agg(l over m) * n(m) / n(M) (`update` module docstring), so the agents'
    gradients add up to the model's. One agent on the model: equal to `model/<model>/grad_norm`, free. Several
    agents sharing it: measured as the change of the accumulated gradient over the agent's micro-batches (one
    agent's are contiguous), which keeps one copy of the trainable parameters' float32 gradients while a second
    agent accumulates; the step is unchanged. Absent with several agents on one model under DeepSpeed ZeRO >= 1
    or several processes (their gradients are not readable there)."""
    kl_start: float | None = None
    """KL to the start weights, no KL loss needed: mean over the agent's sampled response tokens of the update of
    k3 = exp(d) - d - 1, d = logp_start - logp_sample (logp_sample: the samples' recorded logprob, of the
    policy that sampled them; logp_start: the initial weights'). Logged when kl_coef > 0 (the KL reference is
    the start copy) or `update.kl_start_metric` is on (it keeps that copy, `kl_reference` says where, and runs
    one no-grad pass over the step's samples per update)."""


@dataclass(frozen=True)
class UpdateMetrics:
    """What one `ModelUpdater.update` call did; `to_dict` gives flat logging keys."""

    model: str
    """The updater's name."""
    loss: float | None
    """Total loss (pg + kl - entropy, weighted) per mini-batch, mean over the mini-batches that took a step; None
    (absent from the logs) when none did."""
    grad_norm: float | None
    """Global gradient 2-norm before clipping, mean over the optimizer steps; None (absent) when none was taken."""
    grad_norm_max: float | None
    """Largest pre-clip gradient norm over the optimizer steps; None (absent) when none was taken."""
    lr: float
    """Learning rate of the last step."""
    n_samples: int
    """Samples trained on (all processes)."""
    n_tokens: int
    """Response tokens processed (all processes)."""
    n_minibatches: int
    """Optimizer steps taken."""
    skipped_minibatches: int = 0
    """Mini-batches that took no optimizer step because every one of their samples had advantage 0 (with kl_coef
    and entropy_coef 0 their gradient is exactly 0, yet an AdamW step would still move the weights through its
    momentum and weight decay). `n_minibatches` + this = `update.n_minibatches` (fewer when a step had fewer
    samples)."""
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
                    "skipped_minibatches", "forward_tokens", "packed"):
            if getattr(self, key) is not None:  # nothing measured (no step): no metric
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
        if world_size() == 1:
            return self
        parts: list[Any] = [None] * world_size()
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
                   rollout_gap: bool, grad_norm: float | None = None) -> AgentUpdateMetrics:
    def mean(name: str) -> float:
        return tally.mean(("agent", agent, name))

    def measured(name: str) -> float | None:
        """None, not 0, where nothing was measured: no sample of the agent was forwarded, or none had a token."""
        return mean(name) if tally.weights.get(("agent", agent, name), 0.0) > 0 else None

    return AgentUpdateMetrics(
        n_samples=int(tally.sums[("agent", agent, "n_samples")]), pg_loss=measured("pg_loss"),
        clip_frac=measured("clip_frac"), dual_clip_frac=measured("dual_clip_frac"), approx_kl=measured("approx_kl"),
        ratio_max=tally.maxima.get(("agent", agent, "ratio_max")),
        entropy=measured("entropy") if with_entropy else None, logprob_mismatch=measured("logprob_mismatch"),
        kl_ref=measured("kl_ref") if with_kl else None,
        rollout_logprob_gap=measured("rollout_logprob_gap") if rollout_gap else None,
        grad_norm=grad_norm, kl_start=measured("kl_start"),
    )


def agent_grad_norms(tally: _Tally, agents: Sequence[str], grad_norms: Sequence[float]) -> dict[str, float | None]:
    """`AgentUpdateMetrics.grad_norm` of each agent: the model's norm when the update had one agent; else the mean
    over the optimizer steps of the norms `AgentGrads` recorded (None when a step could not measure them)."""
    n_steps = len(grad_norms)
    if n_steps == 0:  # no optimizer step: nothing measured
        return {a: None for a in agents}
    if len(agents) == 1:
        return {agents[0]: sum(grad_norms) / n_steps}
    if tally.sums.get(("model", "agent_grad_steps"), 0.0) != n_steps or n_steps == 0:
        return {a: None for a in agents}
    return {a: tally.sums.get(("agent", a, "grad_norm"), 0.0) / n_steps for a in agents}


def readable_grads(engine: Any) -> tuple[Callable[[], list[torch.Tensor | None]] | None, float]:
    """(a reader of the gradients the engine's next step uses, as accumulated so far, by parameter; their loss
    scale): the torch backend's float32 masters, DeepSpeed ZeRO-0's parameters (float32 only); (None, 1.0) for
    ZeRO >= 1, whose gradients live in the optimizer's partitions, and for several processes."""
    if world_size() > 1:  # each process holds its own samples' part before the average: not the agent's gradient
        return None, 1.0
    masters = getattr(engine, "masters", None)
    if masters is not None:
        return (lambda: [m.grad for m in masters]), float(engine.loss_scale.scale)
    if getattr(engine, "zero_stage", None) == 0:
        params = [p for p in engine.module.parameters() if p.requires_grad]
        return (lambda: [p.grad for p in params]), 1.0
    return None, 1.0


class AgentGrads:
    """The gradient norm of each agent's part of one mini-batch's loss (`AgentUpdateMetrics.grad_norm`).

    `begin(agent)` before each micro-batch: at a change of agent the previous agent's norm is taken as the change
    of the accumulated gradient since its first micro-batch (a copy made then: one float32 gradient copy at a
    time); `step(optimizer_step, tally)` after the last backward closes the last agent, steps and records (a
    mini-batch of one agent gets the step's own norm). ``read`` gives the accumulated gradients
    by parameter (None: not readable, so a mini-batch of several agents is not measured); ``scale`` is the loss
    scale they carry. It only reads gradients: the step is unchanged."""

    def __init__(self, read: Callable[[], list[torch.Tensor | None]] | None, scale: float = 1.0) -> None:
        self.read, self.scale = read, scale
        self.norms: dict[str, float] = {}
        self.agents: list[str] = []
        self._start: list[torch.Tensor | None] | None = None

    def begin(self, agent: str) -> None:
        if self.agents and agent == self.agents[-1]:
            return
        self._close()
        self.agents.append(agent)
        if self.read is not None:
            self._start = [None if g is None else g.detach().clone() for g in self.read()]

    def step(self, optimizer_step: Callable[[], float], tally: _Tally) -> float:
        """After the last backward: close the last agent, run ``optimizer_step`` (it returns the pre-clip norm),
        record the norms in ``tally``; returns the step's norm."""
        if len(self.agents) > 1:
            self._close()
        self._start = None
        norm = optimizer_step()
        self.record(tally, norm)
        return norm

    @torch.no_grad()
    def _close(self) -> None:
        if not self.agents or self.read is None or self._start is None:
            return
        squares = 0.0
        for g, g0 in zip(self.read(), self._start):
            if g is not None:
                squares += float((g.float() if g0 is None else g.float() - g0.float()).pow(2).sum())
        self.norms[self.agents[-1]] = math.sqrt(squares) / self.scale
        self._start = None

    def record(self, tally: _Tally, step_norm: float) -> None:
        """Add this mini-batch's norms to ``tally`` (nothing when they could not be measured, or with several
        processes, where `agent_grad_norms` gives a model of one agent the model's norm)."""
        if world_size() > 1:
            return
        if len(self.agents) == 1:  # one agent: the step's norm itself (all backends, exact)
            self.norms = {self.agents[0]: step_norm}
        elif len(self.norms) < len(self.agents):
            return
        for agent, norm in self.norms.items():
            tally.count(("agent", agent, "grad_norm"), norm)
        tally.count(("model", "agent_grad_steps"), 1.0)


def tally_kl_start(tally: _Tally, samples: Sequence[Sample], start_logprobs: Mapping[int, torch.Tensor]) -> None:
    """Add each sample's k3 KL terms to the start weights (`AgentUpdateMetrics.kl_start`): start_logprobs holds
    id(sample) -> the start weights' logprobs of its response tokens ({} when the metric is off). logp_sample is
    the sampling policy's: `behaviour_logprobs` of a stale sample (its `old_logprobs` are the proximal policy's)."""
    for s in samples:
        if id(s) in start_logprobs and len(s.response_ids):
            sampled = s.behaviour_logprobs if s.behaviour_logprobs is not None else s.old_logprobs
            d_T = start_logprobs[id(s)].double().cpu() - torch.as_tensor(sampled, dtype=torch.float64)
            k3_T = (torch.exp(d_T.clamp(-20.0, 20.0)) - d_T - 1.0).clamp(-10.0, 10.0)  # as losses.kl_penalty
            tally.add(("agent", s.agent, "kl_start"), float(k3_T.mean()), weight=float(len(s.response_ids)))
