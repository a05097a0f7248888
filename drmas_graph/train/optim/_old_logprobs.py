"""The old logprobs of the PPO ratio, recomputed by the trainer (config `old_logprobs`).

An embedded policy's rollout logprobs differ from the trainer's own only by floating-point noise that
depends on which requests its dynamic batcher decoded together, i.e. on timing (padding and batch shape
change the summation order). The trainer's own, from the updater's model, which holds the weights that
generated them, make the update, and so the weights, independent of `max_concurrency`. With one optimizer
step per update (``n_minibatches: 1``) they are the update's own logprobs, detached
(``ModelUpdater.update(old_logprobs="current")``: no separate pass); with several steps they are recomputed
here before the first one. Served policies keep their rollout logprobs by default: there the gap is a real
mismatch (another engine, maybe another precision) that the importance ratio should see.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from drmas_graph.types import Sample

__all__ = ["with_trainer_logprobs"]


def with_trainer_logprobs(samples: Sequence[Sample], recomputed: Sequence[Any]) -> tuple[list[Sample], dict[str, float]]:
    """`samples` with `old_logprobs` replaced by `recomputed` (1-D tensors from `ModelUpdater.compute_logprobs`;
    None for a sample the updater does not forward, whose ratio never matters), and per agent the token mean
    of |rollout - trainer| as `agent/<a>/rollout_logprob_gap`, over the samples the trainer's weights sampled
    (a stale one's, `behaviour_logprobs` set, would measure the policy's change, not the numerics)."""
    gaps: dict[str, list[float]] = {}
    out = []
    for s, lp in zip(samples, recomputed, strict=True):
        if lp is None:
            out.append(s)
            continue
        new = tuple(float(x) for x in lp.tolist())
        if s.behaviour_logprobs is None:
            gaps.setdefault(s.agent, []).extend(abs(a - b) for a, b in zip(s.old_logprobs, new))
        out.append(dataclasses.replace(s, old_logprobs=new))
    return out, {f"agent/{a}/rollout_logprob_gap": sum(g) / max(len(g), 1) for a, g in gaps.items()}
