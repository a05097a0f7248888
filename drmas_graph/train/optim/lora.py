"""LoRA per agent: every agent trains its own adapter over one frozen base model (peft).

The paper's non-shared setting gives each agent its own model. With `models.<m>.lora` the agents of model m
instead share one frozen base and each trains a LoRA adapter (`agents.<a>.adapter`, default: the agent's
name; agents naming the same adapter share it):

- The model is a ``peft.PeftModel`` holding one adapter per name (`attach_adapters`). LoRA B starts at 0, so
  every adapter starts as the base model.
- Generation: a request's adapter is `SamplingParams.adapter` (the trainer sets it per agent). The embedded
  policy decodes a batch of requests for different adapters in one forward pass with peft's mixed-batch
  ``adapter_names=`` argument (`drmas_graph.engine._adapters.adapter_kwargs`); served policies name the
  adapter per request (vLLM: ``model``, SGLang: merged weights; `drmas_graph.served._lora`).
- Training: `LoraUpdater` holds one `ModelUpdater` per adapter, each with its own optimizer over that
  adapter's parameters only (peft's `set_adapter` makes the active adapter the only trainable one), its own
  learning rate (`agents.<a>.lr`) and gradient clipping, as separate models would have. Samples go to the
  updater of their agent's adapter; the base and the other adapters never change. `lora.dropout` (peft's dropout
  on the adapter's input) acts only with `update.dropout: true`: by default the update runs without dropout.
- KL reference: the base model with adapters disabled (`base_forward`), not a copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from drmas_graph.config import check_adapter_name
from drmas_graph.engine import is_peft_model, load_adapter_weights, rank, world_size
from drmas_graph.errors import ConfigError
from drmas_graph.train.engines import default_group_barrier
from drmas_graph.train.optim._packing import PackingProbes

if TYPE_CHECKING:
    from drmas_graph.config import AgentConfig, LoraConfig
    from drmas_graph.types import Sample
    from drmas_graph.train.engines import LossSettings, UpdateSettings
    from drmas_graph.train.optim._update_metrics import UpdateMetrics

__all__ = ["attach_adapters", "base_forward", "build_updater", "LoraUpdater", "LoraUpdateMetrics",
           "load_adapters", "merged_state_dict", "save_for_sync", "save_merged"]


def _import_peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(f"`lora` needs the peft package ({exc}); `pip install drmas-graph[lora]`") from exc
    return peft


# --- the model --------------------------------------------------------------------------------------------


def attach_adapters(model: torch.nn.Module, lora: LoraConfig, adapters: Sequence[str], *,
                    seed: int = 0) -> Any:
    """``model`` wrapped in a ``peft.PeftModel`` with one LoRA adapter per name; the base is frozen.

    Adapter i's A matrix is drawn with seed ``seed + i`` (B is 0, so every adapter starts as the base).
    The base model's modules are modified in place (peft injects the LoRA layers into them).
    """
    peft = _import_peft()
    if not adapters:
        raise ConfigError("attach_adapters: no adapter names given")
    for name in adapters:
        check_adapter_name("attach_adapters", name)
    if len(set(adapters)) != len(adapters):
        raise ConfigError(f"attach_adapters: duplicate adapter names in {list(adapters)}")
    target = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    peft_model = None
    for i, name in enumerate(adapters):
        config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=target)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + i)
            if peft_model is None:
                peft_model = peft.get_peft_model(model, config, adapter_name=name)
            else:
                peft_model.add_adapter(name, config)
    return peft_model.eval()


class base_forward:  # noqa: N801 - used like a function: base_forward(model)(**inputs)
    """The base of a ``PeftModel`` as a callable model: every call runs with all adapters disabled, in
    eval mode, without gradients. Used as the KL reference policy (the initial weights, as LoRA B = 0)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    @torch.no_grad()
    def __call__(self, **inputs: Any) -> Any:
        was_training = self.model.training
        self.model.eval()
        try:
            with self.model.disable_adapter():
                return self.model(**inputs)
        finally:
            self.model.train(was_training)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[base_forward]:
        """`drmas_graph.train.optim._reference.Reference`: the base already sits on the model's device (no copy, no move)."""
        yield self

    def get_output_embeddings(self) -> Any:
        """The LM head with the adapters disabled (for the chunked logprob path: hidden states -> logits)."""
        model = self.model

        @torch.no_grad()
        def head(hidden: torch.Tensor) -> torch.Tensor:
            with model.disable_adapter():
                return model.get_output_embeddings()(hidden)

        return head


# --- saving and loading -----------------------------------------------------------------------------------


def load_adapters(train_models: Mapping[str, Any], checkpoint: Path) -> list[str]:
    """Load the adapters of every LoRA model of `train_models` from a training checkpoint
    (``<checkpoint>/<model>/model``); return their names (`_checkpoints.load_checkpoint_adapters` also pushes them
    to the servers of served ones)."""
    names = [name for name, model in train_models.items() if is_peft_model(model)]
    for name in names:
        load_adapter_weights(train_models[name], checkpoint / name / "model")
    return names


def merged_state_dict(model: Any, adapter: str) -> dict[str, torch.Tensor]:
    """The base model's own state dict (Hugging Face keys) with ``adapter`` merged into every adapted layer,
    W + scaling * B A; ``model`` is not modified (peft's merge_and_unload would change the base in place)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in base.state_dict().items():
            if ".lora_" not in key:
                out[key.replace(".base_layer.", ".")] = value
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and adapter in module.lora_A:
                weight = module.get_base_layer().weight
                merged = weight.float() + module.get_delta_weight(adapter).float()
                out[f"{name}.weight"] = merged.to(weight.dtype)
    return out


def save_merged(model: Any, adapter: str, directory: str | os.PathLike) -> None:
    """Write the base with ``adapter`` merged as a plain Hugging Face model folder (what a server loads)."""
    model.get_base_model().save_pretrained(directory, state_dict=merged_state_dict(model, adapter),
                                           safe_serialization=True)


# --- served policies --------------------------------------------------------------------------------------


def save_for_sync(model: Any, policy: Any, directory: str | os.PathLike) -> None:
    """What the trainer writes before a served policy's `sync_weights(directory, version)`: the full
    model, or for a LoRA model either every adapter in peft format (one subfolder each, loaded by name) or
    the base with the one served adapter merged."""
    if not is_peft_model(model):
        model.save_pretrained(directory, safe_serialization=True)
    elif getattr(policy, "lora_by_name", ()):
        model.save_pretrained(directory, selected_adapters=list(policy.lora_by_name))
    elif getattr(policy, "lora_merged", None) is not None:
        save_merged(model, policy.lora_merged, directory)
    else:
        raise ConfigError(f"policy {policy.name!r} serves a LoRA model but was not told how (serve_adapters)")


# --- training ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoraUpdateMetrics:
    """What one `LoraUpdater.update` did: the `UpdateMetrics` of each adapter's updater."""

    adapters: Mapping[str, UpdateMetrics]
    """By adapter name; keys of `to_dict` are ``model/<model>/<adapter>/...`` and ``agent/<agent>/...``."""

    def to_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for metrics in self.adapters.values():
            out.update(metrics.to_dict())
        return out


class LoraUpdater:
    """Policy-gradient updates of the adapters of one ``PeftModel``: one `ModelUpdater` per adapter.

    Args:
        model: the ``PeftModel`` (see `attach_adapters`), trained in place.
        name: the model's name; adapter updaters are named ``<name>/<adapter>`` in metrics.
        settings: optimizer and loss settings shared by the adapters.
        agent_settings: `LossSettings` of every trained agent.
        agent_adapters: agent -> its adapter (every agent of `agent_settings`).
        adapter_lr: adapter -> learning rate, overriding ``settings.lr``.
        grammars: the rollout policy's grammars, for samples decoded under one (`ModelUpdater`'s).
        references: adapter -> its KL reference where it is not the base (`supervised.AdapterSnapshot`: the
            adapter's weights after a warm start).
    """

    def __init__(self, model: Any, *, name: str, settings: UpdateSettings,
                 agent_settings: Mapping[str, LossSettings], agent_adapters: Mapping[str, str],
                 adapter_lr: Mapping[str, float] | None = None, grammars: Any = None,
                 references: Mapping[str, Any] | None = None) -> None:
        from drmas_graph.train.optim.update import ModelUpdater

        if not is_peft_model(model):
            raise ConfigError(f"LoraUpdater {name!r}: the model is a {type(model).__name__}, not a peft PeftModel; "
                              "wrap it with drmas_graph.train.optim.lora.attach_adapters")
        missing = sorted(set(agent_settings) - set(agent_adapters))
        unknown = sorted({a for a in agent_adapters.values() if a not in model.peft_config})
        if missing or unknown:
            raise ConfigError(f"LoraUpdater {name!r}: agents without an adapter {missing}, unknown adapters {unknown} "
                              f"(the model's adapters: {sorted(model.peft_config)})")
        self.model, self.name, self.settings = model, name, settings
        self.agent_adapters = {a: agent_adapters[a] for a in agent_settings}
        self.updaters: dict[str, ModelUpdater] = {}
        # one probe per module for all adapters (they share the base's attention); grown on demand in one process
        probes = PackingProbes(name, grow=world_size() == 1)
        for adapter in dict.fromkeys(self.agent_adapters.values()):
            lr = (adapter_lr or {}).get(adapter, settings.lr)
            agents = {a: s for a, s in agent_settings.items() if self.agent_adapters[a] == adapter}
            self._activate(adapter)  # the optimizer takes the trainable parameters: this adapter's
            self.updaters[adapter] = ModelUpdater(model, name=f"{name}/{adapter}", agent_settings=agents,
                                                  settings=_with_lr(settings, lr),
                                                  reference=(references or {}).get(adapter) or base_forward(model),
                                                  probes=probes, grammars=grammars)

    def _activate(self, adapter: str) -> None:
        """Make `adapter` the one that forward passes use and the only trainable parameters (peft)."""
        self.model.set_adapter(adapter)

    @property
    def n_updates(self) -> int:
        return max((u.n_updates for u in self.updaters.values()), default=0)

    def update(self, samples: Sequence[Sample], *, old_logprobs: str = "given") -> LoraUpdateMetrics:
        """Train each adapter on the samples of its agents (``old_logprobs`` as in `ModelUpdater.update`).
        Collective like `ModelUpdater.update`: every process calls it, and every adapter's updater runs (with
        no samples it takes no step)."""
        by_adapter = self._split(samples)
        out = {}
        for adapter, updater in self.updaters.items():
            self._activate(adapter)
            out[adapter] = updater.update(by_adapter[adapter], old_logprobs=old_logprobs)
        return LoraUpdateMetrics(out)

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[Sample], *, module: torch.nn.Module | None = None
                         ) -> list[torch.Tensor]:
        """`ModelUpdater.compute_logprobs`, each sample under its agent's adapter (of `module`, a copy of the
        peft model with the same adapters, when given)."""
        self._split(samples)  # raises for samples of unknown agents
        out: list[torch.Tensor | None] = [None] * len(samples)
        for adapter, updater in self.updaters.items():
            rows = [i for i, s in enumerate(samples) if self.agent_adapters[s.agent] == adapter]
            if module is None:
                self._activate(adapter)
            else:
                module.set_adapter(adapter)
            for i, logprobs in zip(rows, updater.compute_logprobs([samples[i] for i in rows], module=module)):
                out[i] = logprobs
        return out  # type: ignore[return-value]

    def _split(self, samples: Sequence[Sample]) -> dict[str, list[Sample]]:
        by_adapter: dict[str, list[Sample]] = {a: [] for a in self.updaters}
        for s in samples:
            if s.agent not in self.agent_adapters:
                raise ConfigError(f"model {self.name!r} got samples of agent {s.agent!r}, which has no adapter "
                                  f"(agents: {sorted(self.agent_adapters)})")
            by_adapter[self.agent_adapters[s.agent]].append(s)
        return by_adapter

    def full_weights(self) -> contextlib.AbstractContextManager:
        """`ModelUpdater.full_weights` of every adapter's updater (ZeRO-3 gathers each adapter; collective)."""
        stack = contextlib.ExitStack()
        for updater in self.updaters.values():
            stack.enter_context(updater.full_weights())
        return stack

    def save(self, directory: str | os.PathLike) -> None:
        """``directory/model/<adapter>/``: every adapter once, in peft format; ``directory/adapters/<adapter>/``:
        each updater's optimizer and RNG state (`ModelUpdater.save_state`). Collective, like `ModelUpdater.save`."""
        directory = Path(directory)
        with self.full_weights():
            if rank() == 0:
                (directory / "model").mkdir(parents=True, exist_ok=True)
                self.model.save_pretrained(directory / "model")
        default_group_barrier()
        for adapter, updater in self.updaters.items():
            self._activate(adapter)
            updater.save_state(directory / "adapters" / adapter)

    def load(self, directory: str | os.PathLike) -> None:
        """Restore what `save` wrote: the adapters (once), then each updater's optimizer and RNG state."""
        directory = Path(directory)
        load_adapter_weights(self.model, directory / "model")
        for adapter, updater in self.updaters.items():
            self._activate(adapter)
            updater.load_state(directory / "adapters" / adapter, weights=None)


def build_updater(model: Any, *, name: str, settings: UpdateSettings, agent_settings: Mapping[str, LossSettings],
                  agent_cfgs: Mapping[str, AgentConfig], grammars: Any = None, reference: Any = None) -> Any:
    """The updater of one trainable model: a `LoraUpdater` for a ``PeftModel``, else a `ModelUpdater`.

    Per-agent learning rates (`AgentConfig.lr`) apply per adapter (agents sharing one must agree), or to the
    whole model when no other agent shares it. `grammars`: the rollout policy's (`Policy.grammars`), for the
    samples it decoded under a grammar. `reference`: the KL reference where it is not the default (the model's
    initial weights; a LoRA adapter's: the base): a `Reference` of the model, or {adapter: Reference} of a LoRA
    model (a warm start's, `supervised.frozen_reference`).
    """
    from drmas_graph.train.optim.update import ModelUpdater

    agents = list(agent_settings)
    if is_peft_model(model):
        adapters = {a: agent_cfgs[a].adapter for a in agents}
        for agent, adapter in adapters.items():
            if adapter is None:
                raise ConfigError(f"agent {agent!r}: model {name!r} trains LoRA adapters; set agents.{agent}.adapter "
                                  f"(one of {sorted(model.peft_config)})")
        lrs = {ad: _shared_lr(f"adapter {ad!r} of model {name!r}", [a for a in agents if adapters[a] == ad],
                              agent_cfgs, settings.lr) for ad in set(adapters.values())}
        return LoraUpdater(model, name=name, settings=settings, agent_settings=agent_settings,
                           agent_adapters=adapters, adapter_lr=lrs, grammars=grammars, references=reference)
    lr = _shared_lr(f"model {name!r}", agents, agent_cfgs, settings.lr)
    return ModelUpdater(model, name=name, settings=_with_lr(settings, lr), agent_settings=agent_settings,
                        grammars=grammars, reference=reference)


def _shared_lr(what: str, agents: Sequence[str], agent_cfgs: Mapping[str, AgentConfig], default: float) -> float:
    """The one learning rate of `agents`, which train the same parameters."""
    lrs = {a: agent_cfgs[a].lr for a in agents if agent_cfgs[a].lr is not None}
    if len(set(lrs.values())) > 1 or (lrs and len(lrs) < len(agents) and set(lrs.values()) != {default}):
        given = {a: agent_cfgs[a].lr for a in agents}
        raise ConfigError(f"{what} is trained by agents {given} (agents.<a>.lr) with different learning rates; "
                          "one set of parameters has one learning rate: give each agent its own adapter "
                          "(models.<m>.lora + agents.<a>.adapter) or the same lr")
    return next(iter(lrs.values()), default)


def _with_lr(settings: UpdateSettings, lr: float) -> UpdateSettings:
    """`settings` with another learning rate (validated like any UpdateSettings)."""
    return type(settings)(**{**settings.model_dump(), "lr": lr})
