"""What the trace store answers without loading whole episodes: episode summaries (and the SQL that filters
them) and store-wide counts. `drmas_graph.traces.store.TraceStore` runs these queries under its lock."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from drmas_graph.errors import ConfigError

__all__ = ["EpisodeSummary", "StoreStats", "EpisodeFilter", "EpisodePage", "SUMMARY_COLUMNS", "OUTCOMES", "SORTS",
           "INDEXES", "ReplyCount", "Facets", "summary_from_row", "summary_select", "conditions", "query_page", "count_sql", "reply_counts",
           "last_replies", "read_facets", "read_stats"]

SUMMARY_COLUMNS = (
    "id", "task_id", "group_id", "step", "n_turns", "agents", "n_prompt_tokens", "n_response_tokens",
    "reward", "rewards", "error", "created", "truncated", "model_error",
)  # fmt: skip

OUTCOMES = {
    "finished": "e.error IS NULL AND e.truncated IS NULL AND e.model_error IS NULL",
    "truncated": "e.error IS NULL AND e.truncated IS NOT NULL",
    "model_error": "e.error IS NULL AND e.truncated IS NULL AND e.model_error IS NOT NULL",
    "failed": "e.error IS NOT NULL",
    "interrupted": "e.error LIKE 'EpisodeInterruptedError:%'",
}
"""`Episode.outcome` (and 'interrupted': a failure at an interrupt nobody answered) -> the SQL condition on an
episodes row `e`."""


@dataclass(frozen=True)
class EpisodeSummary:
    """One light row of `TraceStore.episodes`: counts and rewards, no turns."""

    id: str
    """Episode id."""
    task_id: str | None
    """Task the episode ran on."""
    group_id: str | None
    """GRPO group of the episode."""
    step: int | None
    """Training step the episode was used in; None if it was not (yet)."""
    n_turns: int
    """Number of LLM calls."""
    agents: tuple[str, ...]
    """Agents that made calls, in order of first call."""
    n_prompt_tokens: int
    """Prompt tokens summed over the calls."""
    n_response_tokens: int
    """Response tokens summed over the calls."""
    reward: float | None
    """Mean of `rewards` over agents (the team reward when every agent got it); None without rewards."""
    rewards: dict[str, float]
    """Reward per agent."""
    error: str | None
    """The failure, if the run failed."""
    created: float
    """Unix time the episode was written."""
    truncated: str | None = None
    """'<limit>: <why>' when a limit stopped the run (`Episode.truncated`)."""
    model_error: str | None = None
    """The policy's output that broke the app (`Episode.model_error`)."""

    @property
    def outcome(self) -> str:
        """'finished', 'truncated', 'model_error' or 'failed' (as `Episode.outcome`)."""
        if self.error is not None:
            return "failed"
        return "truncated" if self.truncated else "model_error" if self.model_error else "finished"


@dataclass(frozen=True)
class StoreStats:
    """Counts and sizes over a whole store (`TraceStore.stats`)."""

    n_episodes: int
    """Episodes stored."""
    n_failed: int
    """Episodes whose run failed (error set)."""
    n_turns: int
    """LLM calls stored."""
    n_trainable_turns: int
    """Calls served by a policy (with token ids and logprobs)."""
    n_prompt_tokens: int
    """Prompt tokens over all calls."""
    n_response_tokens: int
    """Response tokens over all calls."""
    turns_by_agent: dict[str, int]
    """Number of calls per agent."""
    steps: tuple[int, ...]
    """Training steps that have episodes, ascending."""
    db_bytes: int
    """Bytes of database pages in use (the file once checkpointed, without free pages)."""
    token_bytes: int
    """Bytes of the token id and logprob arrays alone."""
    n_truncated: int = 0
    """Episodes a limit stopped (kept for training)."""
    n_model_errors: int = 0
    """Episodes the policy's output broke (kept for training)."""

    @property
    def n_tokens(self) -> int:
        return self.n_prompt_tokens + self.n_response_tokens

    @property
    def bytes_per_1k_tokens(self) -> float:
        """Whole store (messages, text and metadata included) per 1,000 prompt + response tokens."""
        return 1000 * self.db_bytes / self.n_tokens if self.n_tokens else 0.0

    @property
    def token_bytes_per_1k_tokens(self) -> float:
        """Token arrays alone per 1,000 tokens: 4 bytes per prompt token, 12 per response token."""
        return 1000 * self.token_bytes / self.n_tokens if self.n_tokens else 0.0


def summary_from_row(row: Sequence[Any]) -> EpisodeSummary:
    """An `EpisodeSummary` from a row of `SUMMARY_COLUMNS`."""
    values = dict(zip(SUMMARY_COLUMNS, row, strict=True))
    values["agents"] = tuple(json.loads(values["agents"]))
    values["rewards"] = json.loads(values["rewards"])
    return EpisodeSummary(**values)


def summary_select(absent: set[tuple[str, str]], alias: str = "e") -> str:
    """The SELECT list of `SUMMARY_COLUMNS` (NULL for columns an older store lacks)."""
    return ", ".join(f"NULL AS {c}" if ("episodes", c) in absent else f"{alias}.{c}" for c in SUMMARY_COLUMNS)


def conditions(*pairs: tuple[str, Any]) -> tuple[list[str], list[Any]]:
    """(SQL conditions, their parameters) of the (condition with one '?', value) pairs whose value is set."""
    chosen = [(sql, value) for sql, value in pairs if value is not None]
    return [sql for sql, _ in chosen], [value for _, value in chosen]


# -- the episode query: filters, sort, keyset pages -------------------------------------------------------

MAX_INT = 2**63 - 1
"""The largest integer SQLite stores (a step or cursor beyond it is refused, not an OverflowError)."""

SORTS = {"created": "e.rowid", "step": "e.step", "reward": "e.reward", "turns": "e.n_turns",
         "tokens": "e.n_response_tokens", "task": "e.task_id", "group": "e.group_id"}
"""`TraceStore.query` sort keys -> the episodes column they sort by ('reward' with an agent: its own reward)."""

PHASE_SQL = "json_extract(e.metadata, '$.phase')"
"""An episode's phase ('train', 'eval'; the trainer's `Episode.metadata['phase']`)."""

INDEXES = (
    "CREATE INDEX IF NOT EXISTS episodes_by_reward ON episodes (reward)",
    "CREATE INDEX IF NOT EXISTS episodes_by_group ON episodes (group_id)",
    "CREATE INDEX IF NOT EXISTS episodes_by_phase ON episodes (json_extract(metadata, '$.phase'))",  # rowid order
    "CREATE INDEX IF NOT EXISTS episodes_by_phase_step ON episodes (json_extract(metadata, '$.phase'), "
    "json_extract(metadata, '$.step'))",
    "CREATE INDEX IF NOT EXISTS rewards_by_agent ON rewards (agent, reward)",
    "CREATE INDEX IF NOT EXISTS episodes_by_turns ON episodes (n_turns)",
    "CREATE INDEX IF NOT EXISTS episodes_by_tokens ON episodes (n_response_tokens)",
    "CREATE INDEX IF NOT EXISTS turns_replies ON turns (agent, response_text, episode_id)",
)
"""Indexes the queries use beyond the layout's own; a store opened to write gains those it lacks (a store
opened read-only is queried without them: the same answers, slower on big stores)."""


def _check_int(name: str, value: Any) -> None:
    if value is not None and not (isinstance(value, int) and -MAX_INT <= value <= MAX_INT):
        raise ConfigError(f"{name}={value!r} is not an integer SQLite can hold (at most {MAX_INT} in size)")


def _check_number(name: str, value: Any) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
        raise ConfigError(f"{name}={value!r} is not a finite number")


@dataclass(frozen=True)
class EpisodeFilter:
    """Which episodes `TraceStore.query` and `TraceStore.count` select; every field None selects all."""

    step: int | None = None
    """Training step the episode was used in."""
    phase: str | None = None
    """'train' or 'eval': the trainer's `Episode.metadata['phase']` (episodes of other rollouts have none)."""
    agent: str | None = None
    """Episodes where this agent made a call; the reward bounds, the reward sort and `reply` then apply to it."""
    task_id: str | None = None
    """This task id."""
    group_id: str | None = None
    """This GRPO group (exactly)."""
    group_prefix: str | None = None
    """Groups whose id starts with it (e.g. 'train:3:', the groups the trainer rolled out in step 3)."""
    outcome: str | None = None
    """One of `OUTCOMES` ('interrupted': failed at an interrupt nobody answered)."""
    failed: bool | None = None
    """True: only failed runs; False: only the others."""
    min_reward: float | None = None
    """Lowest reward, inclusive (the agent's own with `agent`, else the mean); episodes without one are left out."""
    max_reward: float | None = None
    """Highest reward, inclusive (as `min_reward`)."""
    reply: str | None = None
    """Text in a reply (of `agent`, else of any call): its words, in order, case-insensitive for ASCII letters."""

    def __post_init__(self) -> None:
        _check_int("step", self.step)
        _check_number("min_reward", self.min_reward)
        _check_number("max_reward", self.max_reward)
        if self.outcome is not None and self.outcome not in OUTCOMES:
            raise ConfigError(f"unknown episode outcome {self.outcome!r}; valid: {', '.join(OUTCOMES)}")

    def sql(self, absent: set[tuple[str, str]], reward: str, *, sorted_by_index: bool = False
            ) -> tuple[list[str], list[Any]]:
        """(conditions on the episodes row `e`, their parameters); `reward` is the SQL of the reward the bounds
        apply to (with its own parameters: the agent's name when it is a subquery). `sorted_by_index`: another
        index serves the page (the order's, or a step's, task's or group's), so the phase, true of most
        episodes, is checked per row rather than read from its index."""
        agent_turn = "EXISTS (SELECT 1 FROM turns t WHERE t.agent = ? AND t.episode_id = e.id)"
        phase = f"+{PHASE_SQL} = ?" if sorted_by_index else f"{PHASE_SQL} = ?"  # '+': not from the index
        where, params = conditions(("e.step = ?", self.step), ("e.task_id = ?", self.task_id),
                                   ("e.group_id = ?", self.group_id), (phase, self.phase),
                                   (agent_turn, self.agent))
        if self.group_prefix is not None:
            where.append("substr(e.group_id, 1, ?) = ?")
            params.extend([len(self.group_prefix), self.group_prefix])
        if self.failed is not None:
            where.append("e.error IS NOT NULL" if self.failed else "e.error IS NULL")
        if self.outcome is not None:
            where.append(f"({_outcome_sql(self.outcome, absent)})")
        for bound, op in ((self.min_reward, ">="), (self.max_reward, "<=")):
            if bound is not None:
                where.append(f"{reward} {op} ?")
                params.extend([self.agent, bound] if "?" in reward else [bound])
        if self.reply:  # read from the turns_replies index (agent, text, episode), not from the turns
            by_agent = "t.agent = ? AND " if self.agent is not None else ""
            where.append(f"e.id IN (SELECT t.episode_id FROM turns t WHERE {by_agent}"
                         "t.response_text LIKE ? ESCAPE '\\')")
            params.extend([self.agent, like_words(self.reply)] if by_agent else [like_words(self.reply)])
        return where, params


def like_words(text: str) -> str:
    """A LIKE pattern matching text that holds the words of `text` in order ('%' and '_' taken literally)."""
    words = [w.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") for w in text.split()]
    return "%" + "%".join(words) + "%"


def _outcome_sql(outcome: str, absent: set[tuple[str, str]]) -> str:
    if ("episodes", "truncated") in absent:  # a store older than truncation: every episode finished or failed
        return {"finished": "e.error IS NULL", "failed": "e.error IS NOT NULL",
                "interrupted": OUTCOMES["interrupted"]}.get(outcome, "0")
    return OUTCOMES[outcome]


@dataclass(frozen=True)
class EpisodePage:
    """One page of `TraceStore.query`: its rows and the cursors of its neighbours (keyset pagination)."""

    rows: list[EpisodeSummary]
    """The page's episodes, in the order asked for."""
    next: str | None
    """Pass as ``after=`` for the next page; None on the last page."""
    previous: str | None
    """Pass as ``before=`` for the previous page; None on the first page."""


def _reward_sql(agent: str | None, joined: bool) -> str:
    if agent is None:
        return "e.reward"
    return "r.reward" if joined else "(SELECT r.reward FROM rewards r WHERE r.episode_id = e.id AND r.agent = ?)"


@dataclass(frozen=True)
class _Segment:
    """A part of the order: the episodes whose sort value is set (by value, then rowid), or those without one
    (by rowid). Nulls come last in either direction."""

    nulls: bool
    key: str  # SQL of the sort value ('e.rowid' for the 'created' order)
    tie: str  # SQL of the tie-break: the rowid of the row the order's index points to
    source: str  # FROM ...
    source_params: list[Any]
    where: list[str]
    params: list[Any]

    def sql(self, select: str, cursor: list[Any] | None, descending: bool, limit: int | None) -> tuple[str, list]:
        op, direction = ("<", "DESC") if descending else (">", "ASC")
        where, params = list(self.where), [*self.source_params, *self.params]
        by_rowid = self.nulls or self.key == "e.rowid"
        if cursor is not None:
            if by_rowid:
                where.append(f"{self.tie} {op} ?")
                params.append(cursor[-1])
            else:  # a row value: the index of (value, rowid) seeks straight to the cursor
                where.append(f"({self.key}, {self.tie}) {op} (?, ?)")
                params.extend(cursor)
        order = f"{self.tie} {direction}" if by_rowid else f"{self.key} {direction}, {self.tie} {direction}"
        sql = f"SELECT {select}, {self.tie}, {'NULL' if self.nulls else self.key} FROM {self.source}"
        sql += (" WHERE " + " AND ".join(where) if where else "") + f" ORDER BY {order}"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return sql, params


def _segments(f: EpisodeFilter, absent: set[tuple[str, str]], sort: str) -> list[_Segment]:
    """The parts of the order of `sort` over the episodes `f` selects. Each is read along an index: the sort
    column's (its entries end with the episode's rowid, the tie-break), or with an agent's reward the rewards
    table's (agent, reward) index, whose ties fall to the rewards row's rowid: the order the agent's rewards were
    first recorded (`TraceStore.update_training` keeps a row when it rewrites the reward, so a rescore moves no
    episode between pages)."""
    if sort not in SORTS:
        raise ConfigError(f"unknown sort key {sort!r}; valid: {', '.join(SORTS)}")
    bounded = f.min_reward is not None or f.max_reward is not None
    join = f.agent is not None and (bounded or sort == "reward")
    # a step, task or group selects few episodes: read them along its index and sort them ('+' keeps SQLite off
    # the order's index and the reward's, CROSS JOIN makes the episodes the outer loop)
    selective = f.step is not None or f.task_id is not None or f.group_id is not None
    plus = "+" if selective else ""
    source, source_params = "episodes e", []
    if join:  # the agent's own reward, from the rewards table (its index serves the bounds and the sort)
        source = f"episodes e {'CROSS ' if selective else ''}JOIN rewards r ON r.episode_id = e.id AND r.agent = ?"
        source_params = [f.agent]
    reward = plus + _reward_sql(f.agent, join) if join or f.agent is None else _reward_sql(f.agent, join)
    if sort == "created":
        where, params = f.sql(absent, reward, sorted_by_index=selective)
        return [_Segment(False, "e.rowid", "e.rowid", source, source_params, where, params)]
    where, params = f.sql(absent, reward, sorted_by_index=True)
    key = plus + (_reward_sql(f.agent, join) if sort == "reward" else SORTS[sort])
    tie = "r.rowid" if sort == "reward" and join else "e.rowid"
    segments = [_Segment(False, key, tie, source, source_params, [*where, f"{key} IS NOT NULL"], params)]
    if not (sort == "reward" and bounded):  # bounds leave out the episodes without a reward
        null_key = _reward_sql(f.agent, False) if sort == "reward" else key
        null_params = [f.agent] if "?" in null_key else []
        where, params = f.sql(absent, _reward_sql(f.agent, False))
        segments.append(_Segment(True, null_key, "e.rowid", "episodes e", [], [*where, f"{null_key} IS NULL"],
                                 [*params, *null_params]))
    return segments


def encode_cursor(row: Sequence[Any], sort: str) -> str:
    """The cursor of a result row (its summary columns, then rowid and sort value)."""
    rowid, value = row[-2], row[-1]
    return json.dumps([rowid] if sort == "created" else [value, rowid], separators=(",", ":"))


def decode_cursor(text: str, sort: str) -> list[Any]:
    """[value, rowid] (or [rowid] for 'created') from a cursor; ConfigError when it is not one of this sort."""
    try:
        cursor = json.loads(text)
    except ValueError:
        cursor = None
    size = 1 if sort == "created" else 2
    if (not isinstance(cursor, list) or len(cursor) != size or not isinstance(cursor[-1], int)
            or isinstance(cursor[-1], bool) or not all(v is None or isinstance(v, (int, float, str)) for v in cursor)):
        raise ConfigError(f"cursor {text[:80]!r} is not a page cursor of sort {sort!r} (take it from a page's "
                          "next or previous)")
    for value in cursor:
        if isinstance(value, int):
            _check_int("cursor", value)
    return cursor


def query_page(conn: Any, absent: set[tuple[str, str]], f: EpisodeFilter, *, sort: str, descending: bool,
               limit: int | None, after: str | None, before: str | None) -> EpisodePage:
    """`TraceStore.query` on an open connection: each part of the order read from the cursor on, LIMIT rows."""
    if after is not None and before is not None:
        raise ConfigError("give after= or before=, not both")
    if limit is not None and not (isinstance(limit, int) and 0 < limit <= MAX_INT):
        raise ConfigError(f"limit={limit!r}: give a positive integer (or None for every episode)")
    segments = _segments(f, absent, sort)
    given = after if after is not None else before
    cursor = None if given is None else decode_cursor(given, sort)
    start = 0 if cursor is None or cursor[0] is not None or len(segments) == 1 else len(segments) - 1
    if cursor is not None and sort != "created" and cursor[0] is None and not segments[-1].nulls:
        return EpisodePage([], None, None)  # a null cursor where no episode lacks the value
    backward = before is not None
    order = segments[start::-1] if backward else segments[start:]
    rows: list[Any] = []
    want = None if limit is None else limit + 1
    for i, segment in enumerate(order):
        left = None if want is None else want - len(rows)
        if left == 0:
            break
        sql, params = segment.sql(summary_select(absent), cursor if i == 0 else None, descending != backward, left)
        rows += conn.execute(sql, params).fetchall()
    more = limit is not None and len(rows) > limit
    rows = rows[:limit] if limit is not None else rows
    if backward:
        rows.reverse()
    summaries = [summary_from_row(row[:-2]) for row in rows]
    first, last = (encode_cursor(rows[0], sort), encode_cursor(rows[-1], sort)) if rows else (None, None)
    if backward:
        return EpisodePage(summaries, next=last if rows else given, previous=first if more else None)
    return EpisodePage(summaries, next=last if more else None, previous=first if cursor is not None else None)


def count_sql(absent: set[tuple[str, str]], f: EpisodeFilter, at_most: int | None = None) -> tuple[str, list[Any]]:
    """(SQL, parameters) counting the episodes `f` selects (stopping at `at_most`, when given)."""
    join = f.agent is not None and (f.min_reward is not None or f.max_reward is not None)
    selective = f.step is not None or f.task_id is not None or f.group_id is not None  # then episodes lead
    source = (f"episodes e {'CROSS ' if selective else ''}JOIN rewards r ON r.episode_id = e.id AND r.agent = ?"
              if join else "episodes e")
    where, params = f.sql(absent, _reward_sql(f.agent, join))
    params = ([f.agent] if join else []) + params
    rows = f"SELECT 1 FROM {source}" + (" WHERE " + " AND ".join(where) if where else "")
    if at_most is None:
        return f"SELECT count(*) FROM ({rows})", params
    _check_int("at_most", at_most)
    return f"SELECT count(*) FROM ({rows} LIMIT ?)", [*params, at_most]


@dataclass(frozen=True)
class ReplyCount:
    """How often an agent gave one reply (exact text) in a phase and step (`TraceStore.reply_counts`)."""

    phase: str | None
    """'train', 'eval', or None (episodes without the trainer's metadata)."""
    step: int | None
    """The step the episode was rolled out at (`Episode.metadata['step']`; evaluations: steps done before)."""
    agent: str
    """The agent that replied."""
    reply: str
    """The reply's text, exactly."""
    count: int
    """How many calls replied it."""
    reward_sum: float
    """Sum of the agent's episode reward over those calls that have one."""
    rewarded: int
    """How many of those calls' episodes have a reward for the agent."""


def reply_counts(conn: Any, phase: str | None, step: int | None, agent: str | None,
                 rewards: bool = True) -> list[ReplyCount]:
    """Every (phase, step, agent, reply) with its count and reward sum (0 without `rewards`), filtered when the
    arguments are given."""
    _check_int("step", step)
    if step is not None and phase is None:
        raise ConfigError("reply_counts: give the phase with the step (a step's training and evaluation rollouts "
                          "are different episodes)")
    where, params = conditions((f"{PHASE_SQL} = ?", phase), ("json_extract(e.metadata, '$.step') = ?", step),
                               ("t.agent = ?", agent))
    reward = "total(r.reward), count(r.reward)" if rewards else "0.0, 0"
    join = " LEFT JOIN rewards r ON r.episode_id = t.episode_id AND r.agent = t.agent" if rewards else ""
    sql = (f"SELECT {PHASE_SQL}, json_extract(e.metadata, '$.step'), t.agent, t.response_text, count(*), "
           f"{reward} FROM episodes e JOIN turns t ON t.episode_id = e.id{join}"
           + (" WHERE " + " AND ".join(where) if where else "") + " GROUP BY 1, 2, 3, 4")
    out = []
    for ph, st, ag, text, n, total, rewarded in conn.execute(sql, params):
        out.append(ReplyCount(ph if isinstance(ph, str) else None, st if isinstance(st, int) else None, ag, text,
                              n, total, rewarded))
    return out


def last_replies(conn: Any, episode_ids: Sequence[str]) -> dict[str, dict[str, str]]:
    """{episode id: {agent: the text of its last call}} of the episodes given."""
    out: dict[str, dict[str, str]] = {i: {} for i in episode_ids}
    for start in range(0, len(episode_ids), 500):  # SQLite's bound on parameters
        chunk = list(episode_ids[start:start + 500])
        sql = (f"SELECT episode_id, agent, response_text FROM turns WHERE episode_id IN "
               f"({', '.join('?' * len(chunk))}) ORDER BY episode_id, position")
        for episode_id, agent, text in conn.execute(sql, chunk):
            out[episode_id][agent] = text
    return out


@dataclass(frozen=True)
class Facets:
    """The values a store's episodes take, for filter menus (`TraceStore.facets`)."""

    steps: tuple[int, ...]
    """Training steps, ascending."""
    agents: tuple[str, ...]
    """Agents that made calls, by name."""
    phases: tuple[str, ...]
    """Phases of the trainer's rollouts ('eval', 'train'), by name."""


def _distinct(conn: Any, column: str, table: str) -> list[Any]:
    """The distinct non-null values of an indexed `column`, one index seek each (a loose index scan): as fast on
    a big store as on a small one, where SELECT DISTINCT reads every index entry."""
    sql = (f"WITH RECURSIVE v(x) AS (SELECT min({column}) FROM {table} UNION ALL "
           f"SELECT (SELECT min({column}) FROM {table} WHERE {column} > x) FROM v WHERE x IS NOT NULL) "
           "SELECT x FROM v WHERE x IS NOT NULL")
    return [row[0] for row in conn.execute(sql)]


def read_facets(conn: Any) -> Facets:
    """`Facets` of the store open on `conn`."""
    phases = [p for p in _distinct(conn, "json_extract(metadata, '$.phase')", "episodes") if isinstance(p, str)]
    return Facets(tuple(_distinct(conn, "step", "episodes")), tuple(_distinct(conn, "agent", "turns")),
                  tuple(phases))

def read_stats(conn: Any, absent: set[tuple[str, str]]) -> StoreStats:
    """`StoreStats` of the store open on `conn`."""
    n_episodes, n_failed = conn.execute("SELECT count(*), count(error) FROM episodes").fetchone()
    n_truncated = n_model_errors = 0
    if ("episodes", "truncated") not in absent:
        n_truncated, n_model_errors = conn.execute(
            f"SELECT total({OUTCOMES['truncated']}), total({OUTCOMES['model_error']}) FROM episodes e").fetchone()
    n_turns, n_trainable, n_prompt, n_response, token_bytes = conn.execute(
        "SELECT count(*), total(trainable), total(n_prompt_tokens), total(n_response_tokens), "
        "total(length(prompt_ids) + length(response_ids) + length(response_logprobs)) FROM turns"
    ).fetchone()
    by_agent = dict(conn.execute("SELECT agent, count(*) FROM turns GROUP BY agent ORDER BY agent"))
    steps = [r[0] for r in conn.execute("SELECT DISTINCT step FROM episodes WHERE step IS NOT NULL")]
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    pages = conn.execute("PRAGMA page_count").fetchone()[0] - conn.execute("PRAGMA freelist_count").fetchone()[0]
    return StoreStats(
        n_episodes=n_episodes, n_failed=n_failed, n_turns=n_turns, n_trainable_turns=int(n_trainable),
        n_prompt_tokens=int(n_prompt), n_response_tokens=int(n_response), turns_by_agent=by_agent,
        steps=tuple(sorted(steps)), db_bytes=pages * page_size, token_bytes=int(token_bytes),
        n_truncated=int(n_truncated), n_model_errors=int(n_model_errors),
    )
