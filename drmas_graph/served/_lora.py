"""LoRA adapters on served policies: how the servers hold a model's adapters and what each request names.

vLLM loads adapters by name (``/v1/load_lora_adapter``; a request sets ``model`` to its adapter). SGLang here
serves merged weights (base + one adapter). The trainer writes the files (`drmas_graph.train.optim.lora.save_for_sync`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from drmas_graph.errors import ConfigError, PolicyError

if TYPE_CHECKING:
    from drmas_graph.config import LoraConfig

__all__ = ["serve_adapters", "served_adapter", "vllm_launch_kwargs"]

_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted --max-lora-rank values


def serve_adapters(policy: Any, adapters: Sequence[str], engine: str, *, model: str) -> None:
    """Set how a served policy rolls out the adapters of model `model` (see `save_for_sync`).

    vLLM loads them by name (``/v1/load_lora_adapter``; requests set ``model`` to their adapter). SGLang here
    serves merged weights (base + the adapter), so a model's agents must share one adapter there.
    """
    if engine == "vllm":
        policy.lora_by_name = tuple(adapters)
    elif len(adapters) == 1:
        policy.lora_merged = adapters[0]
    else:
        raise ConfigError(f"models.{model}: serve.engine={engine!r} serves merged weights (base + one adapter), but "
                          f"its agents use adapters {list(adapters)}; use serve.engine='vllm' (adapters loaded by "
                          "name), one adapter for all its agents, or one model entry per adapter")


def vllm_launch_kwargs(lora: LoraConfig, adapters: Sequence[str]) -> dict[str, Any]:
    """`launch_vllm` arguments that enable runtime-loaded LoRA adapters for `adapters`."""
    rank = next((r for r in _VLLM_LORA_RANKS if r >= lora.r), None)
    if rank is None:
        raise ConfigError(f"lora.r = {lora.r} is above vLLM's largest --max-lora-rank {_VLLM_LORA_RANKS[-1]}")
    return {"extra_args": ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(rank)],
            "env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}}


def served_adapter(policy: Any, params: Any) -> str | None:
    """The adapter a served request names (vLLM: its ``model``), or None when the served weights are right
    as they are (the base, or the request's adapter merged). Refuses an adapter the servers do not hold."""
    adapter = params.adapter
    by_name, merged = getattr(policy, "lora_by_name", ()), getattr(policy, "lora_merged", None)
    if adapter is not None and adapter in by_name:
        return adapter
    if adapter == merged:
        return None
    served = list(by_name) or ([merged] if merged else [])
    raise PolicyError(f"policy {policy.name!r}: request for LoRA adapter {adapter!r}, but its servers hold "
                      f"{'adapters ' + str(served) if served else 'no adapters'}"
                      f"{' (merged into the weights: every request must name it)' if merged else ''}")

