"""Group-relative advantages for multi-agent GRPO (Dr. MAS and its ablations).

One *sample* is one LLM call (prompt -> response). Every sample carries a scalar reward
``R_i = R_episode - c * 1[call i was invalid]`` and four keys: its group (the G rollouts of one task), its
agent, its episode and, optionally, its turn. An estimator splits the samples into *pools* and normalises
each reward against its pool's statistics; the scalar advantage is later broadcast over the sample's
response tokens (see `drmas_graph.train.optim.losses`).

Estimators (chosen by name from `ADVANTAGE_ESTIMATORS`):

- ``episode_global``: vanilla multi-agent GRPO; one advantage per episode from the episode's mean reward.
- ``step_global``: every sample of the group in one pool (the "global step-level" ablation of issue #81).
- ``agent``: Dr. MAS; one pool per (group, agent).
- ``agent_turn``: one pool per (group, agent, turn).

Conventions shared by every estimator, as in the Dr. MAS reference code:
``sigma`` is the unbiased (N-1) standard deviation; a pool of one member gets ``mu = 0, sigma = 1`` (its
advantage is the raw reward, divided by ``1 + eps``); ``norm_by_std=False`` keeps only the mean
subtraction (Dr. GRPO style). Samples are never padded or duplicated, so each one counts exactly once.

Where we depart from the reference: a pool whose rewards are all equal gets advantage exactly 0. The
reference relies on ``(R - mu) / (0 + eps)`` being 0, but in float32 the mean of three 0.9s is not 0.9
and that formula returns ~0.056; we compute in float64 and zero such pools explicitly.

Axis suffixes: ``_N`` samples, ``_P`` pools, ``_E`` episodes.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Protocol, overload

import torch

from drmas_graph.errors import ConfigError

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "AdvantageStats",
    "SampleKeys",
    "agent_advantages",
    "agent_turn_advantages",
    "compute_advantages",
    "episode_global_advantages",
    "list_estimators",
    "normalize_in_pools",
    "step_global_advantages",
]


@dataclass(frozen=True)
class SampleKeys:
    """Who produced each sample; every sequence has one entry per sample (axis N)."""

    group_ids: Sequence[Hashable]
    """The task group (uid) of each sample; the G rollouts of one task share it."""
    agent_ids: Sequence[Hashable]
    """The agent (role / graph node) that made the call."""
    episode_ids: Sequence[Hashable]
    """The episode (one run of the whole system) the call belongs to; only compared within a group."""
    turn_ids: Sequence[Hashable] | None = None
    """The turn or loop round of the call, as the caller numbers it; needed by ``agent_turn`` only."""


@dataclass(frozen=True)
class AdvantageStats:
    """Counts over the pools an estimator normalised in, for logging."""

    n_pools: int
    """Number of pools (for ``episode_global``: groups, whose members are episodes)."""
    n_zero_variance_pools: int
    """Pools with two or more members whose rewards are all equal: every member gets advantage 0."""
    n_singleton_pools: int
    """Pools with exactly one member: it gets its raw reward (mu = 0, sigma = 1)."""


class AdvantageEstimator(Protocol):
    """An estimator maps float64 rewards_N and their keys to (advantages_N, stats)."""

    def __call__(
        self, rewards_N: torch.Tensor, keys: SampleKeys, *, norm_by_std: bool, eps: float
    ) -> tuple[torch.Tensor, AdvantageStats]: ...


def _pool_index(*key_columns: Sequence[Hashable]) -> tuple[torch.Tensor, int]:
    """Number the distinct key tuples in order of first appearance: (pool_ids_N, number of pools)."""
    index: dict[tuple[Hashable, ...], int] = {}
    pool_ids = [index.setdefault(key, len(index)) for key in zip(*key_columns, strict=True)]
    return torch.tensor(pool_ids, dtype=torch.long), len(index)


def normalize_in_pools(
    values_N: torch.Tensor, pool_ids_N: torch.Tensor, n_pools: int, *, norm_by_std: bool, eps: float
) -> tuple[torch.Tensor, AdvantageStats]:
    """Normalise each value against the statistics of its pool.

    ``A_i = (x_i - mu_p) / (sigma_p + eps)`` for i in pool p (``A_i = x_i - mu_p`` if not norm_by_std),
    with ``mu_p`` the mean and ``sigma_p`` the unbiased std of the pool. A pool of one member uses
    ``mu_p = 0, sigma_p = 1``; a pool of two or more equal values gives exactly 0.
    """
    size_P = torch.bincount(pool_ids_N, minlength=n_pools)
    mean_P = torch.zeros(n_pools, dtype=values_N.dtype).index_add_(0, pool_ids_N, values_N) / size_P
    squared_dev_P = torch.zeros(n_pools, dtype=values_N.dtype).index_add_(
        0, pool_ids_N, (values_N - mean_P[pool_ids_N]) ** 2
    )
    std_P = torch.sqrt(squared_dev_P / (size_P - 1).clamp(min=1))
    lowest_P = torch.full_like(mean_P, math.inf).scatter_reduce_(0, pool_ids_N, values_N, "amin")
    highest_P = torch.full_like(mean_P, -math.inf).scatter_reduce_(0, pool_ids_N, values_N, "amax")

    singleton_P = size_P == 1
    zero_variance_P = (size_P >= 2) & (lowest_P == highest_P)
    mean_P = torch.where(singleton_P, 0.0, mean_P)
    std_P = torch.where(singleton_P, 1.0, std_P)

    advantages_N = values_N - mean_P[pool_ids_N]
    if norm_by_std:
        advantages_N = advantages_N / (std_P[pool_ids_N] + eps)
    advantages_N = torch.where(zero_variance_P[pool_ids_N], 0.0, advantages_N)
    stats = AdvantageStats(
        n_pools=n_pools,
        n_zero_variance_pools=int(zero_variance_P.sum()),
        n_singleton_pools=int(singleton_P.sum()),
    )
    return advantages_N, stats


def episode_global_advantages(
    rewards_N: torch.Tensor, keys: SampleKeys, *, norm_by_std: bool, eps: float
) -> tuple[torch.Tensor, AdvantageStats]:
    """Vanilla multi-agent GRPO: one shared advantage per episode.

    ``Rbar_tau = mean_{i in tau} R_i`` over all samples of episode tau (every agent, every turn);
    ``A_i = (Rbar_tau - mu_g) / (sigma_g + eps)`` for every sample i of tau, where mu_g, sigma_g are taken
    over the episodes of group g, each episode counted once.
    """
    episode_of_N, n_episodes = _pool_index(keys.group_ids, keys.episode_ids)
    group_of_N, n_groups = _pool_index(keys.group_ids)
    samples_per_E = torch.bincount(episode_of_N, minlength=n_episodes)
    episode_means_E = (
        torch.zeros(n_episodes, dtype=rewards_N.dtype).index_add_(0, episode_of_N, rewards_N) / samples_per_E
    )
    # The episode key contains the group, so every sample of an episode writes the same group here.
    group_of_E = torch.zeros(n_episodes, dtype=torch.long).scatter_(0, episode_of_N, group_of_N)
    advantages_E, stats = normalize_in_pools(
        episode_means_E, group_of_E, n_groups, norm_by_std=norm_by_std, eps=eps
    )
    return advantages_E[episode_of_N], stats


def step_global_advantages(
    rewards_N: torch.Tensor, keys: SampleKeys, *, norm_by_std: bool, eps: float
) -> tuple[torch.Tensor, AdvantageStats]:
    """Global step-level ablation: every sample of group g in one pool, each counted once.

    ``A_i = (R_i - mu_g) / (sigma_g + eps)``, mu_g and sigma_g over all samples of g (all agents and turns).
    """
    pool_ids_N, n_pools = _pool_index(keys.group_ids)
    return normalize_in_pools(rewards_N, pool_ids_N, n_pools, norm_by_std=norm_by_std, eps=eps)


def agent_advantages(
    rewards_N: torch.Tensor, keys: SampleKeys, *, norm_by_std: bool, eps: float
) -> tuple[torch.Tensor, AdvantageStats]:
    """Dr. MAS agent-wise normalisation: one pool per (group g, agent k).

    ``A_i = (R_i - mu_{g,k}) / (sigma_{g,k} + eps)``, mu_{g,k} and sigma_{g,k} over every sample of agent k
    in group g, across episodes, turns and loops (an agent that acted 3 times in an episode counts 3 times).
    """
    pool_ids_N, n_pools = _pool_index(keys.group_ids, keys.agent_ids)
    return normalize_in_pools(rewards_N, pool_ids_N, n_pools, norm_by_std=norm_by_std, eps=eps)


def agent_turn_advantages(
    rewards_N: torch.Tensor, keys: SampleKeys, *, norm_by_std: bool, eps: float
) -> tuple[torch.Tensor, AdvantageStats]:
    """Agent x turn normalisation: one pool per (group g, agent k, turn t).

    ``A_i = (R_i - mu_{g,k,t}) / (sigma_{g,k,t} + eps)``. Needs ``keys.turn_ids``.
    """
    if keys.turn_ids is None:
        raise ConfigError(
            "estimator 'agent_turn' needs turn_ids (one turn index per sample); "
            "pass turn_ids=... or choose another estimator"
        )
    pool_ids_N, n_pools = _pool_index(keys.group_ids, keys.agent_ids, keys.turn_ids)
    return normalize_in_pools(rewards_N, pool_ids_N, n_pools, norm_by_std=norm_by_std, eps=eps)


ADVANTAGE_ESTIMATORS: Mapping[str, AdvantageEstimator] = MappingProxyType(
    {
        "episode_global": episode_global_advantages,
        "step_global": step_global_advantages,
        "agent": agent_advantages,
        "agent_turn": agent_turn_advantages,
    }
)


def list_estimators() -> list[str]:
    """Names accepted by ``compute_advantages(estimator=...)``."""
    return list(ADVANTAGE_ESTIMATORS)


def _as_rewards(rewards: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Rewards as a finite 1-D float64 CPU tensor, or a ConfigError naming the first bad sample."""
    rewards_N = torch.as_tensor(rewards.detach() if isinstance(rewards, torch.Tensor) else rewards)
    rewards_N = rewards_N.to(device="cpu", dtype=torch.float64)
    if rewards_N.dim() != 1:
        raise ConfigError(f"rewards must be 1-D (one reward per sample), got shape {tuple(rewards_N.shape)}")
    not_finite_N = ~torch.isfinite(rewards_N)
    if not_finite_N.any():
        i = int(not_finite_N.nonzero()[0])
        raise ConfigError(
            f"rewards[{i}] is {rewards_N[i].item()}; every sample needs a finite reward "
            "(check the reward function and the invalid-turn penalty)"
        )
    return rewards_N


def _check_lengths(n_samples: int, **key_columns: Sequence[Hashable] | None) -> None:
    for name, column in key_columns.items():
        if column is not None and len(column) != n_samples:
            raise ConfigError(
                f"{name} has {len(column)} entries but rewards has {n_samples}; pass one id per sample"
            )


@overload
def compute_advantages(
    rewards: torch.Tensor | Sequence[float],
    *,
    group_ids: Sequence[Hashable],
    agent_ids: Sequence[Hashable],
    episode_ids: Sequence[Hashable],
    turn_ids: Sequence[Hashable] | None = None,
    estimator: str = "agent",
    norm_by_std: bool = True,
    eps: float = 1e-6,
    return_stats: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def compute_advantages(
    rewards: torch.Tensor | Sequence[float],
    *,
    group_ids: Sequence[Hashable],
    agent_ids: Sequence[Hashable],
    episode_ids: Sequence[Hashable],
    turn_ids: Sequence[Hashable] | None = None,
    estimator: str = "agent",
    norm_by_std: bool = True,
    eps: float = 1e-6,
    return_stats: Literal[True],
) -> tuple[torch.Tensor, AdvantageStats]: ...


def compute_advantages(
    rewards: torch.Tensor | Sequence[float],
    *,
    group_ids: Sequence[Hashable],
    agent_ids: Sequence[Hashable],
    episode_ids: Sequence[Hashable],
    turn_ids: Sequence[Hashable] | None = None,
    estimator: str = "agent",
    norm_by_std: bool = True,
    eps: float = 1e-6,
    return_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, AdvantageStats]:
    """One advantage per sample (LLM call), float32, shape [N], on the device of ``rewards``.

    ``rewards`` holds R_i per sample (episode reward minus any invalid-turn penalty); the id sequences
    have one hashable per sample. ``estimator`` is a name from `ADVANTAGE_ESTIMATORS`. With
    ``return_stats=True`` also returns the `AdvantageStats` of the pools (for the zero-variance count).
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ConfigError(
            f"unknown advantage estimator {estimator!r}; valid names: {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    if not eps >= 0:
        raise ConfigError(f"eps must be >= 0, got {eps}")
    rewards_N = _as_rewards(rewards)
    n_samples = rewards_N.shape[0]
    _check_lengths(
        n_samples, group_ids=group_ids, agent_ids=agent_ids, episode_ids=episode_ids, turn_ids=turn_ids
    )
    keys = SampleKeys(group_ids=group_ids, agent_ids=agent_ids, episode_ids=episode_ids, turn_ids=turn_ids)
    advantages_N, stats = ADVANTAGE_ESTIMATORS[estimator](rewards_N, keys, norm_by_std=norm_by_std, eps=eps)
    device = rewards.device if isinstance(rewards, torch.Tensor) else torch.device("cpu")
    advantages_N = advantages_N.to(device=device, dtype=torch.float32)
    return (advantages_N, stats) if return_stats else advantages_N
