"""The ``drmas-graph`` command line.

Commands come in groups (``drmas-graph GROUP COMMAND ...``). Each group has one ``_add_<group>_commands``
function that registers its sub-parsers; each command is a ``_cmd_<name>(args, console) -> int`` set as
the parser's ``func`` default. A new group (``train``, ``eval``) adds its function to `build_parser`.

    drmas-graph traces list PATH [--step N] [--agent A] [--task T] [--failed | --ok] [--limit N]
    drmas-graph traces show PATH EPISODE
    drmas-graph traces stats PATH
    drmas-graph traces export PATH --format jsonl|parquet [--out FILE] [--agent A] [--step N]
    drmas-graph traces export --weave PROJECT RUN_DIR [--sample-per-step N]
    drmas-graph traces replay PATH EPISODE --graph module:attr
    drmas-graph traces rescore PATH --reward module:attr [--episodes trained|ok|all] [--step N] [--out FILE]
    drmas-graph train CONFIG.yaml [--set key=value ...]
    drmas-graph eval CONFIG.yaml [--checkpoint DIR] [--split S] [--k K] [--n-tasks N]
    drmas-graph config-doc

Errors drmas-graph raises on purpose (a missing file, a corrupt store, an unknown episode) print one
line on stderr and exit with status 2; argparse usage errors exit with 2 as well.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from drmas_graph.errors import ConfigError, DrmasError
from drmas_graph.store import TraceStore
from drmas_graph.types import Episode, Turn

__all__ = ["main", "build_parser"]

_SNIPPET_CHARS = 240
"""Longest prompt/response excerpt `traces show` prints."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (0 ok, 1 replay diverged, 2 error)."""
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
    _add_traces_commands(groups)
    from drmas_graph._cli_train import add_train_commands

    add_train_commands(groups)
    return parser


def _console() -> Console:
    """Rich console on the current stdout; plain text of a fixed width when stdout is not a terminal."""
    if sys.stdout.isatty():
        return Console(file=sys.stdout, highlight=False)
    return Console(file=sys.stdout, width=160, highlight=False, no_color=True, emoji=False)


# -- traces ------------------------------------------------------------------------------------------


def _add_traces_commands(groups: Any) -> None:
    traces = groups.add_parser("traces", help="inspect, export and replay recorded runs (trace stores)")
    commands = traces.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("list", help="one line per episode")
    p.add_argument("path", help="trace store (.sqlite) of a run")
    p.add_argument("--step", type=int, help="only episodes used in this training step")
    p.add_argument("--agent", help="only episodes where this agent made a call")
    p.add_argument("--task", help="only episodes of this task id")
    outcome = p.add_mutually_exclusive_group()
    outcome.add_argument("--failed", action="store_const", const=True, dest="failed", help="only failed runs")
    outcome.add_argument(
        "--ok", action="store_const", const=False, dest="failed", help="only runs that ended"
    )
    p.add_argument("--limit", type=int, help="at most this many episodes")
    p.set_defaults(func=_cmd_list)

    p = commands.add_parser("show", help="the timeline of one episode, one block per LLM call")
    p.add_argument("path", help="trace store (.sqlite) of a run")
    p.add_argument("episode", help="episode id (see `traces list`)")
    p.set_defaults(func=_cmd_show)

    p = commands.add_parser("stats", help="episode, turn and token counts, bytes per 1k tokens")
    p.add_argument("path", help="trace store (.sqlite) of a run")
    p.set_defaults(func=_cmd_stats)

    p = commands.add_parser("export", help="per-agent trajectories, one row per LLM call")
    p.add_argument("path", help="trace store (.sqlite) of a run")
    p.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    p.add_argument("--out", type=Path, help="output file (default: PATH with the format's suffix)")
    p.add_argument("--agent", help="only this agent's calls")
    p.add_argument("--step", type=int, help="only episodes used in this training step")
    p.add_argument("--weave", metavar="PROJECT", help="export to this W&B Weave project instead of a file "
                   "(PATH may be the run folder); needs the `weave` extra")
    p.add_argument("--sample-per-step", type=int, metavar="N", help="with --weave: N tasks (groups) per step")
    p.set_defaults(func=_cmd_export)

    p = commands.add_parser("replay", help="re-run a recorded episode through a graph and report divergences")
    p.add_argument("path", help="trace store (.sqlite) of a run")
    p.add_argument("episode", help="episode id (see `traces list`)")
    p.add_argument("--graph", required=True, metavar="MODULE:ATTR", help="the compiled graph to replay into")
    p.set_defaults(func=_cmd_replay)
    _add_rescore_command(commands)


def _add_rescore_command(commands: Any) -> None:
    from drmas_graph.rescore import POOLS

    p = commands.add_parser(
        "rescore", help="new rewards and advantages for a stored run from another reward function, no model",
        description="Recompute rewards and advantages of the pooled episodes (advantages are normalised over "
                    "them, group by group). Pools: " + "; ".join(f"{k}: {v}" for k, v in POOLS.items()) + ".")
    p.add_argument("path", help="trace store (.sqlite) of a run")
    p.add_argument("--reward", required=True, metavar="MODULE:ATTR",
                   help="reward function: episode -> float (team reward) or {agent: float}")
    p.add_argument("--episodes", choices=list(POOLS), default="trained",
                   help="which episodes to pool (default: trained = the episodes training used in the latest "
                        "run; eval, failed, bad-reward and pre-resume episodes are left out)")
    p.add_argument("--step", type=int, help="only the episodes of this training step")
    p.add_argument("--estimator", default="agent", help="advantage estimator (default: agent)")
    p.add_argument("--no-norm-by-std", action="store_false", dest="norm_by_std",
                   help="do not divide advantages by the group's std")
    p.add_argument("--out", type=Path, help="write the rescored episodes to this new trace store")
    p.set_defaults(func=_cmd_rescore)


def _cmd_rescore(args: argparse.Namespace, console: Console) -> int:
    from drmas_graph.rescore import rescore

    result = rescore(args.path, _import_object(args.reward), estimator=args.estimator,
                     norm_by_std=args.norm_by_std, step=args.step, episodes=args.episodes, out=args.out)
    totals: dict[str, list[float]] = {}
    for rescored in result.values():
        for agent, reward in rescored.rewards.items():
            totals.setdefault(agent, []).append(reward)
    means = ", ".join(f"{a} {sum(r) / len(r):.4f}" for a, r in sorted(totals.items()))
    console.print(f"rescored {len(result)} episodes (pool: {args.episodes}); mean reward: {means or '-'}"
                  + (f"; wrote {args.out}" if args.out else ""), markup=False)
    return 0


def _cmd_list(args: argparse.Namespace, console: Console) -> int:
    with TraceStore(args.path, readonly=True) as store:
        summaries = store.episodes(
            step=args.step, agent=args.agent, task_id=args.task, failed=args.failed, limit=args.limit
        )
    table = Table(title=Text(f"{len(summaries)} episodes in {args.path}"), title_justify="left")
    for column in ("episode", "task", "group", "step", "turns", "agents", "tokens p/r", "reward", "error"):
        table.add_column(column, overflow="fold")
    for s in summaries:
        cells = (
            s.id,
            _or_dash(s.task_id),
            _or_dash(s.group_id),
            _or_dash(s.step),
            str(s.n_turns),
            ", ".join(s.agents),
            f"{s.n_prompt_tokens}/{s.n_response_tokens}",
            _number(s.reward),
            _snippet(s.error or "", 60) or "-",
        )
        table.add_row(*map(Text, cells))  # Text: '[...]' in user data is not rich markup
    console.print(table)
    return 0


def _cmd_show(args: argparse.Namespace, console: Console) -> int:
    with TraceStore(args.path, readonly=True) as store:
        summary = store.summary(args.episode)
        episode = store.load_episode(args.episode)
    console.print(_episode_header(episode, summary.step))
    for position, turn in enumerate(episode.turns):
        console.print(_turn_block(episode, position, turn))
    return 0


def _cmd_stats(args: argparse.Namespace, console: Console) -> int:
    with TraceStore(args.path, readonly=True) as store:
        stats = store.stats()
    table = Table(title=Text(f"trace store {args.path}"), title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("episodes", stats.n_episodes),
        ("failed episodes", stats.n_failed),
        ("turns (LLM calls)", stats.n_turns),
        ("trainable turns", stats.n_trainable_turns),
        ("prompt tokens", stats.n_prompt_tokens),
        ("response tokens", stats.n_response_tokens),
        ("training steps", ", ".join(map(str, stats.steps)) or "-"),
        ("bytes on disk", stats.db_bytes),
        ("bytes per 1k tokens", f"{stats.bytes_per_1k_tokens:.0f}"),
        ("token-array bytes per 1k tokens", f"{stats.token_bytes_per_1k_tokens:.0f}"),
    ]
    rows += [(f"turns of {agent}", n) for agent, n in stats.turns_by_agent.items()]
    for what, value in rows:
        table.add_row(Text(what), Text(str(value)))
    console.print(table)
    return 0


def _cmd_export(args: argparse.Namespace, console: Console) -> int:
    if args.weave:
        from drmas_graph.weave_export import cli_export

        return cli_export(args, console)
    out = args.out or _default_export_path(Path(args.path), args.format, args.agent)
    with TraceStore(args.path, readonly=True) as store:
        n_rows = store.export(out, args.format, agent=args.agent, step=args.step)
    console.print(f"wrote {n_rows} turns to {out}", markup=False)
    return 0


def _cmd_replay(args: argparse.Namespace, console: Console) -> int:
    """Replay one stored episode into ``--graph``; exit status 1 if it diverged from the recording."""
    import asyncio

    from drmas_graph.replay import AsyncOnlyGraphError, areplay_episode, replay_episode

    graph = _import_object(args.graph)
    if callable(graph) and not hasattr(graph, "invoke") and not hasattr(graph, "compile"):
        graph = graph()  # a factory that builds the graph
    with TraceStore(args.path, readonly=True) as store:
        episode = store.load_episode(args.episode)
    try:
        result = replay_episode(graph, episode)
    except AsyncOnlyGraphError:
        result = asyncio.run(areplay_episode(graph, episode))
    if result.unreproducible:
        console.print(f"episode {episode.id} cannot be reproduced exactly: {result.unreproducible}", markup=False)
    divergences = list(result.divergences)
    if not divergences:
        same = "the recorded final state" if result.state_matches else "a DIFFERENT final state"
        console.print(f"episode {episode.id}: replay matched all {len(episode.turns)} calls and reproduced {same} "
                      f"in {result.wall_s:.3f}s", markup=False)
        if not result.state_matches:
            console.print(result.state_diff, markup=False)
        return 0 if result.state_matches else 1
    console.print(f"episode {episode.id}: {len(divergences)} divergence(s)", markup=False)
    for divergence in divergences:
        console.print(f"- {divergence}", markup=False)
    return 1


# -- helpers -----------------------------------------------------------------------------------------


def _import_object(spec: str) -> Any:
    """``package.module:attr.sub`` -> the object; a ConfigError naming the spec otherwise."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ConfigError(f"--graph {spec!r} must look like 'package.module:attribute'")
    if os.getcwd() not in sys.path:  # like `python -m`, find modules of the current project
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"--graph {spec!r}: cannot import module {module_name!r} ({e})") from e
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ConfigError(f"--graph {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    return obj


def _default_export_path(path: Path, format: str, agent: str | None) -> Path:
    suffix = f".{agent.replace('/', '_')}.{format}" if agent else f".{format}"
    return path.with_name(path.stem + suffix)


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _snippet(text: str, limit: int = _SNIPPET_CHARS) -> str:
    """One line of at most `limit` characters; a cut is marked with '…' (and the kept head)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _message_text(message: Any) -> str:
    content = message.content
    if isinstance(content, list):  # content blocks: keep the text ones
        content = " ".join(
            block.get("text", "") if isinstance(block, dict) else str(block) for block in content
        )
    return f"{message.type}: {content}"


def _episode_header(episode: Episode, train_step: int | None) -> Panel:
    rewards = ", ".join(f"{agent}={_number(r)}" for agent, r in episode.rewards.items()) or "-"
    wall = episode.timings.get("wall_s")
    lines = [
        f"task {_or_dash(episode.task_id)}   group {_or_dash(episode.group_id)}   "
        f"training step {_or_dash(train_step)}",
        f"turns {len(episode.turns)}   agents {', '.join(episode.agents) or '-'}   "
        f"wall {'-' if wall is None else f'{wall:.2f}s'}",
        f"rewards {rewards}",
        f"error {episode.error or '-'}",
    ]
    return Panel(Text("\n".join(lines)), title=Text(f"episode {episode.id}"), title_align="left")


def _turn_block(episode: Episode, position: int, turn: Turn) -> Panel:
    turn_reward = None if episode.turn_rewards is None else episode.turn_rewards[position]
    advantage = None if episode.advantages is None else episode.advantages[position]
    policy = f"{turn.policy}@{_or_dash(turn.policy_version)}" if turn.policy else "app model"
    policy += "" if turn.trainable else " (not trainable)"
    title = f"#{position}  node {turn.node}  agent {turn.agent}  step {turn.step}"
    facts = (
        f"tokens prompt {turn.n_prompt_tokens} / response {turn.n_response_tokens}   "
        f"finish {turn.finish_reason}   policy {policy}   latency {turn.latency_s:.3f}s\n"
        f"reward {_number(turn_reward)}   advantage {_number(advantage)}"
    )
    prompt = _snippet(_message_text(turn.messages[-1])) if turn.messages else "(no messages)"
    body = [
        Text(facts),
        Text(f"prompt   {prompt}"),
        Text(f"response {_snippet(turn.response_text) or '(empty)'}"),
    ]
    if turn.tool_calls:
        calls = ", ".join(f"{c.get('name')}({_snippet(str(c.get('args', {})), 80)})" for c in turn.tool_calls)
        body.append(Text(f"tools    {calls}"))
    return Panel(Group(*body), title=Text(title), title_align="left")


if __name__ == "__main__":  # python -m drmas_graph.cli (torchrun -m, deepspeed --module)
    sys.exit(main())
