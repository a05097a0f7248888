"""Exports: a run's metrics and an episode list (the same filters and sort as the page) as CSV or JSON."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from drmas_graph.ui._data import EpisodeQuery, Run

__all__ = ["episode_records", "to_csv", "to_json"]


def episode_records(run: Run, query: EpisodeQuery) -> list[dict[str, Any]]:
    """Every episode the list's filters select (not one page), in its sort order, with its last reply per agent."""
    store = run.store()
    where = query.filter(store.facets().phases)
    rows = store.query(where, sort=query.sort, descending=query.desc, limit=None).rows
    replies = store.last_replies([s.id for s in rows])
    return [{**asdict(s), "outcome": s.outcome, "replies": replies[s.id]} for s in rows]


def to_json(records: Sequence[dict[str, Any]]) -> bytes:
    """A JSON list of the records."""
    return json.dumps(list(records), ensure_ascii=False, indent=1, default=str).encode()


def to_csv(records: Sequence[dict[str, Any]]) -> bytes:
    """One row per record, one column per key (in order of first appearance); lists and dicts as JSON."""
    columns: dict[str, None] = {}
    for record in records:
        columns.update(dict.fromkeys(record))
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for record in records:
        writer.writerow([_cell(record.get(c)) for c in columns])
    return out.getvalue().encode()


def _cell(value: Any) -> Any:
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return "" if value is None else value
