"""LoRA adapters on a model, as the embedded engine and the optimizer backends see them (peft, imported lazily).

- `is_peft_model`: whether a model carries adapters.
- `adapter_kwargs`: the forward kwargs of a batch whose rows use different adapters (peft's mixed batch).
- `load_adapter_weights`: copy saved adapters into a model's parameters, in place.

Attaching adapters and training them is `drmas_graph.train.optim.lora`; the adapter names per agent are config
(`drmas_graph.config.resolve_adapters`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from drmas_graph.config import BASE_ADAPTER
from drmas_graph.errors import ConfigError, PolicyError

__all__ = ["is_peft_model", "adapter_kwargs", "load_adapter_weights"]


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (checked without importing peft)."""
    return any(c.__module__.startswith("peft.") and c.__name__ == "PeftModel" for c in type(model).__mro__)


def adapter_kwargs(model: Any, adapters: Sequence[str | None], *, policy: str) -> dict[str, Any]:
    """Forward kwargs that make row i of a batch use adapter ``adapters[i]`` (None = the base model).

    peft's mixed batch: ``adapter_names=[...]`` runs every LoRA layer's sub-batch through its own adapter.
    A model without adapters takes no extra kwargs, and refuses requests that name one.
    """
    if not is_peft_model(model):
        named = sorted({a for a in adapters if a is not None})
        if named:
            raise PolicyError(f"policy {policy!r}: requests name LoRA adapter(s) {named} but its model has no "
                              "adapters; configure `models.<name>.lora` (or wrap it with attach_adapters)")
        return {}
    unknown = sorted({a for a in adapters if a is not None and a not in model.peft_config})
    if unknown:
        raise PolicyError(f"policy {policy!r}: unknown LoRA adapter(s) {unknown}; its adapters: "
                          f"{sorted(model.peft_config)}")
    return {"adapter_names": [a if a is not None else BASE_ADAPTER for a in adapters]}


def load_adapter_weights(model: Any, path: str | os.PathLike) -> None:
    """Copy every adapter saved by ``model.save_pretrained(path)`` (peft layout: one subfolder per adapter)
    into ``model``'s own parameters, in place."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(path)
    for adapter in model.peft_config:
        file = (path if adapter == "default" else path / adapter) / "adapter_model.safetensors"
        if not file.exists():
            raise ConfigError(f"{file} not found: the checkpoint has no LoRA adapter {adapter!r} (saved with other "
                              f"adapters: {sorted(p.name for p in path.iterdir() if p.is_dir())})")
        result = set_peft_model_state_dict(model, load_file(file, device=str(_device(model))), adapter_name=adapter)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ConfigError(f"{file}: weights that fit no layer of adapter {adapter!r}: {unexpected[:3]}")


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device

