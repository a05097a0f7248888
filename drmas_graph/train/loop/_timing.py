"""Where a step's time went, beyond the Stopwatch's laps (rollout, score, update): the rollouts' engine time
(prefill vs decode) in all and per agent, each agent's wall time in LLM calls, the old-logprob passes; and the
one line of `TrainResult.summary()` that adds them up.

The engine seconds come from the episodes' `timings['engine']` (what the embedded engine attributed to each
call, `Generation.prefill_s` / `decode_s`: a decode step split equally among its rows, a prefill pass among its
prompts by token share, see `engine._decode`); a served policy (vLLM, SGLang) measures neither, and its agents
have only their wall time in calls (`agent/<agent>/llm_call_s`, which overlaps between concurrent calls).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from drmas_graph.types import Episode

__all__ = ["rollout_times", "old_logprobs_seconds", "time_line", "timed"]


def rollout_times(agents: Sequence[str], episodes: Sequence[Episode]) -> dict[str, float]:
    """The step's `time/rollout_prefill_s` and `time/rollout_decode_s` (engine seconds over the episodes, where
    their policies measure them), and per agent `agent/<agent>/rollout_prefill_s`, `.../rollout_decode_s` (where
    measured) and `.../llm_call_s` (the summed wall time of its calls)."""
    record: dict[str, float] = {}
    engine = [ep.timings.get("engine", {}) for ep in episodes]
    for phase in ("prefill_s", "decode_s"):
        measured = [spent[phase] for by_agent in engine for spent in by_agent.values()]
        if measured:
            record[f"time/rollout_{phase}"] = sum(measured)
    for agent in agents:
        record[f"agent/{agent}/llm_call_s"] = sum(t.latency_s for ep in episodes for t in ep.turns if t.agent == agent)
        spent = [by_agent[agent] for by_agent in engine if agent in by_agent]
        for phase in ("prefill_s", "decode_s") if spent else ():
            record[f"agent/{agent}/rollout_{phase}"] = sum(s[phase] for s in spent)
    return record


def old_logprobs_seconds(update_metrics: Mapping[str, Any]) -> float:
    """Seconds of the step's separate old-logprob passes: the sum of `model/<model>/old_logprobs_s`."""
    return sum(v for k, v in update_metrics.items() if k.startswith("model/") and k.endswith("/old_logprobs_s"))


_PARTS = (("rollout", "time/rollout_s"), ("score", "time/score_s"), ("old logprobs", "time/old_logprobs_s"),
          ("update", "time/update_s"), ("sync", "time/sync_s"), ("checkpoint", "time/checkpoint_s"))


def time_line(history: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]] = ()) -> str | None:
    """'time per step: rollout 12.1 s (prefill 1.2, decode 9.8), score 0.4 s (judge 0.3), old logprobs 0.0 s,
    update 4.2 s, sync 0.0 s, checkpoint 0.1 s; evaluation 30.2 s each (2)': each phase's seconds over the steps
    of `history` divided by their number (a checkpoint every 4 steps counts a quarter of its time per step); the
    rollout's engine split and the judge's part where measured; the evaluations' mean time (`time_s` of the
    records of `evals`). A phase no step measured is left out (no 0.0 where nothing was measured). None
    without a measured phase or a timed evaluation."""
    n = len(history)

    def per_step(key: str) -> float:  # the key's seconds over the steps / the number of steps
        return sum(float(h.get(key, 0.0)) for h in history) / n

    parts = []
    for label, key in _PARTS if n else ():
        if not any(key in h for h in history):  # not measured (a record from before timing, a phase never run)
            continue
        part = f"{label} {per_step(key):.1f} s"
        if key == "time/rollout_s" and any("time/rollout_prefill_s" in h for h in history):
            prefill, decode = per_step("time/rollout_prefill_s"), per_step("time/rollout_decode_s")
            part += f" (prefill {prefill:.1f}, decode {decode:.1f})"
        if key == "time/score_s" and any(h.get("time/judge_s") for h in history):
            part += f" (judge {per_step('time/judge_s'):.1f})"
        parts.append(part)
    line = "time per step: " + ", ".join(parts) if parts else ""
    timed = [float(e["time_s"]) for e in evals if "time_s" in e]
    if timed:
        line += ("; " if line else "") + f"evaluation {sum(timed) / len(timed):.1f} s each ({len(timed)})"
    return line or None


def timed(fn: Any, *args: Any) -> float:
    """Run `fn(*args)`; its seconds."""
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started
