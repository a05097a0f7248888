"""The updaters' one interface (`drmas_graph.train.optim._updater.Updater`): `ModelUpdater` and `LoraUpdater` both
implement every member with the protocol's signature, so the trainer, checkpoints and resume can use either."""

from __future__ import annotations

import inspect

import pytest

from drmas_graph.train.optim._updater import Updater
from drmas_graph.train.optim.update import ModelUpdater

pytest.importorskip("peft")
from drmas_graph.train.optim.lora import LoraUpdater  # noqa: E402
from tests.test_lora import lora_model, updater  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

METHODS = ("update", "compute_logprobs", "full_weights", "save", "load")


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("cls", [ModelUpdater, LoraUpdater])
def test_both_updaters_have_every_method_of_the_protocol_with_its_signature(cls):
    for name in METHODS:
        assert _params(getattr(cls, name)) == _params(getattr(Updater, name)), f"{cls.__name__}.{name}"


def test_built_updaters_are_updaters_with_settings_name_and_n_updates():
    from drmas_graph.testing import tiny_model, tiny_tokenizer
    from drmas_graph.train.optim.update import UpdateSettings

    lora = updater(lora_model()[0])
    plain = ModelUpdater(tiny_model(tiny_tokenizer()), name="p", settings=UpdateSettings(backend="torch"))
    for up in (lora, plain):
        assert isinstance(up, Updater)
        assert isinstance(up.settings, UpdateSettings) and up.n_updates == 0 and isinstance(up.name, str)
    assert lora.settings.backend == "torch" and lora.settings.zero() == 0  # what resume checks
