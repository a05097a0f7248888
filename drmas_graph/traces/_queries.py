"""What the trace store answers without loading whole episodes: episode summaries (and the SQL that filters
them) and store-wide counts. `drmas_graph.traces.store.TraceStore` runs these queries under its lock."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from drmas_graph.errors import ConfigError

__all__ = ["EpisodeSummary", "StoreStats", "SUMMARY_COLUMNS", "OUTCOMES", "summary_from_row", "summary_select",
           "conditions", "episodes_sql", "read_stats"]

SUMMARY_COLUMNS = (
    "id", "task_id", "group_id", "step", "n_turns", "agents", "n_prompt_tokens", "n_response_tokens",
    "reward", "rewards", "error", "created", "truncated", "model_error",
)  # fmt: skip

OUTCOMES = {
    "finished": "e.error IS NULL AND e.truncated IS NULL AND e.model_error IS NULL",
    "truncated": "e.error IS NULL AND e.truncated IS NOT NULL",
    "model_error": "e.error IS NULL AND e.truncated IS NULL AND e.model_error IS NOT NULL",
    "failed": "e.error IS NOT NULL",
}
"""`Episode.outcome` -> the SQL condition on an episodes row `e`."""


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


def episodes_sql(absent: set[tuple[str, str]], *, step: int | None, agent: str | None, task_id: str | None,
                 min_reward: float | None, max_reward: float | None, failed: bool | None, outcome: str | None,
                 limit: int | None, group_prefix: str | None = None, group_id: str | None = None,
                 ) -> tuple[str, list[Any]]:
    """(SQL, parameters) selecting the summaries `TraceStore.episodes` documents, in the order written."""
    where, params = conditions(("e.step = ?", step), ("e.task_id = ?", task_id), ("e.group_id = ?", group_id),
                               ("EXISTS (SELECT 1 FROM turns t WHERE t.agent = ? AND t.episode_id = e.id)", agent))
    if group_prefix is not None:
        where.append("substr(e.group_id, 1, ?) = ?")
        params.extend([len(group_prefix), group_prefix])
    if failed is not None:
        where.append("e.error IS NOT NULL" if failed else "e.error IS NULL")
    if outcome is not None:
        if outcome not in OUTCOMES:
            raise ConfigError(f"unknown episode outcome {outcome!r}; valid: {', '.join(OUTCOMES)}")
        condition = OUTCOMES[outcome]
        if ("episodes", "truncated") in absent:  # a store older than truncation: every episode finished or failed
            condition = {"finished": "e.error IS NULL", "failed": "e.error IS NOT NULL"}.get(outcome, "0")
        where.append(f"({condition})")
    reward = (
        "(SELECT r.reward FROM rewards r WHERE r.episode_id = e.id AND r.agent = ?)" if agent is not None else "e.reward"
    )
    for bound, op in ((min_reward, ">="), (max_reward, "<=")):
        if bound is not None:
            where.append(f"{reward} {op} ?")
            params.extend([agent, bound] if agent is not None else [bound])
    sql = f"SELECT {summary_select(absent)} FROM episodes e"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY e.rowid"
    if limit is not None:
        sql += " LIMIT ?"
        params.append(limit)
    return sql, params


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
