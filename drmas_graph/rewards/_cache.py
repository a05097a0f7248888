"""The judge's cache: results of judge calls by key (a sha256 of the model name, mode and rendered prompt), in
memory, and in an SQLite file when a path is given, so a resumed run (or a rescore) pays nothing twice.

Only usable results are cached: a failed call is retried by the next run. Each read and write opens its own
connection, so threads and processes may share one file (SQLite serialises the writers).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from drmas_graph.errors import ConfigError

__all__ = ["JudgeCache", "cache_key"]

_SCHEMA = "CREATE TABLE IF NOT EXISTS judgements (key TEXT PRIMARY KEY, value TEXT NOT NULL, created REAL NOT NULL)"


def cache_key(*parts: Any) -> str:
    """sha256 (hex) of the parts as canonical JSON."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class JudgeCache:
    """JSON-able results by key; `path` None keeps them in memory only (for the life of the judge)."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path is not None else None
        self._memory: dict[str, dict] = {}
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._run(lambda db: db.execute(_SCHEMA))

    def _run(self, fn: Any) -> Any:
        try:
            with closing(sqlite3.connect(self.path, timeout=60)) as db, db:
                return fn(db)
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"judge cache {self.path}: {exc}; the file must be a judge cache written by "
                              "drmas-graph: delete it or give the judge another `cache` path") from exc

    def get(self, key: str) -> dict | None:
        """The result stored under `key`, or None."""
        with self._lock:
            if key in self._memory:
                return self._memory[key]
        if self.path is None:
            return None
        row = self._run(lambda db: db.execute("SELECT value FROM judgements WHERE key = ?", (key,)).fetchone())
        return json.loads(row[0]) if row else None

    def put(self, key: str, value: dict) -> None:
        """Store `value` (JSON-able) under `key`."""
        with self._lock:
            self._memory[key] = value
        if self.path is not None:
            text = json.dumps(value, ensure_ascii=False)
            self._run(lambda db: db.execute("INSERT OR REPLACE INTO judgements VALUES (?, ?, ?)",
                                            (key, text, time.time())))
