"""`drmas-graph ui` and `python -m drmas_graph.ui`: the command line of the web UI (`drmas_graph.ui`).

    drmas-graph ui RUN_DIR [RUN_DIR ...] [--port 8000] [--host 127.0.0.1] [--graph module:attr]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from drmas_graph.cli._imports import build_graph
from drmas_graph.errors import DrmasError
from drmas_graph.ui import serve

__all__ = ["add_ui_command", "main"]


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
    graph = build_graph(args.graph) if args.graph else None
    serve(args.run_dirs, host=args.host, port=args.port, graph=graph, graph_spec=args.graph)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m drmas_graph.ui``: the same as ``drmas-graph ui``."""
    parser = argparse.ArgumentParser(prog="python -m drmas_graph.ui", description="Serve the drmas-graph web UI.")
    add_ui_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return _cmd_ui(args)
    except DrmasError as e:
        print(f"drmas-graph: error: {e}", file=sys.stderr)
        return 2
