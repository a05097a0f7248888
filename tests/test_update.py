"""ModelUpdater on a tiny real model: logprob agreement with the rollout backend, the direction of the step,
loss normalization over micro-batches, torch vs DeepSpeed, clipping, checkpoints and config errors."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import sys
import threading

import pytest
import torch
from langchain_core.messages import HumanMessage, SystemMessage
from torch.testing import assert_close

from drmas_graph.errors import ConfigError
from drmas_graph.train.optim.losses import policy_loss
from drmas_graph.testing import tiny_model, tiny_policy, tiny_tokenizer
from drmas_graph.types import Sample, SamplingParams
from drmas_graph.train.optim.update import LossSettings, ModelUpdater, UpdateSettings

# deepspeed's import uses torch.jit.script_method, deprecated in torch 2.13
pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed")
DEEPSPEED_BACKENDS = [pytest.param(("deepspeed", stage), marks=needs_deepspeed, id=f"zero{stage}")
                      for stage in (0, 1, 2, 3)]

PROMPTS = [
    [HumanMessage("hi")],
    [HumanMessage("What is 2 + 3? Answer with just the number.")],
    [SystemMessage("You are the verifier."), HumanMessage("The solver says 7 + 5 = 12. approve or reject?")],
]


@pytest.fixture(scope="module")
def rollout() -> list[Sample]:
    """Six real responses of tiny_policy(seed=0) at T=0.7 (two per prompt), decoded in batches with left
    padding; advantages +1/-1 alternate, agents 'solver' and 'verifier' alternate by prompt."""
    policy = tiny_policy(seed=0, batch_wait_s=0.3, max_batch_wait_s=1.0)
    params = SamplingParams(temperature=0.7, max_new_tokens=12)
    results: list = [None] * 6

    def call(i: int) -> None:
        prompt_ids = policy.render(PROMPTS[i % 3])
        results[i] = (prompt_ids, policy.generate(prompt_ids, params.replace(seed=100 + i)))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert policy.stats.max_batch >= 2, "prompts of different lengths must share a left-padded batch"
    policy.close()
    return [Sample(tuple(ids), g.token_ids, g.logprobs, advantage=(-1.0) ** i, temperature=0.7,
                   agent="solver" if i % 3 != 2 else "verifier", turn_index=i)
            for i, (ids, g) in enumerate(results)]


def fresh_model(seed: int = 0) -> torch.nn.Module:
    """The weights tiny_policy(seed) starts from."""
    return tiny_model(tiny_tokenizer(), seed=seed)


def settings(backend=("torch", 0), **changes) -> UpdateSettings:
    return UpdateSettings(**{"lr": 1e-3, "backend": backend[0], "zero_stage": backend[1], **changes})


def snapshot(model, updater: ModelUpdater | None = None) -> dict[str, torch.Tensor]:
    """The weights; with an updater, gathered (ZeRO-3 shards them; each must be whole and non-empty)."""
    with updater.full_weights() if updater is not None else contextlib.nullcontext():
        out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert all(v.numel() > 0 for v in out.values())
    return out


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_same_first_adamw_step(start: dict, a: dict, b: dict, lr: float) -> None:
    """Two first AdamW steps from `start` agree. A coordinate moves by lr * g / (|g| + eps) (plus the same
    weight decay on both sides): a full step (|step| > 0.99 lr on both sides, |g| >> eps) must agree to
    1e-3 lr. Where |g| ~ eps = 1e-8 the ratio amplifies float32 roundoff of another summation order (thread
    count, micro-batching, ZeRO buckets): measured up to 12% of lr there, so those agree within lr / 2; a
    wrongly signed or weighted sample flips steps (differences ~2 lr). The exact checks are loss and grad norm."""
    for k, w0 in start.items():
        da, db = a[k] - w0, b[k] - w0
        full = (da.abs() > 0.99 * lr) & (db.abs() > 0.99 * lr)
        diff = (da - db).abs()
        assert diff[full].max().item() <= 1e-3 * lr if full.any() else True, k
        assert diff.max().item() < 0.5 * lr, k


def change_norm(a: dict, b: dict) -> float:
    return math.sqrt(sum(((a[k] - b[k]).double() ** 2).sum().item() for k in a))


def with_lengths(samples: list[Sample], lengths: list[int]) -> list[Sample]:
    """Responses cut to the given lengths (prefixes of real samples are real samples)."""
    return [dataclasses.replace(s, response_ids=s.response_ids[:n], old_logprobs=s.old_logprobs[:n])
            for s, n in zip(samples, lengths)]


def reference_grad_norm(model, samples: list[Sample], agg: str, clip: dict | None = None) -> tuple[float, float]:
    """(loss, grad norm) of `policy_loss` over all samples as one batch, each sample forwarded on its own:
    the number the micro-batched update must reproduce."""
    logprobs, olds = [], []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1: -1].float() / s.temperature
        logprobs.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0])
        olds.append(torch.tensor(s.old_logprobs))
    pad = torch.nn.utils.rnn.pad_sequence
    mask = pad([torch.ones(len(s.response_ids)) for s in samples], batch_first=True)
    loss, _ = policy_loss(pad(logprobs, batch_first=True), pad(olds, batch_first=True),
                          torch.tensor([s.advantage for s in samples]), mask, agg=agg, **(clip or {}))
    model.zero_grad()
    loss.backward()
    norm = math.sqrt(sum((p.grad.double() ** 2).sum().item() for p in model.parameters() if p.grad is not None))
    model.zero_grad()
    return loss.item(), norm


# --- the rollout and the trainer see the same logprobs -----------------------------------------------------


@pytest.mark.parametrize("backend", [("torch", 0), *DEEPSPEED_BACKENDS[2:]])
def test_logprob_mismatch_with_embedded_rollout_is_zero(rollout, backend):
    updater = ModelUpdater(fresh_model(), name="m", settings=settings(backend))
    for sample, logprobs in zip(rollout, updater.compute_logprobs(rollout)):
        assert len(sample.response_ids) > 0
        assert_close(logprobs, torch.tensor(sample.old_logprobs), atol=1e-4, rtol=0)
    metrics = updater.update(rollout)
    for agent in ("solver", "verifier"):
        assert metrics.agents[agent].logprob_mismatch < 1e-4
        assert abs(metrics.agents[agent].approx_kl) < 1e-4
        assert metrics.agents[agent].clip_frac == 0.0  # ratio 1 everywhere on the first mini-batch
    assert metrics.n_samples == 6 and metrics.agents["verifier"].n_samples == 2
    assert metrics.n_tokens == sum(len(s.response_ids) for s in rollout)


@needs_deepspeed
def test_zero2_trains_the_rollout_policy_in_place(rollout):
    # The policy serves the very module DeepSpeed trains: no copy, new weights visible at once.
    policy = tiny_policy(seed=0)
    params_before = list(policy.model.parameters())
    updater = ModelUpdater(policy.model, name="m", settings=settings(("deepspeed", 2)))
    assert updater.model is policy.model
    assert all(a is b for a, b in zip(params_before, policy.model.parameters()))
    before = snapshot(policy.model)
    with policy.updating_weights():
        updater.update(rollout)
    assert policy.version == 1 and not policy.model.training
    assert max_diff(before, snapshot(policy.model)) > 1e-4
    prompt_ids = policy.render(PROMPTS[1])
    gen = policy.generate(prompt_ids, SamplingParams(temperature=0.7, max_new_tokens=8, seed=5))
    policy.close()
    sample = Sample(tuple(prompt_ids), gen.token_ids, gen.logprobs, 0.0, "solver", temperature=0.7)
    assert_close(updater.compute_logprobs([sample])[0], torch.tensor(gen.logprobs), atol=1e-4, rtol=0)


# --- direction and size of the step ------------------------------------------------------------------------


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_advantage_sign_moves_logprobs_of_sampled_responses(rollout, sign):
    samples = [dataclasses.replace(s, advantage=sign) for s in rollout]
    updater = ModelUpdater(fresh_model(), name="m", settings=settings(weight_decay=0.0))

    def mean_logprob() -> float:
        return torch.cat(updater.compute_logprobs(samples)).mean().item()

    before = mean_logprob()
    for _ in range(3):
        metrics = updater.update(samples)
    after = mean_logprob()
    assert sign * (after - before) > 0.05, (before, after)
    # the last update started from moved weights: the importance ratio has left 1
    assert metrics.agents["solver"].approx_kl * sign < 0


@pytest.mark.parametrize("backend", [("torch", 0), *DEEPSPEED_BACKENDS[::2]])
def test_zero_advantages_leave_parameters_unchanged(rollout, backend):
    samples = [dataclasses.replace(s, advantage=0.0) for s in rollout]
    model = fresh_model()
    before = snapshot(model)
    updater = ModelUpdater(model, name="m", settings=settings(backend))  # weight decay 0.01: a step would show
    metrics = updater.update(samples)
    # no sample is forwarded and no optimizer step taken (rev7: one sample was forwarded and AdamW stepped, its
    # weight decay moving every weight): nothing measured, so no loss, norm or per-agent loss (absent from the logs)
    assert (metrics.n_minibatches, metrics.skipped_minibatches) == (0, 1)
    assert metrics.grad_norm is metrics.loss is metrics.grad_norm_max is None
    assert [a.pg_loss for a in metrics.agents.values()] == [None, None] and len(metrics.agents) == 2
    assert "model/m/loss" not in metrics.to_dict() and metrics.to_dict()["model/m/skipped_minibatches"] == 1.0
    assert max_diff(before, snapshot(model, updater)) == 0.0


def test_grad_clip_bounds_the_step_and_reports_the_preclip_norm(rollout):
    model = fresh_model()
    _, expected_norm = reference_grad_norm(model, rollout, "token-mean")
    before = snapshot(model)
    clip, lr, eps = 1e-10, 1e-3, 1e-8
    s = UpdateSettings(lr=lr, grad_clip=clip, weight_decay=0.0, backend="torch")
    metrics = ModelUpdater(model, name="m", settings=s).update(rollout)
    assert metrics.grad_norm == pytest.approx(expected_norm, rel=1e-5)
    assert expected_norm > 1.0
    # First AdamW step: |d theta_i| = lr |g_i| / (|g_i| + eps) <= lr |g_i| / eps, so ||d theta|| <= lr clip / eps
    # (1e-5 here; unclipped it would be about lr * sqrt(#params) ~ 0.3).
    assert 0 < change_norm(before, snapshot(model)) <= lr * clip / eps * 1.001


# --- loss normalization over micro-batches -----------------------------------------------------------------


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batch_size_does_not_change_the_step(rollout, agg):
    samples = with_lengths(rollout, [3, 12, 7, 1, 10, 5])
    reference_loss, reference_norm = reference_grad_norm(fresh_model(), samples, agg)
    results = []
    for size in (1, 8):
        model = fresh_model()
        agents = {"solver": LossSettings(micro_batch_size=size), "verifier": LossSettings(micro_batch_size=size)}
        metrics = ModelUpdater(model, name="m", settings=settings(loss_agg=agg, grad_clip=None),
                               agent_settings=agents).update(samples)
        # Both agents are in the mini-batch, so even size 8 accumulates two micro-batches.
        assert metrics.loss == pytest.approx(reference_loss, rel=1e-5, abs=5e-7)  # here the loss is ~0
        assert metrics.grad_norm == pytest.approx(reference_norm, rel=1e-5)
        results.append(snapshot(model))
    assert_same_first_adamw_step(snapshot(fresh_model()), *results, lr=1e-3)


def test_minibatches_take_one_step_each_on_a_seeded_split(rollout):
    def run(seed):
        model = fresh_model()
        metrics = ModelUpdater(model, name="m", settings=settings(n_minibatches=3, seed=seed)).update(rollout)
        return metrics, snapshot(model)

    (m1, p1), (_, p2), (_, p3) = run(0), run(0), run(1)
    assert m1.n_minibatches == 3 and m1.n_samples == 6
    assert m1.grad_norm_max >= m1.grad_norm > 0
    assert max_diff(p1, p2) == 0.0 and max_diff(p1, p3) > 0.0


# --- per-agent settings ------------------------------------------------------------------------------------


def test_agent_with_zero_loss_weight_contributes_nothing(rollout):
    agents = {"solver": LossSettings(micro_batch_size=2), "verifier": LossSettings(loss_weight=0.0)}
    model_all, model_solver = fresh_model(), fresh_model()
    metrics = ModelUpdater(model_all, name="m", settings=settings(), agent_settings=agents).update(rollout)
    solver_only = ModelUpdater(model_solver, name="m", settings=settings(), agent_settings=agents).update(
        [s for s in rollout if s.agent == "solver"])
    assert metrics.grad_norm == pytest.approx(solver_only.grad_norm, rel=1e-6)
    assert metrics.loss == pytest.approx(solver_only.loss, rel=1e-6, abs=1e-9)
    assert max_diff(snapshot(model_all), snapshot(model_solver)) < 1e-6
    # the untrained agent is still measured
    assert metrics.agents["verifier"].n_samples == 2
    assert metrics.agents["verifier"].logprob_mismatch < 1e-4


def test_clip_range_is_per_agent(rollout):
    # old logprobs 0.1 below the current ones: ratio e^0.1 = 1.105 on every token, advantages positive.
    samples = [dataclasses.replace(s, advantage=1.0, old_logprobs=tuple(x - 0.1 for x in s.old_logprobs))
               for s in rollout]
    agents = {"solver": LossSettings(clip_high=0.05), "verifier": LossSettings(clip_high=0.5)}
    metrics = ModelUpdater(fresh_model(), name="m", settings=settings(), agent_settings=agents).update(samples)
    assert metrics.agents["solver"].clip_frac == 1.0
    assert metrics.agents["verifier"].clip_frac == 0.0
    assert metrics.agents["verifier"].ratio_max == pytest.approx(math.exp(0.1), rel=1e-3)


def test_an_agent_without_a_sample_with_nonzero_advantage_has_no_importance_weight(rollout):
    """Every verifier sample has advantage 0 (not forwarded, KL and entropy off): its ratio_max is absent from
    the update's metrics (it was 0.0, drawn as a 0 in the UI's importance-weight chart); the solver's is measured."""
    samples = [dataclasses.replace(s, advantage=0.0 if s.agent == "verifier" else 1.0,
                                   old_logprobs=tuple(x - 0.1 for x in s.old_logprobs)) for s in rollout]
    metrics = ModelUpdater(fresh_model(), name="m", settings=settings()).update(samples)
    assert metrics.agents["verifier"].n_samples == 2 and metrics.agents["verifier"].ratio_max is None
    assert metrics.agents["solver"].ratio_max == pytest.approx(math.exp(0.1), rel=1e-3)
    flat = metrics.to_dict()
    assert "agent/verifier/ratio_max" not in flat and "agent/verifier/n_samples" in flat
    assert flat["agent/solver/ratio_max"] == pytest.approx(math.exp(0.1), rel=1e-3)


def test_an_agent_whose_samples_were_all_skipped_logs_no_loss_clip_or_kl(rollout):
    """The verifier's samples all have advantage 0 (skipped): nothing was measured for it, so its pg_loss,
    clip_frac, dual_clip_frac and approx_kl are absent (they were logged as 0.0); the solver's are numbers."""
    samples = [dataclasses.replace(s, advantage=0.0 if s.agent == "verifier" else 1.0,
                                   old_logprobs=tuple(x - 0.1 for x in s.old_logprobs)) for s in rollout]
    metrics = ModelUpdater(fresh_model(), name="m", settings=settings()).update(samples)
    names = ("pg_loss", "clip_frac", "dual_clip_frac", "approx_kl")
    assert [getattr(metrics.agents["verifier"], n) for n in names] == [None] * 4
    flat = metrics.to_dict()
    assert [f"agent/verifier/{n}" in flat for n in names] == [False] * 4
    assert flat["agent/verifier/n_samples"] == 2.0
    # the solver's ratio is e^0.1 on every token (advantage 1 > 0, clip_high 0.2 not reached): approx_kl = -0.1
    assert flat["agent/solver/approx_kl"] == pytest.approx(-0.1, abs=1e-4)
    assert flat["agent/solver/clip_frac"] == 0.0 and flat["agent/solver/dual_clip_frac"] == 0.0
    assert flat["agent/solver/pg_loss"] == pytest.approx(-math.exp(0.1), rel=1e-3)


def test_unknown_agent_is_an_error_when_agent_settings_are_given(rollout):
    updater = ModelUpdater(fresh_model(), name="m", settings=settings(),
                           agent_settings={"solver": LossSettings()})
    with pytest.raises(ConfigError, match=r"agent 'verifier'.*add it to agent_settings"):
        updater.update(rollout)


# --- KL and entropy terms ----------------------------------------------------------------------------------


def test_kl_to_reference_starts_at_zero_and_grows(rollout):
    updater = ModelUpdater(fresh_model(), name="m", settings=settings(kl_coef=0.1))
    first = updater.update(rollout)
    assert first.agents["solver"].kl_ref == pytest.approx(0.0, abs=1e-6)
    later = updater.update(rollout)
    assert later.agents["solver"].kl_ref > 1e-4
    assert "agent/solver/kl_ref" in later.to_dict()
    assert "agent/solver/kl_ref" not in ModelUpdater(fresh_model(), name="m", settings=settings()).update(
        rollout).to_dict()


def test_entropy_bonus_raises_entropy(rollout):
    samples = [dataclasses.replace(s, advantage=0.0) for s in rollout]
    updater = ModelUpdater(fresh_model(), name="m", settings=settings(entropy_coef=1.0, weight_decay=0.0))
    first = updater.update(samples)
    assert first.grad_norm > 0 and first.loss == pytest.approx(-first.agents["solver"].entropy, rel=0.1)
    for _ in range(3):
        last = updater.update(samples)
    assert last.agents["solver"].entropy > first.agents["solver"].entropy


# --- backends agree ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", DEEPSPEED_BACKENDS)
def test_deepspeed_step_equals_torch_step(rollout, backend):
    # One step accumulated over 5 micro-batches (4 of 1 solver sample, 1 of 2 verifier samples), clipped.
    s = dict(grad_clip=0.1)
    agents = {"solver": LossSettings(micro_batch_size=1), "verifier": LossSettings(micro_batch_size=2)}
    results = []
    for b in (("torch", 0), backend):
        model = fresh_model()
        updater = ModelUpdater(model, name="m", settings=settings(b, **s), agent_settings=agents)
        metrics = updater.update(rollout)
        results.append((metrics, snapshot(model, updater)))
    (torch_metrics, torch_params), (ds_metrics, ds_params) = results
    # ZeRO-3 sums gradients in another order: 7 of 139,840 weights differed by > 1e-7 (the largest 1.8e-6,
    # on a step of 6.5e-5, |g| ~ eps); every full step agrees.
    assert_same_first_adamw_step(snapshot(fresh_model()), torch_params, ds_params, lr=1e-3)
    assert ds_metrics.grad_norm == pytest.approx(torch_metrics.grad_norm, rel=1e-5)
    assert ds_metrics.grad_norm_max > 0.1  # clipping was active
    assert ds_metrics.loss == pytest.approx(torch_metrics.loss, rel=1e-5)
    assert ds_metrics.lr == torch_metrics.lr == 1e-3


# --- checkpoints -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", [("torch", 0), *DEEPSPEED_BACKENDS[2:]])
def test_save_load_resumes_exactly(rollout, tmp_path, backend):
    from transformers import AutoModelForCausalLM

    s = settings(backend, n_minibatches=2)
    first, second = rollout[:4], rollout[2:]
    model = fresh_model()
    updater = ModelUpdater(model, name="m", settings=s)
    updater.update(first)
    updater.save(tmp_path / "ckpt")
    saved = snapshot(model, updater)
    updater.update(second)
    expected = snapshot(model, updater)

    resumed_model = fresh_model()
    resumed = ModelUpdater(resumed_model, name="m", settings=s)
    resumed.load(tmp_path / "ckpt")
    assert max_diff(snapshot(resumed_model, resumed), saved) == 0.0
    assert resumed.n_updates == 1
    resumed.update(second)
    assert max_diff(snapshot(resumed_model, resumed), expected) < 1e-7

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model")
    assert max_diff(snapshot(exported), saved) == 0.0
    assert any(p.name.endswith(".safetensors") for p in (tmp_path / "ckpt" / "model").iterdir())


def test_update_without_samples_takes_no_step():
    model = fresh_model()
    before = snapshot(model)
    metrics = ModelUpdater(model, name="m", settings=settings(n_minibatches=2)).update([])
    assert metrics.n_minibatches == 0 and metrics.n_samples == 0 and metrics.agents == {}
    assert max_diff(before, snapshot(model)) == 0.0


def test_load_of_a_missing_checkpoint_names_the_file(tmp_path):
    updater = ModelUpdater(fresh_model(), name="m", settings=settings())
    with pytest.raises(ConfigError, match="updater_state_rank0.pt"):
        updater.load(tmp_path)


# --- configuration errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "pattern"), [
    ({"loss_agg": "sum"}, r"UpdateSettings.loss_agg: unknown loss_agg 'sum'; valid: .*'token-mean'"),
    ({"backend": "fsdp"}, r"UpdateSettings.backend: Input should be 'deepspeed' or 'torch' \(got 'fsdp'\)"),
    ({"zero_stage": 4}, r"UpdateSettings.zero_stage: Input should be 0, 1, 2 or 3 \(got 4\)"),
    ({"zero_stage": 2, "backend": "torch"}, r"UpdateSettings: zero_stage=2 needs backend='deepspeed'"),
    ({"loss_agg": "seq-mean-token-sum-norm"}, r"norm_len must be set"),
    ({"lr": -1.0}, r"UpdateSettings.lr: .*greater than or equal to 0"),
    ({"lr": math.nan}, r"UpdateSettings.lr: .*finite"),
    ({"grad_clip": 0.0}, r"grad_clip.*None disables it"),
    ({"n_minibatches": 0}, r"n_minibatches"),
    ({"betas": (0.9, 1.5)}, r"betas"),
    ({"kl_coef": -1.0}, r"kl_coef"),
    ({"autocast": "fp8"}, r"UpdateSettings.autocast: Input should be 'bf16'"),
    ({"lr_typo": 1.0}, r"UpdateSettings.lr_typo: Extra inputs are not permitted"),
])
def test_invalid_update_settings_name_the_field(changes, pattern):
    with pytest.raises(ConfigError, match=pattern):
        UpdateSettings(**changes)


@pytest.mark.parametrize(("changes", "pattern"), [
    ({"micro_batch_size": 0}, "micro_batch_size"),
    ({"clip_low": 1.0}, "clip_low"),
    ({"dual_clip": 1.0}, "dual_clip.*None disables it"),
    ({"loss_weight": -1.0}, "loss_weight"),
])
def test_invalid_loss_settings_name_the_field(changes, pattern):
    with pytest.raises(ConfigError, match=pattern):
        LossSettings(**changes)


def test_missing_deepspeed_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` raise ImportError
    with pytest.raises(ConfigError, match=r"pip install drmas-graph\[deepspeed\].*backend='torch'"):
        ModelUpdater(fresh_model(), name="m", settings=UpdateSettings(backend="deepspeed"))


def test_malformed_sample_is_rejected_before_training(rollout):
    bad = dataclasses.replace(rollout[0], old_logprobs=rollout[0].old_logprobs[:-1])
    model = fresh_model()
    before = snapshot(model)
    with pytest.raises(ConfigError, match=r"sample 1 .*response ids but .*old logprobs"):
        ModelUpdater(model, name="m", settings=settings()).update([rollout[1], bad])
    assert max_diff(before, snapshot(model)) == 0.0


def test_metrics_to_dict_keys(rollout):
    metrics = ModelUpdater(fresh_model(), name="policy-a", settings=settings()).update(rollout)
    flat = metrics.to_dict()
    for key in ("grad_norm", "grad_norm_max", "lr", "n_samples", "n_tokens", "n_minibatches", "loss"):
        assert f"model/policy-a/{key}" in flat
    for key in ("pg_loss", "clip_frac", "dual_clip_frac", "approx_kl", "n_samples", "logprob_mismatch"):
        assert f"agent/solver/{key}" in flat and f"agent/verifier/{key}" in flat
    assert "agent/solver/entropy" not in flat  # computed only when entropy_coef > 0
    # the samples' advantages and lengths are the training step's metrics (issue 33: one name per quantity)
    assert not {"agent/solver/advantage_mean", "agent/solver/advantage_std", "agent/solver/response_length"} & set(flat)
    assert all(isinstance(v, float) for v in flat.values())


def test_zero_advantage_samples_are_skipped_without_changing_the_step():
    """Samples with A = 0 are not forwarded (KL/entropy off), yet the step equals forwarding them all."""
    from drmas_graph.testing import tiny_policy
    from drmas_graph.types import SamplingParams
    from drmas_graph.train.optim.update import ModelUpdater, UpdateSettings

    def run(skip):
        policy = tiny_policy(seed=3)
        start = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
        prompts = [policy.render([HumanMessage(f"q{i}")]) for i in range(6)]
        samples = []
        for i, p in enumerate(prompts):
            g = policy.generate(p, SamplingParams(max_new_tokens=5, seed=i))
            samples.append(Sample(prompt_ids=tuple(p), response_ids=g.token_ids, old_logprobs=g.logprobs,
                                  advantage=[1.0, 0.0, -1.0, 0.0, 0.0, 0.5][i], agent="a"))
        updater = ModelUpdater(policy.model, name="m",
                               settings=UpdateSettings(lr=1e-2, backend="torch", weight_decay=0.1))
        updater._skip_zero_advantage = skip
        forwarded = []
        real = updater._micro_batch_loss
        updater._micro_batch_loss = lambda ss, *a, **k: (forwarded.extend(ss), real(ss, *a, **k))[1]
        metrics = updater.update(samples)
        return start, policy.model.state_dict(), metrics, len(forwarded)

    start, p_skip, m_skip, n_skip = run(True)
    _, p_all, m_all, n_all = run(False)
    assert (n_skip, n_all) == (3, 6)
    assert m_skip.grad_norm == pytest.approx(m_all.grad_norm, rel=1e-5)
    assert_same_first_adamw_step(start, p_skip, p_all, lr=1e-2)


# --- precision: float32 master weights, autocast ----------------------------------------------------------


def synthetic_samples(n: int = 6, seed: int = 0) -> list[Sample]:
    """Random prompt/response ids of varied lengths for two agents, old logprobs -6.2, advantages +-1."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        P, R = 4 + i, 3 + (i * 5) % 7
        ids = torch.randint(5, 500, (P + R,), generator=g).tolist()
        samples.append(Sample(tuple(ids[:P]), tuple(ids[P:]), (-6.2,) * R, advantage=(-1.0) ** i,
                              agent="a" if i % 3 else "b"))
    return samples


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weights_follow_the_float32_trajectory(dtype):
    # AdamW moves each weight by about lr per step. At lr 1e-5 that is below half a bfloat16 ulp of most
    # weights (|w| ~ 0.02: ulp 1.2e-4), so AdamW on the bfloat16 weights themselves rounds every step away;
    # float32 master weights accumulate the steps and the module's weights are their rounding.
    samples = synthetic_samples()
    moved = {}
    for dt in (torch.float32, dtype):
        model = fresh_model().to(dt)
        before = snapshot(model)
        updater = ModelUpdater(model, name="m", settings=settings(lr=1e-5, weight_decay=0.0))
        for _ in range(8):
            updater.update(samples)
        after = snapshot(model)
        masters = {name: m.detach() for (name, _), m in zip(model.named_parameters(), updater._engine.masters)}
        for name, master in masters.items():  # the module holds the float32 masters, rounded
            assert master.dtype == torch.float32 and torch.equal(after[name], master.to(dt)), name
        moved[dt] = change_norm({k: before[k].float() for k in masters}, masters)
    assert moved[torch.float32] > 1e-2
    assert moved[dtype] == pytest.approx(moved[torch.float32], rel=0.05)


@pytest.mark.parametrize("backend", DEEPSPEED_BACKENDS[1:])
def test_deepspeed_bf16_step_equals_torch_bf16_step(backend):
    # bfloat16 weights, float32 masters and float32 gradient accumulation on both backends: 3 steps of 5
    # micro-batches each (clipped) end on the same bfloat16 weights up to a last-bit rounding of a few.
    samples = synthetic_samples()
    agents = {"a": LossSettings(micro_batch_size=1), "b": LossSettings(micro_batch_size=2)}
    results = []
    for b in (("torch", 0), backend):
        model = fresh_model().to(torch.bfloat16)
        before = snapshot(model)
        updater = ModelUpdater(model, name="m", settings=settings(b, lr=1e-4, grad_clip=0.1), agent_settings=agents)
        norms = [updater.update(samples).grad_norm for _ in range(3)]
        results.append((norms, snapshot(model, updater)))
    (torch_norms, torch_params), (ds_norms, ds_params) = results
    assert ds_norms[0] == pytest.approx(torch_norms[0], rel=1e-4)  # then a few weights differ by one ulp
    assert ds_norms == pytest.approx(torch_norms, rel=2e-3)
    assert torch_norms[0] > 0.1  # clipping was active
    n = sum(v.numel() for v in torch_params.values())
    moved = sum(int((torch_params[k] != before[k]).sum()) for k in before)
    differ = sum(int((torch_params[k] != ds_params[k]).sum()) for k in before)
    assert moved > 0.5 * n and differ < 0.02 * n, (moved, differ, n)
    for k in before:  # where they differ: by one bfloat16 ulp (2^-7 relative), or near 0 by a few Adam steps
        gap = (torch_params[k].float() - ds_params[k].float()).abs()
        assert (gap <= torch_params[k].float().abs() * 2**-7 + 6e-4).all(), k


@needs_deepspeed
def test_deepspeed_zero0_with_bf16_weights_is_refused():
    with pytest.raises(ConfigError, match=r"zero_stage=0 accumulates bfloat16 gradients.*zero_stage 1 or 2"):
        ModelUpdater(fresh_model().to(torch.bfloat16), name="m", settings=settings(("deepspeed", 0)))
    with pytest.raises(ConfigError, match=r"float32 or bfloat16.*torch.float16.*backend='torch'"):
        ModelUpdater(fresh_model().to(torch.float16), name="m", settings=settings(("deepspeed", 1)))


def test_bf16_masters_survive_save_and_load(tmp_path):
    samples = synthetic_samples()
    s = settings(lr=1e-5)
    model = fresh_model().to(torch.bfloat16)
    updater = ModelUpdater(model, name="m", settings=s)
    updater.update(samples)
    updater.save(tmp_path / "ckpt")
    updater.update(samples)
    expected_masters = [m.detach().clone() for m in updater._engine.masters]
    resumed = ModelUpdater(fresh_model().to(torch.bfloat16), name="m", settings=s)
    resumed.load(tmp_path / "ckpt")
    resumed.update(samples)
    for a, b in zip(resumed._engine.masters, expected_masters):
        assert torch.equal(a.detach(), b)


def test_bf16_autocast_of_a_float32_model_shows_as_logprob_mismatch(rollout):
    # The rollout ran in float32; the trainer's bfloat16 forward sees slightly different logprobs.
    # Measured here: ~4.5e-4 mean |old - new| (tiny model); SmolLM2-135M: ~0.03 (see README).
    exact = ModelUpdater(fresh_model(), name="m", settings=settings()).update(rollout)
    cast = ModelUpdater(fresh_model(), name="m", settings=settings(autocast="bf16")).update(rollout)
    assert exact.agents["solver"].logprob_mismatch < 1e-5
    assert 1e-5 < cast.agents["solver"].logprob_mismatch < 1e-2
    with pytest.raises(ConfigError, match=r"autocast='bf16' is for float32 models.*torch.bfloat16"):
        ModelUpdater(fresh_model().to(torch.bfloat16), name="m", settings=settings(autocast="bf16"))


# --- one settings source; compute_logprobs of every sample ------------------------------------------------


def test_settings_are_the_config_sections():
    from drmas_graph.config import AgentConfig, LossConfig, TrainConfig, UpdateConfig, merge_overrides

    assert issubclass(UpdateSettings, UpdateConfig) and issubclass(LossSettings, LossConfig)
    assert set(UpdateSettings.model_fields) == set(UpdateConfig.model_fields) | {"seed"}
    assert set(LossSettings.model_fields) == set(LossConfig.model_fields)
    # rev_b: a config with loss_agg seq-mean-token-sum-norm builds the updater's settings (trainer.py's line)
    cfg = TrainConfig.model_validate({"update": {"loss_agg": "seq-mean-token-sum-norm", "norm_len": 512,
                                                 "backend": "torch", "grad_clip": None, "betas": [0.9, 0.95]}})
    s = UpdateSettings(**cfg.update.model_dump(), seed=7)
    assert (s.loss_agg, s.norm_len, s.grad_clip, s.betas, s.seed) == ("seq-mean-token-sum-norm", 512, None,
                                                                      (0.9, 0.95), 7)
    loss = LossSettings(**AgentConfig(model="m", loss={"dual_clip": None}).loss.model_dump())
    assert loss.dual_clip is None
    # ...and the config itself refuses what the updater would refuse, at load time
    with pytest.raises(ConfigError, match=r"update: .*norm_len must be set"):
        merge_overrides(None, {"update": {"loss_agg": "seq-mean-token-sum-norm"}})
    with pytest.raises(ConfigError, match=r"agents.a.loss.dual_clip: Input should be greater than 1"):
        merge_overrides(None, {"agents": {"a": {"model": "m", "loss": {"dual_clip": 0.5}}}})


def test_seq_mean_token_sum_norm_from_a_config_trains(rollout):
    from drmas_graph.config import UpdateConfig

    uc = UpdateConfig(loss_agg="seq-mean-token-sum-norm", norm_len=16, backend="torch", lr=1e-3)
    samples = [dataclasses.replace(s, advantage=0.5 * i - 1.0) for i, s in enumerate(rollout)]
    metrics = ModelUpdater(fresh_model(), name="m", settings=UpdateSettings(**uc.model_dump(), seed=0)).update(samples)
    # hand-check: with ratio 1 the loss is mean_b(-A_b * |o_b| / 16)
    expected = sum(-s.advantage * len(s.response_ids) / 16 for s in samples) / len(samples)
    assert abs(expected) > 0.1
    assert metrics.loss == pytest.approx(expected, rel=1e-4)


def test_compute_logprobs_covers_zero_advantage_samples(rollout):
    # rev_a: samples with advantage 0 are skipped in training, but compute_logprobs must return them all.
    samples = [dataclasses.replace(s, advantage=0.0 if i % 2 else 1.0) for i, s in enumerate(rollout)]
    updater = ModelUpdater(fresh_model(), name="m", settings=settings())
    out = updater.compute_logprobs(samples)
    assert [tuple(t.shape) for t in out] == [(len(s.response_ids),) for s in samples]
    for s, logprobs in zip(samples, out):
        assert_close(logprobs, torch.tensor(s.old_logprobs), atol=1e-4, rtol=0)


@needs_deepspeed
def test_deepspeed_refuses_to_move_the_model_off_its_device(monkeypatch):
    import drmas_graph.train.engines._engines as engines

    # a machine whose DeepSpeed accelerator is a GPU, with the policy's model on the CPU
    monkeypatch.setattr(engines, "_deepspeed_device", lambda local_rank: torch.device("cuda", local_rank))
    model = fresh_model()
    with pytest.raises(ConfigError, match=r"would move this model from cpu .* to cuda:0.*backend='torch'"):
        ModelUpdater(model, name="m", settings=settings(("deepspeed", 1)))
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    model.lm_head.to("meta")
    with pytest.raises(ConfigError, match=r"one device.*\['cpu', 'meta'\]"):
        ModelUpdater(model, name="m", settings=settings(("deepspeed", 1), logprob_chunk_tokens=0))


# --- logprobs without full logits: the LM head on response tokens, in chunks -------------------------------


def _batch_with_temperatures(samples, temperatures):
    from drmas_graph.train.optim._logprobs import collate

    batch = collate(samples, pad_id=0, device=torch.device("cpu"))
    return dataclasses.replace(batch, temperatures_B=torch.tensor(temperatures))


@pytest.mark.parametrize("chunk", [1, 5, 512])
def test_chunked_lm_head_gives_the_full_logits_numbers_and_gradients(chunk):
    from drmas_graph.train.optim._logprobs import check_chunked_head, response_token_stats

    samples = synthetic_samples()
    batch = _batch_with_temperatures(samples, [0.7, 1.0, 1.3, 0.5, 1.0, 0.9])
    mask = batch.mask_BT
    results = []
    for chunk_tokens in (0, chunk):
        model = fresh_model()
        head = check_chunked_head(model) if chunk_tokens else None
        logprobs, entropy = response_token_stats(model, batch, lm_head=head, chunk_tokens=chunk_tokens,
                                                 with_entropy=True)
        weights = torch.linspace(-1, 1, mask.numel()).reshape(mask.shape)
        (torch.where(mask, logprobs * weights + 0.3 * entropy, 0.0).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((logprobs.detach(), entropy.detach(), grads))
    (lp_full, h_full, g_full), (lp, h, g) = results
    assert_close(lp[mask], lp_full[mask], atol=2e-6, rtol=0)
    assert_close(h[mask], h_full[mask], atol=2e-6, rtol=0)
    assert (lp[~mask] == 0).all() and (h[~mask] == 0).all()
    for name in g_full:
        assert_close(g[name], g_full[name], atol=1e-6, rtol=1e-5)
    assert lp_full[mask].std() > 0.1  # real numbers, not a degenerate case


@pytest.mark.parametrize("coefs", [{}, {"entropy_coef": 0.1, "kl_coef": 0.1}])
def test_update_with_chunked_head_equals_full_logits(rollout, coefs):
    runs = []
    for chunk_tokens in (0, 4):
        model = fresh_model()
        updater = ModelUpdater(model, name="m", settings=settings(logprob_chunk_tokens=chunk_tokens, **coefs))
        metrics = [updater.update(rollout) for _ in range(2)]
        runs.append((metrics, snapshot(model)))
    (m_full, p_full), (m_chunk, p_chunk) = runs
    for a, b in zip(m_full, m_chunk):
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
        assert b.loss == pytest.approx(a.loss, rel=1e-4, abs=1e-6)
        if coefs:
            assert b.agents["solver"].entropy == pytest.approx(a.agents["solver"].entropy, rel=1e-5)
            assert b.agents["solver"].kl_ref == pytest.approx(a.agents["solver"].kl_ref, rel=1e-3, abs=1e-7)
        else:
            assert a.agents["solver"].entropy is None and b.agents["solver"].entropy is None
    assert max_diff(p_full, p_chunk) < 0.1 * 1e-3  # see test_micro_batch_size_does_not_change_the_step


def test_chunked_head_refuses_a_model_with_logit_softcapping():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, final_logit_softcapping=0.05)
    model = Gemma2ForCausalLM(config)
    with pytest.raises(ConfigError, match=r"not its LM head applied to the last hidden state.*logprob_chunk_tokens: 0"):
        ModelUpdater(model, name="m", settings=settings())
    ModelUpdater(model, name="m", settings=settings(logprob_chunk_tokens=0))  # the full-logits path works


@pytest.mark.parametrize("pack", [True, False])
def test_a_micro_batch_of_empty_responses_contributes_zero_and_still_counts(pack):
    """An empty response has no token for the chunked LM head: its micro-batch (micro_batch_size 1) contributes 0
    and still counts in seq-mean, as on the full-logits path. loss = -(1/2) (A_0 x ratio 1 + 0) = -0.5."""
    samples = [Sample((5, 6, 7, 8), (9, 10, 11), (0.0,) * 3, advantage=1.0, agent="a"),
               Sample((5, 6, 7, 8), (), (), advantage=-1.0, agent="a")]
    runs = []
    for chunk in (0, 512):
        model = fresh_model()
        updater = ModelUpdater(model, name="m", settings=settings(logprob_chunk_tokens=chunk, pack_prefixes=pack,
                                                                  loss_agg="seq-mean-token-mean"),
                               agent_settings={"a": LossSettings(micro_batch_size=1)})
        metrics = updater.update(samples, old_logprobs="current")
        runs.append((metrics, snapshot(model)))
    (full, p_full), (chunked, p_chunked) = runs
    for m in (full, chunked):
        assert m.loss == pytest.approx(-0.5, rel=1e-6) and m.n_samples == 2 and m.n_tokens == 3
    assert chunked.grad_norm == pytest.approx(full.grad_norm, rel=1e-5) and full.grad_norm > 0
    assert max_diff(p_full, p_chunked) < 0.1 * 1e-3
    # only the empty sample forwarded (advantage 0 is skipped): a zero gradient, the step of AdamW's decay alone
    only_empty = [dataclasses.replace(samples[0], advantage=0.0), samples[1]]
    model = fresh_model()
    start = snapshot(model)
    metrics = ModelUpdater(model, name="m", settings=settings(pack_prefixes=pack)).update(only_empty,
                                                                                       old_logprobs="current")
    assert metrics.loss == 0.0 and metrics.grad_norm == 0.0 and metrics.n_samples == 2
    decay = 1 - 1e-3 * settings().weight_decay
    assert all(torch.equal(v, start[k] * decay) for k, v in snapshot(model).items() if k.endswith("weight"))


# --- dropout: off in the update by default, as in the passes that give its ratios' denominators ------------


def dropout_model() -> torch.nn.Module:
    """A tiny GPT-2 with its default dropout 0.1 (embeddings, attention, residual): active in train mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=512, n_embd=32, n_layer=2, n_head=2, n_positions=128, bos_token_id=1, eos_token_id=2)
    assert config.resid_pdrop == config.attn_pdrop == config.embd_pdrop == 0.1
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


def ratios_at_lr_0(model: torch.nn.Module, lora: bool = False, **changes) -> tuple[list[float], list[float]]:
    """(ratio_max, approx_kl) of each agent at lr 0, the old logprobs being the updater's own compute_logprobs."""
    from drmas_graph.train.optim.lora import LoraUpdater

    samples = synthetic_samples()
    if lora:
        updater = LoraUpdater(model, name="m", settings=settings(lr=0.0, **changes), agent_adapters={"a": "ad", "b": "bd"},
                              agent_settings={a: LossSettings() for a in "ab"})
    else:
        updater = ModelUpdater(model, name="m", settings=settings(lr=0.0, **changes))
    old = updater.compute_logprobs(samples)
    samples = [dataclasses.replace(s, old_logprobs=tuple(lp.tolist())) for s, lp in zip(samples, old)]
    metrics = updater.update(samples)
    by_agent = {a: m for one in (metrics.adapters.values() if lora else [metrics]) for a, m in one.agents.items()}
    return [by_agent[a].ratio_max for a in "ab"], [by_agent[a].approx_kl for a in "ab"]


@pytest.mark.parametrize("changes", [{}, {"gradient_checkpointing": True}, {"pack_prefixes": False}])
def test_the_update_runs_without_dropout_by_default(changes):
    """update.dropout false (the default): the first mini-batch's ratio pi / pi_old is exactly 1 at lr 0 for a model
    with dropout 0.1, as the old logprobs were computed without dropout (activation checkpointing still runs)."""
    model = dropout_model()
    ratio_max, approx_kl = ratios_at_lr_0(model, **changes)
    assert ratio_max == [1.0, 1.0] and approx_kl == [0.0, 0.0]
    if changes.get("gradient_checkpointing"):
        assert all(layer.gradient_checkpointing for layer in model.transformer.h)
    assert not any(m.training for m in model.modules())  # eval mode again after the update


def test_update_dropout_true_trains_with_the_models_dropout():
    ratio_max, approx_kl = ratios_at_lr_0(dropout_model(), dropout=True)
    assert all(r > 1.05 for r in ratio_max) and all(abs(k) > 1e-3 for k in approx_kl)  # dropout noise in every ratio


def test_lora_dropout_is_off_in_the_update_by_default():
    """lora.dropout applies only with update.dropout: true."""
    pytest.importorskip("peft")
    from drmas_graph.config import LoraConfig
    from drmas_graph.train.optim.lora import attach_adapters

    def lora_model():
        model = attach_adapters(fresh_model(), LoraConfig(dropout=0.5), ["ad", "bd"])
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # B = 0 would make the adapter (and its dropout) a no-op
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.3, generator=gen)
        return model

    assert ratios_at_lr_0(lora_model(), lora=True)[0] == [1.0, 1.0]
    assert all(r > 1.01 for r in ratios_at_lr_0(lora_model(), lora=True, dropout=True)[0])


# --- memory options: activation checkpointing, attention kernel, token-sized micro-batches, KL reference -----


def _one_update(rollout, **changes):
    model = fresh_model()
    updater = ModelUpdater(model, name="m", settings=settings(**changes))
    metrics = updater.update(rollout)
    return updater, metrics, snapshot(model)


@pytest.mark.parametrize("changes", [{"gradient_checkpointing": True}, {"attn_implementation": "eager"},
                                     {"max_tokens_per_micro_batch": 40}])
def test_memory_options_take_the_same_step(rollout, changes):
    _, base, base_params = _one_update(rollout, grad_clip=None)
    updater, metrics, params = _one_update(rollout, grad_clip=None, **changes)
    assert metrics.grad_norm == pytest.approx(base.grad_norm, rel=1e-5)
    assert metrics.loss == pytest.approx(base.loss, rel=1e-4, abs=1e-6)
    assert max_diff(base_params, params) < 0.1 * 1e-3  # see test_micro_batch_size_does_not_change_the_step
    if "gradient_checkpointing" in changes:
        assert updater.model.is_activation_checkpointing
    if "attn_implementation" in changes:
        assert updater.model.config._attn_implementation == "eager"


def test_micro_batches_sized_in_tokens(rollout):
    samples = with_lengths(rollout, [3, 12, 7, 1, 10, 5])
    updater = ModelUpdater(fresh_model(), name="m", settings=settings(max_tokens_per_micro_batch=60,
                                                                      pack_prefixes=False))
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    micro = updater._micro_batches(list(range(6)), samples, packing=None)
    assert sorted(i for m in micro for i in m) == list(range(6))
    for m in micro:
        assert len({samples[i].agent for i in m}) == 1
        assert len(m) == 1 or len(m) * max(lengths[i] for i in m) <= 60, (m, lengths)
    assert any(len(m) > 1 for m in micro)
    # a sample longer than the budget is trained alone, not dropped
    alone = ModelUpdater(fresh_model(), name="m", settings=settings(max_tokens_per_micro_batch=5, pack_prefixes=False))
    assert sorted(alone._micro_batches(list(range(6)), samples, packing=None)) == [[i] for i in range(6)]


def test_packed_micro_batches_stay_within_the_padded_memory(rollout):
    """Packed: a micro-batch's trie has N <= sqrt(budget x L) nodes (activations ~N <= budget, attention
    scores ~N^2 <= budget x L, what padded rows of at most L tokens within the budget hold)."""
    from drmas_graph.train.optim._packing import build_tree, sequences_of

    samples = with_lengths(rollout, [3, 12, 7, 1, 10, 5])
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    for budget, micro_size in ((60, 4), (None, 2), (None, 8)):
        updater = ModelUpdater(fresh_model(), name="m", settings=settings(max_tokens_per_micro_batch=budget),
                               agent_settings={a: LossSettings(micro_batch_size=micro_size) for a in ("solver", "verifier")})
        micro = updater._micro_batches(list(range(6)), samples, packing=updater._packing)
        assert sorted(i for m in micro for i in m) == list(range(6))
        for m in micro:
            agent_rows = [i for i in range(6) if samples[i].agent == samples[m[0]].agent]
            longest = max(lengths[i] for i in agent_rows)
            nodes = len(build_tree(sequences_of([samples[i] for i in m])).tokens_N)
            assert len({samples[i].agent for i in m}) == 1
            assert len(m) == 1 or nodes**2 <= (budget or micro_size * longest) * longest, (m, nodes)
    # the two samples of each prompt share it: packed they cost their distinct tokens only
    both = [s for s in rollout if s.prompt_ids == rollout[0].prompt_ids]
    tree = build_tree(sequences_of(both))
    shared = len(both[0].prompt_ids) + next(k for k, (a, b) in enumerate(zip(both[0].response_ids, both[1].response_ids))
                                            if a != b)
    assert len(tree.tokens_N) == sum(lengths_ := [len(s.prompt_ids) + len(s.response_ids) for s in both]) - shared
    assert max(tree.depth_N) == max(lengths_) - 1


def test_offloaded_kl_reference_equals_the_device_copy(rollout):
    results = []
    for where in ("offload", "device"):
        updater = ModelUpdater(fresh_model(), name="m", settings=settings(kl_coef=0.1, kl_reference=where))
        metrics = [updater.update(rollout) for _ in range(2)]
        results.append([m.agents["solver"].kl_ref for m in metrics])
        assert metrics[1].agents["solver"].kl_ref > 1e-4
    assert results[0] == results[1]


def test_a_custom_kl_reference_is_used(rollout):
    # The seam for a reference without a copy (e.g. LoRA with the adapter disabled): here another model.
    import contextlib

    class Other:
        def __init__(self):
            self.module, self.calls = fresh_model(seed=1), 0

        @contextlib.contextmanager
        def on_device(self):
            self.calls += 1
            yield self.module

    other = Other()
    updater = ModelUpdater(fresh_model(), name="m", settings=settings(kl_coef=0.1), reference=other)
    metrics = updater.update(rollout)
    assert other.calls == 1  # one pass per update
    assert metrics.agents["solver"].kl_ref > 0.01  # seed 1 differs from the trained seed-0 model from the start


@needs_deepspeed
def test_cpu_optimizer_offload_takes_the_torch_step(rollout):
    _, base, base_params = _one_update(rollout, grad_clip=0.1)
    updater, metrics, params = _one_update(rollout, grad_clip=0.1, backend=("deepspeed", 2), offload_optimizer=True)
    assert updater._engine.engine.zero_cpu_offload()
    assert metrics.grad_norm == pytest.approx(base.grad_norm, rel=1e-5)
    assert max_diff(base_params, params) < 1e-6
    with pytest.raises(ConfigError, match=r"offload_optimizer needs backend='deepspeed' and zero_stage 1, 2"):
        settings(("deepspeed", 0), offload_optimizer=True)


@needs_deepspeed
def test_zero3_shards_the_weights_and_gathers_them_to_save(rollout, tmp_path):
    from transformers import AutoModelForCausalLM

    model = fresh_model()
    updater = ModelUpdater(model, name="m", settings=settings(("deepspeed", 3)))
    # ZeRO-3 keeps parameters under stage3_param_persistence_threshold whole; right after construction
    # they are all sharded (empty here), and full_weights() gathers them
    assert all(p.numel() == 0 for p in model.parameters())
    updater.update(rollout)
    expected = snapshot(model, updater)
    updater.save(tmp_path)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert max_diff(snapshot(exported), expected) == 0.0


def test_defaults_for_gpus_bf16_weights_and_zero1():
    from drmas_graph.config import ModelConfig

    assert ModelConfig(tiny={}, device="cuda:1").torch_dtype() == "bfloat16"
    assert ModelConfig(tiny={}, device="cpu").torch_dtype() == "float32"
    assert ModelConfig(tiny={}, device="cuda", dtype="float32").torch_dtype() == "float32"
    # ZeRO-1 by default with DeepSpeed: float32 accumulation for bf16 weights (ZeRO-0 bf16 is refused)
    assert UpdateSettings(backend="deepspeed").zero() == 1 and UpdateSettings(backend="torch").zero() == 0
    assert UpdateSettings(backend="deepspeed", zero_stage=0).zero() == 0


def test_gathered_rows_backpropagate_in_one_order_every_time():
    """`take_rows` (the response tokens' hidden states / logits out of a packed row, where a group's first tokens
    share a node) backpropagates repeated rows in index order: the gradient equals a sequential sum, bit for bit,
    on every run. ``x[index]``'s CPU backward adds them with parallel atomics (20 runs gave 20 different
    gradients here, 2026-12-05), which made the demo's weights differ run to run."""
    from drmas_graph.train.optim._logprobs import take_rows

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 576, generator=gen, requires_grad=True)
    index = torch.randint(0, 40, (20, 20), generator=gen)  # 400 rows out of 40: every row ~10 times
    upstream = torch.randn(20, 20, 576, generator=gen)
    expected = torch.zeros(300, 576)
    for i, row in enumerate(index.reshape(-1).tolist()):  # in index order, one addition at a time
        expected[row] += upstream.reshape(-1, 576)[i]
    for _ in range(10):
        x.grad = None
        rows = take_rows(x, index)
        assert torch.equal(rows, x.detach()[index])
        (rows * upstream).sum().backward()
        assert torch.equal(x.grad, expected)


def test_a_packed_update_is_bit_identical_when_repeated(rollout):
    """Two samples per prompt share their prompt's nodes in the packed row; the same update from the same weights
    gives the same weights, bit for bit (the trainer's reproducibility rests on it)."""
    results = []
    for _ in range(2):
        model = fresh_model()
        ModelUpdater(model, name="m", settings=settings(pack_prefixes=True)).update(rollout, old_logprobs="current")
        results.append(snapshot(model))
    assert max_diff(results[0], snapshot(fresh_model())) > 0
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])
