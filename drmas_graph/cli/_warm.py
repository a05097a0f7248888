"""`drmas-graph warm-start` (registered by `drmas_graph.cli.build_parser`): the warm start of a config alone.

    drmas-graph warm-start CONFIG.yaml [--set key.sub=value ...]

`drmas-graph train` runs the warm start first when the config has a `warm_start` section; this command runs only it
(supervised fine-tuning of each agent on its demonstrations), into the run folder, where a later `drmas-graph train`
starts the RL from its checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from drmas_graph.cli._train import build_graph_and_env
from drmas_graph.config import load_config
from drmas_graph.errors import ConfigError

__all__ = ["add_warm_command"]


def add_warm_command(groups: Any) -> None:
    p = groups.add_parser("warm-start", help="supervised fine-tuning of each agent on its demonstrations (the config's "
                                             "warm_start section) alone, before `drmas-graph train`")
    p.add_argument("config", type=Path, help="YAML training config with a `warm_start` section")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.set_defaults(func=_cmd_warm_start)


def _cmd_warm_start(args: argparse.Namespace, console: Console) -> int:
    from drmas_graph.train import RunDirInUseError, free_run_dir
    from drmas_graph.train.engines import distributed
    from drmas_graph.train.loop.warm_start import warm_start

    cfg = load_config(args.config, args.set)
    if cfg.warm_start is None:
        raise ConfigError(f"{args.config} has no `warm_start` section; add one, e.g. `warm_start: {{demonstrations: "
                          "demos.jsonl}` (OpenAI fine-tuning JSONL whose records name their \"agent\")")
    graph, env = build_graph_and_env(cfg)
    if distributed.is_main():
        console.print(f"warm start of {cfg.name}: run folder {cfg.run_dir}", markup=False)
    try:
        result = warm_start(graph, env, cfg)
    except RunDirInUseError as exc:
        raise ConfigError(f"run folder {exc.run_dir} already holds a run; warm-start into a new folder with `--set "
                          f"run_dir={free_run_dir(exc.run_dir)}`") from None
    except KeyboardInterrupt:
        if distributed.is_main():
            print(f"drmas-graph: interrupted; the warm start saved nothing: run `drmas-graph warm-start {args.config}` "
                  "again (it starts over)", file=sys.stderr)
        return 130
    finally:
        distributed.shutdown()
    if distributed.is_main():
        console.print(result.summary(), markup=False, soft_wrap=True)
        console.print(f"next: drmas-graph train {args.config}   (the RL starts from {result.checkpoint})", markup=False,
                      soft_wrap=True)
    return 0
