"""The off-policy correction of asynchronous training (decoupled PPO), against hand-computed numbers, and the
pieces of the pipeline that are pure functions (dropping stale groups, the config's checks)."""

import math

import pytest
import torch

from drmas_graph.config import CORRECTIONS as CONFIG_CORRECTIONS
from drmas_graph.config import TrainConfig
from drmas_graph.env import Group
from drmas_graph.errors import ConfigError
from drmas_graph.train.optim import offpolicy
from drmas_graph.train.loop._pipeline import drop_stale
from drmas_graph.train.loop._rollouts import StepBatch
from drmas_graph.train.loop.metrics import Stopwatch
from drmas_graph.train.optim.losses import policy_loss
from drmas_graph.train.optim.offpolicy import CorrectionStats, OffPolicyCorrection, importance_weights
from drmas_graph.types import Episode, Sample, Turn

L = math.log


def test_importance_weights_by_name():
    # w = pi_prox / pi_behav = [0.5/0.25, 0.3/0.3, 0.1/0.4] = [2, 1, 0.25]; the 4th token is padding
    prox = torch.tensor([[L(0.5), L(0.3), L(0.1), 0.0]])
    behav = torch.tensor([[L(0.25), L(0.3), L(0.4), float("-inf")]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w = {name: importance_weights(prox, behav, mask, correction=name, cap=1.5)[0].tolist() for name in offpolicy.CORRECTIONS}
    assert w["truncate"] == pytest.approx([1.5, 1.0, 0.25, 0.0])  # min(w, 1.5)
    assert w["mask"] == pytest.approx([0.0, 1.0, 0.25, 0.0])  # 2 > 1.5 leaves the loss
    assert w["none"] == [1.0, 1.0, 1.0, 0.0]
    assert importance_weights(prox, behav, mask, correction="mask", cap=2.0)[0].tolist() == pytest.approx(
        [2.0, 1.0, 0.25, 0.0])  # w <= C is kept
    assert tuple(CONFIG_CORRECTIONS) == tuple(offpolicy.CORRECTIONS)  # the config names exactly the registry
    with pytest.raises(ConfigError, match="unknown off-policy correction 'clip'; valid: truncate, mask, none"):
        importance_weights(prox, behav, mask, correction="clip")


def _samples():
    # sample 0: A = +1, stale: prox [0.5, 0.4], behaviour [0.25, 0.4] -> w = [2, 1]
    # sample 1: A = -1, sampled by the trainer's own weights (behaviour None) -> w = 1
    return [Sample(prompt_ids=(1,), response_ids=(5, 6), old_logprobs=(L(0.5), L(0.4)), advantage=1.0, agent="a",
                   behaviour_logprobs=(L(0.25), L(0.4))),
            Sample(prompt_ids=(1,), response_ids=(7,), old_logprobs=(L(0.2),), advantage=-1.0, agent="a")]


def _loss(correction):
    samples = _samples()
    mask = torch.tensor([[1, 1], [1, 0]])
    old = torch.tensor([[L(0.5), L(0.4)], [L(0.2), 0.0]])
    # current policy: ratios r = [[1.0, 1.5], [0.5, -]]
    logprobs = torch.tensor([[L(0.5), L(0.6)], [L(0.1), 0.0]], requires_grad=True)
    weights = None if correction is None else correction.token_weights(samples, mask)
    loss, stats = policy_loss(logprobs, old, torch.tensor([1.0, -1.0]), mask, clip_low=0.2, clip_high=0.2,
                              dual_clip=3.0, token_weights=weights)
    loss.backward()
    return loss.item(), logprobs.grad, stats


def test_the_decoupled_ppo_loss_by_hand():
    # per-token loss before the weights: max(-A r, -A clip(r, 0.8, 1.2))
    #   sample 0 (A = 1):  r = 1 -> -1;  r = 1.5 -> max(-1.5, -1.2) = -1.2 (clipped, no gradient)
    #   sample 1 (A = -1): r = 0.5 -> max(0.5, 0.8) = 0.8 (clipped); dual clip min(0.8, 3) = 0.8
    # token-mean over 3 tokens
    plain, _, _ = _loss(None)
    assert plain == pytest.approx((-1.0 - 1.2 + 0.8) / 3)
    truncate = OffPolicyCorrection("truncate", cap=1.5)  # w = [1.5, 1 | 1]
    loss, grad, _ = _loss(truncate)
    assert loss == pytest.approx((-1.5 - 1.2 + 0.8) / 3)
    # d/d logp of w * (-A r) = -w A r / 3 at the one unclipped token: -1.5 * 1 * 1 / 3
    assert grad.flatten().tolist() == pytest.approx([-0.5, 0.0, 0.0, 0.0])
    stats = truncate.pop_stats()
    assert stats == {"a": CorrectionStats(tokens=2, weight_sum=2.5, raw_max=pytest.approx(2.0), capped=1)}
    assert stats["a"].metrics("a") == {"agent/a/is_weight_mean": 1.25, "agent/a/is_weight_max": pytest.approx(2.0),
                                       "agent/a/is_capped_frac": 0.5}
    assert truncate.pop_stats() == {}
    masked, grad, _ = _loss(OffPolicyCorrection("mask", cap=1.5))  # w = [0, 1 | 1]
    assert masked == pytest.approx((0.0 - 1.2 + 0.8) / 3)
    assert grad.flatten().tolist() == [0.0, 0.0, 0.0, 0.0]
    assert _loss(OffPolicyCorrection("none", cap=1.5))[0] == plain


def test_samples_sampled_by_the_trainers_weights_leave_the_loss_unchanged_bit_for_bit():
    samples = [s.__class__(**{**s.__dict__, "behaviour_logprobs": None}) for s in _samples()]
    mask = torch.tensor([[1, 1], [1, 0]])
    assert OffPolicyCorrection().token_weights(samples, mask) is None  # no weights passed at all
    # a stale sample whose behaviour logprobs equal the proximal ones: w = exp(0) = 1 exactly
    same = [s.__class__(**{**s.__dict__, "behaviour_logprobs": s.old_logprobs}) for s in _samples()]
    weights = OffPolicyCorrection().token_weights(same, mask)
    old = torch.tensor([[L(0.5), L(0.4)], [L(0.2), 0.0]])
    assert weights(old).tolist() == [[1.0, 1.0], [1.0, 0.0]]


def test_a_bad_correction_or_cap_is_refused_at_construction():
    with pytest.raises(ConfigError, match="cap must be >= 1"):
        OffPolicyCorrection("truncate", cap=0.5)
    with pytest.raises(ConfigError, match="valid: truncate, mask, none"):
        OffPolicyCorrection("tis")


def _turn(agent, index, version):
    return Turn(agent=agent, node=agent, step=1, index=index, messages=(), prompt_ids=(1,), response_ids=(2,),
                response_logprobs=(-1.0,), response_text="x", policy="p", policy_version=version)


def test_drop_stale_drops_whole_groups_and_counts_them():
    # group g1: episodes of versions 3 and 3; group g2: one episode sampled by version 1 -> at update 4 with
    # max_staleness 2, g2 (staleness 3) is dropped whole, g1 (staleness 1) stays
    eps = [Episode(id="e1", group_id="g1", turns=[_turn("a", 0, 3), _turn("b", 1, 3)]),
           Episode(id="e2", group_id="g1", turns=[_turn("a", 0, 3)]),
           Episode(id="e3", group_id="g2", turns=[_turn("a", 0, 1), _turn("b", 1, 4)]),
           Episode(id="e4", group_id="g2", turns=[_turn("a", 0, 4)])]
    samples = [Sample(prompt_ids=(1,), response_ids=(2,), old_logprobs=(-1.0,), advantage=0.5, agent=t.agent,
                      episode_id=ep.id, turn_index=t.index) for ep in eps for t in ep.turns]
    by_group = [Group(None, "g1", tuple(eps[:2]), (None, None)), Group(None, "g2", tuple(eps[2:]), (None, None))]
    batch = StepBatch(step=4, n_episodes=4, counts={}, rollout_errors=[], groups=by_group,
                      unscored=[], samples=samples, adv_stats=None, times=Stopwatch())
    kept, groups, dropped = drop_stale(batch, 4, 2)
    assert [ep.id for g in kept.groups for ep in g.episodes] == ["e1", "e2"] and groups == 1 and dropped == 3
    assert [s.episode_id for s in kept.samples] == ["e1", "e1", "e2"]
    assert drop_stale(batch, 4, 3) == (batch, 0, 0)  # staleness 3 <= 3: nothing dropped


def test_async_config_is_checked_at_construction():
    with pytest.raises(ValueError, match="needs the trainer's proximal logprobs"):
        TrainConfig.model_validate({"async": {"max_staleness": 1}, "old_logprobs": "rollout"})
    with pytest.raises(ValueError, match="async.timeout_s=100 must exceed rollout.timeout_s=1800"):
        TrainConfig.model_validate({"async": {"max_staleness": 1, "timeout_s": 100}})
    lora = TrainConfig.model_validate({"async": {"max_staleness": 1}, "models": {"m": {"tiny": {}, "lora": {}}},
                                       "agents": {"solver": {"model": "m"}}})  # LoRA trains asynchronously too
    assert lora.models["m"].lora is not None and lora.async_.max_staleness == 1
    with pytest.raises(ValueError, match="unknown async.correction 'x'"):
        TrainConfig.model_validate({"async": {"correction": "x"}})
    cfg = TrainConfig.model_validate({"async": {"max_staleness": 1, "correction": "mask", "is_cap": 5}})
    assert cfg.async_.max_staleness == 1 and cfg.model_dump()["async"]["is_cap"] == 5.0
    assert TrainConfig.model_validate(cfg.model_dump()) == cfg  # `async` round-trips (a Python keyword)
