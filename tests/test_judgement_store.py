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

from drmas_graph.errors import ConfigError
from drmas_graph.traces import _serde
from drmas_graph.traces.store import TraceStore
from drmas_graph.train import _distributed
from drmas_graph.types import Episode
from tests.test_store import make_episode, make_turn


def group_record(index: int, scores: list[float], reasons: list[str], **changes) -> dict:
    """The record a group-mode judge stores with episode `index` of a group (prompt and replies are the group's)."""
    reply = '{"scores": [%s], "reasons": [%s]}' % (", ".join(map(str, scores)),
                                                      ", ".join(f'"{r}"' for r in reasons))
    record = {
        "mode": "group", "model": "scripted-judge", "rubric_sha": "3f2a9c0d1e4b",
        "prompt": [{"role": "system", "content": "You grade answers. Rubric: the answer must be correct. "
                                                 "Score each trajectory in [0, 1]."},
                   {"role": "user", "content": "Task: 2+2?\nReference answer: 4\n#0 solver (solve): 4\n#1 solver (solve): 5"}],
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
    assert store.load_episode(judged.id).judgement["replies"][1] == '{"scores": [0.0, 0.8], "reasons": ["wrong", "right <b>"]}'
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
