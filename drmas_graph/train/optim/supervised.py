"""Supervised steps on demonstrations through a model's own updater (the warm start before RL), and the KL
reference of the RL that follows when it is not the weights the RL starts from.

`SupervisedUpdater` builds the model's updater as the trainer does (`lora.build_updater`: a `ModelUpdater`, or a
`LoraUpdater` with one adapter per agent) with the warm start's settings (its own learning rate and optimizer; no KL,
no entropy) and takes optimizer steps on the negative log-likelihood of the demonstrations' response tokens:

    L = -(1 / N) sum_{b, t} log pi(y_bt | x_b, y_b<t)        N = the step's response tokens on every process

The logprobs are computed as the policy-gradient update computes them (`_logprobs.collate` / `collate_packed` and
`response_token_stats`, with the updater's autocast, chunked LM head and packing), under each sample's grammar masks
(`Sample.grammar`: the distribution the policy samples that call from), in micro-batches of one agent each (its
`micro_batch_size`), on the same optimizer backend (DeepSpeed or torch: gradient accumulation, clipping, float32
master weights). A token the grammar forces (the one allowed) has logprob 0: no loss, no gradient. With P processes
N is summed over all of them and each loss is multiplied by P, as in `update` (the backends average gradients).

`frozen_reference` and `adapter_references` give the KL reference (`ModelUpdater(reference=...)`) of the RL that
follows where the default is not wanted: the weights before the warm start (a frozen copy, `_reference`), or a LoRA
adapter's warm-started weights (`AdapterSnapshot`; a LoRA updater's default reference is the base model).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from drmas_graph.engine import rank, world_size
from drmas_graph.errors import ConfigError
from drmas_graph.train.engines import LossSettings, UpdateSettings, all_reduce, default_group_barrier
from drmas_graph.train.optim._reference import REFERENCES, Reference
from drmas_graph.train.optim.lora import LoraUpdater, build_updater
from drmas_graph.train.optim.update import ModelUpdater
from drmas_graph.types import Sample

__all__ = ["SupervisedUpdater", "SupervisedMetrics", "AdapterSnapshot", "frozen_reference", "adapter_references"]


@dataclass
class SupervisedMetrics:
    """What supervised steps did on this process (sum them over steps and processes with `add`)."""

    nll: dict[str, float] = field(default_factory=dict)
    """Agent -> the sum of -log p over its response tokens, at the forward pass of its step."""
    tokens: dict[str, int] = field(default_factory=dict)
    """Agent -> its response tokens trained on."""
    grad_norms: dict[str, list[float]] = field(default_factory=dict)
    """Updater (model, or model/adapter) -> the pre-clip gradient norm of each step it took."""

    def add(self, other: SupervisedMetrics) -> None:
        for agent, value in other.nll.items():
            self.nll[agent] = self.nll.get(agent, 0.0) + value
            self.tokens[agent] = self.tokens.get(agent, 0) + other.tokens[agent]
        for name, norms in other.grad_norms.items():
            self.grad_norms.setdefault(name, []).extend(norms)


class SupervisedUpdater:
    """Negative log-likelihood steps of one trainable model on its agents' demonstrations (module docstring).

    Args:
        model: the module to train in place (an embedded policy's own: wrap `step` in ``policy.updating_weights()``),
            or a ``PeftModel`` whose adapters (one per agent, `agent_cfgs[a].adapter`) are trained.
        name: the model's name (metric keys).
        settings: the model's update settings; the learning rate is replaced by `lr`, KL and entropy are off.
        lr: the warm start's learning rate (every agent's: `agents.<a>.lr` is the RL's).
        agent_settings: the `LossSettings` of every agent whose demonstrations it trains on (micro-batch sizes).
        agent_cfgs: the agents' configs (their LoRA adapters).
        grammars: the policy's grammars, for demonstrations under a grammar (`Sample.grammar`).
    """

    def __init__(self, model: Any, *, name: str, settings: UpdateSettings, lr: float,
                 agent_settings: Mapping[str, LossSettings], agent_cfgs: Mapping[str, Any], grammars: Any) -> None:
        settings = type(settings)(**{**settings.model_dump(), "lr": lr, "kl_coef": 0.0, "entropy_coef": 0.0,
                                     "kl_start_metric": False, "n_minibatches": 1})
        cfgs = {a: c.model_copy(update={"lr": None}) for a, c in agent_cfgs.items()}
        self.name = name
        self.updater: ModelUpdater | LoraUpdater = build_updater(
            model, name=name, settings=settings, agent_settings=agent_settings, agent_cfgs=cfgs, grammars=grammars)
        """The updater its steps go through (its optimizer is the warm start's own)."""

    def step(self, samples: Sequence[Sample]) -> SupervisedMetrics:
        """One optimizer step (per adapter of a LoRA model) on this process's share of a batch. Collective: every
        process calls it; an updater none of whose samples are on any process takes no step."""
        if isinstance(self.updater, LoraUpdater):
            parts, out = self.updater._split(samples), SupervisedMetrics()
            for adapter, updater in self.updater.updaters.items():
                self.updater._activate(adapter)
                out.add(_nll_step(updater, parts[adapter]))
            return out
        return _nll_step(self.updater, samples)

    def logprobs(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """log p of each sample's response tokens under the current weights (no gradient), one 1-D tensor each."""
        return self.updater.compute_logprobs(samples)

    def save(self, directory: str | os.PathLike) -> None:
        """``directory/model``: the weights (Hugging Face format; a LoRA model: its adapters), without optimizer
        state. Collective (ZeRO-3 gathers the parameters); rank 0 writes."""
        directory = Path(directory)
        with self.updater.full_weights():
            if rank() == 0:
                self.updater.model.save_pretrained(directory / "model", safe_serialization=True)
        default_group_barrier()

    @staticmethod
    def frozen_reference(model: Any, where: str) -> Reference:
        """`frozen_reference`: the KL reference of the weights `model` holds now (the RL's, after a warm start)."""
        return frozen_reference(model, where)

    @staticmethod
    def adapter_references(model: Any, adapters: Sequence[str]) -> dict[str, Reference]:
        """`adapter_references`: the KL reference of each LoRA adapter of `model` as it is now."""
        return adapter_references(model, adapters)

    def close(self) -> None:
        """Let go of the optimizer: a DeepSpeed engine takes its gradient hooks off the module (the RL's updater
        wraps the same parameters next)."""
        updaters = self.updater.updaters.values() if isinstance(self.updater, LoraUpdater) else [self.updater]
        for updater in updaters:
            destroy = getattr(getattr(updater._engine, "engine", None), "destroy", None)
            if destroy is not None:
                destroy()


def _nll_step(u: ModelUpdater, samples: Sequence[Sample]) -> SupervisedMetrics:
    """One optimizer step of `u` on the token-mean negative log-likelihood of the samples (module docstring)."""
    out = SupervisedMetrics()
    n_all = all_reduce([float(sum(len(s.response_ids) for s in samples))], "SUM", u.device)[0]
    packing = u._packing_of(u.model, samples)
    micro = u._micro_batches(list(range(len(samples))), samples, packing=packing, skip_zero_advantage=False)
    n_passes = int(all_reduce([float(len(micro))], "MAX", u.device)[0])
    if n_all == 0:  # no token on any process: no step (an AdamW step would still move the weights)
        return out
    with u._training_mode():
        for k in range(n_passes):
            forward = functools.partial(u._engine.forward, is_last=k == n_passes - 1)
            if k < len(micro):
                batch = u._collate([samples[i] for i in micro[k]], packing)
                logprobs_BT, _ = u._token_stats(forward, batch, with_entropy=False)
                nll = -(logprobs_BT * batch.mask_BT).sum()  # 0 at padding
                out.nll[batch.agent] = out.nll.get(batch.agent, 0.0) + float(nll.detach())
                out.tokens[batch.agent] = out.tokens.get(batch.agent, 0) + batch.n_tokens
                loss = nll / n_all
            else:  # fewer micro-batches here than on another process: a zero loss keeps the collectives aligned
                pad = torch.full((1, 1), u._pad_id, device=u.device)
                loss = forward(input_ids=pad, use_cache=False).logits.sum() * 0.0
            u._engine.backward(loss * world_size())
    out.grad_norms[u.name] = [u._engine.step()]
    return out


class AdapterSnapshot:
    """LoRA adapters' weights as they are now, as the KL references of their updaters (`Reference`, one per adapter:
    `of`): a copy of the ``PeftModel`` that shares its base's tensors (nobody trains them) and holds its own frozen
    copy of every adapter, so the reference stays put while the adapters train (the trained module may be the
    policy's or the asynchronous trainer's copy of it)."""

    def __init__(self, model: Any) -> None:
        adapters = set(model.peft_config)
        base = {id(t): t for name, t in [*model.named_parameters(), *model.named_buffers()]
                if not adapters & set(name.split("."))}
        self.module = copy.deepcopy(model, base)
        for p in self.module.parameters():
            if id(p) not in base:
                p.requires_grad_(False)
        self.module.eval()

    def of(self, adapter: str) -> Reference:
        """The reference of one adapter: the copy with that adapter active."""
        if adapter not in self.module.peft_config:
            raise ConfigError(f"the LoRA model has no adapter {adapter!r} (adapters: "
                              f"{sorted(self.module.peft_config)})")
        return _ActiveAdapter(self.module, adapter)


class _ActiveAdapter:
    def __init__(self, module: Any, adapter: str) -> None:
        self.module, self.adapter = module, adapter

    @contextlib.contextmanager
    def on_device(self) -> Iterator[Any]:
        self.module.set_adapter(self.adapter)  # peft also marks it trainable: the reference pass takes no gradient
        yield self.module


def frozen_reference(model: Any, where: str) -> Reference:
    """The KL reference of the weights `model` holds now: a frozen copy of the module (`where`: offload | device,
    `UpdateSettings.kl_reference`)."""
    return REFERENCES[where](model)


def adapter_references(model: Any, adapters: Sequence[str]) -> dict[str, Reference]:
    """The KL reference of each LoRA adapter of `model` as it is now (`AdapterSnapshot`)."""
    snapshot = AdapterSnapshot(model)
    return {adapter: snapshot.of(adapter) for adapter in adapters}
