"""`UpdateSettings` and `LossSettings`: the config's `update` and `agents.<a>.loss` sections as frozen settings
of one trainable model, validated like the config (invalid values raise `ConfigError` naming the field)."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import ConfigDict, Field, ValidationError

from drmas_graph.config import LossConfig, UpdateConfig
from drmas_graph.errors import ConfigError

__all__ = ["LossSettings", "UpdateSettings"]


def _settings_error(cls: type, exc: ValidationError) -> ConfigError:
    """A ConfigError naming each invalid field as ``Class.field: problem (got value)``."""
    lines = [f"invalid {cls.__name__}:"]
    for err in exc.errors():
        msg = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:
            lines.append(f"  {cls.__name__}: {msg}")
            continue
        field = cls.model_fields.get(str(err["loc"][0]))
        optional = field is not None and type(None) in typing.get_args(field.annotation)
        hint = "; None disables it" if optional and err["type"] != "literal_error" else ""
        lines.append(f"  {cls.__name__}.{'.'.join(map(str, err['loc']))}: {msg} (got {err['input']!r}){hint}")
    return ConfigError("\n".join(lines))


class LossSettings(LossConfig):
    """How the samples of one agent enter the loss: the config's `agents.<a>.loss` section (one source)."""

    model_config = ConfigDict(frozen=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _settings_error(type(self), exc) from None


class UpdateSettings(UpdateConfig):
    """Optimizer and loss settings of one trainable model: the config's `update` section plus the run's seed.

    The fields and their checks live in `drmas_graph.config.UpdateConfig` (one source for YAML configs and
    for code); invalid values raise `ConfigError` naming the field.
    """

    model_config = ConfigDict(frozen=True)

    seed: int = Field(0, description="Seeds the shuffle that splits samples into mini-batches.")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _settings_error(type(self), exc) from None

