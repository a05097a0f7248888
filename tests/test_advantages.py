"""Advantage estimators against hand-computed numbers.

The shared example: two groups, two agents (S = solver, V = verifier), invalid-turn penalty c = 0.5 (the
reference uses 0.1 for math; 0.5 keeps the arithmetic in halves). Samples, in order:

    i  group episode agent turn  R_i
    0  g1    e1      S     0     1.0
    1  g1    e1      V     0     1.0
    2  g1    e2      S     0     0.0
    3  g1    e2      V     0     0.0
    4  g1    e2      S     1     0.0
    5  g1    e2      V     1    -0.5   (episode failed, and V's second call was invalid)
    6  g2    e3      S     0     1.0
    7  g2    e3      V     0     1.0
    8  g2    e3      S     1     1.0
    9  g2    e3      V     1     1.0
    10 g2    e4      S     0     0.5   (episode solved, but S's call was invalid)
    11 g2    e4      V     0     1.0
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from drmas_graph.train.optim.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageStats,
    compute_advantages,
    list_estimators,
)
from drmas_graph.errors import ConfigError, DrmasError

EPS = 1e-6
SQRT2 = math.sqrt(2)

REWARDS = [1.0, 1.0, 0.0, 0.0, 0.0, -0.5, 1.0, 1.0, 1.0, 1.0, 0.5, 1.0]
KEYS = dict(
    group_ids=["g1"] * 6 + ["g2"] * 6,
    episode_ids=["e1", "e1", "e2", "e2", "e2", "e2", "e3", "e3", "e3", "e3", "e4", "e4"],
    agent_ids=["S", "V", "S", "V", "S", "V", "S", "V", "S", "V", "S", "V"],
    turn_ids=[0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0],
)


def advantages(estimator: str, **kwargs) -> tuple[torch.Tensor, AdvantageStats]:
    return compute_advantages(REWARDS, **KEYS, estimator=estimator, return_stats=True, **kwargs)


def test_registry_names():
    assert list_estimators() == ["episode_global", "step_global", "agent", "agent_turn"]
    assert set(ADVANTAGE_ESTIMATORS) == set(list_estimators())


def test_episode_global():
    # g1: Rbar_e1 = (1 + 1) / 2 = 1; Rbar_e2 = (0 + 0 + 0 - 0.5) / 4 = -0.125.
    #     mu = 0.4375; sigma (unbiased, 2 episodes) = |1 - (-0.125)| / sqrt(2) = 1.125 / sqrt(2) = 0.795495.
    #     e1 samples: 0.5625 / (0.795495 + eps) = +0.707106; e2 samples: -0.707106.
    # g2: Rbar_e3 = 1; Rbar_e4 = (0.5 + 1) / 2 = 0.75; mu = 0.875; sigma = 0.25 / sqrt(2) = 0.176777.
    #     e3 samples: 0.125 / (0.176777 + eps) = +0.707103; e4 samples: -0.707103.
    a1 = 0.5625 / (1.125 / SQRT2 + EPS)
    a2 = 0.125 / (0.25 / SQRT2 + EPS)
    expected = [a1, a1, -a1, -a1, -a1, -a1, a2, a2, a2, a2, -a2, -a2]
    adv, stats = advantages("episode_global")
    assert adv.dtype == torch.float32 and adv.shape == (12,)
    assert_close(adv, torch.tensor(expected))
    assert stats == AdvantageStats(n_pools=2, n_zero_variance_pools=0, n_singleton_pools=0)


def test_step_global():
    # g1 pool, 6 samples [1, 1, 0, 0, 0, -0.5]: mu = 1.5 / 6 = 0.25.
    #     deviations 0.75, 0.75, -0.25, -0.25, -0.25, -0.75; squares sum to 1.875;
    #     sigma = sqrt(1.875 / 5) = 0.612372.
    #     A = 0.75 / 0.612372 = 1.224745; -0.25 / 0.612372 = -0.408248; -0.75 / 0.612372 = -1.224745.
    # g2 pool [1, 1, 1, 1, 0.5, 1]: mu = 5.5 / 6 = 11/12.
    #     deviations 1/12 (x5), -5/12; squares sum to 5/144 + 25/144 = 30/144;
    #     sigma = sqrt(30/144 / 5) = 0.204124.
    #     A = (1/12) / 0.204124 = 0.408248 for the 1s; (-5/12) / 0.204124 = -2.041241 for sample 10.
    s1 = math.sqrt(1.875 / 5) + EPS
    s2 = math.sqrt(30 / 144 / 5) + EPS
    expected = [
        0.75 / s1, 0.75 / s1, -0.25 / s1, -0.25 / s1, -0.25 / s1, -0.75 / s1,
        (1 / 12) / s2, (1 / 12) / s2, (1 / 12) / s2, (1 / 12) / s2, (-5 / 12) / s2, (1 / 12) / s2,
    ]  # fmt: skip
    adv, stats = advantages("step_global")
    assert_close(adv, torch.tensor(expected))
    assert stats == AdvantageStats(n_pools=2, n_zero_variance_pools=0, n_singleton_pools=0)


def test_agent():
    # (g1, S) = samples 0, 2, 4 = [1, 0, 0]: mu = 1/3; squared deviations 4/9 + 1/9 + 1/9 = 2/3;
    #     sigma = sqrt((2/3) / 2) = 0.577350. A = (2/3) / 0.577350 = 1.154701; (-1/3) / 0.577350 = -0.577350.
    # (g1, V) = samples 1, 3, 5 = [1, 0, -0.5]: mu = 1/6; squared deviations 25/36 + 1/36 + 16/36 = 7/6;
    #     sigma = sqrt(7/12) = 0.763763. A = (5/6) / 0.763763 = 1.091089; (-1/6) / ... = -0.218218;
    #     (-2/3) / ... = -0.872872.
    # (g2, S) = samples 6, 8, 10 = [1, 1, 0.5]: mu = 5/6; squared deviations 1/36 + 1/36 + 4/36 = 1/6;
    #     sigma = sqrt(1/12) = 0.288675. A = (1/6) / 0.288675 = 0.577350; (-1/3) / 0.288675 = -1.154701.
    # (g2, V) = samples 7, 9, 11 = [1, 1, 1]: all equal, A = 0 (a zero-variance pool).
    s1S = math.sqrt(1 / 3) + EPS
    s1V = math.sqrt(7 / 12) + EPS
    s2S = math.sqrt(1 / 12) + EPS
    expected = [
        (2 / 3) / s1S, (5 / 6) / s1V, (-1 / 3) / s1S, (-1 / 6) / s1V, (-1 / 3) / s1S, (-2 / 3) / s1V,
        (1 / 6) / s2S, 0.0, (1 / 6) / s2S, 0.0, (-1 / 3) / s2S, 0.0,
    ]  # fmt: skip
    adv, stats = advantages("agent")
    assert_close(adv, torch.tensor(expected))
    assert stats == AdvantageStats(n_pools=4, n_zero_variance_pools=1, n_singleton_pools=0)


def test_agent_is_the_default():
    assert_close(compute_advantages(REWARDS, **KEYS), advantages("agent")[0])


def test_agent_turn():
    # (g1, S, 0) = [1, 0] (samples 0, 2) and (g1, V, 0) = [1, 0] (samples 1, 3): mu = 0.5,
    #     sigma = 1 / sqrt(2); A = +-0.5 / (0.707107 + eps) = +-0.707106.
    # (g1, S, 1) = [0] (sample 4), (g1, V, 1) = [-0.5] (sample 5): singletons, mu = 0 and sigma = 1,
    #     so A = R / (1 + eps): 0 and -0.5.
    # (g2, S, 0) = [1, 0.5] (samples 6, 10): mu = 0.75, sigma = 0.5 / sqrt(2) = 0.353553;
    #     A = +-0.25 / (0.353553 + eps) = +-0.707105.
    # (g2, V, 0) = [1, 1] (samples 7, 11): zero variance, A = 0.
    # (g2, S, 1) = [1] (sample 8), (g2, V, 1) = [1] (sample 9): singletons, A = 1 / (1 + eps).
    a1 = 0.5 / (1 / SQRT2 + EPS)
    a2 = 0.25 / (0.5 / SQRT2 + EPS)
    single = 1 / (1 + EPS)
    expected = [a1, a1, -a1, -a1, 0.0, -0.5 * single, a2, 0.0, single, single, -a2, 0.0]
    adv, stats = advantages("agent_turn")
    assert_close(adv, torch.tensor(expected))
    assert stats == AdvantageStats(n_pools=8, n_zero_variance_pools=1, n_singleton_pools=4)


def test_agent_turn_needs_turn_ids():
    keys = {**KEYS, "turn_ids": None}
    with pytest.raises(ConfigError, match="turn_ids"):
        compute_advantages(REWARDS, **keys, estimator="agent_turn")


def test_singleton_pool_gets_raw_reward():
    # One sample in its pool: mu = 0, sigma = 1, so A = R / (1 + eps), and R itself without std division.
    adv = compute_advantages([0.7], group_ids=["g"], agent_ids=["a"], episode_ids=[0])
    assert_close(adv, torch.tensor([0.7 / (1 + EPS)]))
    adv = compute_advantages([0.7], group_ids=["g"], agent_ids=["a"], episode_ids=[0], norm_by_std=False)
    assert_close(adv, torch.tensor([0.7]), rtol=0, atol=0)
    # episode_global with G = 1: the lone episode's mean (0.7 + 0.3) / 2 = 0.5 is its advantage.
    adv = compute_advantages(
        [0.7, 0.3], group_ids=["g", "g"], agent_ids=["a", "b"], episode_ids=[0, 0], estimator="episode_global"
    )
    assert_close(adv, torch.tensor([0.5, 0.5]) / (1 + EPS))


@pytest.mark.parametrize("estimator", ["episode_global", "step_global", "agent", "agent_turn"])
@pytest.mark.parametrize("value", [0.9, 0.1, 0.99, -0.01])
def test_all_equal_pool_gives_exactly_zero(estimator, value):
    # Three equal rewards: (R - mu) / (0 + eps) should be 0, but in float32 the mean of three 0.9s is not
    # 0.9 and that formula returns ~0.056; the estimators must return exactly 0 and count the pool.
    adv, stats = compute_advantages(
        [value] * 3,
        group_ids=["g"] * 3,
        agent_ids=["a"] * 3,
        episode_ids=[0, 1, 2],
        turn_ids=[0] * 3,
        estimator=estimator,
        return_stats=True,
    )
    assert adv.tolist() == [0.0, 0.0, 0.0]
    assert stats == AdvantageStats(n_pools=1, n_zero_variance_pools=1, n_singleton_pools=0)


def test_zero_variance_with_eps_zero_is_not_nan():
    keys = dict(group_ids=["g", "g"], agent_ids=["a", "a"], episode_ids=[0, 1])
    adv = compute_advantages([1.0, 1.0], **keys, eps=0.0)
    assert adv.tolist() == [0.0, 0.0]


def test_norm_by_std_false_is_mean_only():
    # agent pools without std division: A = R - mu_{g,k}.
    # (g1, S) mu = 1/3 -> 2/3, -1/3, -1/3; (g1, V) mu = 1/6 -> 5/6, -1/6, -2/3;
    # (g2, S) mu = 5/6 -> 1/6, 1/6, -1/3; (g2, V) all 1 -> 0.
    expected = [2 / 3, 5 / 6, -1 / 3, -1 / 6, -1 / 3, -2 / 3, 1 / 6, 0.0, 1 / 6, 0.0, -1 / 3, 0.0]
    adv, _ = advantages("agent", norm_by_std=False)
    assert_close(adv, torch.tensor(expected))
    # episode_global: Rbar - mu_g = +-0.5625 in g1, +-0.125 in g2.
    adv, _ = advantages("episode_global", norm_by_std=False)
    assert_close(adv, torch.tensor([0.5625] * 2 + [-0.5625] * 4 + [0.125] * 4 + [-0.125] * 2))


def test_eps_is_added_to_sigma():
    # Pool [1, 0]: mu = 0.5, sigma = 1 / sqrt(2) = 0.707107; with eps = 1: A = +-0.5 / 1.707107 = +-0.292893.
    keys = dict(group_ids=["g", "g"], agent_ids=["a", "a"], episode_ids=[0, 1])
    adv = compute_advantages([1.0, 0.0], **keys, eps=1.0)
    assert_close(adv, torch.tensor([0.292893, -0.292893]))


def test_mixed_id_types_and_tensor_input():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    adv = compute_advantages(
        rewards, group_ids=[7, 7, "x", "x"], agent_ids=[0, 0, 0, 0], episode_ids=[0, 1, 0, 1]
    )
    a = 0.5 / (1 / SQRT2 + EPS)
    assert adv.dtype == torch.float32
    assert_close(adv, torch.tensor([a, -a, a, -a]))


def test_empty_input_gives_empty_tensor():
    for estimator in list_estimators():
        adv, stats = compute_advantages(
            [], group_ids=[], agent_ids=[], episode_ids=[], turn_ids=[], estimator=estimator,
            return_stats=True,
        )  # fmt: skip
        assert adv.shape == (0,) and adv.dtype == torch.float32
        assert stats == AdvantageStats(0, 0, 0)


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ConfigError) as info:
        compute_advantages(REWARDS, **KEYS, estimator="grpo")
    message = str(info.value)
    assert "'grpo'" in message
    for name in list_estimators():
        assert name in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, DrmasError)


def test_length_mismatch_names_argument_and_lengths():
    keys = {**KEYS, "agent_ids": KEYS["agent_ids"][:-1]}
    with pytest.raises(ValueError, match=r"agent_ids has 11 entries but rewards has 12"):
        compute_advantages(REWARDS, **keys)
    keys = {**KEYS, "turn_ids": [0]}
    with pytest.raises(ValueError, match=r"turn_ids has 1 entries but rewards has 12"):
        compute_advantages(REWARDS, **keys, estimator="agent")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_names_the_sample(bad):
    rewards = list(REWARDS)
    rewards[4] = bad
    with pytest.raises(ValueError, match=r"rewards\[4\]"):
        compute_advantages(rewards, **KEYS)


def test_rewards_must_be_1d():
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages(torch.zeros(2, 2), group_ids=[0, 0], agent_ids=[0, 0], episode_ids=[0, 1])


def test_agent_wise_normalisation_keeps_each_agents_advantage_scale():
    # The paper's argument: normalising agent k with shared (mu, sigma) gives
    #   E_k[A^2] = (sigma_k^2 + (mu_k - mu)^2) / sigma^2,
    # which grows when agent k's rewards sit away from the pooled mean. One group:
    #   agent "router":   16 samples, eight 1s and eight 0s    (mu_r = 0.5,  biased sigma_r^2 = 0.25)
    #   agent "searcher":  4 samples [-1, 0, -1, 0]            (mu_s = -0.5, biased sigma_s^2 = 0.25)
    #       (called only in failing episodes, penalised every other call)
    # Pooled (step_global): mu = (8 - 2) / 20 = 0.3; sum of squares 10, so sum of squared deviations
    #   10 - 20 * 0.09 = 8.2 and sigma^2 = 8.2 / 19 = 0.431579.
    #   searcher: (0.25 + (-0.5 - 0.3)^2) / 0.431579 = 0.89 / 0.431579 = 2.062195
    #   router:   (0.25 + ( 0.5 - 0.3)^2) / 0.431579 = 0.29 / 0.431579 = 0.671951
    # Agent-wise: the mean of squared z-scores with the unbiased std is (n - 1) / n, so ~1:
    #   router 15/16 = 0.9375, searcher 3/4 = 0.75.
    rewards = [1.0, 0.0] * 8 + [-1.0, 0.0, -1.0, 0.0]
    agents = ["router"] * 16 + ["searcher"] * 4
    keys = dict(group_ids=["g"] * 20, agent_ids=agents, episode_ids=list(range(20)))
    searcher = torch.tensor([a == "searcher" for a in agents])

    def mean_square(adv: torch.Tensor) -> tuple[float, float]:
        return (adv[~searcher] ** 2).mean().item(), (adv[searcher] ** 2).mean().item()

    router_step, searcher_step = mean_square(compute_advantages(rewards, **keys, estimator="step_global"))
    router_agent, searcher_agent = mean_square(compute_advantages(rewards, **keys, estimator="agent"))
    assert searcher_step == pytest.approx(0.89 * 19 / 8.2, rel=1e-5)  # 2.062195
    assert router_step == pytest.approx(0.29 * 19 / 8.2, rel=1e-5)  # 0.671951
    assert searcher_agent == pytest.approx(3 / 4, rel=1e-5)
    assert router_agent == pytest.approx(15 / 16, rel=1e-5)
