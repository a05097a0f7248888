"""The seam replay drives: what `drmas_graph.traces.replay` needs to answer an instrumented app's calls
from a recording.

Replay builds an `InstrumentedGraph` without policies, installs the hook (`install`), puts its own
`CallHandler` in `ACTIVE_HANDLER` for the run (`token = start_replay(handler)`, then `end_replay(handler,
token)`: the local endpoint's URLs made in the replay work until then), and gets each call as a `CallSite`
(compared with the recorded call: `call_sampling`, its own stop and max_tokens, as the recorder records them).
Calls after a divergence are served live and recorded by an
`EpisodeRecorder`. It rebuilds a recorded answer with `cut_at_stop` and `stop_hit` (and `served_message` /
`structured_parts` of `drmas_graph.instrumentation.instrumented`), words a run that raised as the recording
did (`note_stop`), copies a checkpointed thread's recorded start (`checkpointer`, `fork_config`,
`afork_config`), runs with the recorded configurable values and context (`replay_config`), and finds where a
run of the thread stopped (`latest` addresses the thread's newest checkpoint; `pending_interrupts`,
`apending_interrupts`), and runs the graph as a recording does (`invoke_by_supersteps`, `ainvoke_by_supersteps`:
`invoke`, keeping the state of a run that raises as of its last completed superstep).

Every name here is the instrumentation's own object (not a copy), so a replay and an instrumented run share
one hook and one handler variable.
"""

from __future__ import annotations

from typing import Any

from drmas_graph.instrumentation import _threads
from drmas_graph.instrumentation._intercept import (ACTIVE_HANDLER, CallHandler, CallSite, active_handler, end_replay,
                                                    start_replay)
from drmas_graph.instrumentation._http import install
from drmas_graph.instrumentation._outcomes import note_stop
from drmas_graph.instrumentation._recorder import RAW_BRANCH_TAG, call_sampling
from drmas_graph.instrumentation._recorder import _cut_at_stop as cut_at_stop
from drmas_graph.instrumentation._recorder import _stop_hit as stop_hit
from drmas_graph.instrumentation._recorder import _EpisodeRecorder as EpisodeRecorder
from drmas_graph.instrumentation._segments import apending_interrupts, latest, pending_interrupts
from drmas_graph.instrumentation._streams import ainvoke_by_supersteps, invoke_by_supersteps
from drmas_graph.instrumentation._threads import afork_config, fork_config, replay_config

__all__ = ["ACTIVE_HANDLER", "CallHandler", "CallSite", "EpisodeRecorder", "RAW_BRANCH_TAG", "active_handler",
           "afork_config", "ainvoke_by_supersteps", "apending_interrupts", "call_sampling", "checkpointer",
           "cut_at_stop", "end_replay", "fork_config", "install", "invoke_by_supersteps", "latest", "note_stop",
           "pending_interrupts", "replay_config", "start_replay", "stop_hit"]


def checkpointer(graph: Any) -> Any:
    """The compiled graph's checkpointer (one with `get_tuple`), else None: only then has a run a thread to
    continue, copy or inspect."""
    return _threads._checkpointer(graph)
