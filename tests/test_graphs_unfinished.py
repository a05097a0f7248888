"""The apps of issue 22, trained with tiny random policies and the default rollout settings: the reflection
loop (graphs/reflection, the langgraph-reflection README pattern) never finishes, so every episode is
truncated by the default cap and trained; the research app (graphs/research, open-deep-research's OpenAI
structured-output pattern) breaks on every broken-JSON reply, so every episode is a model error whose
broken turns are penalised and trained. Both runs end on their own."""

import pytest

from drmas_graph import SamplingParams, TraceStore, train_graph
from drmas_graph.testing import tiny_policy
from graphs.reflection.env import ReflectionEnv
from graphs.reflection.graph import build_graph as build_reflection
from graphs.research.env import ResearchEnv
from graphs.research.graph import build_graph as build_research
from tests.test_instrument import Unreachable
from tests.test_trainer import small_config

pytestmark = pytest.mark.slow


def _policies(agents):
    return {a: tiny_policy(seed=i, name=f"tiny-{a}", sampling=SamplingParams(max_new_tokens=4))
            for i, a in enumerate(agents)}


def _train(tmp_path, graph, env, agents):
    cfg = small_config(tmp_path, steps=2, tasks_per_step=1, group_size=2,
                       eval={"k": 1, "n_tasks": 1, "before_training": False})
    assert cfg.rollout.model_dump() == type(cfg.rollout)().model_dump()  # the defaults, untouched
    return train_graph(graph, env, cfg, policies=_policies(agents))


def _trained_episodes(tmp_path):
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        return [store.load_episode(i) for i in store.trained_episodes()]


def test_the_reflection_loop_trains_on_truncated_episodes_with_the_default_settings(tmp_path):
    result = _train(tmp_path, build_reflection(Unreachable()), ReflectionEnv(), ["assistant", "judge"])
    assert [r["step"] for r in result.history] == [0, 1]  # it ended on its own
    for record in result.history:
        assert record["truncated_episodes"] == record["truncated/max_llm_calls"] == record["episodes"] == 2
        assert record["samples/truncated_share"] == 1.0
        assert record["agent/assistant/n_samples"] == record["agent/judge/n_samples"] == 50  # 2 episodes x 25
    episodes = _trained_episodes(tmp_path)
    assert len(episodes) == 4
    for ep in episodes:
        assert len(ep.turns) == 50 and "rollout.max_llm_calls=50" in ep.truncated and ep.error is None
        assert [t.agent for t in ep.turns[:4]] == ["assistant", "judge", "assistant", "judge"]
        # rollout.truncated_reward = 0.0; an empty judge reply costs the env's invalid_penalty 0.05
        assert set(ep.turn_rewards) <= {0.0, -0.05}


def test_the_research_app_trains_on_its_broken_json_turns_with_the_default_settings(tmp_path):
    agents = ["clarify", "write_brief", "researcher", "report"]
    result = _train(tmp_path, build_research(), ResearchEnv(), agents)  # ChatOpenAI on a closed port
    assert [r["step"] for r in result.history] == [0, 1]
    for record in result.history:
        assert record["model_error_episodes"] == record["agent/clarify/model_error_episodes"] == 2
        assert record["agent/clarify/n_samples"] == 6  # 3 attempts (with_retry) x 2 episodes
        assert record["agent/write_brief/never_acted"] == 1
    episodes = _trained_episodes(tmp_path)
    assert len(episodes) == 4
    for ep in episodes:
        assert ep.outcome == "model_error" and ep.model_error_turn == 2
        assert all(t.format_error and t.response_format["name"] == "ClarifyWithUser" for t in ep.turns)
        assert ep.turn_rewards == pytest.approx([-0.1] * 3)  # model_error_reward 0.0 - invalid_penalty 0.1
