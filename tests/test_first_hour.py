"""A user's first hour with their own app (issue 33): the `check` preflight, the zero-signal training warning,
what evaluation shows of the agents' replies, reproducible checkpoint evaluation, CLI errors with CLI fixes."""

import json
import logging

import pytest

from drmas_graph.cli import main
from tests._envs import ParityEnv
from tests.test_cli_train import write_config


class ConstantEnv(ParityEnv):
    """Every episode gets reward 1: no group has a learning signal."""

    def reward(self, task, episode):
        return 1.0


def test_check_reports_the_reward_spread_per_agent(tmp_path, capsys):
    cfg = write_config(tmp_path, env_kwargs={"n_train": 4, "n_test": 2, "per_agent": True})
    assert main(["check", str(cfg), "--groups", "3", "--set", "group_size=4"]) == 0
    out = capsys.readouterr().out
    assert "3 groups x 4 episodes on the base models: 12 scored" in out
    assert "check, 3 groups: 12/12 episodes  elapsed " in out  # progress, also without a terminal
    assert "episodes: 0 truncated by a limit, 0 model errors, 0 failed, 0 bad rewards" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("solver ", "verifier "))}
    # per agent: rewards are 0/1 (solver) and 1 - solver's (verifier); max_new_tokens 4 cuts every reply
    assert rows["solver"][3:5] == ["0.000", "1.000"] and rows["verifier"][3:5] == ["0.000", "1.000"]
    assert float(rows["solver"][1]) + float(rows["verifier"][1]) == pytest.approx(1.0)
    assert rows["solver"][8] == "100%"  # cut off
    assert "sample reply of solver: '" in out and "sample reply of verifier: '" in out
    assert str(tmp_path / "run" / "check" / "base-g3") in out
    assert not (tmp_path / "run" / "traces.db").exists()  # the run folder stays free for training
    # its episodes' rewards are stored (issue 48: `traces list` showed '-'), matching the report's means
    from drmas_graph.traces.store import TraceStore

    with TraceStore(tmp_path / "run" / "check" / "base-g3" / "traces.db", readonly=True) as store:
        summaries = store.episodes()
        episodes = [store.load_episode(s.id) for s in summaries]
    assert len(episodes) == 12 and all(s.step is None and s.reward is not None for s in summaries)
    assert all(set(ep.rewards) == {"solver", "verifier"} and len(ep.turn_rewards) == len(ep.turns) for ep in episodes)
    assert sum(ep.rewards["solver"] for ep in episodes) / 12 == pytest.approx(float(rows["solver"][1]), abs=5e-4)
    assert main(["traces", "list", str(tmp_path / "run" / "check" / "base-g3" / "traces.db")]) == 0
    listed = [ln.split("│") for ln in capsys.readouterr().out.splitlines() if "train:0:" in ln]
    assert len(listed) == 12 and {cells[8].strip() for cells in listed} == {"0.5"}  # the team mean: 1 in all


def test_check_without_any_learning_signal_exits_3_and_says_what_to_change(tmp_path, capsys):
    cfg = write_config(tmp_path, env="tests.test_first_hour:ConstantEnv")
    assert main(["check", str(cfg)]) == 3
    out = capsys.readouterr().out
    assert "0 of 8 advantage pools with a learning signal" in out  # 4 groups x 2 agents (estimator agent)
    assert "4 of 4 groups give agent 'solver' no learning signal" in out
    assert "change the prompt" in out and "graded" in out and "no group has any learning signal" in out


def test_zero_signal_watch_warns_once_after_three_mostly_zero_variance_steps():
    from drmas_graph.train.loop._scoring import ZeroSignalWatch

    watch = ZeroSignalWatch()
    records = [(0, 3, 4), (1, 4, 4), (2, 2, 4), (3, 3, 4), (4, 4, 4), (5, 4, 4), (6, 4, 4)]  # step 2: half, not most
    out = [watch.observe({"step": s, "adv/zero_variance_pools": z, "adv/pools": p}) for s, z, p in records]
    assert [i for i, w in enumerate(out) if w is not None] == [5]
    assert "for 3 steps in a row (step 3: 3/4, step 4: 4/4, step 5: 4/4;" in out[5]
    assert "Change the prompt, the task difficulty or the reward" in out[5]


def test_training_warns_when_most_pools_teach_nothing(tmp_path, caplog):
    cfg = write_config(tmp_path, env="tests.test_first_hour:ConstantEnv", eval={"k": 1, "n_tasks": 1,
                                                                                   "before_training": False})
    with caplog.at_level(logging.WARNING, logger="drmas_graph.train.loop.trainer"):
        assert main(["train", str(cfg), "--set", "steps=3"]) == 0
    warnings = [r.getMessage() for r in caplog.records if "zero variance" in r.getMessage()]
    assert len(warnings) == 1
    assert "(step 0: 4/4, step 1: 4/4, step 2: 4/4; metric adv/zero_variance_pools)" in warnings[0]


def _evals(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "eval/avg@k" in x]


def test_evaluation_shows_and_stores_the_agents_most_frequent_replies(tmp_path, capsys):
    cfg = write_config(tmp_path)
    assert main(["train", str(cfg)]) == 0  # k 2 x 2 tasks: 4 replies per agent and evaluation
    out = capsys.readouterr().out
    evals = _evals(tmp_path / "run")
    assert [e["step"] for e in evals] == [0, 1]
    for agent in ("solver", "verifier"):
        top = evals[-1][f"eval/{agent}/top_replies"]
        assert sum(r["count"] for r in top) == 4 and all(set(r) == {"reply", "count", "reward"} for r in top)
        # every reply is listed (4 <= 5), so their rewards average to the agent's evaluation reward
        assert sum(r["count"] * r["reward"] for r in top) / 4 == pytest.approx(evals[-1][f"eval/{agent}/reward"])
        assert f"most frequent replies of {agent} (step 1, test):" in out
        assert f"x  reward {top[0]['reward']:.2f}  {top[0]['reply']!r}" in out



def test_every_logged_metric_has_one_documented_name(tmp_path):
    import math

    from drmas_graph.traces.store import TraceStore
    from drmas_graph.train.loop._metric_reference import is_documented

    cfg = write_config(tmp_path, group_size=4)
    assert main(["train", str(cfg)]) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    keys = {k for line in lines for k in line}
    assert [k for k in sorted(keys) if not is_documented(k)] == []
    for old in ("adv_mean", "adv_std", "response_len"):
        assert not [k for k in keys if k.endswith("/" + old)]
    record = next(line for line in lines if "reward/team_mean" in line)
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        episodes = [store.load_episode(i) for i in store.trained_episodes(step=0)]
    for agent in ("solver", "verifier"):  # the population std of the stored advantages of the agent's turns
        advs = [ep.advantages[i] for ep in episodes for i, t in enumerate(ep.turns) if t.agent == agent]
        mean = sum(advs) / len(advs)
        assert len(advs) == 8 and record[f"agent/{agent}/advantage_mean"] == pytest.approx(mean, abs=1e-9)
        assert record[f"agent/{agent}/advantage_std"] == pytest.approx(
            math.sqrt(sum((a - mean) ** 2 for a in advs) / len(advs)), abs=1e-9)
        assert record[f"agent/{agent}/response_length"] == 4.0  # max_new_tokens: the tiny model never stops


def test_top_replies_normalizes_cuts_and_counts():
    from drmas_graph.train.loop.evaluate import top_replies

    long = "x" * 100
    top = top_replies([("a", " The answer\n is 4. ", 1.0), ("a", "The answer is 4.", 0.0), ("a", "No", 0.5),
                       ("a", long, 0.25), ("b", "ok", 1.0)])
    assert top == {"a": [{"reply": "The answer is 4.", "count": 2, "reward": 0.5},
                         {"reply": "No", "count": 1, "reward": 0.5},
                         {"reply": "x" * 80 + "...", "count": 1, "reward": 0.25}],
                   "b": [{"reply": "ok", "count": 1, "reward": 1.0}]}


def test_eval_episodes_store_their_rewards(tmp_path, capsys):
    from drmas_graph.traces.store import TraceStore

    cfg = write_config(tmp_path, env_kwargs={"n_train": 4, "n_test": 2, "per_agent": True})
    assert main(["eval", str(cfg), "--k", "2"]) == 0
    folder = tmp_path / "run" / "eval" / "base-test-k2"
    record = json.loads((folder / "eval.json").read_text())
    with TraceStore(folder / "traces.db", readonly=True) as store:
        episodes = store.episodes()
        assert len(episodes) == 4 and all(e.step is None for e in episodes)  # never trained
        # per-agent rewards: the verifier's is 1 - the solver's (ParityEnv per_agent), the episode's their mean
        assert all(e.rewards["verifier"] == 1.0 - e.rewards["solver"] and e.reward == 0.5 for e in episodes)
        solver = sum(e.rewards["solver"] for e in episodes) / 4
    assert record["solver/reward"] == pytest.approx(solver) and record["split"] == "test"
    assert sum(r["count"] for r in record["solver/top_replies"]) == 4
    assert "most frequent replies of solver (step 0, test):" in capsys.readouterr().out


def test_a_success_threshold_above_every_team_reward_warns_once_with_the_numbers(tmp_path, caplog):
    # per agent: the verifier gets 1 - the solver's reward, so every team reward is their mean, 0.5 < 1.0
    cfg = write_config(tmp_path, env_kwargs={"n_train": 4, "n_test": 2, "per_agent": True})
    with caplog.at_level(logging.WARNING, logger="drmas_graph.train.loop.evaluate"):
        assert main(["train", str(cfg)]) == 0  # evaluations at steps 0 and 1
    warnings = [r.getMessage() for r in caplog.records if "success_threshold" in r.getMessage()]
    assert warnings == [
        "success_threshold 1 is above every team reward of the evaluation at step 0 (4 episodes, highest 0.5, "
        "lowest 0.5; a per-agent reward dict counts as the mean of the agents' rewards): avg@k and pass@k stay 0. "
        "Set success_threshold to the team reward of a success, or give the environment an is_success(task, "
        "episode) method"]
    assert [e["eval/avg@k"] for e in _evals(tmp_path / "run")] == [0.0, 0.0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="drmas_graph.train.loop.evaluate"):
        assert main(["eval", str(cfg), "--set", "success_threshold=0.5"]) == 0
    assert not [r for r in caplog.records if "success_threshold" in r.getMessage()]


def test_the_env_protocol_documents_how_a_reward_dict_becomes_the_team_reward():
    from drmas_graph.env import Env

    assert "The team reward of a per-agent dict is the mean of the agents' rewards" in Env.reward.__doc__


def test_eval_of_a_checkpoint_reproduces_the_runs_own_evaluation_of_that_step(tmp_path, capsys):
    cfg = write_config(tmp_path, eval={"k": 4, "n_tasks": 2, "temperature": 1.0, "top_p": 1.0})
    assert main(["train", str(cfg), "--set", "steps=2"]) == 0
    final = {k.removeprefix("eval/"): v for k, v in _evals(tmp_path / "run")[-1].items()
             if k not in ("time", "eval/time_s")}  # when it was written and how long it took differ
    assert final["step"] == 2
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    assert main(["eval", str(cfg), "--checkpoint", str(ckpt)]) == 0
    record = json.loads((tmp_path / "run" / "eval" / "step_000002-test-k4" / "eval.json").read_text())
    assert record.pop("time_s") > 0
    assert record == final  # avg@k, pass@k, per-agent rewards, lengths and the very replies
    assert "(step 2, test)" in capsys.readouterr().out
    base = _evals(tmp_path / "run")[0]
    assert record["solver/top_replies"] != base["eval/solver/top_replies"]  # not a coincidence of equal seeds


def test_training_again_into_a_used_run_folder_advises_cli_flags(tmp_path, capsys):
    cfg = write_config(tmp_path, eval={"k": 1, "n_tasks": 1, "before_training": False})
    assert main(["train", str(cfg)]) == 0
    capsys.readouterr()
    assert main(["train", str(cfg), "--set", "steps=2"]) == 2  # same folder, not resumed: refused, nothing mixed
    err = capsys.readouterr().err
    run = tmp_path / "run"
    assert err == (f"drmas-graph: error: run folder {run} already holds a run; train into a new folder with "
                   f"`--set run_dir={tmp_path / 'run-2'}`, or continue this run from its last checkpoint with "
                   "`--resume`\n")
    assert main(["train", str(cfg), "--set", "steps=2", "--resume"]) == 0  # continues at step 1
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if "reward/team_mean" in x]
    assert steps == [0, 1]


def test_the_python_api_refuses_a_used_run_folder_naming_its_fixes(tmp_path):
    from drmas_graph.testing import tiny_policy
    from drmas_graph.train.loop.trainer import RunDirInUseError, train_graph
    from tests._graphs import solver_verifier

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "traces.db").write_bytes(b"")
    policy = tiny_policy()
    with pytest.raises(RunDirInUseError, match=r"already holds a run .*run_dir='.*run-2'\), or continue this run "
                                               r"from its last checkpoint with resume=True"):
        train_graph(solver_verifier(None), ParityEnv(), policies={"solver": policy, "verifier": policy},
                    run_dir=str(tmp_path / "run"))


class InterruptedEnv(ParityEnv):
    """Ctrl-C (KeyboardInterrupt) while scoring training reward number `interrupt_at` (1-based; 0: never)."""

    def __init__(self, interrupt_at=0, **kwargs):
        super().__init__(**kwargs)
        self.interrupt_at, self.calls = interrupt_at, 0

    def reward(self, task, episode):
        if task.id.startswith("train"):
            self.calls += 1
            if self.calls == self.interrupt_at:
                raise KeyboardInterrupt
        return super().reward(task, episode)


def test_ctrl_c_during_training_says_what_was_saved_and_how_to_resume(tmp_path, capsys):
    cfg = write_config(tmp_path, env="tests.test_first_hour:InterruptedEnv", checkpoint_every=1, steps=3,
                       env_kwargs={"n_train": 4, "n_test": 2, "interrupt_at": 5},  # step 1's first reward
                       eval={"k": 1, "n_tasks": 1, "before_training": False})
    assert main(["train", str(cfg)]) == 130
    stderr = capsys.readouterr().err
    err = stderr.splitlines()[-1]  # after the checkpoint writer's progress bars
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    assert "Traceback" not in stderr and err == (f"drmas-graph: interrupted; last checkpoint {ckpt} (1 of 3 steps done); continue with "
                   f"`drmas-graph train {cfg} --resume`")
    assert main(["train", str(cfg), "--resume", "--set", "env_kwargs.interrupt_at=0"]) == 0
    assert (tmp_path / "run" / "checkpoints" / "step_000003").is_dir()


def test_ctrl_c_before_the_first_checkpoint_says_to_start_again(tmp_path, capsys):
    cfg = write_config(tmp_path, env="tests.test_first_hour:InterruptedEnv",
                       env_kwargs={"n_train": 4, "n_test": 2, "interrupt_at": 1})
    assert main(["train", str(cfg)]) == 130
    assert capsys.readouterr().err == (
        f"drmas-graph: interrupted; no checkpoint was saved yet (checkpoint_every: 25); its episodes are in "
        f"{tmp_path / 'run' / 'traces.db'}. Start again with `drmas-graph train {cfg} --set "
        f"run_dir={tmp_path / 'run-2'}`\n")


def test_a_resumed_run_keeps_the_evaluation_of_the_checkpoint_it_resumes_from(tmp_path):
    cfg = write_config(tmp_path, steps=2, checkpoint_every=1, eval={"k": 1, "n_tasks": 1, "every": 1})
    assert main(["train", str(cfg)]) == 0
    assert [e["step"] for e in _evals(tmp_path / "run")] == [0, 1, 2]  # after 0, 1 and 2 steps
    assert main(["train", str(cfg), "--resume", "--set", "steps=3"]) == 0  # resumes at step_000002
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in _evals(tmp_path / "run")] == [0, 1, 2, 3]  # step 2's was dropped before
    assert [x["step"] for x in lines if "reward/team_mean" in x] == [0, 1, 2]


def test_check_report_warns_about_an_agent_that_never_acted_and_cut_off_replies():
    from drmas_graph.train.loop._check import AgentCheck, CheckReport

    solver = AgentCheck(episodes=8, reward_mean=0.5, reward_std=0.53, reward_min=0.0, reward_max=1.0, groups=4,
                        zero_variance_groups=1, invalid_rate=0.0, format_error_rate=0.0, truncated_reply_rate=0.75,
                        constrained_rate=0.0, sample_reply="4")
    report = CheckReport(groups=4, group_size=2, episodes=8, counts={}, pools=4, signal_pools=3,
                         agents={"solver": solver}, silent=("judge",))
    assert report.has_signal and report.warnings() == [
        "agent 'solver': 75% of its replies stopped at max_new_tokens: raise agents.solver.sampling.max_new_tokens "
        "or ask for shorter answers",
        "agent 'judge' acted in no scored episode: it would not be trained (does the graph reach it?)"]
