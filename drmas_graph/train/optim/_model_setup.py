"""How the update's module computes: its attention kernel, activation checkpointing, autocast, and no dropout
(`UpdateSettings.attn_implementation`, `gradient_checkpointing`, `autocast`, `dropout`), applied once by
`update.ModelUpdater` (and to an embedded policy's own module when the trainer trains a copy)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from drmas_graph.errors import ConfigError
from drmas_graph.train.engines import UpdateSettings

__all__ = ["AUTOCAST_DTYPES", "check_autocast", "prepare_model", "require", "set_attn_implementation",
           "without_dropout"]

AUTOCAST_DTYPES: Mapping[str | None, torch.dtype | None] = {None: None, "bf16": torch.bfloat16}


def require(ok: bool, message: str) -> None:
    """Raise `ConfigError(message)` unless `ok`."""
    if not ok:
        raise ConfigError(message)


def check_autocast(model: torch.nn.Module, autocast: str | None) -> torch.dtype | None:
    """The autocast dtype; autocast is for float32 models (a bfloat16 model already computes in bfloat16)."""
    dtype = AUTOCAST_DTYPES[autocast]
    if dtype is not None:
        dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
        require(dtypes == {torch.float32}, f"UpdateSettings.autocast={autocast!r} is for float32 models; this model "
                 f"has {sorted(map(str, dtypes))} parameters (it already computes in low precision): set autocast=None")
    return dtype


def set_attn_implementation(model: torch.nn.Module, attn_implementation: str | None) -> None:
    """Give ``model`` the attention kernel `UpdateSettings.attn_implementation` names (None: keep its own). Also
    applied to an embedded policy's own module when the trainer trains a copy (`_pipeline.trainer_copies`)."""
    if attn_implementation is None:
        return
    setter = getattr(model, "set_attn_implementation", None)
    require(callable(setter), f"UpdateSettings.attn_implementation={attn_implementation!r}: "
             f"{type(model).__name__} is not a Hugging Face model with set_attn_implementation()")
    try:
        setter(attn_implementation)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"UpdateSettings.attn_implementation={attn_implementation!r}: {exc}") from None


def prepare_model(model: torch.nn.Module, s: UpdateSettings) -> None:
    """Apply the settings that change how the module computes: attention kernel, activation checkpointing."""
    set_attn_implementation(model, s.attn_implementation)
    if s.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
            model, "gradient_checkpointing_enable", None)
        require(callable(enable) and getattr(model, "supports_gradient_checkpointing", False),
                 f"UpdateSettings.gradient_checkpointing: {type(model).__name__} does not support it; set it false")
        if enable.__name__ == "activation_checkpointing_enable":
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@contextlib.contextmanager
def without_dropout(model: torch.nn.Module) -> Iterator[None]:
    """Dropout off in a model in train mode: every submodule in eval mode (nn.Dropout, LoRA's dropout, attention
    dropout read from ``self.training``), except those that run activation checkpointing (Hugging Face checkpoints
    a layer only while it trains), whose own ``*dropout`` probabilities are set to 0 meanwhile."""
    kept = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    zeroed = [(m, k, v) for m in kept for k, v in vars(m).items()
              if k.endswith("dropout") and isinstance(v, float) and v > 0]
    modes = [(m, m.training) for m in model.modules()]
    for m, _ in modes:
        m.training = False
    for m in kept:
        m.training = True
    for m, k, _ in zeroed:
        setattr(m, k, 0.0)
    try:
        yield
    finally:
        for m, k, v in zeroed:
            setattr(m, k, v)
        for m, training in modes:
            m.training = training
