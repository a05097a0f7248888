"""Where a step's time goes (issue 50, item 1): the embedded engine splits its seconds among the requests (a decode
step equally among its rows, a prefill pass by token share), the recorder sums them per agent in the episode,
and the step's record, the run's summary and the docs say where the time went."""

import json

import pytest

from drmas_graph import SamplingParams
from drmas_graph.cli import main
from drmas_graph.train.loop._timing import time_line
from tests.test_cli_train import write_config


def _together(policy, prompts, params):
    futures = [policy.submit(p, sp) for p, sp in zip(prompts, params)]
    return [f.result() for f in futures]


def test_the_engine_shares_a_prefill_by_prompt_tokens_and_a_step_equally_and_loses_no_second():
    from drmas_graph.testing import tiny_policy

    policy = tiny_policy(seed=0, batch_wait_s=0.5, max_batch_wait_s=2.0)  # the four arrive in one admission
    try:
        short, long_ = list(range(10, 20)), list(range(10, 40))  # 10 and 30 prompt tokens
        params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=1)
        gens = _together(policy, [short, long_, long_, short + [7]], [params] * 4)
    finally:
        policy.close()
    assert policy.stats.batches == 1 and policy.stats.prefill_rows == 3  # one pass, the two `long_` share theirs
    a, b, c, d = (g.prefill_s for g in gens)
    # weights: 10 + 1, 30 / 2 + 1 (two requests share the prompt), 30 / 2 + 1, 11 + 1 (one sample each)
    assert b == c and a / b == pytest.approx(11 / 16) and d / a == pytest.approx(12 / 11)
    # no eos in 5 tokens of this model: every row decoded in the same 4 steps, whose time it shared equally
    assert [len(g.token_ids) for g in gens] == [5] * 4
    assert max(g.decode_s for g in gens) == pytest.approx(min(g.decode_s for g in gens))
    # every second the engine measured went to some request
    assert sum(g.prefill_s for g in gens) == pytest.approx(policy.stats.prefill_s, rel=1e-9)
    assert sum(g.decode_s for g in gens) == pytest.approx(policy.stats.decode_s, rel=1e-9)
    assert policy.stats.prefill_s > 0 and policy.stats.decode_s > 0


def test_a_step_records_where_its_time_went_per_phase_and_agent(tmp_path, capsys):
    from drmas_graph.traces.store import TraceStore
    from drmas_graph.train.loop._metric_reference import is_documented

    cfg = write_config(tmp_path, steps=2, checkpoint_every=1, old_logprobs="trainer",
                       update={"lr": 1e-3, "backend": "torch", "n_minibatches": 2})
    assert main(["train", str(cfg)]) == 0
    out = capsys.readouterr().out
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [k for line in lines for k in line if not is_documented(k)] == []
    steps = [line for line in lines if "reward/team_mean" in line]
    evals = [line for line in lines if "eval/split" in line]
    assert len(steps) == 2 and len(evals) == 2 and all(e["eval/time_s"] > 0 for e in evals)
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        for record in steps:
            episodes = [store.load_episode(i) for i in store.trained_episodes(step=record["step"])]
            assert len(episodes) == 4
            for phase in ("prefill", "decode"):
                per_agent = [record[f"agent/{a}/rollout_{phase}_s"] for a in ("solver", "verifier")]
                assert all(s > 0 for s in per_agent)
                assert record[f"time/rollout_{phase}_s"] == pytest.approx(sum(per_agent), rel=1e-9)
                stored = sum(ep.timings["engine"][a][f"{phase}_s"] for ep in episodes for a in ("solver", "verifier"))
                assert record[f"time/rollout_{phase}_s"] == pytest.approx(stored, rel=1e-9)  # kept in traces.db
            assert record["time/rollout_prefill_s"] + record["time/rollout_decode_s"] < record["time/rollout_s"]
            for agent in ("solver", "verifier"):  # its calls' wall time holds its engine time
                assert record[f"agent/{agent}/llm_call_s"] == pytest.approx(
                    sum(t.latency_s for ep in episodes for t in ep.turns if t.agent == agent), rel=1e-9)
                assert record[f"agent/{agent}/llm_call_s"] > record[f"agent/{agent}/rollout_decode_s"]
            # a separate old-logprob pass (trainer logprobs, 2 minibatches), out of the update's time
            assert record["time/old_logprobs_s"] == record["model/tiny/old_logprobs_s"] > 0
            assert record["time/update_s"] > 0 and record["time/sync_s"] == 0.0
            assert "time/judge_s" not in record  # ParityEnv has no reward_group
        assert "time/checkpoint_s" in steps[0] and steps[0]["time/checkpoint_s"] > 0
        assert "time/checkpoint_s" not in steps[1]  # the final checkpoint is written after the loop
    line = next(x for x in out.splitlines() if x.startswith("time per step: "))
    mean = {k: sum(s.get(k, 0.0) for s in steps) / 2 for k in ("time/rollout_s", "time/rollout_prefill_s",
                                                               "time/rollout_decode_s", "time/update_s")}
    assert (f"rollout {mean['time/rollout_s']:.1f} s (prefill {mean['time/rollout_prefill_s']:.1f}, "
            f"decode {mean['time/rollout_decode_s']:.1f})") in line
    assert f"update {mean['time/update_s']:.1f} s" in line
    assert line.endswith(f"evaluation {(evals[0]['eval/time_s'] + evals[1]['eval/time_s']) / 2:.1f} s each (2)")


def test_the_summary_line_averages_each_phase_over_the_steps():
    history = [{"time/rollout_s": 10.0, "time/rollout_prefill_s": 2.0, "time/rollout_decode_s": 6.0,
                "time/score_s": 1.0, "time/judge_s": 0.8, "time/old_logprobs_s": 0.0, "time/update_s": 4.0,
                "time/sync_s": 0.0, "time/checkpoint_s": 3.0},
               {"time/rollout_s": 12.0, "time/rollout_prefill_s": 3.0, "time/rollout_decode_s": 7.0,
                "time/score_s": 2.0, "time/judge_s": 1.6, "time/old_logprobs_s": 0.0, "time/update_s": 5.0,
                "time/sync_s": 0.0}]
    assert time_line(history, [{"time_s": 30.0}, {"time_s": 20.0}, {}]) == (
        "time per step: rollout 11.0 s (prefill 2.5, decode 6.5), score 1.5 s (judge 1.2), old logprobs 0.0 s, "
        "update 4.5 s, sync 0.0 s, checkpoint 1.5 s; evaluation 25.0 s each (2)")
    served = [{"time/rollout_s": 10.0, "time/score_s": 1.0, "time/update_s": 4.0, "time/sync_s": 2.0}]
    # a phase no step measured (no old-logprob pass logged, no checkpoint written) is left out, not shown as 0.0
    assert time_line(served) == "time per step: rollout 10.0 s, score 1.0 s, update 4.0 s, sync 2.0 s"
    assert time_line([{"step": 0, "reward/team_mean": 0.5}]) is None  # a record from before timing: no line
    assert time_line([]) is None
