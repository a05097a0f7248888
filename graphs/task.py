"""The task record both example environments hand out (plain Python; no drmas_graph import)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Task", "split_counts", "stable_id"]


@dataclass(frozen=True)
class Task:
    """One problem of an environment split."""

    id: str
    """Stable, unique id derived from the task's content (same seed -> same id)."""
    input: dict[str, Any]
    """The graph input, e.g. ``{"question": "What is 3 + 4?"}``; pass it to ``graph.invoke``."""
    answer: str
    """The gold answer as a string."""
    meta: dict[str, Any] = field(default_factory=dict, hash=False)
    """Extra facts: always ``level`` (difficulty, 0 = easiest), ``kind`` and ``split``."""


def stable_id(prefix: str, text: str) -> str:
    """``prefix-<10 hex digits of sha1(text)>``: stable across runs and Python hash seeds."""
    return f"{prefix}-{hashlib.sha1(text.encode()).hexdigest()[:10]}"


def split_counts(n: int, weights: tuple[float, ...]) -> list[int]:
    """Split ``n`` items over levels in proportion to ``weights`` (largest-remainder rounding).

    >>> split_counts(10, (0.55, 0.2, 0.15, 0.1))
    [6, 2, 1, 1]
    """
    if n < 0:
        raise ValueError(f"a split size must be >= 0, got {n}")
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"difficulty weights must be non-negative with a positive sum, got {weights}")
    total = sum(weights)
    exact = [n * w / total for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts
