"""ModelUpdater on a tiny real model: logprob agreement with the rollout backend, the direction of the step,
loss normalization over micro-batches, torch vs DeepSpeed, clipping, checkpoints and config errors."""

from __future__ import annotations

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
from drmas_graph.losses import policy_loss
from drmas_graph.testing import tiny_model, tiny_policy, tiny_tokenizer
from drmas_graph.types import Sample, SamplingParams
from drmas_graph.update import LossSettings, ModelUpdater, UpdateSettings

# deepspeed's import uses torch.jit.script_method, deprecated in torch 2.13
pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed")
DEEPSPEED_BACKENDS = [pytest.param(("deepspeed", stage), marks=needs_deepspeed, id=f"zero{stage}")
                      for stage in (0, 1, 2)]

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


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


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
    metrics = ModelUpdater(model, name="m", settings=settings(backend, weight_decay=0.0)).update(samples)
    assert metrics.grad_norm == 0.0 and metrics.loss == 0.0
    assert all(a.pg_loss == 0.0 for a in metrics.agents.values())
    assert max_diff(before, snapshot(model)) == 0.0


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
        assert metrics.loss == pytest.approx(reference_loss, rel=1e-5, abs=1e-7)
        assert metrics.grad_norm == pytest.approx(reference_norm, rel=1e-5)
        results.append(snapshot(model))
    # AdamW's first step is lr * g / (|g| + eps): on the few coordinates with |g| ~ eps = 1e-8 the float32
    # roundoff of a different summation order (~1e-10 here) shows as up to a few % of lr. A wrongly weighted
    # micro-batch flips signs (differences ~2 lr); the loss and grad norm checks above are the exact ones.
    # (6.5% of lr was seen on the fixture's responses from the embedded engine's counter-based sampler.)
    assert max_diff(*results) < 0.25 * 1e-3


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
        metrics = ModelUpdater(model, name="m", settings=settings(b, **s), agent_settings=agents).update(rollout)
        results.append((metrics, snapshot(model)))
    (torch_metrics, torch_params), (ds_metrics, ds_params) = results
    assert max_diff(torch_params, ds_params) < 1e-6
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
    saved = snapshot(model)
    updater.update(second)
    expected = snapshot(model)

    resumed_model = fresh_model()
    resumed = ModelUpdater(resumed_model, name="m", settings=s)
    resumed.load(tmp_path / "ckpt")
    assert max_diff(snapshot(resumed_model), saved) == 0.0
    assert resumed.n_updates == 1
    resumed.update(second)
    assert max_diff(snapshot(resumed_model), expected) < 1e-7

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
    ({"loss_agg": "sum"}, r"loss_agg.*'sum'.*token-mean, seq-mean-token-sum, seq-mean-token-mean"),
    ({"backend": "fsdp"}, r"backend.*'fsdp'.*deepspeed, torch"),
    ({"zero_stage": 3}, r"zero_stage.*\(0, 1, 2\).*3"),
    ({"zero_stage": 2, "backend": "torch"}, r"zero_stage=2 needs backend='deepspeed'"),
    ({"loss_agg": "seq-mean-token-sum-norm"}, r"norm_len must be set"),
    ({"lr": 0.0}, r"UpdateSettings.lr"),
    ({"grad_clip": 0.0}, r"grad_clip.*None to disable"),
    ({"n_minibatches": 0}, r"n_minibatches"),
    ({"betas": (0.9, 1.5)}, r"betas"),
    ({"kl_coef": -1.0}, r"kl_coef"),
])
def test_invalid_update_settings_name_the_field(changes, pattern):
    with pytest.raises(ConfigError, match=pattern):
        UpdateSettings(**changes)


@pytest.mark.parametrize(("changes", "pattern"), [
    ({"micro_batch_size": 0}, "micro_batch_size"),
    ({"clip_low": 1.0}, "clip_low"),
    ({"dual_clip": 1.0}, "dual_clip.*None to disable"),
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
    for key in ("pg_loss", "clip_frac", "dual_clip_frac", "approx_kl", "entropy", "response_length",
                "n_samples", "advantage_mean", "advantage_std", "logprob_mismatch"):
        assert f"agent/solver/{key}" in flat and f"agent/verifier/{key}" in flat
    # hand-checked: solver samples have advantages +1, -1, -1, +1 (i = 0, 1, 3, 4)
    assert flat["agent/solver/advantage_mean"] == 0.0 and flat["agent/solver/advantage_std"] == 1.0
    assert all(isinstance(v, float) for v in flat.values())


def test_zero_advantage_samples_are_skipped_without_changing_the_step():
    """Samples with A = 0 are not forwarded (KL/entropy off), yet the step equals forwarding them all."""
    from drmas_graph.testing import tiny_policy
    from drmas_graph.types import SamplingParams
    from drmas_graph.update import ModelUpdater, UpdateSettings

    def run(skip):
        policy = tiny_policy(seed=3)
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
        return policy.model.state_dict(), metrics, len(forwarded)

    p_skip, m_skip, n_skip = run(True)
    p_all, m_all, n_all = run(False)
    assert (n_skip, n_all) == (3, 6)
    assert m_skip.grad_norm == pytest.approx(m_all.grad_norm, rel=1e-5)
    for k, v in p_all.items():
        torch.testing.assert_close(p_skip[k], v, atol=1e-5, rtol=0)  # lr 1e-2: steps agree to 1e-3 of a step
