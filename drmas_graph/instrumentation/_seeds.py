"""Seeds derived from what a call *is*, never from the order calls arrive in.

A training run's sampling must not depend on thread scheduling: with several episodes in flight, the
n-th request to reach a policy is a different call from run to run. So every LLM call of an instrumented
rollout gets its seed from its identity,

    episode seed = H(run seed, phase, step, group index in the step, episode index in the group)
    call seed    = H(episode seed, call_key, k, H(prompt token ids)[, agent])

with k the number of earlier calls of the same node instance (`call_key`) by the same agent with the same
prompt, and H a
keyed hash that is stable across processes and Python versions (blake2b over the parts' reprs; Python's
`hash()` is salted per process). Calls one node instance makes one after the other differ in k or in their
prompt; calls it makes concurrently (an `llm.batch`, sub-agents run in parallel, whose calls share the
node's key) arrive in any order, yet each keeps its seed (one agent's calls with equal prompts are
interchangeable). A call routed to another agent than the node's own (`drmas_agent` metadata, an `agent:`
entry: voters or debaters one node calls at once, maybe with one prompt) has its agent in the seed too, so
two agents never trade seeds by arrival order; calls of the node's own agent keep the seed without it.
The position of a call among its node instance's calls (`node_call_index`) follows arrival order for
concurrent calls, so it is no part of the seed. The trainer puts the episode seed in the rollout's
metadata (`"seed"`); the instrumented call handler derives the call seed (`seeded`).
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence
from typing import Any

from drmas_graph.types import SamplingParams

__all__ = ["stable_seed", "episode_seed", "call_seed", "prompt_digest", "seeded", "SEED_BITS"]

SEED_BITS = 31
"""Seeds lie in [0, 2**31): every backend (torch generators, vLLM, SGLang) accepts them."""


def stable_seed(*parts: Any) -> int:
    """A seed in [0, 2**SEED_BITS) from `parts` (ints and strings), the same in every process."""
    digest = hashlib.blake2b("\x1f".join(repr(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (1 << SEED_BITS)


def episode_seed(run_seed: int, phase: str, step: int, group: int, index: int) -> int:
    """Seed of episode `index` of group `group` (position in the step's task batch) at `step` of `phase`."""
    return stable_seed("episode", run_seed, phase, step, group, index)


def call_seed(episode: int, call_key: str, index: int, prompt: str | None = None, agent: str | None = None) -> int:
    """Seed of the `index`-th call with `call_key` (and prompt digest `prompt`; by `agent` when it is not the
    node's own agent) in the episode seeded `episode`."""
    extra = (() if prompt is None else (prompt,)) + (() if agent is None else (agent,))
    return stable_seed("call", episode, call_key, index, *extra)


def prompt_digest(prompt_ids: Sequence[int]) -> str:
    """A short stable digest of a prompt's token ids (a part of its calls' seeds)."""
    return hashlib.blake2b(array.array("q", prompt_ids).tobytes(), digest_size=8).hexdigest()


def seeded(params: SamplingParams, metadata: dict[str, Any], call_key: str, index: int, prompt: str,
           agent: str | None = None) -> SamplingParams:
    """`params` with the call's derived seed (`index`-th call of node instance `call_key` with the prompt whose
    digest is `prompt`, by `agent`: None for the node's own agent), when the episode carries a seed and the
    params fix none."""
    base = metadata.get("seed")
    if base is None or params.seed is not None:
        return params
    return params.replace(seed=call_seed(int(base), call_key, index, prompt, agent))
