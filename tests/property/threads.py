"""Several rollouts of one thread, and a replay in a fresh process (issue 40): the properties the suite could not
state while it ran one rollout per thread in one process.

- `continue_thread`: a first rollout that stops at `interrupt()` unanswered, resumed by a second rollout with
  `Command(resume=...)` (rev5_b); an app without interrupts gets the next input on the same thread instead
  (its sub-agents with `checkpointer=True` remember the first: rev5_g); then a rollout from an older checkpoint
  of the thread (time travel, rev5_b). Each stored episode must replay cleanly.
- `replay_elsewhere`: the stored episode replayed in a new Python process with another PYTHONHASHSEED, compared
  with the in-process replay (rev5_e).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from langgraph.types import Command

from drmas_graph import EpisodeInterruptedError, RolloutError, TraceStore
from drmas_graph.types import Episode
from tests.property import invariants as inv
from tests.property.apps import App, Built, Timing  # noqa: F401  (App: eval'd in the child)

ROOT = Path(__file__).resolve().parents[2]


def continue_thread(app: App, built: Built, store: TraceStore, seed: int) -> list[Episode]:
    """The episodes of a thread continued by later rollouts (see the module docstring), all in `store`."""
    wired = inv.wiring(app)
    runner = inv.instrumented(built, wired, store)
    thread = inv.run_config(uuid.uuid4().hex)
    kwargs = {"context": inv.context(app), "metadata": {"seed": seed}}
    episodes = []
    try:
        episodes.append(runner.rollout({"topic": "cats"}, thread, **kwargs))  # no resume hook: it stays paused
        nxt: Any = {"topic": "dogs"}  # finished: the conversation's next input
    except EpisodeInterruptedError as exc:
        episodes.append(exc.episode)
        pending = runner.get_state(thread, subgraphs=True)
        nxt = Command(resume={i.id: f"yes to {i.value['site']}" for t in _tasks(pending) for i in t.interrupts})
    episodes.append(runner.rollout(nxt, thread, resume=inv.answer_interrupts, **kwargs))
    history = [s for s in runner.get_state_history(thread) if s.next]
    if history:  # time travel: run again from the thread's oldest checkpoint with work left
        older = history[-1]
        again = Command(resume="again") if any(t.interrupts for t in older.tasks) else None
        try:
            episodes.append(runner.rollout(again, older.config, resume=inv.answer_interrupts, **kwargs))
        except RolloutError as exc:
            episodes.append(exc.episode)
    return episodes


def _tasks(state: Any) -> list[Any]:
    out = []
    for task in state.tasks:
        out.append(task)
        if hasattr(task.state, "tasks"):
            out.extend(_tasks(task.state))
    return out


CHILD = """
import json, sys
from tests.property.apps import *
from tests.property import invariants as inv
from drmas_graph.traces.replay import comparable
app = eval(sys.argv[1])
result = inv.replay_stored(app, sys.argv[2], type("E", (), {"id": sys.argv[3]})(), 0)
print(json.dumps({"divergences": [str(d) for d in result.divergences], "state_matches": result.state_matches,
                  "state": inv.state_text(result.final_state)}))
"""


def replay_elsewhere(app: App, db: Path, episode_id: str, hash_seed: int) -> dict[str, Any]:
    """Replay the stored episode in a fresh process with PYTHONHASHSEED=`hash_seed`."""
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CHILD, repr(app), str(db), episode_id], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"the replay process failed:\n{out.stderr[-3000:]}\n{inv.describe(app)}"
    return json.loads(out.stdout.strip().splitlines()[-1])
