"""The ``drmas-graph`` command line.

Commands come in groups (``drmas-graph GROUP COMMAND ...``). Each group's module has one
``add_<group>_commands`` function that registers its sub-parsers (`_traces`: inspecting stored runs;
`_train`: training, evaluation, config docs; `_warm`: the warm start alone); each command is a ``_cmd_<name>(args, console) -> int`` set
as the parser's ``func`` default. A new group adds its function to `build_parser`.

    drmas-graph traces list PATH [--step N] [--agent A] [--task T] [--failed | --ok] [--limit N]
    drmas-graph traces show PATH EPISODE
    drmas-graph traces stats PATH
    drmas-graph traces export PATH --format jsonl|parquet [--out FILE] [--agent A] [--step N]
    drmas-graph traces export --weave PROJECT RUN_DIR [--sample-per-step N]
    drmas-graph traces replay PATH EPISODE --graph module:attr
    drmas-graph traces rescore PATH --reward module:attr [--episodes trained|ok|all] [--step N] [--out FILE]
    drmas-graph train CONFIG.yaml [--set key=value ...]
    drmas-graph warm-start CONFIG.yaml [--set key=value ...]
    drmas-graph eval CONFIG.yaml [--checkpoint DIR] [--split S] [--k K] [--n-tasks N]
    drmas-graph check CONFIG.yaml [--groups N] [--set key=value ...]
    drmas-graph config-doc

Errors drmas-graph raises on purpose (a missing file, a corrupt store, an unknown episode) print one
line on stderr and exit with status 2; argparse usage errors exit with 2 as well. `check` exits with
status 3 when no group it rolled out has any learning signal.

May import: every layer (it is the top).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from rich.console import Console

from drmas_graph.cli._traces import add_traces_commands
from drmas_graph.cli._train import add_train_commands
from drmas_graph.cli._ui import add_ui_command
from drmas_graph.cli._ui import main as ui_main  # `python -m drmas_graph.ui`
from drmas_graph.cli._warm import add_warm_command
from drmas_graph.errors import DrmasError

__all__ = ["main", "build_parser", "ui_main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (0 ok, 1 replay diverged, 2 error, 3 `check` found no learning
    signal, 130 training interrupted by Ctrl-C, 143 training stopped by SIGTERM)."""
    args = build_parser().parse_args(argv)
    if args.local_rank is not None:  # the deepspeed launcher passes --local_rank=R (and sets LOCAL_RANK)
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    console = _console()
    try:
        return args.func(args, console)
    except DrmasError as e:
        print(f"drmas-graph: error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drmas-graph", description="Train and inspect LangGraph multi-agent apps (Dr. MAS)."
    )
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # deepspeed launcher
    groups = parser.add_subparsers(dest="group", required=True, metavar="GROUP")
    add_traces_commands(groups)
    add_train_commands(groups)
    add_warm_command(groups)
    add_ui_command(groups)
    return parser


def _console() -> Console:
    """Rich console on the current stdout; plain text of a fixed width when stdout is not a terminal."""
    if sys.stdout.isatty():
        return Console(file=sys.stdout, highlight=False)
    return Console(file=sys.stdout, width=160, highlight=False, no_color=True, emoji=False)
