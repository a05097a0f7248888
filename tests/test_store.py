"""TraceStore: exact round trips, queries, training updates, export, durability, concurrency, errors."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pydantic
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from drmas_graph.errors import (
    ConfigError,
    CorruptStoreError,
    DrmasError,
    EpisodeNotFoundError,
    SchemaVersionError,
    StoreNotFoundError,
    TraceStoreError,
)
from drmas_graph.env import BadRewardError
from drmas_graph.train.loop.rescore import rescore
from drmas_graph.traces.store import SCHEMA_VERSION, TraceStore, TraceStoreWarning
from drmas_graph.types import Episode, SamplingParams, Turn

# Logprobs chosen to catch any lossy encoding: a float32 round trip changes all but -0.5 and -inf.
LOGPROBS = (-0.1, -1e-300, -0.0, math.nextafter(-1.0, 0.0), -2.220446049250313e-16, -0.5, -math.inf)


def make_turn(agent: str, index: int, *, n_prompt: int = 5, n_response: int = 3, **changes) -> Turn:
    fields = dict(
        agent=agent,
        node=f"{agent}_node",
        step=index + 1,
        index=index,
        messages=(SystemMessage(f"you are {agent}"), HumanMessage(f"question {index}")),
        prompt_ids=tuple(range(100 + index, 100 + index + n_prompt)),
        response_ids=tuple(range(200, 200 + n_response)),
        response_logprobs=tuple(-0.25 * (k + 1) for k in range(n_response)),
        response_text=f"answer of {agent} #{index}",
        policy="qwen",
        policy_version=3,
        call_key=f"{agent}_node",
        sampling=SamplingParams(temperature=0.7),
    )
    fields.update(changes)
    return Turn(**fields)


def make_episode(agents=("solver", "verifier"), **changes) -> Episode:
    turns = [make_turn(agent, i) for i, agent in enumerate(agents)]
    return Episode(**{"task_id": "t0", "group_id": "g0", "turns": turns, **changes})


def rich_episode() -> Episode:
    """Every Turn field set, tool calls, a tool message, a non-trainable call, odd logprobs."""
    tool_call = {
        "name": "search",
        "args": {"query": "capital of France", "k": 3},
        "id": "call_1",
        "type": "tool_call",
    }
    ai_with_call = AIMessage(content="", tool_calls=[tool_call], id="ai-1")
    tool_result = ToolMessage(content="Paris", tool_call_id="call_1", name="search")
    tools = ({"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},)
    turns = [
        make_turn(
            "solver",
            0,
            messages=(SystemMessage("sys"), HumanMessage("capital of France?")),
            prompt_ids=(151_643, 0, 2**31 - 1, 42),
            response_ids=tuple(range(300, 300 + len(LOGPROBS))),
            response_logprobs=LOGPROBS,
            response_text="",
            tool_calls=(tool_call,),
            finish_reason="tool_calls",
            latency_s=0.123456789,
            call_key="solver_node",
            node_call_index=0,
            sampling=SamplingParams(
                temperature=0.6,
                top_p=0.95,
                top_k=20,
                max_new_tokens=64,
                stop=("\n\n",),
                stop_token_ids=(7, 8),
                seed=1234,
            ),
            tools=tools,
        ),
        make_turn(
            "solver",
            1,
            node="outer/solver_node",
            messages=(HumanMessage("capital of France?"), ai_with_call, tool_result),
            call_key="outer/solver_node[1]",
            node_call_index=1,
            tools=tools,
        ),
        make_turn(
            "judge",
            2,
            prompt_ids=(),
            response_ids=(),
            response_logprobs=(),
            response_text="looks right",
            policy=None,
            policy_version=None,
            trainable=False,
            sampling=None,
        ),
    ]
    return Episode(
        task_id="france",
        group_id="g-france",
        turns=turns,
        final_state={"messages": [HumanMessage("capital of France?"), AIMessage("Paris")], "answer": "Paris"},
        rewards={"solver": 1.0, "judge": 0.25},
        turn_rewards=[1.0, 0.9, 0.25],
        advantages=[0.7071, -0.1, 0.0],
        timings={"start": 1700000000.125, "end": 1700000001.5, "wall_s": 1.375, "llm_s": 0.5},
        metadata={"input": {"question": "capital of France?"}, "thread_id": "th-1"},
        judgement={"mode": "agent", "model": "judge-model", "rubric_sha": "0123456789ab",
                   "prompt": [{"role": "user", "content": "Score the solver and the judge."}],
                   "replies": ['{"scores": {"solver": 1.0, "judge": 0.25}}'],
                   "scores": {"solver": 1.0, "judge": 0.25}, "reasons": {"solver": "Paris", "judge": "too lax"},
                   "attempts": 1, "input_tokens": 31, "output_tokens": 17, "cached": False, "seconds": 0.5,
                   "error": None},
    )


@pytest.fixture
def store(tmp_path: Path):
    with TraceStore(tmp_path / "run.sqlite", config={"model": "qwen", "lr": 1e-6}) as s:
        yield s


# -- round trip ------------------------------------------------------------------------------------


def test_round_trip_is_exact(store: TraceStore):
    episode = rich_episode()
    store.write_episode(episode, step=4)
    loaded = store.load_episode(episode.id)

    assert loaded.turns == episode.turns  # every Turn field, messages included
    for got, want in zip(loaded.turns, episode.turns, strict=True):
        assert [x.hex() for x in got.response_logprobs] == [x.hex() for x in want.response_logprobs]
        assert all(type(t) is int for t in got.prompt_ids + got.response_ids)
        assert got.messages == want.messages
        assert got.sampling == want.sampling
    assert math.copysign(1.0, loaded.turns[0].response_logprobs[2]) == -1.0  # -0.0 kept its sign
    assert isinstance(loaded.turns[1].messages[1], AIMessage)
    assert loaded.turns[1].messages[1].tool_calls[0]["args"] == {"query": "capital of France", "k": 3}
    assert isinstance(loaded.turns[1].messages[2], ToolMessage)
    assert loaded.turns[1].messages[2].tool_call_id == "call_1"
    assert loaded.turns[2].sampling is None and loaded.turns[2].trainable is False

    for field in (f.name for f in dataclasses.fields(Episode)):  # every field: a new one must be stored too
        assert getattr(loaded, field) == getattr(episode, field), field
    assert loaded.judgement["reasons"] == {"solver": "Paris", "judge": "too lax"}
    assert isinstance(loaded.final_state["messages"][1], AIMessage)
    assert store.summary(episode.id).step == 4


def test_untrained_episode_loads_without_rewards_and_failed_run_keeps_error(store: TraceStore):
    episode = make_episode(error="ValueError: boom", final_state=None)
    store.write_episode(episode)
    loaded = store.load_episode(episode.id)
    assert loaded.turn_rewards is None and loaded.advantages is None and loaded.rewards == {}
    assert loaded.error == "ValueError: boom" and loaded.final_state is None
    summary = store.summary(episode.id)
    assert summary.step is None and summary.reward is None
    assert (summary.n_turns, summary.n_prompt_tokens, summary.n_response_tokens) == (2, 10, 6)
    assert summary.agents == ("solver", "verifier")


def test_writing_the_same_episode_twice_is_refused(store: TraceStore):
    episode = make_episode()
    store.write_episode(episode)
    with pytest.raises(TraceStoreError, match=f"episode {episode.id} is already in"):
        store.write_episode(episode)
    assert len(store) == 1 and len(store.load_episode(episode.id).turns) == 2


def test_misaligned_advantages_are_refused_before_writing(store: TraceStore):
    episode = make_episode(advantages=[0.1])
    with pytest.raises(ConfigError, match="advantages has 1 values but the episode has 2 turns"):
        store.write_episode(episode)
    assert episode.id not in store


def test_config_is_stored_and_must_match(tmp_path: Path):
    path = tmp_path / "run.sqlite"
    TraceStore(path, config={"lr": 1e-6, "agents": ["a", "b"]}).close()
    with TraceStore(path, readonly=True) as s:
        assert s.config == {"lr": 1e-6, "agents": ["a", "b"]} and s.schema_version == SCHEMA_VERSION
    with TraceStore(path, config={"lr": 1e-6, "agents": ["a", "b"]}) as s:  # same config: appending is fine
        s.write_episode(make_episode())
    with pytest.raises(ConfigError, match="different config"):
        TraceStore(path, config={"lr": 2e-6})
    with TraceStore(path, readonly=True) as s, pytest.raises(TraceStoreError, match="read-only"):
        s.write_episode(make_episode())


# -- final_state serialization -----------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    steps: list[str]
    done: bool


class Verdict(pydantic.BaseModel):
    ok: bool
    score: float


class Handle:
    def __repr__(self) -> str:
        return "<Handle fd=3>"


def test_unserializable_state_is_stored_as_repr_with_a_warning_naming_the_key(store: TraceStore):
    state = {
        "messages": [HumanMessage("hi"), AIMessage("hello")],
        "plan": Plan(steps=["a", "b"], done=False),
        "verdict": Verdict(ok=True, score=0.5),
        "handle": Handle(),
        "pair": (1, 2),
    }
    episode = make_episode(final_state=state)
    with pytest.warns(TraceStoreWarning, match=r"final_state\['handle'\]: .*Handle has no JSON form"):
        store.write_episode(episode)
    loaded = store.load_episode(episode.id).final_state
    assert loaded["messages"] == state["messages"]
    assert loaded["plan"] == {"steps": ["a", "b"], "done": False}
    assert loaded["verdict"] == {"ok": True, "score": 0.5}
    assert loaded["handle"] == {"__unserializable__": f"{__name__}.Handle", "repr": "<Handle fd=3>"}
    assert loaded["pair"] == [1, 2]


def test_self_referencing_state_does_not_crash_the_run(store: TraceStore):
    state: dict = {"x": 1}
    state["self"] = state
    with pytest.warns(TraceStoreWarning, match=r"final_state\['self'\]: .*reference cycle"):
        store.write_episode(make_episode(final_state=state))


# -- queries -------------------------------------------------------------------------------------------


def _fill_for_queries(store: TraceStore) -> dict[str, Episode]:
    episodes = {
        "a": make_episode(task_id="t1", rewards={"solver": 1.0, "verifier": 1.0}),
        "b": make_episode(task_id="t1", rewards={"solver": 0.0, "verifier": 0.5}),
        "c": make_episode(agents=("solver",), task_id="t2", rewards={"solver": 0.5}),
        "d": make_episode(
            agents=("planner", "solver"), task_id="t2", rewards={"planner": 0.2, "solver": 0.8}
        ),
        "e": make_episode(agents=("solver",), task_id="t3", error="TimeoutError: slow"),
    }
    steps = {"a": 1, "b": 1, "c": 2, "d": None, "e": 2}
    for name, episode in episodes.items():
        store.write_episode(episode, step=steps[name])
    return episodes


def test_queries_by_step_agent_task_reward_and_failure(store: TraceStore):
    ep = _fill_for_queries(store)

    def ids(**filters) -> list[str]:
        return [s.id for s in store.episodes(**filters)]

    assert ids() == [ep[k].id for k in "abcde"]  # write order
    assert ids(step=1) == [ep["a"].id, ep["b"].id]
    assert ids(step=2) == [ep["c"].id, ep["e"].id]
    assert ids(agent="planner") == [ep["d"].id]
    assert ids(agent="verifier") == [ep["a"].id, ep["b"].id]
    assert ids(task_id="t2") == [ep["c"].id, ep["d"].id]
    # mean reward: a 1.0, b 0.25, c 0.5, d 0.5, e none (left out by reward bounds)
    assert ids(min_reward=0.5) == [ep["a"].id, ep["c"].id, ep["d"].id]
    assert ids(max_reward=0.25) == [ep["b"].id]
    # with an agent, bounds apply to that agent's own reward: solver a 1.0, b 0.0, c 0.5, d 0.8
    assert ids(agent="solver", min_reward=0.6) == [ep["a"].id, ep["d"].id]
    assert ids(agent="verifier", max_reward=0.5) == [ep["b"].id]
    assert ids(failed=True) == [ep["e"].id]
    assert ids(failed=False, step=2) == [ep["c"].id]
    assert ids(limit=2) == [ep["a"].id, ep["b"].id]
    assert store.summary(ep["b"].id).reward == 0.25
    assert len(store) == 5 and ep["c"].id in store and "nope" not in store


def test_update_training_records_step_rewards_and_advantages(store: TraceStore):
    episode = make_episode()
    store.write_episode(episode)
    store.update_training(
        episode.id,
        step=7,
        rewards={"solver": 1.0, "verifier": 0.0},
        turn_rewards=[1.0, 0.0],
        advantages=[0.5, -0.5],
    )
    loaded = store.load_episode(episode.id)
    assert loaded.rewards == {"solver": 1.0, "verifier": 0.0}
    assert loaded.turn_rewards == [1.0, 0.0] and loaded.advantages == [0.5, -0.5]
    assert [s.id for s in store.episodes(step=7, agent="verifier", max_reward=0.0)] == [episode.id]

    store.update_training(episode.id, step=None, advantages=[0.25, math.nan])  # rewards and step kept
    loaded = store.load_episode(episode.id)
    assert loaded.advantages[0] == 0.25 and math.isnan(loaded.advantages[1])
    assert loaded.turn_rewards == [1.0, 0.0] and store.summary(episode.id).step == 7

    with pytest.raises(ConfigError, match=f"episode {episode.id}: turn_rewards has 3 values"):
        store.update_training(episode.id, step=8, turn_rewards=[1.0, 1.0, 1.0])
    assert store.summary(episode.id).step == 7  # the failed update left nothing behind
    with pytest.raises(EpisodeNotFoundError, match="no episode 'missing'"):
        store.update_training("missing", step=1)


def test_record_training_takes_values_from_the_trainers_episodes(store: TraceStore):
    episodes = [make_episode(), make_episode()]
    for episode in episodes:
        store.write_episode(episode)
    for sign, episode in zip((1, -1), episodes, strict=True):
        episode.rewards = {"solver": float(sign > 0), "verifier": float(sign > 0)}
        episode.turn_rewards = [float(sign > 0)] * 2
        episode.advantages = [0.7 * sign, 0.7 * sign]
    store.record_training(3, episodes)
    assert [s.id for s in store.episodes(step=3, min_reward=1.0)] == [episodes[0].id]
    assert store.load_episode(episodes[1].id).advantages == [-0.7, -0.7]


def test_stats_counts_tokens_and_bytes(store: TraceStore):
    store.write_episode(rich_episode(), step=1)
    store.write_episode(make_episode(error="boom"), step=2)
    stats = store.stats()
    assert (stats.n_episodes, stats.n_failed, stats.n_turns, stats.n_trainable_turns) == (2, 1, 5, 4)
    n_prompt = 4 + 5 + 0 + 5 + 5
    n_response = 7 + 3 + 0 + 3 + 3
    assert (stats.n_prompt_tokens, stats.n_response_tokens) == (n_prompt, n_response)
    assert stats.token_bytes == 4 * n_prompt + (4 + 8) * n_response  # int32 ids, float64 logprobs
    assert stats.turns_by_agent == {"judge": 1, "solver": 3, "verifier": 1}
    assert stats.steps == (1, 2)
    assert stats.db_bytes > 0 and stats.bytes_per_1k_tokens == 1000 * stats.db_bytes / (n_prompt + n_response)


# -- export --------------------------------------------------------------------------------------------


def _expected_rows(episode: Episode, step: int | None) -> list[dict]:
    return [
        {
            "episode_id": episode.id,
            "task_id": episode.task_id,
            "group_id": episode.group_id,
            "train_step": step,
            "turn_index": i,
            "agent": turn.agent,
            "node": turn.node,
            "graph_step": turn.step,
            "prompt_ids": list(turn.prompt_ids),
            "response_ids": list(turn.response_ids),
            "response_logprobs": list(turn.response_logprobs),
            "response_text": turn.response_text,
            "finish_reason": turn.finish_reason,
            "policy": turn.policy,
            "policy_version": turn.policy_version,
            "trainable": turn.trainable,
            "reward": episode.rewards.get(turn.agent),
            "turn_reward": None if episode.turn_rewards is None else episode.turn_rewards[i],
            "advantage": None if episode.advantages is None else episode.advantages[i],
            "error": episode.error,
        }
        for i, turn in enumerate(episode.turns)
    ]


def test_export_jsonl_and_parquet_read_back_equal(store: TraceStore, tmp_path: Path):
    pq = pytest.importorskip("pyarrow.parquet")
    first, second = rich_episode(), make_episode(error="boom")
    store.write_episode(first, step=5)
    store.write_episode(second)
    expected = _expected_rows(first, 5) + _expected_rows(second, None)

    assert store.export(tmp_path / "all.jsonl") == 5
    lines = (tmp_path / "all.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == expected  # -inf logprob survives (json's -Infinity)

    assert store.export(tmp_path / "all.parquet", "parquet") == 5
    table = pq.read_table(tmp_path / "all.parquet")
    assert table.to_pylist() == expected
    assert str(table.schema.field("prompt_ids").type) == "list<element: int32>"
    assert str(table.schema.field("response_logprobs").type) == "list<element: double>"

    assert store.export(tmp_path / "solver.parquet", "parquet", agent="solver") == 3
    assert pq.read_table(tmp_path / "solver.parquet").to_pylist() == [
        r for r in expected if r["agent"] == "solver"
    ]
    assert store.export(tmp_path / "none.parquet", "parquet", agent="nobody") == 0
    assert pq.read_table(tmp_path / "none.parquet").num_rows == 0
    with pytest.raises(ConfigError, match="unknown export format 'csv'; valid formats: jsonl, parquet"):
        store.export(tmp_path / "x.csv", "csv")


# -- opening errors ------------------------------------------------------------------------------------


def test_missing_corrupt_and_foreign_files_raise_clear_errors(tmp_path: Path):
    missing = tmp_path / "missing.sqlite"
    with pytest.raises(StoreNotFoundError, match=f"no trace store at {missing}") as info:
        TraceStore(missing, readonly=True)
    assert isinstance(info.value, FileNotFoundError) and not missing.exists()

    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"this is not sqlite at all" * 100)
    for readonly in (True, False):
        with pytest.raises(CorruptStoreError, match=f"{corrupt} is not a readable trace store"):
            TraceStore(corrupt, readonly=readonly)

    foreign = tmp_path / "foreign.sqlite"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE users (name TEXT)")
    conn.close()
    with pytest.raises(CorruptStoreError, match="not a drmas-graph trace store .*tables users but no 'meta'"):
        TraceStore(foreign)


def test_missing_episode_names_the_id_and_the_file(store: TraceStore):
    with pytest.raises(EpisodeNotFoundError) as info:
        store.load_episode("abc123")
    assert str(info.value) == f"no episode 'abc123' in trace store {store.path}"
    assert isinstance(info.value, KeyError) and isinstance(info.value, DrmasError)


def _set_schema_version(path: Path, version: int) -> None:
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),))
    conn.close()


def test_newer_schema_asks_to_upgrade_and_older_schema_is_rejected(tmp_path: Path):
    path = tmp_path / "run.sqlite"
    with TraceStore(path) as s:
        s.write_episode(make_episode())
    _set_schema_version(path, 3)
    for readonly in (True, False):
        with pytest.raises(SchemaVersionError) as info:
            TraceStore(path, readonly=readonly)
        assert str(info.value) == (
            f"store {path} was written by schema version 3; "
            "this drmas-graph reads version 1; upgrade drmas-graph"
        )
    _set_schema_version(path, 0)
    with pytest.raises(SchemaVersionError, match="schema version 0, older than the version 1 .*no migration"):
        TraceStore(path)


# -- durability and concurrency -------------------------------------------------------------------------

_WRITER = textwrap.dedent(
    """
    import sys, threading
    from drmas_graph.traces.store import TraceStore
    from drmas_graph.types import Episode, Turn

    path, prefix, n_threads, n_per_thread = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

    def episode(name, k):
        turns = [
            Turn(agent=f"agent{i % 3}", node="n", step=i, index=i, messages=(), prompt_ids=tuple(range(400)),
                 response_ids=tuple(range(100)), response_logprobs=(-0.5,) * 100, response_text="x" * 500)
            for i in range(k)
        ]
        return Episode(id=name, task_id="t", group_id="g", turns=turns, metadata={"n_turns": k})

    store = TraceStore(path)

    def write(t):
        i = 0
        while n_per_thread < 0 or i < n_per_thread:  # n_per_thread < 0: write until killed
            store.write_episode(episode(f"{prefix}-{t}-{i}", 1 + (7 * i + t) % 13))
            i += 1

    threads = [threading.Thread(target=write, args=(t,)) for t in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.close()
    """
)


def _start_writer(tmp_path: Path, store_path: Path, prefix: str, n_threads: int, n_per_thread: int):
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    return subprocess.Popen(
        [sys.executable, str(script), str(store_path), prefix, str(n_threads), str(n_per_thread)],
        stderr=subprocess.PIPE,
    )


def _assert_every_episode_complete(path: Path) -> int:
    """Open the store after the writers are gone; every episode has all the turns its writer wrote."""
    with TraceStore(path) as s:
        conn = s._conn
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        summaries = s.episodes()
        for summary in summaries:
            episode = s.load_episode(summary.id)
            assert len(episode.turns) == summary.n_turns == episode.metadata["n_turns"], summary.id
            assert [t.index for t in episode.turns] == list(range(summary.n_turns))
        orphans = conn.execute("SELECT count(*) FROM turns WHERE episode_id NOT IN (SELECT id FROM episodes)")
        assert orphans.fetchone()[0] == 0
        return len(summaries)


def test_sigkill_mid_run_leaves_only_complete_episodes(tmp_path: Path):
    path = tmp_path / "run.sqlite"
    writer = _start_writer(tmp_path, path, "killed", n_threads=1, n_per_thread=-1)
    n_wanted, n_seen = 25, 0
    deadline = time.monotonic() + 60
    try:
        while n_seen < n_wanted:
            assert writer.poll() is None, writer.stderr.read().decode()
            assert time.monotonic() < deadline, f"writer wrote only {n_seen} episodes in 60 s"
            try:
                with TraceStore(path, readonly=True) as s:  # a reader next to the live writer
                    n_seen = len(s)
            except (StoreNotFoundError, CorruptStoreError):  # the writer has not created the layout yet
                pass
            time.sleep(0.02)
    finally:
        if writer.poll() is None:
            os.kill(writer.pid, signal.SIGKILL)
        writer.communicate()
    assert writer.returncode == -signal.SIGKILL
    assert _assert_every_episode_complete(path) >= n_wanted


@pytest.mark.slow  # two interpreters start, and importing drmas_graph takes seconds
def test_two_processes_with_threads_write_one_store_without_losing_episodes(tmp_path: Path):
    path = tmp_path / "run.sqlite"
    n_threads, n_per_thread = 3, 8
    writers = [_start_writer(tmp_path, path, f"proc{p}", n_threads, n_per_thread) for p in range(2)]
    for writer in writers:
        _, stderr = writer.communicate(timeout=120)
        assert writer.returncode == 0, stderr.decode()
    assert _assert_every_episode_complete(path) == 2 * n_threads * n_per_thread
    with TraceStore(path, readonly=True) as s:
        ids = {summary.id for summary in s.episodes()}
    assert ids == {
        f"proc{p}-{t}-{i}" for p in range(2) for t in range(n_threads) for i in range(n_per_thread)
    }


def test_threads_share_one_store(store: TraceStore):
    episodes = [make_episode(task_id=f"t{i}") for i in range(40)]
    errors: list[BaseException] = []

    def write(chunk: list[Episode]) -> None:
        try:
            for episode in chunk:
                store.write_episode(episode)
                store.episodes(task_id=episode.task_id)  # reads interleaved with other threads' writes
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(episodes[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert {s.id for s in store.episodes()} == {e.id for e in episodes}


# -- rescoring -------------------------------------------------------------------------------------------


def _advantages_module():
    try:
        import drmas_graph.train.optim.advantages as advantages
    except ImportError as e:
        pytest.skip(f"drmas_graph.train.optim.advantages is not available yet ({e}); rescore needs compute_advantages")
    return advantages


def test_rescore_recomputes_agent_wise_advantages_without_a_model(tmp_path: Path):
    _advantages_module()
    path = tmp_path / "run.sqlite"
    with TraceStore(path) as s:
        for i, correct in enumerate([True, False, True, True]):
            episode = make_episode(task_id="t", group_id="g", metadata={"correct": correct})
            episode.turns.append(make_turn("judge", 2, trainable=False, policy=None, prompt_ids=(),
                                           response_ids=(), response_logprobs=()))  # fmt: skip
            s.write_episode(episode, step=i // 2)

    def reward_fn(episode: Episode) -> dict[str, float]:
        solved = float(episode.metadata["correct"])
        return {"solver": solved, "verifier": 0.5, "judge": 1.0}

    result = rescore(path, reward_fn, estimator="agent", out=tmp_path / "rescored.sqlite")

    # solver pool (group g): rewards 1, 0, 1, 1 -> mu = 0.75, unbiased sigma = sqrt(0.75 / 3) = 0.5
    # -> A = (1 - 0.75) / 0.5 = 0.5 and (0 - 0.75) / 0.5 = -1.5 ; verifier pool: all 0.5 -> A = 0
    with TraceStore(path, readonly=True) as s:
        ids = [summary.id for summary in s.episodes()]
    solver_advantages = [result[i].advantages[0] for i in ids]
    assert solver_advantages == pytest.approx([0.5, -1.5, 0.5, 0.5], abs=1e-5)
    assert all(result[i].advantages[1:] == [0.0, 0.0] for i in ids)  # verifier: zero variance; judge: frozen
    assert result[ids[1]].turn_rewards == [0.0, 0.5, 1.0]
    assert result[ids[1]].rewards == {"solver": 0.0, "verifier": 0.5, "judge": 1.0}

    with TraceStore(tmp_path / "rescored.sqlite", readonly=True) as out:
        assert out.config["estimator"] == "agent" and out.config["rescored_from"] == str(path)
        assert [s.step for s in out.episodes()] == [0, 0, 1, 1]
        assert out.load_episode(ids[1]).advantages == result[ids[1]].advantages
    with TraceStore(path, readonly=True) as s:
        assert s.load_episode(ids[1]).advantages is None  # the source is not modified

    team = rescore(path, lambda e: float(e.metadata["correct"]), estimator="episode_global", step=0)
    assert set(team) == set(ids[:2])
    # episode_global over 2 episodes with rewards 1, 0: A = +-0.5 / sqrt(0.5) = +-0.7071
    assert team[ids[0]].advantages[:2] == pytest.approx([0.70710, 0.70710], abs=1e-4)
    assert team[ids[1]].advantages[:2] == pytest.approx([-0.70710, -0.70710], abs=1e-4)


def test_rescore_needs_a_reward_for_every_agent(tmp_path: Path):
    _advantages_module()
    path = tmp_path / "run.sqlite"
    with TraceStore(path) as s:
        episode = make_episode()
        s.write_episode(episode, step=0)
    # the one scoring rule (`_scoring.score_episodes`): the episode has no usable reward, so nothing is left
    with pytest.raises(BadRewardError, match=rf"none of the 1 pooled episodes got a usable reward; the first failure "
                                             rf"\(episode {episode.id}\): reward dict for task .* lacks agents \['verifier'\]"):
        rescore(path, lambda e: {"solver": 1.0})


# -- the query API: filters, sorts, keyset pages ---------------------------------------------------------------

from drmas_graph.traces.store import SORTS, EpisodeFilter  # noqa: E402


def query_store(tmp_path: Path) -> TraceStore:
    """24 episodes: phases train (steps 0-2) and eval, solver reward i % 5 / 4 (None for every 7th), checker 1,
    task t{i % 4}, group g{i // 4}; replies 'x = {i % 3}' (solver) and 'ok 100%_sure' (checker)."""
    store = TraceStore(tmp_path / "q.db")
    for i in range(24):
        phase = "eval" if i >= 18 else "train"
        turns = [make_turn("solver", 0, response_text=f"x = {i % 3}"),
                 make_turn("checker", 1, response_text="ok 100%_sure")]
        store.write_episode(Episode(id=f"e{i:02d}", task_id=f"t{i % 4}", group_id=f"g{i // 4}", turns=turns,
                                    metadata={"phase": phase, "step": i // 6, "group_index": i % 4}))
        if i % 7 != 0:
            store.update_training(f"e{i:02d}", step=None if phase == "eval" else i // 6,
                                  rewards={"solver": (i % 5) / 4, "checker": 1.0})
    return store


def walk(store: TraceStore, where: EpisodeFilter | None, sort: str, descending: bool, size: int) -> list[list[str]]:
    pages, after = [], None
    while True:
        page = store.query(where, sort=sort, descending=descending, limit=size, after=after)
        pages.append([s.id for s in page.rows])
        if page.next is None:
            return pages
        after = page.next


def expected_order(store: TraceStore, where: EpisodeFilter | None, sort: str, descending: bool) -> list[str]:
    rows = store.query(where, limit=None).rows  # the order written
    column = {"created": None, "step": "step", "reward": "reward", "turns": "n_turns", "tokens": "n_response_tokens",
              "task": "task_id", "group": "group_id"}[sort]
    agent = where.agent if where else None

    def value(s):
        if column is None:
            return None
        return s.rewards.get(agent) if sort == "reward" and agent else getattr(s, column)

    position = {s.id: i for i, s in enumerate(rows)}
    known = sorted((s for s in rows if value(s) is not None), key=lambda s: (value(s), position[s.id]),
                   reverse=descending)
    unknown = sorted((s for s in rows if value(s) is None), key=lambda s: position[s.id], reverse=descending)
    return [s.id for s in known + unknown] if column else [s.id for s in (rows[::-1] if descending else rows)]


@pytest.mark.parametrize("where", [None, EpisodeFilter(agent="solver"), EpisodeFilter(agent="solver", min_reward=0.25),
                                   EpisodeFilter(phase="train", max_reward=0.9)])
def test_keyset_pages_walk_the_whole_order_both_ways(tmp_path, where):
    with query_store(tmp_path) as store:
        for sort in SORTS:
            for descending in (False, True):
                want = expected_order(store, where, sort, descending)
                pages = walk(store, where, sort, descending, 5)
                assert [i for p in pages for i in p] == want, (sort, descending)
                assert all(len(p) == 5 for p in pages[:-1]) and store.count(where) == len(want)
                # and back: each page's previous is the page before it
                page = store.query(where, sort=sort, descending=descending, limit=5, after=None)
                for before in pages[1:]:
                    page = store.query(where, sort=sort, descending=descending, limit=5, after=page.next)
                    back = store.query(where, sort=sort, descending=descending, limit=5, before=page.previous)
                    assert [s.id for s in page.rows] == before
                    assert [s.id for s in back.rows] == pages[pages.index(before) - 1]


def test_ties_of_an_agents_reward_stay_in_the_order_written_when_rewards_are_rewritten(tmp_path):
    """Suspected in issue 48: sorted by an agent's reward, ties fall to the rewards rows' rowids (index order), and
    update_training deleted and re-inserted an episode's rows: rewriting e01's rewards (a rescore) moved it from
    first to last of its ties, from page 1 to page 2. Rewritten rows now keep their rowids."""
    with query_store(tmp_path) as store:
        where = EpisodeFilter(agent="checker")
        before = walk(store, where, "reward", False, 5)
        store.update_training("e01", step=None, rewards={"solver": 0.25, "checker": 1.0})
        assert walk(store, where, "reward", False, 5) == before and before[0][0] == "e01"
        store.update_training("e06", step=None, rewards={"solver": 0.25})  # the checker's reward goes: last
        assert store.load_episode("e06").rewards == {"solver": 0.25}
        assert [i for p in walk(store, where, "reward", False, 5) for i in p][-5:] == ["e00", "e06", "e07", "e14", "e21"]
        ties = [s.id for s in store.query(EpisodeFilter(agent="solver", min_reward=0.25, max_reward=0.25),
                                          sort="reward", limit=None).rows]
        assert ties == ["e01", "e06", "e11", "e16"]


def test_query_filters(tmp_path):
    with query_store(tmp_path) as store:
        def ids(**kw):
            return [s.id for s in store.query(EpisodeFilter(**kw), limit=None).rows]

        assert ids(phase="eval") == ["e18", "e19", "e20", "e21", "e22", "e23"]
        assert ids(group_id="g1") == ["e04", "e05", "e06", "e07"] and ids(group_id="g") == []  # exact
        assert ids(reply="x 2") == ["e02", "e05", "e08", "e11", "e14", "e17", "e20", "e23"]  # 'x = 2': words in order
        assert ids(reply="2 x") == []
        assert ids(reply="100%_sure", agent="checker") == ids()  # % and _ taken literally
        assert ids(reply="100%_sure", agent="solver") == [] and ids(reply="1000") == []
        assert ids(reply="_") == ids() and ids(reply="%sure") == []
        assert ids(agent="solver", min_reward=1.0) == ["e04", "e09", "e19"]  # (i % 5) / 4 == 1, e14 has none (14 % 7)
        assert ids(outcome="finished", step=1) == ["e06", "e08", "e09", "e10", "e11"]  # e07 has no step (no reward)
        assert store.count(EpisodeFilter(phase="train")) == 18
        assert store.count(EpisodeFilter(phase="train"), at_most=5) == 5  # counting stops there
        assert store.count(EpisodeFilter(phase="eval"), at_most=50) == 6


def test_query_refuses_what_sqlite_cannot_hold(tmp_path):
    with query_store(tmp_path) as store:
        with pytest.raises(ConfigError, match="step=99999999999999999999 is not an integer SQLite can hold"):
            store.query(EpisodeFilter(step=99999999999999999999))
        with pytest.raises(ConfigError, match="not a page cursor"):
            store.query(sort="reward", after="[1]")
        with pytest.raises(ConfigError, match="cursor=-99999999999999999999"):
            store.query(sort="reward", after="[0.5, -99999999999999999999]")
        with pytest.raises(ConfigError, match="unknown sort key 'id;drop'"):
            store.query(sort="id;drop")
        with pytest.raises(ConfigError, match="min_reward=nan"):
            EpisodeFilter(min_reward=math.nan)


def test_facets_replies_and_reply_counts(tmp_path):
    with query_store(tmp_path) as store:
        facets = store.facets()
        assert (facets.steps, facets.agents, facets.phases) == ((0, 1, 2), ("checker", "solver"), ("eval", "train"))
        assert store.last_replies(["e05", "missing"]) == {"e05": {"solver": "x = 2", "checker": "ok 100%_sure"},
                                                          "missing": {}}
        counts = {(c.reply, c.count, c.reward_sum, c.rewarded)
                  for c in store.reply_counts(phase="train", step=0, agent="solver")}
        # e00..e05: x = 0 (e00 no reward, e03 reward 3/4), x = 1 (e01 1/4, e04 1), x = 2 (e02 2/4, e05 0)
        assert counts == {("x = 0", 2, 0.75, 1), ("x = 1", 2, 1.25, 2), ("x = 2", 2, 0.5, 2)}
        assert {c.phase for c in store.reply_counts()} == {"train", "eval"}


def test_the_list_queries_use_indexes(tmp_path):
    """Sorting by reward (the agent's own with a filter) and the phase and group filters read an index, not the
    whole table: what keeps a deep page fast on a big store (benchmarks/bench_ui.py times them)."""
    from drmas_graph.traces import _queries

    with query_store(tmp_path) as store:
        conn = sqlite3.connect(store.path)
        cases = {  # (filter, sort) -> the index its first page reads
            (EpisodeFilter(), "reward"): "episodes_by_reward",
            (EpisodeFilter(phase="train"), "reward"): "episodes_by_reward",  # not the phase's index, then a sort
            (EpisodeFilter(agent="solver", min_reward=0.5), "reward"): "rewards_by_agent",
            (EpisodeFilter(phase="train"), "created"): "episodes_by_phase ",
            (EpisodeFilter(group_id="g1"), "created"): "episodes_by_group",
            (EpisodeFilter(phase="train"), "turns"): "episodes_by_turns",
            (EpisodeFilter(), "tokens"): "episodes_by_tokens",
            (EpisodeFilter(reply="x 1", agent="solver"), "created"): "COVERING INDEX turns_replies",
            # a step, task or group picks few episodes: read them by its index and sort them, not the whole order
            (EpisodeFilter(step=1, min_reward=0.5), "reward"): "episodes_by_step",
            (EpisodeFilter(task_id="t1", phase="train"), "turns"): "episodes_by_task",
            (EpisodeFilter(group_id="g1", agent="solver", min_reward=0.1), "reward"): "episodes_by_group",
        }
        selective = ("step", "task", "group")
        for (where, sort), index in cases.items():
            segment = _queries._segments(where, store._absent, sort)[0]
            sql, params = segment.sql("e.id", [0.5, 3] if sort != "created" else [3], True, 5)
            plan = " ".join(r[-1] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, params))
            sorts = where.reply or any(name in index for name in selective)  # these sort the few matches
            assert index in plan and ("TEMP B-TREE" not in plan or sorts), (where, sort, plan)
        conn.close()
