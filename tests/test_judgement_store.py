"""Episode.judgement (what a judge model made of an episode) in the trace store, `traces show`, the Weave export,
the UI's episode page and `rescore` with a judge (issue 32, JUDGE_DESIGN.md section 3).

The judges here are scripted: objects with the `reward_group(task, episodes)` protocol that set
`episode.judgement` the way `drmas_graph.rewards.Judge` does, so every number is known in advance.
"""

from __future__ import annotations

import copy
import sqlite3
from pathlib import Path

import pytest

from drmas_graph.env import BadRewardError, Task
from drmas_graph.errors import ConfigError
from drmas_graph.traces import _serde
from drmas_graph.traces.store import TraceStore
from drmas_graph.train.engines import distributed as _distributed
from drmas_graph.train.loop.rescore import rescore
from tests.test_store import make_episode


def group_record(index: int, scores: list[float], reasons: list[str], **changes) -> dict:
    """The record a group-mode judge stores with episode `index` of a group (prompt and replies are the group's)."""
    reply = '{"scores": [%s], "reasons": [%s]}' % (", ".join(map(str, scores)),
                                                      ", ".join(f'"{r}"' for r in reasons))
    record = {
        "mode": "group", "model": "scripted-judge", "rubric_sha": "3f2a9c0d1e4b",
        "prompt": [{"role": "system", "content": "You grade answers. Rubric: the answer must be correct. "
                                                 "Score each trajectory in [0, 1]."},
                   {"role": "user",
                    "content": "Task: 2+2?\nReference answer: 4\n#0 solver (solve): 4\n#1 solver (solve): 5"}],
        "replies": ["not json", reply],
        "scores": scores[index], "reasons": reasons[index], "attempts": 2,
        "input_tokens": 812, "output_tokens": 64, "cached": False, "seconds": 1.25,
        "group_size": len(scores), "index": index, "error": None,
    }
    record.update(changes)
    return record


AGENT_RECORD = {
    "mode": "agent", "model": "scripted-judge", "rubric_sha": "0b1c2d3e4f5a",
    "prompt": [{"role": "user", "content": "Score each agent."}],
    "replies": ['{"scores": {"solver": 1.0, "verifier": 0.25}, "reasons": {"solver": "right", "verifier": "lax"}}'],
    "scores": {"solver": 1.0, "verifier": 0.25}, "reasons": {"solver": "right", "verifier": "lax"},
    "attempts": 1, "input_tokens": 40, "output_tokens": 30, "cached": True, "seconds": 0.0, "error": None,
}


@pytest.fixture
def store(tmp_path: Path):
    with TraceStore(tmp_path / "run.db") as s:
        yield s


# -- the trace store ---------------------------------------------------------------------------------------


def test_write_episode_stores_the_judgement_and_load_episode_returns_it_equal(store):
    judged = make_episode(judgement=group_record(1, [0.0, 0.8], ["wrong", "right <b>"]))
    plain = make_episode()
    store.write_episode(judged, step=2)
    store.write_episode(plain)
    assert store.load_episode(judged.id).judgement == judged.judgement
    reply = store.load_episode(judged.id).judgement["replies"][1]
    assert reply == '{"scores": [0.0, 0.8], "reasons": ["wrong", "right <b>"]}'
    assert store.load_episode(plain.id).judgement is None
    per_agent = make_episode(judgement=copy.deepcopy(AGENT_RECORD))
    store.write_episode(per_agent)
    assert store.load_episode(per_agent.id).judgement == AGENT_RECORD


def test_update_training_and_record_training_store_the_judgement_that_arrives_with_the_rewards(store):
    first, second, third = make_episode(), make_episode(), make_episode()
    for episode in (first, second, third):
        store.write_episode(episode)  # written when the run ends: not judged yet
    record = group_record(0, [0.8, 0.2], ["solved", "off by one"])
    store.update_training(first.id, step=None, rewards={"solver": 0.8, "verifier": 0.8}, judgement=record)
    assert store.load_episode(first.id).judgement == record
    store.update_training(first.id, step=4, advantages=[0.5, -0.5])  # judgement None: kept
    assert store.load_episode(first.id).judgement == record and store.summary(first.id).step == 4

    second.judgement = group_record(1, [0.8, 0.2], ["solved", "off by one"], error="JudgeError: no scores")
    second.rewards = {"solver": 0.2, "verifier": 0.2}
    store.record_training(5, [second, third])  # third has no judgement: its column stays NULL
    assert store.load_episode(second.id).judgement == second.judgement
    assert store.load_episode(second.id).rewards == {"solver": 0.2, "verifier": 0.2}
    assert store.load_episode(third.id).judgement is None
    third.judgement = None
    store.record_training(5, [first])  # first.judgement is None here: the stored record is not erased
    assert store.load_episode(first.id).judgement == record


def test_a_judgement_that_is_not_a_dict_is_refused_naming_the_field(store):
    with pytest.raises(ConfigError, match=r"Episode.judgement is a list; it must be a dict"):
        store.write_episode(make_episode(judgement=[0.5]))
    episode = make_episode()
    store.write_episode(episode)
    with pytest.raises(ConfigError, match=r"Episode.judgement is a str"):
        store.update_training(episode.id, step=None, judgement="0.5")
    assert store.load_episode(episode.id).judgement is None


def test_a_store_written_before_judgements_reads_none_and_gains_the_column_when_opened_to_write(tmp_path):
    path = tmp_path / "old.db"
    old = make_episode()
    with TraceStore(path) as store:
        store.write_episode(old, step=0)
    with sqlite3.connect(path) as conn:
        conn.execute("ALTER TABLE episodes DROP COLUMN judgement")
    conn.close()
    with TraceStore(path, readonly=True) as store:
        assert ("episodes", "judgement") in store._absent
        assert store.load_episode(old.id).judgement is None and store.load_episode(old.id).turns == old.turns
    record = group_record(0, [1.0], ["right"])
    with TraceStore(path) as store:  # opening to write adds the column (NULL in the old rows)
        assert store.load_episode(old.id).judgement is None
        store.update_training(old.id, step=None, judgement=record)
        new = make_episode(judgement=record)
        store.write_episode(new)
    with sqlite3.connect(path) as conn:
        assert "judgement" in {row[1] for row in conn.execute("PRAGMA table_info(episodes)")}
    conn.close()
    with TraceStore(path, readonly=True) as store:
        assert store.load_episode(old.id).judgement == record and store.load_episode(new.id).judgement == record


def test_merging_rank_stores_copies_the_judgements(tmp_path):
    main, other = TraceStore(tmp_path / "traces.db"), TraceStore(tmp_path / "traces.rank1.db")
    theirs = [make_episode(group_id="train:0:t1") for _ in range(2)]
    for episode in theirs:
        other.write_episode(episode)
    for i, episode in enumerate(theirs):
        episode.judgement = group_record(i, [1.0, 0.0], ["right", "wrong"])
    other.record_training(0, theirs)
    assert _distributed.merge_traces(tmp_path) == 2
    assert [main.load_episode(e.id).judgement for e in theirs] == [e.judgement for e in theirs]
    other.close()
    main.close()


def test_the_judgement_column_is_one_of_the_added_columns():
    assert ("episodes", "judgement", "TEXT") in _serde.ADDED_COLUMNS and "judgement" in _serde.EPISODE_COLUMNS
    assert _serde.judgement_from_json(_serde.judgement_to_json(AGENT_RECORD)) == AGENT_RECORD
    assert _serde.judgement_to_json(None) is None and _serde.judgement_from_json(None) is None


# -- traces show ------------------------------------------------------------------------------------------------


def panel_lines(out: str, title: str) -> list[str]:
    """The text lines of the panel whose title starts with `title`, borders stripped."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"╭─ {title}"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("╰"))
    body = [line.strip("│").strip() for line in lines[start + 1:end]]
    return [lines[start].strip("╭─╮ ").rstrip("─ "), *body]


def test_traces_show_prints_the_judges_scores_reasons_reply_and_folded_prompt(tmp_path, capsys):
    from drmas_graph.cli import main

    record = group_record(1, [0.0, 0.8], ["wrong", "right, [bold]4[/bold]"])
    episode = make_episode(judgement=record)
    with TraceStore(tmp_path / "run.db") as store:
        store.write_episode(episode, step=1)
    assert main(["traces", "show", str(tmp_path / "run.db"), episode.id]) == 0
    out = capsys.readouterr().out
    assert panel_lines(out, "judge") == [
        "judge  mode group  episode 2 of 2 judged together",
        "model scripted-judge   rubric 3f2a9c0d1e4b   judge calls 2   tokens in 812 / out 64   cached no   seconds 1.25",
        "scores 0.8",
        "reason   right, [bold]4[/bold]",  # user text, not rich markup
        "error    -",
        "prompt   system: You grade answers. Rubric: the answer must be correct. Score each trajectory in [0, 1].",
        "prompt   user: Task: 2+2? Reference answer: 4 #0 solver (solve): 4 #1 solver (solve): 5",  # one line
        'reply    {"scores": [0.0, 0.8], "reasons": ["wrong", "right, [bold]4[/bold]"]}',
    ]
    assert out.index("╭─ judge") < out.index("╭─ #0  node solver_node")  # after the header, before the turns

    long_rubric = "Rubric: " + "Be strict about units. " * 30
    record["prompt"][0]["content"] = long_rubric
    long = make_episode(judgement=record)
    with TraceStore(tmp_path / "run.db") as store:
        store.write_episode(long)
    assert main(["traces", "show", str(tmp_path / "run.db"), long.id]) == 0
    folded = " ".join(capsys.readouterr().out.replace("│", " ").split())
    cut = ("system: " + long_rubric.strip())[:239] + "…"  # one line of 240 characters, the cut marked
    assert cut.endswith("units. Be strict about …") and f"prompt {cut} prompt user: Task: 2+2?" in folded
    assert main(["traces", "show", str(tmp_path / "run.db"), long.id, "--full"]) == 0
    full = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert long_rubric.strip() in full  # the whole prompt
    assert 'reply 1 not json reply 2 {"scores": [0.0, 0.8]' in full  # every attempt's reply


def test_traces_show_prints_per_agent_scores_and_a_judge_failure(tmp_path, capsys):
    from drmas_graph.cli import main

    failed = {"mode": "agent", "model": "scripted-judge", "prompt": [], "replies": [], "scores": None,
              "reasons": None, "attempts": 3, "cached": False,
              "error": "JudgeError: the judge timed out after 120.0 s (3 attempts)"}
    agent, broken = make_episode(judgement=copy.deepcopy(AGENT_RECORD)), make_episode(judgement=failed)
    with TraceStore(tmp_path / "run.db") as store:
        store.write_episode(agent)
        store.write_episode(broken)
    assert main(["traces", "show", str(tmp_path / "run.db"), agent.id]) == 0
    assert panel_lines(capsys.readouterr().out, "judge") == [
        "judge  mode agent",
        "model scripted-judge   rubric 0b1c2d3e4f5a   judge calls 1   tokens in 40 / out 30   cached yes   seconds 0.00",
        "scores solver=1, verifier=0.25",
        "reason   solver: right",
        "reason   verifier: lax",
        "error    -",
        "prompt   user: Score each agent.",
        'reply    {"scores": {"solver": 1.0, "verifier": 0.25}, "reasons": {"solver": "right", "verifier": "lax"}}',
    ]
    assert main(["traces", "show", str(tmp_path / "run.db"), broken.id]) == 0
    assert panel_lines(capsys.readouterr().out, "judge") == [
        "judge  mode agent",
        "model scripted-judge   rubric -   judge calls 3   tokens in - / out -   cached no   seconds -",
        "scores -",
        "reason   -",
        "error    JudgeError: the judge timed out after 120.0 s (3 attempts)",
        "prompt   -",
        "reply    -",
    ]
    plain = make_episode()
    with TraceStore(tmp_path / "run.db") as store:
        store.write_episode(plain)
    assert main(["traces", "show", str(tmp_path / "run.db"), plain.id]) == 0
    assert "╭─ judge" not in capsys.readouterr().out  # no judge, no block


# -- rescore with a judge ---------------------------------------------------------------------------------------


class JudgeError(RuntimeError):
    """Stands in for drmas_graph.rewards.JudgeError: the judge gave no usable score for an episode."""


class ScriptedGroupJudge:
    """A group-mode judge with `drmas_graph.rewards.Judge`'s protocol: one call sees the whole group, sets every
    episode's judgement and returns one item per episode. Its score of an episode is the episode's
    metadata["score"] (a float, an {agent: float} dict, or None: the judge fails on it)."""

    name = "scripted-group-judge"

    def __init__(self) -> None:
        self.calls: list[tuple[object, list[str]]] = []

    def reward_group(self, task, episodes):
        self.calls.append((task, [e.id for e in episodes]))
        scores = [e.metadata["score"] for e in episodes]
        prompt = [{"role": "user", "content": f"task {task.id}: {task.input} (reference answer: {task.answer})"}]
        items = []
        for i, (episode, score) in enumerate(zip(episodes, scores, strict=True)):
            error = None if score is not None else "no usable score after 3 attempts"
            episode.judgement = {"mode": "group", "model": "scripted", "prompt": prompt, "replies": [repr(scores)],
                                 "scores": score, "reasons": f"episode {i} of {task.id}", "attempts": 1,
                                 "group_size": len(episodes), "index": i, "error": error}
            items.append(JudgeError(error) if error else score)
        return items


class ScriptedJudgedEnv(ScriptedGroupJudge):
    """A JudgedEnv stand-in: the judge plus the env's tasks (with reference answers)."""

    def tasks(self, split):
        return TASKS if split == "train" else TASKS[:1]


TASKS = [Task(id="t1", input={"q": "2+2?"}, answer="4"), Task(id="t2", input={"q": "3*3?"}, answer="9")]
GROUP_T2 = [{"solver": 0.9, "verifier": 0.3}, {"solver": 0.6, "verifier": 0.3}, {"solver": 0.3, "verifier": 0.3}]


def judged_run(path: Path) -> dict[str, list[str]]:
    """Step 0 of a run: group train:0:t1 (team scores 1, 0.5, the judge fails, 0) and group train:0:t2 (per-agent
    scores GROUP_T2), trained with an older judge's verdicts stored. Returns the ids by group."""
    ids: dict[str, list[str]] = {}
    episodes = []
    for task, scores in (("t1", [1.0, 0.5, None, 0.0]), ("t2", GROUP_T2)):
        group = [make_episode(task_id=task, group_id=f"train:0:{task}", input=TASKS[task == "t2"].input,
                              metadata={"score": score}) for score in scores]
        ids[task] = [e.id for e in group]
        episodes += group
    with TraceStore(path) as store:
        for episode in episodes:
            store.write_episode(episode)
            episode.judgement = {"mode": "episode", "model": "older-judge", "scores": 0.5, "error": None}
            episode.rewards = {"solver": 0.5, "verifier": 0.5}
        store.record_training(0, episodes)
    return ids


def test_rescore_with_a_group_judge_calls_it_once_per_group_and_stores_its_judgements(tmp_path):
    ids = judged_run(tmp_path / "run.db")
    judge = ScriptedGroupJudge()
    result = rescore(tmp_path / "run.db", judge=judge, tasks=TASKS, out=tmp_path / "judged.db")

    calls = sorted(judge.calls, key=lambda call: call[0].id)  # groups are judged concurrently
    assert calls == [(TASKS[0], ids["t1"]), (TASKS[1], ids["t2"])]
    failed = ids["t1"][2]
    # the one failure rule of training and rescore (`_scoring.score_episodes`): a BadRewardError caused by the item
    why = (f"BadRewardError: env ScriptedGroupJudge.reward_group() gave no reward for episode 2 ({failed}) of group "
           "'train:0:t1' (task 't1'): JudgeError: no usable score after 3 attempts")
    assert result.failed == {failed: why}
    assert list(result) == [i for i in ids["t1"] + ids["t2"] if i != failed]
    # group t1, team rewards 1, 0.5, 0 for both agents: mu = 0.5, unbiased sigma = sqrt((0.25 + 0 + 0.25) / 2) = 0.5
    # -> A = (1 - 0.5) / 0.5 = 1, 0, -1 (the failed episode is out of the pool)
    assert [a for i in (ids["t1"][0], ids["t1"][1], ids["t1"][3]) for a in result[i].advantages] == \
        pytest.approx([1.0, 1.0, 0.0, 0.0, -1.0, -1.0], abs=1e-5)
    assert result[ids["t1"][1]].rewards == {"solver": 0.5, "verifier": 0.5}
    # group t2, per agent: solver 0.9, 0.6, 0.3 -> mu 0.6, sigma 0.3 -> A = 1, 0, -1; verifier all 0.3 -> 0
    assert [a for i in ids["t2"] for a in result[i].advantages] == pytest.approx([1.0, 0.0, 0.0, 0.0, -1.0, 0.0],
                                                                                abs=1e-5)
    assert result[ids["t2"][0]].turn_rewards == [0.9, 0.3]
    assert result[ids["t2"][2]].judgement["reasons"] == "episode 2 of t2"

    with TraceStore(tmp_path / "judged.db", readonly=True) as out:
        assert out.config["judge"] == "scripted-group-judge" and out.config["reward_fn"] is None
        loaded = {i: out.load_episode(i) for i in ids["t1"] + ids["t2"]}
        assert out.trained_episodes() == list(result)  # the failed one has its error: not trained on
    assert loaded[ids["t2"][0]].judgement == {
        "mode": "group", "model": "scripted", "prompt": [{"role": "user", "content":
                                                          "task t2: {'q': '3*3?'} (reference answer: 9)"}],
        "replies": [repr(GROUP_T2)], "scores": {"solver": 0.9, "verifier": 0.3}, "reasons": "episode 0 of t2",
        "attempts": 1, "group_size": 3, "index": 0, "error": None}
    assert loaded[ids["t2"][0]].advantages == pytest.approx([1.0, 0.0], abs=1e-5)
    assert loaded[failed].judgement["error"] == "no usable score after 3 attempts"
    assert loaded[failed].error == why
    assert loaded[failed].rewards == {} and loaded[failed].advantages is None
    with TraceStore(tmp_path / "run.db", readonly=True) as source:  # never modified
        assert source.load_episode(failed).judgement["model"] == "older-judge"


def test_rescore_without_tasks_rebuilds_each_task_from_the_stored_input(tmp_path):
    ids = judged_run(tmp_path / "run.db")
    judge = ScriptedGroupJudge()
    rescore(tmp_path / "run.db", judge=judge, step=0, episodes=ids["t2"])
    [(task, group)] = judge.calls
    assert task == Task(id="t2", input={"q": "3*3?"}) and task.answer is None and group == ids["t2"]


def test_rescore_shows_the_judge_each_group_in_the_order_training_did_not_the_order_episodes_finished(tmp_path):
    """The store holds episodes in the order they finished; a group judge that ranks by position (as a cached
    group reply does) must see them in their group order (`metadata["group_index"]`), as training did."""
    group = [make_episode(task_id="t1", group_id="train:0:t1", input=TASKS[0].input,
                          metadata={"score": 0.25 * (i + 1), "group_index": i}) for i in range(3)]
    with TraceStore(tmp_path / "run.db") as store:
        for episode in (group[2], group[0], group[1]):  # finishing order
            store.write_episode(episode)
        store.record_training(0, group)
    judge = ScriptedGroupJudge()
    result = rescore(tmp_path / "run.db", judge=judge, tasks=TASKS)
    assert judge.calls == [(TASKS[0], [e.id for e in group])]
    assert [result[e.id].judgement["index"] for e in group] == [0, 1, 2]


def test_rescore_with_a_judge_refuses_what_it_cannot_score(tmp_path):
    ids = judged_run(tmp_path / "run.db")
    with pytest.raises(ConfigError, match=r"task 't2' \(group 'train:0:t2'\) is not in the tasks given"):
        rescore(tmp_path / "run.db", judge=ScriptedGroupJudge(), tasks=TASKS[:1])
    with pytest.raises(ConfigError, match="give exactly one of reward_fn"):
        rescore(tmp_path / "run.db", lambda e: 1.0, judge=ScriptedGroupJudge())
    with pytest.raises(ConfigError, match="not an object with a reward_group"):
        rescore(tmp_path / "run.db", judge=object())

    class ShortJudge(ScriptedGroupJudge):
        def reward_group(self, task, episodes):
            return super().reward_group(task, episodes)[:-1]

    # a wrong-length list fails its group's episodes, as in training; here every group's, so nothing is left
    with pytest.raises(BadRewardError, match=rf"none of the 7 pooled episodes got a usable reward; the first failure "
                                             rf"\(episode {ids['t1'][0]}\): env ShortJudge.reward_group\(\) returned 3 "
                                             r"rewards for the 4 episodes of group 'train:0:t1'"):
        rescore(tmp_path / "run.db", judge=ShortJudge())
    with pytest.raises(BadRewardError, match=rf"none of the 1 pooled episodes got a usable reward; the first failure "
                                             rf"\(episode {ids['t1'][2]}\): .*JudgeError: no usable score"):
        rescore(tmp_path / "run.db", judge=ScriptedGroupJudge(), episodes=[ids["t1"][2]])


def test_rescore_with_a_reward_function_drops_the_stored_judgements(tmp_path):
    ids = judged_run(tmp_path / "run.db")
    result = rescore(tmp_path / "run.db", lambda e: 1.0, out=tmp_path / "out.db")
    assert result.failed == {} and result[ids["t1"][0]].judgement is None
    with TraceStore(tmp_path / "out.db", readonly=True) as out:
        assert out.load_episode(ids["t1"][0]).judgement is None  # the older judge did not give these rewards


def test_cli_rescore_takes_a_judge_and_says_what_failed(tmp_path, capsys):
    from drmas_graph.cli import main

    ids = judged_run(tmp_path / "run.db")
    args = ["traces", "rescore", str(tmp_path / "run.db"), "--judge", "tests.test_judgement_store:ScriptedGroupJudge"]
    assert main([*args, "--out", str(tmp_path / "judged.db")]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the console wraps at 160 columns
    assert out == (
        "rescored 6 episodes (pool: trained; tasks rebuilt from the stored inputs, without reference answers); "
        f"mean reward: solver 0.5500, verifier 0.4000; wrote {tmp_path / 'judged.db'} "  # (1+.5+0+.9+.6+.3)/6 = .55
        "the judge gave no usable reward to 1 episode(s), left out of the advantages (stored with their error in "
        f"--out): - {ids['t1'][2]}: BadRewardError: env ScriptedGroupJudge.reward_group() gave no reward for episode 2 "
        f"({ids['t1'][2]}) of group 'train:0:t1' (task 't1'): JudgeError: no usable score after 3 attempts")
    with TraceStore(tmp_path / "judged.db", readonly=True) as out:
        assert out.load_episode(ids["t1"][0]).judgement["reasons"] == "episode 0 of t1"
    assert main(["traces", "rescore", str(tmp_path / "run.db"), "--judge",
                 "tests.test_judgement_store:ScriptedJudgedEnv", "--split", "train"]) == 0
    assert "(pool: trained; tasks of the train splits)" in capsys.readouterr().out
    assert main(["traces", "rescore", str(tmp_path / "run.db"), "--judge", "tests.test_judgement_store:TASKS"]) == 2
    assert "is a list, not a judge" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["traces", "rescore", str(tmp_path / "run.db"), "--reward", "x:y", "--judge", "x:y"])
    assert usage.value.code == 2 and "argument --judge: not allowed with argument --reward" in capsys.readouterr().err
