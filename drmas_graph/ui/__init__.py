"""A local, read-only web UI over training runs: metric curves, episodes, one episode token by token, replay.

    drmas-graph ui RUN_DIR [RUN_DIR ...] [--port 8000] [--host 127.0.0.1] [--graph module:attr]
    python -m drmas_graph.ui RUN_DIR ...

Pages (every one a shareable URL; filters live in the query string):

- ``/``: the runs' metric curves (one chart per metric, one line per run and agent: colour the run, line style
  the agent; ``?run=a&run=b`` picks runs, ``smooth``, ``from_step`` and ``to_step`` draw them) and their
  evaluations per step; ``/chart?metric=M``: one chart enlarged;
- ``/runs/RUN/answers``: what each agent replies per phase and step (top replies, distinct replies, entropy);
- ``/runs/RUN/episodes``: the episode table with filters (phase, step, group, agent, task, outcome, reward
  range, reply text), sorting and keyset pages (`TraceStore.query`); ``/runs/RUN/group?id=G``: a GRPO group's
  episodes side by side; ``/runs/RUN/export/{metrics,episodes}.{csv,json}``: the metrics, the episode list;
- ``/runs/RUN/episodes/ID``: one episode: its segments, node instances and turns, each prompt as the policy saw
  it (its ids decoded, `turns`; else its messages, said so), response tokens coloured by probability (hover: id
  and logprob), the tool calls made and whether they parsed, advantages, the final state;
- ``/runs/RUN/episodes/ID/replay`` (with ``--graph``): the episode replayed, its first divergence diffed.

A run folder that has written nothing yet (training is loading its models) is waited for: its pages say so and
reload themselves. `turns` (public: `drmas-graph traces show` uses it) says how a turn reads as text.

Needs the ``ui`` extra (Jinja2). May import: traces, instrumentation and the shared modules; the command line
(`drmas_graph.cli._ui`) builds the ``--graph`` it replays into.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

__all__ = ["UiApp", "make_server", "serve"]


def __getattr__(name: str) -> Any:
    """`UiApp` and `make_server` load Jinja2 (the ``ui`` extra): imported on first use, so the CLI starts without it."""
    if name in ("UiApp", "make_server"):
        return getattr(_load_app(), name)
    raise AttributeError(f"module 'drmas_graph.ui' has no attribute {name!r}")


def _load_app() -> Any:
    try:
        return importlib.import_module("drmas_graph.ui._app")
    except ImportError as e:
        from drmas_graph.errors import ConfigError

        raise ConfigError(f"drmas-graph ui needs the `ui` extra ({e}): pip install 'drmas-graph[ui]'") from e


def serve(run_dirs: Sequence[str], *, host: str = "127.0.0.1", port: int = 8000, graph: Any = None,
          graph_spec: str | None = None) -> None:
    """Serve the UI for `run_dirs` until interrupted (Ctrl-C). `graph`: the compiled graph Replay uses (None: no
    Replay button); `graph_spec`: how it was named ('module:attr'), shown on the replay page."""
    ui = _load_app()
    app = ui.UiApp(run_dirs, graph=graph, graph_spec=graph_spec)
    server = ui.make_server(app, host, port)
    where = f"[{host}]" if ":" in host else host
    print(f"drmas-graph ui: {len(app.runs)} run(s) ({', '.join(app.runs)}) at http://{where}:{server.server_port}/ "
          "(Ctrl-C stops)", flush=True)
    for run in app.runs.values():
        if run.waiting():
            print(f"drmas-graph ui: {run.not_written()} Its pages show it as it trains.", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        app.close()
