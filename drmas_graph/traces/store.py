"""The trace store: every episode of a run, every LLM call as exact token ids and logprobs, in one file.

One SQLite file per run, written while the run goes. Why SQLite:

- it is in the standard library: no server, no extra dependency, one file to copy or attach to a bug;
- WAL mode makes it crash-safe: a commit is appended to the write-ahead log, so a process killed with
  SIGKILL mid-episode leaves the file openable and holding every committed episode, and none half;
- transactions: one episode is one transaction, so an episode is either fully there or absent;
- readers never block the writer (and vice versa) under WAL, so ``drmas-graph traces list`` works on a
  live run, and several processes can append to the same file (SQLite serialises the writers; we wait
  on a busy file with ``busy_timeout`` and retry).

``synchronous=NORMAL``: in WAL mode this never corrupts the file and loses nothing when the *process*
dies (the log is in the OS page cache); only a power loss or OS crash can drop the last few commits.
``FULL`` would fsync every episode, a cost that buys nothing against the failure that matters here (a
killed trainer), so we do not pay it.

Layout (schema version 1; `SCHEMA_VERSION`): ``meta`` (key/value: schema_version, created, config),
``episodes`` (one row per episode, with counts and the mean reward for queries), ``rewards`` (one row
per episode and agent, for reward queries by agent) and ``turns`` (one row per LLM call; token ids as
int32 bytes, logprobs as float64 bytes, see `drmas_graph.traces._serde`). Nothing is ever pickled or evaluated.
Columns added since version 1 (`_serde.ADDED_COLUMNS`, all nullable) keep the version: opening an older
store to write adds them, opening it read-only reads them as NULL.

Every episode is stored whatever its outcome (`Episode.outcome`: finished, truncated, model error, failed).
`TraceStore.query` selects summaries by an `EpisodeFilter`, sorted, in keyset pages (what `drmas-graph ui` and
`drmas-graph traces list` show); `count`, `facets` and `reply_counts` answer the rest; the SQL lives in
`drmas_graph.traces._queries`, with the indexes it reads (`_queries.INDEXES`, added when a store is opened to
write).

Two "steps" appear: an episode's ``step`` is the *training* step it was used in (None until it is), a
turn's ``step`` is the LangGraph superstep of the node that made the call (`Turn.step`).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from drmas_graph.traces import _export, _queries, _serde
from drmas_graph.traces._queries import (
    OUTCOMES,
    SORTS,
    EpisodeFilter,
    EpisodePage,
    EpisodeSummary,
    Facets,
    ReplyCount,
    StoreStats,
)
from drmas_graph.traces._serde import TraceStoreWarning
from drmas_graph.errors import (
    ConfigError,
    CorruptStoreError,
    EpisodeNotFoundError,
    SchemaVersionError,
    StoreNotFoundError,
    TraceStoreError,
)
from drmas_graph.types import Episode

__all__ = [
    "OUTCOMES",
    "SCHEMA_VERSION",
    "SORTS",
    "EpisodeFilter",
    "EpisodePage",
    "EpisodeSummary",
    "Facets",
    "ReplyCount",
    "StoreStats",
    "TraceStore",
    "TraceStoreWarning",
]

SCHEMA_VERSION = 1
"""Version of the table layout this drmas-graph writes and reads."""

_BUSY_TIMEOUT_S = 30.0
"""How long one statement waits for another writer before SQLite reports the file busy."""
_WRITE_RETRIES = 5
"""Extra attempts (with backoff) after SQLITE_BUSY outlived the busy timeout or bypassed it."""

def _insert_sql(table: str, columns: Sequence[str]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


class TraceStore:
    """One run's traces in one SQLite file. Thread-safe; several processes may write the same file.

    ``TraceStore(path, config=...)`` creates the file (and its folder) if needed, or opens it to append;
    ``config`` (the run's configuration, JSON-able) is stored once and must match when given again.
    ``readonly=True`` opens an existing store for reading only (e.g. while another process writes it).
    """

    def __init__(self, path: str | Path, *, config: Mapping[str, Any] | None = None, readonly: bool = False):
        self.path = Path(path)
        """The SQLite file."""
        self.readonly = readonly
        """Opened for reading only."""
        self._lock = threading.RLock()  # one connection shared by the threads of this process
        self._conn: sqlite3.Connection | None = None
        if readonly and config is not None:
            raise ConfigError(f"TraceStore({str(self.path)!r}): a read-only store cannot take a config")
        if readonly and not self.path.is_file():
            raise StoreNotFoundError(f"no trace store at {self.path}")
        if self.path.is_dir():
            raise TraceStoreError(f"trace store path {self.path} is a directory; give a file name")
        if not readonly:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = self._connect()
            meta = self._open(config)
            self._absent = self._read(_serde.absent_columns)  # newer layouts' columns an old store lacks
        except BaseException:
            self.close()
            raise
        self.schema_version: int = int(meta["schema_version"])
        """Schema version the store was written with."""
        self.created: float = float(meta["created"])
        """Unix time the store was created."""
        self.config: dict[str, Any] = json.loads(meta["config"])
        """The run configuration given when the store was created ({} if none)."""

    # -- opening -----------------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        target, uri = (
            (self.path.resolve().as_uri() + "?mode=ro", True) if self.readonly else (str(self.path), False)
        )
        try:
            conn = sqlite3.connect(
                target, uri=uri, timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as e:
            raise TraceStoreError(f"cannot open trace store {self.path}: {e}") from e
        return conn

    def _open(self, config: Mapping[str, Any] | None) -> dict[str, str]:
        """Check (or create) the layout and return the meta table."""
        with self._errors("open"):
            if not self.readonly:
                self._retry_busy(lambda: self._conn.execute("PRAGMA journal_mode=WAL").fetchone())
                self._conn.execute("PRAGMA synchronous=NORMAL")
                return self._transaction(lambda conn: self._init_layout(conn, config))
            return self._read_meta(self._conn)

    def _read_meta(self, conn: sqlite3.Connection) -> dict[str, str]:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "meta" not in tables:
            what = f"it has tables {', '.join(sorted(tables))} but no 'meta'" if tables else "it is empty"
            raise CorruptStoreError(f"{self.path} is not a drmas-graph trace store ({what})")
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        version = int(meta.get("schema_version", 0))
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"store {self.path} was written by schema version {version}; this drmas-graph reads version "
                f"{SCHEMA_VERSION}; upgrade drmas-graph"
            )
        if version < SCHEMA_VERSION:
            raise SchemaVersionError(
                f"store {self.path} has schema version {version}, older than the version {SCHEMA_VERSION} "
                "this drmas-graph reads, and there is no migration from it; open it with the drmas-graph "
                "release that wrote it"
            )
        return meta

    def _init_layout(self, conn: sqlite3.Connection, config: Mapping[str, Any] | None) -> dict[str, str]:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            statement = ""
            for line in _serde.SCHEMA.splitlines(keepends=True):  # not executescript: it would COMMIT
                statement += line
                if sqlite3.complete_statement(statement):
                    conn.execute(statement)
                    statement = ""
            conn.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?)",
                [
                    ("schema_version", str(SCHEMA_VERSION)),
                    ("created", repr(time.time())),
                    ("config", _serde.to_json(dict(config or {}), "config")),
                ],
            )
        meta = self._read_meta(conn)
        _serde.add_absent_columns(conn)  # a store written before a column was added gains it (NULL)
        for statement in _queries.INDEXES:  # and the query indexes it lacks
            conn.execute(statement)
        given = None if config is None else json.loads(_serde.to_json(dict(config), "config"))
        if given is not None and given != json.loads(meta["config"]):
            raise ConfigError(
                f"trace store {self.path} already holds a run with a different config; open it without "
                "config=... to append to that run, or write this run to a new file"
            )
        return meta

    # -- plumbing ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        """Turn sqlite3 errors into TraceStoreError/CorruptStoreError naming the file."""
        try:
            yield
        except sqlite3.OperationalError as e:
            raise TraceStoreError(f"cannot {doing} trace store {self.path}: {e}") from e
        except sqlite3.DatabaseError as e:  # "file is not a database", "database disk image is malformed"
            raise CorruptStoreError(f"{self.path} is not a readable trace store ({e})") from e

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise TraceStoreError(f"trace store {self.path} is closed")
        return self._conn

    def _retry_busy(self, fn: Callable[[], Any]) -> Any:
        for attempt in range(_WRITE_RETRIES + 1):
            try:
                return fn()
            except sqlite3.OperationalError as e:
                busy = "locked" in str(e) or "busy" in str(e)
                if not busy or attempt == _WRITE_RETRIES:
                    raise
                time.sleep(0.05 * 2**attempt)

    def _transaction(self, body: Callable[[sqlite3.Connection], Any]) -> Any:
        """Run `body` in one write transaction (BEGIN IMMEDIATE: take the write lock up front, so a busy
        file is waited on, not failed mid-way), retrying when another writer holds the file."""
        if self.readonly:
            raise TraceStoreError(f"trace store {self.path} is open read-only")

        def attempt() -> Any:
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = body(conn)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            return result

        with self._lock:
            return self._retry_busy(attempt)

    def _read(self, body: Callable[[sqlite3.Connection], Any]) -> Any:
        with self._lock, self._errors("read"):
            return body(self._connection())

    # -- writing -----------------------------------------------------------------------------------

    def write_episode(self, episode: Episode, *, step: int | None = None) -> None:
        """Store one episode, all or nothing. ``step``: the training step it is used in, if known.

        Values of ``final_state`` (or metadata) with no JSON form are stored as their repr with a
        `TraceStoreWarning` naming the key. Writing an id that is already stored raises TraceStoreError.
        """
        episode_row, turn_rows, reward_rows = _serde.episode_rows(episode, step)  # encode outside the lock

        def insert(conn: sqlite3.Connection) -> None:
            try:
                conn.execute(_insert_sql("episodes", _serde.EPISODE_COLUMNS), episode_row)
            except sqlite3.IntegrityError as e:
                raise TraceStoreError(
                    f"episode {episode.id} is already in {self.path}; an episode is written once "
                    "(use update_training to add rewards and advantages)"
                ) from e
            conn.executemany(_insert_sql("turns", _serde.TURN_COLUMNS), turn_rows)
            conn.executemany("INSERT INTO rewards (episode_id, agent, reward) VALUES (?, ?, ?)", reward_rows)

        with self._errors("write to"):
            self._transaction(insert)

    def update_training(
        self,
        episode_id: str,
        *,
        step: int | None,
        rewards: Mapping[str, float] | None = None,
        turn_rewards: Sequence[float] | None = None,
        advantages: Sequence[float] | None = None,
        judgement: Mapping[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        """Record what training made of a stored episode: its training step, its rewards per agent, per-turn
        rewards and advantages (aligned with its turns), the judge's record when a judge gave the rewards
        (`Episode.judgement`; episodes are written when their run ends, before they are judged), and the error of
        an episode left out for its reward (a bad reward, a judge failure: `traces list --failed` finds it).
        Arguments left None keep their value."""
        judgement_json = _serde.judgement_to_json(judgement)  # encode outside the lock

        def body(conn: sqlite3.Connection) -> None:
            self._update(conn, episode_id, step, rewards, turn_rewards, advantages, judgement_json)
            if error is not None:
                conn.execute("UPDATE episodes SET error = ? WHERE id = ?", (error, episode_id))

        with self._errors("write to"):
            self._transaction(body)

    def record_training(self, step: int | None, episodes: Iterable[Episode]) -> None:
        """`update_training` for many stored episodes at once (one transaction), taking ``rewards``,
        ``turn_rewards``, ``advantages`` and ``judgement`` (when set) from each episode as scored; ``step`` None
        keeps each episode's stored step (scores of an evaluation or a check)."""
        updates = [(ep.id, ep.rewards, ep.turn_rewards, ep.advantages, _serde.judgement_to_json(ep.judgement))
                   for ep in episodes]

        def body(conn: sqlite3.Connection) -> None:
            for episode_id, *values in updates:
                self._update(conn, episode_id, step, *values)

        with self._errors("write to"):
            self._transaction(body)

    def _update(
        self,
        conn: sqlite3.Connection,
        episode_id: str,
        step: int | None,
        rewards: Mapping[str, float] | None,
        turn_rewards: Sequence[float] | None,
        advantages: Sequence[float] | None,
        judgement_json: str | None,
    ) -> None:
        row = conn.execute("SELECT n_turns FROM episodes WHERE id = ?", (episode_id,)).fetchone()
        if row is None:
            raise EpisodeNotFoundError(f"no episode {episode_id!r} in trace store {self.path}")
        n_turns = row[0]
        if step is not None:
            conn.execute("UPDATE episodes SET step = ?, trained = ? WHERE id = ?", (step, time.time(), episode_id))
        if judgement_json is not None:
            conn.execute("UPDATE episodes SET judgement = ? WHERE id = ?", (judgement_json, episode_id))
        if rewards is not None:
            conn.execute(
                "UPDATE episodes SET rewards = ?, reward = ? WHERE id = ?",
                (_serde.to_json(dict(rewards), "rewards"), _serde.mean(rewards.values()), episode_id),
            )
            # rows kept where the agent keeps a reward (their rowids order the ties of `query` by that reward)
            conn.execute(f"DELETE FROM rewards WHERE episode_id = ? AND agent NOT IN ({','.join('?' * len(rewards))})",
                         (episode_id, *rewards))
            conn.executemany(
                "INSERT INTO rewards (episode_id, agent, reward) VALUES (?, ?, ?) "
                "ON CONFLICT (episode_id, agent) DO UPDATE SET reward = excluded.reward",
                [(episode_id, agent, float(r)) for agent, r in rewards.items()],
            )
        for name, column, values in (
            ("turn_rewards", "turn_reward", turn_rewards),
            ("advantages", "advantage", advantages),
        ):
            if values is None:
                continue
            _serde.check_aligned(name, values, n_turns, episode_id)
            conn.executemany(
                f"UPDATE turns SET {column} = ? WHERE episode_id = ? AND position = ?",
                [(float(v), episode_id, i) for i, v in enumerate(values)],
            )

    # -- reading -----------------------------------------------------------------------------------

    def episodes(
        self,
        *,
        step: int | None = None,
        agent: str | None = None,
        task_id: str | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        failed: bool | None = None,
        outcome: str | None = None,
        limit: int | None = None,
        group_prefix: str | None = None,
        group_id: str | None = None,
    ) -> list[EpisodeSummary]:
        """Summaries of the stored episodes, in the order they were written, filtered as `EpisodeFilter`'s
        fields of the same names say (`query` adds the other filters, sorting and pages)."""
        selected = EpisodeFilter(step=step, agent=agent, task_id=task_id, min_reward=min_reward,
                                 max_reward=max_reward, failed=failed, outcome=outcome, group_prefix=group_prefix,
                                 group_id=group_id)
        return self.query(selected, limit=limit).rows

    def query(self, where: EpisodeFilter | None = None, *, sort: str = "created", descending: bool = False,
              limit: int | None = 50, after: str | None = None, before: str | None = None) -> EpisodePage:
        """One page of the episodes `where` selects (all of them without a filter), sorted by `sort` (a key of
        `SORTS`: created (the order written), step, reward (the filter's agent's own reward when it names
        one), turns, tokens, task, group; episodes without the value come last, then ties by the order
        written; of an agent's reward, by the order its rewards were first recorded), at most `limit` (None: every one). Pages are keyset pages, as fast deep as at the start:
        ``after=page.next`` is the next page, ``before=page.previous`` the one before.

            page = store.query(EpisodeFilter(agent="solver", min_reward=0.5), sort="reward", descending=True)
            more = store.query(EpisodeFilter(agent="solver", min_reward=0.5), sort="reward", descending=True,
                               after=page.next)
        """
        selected = where or EpisodeFilter()
        return self._read(lambda conn: _queries.query_page(conn, self._absent, selected, sort=sort,
                                                           descending=descending, limit=limit, after=after,
                                                           before=before))

    def count(self, where: EpisodeFilter | None = None, *, at_most: int | None = None) -> int:
        """How many episodes `where` selects (all without a filter); with `at_most`, counting stops there (what a
        page shows as "N+" when a filter matches many episodes on a big store)."""
        sql, params = _queries.count_sql(self._absent, where or EpisodeFilter(), at_most)
        return self._read(lambda conn: conn.execute(sql, params).fetchone()[0])

    def facets(self) -> Facets:
        """The steps, agents and phases the stored episodes have (for filter menus)."""
        return self._read(_queries.read_facets)

    def last_replies(self, episode_ids: Sequence[str]) -> dict[str, dict[str, str]]:
        """{episode id: {agent: the text of the agent's last call}} of the episodes given."""
        return self._read(lambda conn: _queries.last_replies(conn, episode_ids))

    def reply_counts(self, *, phase: str | None = None, step: int | None = None, agent: str | None = None,
                     rewards: bool = True) -> list[ReplyCount]:
        """How often each agent gave each reply (exact text), per phase and rollout step, with the agent's reward
        summed over them (`rewards=False`: not read, faster): what the answers view and a collapse check read.
        Arguments given filter (a step with its phase)."""
        return self._read(lambda conn: _queries.reply_counts(conn, phase, step, agent, rewards))

    def trained_episodes(self, *, step: int | None = None) -> list[str]:
        """Ids of the episodes the run's training used, in the order written: those with a training step
        and no error, less the ones a resume superseded. An episode is superseded when a rollout for its
        step or an earlier one was made after training recorded it: the run went back to a checkpoint
        and trained that step again. Eval, failed and never-trained episodes have no step. Stores
        written before training times were recorded cannot tell superseded episodes apart."""
        sql = "SELECT id, step, created, trained FROM episodes WHERE step IS NOT NULL AND error IS NULL"
        if "trained" in {c for _, c in self._absent}:
            sql = sql.replace("trained FROM", "NULL FROM")
        rows = self._read(lambda conn: conn.execute(sql + " ORDER BY rowid").fetchall())
        latest_rollout: dict[int, float] = {}  # step -> latest `created` among steps <= it
        running = float("-inf")
        for s, created in sorted((r[1], r[2]) for r in rows):
            running = max(running, created)
            latest_rollout[s] = running
        return [i for i, s, _, trained in rows
                if (step is None or s == step) and (trained is None or latest_rollout[s] <= trained)]

    def __len__(self) -> int:
        return self._read(lambda conn: conn.execute("SELECT count(*) FROM episodes").fetchone()[0])

    def __contains__(self, episode_id: object) -> bool:
        sql = "SELECT 1 FROM episodes WHERE id = ?"
        return self._read(lambda conn: conn.execute(sql, (episode_id,)).fetchone()) is not None

    def summary(self, episode_id: str) -> EpisodeSummary:
        """The summary of one episode (its training step, counts, rewards)."""
        sql = f"SELECT {_queries.summary_select(self._absent)} FROM episodes e WHERE id = ?"
        row = self._read(lambda conn: conn.execute(sql, (episode_id,)).fetchone())
        if row is None:
            raise EpisodeNotFoundError(f"no episode {episode_id!r} in trace store {self.path}")
        return _queries.summary_from_row(row)

    def load_episode(self, episode_id: str) -> Episode:
        """The whole episode, exactly as written (tuples in final_state/metadata come back as lists)."""

        def read(conn: sqlite3.Connection) -> tuple[Any, list[Any]]:
            episode_row = conn.execute(
                f"SELECT {_serde.select_list('episodes', _serde.EPISODE_COLUMNS, self._absent)} FROM episodes "
                "WHERE id = ?", (episode_id,)
            ).fetchone()
            turn_rows = conn.execute(
                f"SELECT {_serde.select_list('turns', _serde.TURN_COLUMNS, self._absent)} FROM turns "
                "WHERE episode_id = ? ORDER BY position",
                (episode_id,),
            ).fetchall()
            return episode_row, turn_rows

        episode_row, turn_rows = self._read(read)
        if episode_row is None:
            raise EpisodeNotFoundError(f"no episode {episode_id!r} in trace store {self.path}")
        return _serde.episode_from_rows(
            dict(zip(_serde.EPISODE_COLUMNS, episode_row, strict=True)), turn_rows
        )

    def iter_episodes(self, **filters: Any) -> Iterator[Episode]:
        """Load the episodes `episodes(**filters)` selects, one at a time."""
        for summary in self.episodes(**filters):
            yield self.load_episode(summary.id)

    def stats(self) -> StoreStats:
        """Counts, tokens and bytes over the whole store."""
        return self._read(lambda conn: _queries.read_stats(conn, self._absent))

    def export(
        self,
        path: str | Path,
        format: str = "jsonl",
        *,
        agent: str | None = None,
        step: int | None = None,
    ) -> int:
        """Write per-agent trajectories, one row per LLM call, to ``path`` as ``jsonl`` or ``parquet``;
        returns the number of rows. Columns: `drmas_graph.traces._export.EXPORT_COLUMNS`. ``reward`` is
        the agent's episode reward; ``turn_reward`` and ``advantage`` are what training stored."""
        if format not in _export.EXPORT_WRITERS:
            valid = ", ".join(_export.EXPORT_WRITERS)
            raise ConfigError(f"unknown export format {format!r}; valid formats: {valid}")
        where, params = _queries.conditions(("t.agent = ?", agent), ("e.step = ?", step))
        sql = _export.EXPORT_SELECT + (" WHERE " + " AND ".join(where) if where else "") + _export.EXPORT_ORDER
        with self._lock, self._errors("export"):
            cursor = self._connection().execute(sql, params)
            return _export.EXPORT_WRITERS[format](Path(path), _export.export_rows(cursor))

    # -- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the file (idempotent). The store cannot be used afterwards."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "readonly" if self.readonly else "read-write"
        return f"TraceStore({str(self.path)!r}, {mode}, {'closed' if self._conn is None else 'open'})"
