"""Per-model policy update: agent-wise clipped policy-gradient steps on one trainable model.

One `ModelUpdater` owns one trainable model (``nn.Module``). Several agents may share it (Dr. MAS "shared"
setting): their samples are trained together, but every micro-batch holds samples of one agent only, so
each agent's clip range, loss weight and micro-batch size (`LossSettings`) apply. Per iteration:

    samples --seeded shuffle (one for all processes)--> n_minibatches mini-batches (one optimizer step each)
    mini-batch --group by agent--> micro-batches (forward + backward each, gradients accumulate)

Loss of one mini-batch M, with l_bt the per-token loss (PPO clipped surrogate with dual clip, see
`drmas_graph.train.optim.losses.policy_loss`), w_a the agent's loss weight and m = micro-batch:

    l_bt  = pg_bt + kl_coef * k3(logp_bt, logp_ref_bt) - entropy_coef * H_bt
    L_M   = sum_m  w_a(m) * agg(l over m) * n(m) / n(M)

where agg is the aggregation ``loss_agg`` and n counts what agg averages over: valid tokens for
"token-mean", sequences for the "seq-mean-*" modes. Then L_M equals agg over the whole mini-batch whatever
the micro-batch size. Samples of agents with loss weight 0 are not counted in n(M) (they only feed
metrics). With KL and entropy off, samples whose advantage is exactly 0 (zero-variance groups) are not
forwarded at all: their gradient is exactly 0, and they still count in n(M), so the step is unchanged
(per-token metrics then cover the forwarded samples). A mini-batch none of whose samples (on any process) has
an advantage takes no optimizer step: its gradient is exactly 0, yet an AdamW step would still move the weights
(momentum from earlier steps, weight decay); `skipped_minibatches` counts it. With P processes, n(M) is summed
over all of them and each loss is multiplied by P (DeepSpeed and the torch backend average gradients over processes), and the shuffle
that cuts mini-batches is one global order of the step's samples, so P processes each given a contiguous
block of the samples take exactly the steps of one process given all of them.

Backends, chosen by `UpdateSettings.backend`:
- "deepspeed": ``deepspeed.initialize`` with a client ``torch.optim.AdamW`` and ZeRO stage 0-3 (default 1).
  ZeRO 0-2 keep every parameter whole on every process, in the module's own ``nn.Parameter`` objects, so
  a rollout policy serving the same module sees the new weights without any copy. ZeRO-3 shards them;
  `ModelUpdater.full_weights` gathers them (saving, pushing weights to servers). The model stays on the
  device it was given (where its policy serves it); DeepSpeed is never allowed to move it.
- "torch": plain AdamW and ``clip_grad_norm_``; numerically the same step as DeepSpeed on one process.

Precision: a bfloat16/float16 model keeps its dtype (the rollout policy serves it), and the optimizer keeps
float32 master weights and accumulates gradients in float32 (DeepSpeed ZeRO-1/2/3 in bf16; the torch backend
does the same, plus dynamic loss scaling for float16). ``autocast="bf16"`` runs a float32 model's forward
passes in bfloat16; the rollout-vs-trainer gap it causes shows in the ``logprob_mismatch`` metric.

Dropout: off in the update by default (``dropout: false``): the training passes compute what eval mode computes
(every submodule in eval mode but the layers that run activation checkpointing, whose own dropout rates are 0
meanwhile), as do the passes that give the ratios' denominators (old, behaviour and proximal logprobs), so a
ratio carries no dropout noise: exactly 1 at the first mini-batch (with dropout it would be a ratio of two
dropout masks). ``dropout: true`` runs the model's dropout (and LoRA's ``lora.dropout``) in the update.

Memory: logprobs (and entropy, only when entropy_coef > 0) come from the LM head applied to the response
tokens only, in checkpointed chunks (`drmas_graph.train.optim._logprobs`); activation checkpointing, the attention
kernel and token-sized micro-batches are settings; the KL reference is offloaded to CPU memory between
updates (`drmas_graph.train.optim._reference`).

Departures from verl (the reference implementation of Dr. MAS):
- Loss weights per agent and micro-batches of one agent each (verl mixes agents of one model).
- The number of micro-batches varies per mini-batch; processes with fewer run zero-loss backward passes so
  that every process takes part in every gradient reduction.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from drmas_graph.engine import rank, world_size
from drmas_graph.train.engines import ENGINES, LossSettings, UpdateSettings, all_reduce, default_group_barrier
from drmas_graph.train.optim._model_setup import (check_autocast, prepare_model, require, set_attn_implementation,
                                                  without_dropout)
from drmas_graph.train.optim._logprobs import Batch, check_chunked_head, collate, collate_packed, response_token_stats
from drmas_graph.train.optim._packing import (Packing, PackingProbes, max_nodes, pack_by_tokens, pack_rows, row_nodes,
                                         sequences_of)
from drmas_graph.train.optim._reference import REFERENCES, Reference
from drmas_graph.train.optim._update_metrics import (AgentGrads, AgentUpdateMetrics, UpdateMetrics, _agent_metrics,
                                                     _Tally, _tally_samples, agent_grad_norms, readable_grads,
                                                     tally_kl_start)
from drmas_graph.errors import ConfigError
from drmas_graph.grammar import Grammars
from drmas_graph.train.optim.losses import agg_loss, kl_penalty, policy_loss
from drmas_graph.types import Sample

__all__ = ["BACKENDS", "ZERO_STAGES", "AgentUpdateMetrics", "LossSettings", "ModelUpdater", "UpdateMetrics",
           "UpdateSettings", "set_attn_implementation"]

BACKENDS = tuple(ENGINES)
OLD_LOGPROBS = ("given", "current")
"""`ModelUpdater.update(old_logprobs=...)`: the samples' recorded ones, or the update's own (on-policy)."""
ZERO_STAGES = (0, 1, 2, 3)

# Axis suffixes: _B rows (samples) of a micro-batch, _L prompt+response positions, _T response tokens,
# _V vocabulary.


# --- settings ----------------------------------------------------------------------------------------------


# --- batches -----------------------------------------------------------------------------------------------


def _check_samples(samples: Sequence[Sample]) -> None:
    for i, s in enumerate(samples):
        where = f"sample {i} (agent {s.agent!r}, episode {s.episode_id!r}, turn {s.turn_index})"
        require(len(s.prompt_ids) > 0, f"{where} has an empty prompt; the first response token needs one")
        require(len(s.old_logprobs) == len(s.response_ids), f"{where} has {len(s.response_ids)} response ids but "
                 f"{len(s.old_logprobs)} old logprobs; record one logprob per sampled token")
        require(math.isfinite(s.advantage), f"{where} has a non-finite advantage {s.advantage}")
        require(s.temperature >= 0, f"{where} has a negative temperature {s.temperature}")


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
        reference: the start policy (`_reference.Reference`) when ``kl_coef > 0`` or ``kl_start_metric``; None
            builds ``settings.kl_reference`` (a frozen copy of the initial weights, offloaded or on device).
        probes: the `drmas_graph.train.optim._packing.PackingProbes` to share (`LoraUpdater`: its adapters share one
            module, probed once); None makes one. With ``settings.pack_prefixes`` each module this updater computes
            on (the model, or a ``module=`` of `compute_logprobs`) is probed with the attention kernel it has,
            after ``settings.attn_implementation`` is applied, and the reason it cannot be packed is logged.
        grammars: the rollout policy's `drmas_graph.grammar.Grammars` (`policy.grammars`): every logprob of a sample
            decoded under a grammar (`Sample.grammar`) is computed under the masks it was sampled with. None: such
            a sample is refused.
    """

    def __init__(self, model: torch.nn.Module, *, name: str, settings: UpdateSettings,
                 agent_settings: Mapping[str, LossSettings] | None = None,
                 reference: Reference | None = None, probes: PackingProbes | None = None,
                 grammars: Grammars | None = None) -> None:
        if not isinstance(settings, UpdateSettings):
            raise ConfigError(f"settings must be an UpdateSettings, got {type(settings).__name__}")
        for agent, value in (agent_settings or {}).items():
            if not isinstance(value, LossSettings):
                raise ConfigError(f"agent_settings[{agent!r}] must be a LossSettings, got {type(value).__name__}")
        self.name = name
        self.settings = settings
        self.agent_settings = dict(agent_settings) if agent_settings is not None else None
        self.model = model
        self.grammars = grammars
        self.n_updates = 0
        self.correction: Any = None
        """Off-policy correction of stale samples (`offpolicy.OffPolicyCorrection`, asynchronous training); None = off."""
        prepare_model(model, settings)
        start = (reference or REFERENCES[settings.kl_reference](model)
                 ) if settings.kl_coef > 0 or settings.kl_start_metric else None
        self._reference, self._start = (start if settings.kl_coef > 0 else None), start  # KL loss's; kl_start's
        self._ref_logprobs: dict[int, torch.Tensor] = {}
        """id(sample) -> its reference logprobs, computed at the start of each `update`."""
        self._by_tokens = settings.loss_agg == "token-mean"
        self._skip_zero_advantage = settings.kl_coef == 0 and settings.entropy_coef == 0
        self._autocast_dtype = check_autocast(model, settings.autocast)
        self._lm_head = check_chunked_head(model) if settings.logprob_chunk_tokens > 0 else None
        self._probes = probes or PackingProbes(name, grow=world_size() == 1)
        self._packing_of(model)  # probed now, with the kernel it trains with (the reason is logged at start-up)
        self._engine = ENGINES[settings.backend](model, settings)
        pad_id = getattr(getattr(model, "config", None), "pad_token_id", None)
        self._pad_id = int(pad_id) if pad_id is not None else 0
        model.eval()

    def _packing_of(self, module: torch.nn.Module, samples: Sequence[Sample] = ()) -> Packing | None:
        """How ``module`` takes packed rows of ``samples`` (`PackingProbes`, probed for the longest row
        `_micro_batches` can make of them: `_packing.row_nodes`), None with pack_prefixes off."""
        return self._probes.of(module, row_nodes(samples, self._budget)) if self.settings.pack_prefixes else None

    def _budget(self, agent: str, longest: int) -> int:
        """Tokens of one of ``agent``'s micro-batches: max_tokens_per_micro_batch, else micro_batch_size x longest."""
        return self.settings.max_tokens_per_micro_batch or self.loss_settings(agent).micro_batch_size * longest

    @property
    def _packing(self) -> Packing | None:
        """How the model takes packed rows (its current kernel, rows probed so far); None: pack_prefixes is off."""
        return self._packing_of(self.model)

    @property
    def _mask_kind(self) -> str | None:
        """The packed rows' attention-mask format of the model (`_packing.MASK_KINDS`); None trains on padded rows."""
        return self._packing.mask_kind if self._packing is not None else None

    def _autocast(self) -> contextlib.AbstractContextManager:
        """bfloat16 autocast of the forward passes when ``settings.autocast`` asks for it."""
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self._autocast_dtype)

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
    def update(self, samples: Sequence[Sample], *, old_logprobs: str = "given") -> UpdateMetrics:
        """Train on ``samples`` (this process's share): ``n_minibatches`` optimizer steps.

        ``old_logprobs`` is the PPO ratio's denominator: "given" = each sample's ``old_logprobs``; "current" =
        the update's own logprobs, detached (on-policy: the weights are those that generated the samples, and
        with ``n_minibatches == 1`` nothing moves them before the one step), so the ratio is exactly 1 in value
        and its gradient is the policy gradient, without a separate pass to recompute them. With several
        processes every one must call `update` (with possibly different sample counts).
        """
        _check_samples(samples)
        for s in samples:
            self.loss_settings(s.agent)
        require(old_logprobs in OLD_LOGPROBS, f"update(old_logprobs={old_logprobs!r}): valid values are "
                 f"{', '.join(OLD_LOGPROBS)}")
        require(old_logprobs != "current" or self.settings.n_minibatches == 1,
                 f"model {self.name!r}: old_logprobs='current' needs n_minibatches 1 (after the first of "
                 f"{self.settings.n_minibatches} steps the weights are no longer those that generated the samples); "
                 "pass the recomputed logprobs as the samples' old_logprobs instead")
        tally = _Tally()
        _tally_samples(tally, samples)
        grad_norms: list[float] = []
        self._ref_logprobs = self._reference_logprobs(samples)
        tally_kl_start(tally, samples, self._ref_logprobs)
        plan, skipped = self._plan(samples)  # the same on every process
        with self._training_mode():
            for i, minibatch in enumerate(plan):
                grad_norms.append(self._train_minibatch(minibatch, tally, first=i == 0,
                                                        current=old_logprobs == "current"))
        self._ref_logprobs = {}
        self.n_updates += 1
        return self._metrics(tally.merged(), grad_norms, skipped, rollout_gap=old_logprobs == "current")

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[Sample], *, module: torch.nn.Module | None = None) -> list[torch.Tensor]:
        """log_softmax(logits / T) at each response token under the current weights (or those of `module`, a copy
        of the model), one 1-D float32 CPU tensor per sample, in order. Batched by agent with each agent's
        micro-batch size."""
        _check_samples(samples)
        module = module if module is not None else self.model
        return [t.cpu() for t in self._logprobs_of(module, samples, self._packing_of(module, samples))]

    @torch.no_grad()
    def _logprobs_of(self, module: torch.nn.Module, samples: Sequence[Sample], packing: Packing | None
                     ) -> list[torch.Tensor]:
        """Per-sample logprobs on ``module``, packed as ``packing`` (found on that module, or a copy of it) says."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        lm_head = module.get_output_embeddings() if self._lm_head is not None else None
        every = list(range(len(samples)))
        for rows in self._micro_batches(every, samples, packing=packing, skip_zero_advantage=False):
            batch = self._collate([samples[i] for i in rows], packing)
            logprobs_BT, _ = self._token_stats(module, batch, with_entropy=False, lm_head=lm_head)
            for b, i in enumerate(rows):
                out[i] = logprobs_BT[b, : len(samples[i].response_ids)]
        return out

    def _reference_logprobs(self, samples: Sequence[Sample]) -> dict[int, torch.Tensor]:
        """id(sample) -> logprobs under the KL reference, for every sample, in one pass (one transfer of an
        offloaded reference per update)."""
        if self._start is None or not samples:
            return {}
        with self._start.on_device() as module:  # a frozen copy of the model (or it, adapters disabled): its probe
            packing = self._packing_of(self.model, samples)
            return {id(s): lp for s, lp in zip(samples, self._logprobs_of(module, samples, packing))}

    def full_weights(self) -> contextlib.AbstractContextManager:
        """Inside this block the model's parameters are whole (read them to save or push weights to servers).

        A no-op except with ZeRO-3, which shards the parameters over processes; then it is a collective call
        (every process enters it) that gathers them.
        """
        return self._engine.full_weights()

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``directory/model`` (Hugging Face format, safetensors) and the optimizer and RNG state.

        Collective: every process calls it. Resume with `load` on an updater built the same way (same
        initial model, settings and number of processes).
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with self.full_weights():
            if rank() == 0:
                self.model.save_pretrained(directory / "model", safe_serialization=True)
        default_group_barrier()
        self.save_state(directory)

    def save_state(self, directory: str | os.PathLike) -> None:
        """`save` without the Hugging Face weights: the optimizer (a DeepSpeed checkpoint holds its own copy of
        the trained parameters) and RNG state. `LoraUpdater` writes the adapters once, then this per adapter."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._engine.save(directory)
        state = {"n_updates": self.n_updates, "torch_rng": torch.get_rng_state()}
        torch.save(state, directory / f"updater_state_rank{rank()}.pt")
        default_group_barrier()

    def load(self, directory: str | os.PathLike) -> None:
        """Restore weights (in place), optimizer state and RNG written by `save`."""
        self.load_state(directory, weights=Path(directory) / "model")

    def load_state(self, directory: str | os.PathLike, *, weights: Path | None) -> None:
        """Restore what `save_state` wrote; the torch backend also copies the Hugging Face weights at ``weights``
        into the model (None: the caller restored them, as `LoraUpdater.load` does for all adapters at once)."""
        directory = Path(directory)
        state_file = directory / f"updater_state_rank{rank()}.pt"
        if not state_file.exists():  # a rank the saving run did not have (resumed by more processes)
            state_file = directory / "updater_state_rank0.pt"  # takes rank 0's counters and RNG state
        if not state_file.exists():
            raise ConfigError(f"{state_file} not found: not a ModelUpdater checkpoint")
        self._engine.load(directory, weights=weights)
        state = torch.load(state_file, map_location="cpu", weights_only=True)
        self.n_updates = int(state["n_updates"])
        torch.set_rng_state(state["torch_rng"])
        self.model.eval()

    # ---- planning -------------------------------------------------------------------------------------
    def _plan(self, samples: Sequence[Sample]) -> tuple[list[_MiniBatch], int]:
        """Shuffle (seeded), split into mini-batches, group each into one-agent micro-batches, and agree
        with the other processes on the normalizers and on the number of backward passes; also how many
        mini-batches take no step (every sample's advantage 0 with KL and entropy off: `_micro_batches`)."""
        chunks = self._minibatch_rows(len(samples))
        packing = self._packing_of(self.model, samples)
        micro = [self._micro_batches(chunk, samples, packing=packing) for chunk in chunks]
        local_norms = [sum(self._norm_count(samples[i]) for i in chunk) for chunk in chunks]
        norms = all_reduce(local_norms, "SUM", self.device)
        passes = all_reduce([float(len(m)) for m in micro], "MAX", self.device)
        # a mini-batch with nothing to forward on every process is skipped: every chunk holds a sample somewhere
        # (at most as many mini-batches as samples), so all of them had advantage 0 (no gradient, no step)
        plan = [_MiniBatch(micro=[[samples[i] for i in rows] for rows in m], norm=norm, n_passes=int(n))
                for m, norm, n in zip(micro, norms, passes) if n > 0]
        return plan, len(chunks) - len(plan)

    def _minibatch_rows(self, n_local: int) -> list[list[int]]:
        """This process's rows of each mini-batch, from one seeded shuffle of the step's samples on all processes.

        Process r holds global rows [o_r, o_r + n_r) (o_r = n_0 + ... + n_{r-1}: the trainer gives each process a
        contiguous block of whole groups, in order). The global order is a shuffle seeded by (seed, n_updates)
        only, cut into ``n_minibatches`` equal parts; each process keeps its rows of each part. So P processes form
        exactly the mini-batches of one process given all the samples.
        """
        world, this_rank = world_size(), rank()
        counts = [0.0] * world
        counts[this_rank] = float(n_local)
        counts = [int(c) for c in all_reduce(counts, "SUM", self.device)]
        offset, n_global = sum(counts[:this_rank]), sum(counts)
        n_minibatches = min(self.settings.n_minibatches, n_global)
        order = list(range(n_global))
        random.Random(f"{self.settings.seed}:{self.n_updates}:0").shuffle(order)  # ":0": the seed one process had
        cuts = [order[k * n_global // n_minibatches:(k + 1) * n_global // n_minibatches] for k in range(n_minibatches)]
        return [[g - offset for g in cut if offset <= g < offset + n_local] for cut in cuts]

    def _micro_batches(self, rows: Sequence[int], samples: Sequence[Sample], *, packing: Packing | None,
                       skip_zero_advantage: bool = True) -> list[list[int]]:
        """Rows grouped by agent (agents in order of first appearance), cut by each agent's micro_batch_size
        (or ``max_tokens_per_micro_batch``) into padded rows; with packing, into sequence trees of at most
        `_packing.max_nodes` positions for the same budget, and at most the nodes the packing probe proved
        (`Packing.max_nodes`; `_packing.pack_rows`).

        For training (``skip_zero_advantage``) with KL and entropy off, a sample with advantage exactly 0 has
        loss 0 and gradient 0 (every PPO branch is -A * ratio), so it is not forwarded; it still counts in
        n(M). Rows all of advantage 0 give no micro-batch (a mini-batch with none on any process takes no step).
        """
        if skip_zero_advantage and self._skip_zero_advantage:
            rows = [i for i in rows if samples[i].advantage != 0.0]
        by_agent: dict[str, list[int]] = {}
        for i in rows:
            by_agent.setdefault(samples[i].agent, []).append(i)
        out = []
        budget = self.settings.max_tokens_per_micro_batch
        for agent, agent_rows in by_agent.items():
            size = self.loss_settings(agent).micro_batch_size
            if packing is not None and packing.mask_kind is not None:  # as memory-bounded as the padded rows
                sequences = sequences_of([samples[i] for i in agent_rows])
                longest = max(map(len, sequences))
                limit = min(max_nodes(longest, self._budget(agent, longest)), packing.max_nodes)
                out += pack_rows(agent_rows, sequences, limit)
            elif budget is not None:
                out += pack_by_tokens(agent_rows, [_length(samples[i]) for i in agent_rows], budget)
            else:
                out += [agent_rows[k:k + size] for k in range(0, len(agent_rows), size)]
        return out

    def _collate(self, samples: Sequence[Sample], packing: Packing | None) -> Batch:
        """The micro-batch's `Batch`: one packed row of its trie, or padded rows when packing is off (or for a
        sample longer than the packed rows the probe proved, alone: `_micro_batches` gives it a row of its own)."""
        alone_too_long = len(samples) == 1 and packing is not None and _length(samples[0]) > packing.max_nodes
        if packing is None or packing.mask_kind is None or alone_too_long:
            return collate(samples, pad_id=self._pad_id, device=self.device, grammars=self.grammars)
        return collate_packed(samples, pad_id=self._pad_id, device=self.device, mask_kind=packing.mask_kind,
                              dtype=next(self.model.parameters()).dtype, grammars=self.grammars)

    def _norm_count(self, sample: Sample) -> float:
        """What the aggregation averages over: tokens (token-mean) or sequences; 0 for untrained agents."""
        if self.loss_settings(sample.agent).loss_weight == 0:
            return 0.0
        return float(len(sample.response_ids)) if self._by_tokens else 1.0

    # ---- training -------------------------------------------------------------------------------------
    def _train_minibatch(self, minibatch: _MiniBatch, tally: _Tally, *, first: bool, current: bool) -> float:
        """Accumulate gradients over the micro-batches, then one optimizer step; returns the grad norm."""
        world = world_size()
        agent_grads = AgentGrads(*readable_grads(self._engine))  # per-agent norms (world 1): reads, changes nothing
        for k in range(minibatch.n_passes):
            is_last = k == minibatch.n_passes - 1
            if k < len(minibatch.micro):
                agent_grads.begin(minibatch.micro[k][0].agent)
                loss = self._micro_batch_loss(minibatch.micro[k], minibatch.norm, tally, first=first, is_last=is_last,
                                              current=current)
            else:  # this process has fewer micro-batches than another: a zero loss keeps the collectives aligned
                loss = self._engine.forward(is_last=is_last, input_ids=torch.full((1, 1), self._pad_id,
                                            device=self.device), use_cache=False).logits.sum() * 0.0
            tally.count(("model", "loss"), loss.item())
            self._engine.backward(loss * world)
        return agent_grads.step(self._engine.step, tally)

    def _micro_batch_loss(self, samples: list[Sample], norm: float, tally: _Tally, *, first: bool, is_last: bool,
                          current: bool) -> torch.Tensor:
        """This micro-batch's share of the mini-batch loss, w_a * agg(l) * n(m) / n(M) (module docstring)."""
        s, loss_settings = self.settings, self.loss_settings(samples[0].agent)
        batch = self._collate(samples, self._packing)
        with_entropy = s.entropy_coef > 0
        logprobs_BT, entropy_BT = self._token_stats(functools.partial(self._engine.forward, is_last=is_last), batch,
                                                    with_entropy=with_entropy)
        old_BT = logprobs_BT.detach() if current else batch.old_logprobs_BT
        pg_loss, stats = policy_loss(
            logprobs_BT, old_BT, batch.advantages_B, batch.mask_BT,
            clip_low=loss_settings.clip_low, clip_high=loss_settings.clip_high,
            dual_clip=loss_settings.dual_clip, agg=s.loss_agg, norm_len=s.norm_len,
            token_weights=self.correction.token_weights(samples, batch.mask_BT) if self.correction else None)
        loss = pg_loss
        if entropy_BT is not None:
            loss = loss - s.entropy_coef * agg_loss(entropy_BT, batch.mask_BT, s.loss_agg, norm_len=s.norm_len)
        kl_BT = None
        if self._reference is not None:
            ref_BT = _pad_rows([self._ref_logprobs[id(x)] for x in samples], batch.mask_BT)
            kl_BT = kl_penalty(logprobs_BT, ref_BT, "low_var_kl")
            loss = loss + s.kl_coef * agg_loss(kl_BT, batch.mask_BT, s.loss_agg, norm_len=s.norm_len)
        n_micro = float(batch.n_tokens if self._by_tokens else len(samples))
        self._tally_micro_batch(tally, batch, stats, logprobs_BT, entropy_BT, kl_BT, n_micro, first, current, samples)
        if loss_settings.loss_weight == 0:
            return loss * 0.0
        return loss * (loss_settings.loss_weight * n_micro / max(norm, 1.0))

    def _token_stats(self, forward: Callable[..., Any], batch: Batch, *, with_entropy: bool,
                     lm_head: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logprobs_BT, entropy_BT or None) under this updater's autocast and logprob path."""
        with self._autocast():
            return response_token_stats(forward, batch, lm_head=lm_head or self._lm_head, with_entropy=with_entropy,
                                        chunk_tokens=self.settings.logprob_chunk_tokens)

    def _tally_micro_batch(self, tally: _Tally, batch: Batch, stats: Any, logprobs_BT: torch.Tensor,
                           entropy_BT: torch.Tensor | None, kl_BT: torch.Tensor | None, n_micro: float,
                           first: bool, current: bool, samples: Sequence[Sample]) -> None:
        agent, n_tokens, mask_BT = batch.agent, float(batch.n_tokens), batch.mask_BT

        def token_mean(values_BT: torch.Tensor, where_BT: torch.Tensor = mask_BT) -> float:
            return float(values_BT.detach()[where_BT].mean()) if where_BT.any() else 0.0

        tally.add(("agent", agent, "pg_loss"), stats.pg_loss, weight=n_micro)
        for name in ("clip_frac", "dual_clip_frac", "approx_kl"):
            tally.add(("agent", agent, name), getattr(stats, name), weight=n_tokens)
        if n_tokens:  # a ratio was taken (no response token: none, so no maximum rather than 0)
            tally.max(("agent", agent, "ratio_max"), stats.ratio_max)
        if entropy_BT is not None:
            tally.add(("agent", agent, "entropy"), token_mean(entropy_BT), weight=n_tokens)
        tally.count(("model", "n_tokens"), n_tokens)
        tally.count(("model", "forward_tokens"), float(batch.n_positions))
        if kl_BT is not None:
            tally.add(("agent", agent, "kl_ref"), token_mean(kl_BT), weight=n_tokens)
        fresh_BT = mask_BT & torch.tensor([s.behaviour_logprobs is None for s in samples], device=mask_BT.device)[:, None]
        if first and (n_fresh := float(fresh_BT.sum())):  # recorded old logprobs vs the trainer's first pass (a stale
            gap = token_mean((logprobs_BT - batch.old_logprobs_BT).abs(), fresh_BT)  # sample's: the policy's change)
            for name in ("logprob_mismatch", "rollout_logprob_gap") if current else ("logprob_mismatch",):
                tally.add(("agent", agent, name), gap, weight=n_fresh)  # current: the recorded ones are the rollout's

    @contextlib.contextmanager
    def _training_mode(self) -> Iterator[None]:
        """The gradient passes: train mode with ``settings.dropout``; else (the default) the model computes as
        in eval mode, as its old, behaviour and proximal logprobs were computed (`_without_dropout`)."""
        self.model.train()
        try:
            with contextlib.nullcontext() if self.settings.dropout else without_dropout(self.model):
                yield
        finally:
            self.model.eval()

    def _metrics(self, tally: _Tally, grad_norms: list[float], skipped: int, *, rollout_gap: bool) -> UpdateMetrics:
        agents = sorted({key[1] for key in tally.sums if key[0] == "agent"})
        n_steps = len(grad_norms)
        return UpdateMetrics(  # no step taken: no loss, no gradient norm (absent from the logs)
            model=self.name, loss=tally.sums[("model", "loss")] / n_steps if n_steps else None,
            grad_norm=sum(grad_norms) / n_steps if n_steps else None, grad_norm_max=max(grad_norms, default=None),
            lr=self._engine.lr(), n_samples=int(sum(tally.sums[("agent", a, "n_samples")] for a in agents)),
            n_tokens=int(tally.sums[("model", "n_tokens")]), n_minibatches=n_steps,
            skipped_minibatches=skipped,
            forward_tokens=int(tally.sums[("model", "forward_tokens")]), packed=self._mask_kind is not None,
            agents={a: _agent_metrics(tally, a, self._reference is not None, self.settings.entropy_coef > 0,
                                      rollout_gap, agent_grad_norms(tally, agents, grad_norms)[a]) for a in agents},
        )


_DEFAULT_LOSS = LossSettings()


def _pad_rows(rows: Sequence[torch.Tensor], mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-sample 1-D tensors as a right-padded [B, T] float32 tensor shaped like ``mask_BT``."""
    out_BT = torch.zeros(mask_BT.shape, dtype=torch.float32, device=mask_BT.device)
    for b, row in enumerate(rows):
        out_BT[b, : row.shape[0]] = row
    return out_BT


def _length(sample: Sample) -> int:
    return len(sample.prompt_ids) + len(sample.response_ids)

