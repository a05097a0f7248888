"""A local, read-only web UI over training runs: metric curves, episodes, one episode token by token, replay.

    drmas-graph ui RUN_DIR [RUN_DIR ...] [--port 8000] [--host 127.0.0.1] [--graph module:attr]
    python -m drmas_graph.ui RUN_DIR ...

Pages (every one a shareable URL; filters live in the query string):

- ``/``: the runs' metric curves (one chart per metric, one line per run and agent; ``?run=a&run=b`` picks
  runs) and their evaluations per step;
- ``/runs/RUN/episodes``: the episode table with filters (step, group, agent, task, outcome, reward range),
  sorting and pages; ``/runs/RUN/group?id=G``: a GRPO group's episodes side by side;
- ``/runs/RUN/episodes/ID``: one episode: its segments, node instances and turns, prompts as messages,
  response tokens coloured by probability (hover: id and logprob), advantages, the final state;
- ``/runs/RUN/episodes/ID/replay`` (with ``--graph``): the episode replayed, its first divergence diffed.

Needs the ``ui`` extra (Jinja2). May import: traces, types, cli._imports (to build ``--graph``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["UiApp", "make_server", "serve", "add_ui_command", "main"]


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


def serve(run_dirs: Sequence[str], *, host: str = "127.0.0.1", port: int = 8000, graph: str | None = None) -> None:
    """Serve the UI for `run_dirs` until interrupted (Ctrl-C). `graph`: 'module:attr' of the graph Replay uses."""
    from drmas_graph.cli._imports import build_graph

    ui = _load_app()
    app = ui.UiApp(run_dirs, graph=build_graph(graph) if graph else None, graph_spec=graph)
    server = ui.make_server(app, host, port)
    where = f"[{host}]" if ":" in host else host
    print(f"drmas-graph ui: {len(app.runs)} run(s) ({', '.join(app.runs)}) at http://{where}:{server.server_port}/ "
          "(Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        app.close()


def add_ui_command(groups: Any) -> None:
    """Register ``drmas-graph ui`` (called by `drmas_graph.cli.build_parser`)."""
    p = groups.add_parser("ui", help="a local web UI over run folders: metrics, episodes, tokens, replay",
                          description="Serve a read-only web UI over training run folders (traces.db, "
                                      "metrics.jsonl); it works while the runs train. Needs the `ui` extra.")
    add_ui_arguments(p)
    p.set_defaults(func=_cmd_ui)


def add_ui_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folder(s) of training runs (their run_dir)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only); any other is served with a "
                        "warning: the UI has no authentication and shows every prompt and reply")
    p.add_argument("--graph", metavar="MODULE:ATTR",
                   help="the graph (or a factory) to replay episodes into; enables the Replay button")


def _cmd_ui(args: argparse.Namespace, console: Any = None) -> int:
    serve(args.run_dirs, host=args.host, port=args.port, graph=args.graph)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m drmas_graph.ui``: the same as ``drmas-graph ui``."""
    from drmas_graph.errors import DrmasError

    parser = argparse.ArgumentParser(prog="python -m drmas_graph.ui", description="Serve the drmas-graph web UI.")
    add_ui_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return _cmd_ui(args)
    except DrmasError as e:
        print(f"drmas-graph: error: {e}", file=sys.stderr)
        return 2
