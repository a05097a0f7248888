"""`drmas-graph train`, `drmas-graph eval` and `drmas-graph config-doc` (registered by `drmas_graph.cli.build_parser`).

    drmas-graph train CONFIG.yaml [--set key.sub=value ...]
    drmas-graph eval CONFIG.yaml [--checkpoint DIR] [--split test] [--k 16] [--n-tasks N] [--set ...]
    drmas-graph check CONFIG.yaml [--groups N] [--set ...]
    drmas-graph config-doc
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from drmas_graph._importing import import_spec
from drmas_graph.cli._imports import StandInChatModel, build_graph
from drmas_graph.config import TaskFilesConfig, TrainConfig, config_reference, load_config
from drmas_graph.errors import ConfigError, RolloutError

__all__ = ["add_train_commands", "StandInChatModel", "attached_servers", "build_graph_and_env", "eval_dir",
           "point_at_checkpoint"]


def build_graph_and_env(cfg: TrainConfig) -> tuple[Any, Any]:
    """Import and build the graph and environment a config names ('module:attr' + kwargs), or the environment
    of an `env` mapping of task files (`drmas_graph.task_files`; a judge caches in the run folder)."""

    if not cfg.graph or not cfg.env:
        raise ConfigError("the config must name `graph` as 'module:attr' and `env` as 'module:attr' or a mapping of "
                          "task files (tasks, input, reward) for the CLI")
    graph = build_graph(cfg.graph, cfg.graph_kwargs, setting="graph")
    if isinstance(cfg.env, TaskFilesConfig):
        from drmas_graph.task_files import env_from_config

        return graph, env_from_config(cfg.env, run_dir=cfg.run_dir)
    env_factory = import_spec(cfg.env, setting="env")
    env = env_factory(**cfg.env_kwargs) if callable(env_factory) else env_factory
    return graph, env


def add_train_commands(groups: Any) -> None:
    p = groups.add_parser("train", help="train a graph's policies with agent-wise GRPO from a YAML config (after its "
                                        "warm start, when the config has a `warm_start` section)")
    p.add_argument("config", type=Path, help="YAML training config (see `drmas-graph config-doc`)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in run_dir from its last checkpoint (the same as --set resume=true)")
    p.set_defaults(func=_cmd_train)

    p = groups.add_parser("eval", help="avg@k and pass@k of a checkpoint (or the base models) on a split; its "
                                       "episodes are shown as they end (done / total, elapsed, ETA), a line at each tenth")
    p.add_argument("config", type=Path, help="the run's YAML config")
    p.add_argument("--checkpoint", type=Path, help="checkpoint folder (run_dir/checkpoints/step_N); default: base models")
    p.add_argument("--split", help="task split (default: eval.split)")
    p.add_argument("--k", type=int, help="samples per task (default: eval.k)")
    p.add_argument("--n-tasks", type=int, help="first N tasks of the split (default: eval.n_tasks)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.set_defaults(func=_cmd_eval)

    p = groups.add_parser("check", help="preflight before training: do the base models' groups get different "
                          "rewards (a learning signal)?")
    p.add_argument("config", type=Path, help="the YAML training config")
    p.add_argument("--groups", type=int, default=4, help="groups (tasks) to roll out, group_size episodes each")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.set_defaults(func=_cmd_check)

    p = groups.add_parser("config-doc", help="every training config field with its default and meaning")
    p.set_defaults(func=_cmd_config_doc)


def _cmd_train(args: argparse.Namespace, console: Console) -> int:
    from drmas_graph.train import RunDirInUseError, free_run_dir, train_graph
    from drmas_graph.train.engines import distributed

    cfg = load_config(args.config, args.set + (["resume=true"] if args.resume else []))
    terminated: list[int] = []  # the signals that stopped the run
    try:
        with _terminated_as_interrupt(terminated):  # SIGTERM (a scheduler, `kill`, a launcher) stops it as Ctrl-C
            graph, env = build_graph_and_env(cfg)
            if distributed.is_main():  # under a launcher, rank 0 alone reports
                console.print(f"training {cfg.name}: run folder {cfg.run_dir}", markup=False)
            result = train_graph(graph, env, cfg)
    except RunDirInUseError as exc:
        raise ConfigError(f"run folder {exc.run_dir} already holds a run; train into a new folder with `--set "
                          f"run_dir={free_run_dir(exc.run_dir)}`, or continue this run from its last checkpoint "
                          "with `--resume`") from None
    except RolloutError as exc:  # a step had nothing to train on: what the run measured, then the error
        if getattr(exc, "result", None) is not None and distributed.is_main():
            console.print(exc.result.summary(), markup=False, soft_wrap=True)
        raise
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (`_terminated_as_interrupt`)
        if distributed.is_main():
            print(f"drmas-graph: {'terminated (SIGTERM)' if terminated else 'interrupted'}; "
                  f"{_saved(cfg, args.config)}", file=sys.stderr)
        return TERMINATED_EXIT if terminated else INTERRUPTED_EXIT
    finally:
        distributed.shutdown()
    if distributed.is_main():
        console.print(result.summary(), markup=False, soft_wrap=True)
        run_dir = Path(cfg.run_dir)
        console.print(f"look at it: drmas-graph ui {run_dir}   (episodes: drmas-graph traces list "
                      f"{run_dir / 'traces.db'})", markup=False, soft_wrap=True)
    return 0


INTERRUPTED_EXIT = 130
"""`drmas-graph train`'s exit status after Ctrl-C (128 + SIGINT, as a shell reports it)."""
TERMINATED_EXIT = 143
"""`drmas-graph train`'s exit status after SIGTERM (128 + SIGTERM, what the signal's default action gives)."""


@contextmanager
def _terminated_as_interrupt(received: list[int]) -> Iterator[None]:
    """Inside the block SIGTERM raises `KeyboardInterrupt` in the main thread, exactly where Ctrl-C raises it, after
    adding the signal to `received`: the run stops the same way, with the same guarantees (every checkpoint whole
    or absent, the traces closed, the rollouts cancelled), and the command says what was saved. A handler can be
    set only in the main thread (elsewhere SIGTERM keeps its own); the previous one is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        received.append(signum)
        raise KeyboardInterrupt(f"signal {signum} (SIGTERM)")

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _saved(cfg: TrainConfig, config: Path) -> str:
    """What an interrupted run saved, and the command that continues it."""
    from drmas_graph.train import checkpoint_step, free_run_dir
    from drmas_graph.train.loop.warm_start import warm_start_state

    ckpts = sorted((Path(cfg.run_dir) / "checkpoints").glob("step_*"))
    warm = warm_start_state(cfg.run_dir) if cfg.warm_start is not None and not ckpts else None
    if warm is not None:  # nothing of the RL was saved; the warm start is kept, or starts over
        return (f"the warm start is saved; `drmas-graph train {config} --resume` starts the RL from it" if warm == "done"
                else f"the warm start did not finish; `drmas-graph train {config}` again starts it over")
    if not ckpts:
        return (f"no checkpoint was saved yet (checkpoint_every: {cfg.checkpoint_every}); its episodes are in "
                f"{Path(cfg.run_dir) / 'traces.db'}. Start again with `drmas-graph train {config} --set "
                f"run_dir={free_run_dir(Path(cfg.run_dir))}`")
    step = checkpoint_step(ckpts[-1])
    return (f"last checkpoint {ckpts[-1]} ({step} of {cfg.steps} steps done); continue with "
            f"`drmas-graph train {config} --resume`")


def _cmd_eval(args: argparse.Namespace, console: Console) -> int:
    from drmas_graph.train import Trainer, checkpoint_step, load_checkpoint_adapters, reply_lines
    from drmas_graph.train.loop.evaluate import evaluate
    from drmas_graph.train.loop.metrics import EpisodeProgress
    from drmas_graph.train.engines import distributed

    overrides = list(args.set)
    if args.k:
        overrides.append(f"eval.k={args.k}")
    if args.n_tasks:
        overrides.append(f"eval.n_tasks={args.n_tasks}")
    cfg = load_config(args.config, overrides)
    from_checkpoint = point_at_checkpoint(cfg, args.checkpoint) if args.checkpoint is not None else []
    graph, env = build_graph_and_env(cfg)  # in the run's folder: a judge reads (and adds to) the run's cache
    cfg.run_dir = str(eval_dir(Path(cfg.run_dir), args.checkpoint, args.split or cfg.eval.split, cfg.eval.k))
    trainer = Trainer(graph, env, cfg, train=False)
    try:
        if args.checkpoint is not None:
            load_checkpoint_adapters(trainer, args.checkpoint)  # LoRA: into the models, and their servers
        for name in attached_servers(cfg, from_checkpoint):  # they serve what they held: push the checkpoint
            trainer.sync_weights(name, version=trainer.state.models[name].policy.version)
            if distributed.is_main():
                mc = cfg.models[name]
                console.print(f"model {name}: loaded {mc.path} into its servers {', '.join(mc.serve.urls)} (they keep "
                              "serving it after this evaluation)", markup=False)
        # a checkpoint samples with the seeds of its step's evaluation: it reproduces the run's own
        step = checkpoint_step(args.checkpoint) if args.checkpoint is not None else 0
        progress = EpisodeProgress(f"evaluation on {args.split or cfg.eval.split}") if distributed.is_main() else None
        # sharded over the processes of a launcher (rank 0 shows its own share's progress)
        record = evaluate(trainer, step=step, split=args.split, progress=progress)
        distributed.remove_rank_stores(trainer.state.run_dir, trainer.state.store.close)
        main = distributed.is_main()
    finally:
        trainer.close()
        distributed.shutdown()
    if not main:
        return 0
    table = Table(title=f"{args.checkpoint or 'base models'} on {record['split']} ({record['tasks']} tasks)")
    for col in ("metric", "value"):
        table.add_column(col)
    for key, value in record.items():
        if key not in ("step", "split") and not key.endswith("/top_replies"):
            table.add_row(key.replace("@k", f"@{record['k']}"), f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    for line in reply_lines(record):
        console.print(line, markup=False)
    (Path(cfg.run_dir) / "eval.json").write_text(json.dumps(record, indent=1) + "\n")
    console.print(f"episodes, config and results (eval.json): {cfg.run_dir}", markup=False)
    return 0


def _cmd_check(args: argparse.Namespace, console: Console) -> int:
    from drmas_graph.train import NO_SIGNAL_EXIT, Trainer, preflight
    from drmas_graph.train.loop.metrics import EpisodeProgress

    if args.groups < 1:
        raise ConfigError(f"--groups must be at least 1 (got {args.groups})")
    cfg = load_config(args.config, args.set)
    cfg.run_dir = str(numbered_dir(Path(cfg.run_dir) / "check", f"base-g{args.groups}"))
    with removed_on_failure(Path(cfg.run_dir)):  # a failed set-up leaves no empty base-gN behind
        graph, env = build_graph_and_env(cfg)
        trainer = Trainer(graph, env, cfg, train=False)
    try:
        report = preflight(trainer, args.groups, progress=EpisodeProgress(f"check, {args.groups} groups"))
    finally:
        trainer.close()
    for line in report.lines():
        console.print(line, markup=False, soft_wrap=True)  # a URL or a fix stays on its line, whole
    console.print(f"episodes: {cfg.run_dir}", markup=False)
    return 0 if report.has_signal else NO_SIGNAL_EXIT


def point_at_checkpoint(cfg: TrainConfig, checkpoint: Path) -> list[str]:
    """Point every trainable full model whose weights the checkpoint holds (``<checkpoint>/<model>/model``) at
    them, in place; return their names. LoRA models keep their base (their adapters load into the trainer)."""
    if not checkpoint.is_dir():
        raise ConfigError(f"checkpoint {str(checkpoint)!r} is not a folder")
    names = []
    for name, model in list(cfg.models.items()):
        path = checkpoint / name / "model"
        if model.trainable and path.is_dir() and model.lora is None:
            cfg.models[name] = model.model_copy(update={"path": str(path), "gguf_file": None, "tiny": None})
            names.append(name)
    return names


def attached_servers(cfg: TrainConfig, names: list[str]) -> list[str]:
    """Those of `names` served by servers the run attaches to (`serve.urls`): they were started elsewhere and
    hold their own weights, so the checkpoint must be pushed to them (launched servers start from `path`)."""
    return [n for n in names if cfg.models[n].serve is not None and not cfg.models[n].serve.launch]


def eval_dir(run_dir: Path, checkpoint: Path | None, split: str, k: int) -> Path:
    """A new folder per `drmas-graph eval`: run_dir/eval/<checkpoint|base>-<split>-k<k>[-2, -3, ...] (each with its
    own traces.db and config.yaml, so evaluations with other settings never collide)."""
    return numbered_dir(run_dir / "eval", f"{checkpoint.name if checkpoint is not None else 'base'}-{split}-k{k}")


@contextmanager
def removed_on_failure(folder: Path) -> Iterator[Path]:
    """Set up a run in the new `folder`: when the block raises, the folder (made by the set-up, holding no
    episode yet) is removed, so the next command takes its name instead of a `-2` one."""
    existed = folder.exists()
    try:
        yield folder
    except BaseException:
        if not existed:
            shutil.rmtree(folder, ignore_errors=True)
        raise


def numbered_dir(root: Path, label: str) -> Path:
    """root/label, or root/label-2, -3, ... when it exists."""
    path, n = root / label, 1
    while path.exists():
        n += 1
        path = root / f"{label}-{n}"
    return path


def _cmd_config_doc(args: argparse.Namespace, console: Console) -> int:
    for field, default, description in config_reference():
        console.print(f"{field:<36} {default:<14} {description}", markup=False)
    return 0
