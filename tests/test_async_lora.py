"""Asynchronous training of LoRA models (`models.<m>.lora` with `async.max_staleness` >= 1): the trainer trains a
copy of the adapters only (the frozen base is shared with the policy's module), installs them at the boundary,
corrects stale samples per adapter, and stays reproducible to the last digit one step off."""

import pytest
import torch

pytest.importorskip("peft")

from drmas_graph.train.loop import _pipeline  # noqa: E402
from drmas_graph.train.loop.trainer import Trainer  # noqa: E402
from tests import _graphs  # noqa: E402
from tests._envs import ParityEnv  # noqa: E402
from tests.test_instrument import Unreachable  # noqa: E402
from tests.test_lora import config, groups, moved  # noqa: E402


def run(tmp_path, run_dir, *, conc=8, steps=3, **async_):
    cfg = config(tmp_path, run_dir=str(tmp_path / run_dir), steps=steps, max_concurrency=conc,
                 **{"async": {"max_staleness": 1, **async_}})
    trainer = Trainer(_graphs.solver_verifier(Unreachable()).compile(), ParityEnv(n_train=5), cfg)
    try:
        policy, copy_ = trainer.state.models["m"].policy.model, trainer.state.models["m"].trained
        shared = {n for n, p in copy_.named_parameters()
                  if p.data_ptr() == dict(policy.named_parameters())[n].data_ptr()}
        initial = groups(policy)
        result = trainer.run()
        return result, groups(copy_), groups(policy), initial, shared, trainer
    finally:
        trainer.close()


def test_lora_one_step_off_trains_a_copy_of_the_adapters_reproducibly(tmp_path):
    r1, trained1, _, _, _, _ = run(tmp_path, "c1", conc=1)
    r8, trained8, served8, initial, shared, trainer = run(tmp_path, "c8", conc=8)
    assert isinstance(trainer.pipeline, _pipeline.OneStepOff)
    base = set(initial["base"])
    assert shared == base  # the copy shares every base tensor and none of the adapters'
    assert moved(initial, trained8) == {"solver", "verifier"}  # both adapters trained, the base untouched
    assert moved(trained1, trained8) == set()  # bit for bit at max_concurrency 1 and 8
    assert moved(trained8, served8) == set()  # the final install (before the evaluation) reached the policy
    assert [h["async/staleness_mean"] for h in r8.history] == [0.0, 1.0, 1.0]
    for h in r8.history[1:]:  # each adapter's samples were corrected (importance weights near 1)
        for agent in ("solver", "verifier"):
            assert 0.5 < h[f"agent/{agent}/is_weight_mean"] < 1.5
    assert [h["reward/team_mean"] for h in r1.history] == [h["reward/team_mean"] for h in r8.history]


def test_lora_free_running_keeps_staleness_within_the_bound(tmp_path):
    result, trained, served, initial, _, trainer = run(tmp_path, "free", steps=4, max_staleness=2, schedule="free")
    assert isinstance(trainer.pipeline, _pipeline.FreeRunning)
    assert moved(initial, trained) == {"solver", "verifier"}
    assert moved(trained, served) == set()
    assert all(h["async/staleness_max"] <= 2 and h["async/dropped_groups"] == 0 for h in result.history)


def test_a_lora_copy_under_zero3_does_not_share_the_base(tmp_path):
    """ZeRO-3 partitions every parameter of the module it trains: the policy's base must not be among them."""
    cfg = config(tmp_path, **{"async": {"max_staleness": 1}})
    cfg.update = cfg.update.model_copy(update={"zero_stage": 3, "backend": "deepspeed"})
    assert cfg.update.zero() == 3
    assert _pipeline._frozen_base(torch.nn.Module(), cfg.update.zero()) == {}  # not a peft model
    from tests.test_lora import lora_model

    model = lora_model()[0]
    assert _pipeline._frozen_base(model, cfg.update.zero()) == {}
    cfg.update = cfg.update.model_copy(update={"zero_stage": 1})
    base = _pipeline._frozen_base(model, cfg.update.zero())
    names = {n for n, p in model.named_parameters() if id(p) in base}
    assert names and all("lora_" not in n for n in names)
    assert len(names) == sum(1 for n, _ in model.named_parameters() if "lora_" not in n)


def test_the_memory_check_counts_only_the_adapters(tmp_path, monkeypatch):
    """A device with room for half a model: enough for a LoRA model's adapters (the base is shared), not for a
    second copy of the full model (which then trains synchronously)."""
    from drmas_graph.testing import tiny_model, tiny_tokenizer

    total = sum(p.numel() * p.element_size() for p in tiny_model(tiny_tokenizer(), seed=0).parameters())
    monkeypatch.setattr(_pipeline, "_free_bytes", lambda module: total // 2)
    graph = _graphs.solver_verifier(Unreachable()).compile()
    lora = Trainer(graph, ParityEnv(n_train=5), config(tmp_path, **{"async": {"max_staleness": 1}}))
    try:
        assert lora.pipeline is not None and lora.state.async_fallback is None
        copied = [n for n, p in lora.state.models["m"].trained.named_parameters()
                  if p.data_ptr() != dict(lora.state.models["m"].policy.model.named_parameters())[n].data_ptr()]
        assert copied and all("lora_" in n for n in copied)
    finally:
        lora.close()
    full = Trainer(graph, ParityEnv(n_train=5), config(tmp_path, run_dir=str(tmp_path / "full"),
                                                       models={"m": {"tiny": {"seed": 0}}},
                                                       **{"async": {"max_staleness": 1}}))
    try:
        assert full.pipeline is None and "needs a second copy of its weights" in full.state.async_fallback
    finally:
        full.close()
