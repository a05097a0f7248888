"""`Updater`: the interface of the updater of one trainable model, which the trainer, checkpoints and resume
use. `update.ModelUpdater` (one model, full weights) and `lora.LoraUpdater` (one adapter per agent over a
frozen base) both implement it; `tests/test_update_protocol.py` checks that their members and signatures
match this one, so saving, loading, resuming and gathering weights cannot drift apart between them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from drmas_graph.train.engines import UpdateSettings
from drmas_graph.types import Sample

__all__ = ["Updater"]


@runtime_checkable
class Updater(Protocol):
    """Policy-gradient updates of one trainable model (its agents' samples), its checkpoints and its weights."""

    name: str
    """The model's name in metric keys (``model/<name>/...``)."""
    settings: UpdateSettings
    """Optimizer, loss and backend settings of the model (an adapter's learning rate may override `lr`)."""

    @property
    def n_updates(self) -> int:
        """`update` calls done (restored by `load`); seeds the mini-batch shuffle."""
        ...

    def update(self, samples: Sequence[Sample], *, old_logprobs: str = "given") -> Any:
        """Train on this process's share of the step's samples; metrics with ``to_dict()``. Collective.
        ``old_logprobs``: "given" (the samples') or "current" (the update's own, detached: on-policy)."""
        ...

    def compute_logprobs(self, samples: Sequence[Sample], *, module: torch.nn.Module | None = None
                         ) -> list[torch.Tensor]:
        """log_softmax(logits / T) of each sample's response tokens under the current weights, or under those of
        `module` (a copy of the model, asynchronous training's serving weights); 1-D, CPU."""
        ...

    def full_weights(self) -> contextlib.AbstractContextManager:
        """A block inside which the parameters are whole (ZeRO-3 gathers them). Collective."""
        ...

    def save(self, directory: str | os.PathLike) -> None:
        """Write weights (once), optimizer and RNG state under ``directory``. Collective."""
        ...

    def load(self, directory: str | os.PathLike) -> None:
        """Restore what `save` wrote, in place. Collective."""
        ...
