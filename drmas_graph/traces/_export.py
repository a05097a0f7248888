"""The trace store's flat export: one row per LLM call (`TraceStore.export`), as JSONL or Parquet."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from drmas_graph.errors import ConfigError
from drmas_graph.traces._serde import IDS_DTYPE, LOGPROBS_DTYPE, _dumps

__all__ = ["EXPORT_COLUMNS", "EXPORT_SELECT", "EXPORT_ORDER", "EXPORT_WRITERS", "export_rows"]

EXPORT_COLUMNS = (
    "episode_id", "task_id", "group_id", "train_step", "turn_index", "agent", "node", "graph_step",
    "prompt_ids", "response_ids", "response_logprobs", "response_text", "finish_reason", "policy",
    "policy_version", "trainable", "reward", "turn_reward", "advantage", "error",
)  # fmt: skip
"""Export columns: ``train_step`` is the training step of the episode, ``graph_step`` the LangGraph
superstep of the call, ``turn_index`` its position in the episode, ``reward`` the episode reward of the
call's agent, ``turn_reward``/``advantage`` what training stored (None until then), ``error`` the
episode's failure."""

EXPORT_SELECT = """
SELECT t.episode_id, e.task_id, e.group_id, e.step, t.position, t.agent, t.node, t.step,
       t.prompt_ids, t.response_ids, t.response_logprobs, t.response_text, t.finish_reason, t.policy,
       t.policy_version, t.trainable, r.reward, t.turn_reward, t.advantage, e.error
FROM turns t
JOIN episodes e ON e.id = t.episode_id
LEFT JOIN rewards r ON r.episode_id = t.episode_id AND r.agent = t.agent
"""
EXPORT_ORDER = " ORDER BY e.rowid, t.position"


def export_rows(cursor: Iterable[tuple]) -> Iterator[dict[str, Any]]:
    """Rows of `EXPORT_SELECT` as dicts keyed by `EXPORT_COLUMNS`, token arrays as lists."""
    for values in cursor:
        row = dict(zip(EXPORT_COLUMNS, values, strict=True))
        row["prompt_ids"] = np.frombuffer(row["prompt_ids"], dtype=IDS_DTYPE).tolist()
        row["response_ids"] = np.frombuffer(row["response_ids"], dtype=IDS_DTYPE).tolist()
        row["response_logprobs"] = np.frombuffer(row["response_logprobs"], dtype=LOGPROBS_DTYPE).tolist()
        row["trainable"] = bool(row["trainable"])
        yield row


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    """One JSON object per line (NaN/Infinity written as Python's json does). Returns the row count."""
    n_rows = 0
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(_dumps(row) + "\n")
            n_rows += 1
    return n_rows


def write_parquet(path: Path, rows: Iterable[dict[str, Any]], batch_rows: int = 4096) -> int:
    """A Parquet file with typed columns (token ids list<int32>, logprobs list<float64>)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError("export format 'parquet' needs pyarrow: pip install pyarrow") from e
    types = {
        "train_step": pa.int64(), "turn_index": pa.int64(), "graph_step": pa.int64(),
        "prompt_ids": pa.list_(pa.int32()), "response_ids": pa.list_(pa.int32()),
        "response_logprobs": pa.list_(pa.float64()), "policy_version": pa.int64(), "trainable": pa.bool_(),
        "reward": pa.float64(), "turn_reward": pa.float64(), "advantage": pa.float64(),
    }  # fmt: skip
    schema = pa.schema([(name, types.get(name, pa.string())) for name in EXPORT_COLUMNS])
    n_rows = 0
    with pq.ParquetWriter(path, schema) as writer:
        batch: list[dict[str, Any]] = []
        for row in rows:
            batch.append(row)
            if len(batch) == batch_rows:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                n_rows, batch = n_rows + len(batch), []
        if batch or n_rows == 0:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
            n_rows += len(batch)
    return n_rows


EXPORT_WRITERS = {"jsonl": write_jsonl, "parquet": write_parquet}
"""Export formats by name."""
