"""Per-model policy update: agent-wise clipped policy-gradient steps on one trainable model.

One `ModelUpdater` owns one trainable model (``nn.Module``). Several agents may share it (Dr. MAS "shared"
setting): their samples are trained together, but every micro-batch holds samples of one agent only, so
each agent's clip range, loss weight and micro-batch size (`LossSettings`) apply. Per iteration:

    samples --seeded shuffle--> n_minibatches mini-batches (one optimizer step each)
    mini-batch --group by agent--> micro-batches (forward + backward each, gradients accumulate)

Loss of one mini-batch M, with l_bt the per-token loss (PPO clipped surrogate with dual clip, see
`drmas_graph.losses.policy_loss`), w_a the agent's loss weight and m = micro-batch:

    l_bt  = pg_bt + kl_coef * k3(logp_bt, logp_ref_bt) - entropy_coef * H_bt
    L_M   = sum_m  w_a(m) * agg(l over m) * n(m) / n(M)

where agg is the aggregation ``loss_agg`` and n counts what agg averages over: valid tokens for
"token-mean", sequences for the "seq-mean-*" modes. Then L_M equals agg over the whole mini-batch whatever
the micro-batch size. Samples of agents with loss weight 0 are not counted in n(M) (they only feed
metrics). With KL and entropy off, samples whose advantage is exactly 0 (zero-variance groups) are not
forwarded at all: their gradient is exactly 0, and they still count in n(M), so the step is unchanged
(per-token metrics such as entropy then cover the forwarded samples). With P processes, n(M) is summed over all of them and each loss is multiplied by P (DeepSpeed
and the torch backend average gradients over processes), so P processes each given 1/P of the samples
take exactly the step of one process given all of them.

Backends, chosen by `UpdateSettings.backend`:
- "deepspeed": ``deepspeed.initialize`` with a client ``torch.optim.AdamW`` and ZeRO stage 0, 1 or 2.
  ZeRO 0-2 keep every parameter whole on every process, in the module's own ``nn.Parameter`` objects, so
  a rollout policy serving the same module sees the new weights without any copy.
- "torch": plain AdamW and ``clip_grad_norm_``; numerically the same step as DeepSpeed on one process.

Departures from verl (the reference implementation of Dr. MAS):
- Loss weights per agent and micro-batches of one agent each (verl mixes agents of one model).
- The number of micro-batches varies per mini-batch; processes with fewer run zero-loss backward passes so
  that every process takes part in every gradient reduction.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import random
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from drmas_graph._engines import _ENGINES, _all_reduce, _barrier, _rank, _world_size
from drmas_graph.errors import ConfigError
from drmas_graph.losses import (
    LOSS_AGGREGATIONS,
    agg_loss,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    token_logprobs,
)
from drmas_graph.types import Sample

__all__ = [
    "BACKENDS",
    "ZERO_STAGES",
    "AgentUpdateMetrics",
    "LossSettings",
    "ModelUpdater",
    "UpdateMetrics",
    "UpdateSettings",
]

BACKENDS = ("deepspeed", "torch")
ZERO_STAGES = (0, 1, 2)

# Axis suffixes: _B rows (samples) of a micro-batch, _L prompt+response positions, _T response tokens,
# _V vocabulary.


# --- settings ----------------------------------------------------------------------------------------------


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class LossSettings:
    """How the samples of one agent enter the loss."""

    clip_low: float = 0.2
    """PPO lower clip: the ratio is clipped at 1 - clip_low."""
    clip_high: float = 0.2
    """PPO upper clip: the ratio is clipped at 1 + clip_high."""
    dual_clip: float | None = 3.0
    """Dual-clip constant c > 1 for negative advantages (Ye et al. 2020); None disables it."""
    loss_weight: float = 1.0
    """Multiplies this agent's loss; 0 trains nothing on its samples (they are still measured)."""
    micro_batch_size: int = 4
    """Samples per forward/backward pass."""

    def __post_init__(self) -> None:
        _require(0.0 <= self.clip_low < 1.0, f"LossSettings.clip_low must be in [0, 1), got {self.clip_low}")
        _require(self.clip_high >= 0.0, f"LossSettings.clip_high must be >= 0, got {self.clip_high}")
        _require(self.dual_clip is None or self.dual_clip > 1.0,
                 f"LossSettings.dual_clip must be > 1, or None to disable it; got {self.dual_clip}")
        _require(math.isfinite(self.loss_weight) and self.loss_weight >= 0.0,
                 f"LossSettings.loss_weight must be a finite number >= 0, got {self.loss_weight}")
        _require(isinstance(self.micro_batch_size, int) and self.micro_batch_size >= 1,
                 f"LossSettings.micro_batch_size must be an int >= 1, got {self.micro_batch_size!r}")


@dataclass(frozen=True)
class UpdateSettings:
    """Optimizer and loss settings of one trainable model."""

    lr: float = 1e-6
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay, applied to every parameter."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment decay rates."""
    grad_clip: float | None = 1.0
    """Clip the global gradient 2-norm to this value before each step; None disables clipping."""
    n_minibatches: int = 1
    """Optimizer steps per `update` call: the shuffled samples are split into this many mini-batches."""
    loss_agg: str = "token-mean"
    """Loss aggregation, one of `drmas_graph.losses.LOSS_AGGREGATIONS`."""
    norm_len: int | None = None
    """The constant L_norm of "seq-mean-token-sum-norm" (e.g. the max response length); required there."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to a frozen copy of the initial model; 0 builds no copy."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (loss -= entropy_coef * entropy)."""
    backend: str = "deepspeed"
    """"deepspeed" (needs the `deepspeed` extra) or "torch" (plain AdamW)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage, 0, 1 or 2 (only with backend="deepspeed")."""
    seed: int = 0
    """Seeds the shuffle that splits samples into mini-batches."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        _require(math.isfinite(self.lr) and self.lr >= 0, f"UpdateSettings.lr must be a number >= 0, got {self.lr}")
        _require(self.weight_decay >= 0, f"UpdateSettings.weight_decay must be >= 0, got {self.weight_decay}")
        _require(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
                 f"UpdateSettings.betas must be two numbers in [0, 1), got {self.betas}")
        _require(self.grad_clip is None or self.grad_clip > 0,
                 f"UpdateSettings.grad_clip must be > 0, or None to disable clipping; got {self.grad_clip}")
        _require(isinstance(self.n_minibatches, int) and self.n_minibatches >= 1,
                 f"UpdateSettings.n_minibatches must be an int >= 1, got {self.n_minibatches!r}")
        _require(self.loss_agg in LOSS_AGGREGATIONS, f"UpdateSettings.loss_agg: unknown aggregation "
                 f"{self.loss_agg!r}; valid: {', '.join(LOSS_AGGREGATIONS)}")
        _require(self.loss_agg != "seq-mean-token-sum-norm" or self.norm_len is not None,
                 "UpdateSettings.norm_len must be set for loss_agg='seq-mean-token-sum-norm' "
                 "(a constant such as the max response length)")
        _require(self.norm_len is None or (isinstance(self.norm_len, int) and self.norm_len >= 1),
                 f"UpdateSettings.norm_len must be an int >= 1 or None, got {self.norm_len!r}")
        for name in ("kl_coef", "entropy_coef"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value >= 0, f"UpdateSettings.{name} must be a number >= 0, got {value}")
        _require(self.backend in BACKENDS,
                 f"UpdateSettings.backend: unknown backend {self.backend!r}; valid: {', '.join(BACKENDS)}")
        _require(self.zero_stage in ZERO_STAGES, f"UpdateSettings.zero_stage must be one of {ZERO_STAGES}, got "
                 f"{self.zero_stage!r} (ZeRO-3 shards parameters, which the rollout policy cannot serve from)")
        _require(self.backend == "deepspeed" or self.zero_stage == 0,
                 f"UpdateSettings.zero_stage={self.zero_stage} needs backend='deepspeed'; set zero_stage=0 for "
                 "backend='torch'")


# --- metrics -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentUpdateMetrics:
    """What one `update` did to one agent's samples; token means are over valid response tokens."""

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
    entropy: float
    """Mean entropy of the sampling distribution softmax(logits / T)."""
    response_length: float
    """Mean response length in tokens."""
    advantage_mean: float
    """Mean advantage of the samples."""
    advantage_std: float
    """Population standard deviation of the advantages."""
    logprob_mismatch: float
    """Mean |old_logprob - logprob| on the first mini-batch before any step: rollout vs trainer numerics."""
    kl_ref: float | None = None
    """Mean k3 KL to the reference model (only when kl_coef > 0)."""


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
    agents: Mapping[str, AgentUpdateMetrics] = field(default_factory=dict)
    """Per-agent metrics, by agent name."""

    def to_dict(self) -> dict[str, float]:
        """Flat keys: ``model/<name>/grad_norm``, ``agent/<agent>/pg_loss``, ..."""
        out: dict[str, float] = {}
        for key in ("loss", "grad_norm", "grad_norm_max", "lr", "n_samples", "n_tokens", "n_minibatches"):
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
        tally.add(("agent", s.agent, "response_length"), len(s.response_ids))
        tally.add(("agent", s.agent, "advantage_mean"), s.advantage)
        tally.add(("agent", s.agent, "advantage_sq"), s.advantage**2)


def _agent_metrics(tally: _Tally, agent: str, with_kl: bool) -> AgentUpdateMetrics:
    def mean(name: str) -> float:
        return tally.mean(("agent", agent, name))

    adv_mean = mean("advantage_mean")
    return AgentUpdateMetrics(
        n_samples=int(tally.sums[("agent", agent, "n_samples")]), pg_loss=mean("pg_loss"),
        clip_frac=mean("clip_frac"), dual_clip_frac=mean("dual_clip_frac"), approx_kl=mean("approx_kl"),
        ratio_max=tally.maxima.get(("agent", agent, "ratio_max"), 0.0), entropy=mean("entropy"),
        response_length=mean("response_length"), advantage_mean=adv_mean,
        advantage_std=math.sqrt(max(mean("advantage_sq") - adv_mean**2, 0.0)),
        logprob_mismatch=mean("logprob_mismatch"), kl_ref=mean("kl_ref") if with_kl else None,
    )


# --- batches -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Batch:
    """A right-padded micro-batch of one agent: row b is prompt + response of sample b."""

    agent: str
    input_ids_BL: torch.Tensor
    attention_mask_BL: torch.Tensor
    logit_index_BT: torch.Tensor
    """Position whose logits predict response token t: len(prompt) - 1 + t."""
    response_ids_BT: torch.Tensor
    old_logprobs_BT: torch.Tensor
    mask_BT: torch.Tensor
    advantages_B: torch.Tensor
    temperatures_B: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return int(self.mask_BT.sum())


def _collate(samples: Sequence[Sample], *, pad_id: int, device: torch.device) -> _Batch:
    B = len(samples)
    L = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    T = max(1, max(len(s.response_ids) for s in samples))
    input_ids_BL = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask_BL = torch.zeros((B, L), dtype=torch.long)
    response_ids_BT = torch.full((B, T), pad_id, dtype=torch.long)
    old_logprobs_BT = torch.zeros((B, T), dtype=torch.float32)
    mask_BT = torch.zeros((B, T), dtype=torch.bool)
    logit_index_BT = torch.zeros((B, T), dtype=torch.long)
    for b, s in enumerate(samples):
        P, R = len(s.prompt_ids), len(s.response_ids)
        input_ids_BL[b, : P + R] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attention_mask_BL[b, : P + R] = 1
        response_ids_BT[b, :R] = torch.tensor(s.response_ids, dtype=torch.long)
        old_logprobs_BT[b, :R] = torch.tensor(s.old_logprobs, dtype=torch.float32)
        mask_BT[b, :R] = True
        logit_index_BT[b] = (P - 1 + torch.arange(T)).clamp(max=L - 1)
    return _Batch(
        agent=samples[0].agent,
        input_ids_BL=input_ids_BL.to(device), attention_mask_BL=attention_mask_BL.to(device),
        logit_index_BT=logit_index_BT.to(device), response_ids_BT=response_ids_BT.to(device),
        old_logprobs_BT=old_logprobs_BT.to(device), mask_BT=mask_BT.to(device),
        advantages_B=torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=device),
        temperatures_B=torch.tensor([s.temperature or 1.0 for s in samples], dtype=torch.float32, device=device),
    )


def _response_logits(forward: Callable[..., Any], batch: _Batch) -> torch.Tensor:
    """Logits / T at the response positions, float32, [B, T, V]: softmax of them is the sampling law."""
    logits_BLV = forward(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL, use_cache=False).logits
    index_BTV = batch.logit_index_BT.unsqueeze(-1).expand(-1, -1, logits_BLV.shape[-1])
    return logits_BLV.gather(1, index_BTV).float() / batch.temperatures_B[:, None, None]


def _check_samples(samples: Sequence[Sample]) -> None:
    for i, s in enumerate(samples):
        where = f"sample {i} (agent {s.agent!r}, episode {s.episode_id!r}, turn {s.turn_index})"
        _require(len(s.prompt_ids) > 0, f"{where} has an empty prompt; the first response token needs one")
        _require(len(s.old_logprobs) == len(s.response_ids), f"{where} has {len(s.response_ids)} response ids but "
                 f"{len(s.old_logprobs)} old logprobs; record one logprob per sampled token")
        _require(math.isfinite(s.advantage), f"{where} has a non-finite advantage {s.advantage}")
        _require(s.temperature >= 0, f"{where} has a negative temperature {s.temperature}")


@dataclass(frozen=True)
class _MiniBatch:
    """One optimizer step: this process's micro-batches and the global counts that normalize them."""

    micro: list[list[Sample]]
    """Micro-batches of this process, one agent each."""
    norm: float
    """n(M): trained tokens (token-mean) or sequences (seq-mean-*) of the mini-batch on all processes."""
    n_passes: int
    """Backward passes every process runs (the most micro-batches of any process)."""


# --- the updater -------------------------------------------------------------------------------------------


class ModelUpdater:
    """Policy-gradient updates of one trainable model, shared by one or more agents.

    Args:
        model: the ``nn.Module`` to train, in place (the rollout policy may serve the same object: wrap
            `update` and `load` in ``policy.updating_weights()`` so no batch sees a half-updated model).
        name: the model's name in metric keys (``model/<name>/...``).
        settings: optimizer, aggregation and backend.
        agent_settings: per-agent `LossSettings`; None gives every agent the defaults. When given, every
            agent whose samples reach `update` must have an entry.
    """

    def __init__(self, model: torch.nn.Module, *, name: str, settings: UpdateSettings,
                 agent_settings: Mapping[str, LossSettings] | None = None) -> None:
        if not isinstance(settings, UpdateSettings):
            raise ConfigError(f"settings must be an UpdateSettings, got {type(settings).__name__}")
        for agent, value in (agent_settings or {}).items():
            if not isinstance(value, LossSettings):
                raise ConfigError(f"agent_settings[{agent!r}] must be a LossSettings, got {type(value).__name__}")
        self.name = name
        self.settings = settings
        self.agent_settings = dict(agent_settings) if agent_settings is not None else None
        self.model = model
        self.n_updates = 0
        self._ref_model = _frozen_copy(model) if settings.kl_coef > 0 else None
        self._by_tokens = settings.loss_agg == "token-mean"
        self._skip_zero_advantage = settings.kl_coef == 0 and settings.entropy_coef == 0
        self._engine = _ENGINES[settings.backend](model, settings)
        pad_id = getattr(getattr(model, "config", None), "pad_token_id", None)
        self._pad_id = int(pad_id) if pad_id is not None else 0
        model.eval()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def loss_settings(self, agent: str) -> LossSettings:
        """The `LossSettings` of ``agent``."""
        if self.agent_settings is None:
            return _DEFAULT_LOSS
        if agent not in self.agent_settings:
            raise ConfigError(f"model {self.name!r} got samples of agent {agent!r}, which has no LossSettings; "
                              f"add it to agent_settings (known agents: {', '.join(self.agent_settings) or 'none'})")
        return self.agent_settings[agent]

    # ---- public API -----------------------------------------------------------------------------------
    def update(self, samples: Sequence[Sample]) -> UpdateMetrics:
        """Train on ``samples`` (this process's share): ``n_minibatches`` optimizer steps.

        With several processes every one must call `update` (with possibly different sample counts).
        """
        _check_samples(samples)
        for s in samples:
            self.loss_settings(s.agent)
        tally = _Tally()
        _tally_samples(tally, samples)
        grad_norms: list[float] = []
        with self._training_mode():
            for i, minibatch in enumerate(self._plan(samples)):
                grad_norms.append(self._train_minibatch(minibatch, tally, first=i == 0))
        self.n_updates += 1
        return self._metrics(tally.merged(), grad_norms)

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """log_softmax(logits / T) at each response token under the current weights, one 1-D float32 CPU
        tensor per sample, in order. Batched by agent with each agent's micro-batch size."""
        _check_samples(samples)
        out: list[torch.Tensor | None] = [None] * len(samples)
        for rows in self._micro_batches(list(range(len(samples))), samples):
            batch = _collate([samples[i] for i in rows], pad_id=self._pad_id, device=self.device)
            logprobs_BT = token_logprobs(_response_logits(self.model, batch), batch.response_ids_BT)
            for b, i in enumerate(rows):
                out[i] = logprobs_BT[b, : len(samples[i].response_ids)].cpu()
        return out  # type: ignore[return-value]

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``directory/model`` (Hugging Face format, safetensors) and the optimizer and RNG state.

        Collective: every process calls it. Resume with `load` on an updater built the same way (same
        initial model, settings and number of processes).
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if _rank() == 0:
            self.model.save_pretrained(directory / "model", safe_serialization=True)
        _barrier()
        self._engine.save(directory)
        state = {"n_updates": self.n_updates, "torch_rng": torch.get_rng_state()}
        torch.save(state, directory / f"updater_state_rank{_rank()}.pt")
        _barrier()

    def load(self, directory: str | os.PathLike) -> None:
        """Restore weights (in place), optimizer state and RNG written by `save`."""
        directory = Path(directory)
        state_file = directory / f"updater_state_rank{_rank()}.pt"
        if not state_file.exists():
            raise ConfigError(f"{state_file} not found: not a ModelUpdater checkpoint, or saved with fewer processes")
        self._engine.load(directory)
        state = torch.load(state_file, map_location="cpu", weights_only=True)
        self.n_updates = int(state["n_updates"])
        torch.set_rng_state(state["torch_rng"])
        self.model.eval()

    # ---- planning -------------------------------------------------------------------------------------
    def _plan(self, samples: Sequence[Sample]) -> list[_MiniBatch]:
        """Shuffle (seeded), split into mini-batches, group each into one-agent micro-batches, and agree
        with the other processes on the normalizers and on the number of backward passes."""
        n_global = int(_all_reduce([float(len(samples))], "SUM", self.device)[0])
        n_minibatches = min(self.settings.n_minibatches, n_global)
        order = list(range(len(samples)))
        random.Random(f"{self.settings.seed}:{self.n_updates}:{_rank()}").shuffle(order)
        chunks = [order[k * len(order) // n_minibatches:(k + 1) * len(order) // n_minibatches]
                  for k in range(n_minibatches)]
        micro = [self._micro_batches(chunk, samples) for chunk in chunks]
        local_norms = [sum(self._norm_count(samples[i]) for i in chunk) for chunk in chunks]
        norms = _all_reduce(local_norms, "SUM", self.device)
        passes = _all_reduce([float(len(m)) for m in micro], "MAX", self.device)
        # a mini-batch empty on every process (fewer samples than processes x mini-batches) is skipped
        return [_MiniBatch(micro=[[samples[i] for i in rows] for rows in m], norm=norm, n_passes=int(n))
                for m, norm, n in zip(micro, norms, passes) if n > 0]

    def _micro_batches(self, rows: Sequence[int], samples: Sequence[Sample]) -> list[list[int]]:
        """Rows grouped by agent (agents in order of first appearance), cut by each agent's micro_batch_size.

        With KL and entropy off, a sample with advantage exactly 0 has loss 0 and gradient 0 (every PPO
        branch is -A * ratio), so it is not forwarded; it still counts in n(M). One row is always kept, so
        the optimizer step (AdamW decay and moments) happens exactly as if every sample had been forwarded.
        """
        if self._skip_zero_advantage and rows:
            kept = [i for i in rows if samples[i].advantage != 0.0]
            rows = kept or list(rows[:1])
        by_agent: dict[str, list[int]] = {}
        for i in rows:
            by_agent.setdefault(samples[i].agent, []).append(i)
        out = []
        for agent, agent_rows in by_agent.items():
            size = self.loss_settings(agent).micro_batch_size
            out += [agent_rows[k:k + size] for k in range(0, len(agent_rows), size)]
        return out

    def _norm_count(self, sample: Sample) -> float:
        """What the aggregation averages over: tokens (token-mean) or sequences; 0 for untrained agents."""
        if self.loss_settings(sample.agent).loss_weight == 0:
            return 0.0
        return float(len(sample.response_ids)) if self._by_tokens else 1.0

    # ---- training -------------------------------------------------------------------------------------
    def _train_minibatch(self, minibatch: _MiniBatch, tally: _Tally, *, first: bool) -> float:
        """Accumulate gradients over the micro-batches, then one optimizer step; returns the grad norm."""
        world = _world_size()
        for k in range(minibatch.n_passes):
            is_last = k == minibatch.n_passes - 1
            if k < len(minibatch.micro):
                loss = self._micro_batch_loss(minibatch.micro[k], minibatch.norm, tally, first, is_last)
            else:  # this process has fewer micro-batches than another: a zero loss keeps the collectives aligned
                loss = self._engine.forward(is_last=is_last, input_ids=torch.full((1, 1), self._pad_id,
                                            device=self.device), use_cache=False).logits.sum() * 0.0
            tally.count(("model", "loss"), loss.item())
            self._engine.backward(loss * world)
        return self._engine.step()

    def _micro_batch_loss(self, samples: list[Sample], norm: float, tally: _Tally, first: bool,
                          is_last: bool) -> torch.Tensor:
        """This micro-batch's share of the mini-batch loss, w_a * agg(l) * n(m) / n(M) (module docstring)."""
        s, loss_settings = self.settings, self.loss_settings(samples[0].agent)
        batch = _collate(samples, pad_id=self._pad_id, device=self.device)
        logits_BTV = _response_logits(functools.partial(self._engine.forward, is_last=is_last), batch)
        logprobs_BT = token_logprobs(logits_BTV, batch.response_ids_BT)
        pg_loss, stats = policy_loss(
            logprobs_BT, batch.old_logprobs_BT, batch.advantages_B, batch.mask_BT,
            clip_low=loss_settings.clip_low, clip_high=loss_settings.clip_high,
            dual_clip=loss_settings.dual_clip, agg=s.loss_agg, norm_len=s.norm_len)
        loss = pg_loss
        with torch.set_grad_enabled(s.entropy_coef > 0):
            entropy_BT = entropy_from_logits(logits_BTV)
        if s.entropy_coef > 0:
            loss = loss - s.entropy_coef * agg_loss(entropy_BT, batch.mask_BT, s.loss_agg, norm_len=s.norm_len)
        kl_BT = None
        if self._ref_model is not None:
            kl_BT = kl_penalty(logprobs_BT, self._ref_logprobs(batch), "low_var_kl")
            loss = loss + s.kl_coef * agg_loss(kl_BT, batch.mask_BT, s.loss_agg, norm_len=s.norm_len)
        n_micro = float(batch.n_tokens if self._by_tokens else len(samples))
        self._tally_micro_batch(tally, batch, stats, logprobs_BT, entropy_BT, kl_BT, n_micro, first)
        if loss_settings.loss_weight == 0:
            return loss * 0.0
        return loss * (loss_settings.loss_weight * n_micro / max(norm, 1.0))

    @torch.no_grad()
    def _ref_logprobs(self, batch: _Batch) -> torch.Tensor:
        return token_logprobs(_response_logits(self._ref_model, batch), batch.response_ids_BT)

    def _tally_micro_batch(self, tally: _Tally, batch: _Batch, stats: Any, logprobs_BT: torch.Tensor,
                           entropy_BT: torch.Tensor, kl_BT: torch.Tensor | None, n_micro: float,
                           first: bool) -> None:
        agent, n_tokens, mask_BT = batch.agent, float(batch.n_tokens), batch.mask_BT

        def token_mean(values_BT: torch.Tensor) -> float:
            return float(values_BT.detach()[mask_BT].mean()) if n_tokens else 0.0

        tally.add(("agent", agent, "pg_loss"), stats.pg_loss, weight=n_micro)
        for name in ("clip_frac", "dual_clip_frac", "approx_kl"):
            tally.add(("agent", agent, name), getattr(stats, name), weight=n_tokens)
        tally.max(("agent", agent, "ratio_max"), stats.ratio_max)
        tally.add(("agent", agent, "entropy"), token_mean(entropy_BT), weight=n_tokens)
        tally.count(("model", "n_tokens"), n_tokens)
        if kl_BT is not None:
            tally.add(("agent", agent, "kl_ref"), token_mean(kl_BT), weight=n_tokens)
        if first:
            gap_BT = (logprobs_BT.detach() - batch.old_logprobs_BT).abs()
            tally.add(("agent", agent, "logprob_mismatch"), token_mean(gap_BT), weight=n_tokens)

    @contextlib.contextmanager
    def _training_mode(self) -> Iterator[None]:
        self.model.train()
        try:
            yield
        finally:
            self.model.eval()

    def _metrics(self, tally: _Tally, grad_norms: list[float]) -> UpdateMetrics:
        agents = sorted({key[1] for key in tally.sums if key[0] == "agent"})
        n_steps = len(grad_norms)
        return UpdateMetrics(
            model=self.name, loss=tally.sums[("model", "loss")] / max(n_steps, 1),
            grad_norm=sum(grad_norms) / max(n_steps, 1), grad_norm_max=max(grad_norms, default=0.0),
            lr=self._engine.lr(), n_samples=int(sum(tally.sums[("agent", a, "n_samples")] for a in agents)),
            n_tokens=int(tally.sums[("model", "n_tokens")]), n_minibatches=n_steps,
            agents={a: _agent_metrics(tally, a, self._ref_model is not None) for a in agents},
        )


_DEFAULT_LOSS = LossSettings()


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The reference policy for the KL penalty: a copy of the initial weights, eval mode, no gradients.
    A LoRA model's reference is its own base with the adapters disabled (no copy)."""
    from drmas_graph.lora import base_forward, is_peft_model

    if is_peft_model(model):
        return base_forward(model)
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref
