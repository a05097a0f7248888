"""rescore pools the episodes training used in the latest run; older stores gain new columns or read them as NULL."""

import sqlite3
from pathlib import Path

import pytest

from drmas_graph.traces import _serde
from drmas_graph.cli import main as cli_main
from drmas_graph.errors import ConfigError
from drmas_graph.train.loop.rescore import rescore
from drmas_graph.traces.store import TraceStore
from tests.test_store import make_episode


def _episode(reward: float, group: str, **changes):
    return make_episode(agents=("solver",), task_id="t", group_id=group, metadata={"r": reward}, **changes)


def resumed_run(path: Path) -> dict[str, list[str]]:
    """A run as the trainer stores it: step 0 trained, eval and failed episodes, step 1 trained, then the
    run is killed and resumed from the checkpoint of step 1, which trains step 1 again."""
    written: dict[str, list[str]] = {}
    with TraceStore(path) as store:
        def train(name, step, rewards):
            episodes = [_episode(r, f"train:{step}:t") for r in rewards]
            for episode in episodes:
                store.write_episode(episode)
            store.record_training(step, episodes)
            written[name] = [e.id for e in episodes]

        train("step0", 0, [1.0, 0.0])
        evaluation, failed = _episode(5.0, "eval:0:t"), _episode(1.0, "train:1:t", error="RolloutError: boom")
        store.write_episode(evaluation)
        store.write_episode(failed)
        written["eval"], written["failed"] = [evaluation.id], [failed.id]
        train("step1_before_resume", 1, [1.0, 0.0])
        train("step1", 1, [1.0, 0.0, 0.0])  # the resumed run
    return written


def reward(episode):
    return float(episode.metadata["r"])


def test_rescore_pools_the_trained_episodes_of_the_latest_run(tmp_path):
    written = resumed_run(tmp_path / "run.db")
    result = rescore(tmp_path / "run.db", reward, estimator="agent")
    assert list(result) == written["step0"] + written["step1"]
    # group train:0:t: rewards 1, 0 -> mean 0.5, unbiased std sqrt(0.5): A = +-0.70711
    assert [result[i].advantages[0] for i in written["step0"]] == pytest.approx([0.70711, -0.70711], abs=1e-5)
    # group train:1:t: only the resumed run's 1, 0, 0 -> mean 1/3, std sqrt(1/3): A = 1.1547, -0.57735 (twice)
    assert [result[i].advantages[0] for i in written["step1"]] == pytest.approx(
        [1.15470, -0.57735, -0.57735], abs=1e-5)
    with TraceStore(tmp_path / "run.db", readonly=True) as store:
        assert store.trained_episodes(step=1) == written["step1"]
        assert store.trained_episodes() == written["step0"] + written["step1"]


def test_rescore_can_pool_other_episodes(tmp_path):
    written = resumed_run(tmp_path / "run.db")
    ok = rescore(tmp_path / "run.db", reward, episodes="ok")
    assert set(ok) == set(written["step0"] + written["eval"] + written["step1_before_resume"] + written["step1"])
    everything = rescore(tmp_path / "run.db", reward, episodes="all")
    assert set(everything) == set(ok) | set(written["failed"])
    chosen = rescore(tmp_path / "run.db", reward, episodes=written["step1_before_resume"])
    assert [a.advantages[0] for a in chosen.values()] == pytest.approx([0.70711, -0.70711], abs=1e-5)
    assert list(rescore(tmp_path / "run.db", reward, step=0)) == written["step0"]
    with pytest.raises(ConfigError, match="choose one of trained, ok, all"):
        rescore(tmp_path / "run.db", reward, episodes="eval")
    with pytest.raises(ConfigError, match="nope"):
        rescore(tmp_path / "run.db", reward, episodes=["nope"])


def test_cli_rescore_says_what_it_pooled(tmp_path, capsys, monkeypatch):
    written = resumed_run(tmp_path / "run.db")
    (tmp_path / "my_reward.py").write_text("def reward(episode):\n    return float(episode.metadata['r'])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["traces", "rescore", str(tmp_path / "run.db"), "--reward", "my_reward:reward"]
    assert cli_main([*args, "--out", str(tmp_path / "new.db")]) == 0
    assert "rescored 5 episodes (pool: trained); mean reward: solver 0.4000" in capsys.readouterr().out
    with TraceStore(tmp_path / "new.db", readonly=True) as out:
        assert [s.id for s in out.episodes()] == written["step0"] + written["step1"]
    assert cli_main([*args, "--episodes", "ok"]) == 0
    assert "rescored 8 episodes (pool: ok)" in capsys.readouterr().out


def _drop_added_columns(path: Path) -> None:
    """Make the file look like a store written before `_serde.ADDED_COLUMNS` existed."""
    with sqlite3.connect(path) as conn:
        for table, column, _ in _serde.ADDED_COLUMNS:
            conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    conn.close()


def test_older_stores_read_new_columns_as_null_and_gain_them_when_written(tmp_path):
    path = tmp_path / "old.db"
    written = resumed_run(path)
    _drop_added_columns(path)
    with TraceStore(path, readonly=True) as old:
        assert old.load_episode(written["step1"][0]).metadata == {"r": 1.0}
        # no training times: superseded episodes cannot be told apart, so every trained one is listed
        assert old.trained_episodes(step=1) == written["step1_before_resume"] + written["step1"]
    with TraceStore(path) as store:  # opening to write migrates
        store.write_episode(_episode(0.0, "train:2:t"), step=2)
    with sqlite3.connect(path) as conn:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(episodes)")}
    conn.close()
    assert {c for t, c, _ in _serde.ADDED_COLUMNS if t == "episodes"} <= columns
    with TraceStore(path, readonly=True) as store:
        assert len(store.trained_episodes(step=2)) == 1 and len(store) == 10
