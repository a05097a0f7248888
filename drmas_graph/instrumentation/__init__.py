"""Instrumentation: serve every LLM call of an unmodified LangGraph app from a policy, and record it.

Owns the path of one call: a node calls a chat model -> `_intercept` (the run-scoped hook on LangChain's
`BaseChatModel`; which node, which `Send`, which task: `_task_paths`), or sends an LLM API request with an SDK or
raw HTTP -> `_http` (the run-scoped hook on httpx, requests and aiohttp; `_wire` reads the request, `_wire_replies`
answers in its protocol), or another process posts to the run's local endpoint (`endpoint`; a program a node starts
is pointed there by `_subprocess`) -> `_recorder` (the agent, the seed
derived from the call's identity (`_seeds`), the episode's limits (`_limits`), the policy's answer in the
form LangChain expects) -> a `Turn` on the `Episode`; a run that raised is truncated, a model error or failed
(`_outcomes`). Entry points: `instrumented.instrument` /
`InstrumentedGraph` (an app's runs as episodes), `chat_model.PolicyChatModel` (a policy as a chat model),
`_threads` (where a checkpointed thread started).

May import: the shared modules only (types, errors, config, env, policy, _chat, _structured). Public names
are exported by `drmas_graph` itself.

Seams offered to the other sub-packages (their only way in; a private `_x` module stays inside):
`active_handler()` (the call handler serving this context: served policies read it), `app_models()` (calls
go to the app's own models: the judge), `instrumented` / `chat_model` (public modules), and `replaying`
(what `traces.replay` drives: the hook, the handler variable, the recorder, thread forks, interrupts); the
errors of an episode's limits, `EpisodeLimitError` and `StuckEpisodeError`; `endpoint` (`llm_base_url`,
`llm_env`: the run's local endpoint, exported by `drmas_graph`).
"""

from drmas_graph.instrumentation._intercept import active_handler, app_models
from drmas_graph.instrumentation._limits import EpisodeLimitError, StuckEpisodeError

__all__ = ["active_handler", "app_models", "EpisodeLimitError", "StuckEpisodeError"]

from typing import Any as _Any

_SEAM = {  # public name -> the module that defines it; loaded on first use
    "LIMITS": "drmas_graph.instrumentation._limits",
    "Backstop": "drmas_graph.instrumentation._limits",
    "limit_metadata": "drmas_graph.instrumentation._limits",
    "episode_seed": "drmas_graph.instrumentation._seeds",
    "EpisodeInterruptedError": "drmas_graph.instrumentation._segments",
    "continuation_from_env": "drmas_graph.instrumentation._segments",
    "UNSERVED_KEY": "drmas_graph.instrumentation._wire",
}
"""The names train/'s rollouts use: an episode's limits and their backstop, its sampling seed, interrupts, and
the episode metadata key of its LLM API requests that no policy served (`check` reports them)."""


def __getattr__(name: str) -> _Any:
    if name not in _SEAM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_SEAM[name]), name)
