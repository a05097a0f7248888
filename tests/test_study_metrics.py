"""The metrics a study of Dr. MAS needs (issue 43, item 3), on hand-worked groups: per-agent E[A^2]
(`agent/<a>/advantage_sq_mean`), per-turn rewards from an environment (`env.turn_rewards`), the per-agent
gradient norm (`agent/<a>/grad_norm`) and the KL to the start weights without a KL loss (`agent/<a>/kl_start`)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from drmas_graph.env import BadRewardError, Group, group_key, score_episode
from drmas_graph.train.loop._metric_reference import is_documented
from drmas_graph.train.loop._scoring import step_record, with_advantages
from drmas_graph.train.loop.metrics import Stopwatch
from drmas_graph.train.optim._update_metrics import _Tally, tally_kl_start
from drmas_graph.train.optim.update import LossSettings, ModelUpdater
from tests.test_store import make_episode
from tests.test_update import DEEPSPEED_BACKENDS, fresh_model, reference_grad_norm, rollout, settings, snapshot  # noqa: F401 (fixture)


class VerdictEnv:
    """solver paid for its answer (task meta), the verifier paid per verdict through `turn_rewards`."""

    def __init__(self, verdicts: dict[str, dict[int, float]], solver: dict[str, float]):
        self.verdicts, self.solver = verdicts, solver
        self.asked: list[str] = []

    def reward(self, task, episode):
        v = self.verdicts[episode.id]
        return {"solver": self.solver[episode.id], "verifier": sum(v.values()) / len(v)}

    def turn_rewards(self, task, episode):
        self.asked.append(episode.id)
        return self.verdicts[episode.id]


def _group(env_verdicts: dict[int, dict[int, float]], solver: dict[int, float], penalty: float = 0.0):
    """Two episodes of one group, turns [solver, verifier, verifier], scored by `VerdictEnv`."""
    task = SimpleNamespace(id="t0")
    episodes = [make_episode(agents=("solver", "verifier", "verifier"), id=f"e{i}") for i in range(2)]
    env = VerdictEnv({f"e{i}": v for i, v in env_verdicts.items()}, {f"e{i}": r for i, r in solver.items()})
    scored = [(task, ep, score_episode(env, task, ep, invalid_penalty=penalty)) for ep in episodes]
    return env, scored


def _record(scored, estimator: str) -> tuple[dict, list]:
    """The step record of the group and its episodes' advantages."""
    cfg = SimpleNamespace(estimator=estimator, norm_by_std=True, adv_eps=1e-6)
    groups = [Group(scored[0][0], group_key(scored[0][1]), tuple(ep for _, ep, _ in scored), tuple(s for *_, s in scored))]
    groups, stats = with_advantages(groups, cfg)
    times = Stopwatch()
    times.laps.update(rollout=0.0, score=0.0, update=0.0)
    return step_record(0, ["solver", "verifier"], groups, {}, stats, {}, times, 0.0), list(groups[0].advantages)


def test_turn_rewards_replace_the_agent_reward_per_sample_and_feed_the_estimators():
    # e0: solver right (1), verdicts {1: right, 2: wrong}; e1: solver wrong (0), verdicts {1: right, 2: right}
    env, scored = _group({0: {1: 1.0, 2: 0.0}, 1: {1: 1.0, 2: 1.0}}, {0: 1.0, 1: 0.0})
    assert env.asked == ["e0", "e1"]
    assert [s.turn_rewards for *_, s in scored] == [[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]]
    assert [s.rewards for *_, s in scored] == [{"solver": 1.0, "verifier": 0.5}, {"solver": 0.0, "verifier": 1.0}]
    record, adv = _record(scored, "agent")
    # agent: solver pool [1, 0]: mu 0.5, sigma (n-1) 0.70711 -> A = +-0.70711, E[A^2] = 0.5
    # verifier pool [1, 0, 1, 1]: mu 0.75, sigma sqrt((3 x 0.0625 + 0.5625) / 3) = 0.5 -> A = [0.5, -1.5, 0.5, 0.5]
    assert adv[0] == pytest.approx([0.70711, 0.5, -1.5], abs=1e-5)
    assert adv[1] == pytest.approx([-0.70711, 0.5, 0.5], abs=1e-5)
    assert record["agent/solver/advantage_sq_mean"] == pytest.approx(0.5, abs=1e-5)
    assert record["agent/verifier/advantage_sq_mean"] == pytest.approx(0.75, abs=1e-5)  # (n-1)/n, n = 4
    # step_global: pool [1, 1, 0, 0, 1, 1]: mu 2/3, sigma sqrt((4/9 + 8/9) / 5) = 0.516398
    # -> A = 1/3 / 0.516398 = 0.645497 or -2/3 / 0.516398 = -1.290994
    record, adv = _record(scored, "step_global")
    assert adv[0] == pytest.approx([0.645497, 0.645497, -1.290994], abs=1e-5)
    # solver (0.645497^2 + 1.290994^2) / 2 = (0.416667 + 1.666667) / 2 = 1.041667
    # verifier (3 x 0.416667 + 1.666667) / 4 = 0.729167
    assert record["agent/solver/advantage_sq_mean"] == pytest.approx(1.041667, abs=1e-5)
    assert record["agent/verifier/advantage_sq_mean"] == pytest.approx(0.729167, abs=1e-5)
    assert is_documented("agent/verifier/advantage_sq_mean")


def test_without_turn_rewards_every_verifier_turn_gets_its_agent_reward():
    class PerAgent(VerdictEnv):
        turn_rewards = None

    task = SimpleNamespace(id="t0")
    env = PerAgent({"e0": {1: 1.0, 2: 0.0}, "e1": {1: 1.0, 2: 1.0}}, {"e0": 1.0, "e1": 0.0})
    episodes = [make_episode(agents=("solver", "verifier", "verifier"), id=f"e{i}") for i in range(2)]
    scored = [(task, ep, score_episode(env, task, ep, invalid_penalty=0.0)) for ep in episodes]
    _, adv = _record(scored, "agent")
    # verifier pool [0.5, 0.5, 1, 1]: mu 0.75, sigma sqrt(4 x 0.0625 / 3) = 0.288675 -> A = -+0.866025
    assert adv[0] == pytest.approx([0.70711, -0.866025, -0.866025], abs=1e-5)


def test_turn_rewards_take_the_invalid_penalty_and_a_list_form():
    task = SimpleNamespace(id="t0")
    episode = make_episode(agents=("solver", "verifier"))

    class Env:
        def reward(self, task, episode):
            return 1.0

        def turn_rewards(self, task, episode):
            return [0.25, 0.5]

        def turn_is_valid(self, task, turn):
            return turn.agent == "solver"

    score = score_episode(Env(), task, episode, invalid_penalty=0.1)
    assert score.turn_rewards == [0.25, pytest.approx(0.4)]  # 0.5 - 0.1 (verifier turn invalid)
    assert score.rewards == {"solver": 1.0, "verifier": 1.0} and score.team == 1.0


@pytest.mark.parametrize("given, message", [
    ([1.0], "returned 1 rewards for the episode's 2 turns"),
    ({2: 1.0}, "returned a reward for turn 2; the episode's turns are 0..1"),
    ({1: math.nan}, "reward of turn 1 (verifier) for task 't0' is nan"),
    ("1.0", "returned str"),
])
def test_bad_turn_rewards_name_the_environment_and_the_turn(given, message):
    class Env:
        def reward(self, task, episode):
            return 1.0

        def turn_rewards(self, task, episode):
            return given

    with pytest.raises(BadRewardError, match="turn") as info:
        score_episode(Env(), SimpleNamespace(id="t0"), make_episode(agents=("solver", "verifier")), invalid_penalty=0)
    assert message in str(info.value)


def test_turn_rewards_are_not_asked_for_a_configured_reward():
    env = VerdictEnv({"e0": {1: 1.0}}, {"e0": 1.0})
    episode = make_episode(agents=("solver", "verifier"), id="e0", truncated="max_llm_calls")
    score = score_episode(env, SimpleNamespace(id="t0"), episode, invalid_penalty=0.0, truncated_reward=0.0)
    assert score.turn_rewards == [0.0, 0.0] and env.asked == []


# --- per-agent gradient norm -------------------------------------------------------------------------------


def _tokens(samples) -> int:
    return sum(len(s.response_ids) for s in samples)


@pytest.mark.parametrize("backend", [("torch", 0), DEEPSPEED_BACKENDS[0]])
def test_per_agent_grad_norm_is_the_norm_of_its_part_of_the_loss(rollout, backend):  # noqa: F811
    """token-mean over N tokens: agent a's part of the loss is sum_{t in a} l_t / N, so its gradient is
    n_a / N times the gradient of the token-mean over a's samples alone (`reference_grad_norm`)."""
    agents = {"solver": LossSettings(micro_batch_size=2), "verifier": LossSettings(micro_batch_size=2)}
    metrics = ModelUpdater(fresh_model(), name="m", settings=settings(backend, grad_clip=None),
                           agent_settings=agents).update(rollout)
    n = _tokens(rollout)
    for agent in ("solver", "verifier"):
        mine = [s for s in rollout if s.agent == agent]
        _, alone = reference_grad_norm(fresh_model(), mine, "token-mean")
        assert metrics.agents[agent].grad_norm == pytest.approx(_tokens(mine) / n * alone, rel=1e-4)
    _, whole = reference_grad_norm(fresh_model(), list(rollout), "token-mean")
    assert metrics.grad_norm == pytest.approx(whole, rel=1e-4)
    parts = [metrics.agents[a].grad_norm for a in ("solver", "verifier")]
    assert abs(parts[0] - parts[1]) <= metrics.grad_norm <= sum(parts) + 1e-6  # g = g_solver + g_verifier
    assert metrics.to_dict()["agent/verifier/grad_norm"] == parts[1] and is_documented("agent/verifier/grad_norm")


@pytest.mark.parametrize("backend", [("torch", 0), DEEPSPEED_BACKENDS[0]])  # the CPU demo trains on ZeRO-0
def test_measuring_per_agent_grad_norms_leaves_the_step_unchanged(rollout, monkeypatch, backend):  # noqa: F811
    s = settings(backend, n_minibatches=2)
    model_a, model_b = fresh_model(), fresh_model()
    measured = ModelUpdater(model_a, name="m", settings=s).update(rollout)
    monkeypatch.setattr("drmas_graph.train.optim.update.readable_grads", lambda engine: (None, 1.0))
    unmeasured = ModelUpdater(model_b, name="m", settings=s).update(rollout)
    a, b = snapshot(model_a), snapshot(model_b)
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    assert measured.grad_norm == unmeasured.grad_norm and measured.loss == unmeasured.loss
    assert measured.agents["solver"].grad_norm > 0 and unmeasured.agents["solver"].grad_norm is None


def test_one_agent_grad_norm_is_the_model_grad_norm(rollout):  # noqa: F811
    solver = [s for s in rollout if s.agent == "solver"]
    metrics = ModelUpdater(fresh_model(), name="m", settings=settings(n_minibatches=2)).update(solver)
    assert metrics.agents["solver"].grad_norm == metrics.grad_norm > 0


# --- KL to the start weights ---------------------------------------------------------------------------------


def test_kl_start_k3_on_hand_worked_tokens():
    tally = _Tally()
    sample = SimpleNamespace(agent="a", response_ids=(1, 2), old_logprobs=(-1.0, -1.0 + math.log(2)),
                             behaviour_logprobs=None)
    tally_kl_start(tally, [sample], {id(sample): torch.tensor([-1.0, -1.0])})
    # d = logp_start - logp_sample: token 1 d = 0 -> k3 = 0; token 2 d = -ln 2 -> k3 = 1/2 + ln 2 - 1 = 0.193147
    assert tally.mean(("agent", "a", "kl_start")) == pytest.approx(0.193147 / 2, abs=1e-6)
    # a stale sample (asynchronous training): its old_logprobs are the proximal policy's, the metric reads the
    # sampling policy's behaviour_logprobs, here the start weights' own: d = 0 on both tokens -> k3 = 0
    stale_tally = _Tally()
    stale = SimpleNamespace(agent="a", response_ids=(1, 2), old_logprobs=(-1.0, -1.0 + math.log(2)),
                            behaviour_logprobs=(-1.0, -1.0))
    tally_kl_start(stale_tally, [stale], {id(stale): torch.tensor([-1.0, -1.0])})
    assert stale_tally.mean(("agent", "a", "kl_start")) == pytest.approx(0.0, abs=1e-12)


def test_kl_start_without_a_kl_loss(rollout):  # noqa: F811
    off = ModelUpdater(fresh_model(), name="m", settings=settings())
    assert off._start is None and off.update(rollout).agents["solver"].kl_start is None  # no copy, no metric
    model = fresh_model()
    updater = ModelUpdater(model, name="m", settings=settings(kl_start_metric=True))
    first = updater.update(rollout)  # sampled by the start weights themselves: KL ~ 0
    assert first.agents["solver"].kl_start == pytest.approx(0.0, abs=1e-5)
    assert first.agents["solver"].kl_ref is None  # no KL loss
    # samples whose logprobs are the start weights' + ln 2 on every token: d = -ln 2, k3 = 0.193147 per token
    shifted = [dataclasses.replace(s, old_logprobs=tuple(lp + math.log(2) for lp in s.old_logprobs)) for s in rollout]
    second = updater.update(shifted)
    assert second.agents["verifier"].kl_start == pytest.approx(0.193147, abs=1e-4)
    # the metric changes nothing in the step: the same two updates without it give the same weights, bit for bit
    plain = fresh_model()
    other = ModelUpdater(plain, name="m", settings=settings())
    other.update(rollout)
    other.update(shifted)
    a, b = snapshot(model), snapshot(plain)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert is_documented("agent/solver/kl_start")
