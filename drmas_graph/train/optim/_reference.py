"""The frozen reference policy of the KL penalty (``kl_coef > 0``), chosen by name from `REFERENCES`.

- "offload": a frozen copy of the initial weights lives in CPU memory; once per update it is moved to the
  model's device, the reference logprobs of all the update's samples are computed, and it goes back. It
  never shares the device with the gradients, optimizer state and activations of the training passes.
- "device": the frozen copy stays on the model's device (no transfers; one more copy of the weights there).

Any object with an ``on_device()`` context manager that yields a module to run forward is a reference: a
LoRA-adapted model needs no copy at all (its reference is the same module with the adapter disabled);
pass such an object as ``ModelUpdater(reference=...)``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

import torch

__all__ = ["REFERENCES", "DeviceCopy", "OffloadedCopy", "Reference"]


class Reference(Protocol):
    """A frozen policy the KL penalty compares against."""

    def on_device(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """A module on the trained model's device, ready for no-grad forward passes, for the ``with`` block."""
        ...


def _frozen_copy(model: torch.nn.Module, device: torch.device | None = None) -> torch.nn.Module:
    """A copy of ``model`` in eval mode without gradients, its tensors made directly on ``device`` (default:
    where they are) so that a copy meant for the CPU never needs room on the GPU."""
    memo: dict[int, object] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in memo:
            clone = t.detach().to(device or t.device, copy=True)
            memo[id(t)] = torch.nn.Parameter(clone, requires_grad=False) if isinstance(t, torch.nn.Parameter) else clone
    ref = copy.deepcopy(model, memo)
    ref.eval()
    ref.requires_grad_(False)
    return ref


class DeviceCopy:
    """A frozen copy of the initial weights on the model's device."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = _frozen_copy(model)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[torch.nn.Module]:
        yield self.module


class OffloadedCopy:
    """A frozen copy of the initial weights in CPU memory, moved to the model's device while in use."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.device = next(model.parameters()).device
        self.module = _frozen_copy(model, torch.device("cpu"))

    @contextlib.contextmanager
    def on_device(self) -> Iterator[torch.nn.Module]:
        self.module.to(self.device)
        try:
            yield self.module
        finally:
            self.module.to("cpu")


REFERENCES: Mapping[str, Callable[[torch.nn.Module], Reference]] = {"offload": OffloadedCopy, "device": DeviceCopy}
