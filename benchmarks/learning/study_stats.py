"""The learning studies' shared statistics and helpers (v1 `run.py` and v2 `v2.py` both use them; neither imports
the other's internals): the 95% Student-t interval, the pre-registered verdict rule, interval formatting, the
per-step band plot and a run in its own process."""

from __future__ import annotations

import math
import statistics
from typing import Any

__all__ = ["band", "fmt_ci", "in_own_process", "t_interval", "verdict"]

_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def in_own_process(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in a fresh process (spawned, so it shares no torch state with this one): a run's two
    models, optimizer states and KL reference go back to the system when it ends. In one process the study grew
    by ~1 GB per run (12.4 GB after 11 runs) until the out-of-memory killer picked it."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def t_interval(xs: list[float]) -> tuple[float, float, float]:
    """Mean and two-sided 95% Student-t interval (NaNs dropped; half-width NaN for fewer than two values)."""
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return math.nan, math.nan, math.nan
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, math.nan, math.nan
    df = len(xs) - 1
    t = _T95[max(k for k in _T95 if k <= df)] if df <= 30 else 1.96
    h = t * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, m - h, m + h


def fmt_ci(ci: tuple[float, float, float]) -> str:
    """`mean [lo, hi]` to 3 decimals (the mean alone when the interval is undefined)."""
    m, lo, hi = ci
    return f"{m:.3f}" if math.isnan(lo) else f"{m:.3f} [{lo:.3f}, {hi:.3f}]"


def verdict(lo: float, hi: float, sign: int) -> str:
    """The pre-registered rule (v1 and v2) for a paired difference's 95% t interval [lo, hi] and the stated
    direction `sign`: supported when it excludes 0 that way, contradicted when it excludes 0 the other way."""
    if math.isnan(lo):
        return "not resolved (fewer than 2 pairs)"
    if (lo > 0 and sign > 0) or (hi < 0 and sign < 0):
        return "supported"
    if (hi < 0 and sign > 0) or (lo > 0 and sign < 0):
        return "contradicted"
    return "not resolved"


def band(ax: Any, runs: list[dict[str, Any]], get: Any, title: str,
         bounds: tuple[float | None, float | None] = (None, None)) -> None:
    """One line per estimator: the mean over runs of `get(step)` per step, with its 95% t band (clipped to `bounds`)."""
    lo_b = -math.inf if bounds[0] is None else bounds[0]
    hi_b = math.inf if bounds[1] is None else bounds[1]
    for est in sorted({r["estimator"] for r in runs}):
        series = [[get(s) for s in r["steps"]] for r in runs if r["estimator"] == est]
        n = min(len(x) for x in series)
        steps = list(range(1, n + 1))
        cis = [t_interval([x[i] for x in series]) for i in range(n)]
        ax.plot(steps, [c[0] for c in cis], label=est)
        if len(series) > 1:
            ax.fill_between(steps, [min(max(c[1], lo_b), hi_b) for c in cis],
                            [min(max(c[2], lo_b), hi_b) for c in cis], alpha=0.2)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
