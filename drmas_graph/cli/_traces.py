"""`drmas-graph traces ...`: list, show, stats, export, replay and rescore a stored run (registered by
`drmas_graph.cli.build_parser`). These commands never load torch."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from drmas_graph._chat import tool_signature
from drmas_graph._importing import import_spec
from drmas_graph.cli._imports import build_graph
from drmas_graph.errors import ConfigError
from drmas_graph.traces.store import OUTCOMES, SORTS, EpisodeFilter, TraceStore
from drmas_graph.types import Episode, Turn
from drmas_graph.ui.turns import (PromptText, TokenizerFile, find_tokenizer, load_tokenizer, prompt_text, tool_use,
                                  turn_flags)

__all__ = ["add_traces_commands"]

_SNIPPET_CHARS = 240
"""Longest prompt/response excerpt `traces show` prints."""


# -- traces ------------------------------------------------------------------------------------------


def add_traces_commands(groups: Any) -> None:
    traces = groups.add_parser("traces", help="inspect, export and replay recorded runs (trace stores)")
    commands = traces.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("list", help="one line per episode (the filters and sorts of `drmas-graph ui`'s list)")
    p.add_argument("path", help="trace store of a run (run_dir/traces.db)")
    p.add_argument("--step", type=int, help="only episodes used in this training step")
    p.add_argument("--phase", choices=["train", "eval"], help="only the trainer's training or evaluation episodes")
    p.add_argument("--agent", help="only episodes where this agent made a call (reward bounds, reward sort and "
                                   "--reply then apply to it)")
    p.add_argument("--task", help="only episodes of this task id")
    p.add_argument("--group", help="only episodes of this GRPO group (exact id)")
    outcome = p.add_mutually_exclusive_group()
    outcome.add_argument("--failed", action="store_const", const=True, dest="failed", help="only failed runs")
    outcome.add_argument(
        "--ok", action="store_const", const=False, dest="failed", help="only runs that did not fail"
    )
    outcome.add_argument("--truncated", action="store_const", const="truncated", dest="outcome",
                         help="only runs a limit stopped (max_llm_calls, timeout_s, recursion_limit)")
    outcome.add_argument("--model-errors", action="store_const", const="model_error", dest="outcome",
                         help="only runs the policy's output broke (model errors)")
    outcome.add_argument("--outcome", choices=list(OUTCOMES), help="only runs with this outcome")
    p.add_argument("--min-reward", type=float, help="lowest reward (inclusive)")
    p.add_argument("--max-reward", type=float, help="highest reward (inclusive)")
    p.add_argument("--reply", help="only episodes with a reply holding these words, in order")
    p.add_argument("--sort", choices=list(SORTS), default="created", help="order (default: as written)")
    p.add_argument("--desc", action="store_true", help="descending order")
    p.add_argument("--limit", type=int, help="at most this many episodes")
    p.set_defaults(func=_cmd_list)

    p = commands.add_parser("show", help="the timeline of one episode, one block per LLM call")
    p.add_argument("path", help="trace store of a run (run_dir/traces.db)")
    p.add_argument("episode", help="episode id (see `traces list`)")
    p.add_argument("--full", action="store_true",
                   help="every prompt message and response in full (default: one folded line per message)")
    p.set_defaults(func=_cmd_show)

    p = commands.add_parser("stats", help="episode, turn and token counts, bytes per 1k tokens")
    p.add_argument("path", help="trace store of a run (run_dir/traces.db)")
    p.set_defaults(func=_cmd_stats)

    p = commands.add_parser("export", help="per-agent trajectories, one row per LLM call")
    p.add_argument("path", help="trace store of a run (run_dir/traces.db)")
    p.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    p.add_argument("--out", type=Path, help="output file (default: PATH with the format's suffix)")
    p.add_argument("--agent", help="only this agent's calls")
    p.add_argument("--step", type=int, help="only episodes used in this training step")
    p.add_argument("--weave", metavar="PROJECT", help="export to this W&B Weave project instead of a file "
                   "(PATH may be the run folder); needs the `weave` extra")
    p.add_argument("--sample-per-step", type=int, metavar="N", help="with --weave: N tasks (groups) per step")
    p.set_defaults(func=_cmd_export)

    p = commands.add_parser("replay", help="re-run a recorded episode through a graph and report divergences")
    p.add_argument("path", help="trace store of a run (run_dir/traces.db)")
    p.add_argument("episode", help="episode id (see `traces list`)")
    p.add_argument("--graph", required=True, metavar="MODULE:ATTR",
                   help="the compiled graph to replay into, or a factory that builds it (its `llm` parameter gets a "
                        "stand-in chat model, as under `drmas-graph train`: the recording answers every call)")
    p.set_defaults(func=_cmd_replay)
    _add_rescore_command(commands)


def _add_rescore_command(commands: Any) -> None:
    from drmas_graph.train.loop.rescore import POOLS

    p = commands.add_parser(
        "rescore", help="new rewards and advantages for a stored run from another reward function or a judge, "
                        "no policy model",
        description="Score the pooled episodes again through training's scoring (the run's own reward reproduces its rewards): rewards and advantages (advantages are normalised over "
                    "them, group by group). Pools: " + "; ".join(f"{k}: {v}" for k, v in POOLS.items()) + ".")
    p.add_argument("path", help="trace store of a run (run_dir/traces.db)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--reward", metavar="MODULE:ATTR",
                        help="reward function: episode -> float (team reward) or {agent: float}")
    source.add_argument("--judge", metavar="CONFIG.yaml|MODULE:ATTR",
                        help="a training config whose env has reward.judge (the judge it trains with, its tasks "
                             "with their reference answers, its cache in the config's run_dir), or a judge "
                             "(an object with reward_group(task, episodes), e.g. drmas_graph.rewards.Judge "
                             "or JudgedEnv) or a zero-argument factory returning one; called once per group, it "
                             "stores its verdict with each episode (--out). If it also has tasks(split) (a "
                             "JudgedEnv), the judge sees those tasks (reference answers); else each task is "
                             "rebuilt from the stored input")
    p.add_argument("--split", action="append", metavar="SPLIT",
                   help="with --judge: the splits of its tasks(split) to look task ids up in (repeat it; "
                        "default: train and test)")
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
    from drmas_graph.train.loop.rescore import rescore

    source, judge, tasks = "", None, None
    if args.judge:
        judge, tasks, source = _judge_and_tasks(args.judge, args.split)
    elif args.split:
        raise ConfigError("--split applies to --judge (the splits of the judge's tasks)")
    result = rescore(args.path, None if judge else import_spec(args.reward, setting="--reward"), judge=judge, tasks=tasks,
                     estimator=args.estimator, norm_by_std=args.norm_by_std, step=args.step, episodes=args.episodes,
                     out=args.out)
    totals: dict[str, list[float]] = {}
    for rescored in result.values():
        for agent, reward in rescored.rewards.items():
            totals.setdefault(agent, []).append(reward)
    means = ", ".join(f"{a} {sum(r) / len(r):.4f}" for a, r in sorted(totals.items()))
    console.print(f"rescored {len(result)} episodes (pool: {args.episodes}{source}); mean reward: {means or '-'}"
                  + (f"; wrote {args.out}" if args.out else ""), markup=False)
    if result.failed:
        console.print(f"the judge gave no usable reward to {len(result.failed)} episode(s), left out of the "
                      f"advantages" + (" (stored with their error in --out)" if args.out else "") + ":", markup=False)
        for episode_id, error in result.failed.items():
            console.print(f"- {episode_id}: {_snippet(error, 200)}", markup=False)
    return 0


def _judge_and_tasks(spec: str, splits: list[str] | None) -> tuple[Any, list[Any] | None, str]:
    """`--judge CONFIG.yaml`: the judge and tasks of a training config's `env` mapping; `--judge MODULE:ATTR`: the
    judge (the object, or what a zero-argument factory returns), the tasks of its `tasks(split)` if it has one.
    Also what the output line says about the tasks."""
    if spec.endswith((".yaml", ".yml")):
        from drmas_graph.task_files import judge_from_config, tasks_from_config

        if splits:
            raise ConfigError("--split applies to --judge MODULE:ATTR; a config's judge sees every task of its "
                              "`env.tasks` and `env.test` files")
        return judge_from_config(spec), tasks_from_config(spec), f"; judge and tasks of {spec}"
    judge = import_spec(spec, setting="--judge")
    if isinstance(judge, type) or (callable(judge) and not hasattr(judge, "reward_group")):  # a factory
        judge = judge()
    if not callable(getattr(judge, "reward_group", None)):
        raise ConfigError(f"--judge {spec!r} is a {type(judge).__name__}, not a judge: name a "
                          "drmas_graph.rewards.Judge, a JudgedEnv (or any object with reward_group(task, episodes)), "
                          "or a factory returning one")
    if not callable(getattr(judge, "tasks", None)):
        if splits:
            raise ConfigError(f"--split: the judge {spec!r} has no tasks(split); name a JudgedEnv to look tasks up")
        return judge, None, "; tasks rebuilt from the stored inputs, without reference answers"
    tasks: list[Any] = []
    for split in splits or ["train", "test"]:
        tasks += list(judge.tasks(split))
    return judge, tasks, f"; tasks of the {', '.join(splits or ['train', 'test'])} splits"


def _cmd_list(args: argparse.Namespace, console: Console) -> int:
    with TraceStore(args.path, readonly=True) as store:
        where = EpisodeFilter(step=args.step, phase=args.phase, agent=args.agent, task_id=args.task,
                              group_id=args.group, failed=args.failed, outcome=args.outcome,
                              min_reward=args.min_reward, max_reward=args.max_reward, reply=args.reply)
        summaries = store.query(where, sort=args.sort, descending=args.desc, limit=args.limit).rows
    table = Table(title=Text(f"{len(summaries)} episodes in {args.path}"), title_justify="left")
    table.add_column("episode", no_wrap=True, min_width=max((len(s.id) for s in summaries), default=7))  # copyable
    for column in ("task", "group", "step", "turns", "agents", "tokens p/r", "reward", "outcome"):
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
            _outcome_cell(s.outcome, s.error or s.truncated or s.model_error),
        )
        table.add_row(*map(Text, cells))  # Text: '[...]' in user data is not rich markup
    console.print(table)
    return 0


def _cmd_show(args: argparse.Namespace, console: Console) -> int:
    with TraceStore(args.path, readonly=True) as store:
        summary = store.summary(args.episode)
        episode = store.load_episode(args.episode)
        config = store.config
    console.print(_episode_header(episode, summary.step))
    if episode.judgement is not None:
        console.print(_judgement_block(episode.judgement, full=args.full))
    prompts = _prompt_texts(episode, Path(args.path).parent, config)
    for position, turn in enumerate(episode.turns):
        console.print(_turn_block(episode, position, turn, prompts[position], full=args.full))
    return 0


def _prompt_texts(episode: Episode, folder: Path, config: dict[str, Any]) -> list[PromptText]:
    """Each turn's prompt as text: its ids decoded with its policy's tokenizer where the store's run folder
    (`folder`) holds it, else why not (`drmas_graph.ui.turns`, as the episode page shows it)."""
    found: dict[str, tuple[Any, TokenizerFile]] = {}
    out = []
    for turn in episode.turns:
        policy = turn.policy or ""
        if policy not in found:
            where = find_tokenizer(folder, policy, config) if policy else TokenizerFile(None, "", ())
            found[policy] = (None if where.path is None else load_tokenizer(where.path), where)
        out.append(prompt_text(turn, *found[policy]))
    return out


def _cmd_stats(args: argparse.Namespace, console: Console) -> int:
    with TraceStore(args.path, readonly=True) as store:
        stats = store.stats()
    table = Table(title=Text(f"trace store {args.path}"), title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("episodes", stats.n_episodes),
        ("failed episodes", stats.n_failed),
        ("truncated episodes", stats.n_truncated),
        ("model-error episodes", stats.n_model_errors),
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
        from drmas_graph.traces.weave_export import cli_export

        return cli_export(args, console)
    out = args.out or _default_export_path(Path(args.path), args.format, args.agent)
    with TraceStore(args.path, readonly=True) as store:
        n_rows = store.export(out, args.format, agent=args.agent, step=args.step)
    console.print(f"wrote {n_rows} turns to {out}", markup=False)
    return 0


def _cmd_replay(args: argparse.Namespace, console: Console) -> int:
    """Replay one stored episode into ``--graph``; exit status 1 if it diverged from the recording. An error
    the app raises is part of the result (reproduced, or an `outcome_changed` divergence), never a traceback."""
    import asyncio

    from drmas_graph.traces.replay import AsyncOnlyGraphError, areplay_episode, replay_episode

    graph = build_graph(args.graph)
    with TraceStore(args.path, readonly=True) as store:
        episode = store.load_episode(args.episode)
    try:
        result = replay_episode(graph, episode)
    except AsyncOnlyGraphError:
        result = asyncio.run(areplay_episode(graph, episode))
    if result.unreproducible:
        console.print(f"episode {episode.id} cannot be reproduced exactly: {result.unreproducible}", markup=False)
    if episode.truncated:
        console.print(f"episode {episode.id} was truncated ({episode.truncated_by}): the recording ends where the "
                      "limit stopped it, and so does the replay", markup=False)
    divergences = list(result.divergences)
    if not divergences:
        same = "the recorded final state" if result.state_matches else "a DIFFERENT final state"
        console.print(f"episode {episode.id}: replay matched all {len(episode.turns)} calls and reproduced {same} "
                      f"in {result.wall_s:.3f}s", markup=False)
        if result.error:
            console.print(f"the re-run raised the recorded error again: {result.error}", markup=False)
        if not result.state_matches:
            console.print(result.state_diff, markup=False)
        return 0 if result.state_matches else 1
    console.print(f"episode {episode.id}: {len(divergences)} divergence(s)", markup=False)
    for divergence in divergences:
        console.print(f"- {divergence}", markup=False)
    return 1


# -- helpers -----------------------------------------------------------------------------------------


def _default_export_path(path: Path, format: str, agent: str | None) -> Path:
    suffix = f".{agent.replace('/', '_')}.{format}" if agent else f".{format}"
    return path.with_name(path.stem + suffix)


def _outcome_cell(outcome: str, reason: str | None) -> str:
    """'finished', or the outcome with the start of its reason ('truncated: max_llm_calls: ...')."""
    return outcome if not reason else f"{outcome}: {_snippet(reason, 60)}"


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
    if episode.truncated:
        lines.append(f"truncated {episode.truncated}   (kept: trained with rollout.truncated_reward)")
    if episode.model_error:
        lines.append(f"model error {episode.model_error}   (kept: trained with rollout.model_error_reward)")
    return Panel(Text("\n".join(lines)), title=Text(f"episode {episode.id}"), title_align="left")


def _judgement_block(record: dict[str, Any], *, full: bool = False) -> Panel:
    """What the judge made of the episode (`Episode.judgement`): its scores and reasons, the raw reply of its
    last attempt in full, its prompt folded to one line per message (in full with `full`)."""
    mode = record.get("mode") or "-"
    title = f"judge  mode {mode}"
    if record.get("group_size") is not None and record.get("index") is not None:
        title += f"  episode {record['index'] + 1} of {record['group_size']} judged together"
    seconds = record.get("seconds")
    cached = {True: "yes", False: "no"}.get(record.get("cached"), "-")
    lines = [
        f"model {_or_dash(record.get('model'))}   rubric {_or_dash(record.get('rubric_sha'))}   "
        f"judge calls {_or_dash(record.get('attempts'))}   tokens in {_or_dash(record.get('input_tokens'))} / out "
        f"{_or_dash(record.get('output_tokens'))}   cached {cached}   "
        f"seconds {'-' if seconds is None else f'{seconds:.2f}'}",
        f"scores {_scores(record.get('scores'))}",
    ]
    reasons = record.get("reasons")
    if isinstance(reasons, dict):
        lines += [f"reason   {agent}: {reason}" for agent, reason in reasons.items()] or ["reason   -"]
    else:
        lines.append(f"reason   {_or_dash(reasons)}")
    lines.append(f"error    {record.get('error') or '-'}")
    fold = (lambda text: str(text)) if full else _snippet
    messages = [m for m in record.get("prompt") or () if isinstance(m, dict)]
    lines += [f"prompt   {fold(str(m.get('role')) + ': ' + str(m.get('content')))}" for m in messages] or ["prompt   -"]
    replies = [str(r) for r in record.get("replies") or ()]
    if full and len(replies) > 1:  # every attempt's reply, the unusable ones too
        lines += [f"reply {k}  {reply}" for k, reply in enumerate(replies, 1)]
    else:
        lines.append(f"reply    {replies[-1] if replies else '-'}")
    return Panel(Text("\n".join(lines)), title=Text(title), title_align="left")


def _scores(scores: Any) -> str:
    """A judge's score (float) or scores ({agent: float}) as text; '-' when it gave none."""
    if isinstance(scores, dict):
        return ", ".join(f"{agent}={_number(v)}" for agent, v in scores.items()) or "-"
    return _number(scores) if isinstance(scores, int | float) else _or_dash(scores)


def _turn_block(episode: Episode, position: int, turn: Turn, prompt: PromptText, *, full: bool = False) -> Panel:
    turn_reward = None if episode.turn_rewards is None else episode.turn_rewards[position]
    advantage = None if episode.advantages is None else episode.advantages[position]
    policy = f"{turn.policy}@{_or_dash(turn.policy_version)}" if turn.policy else "app model"
    policy += "".join(f" ({label})" for label, _ in turn_flags(turn))
    title = f"#{position}  node {turn.node}  agent {turn.agent}  step {turn.step}"
    facts = (
        f"tokens prompt {turn.n_prompt_tokens} / response {turn.n_response_tokens}   "
        f"finish {turn.finish_reason}   policy {policy}   latency {turn.latency_s:.3f}s\n"
        f"reward {_number(turn_reward)}   advantage {_number(advantage)}"
    )
    fold = (lambda text: str(text)) if full else _snippet
    messages = [Text(f"message  {fold(_message_text(m))}") for m in turn.messages] or [Text("message  (none)")]
    body = [Text(facts), *messages]
    if prompt.text is None:
        body.append(Text(f"prompt   not shown exactly: {prompt.note}"))
    else:  # --full: as the policy saw it, line breaks kept; else one folded line
        body.append(Text(f"prompt   ({prompt.note})"))
        body.append(Text(prompt.text if full else f"         {_snippet(prompt.text)}"))
    if turn.tools:  # the tools the agent was given (bound, or in the request): `--full` adds their descriptions
        tools = [tool_signature(t) for t in turn.tools]
        if full:
            body += [Text(f"tool     {sig}: {t.get('function', t).get('description') or '-'}")
                     for sig, t in zip(tools, turn.tools, strict=True)]
        else:
            body.append(Text(f"tools    {fold(', '.join(tools))}"))
    body.append(Text(f"response {fold(turn.response_text) or '(empty)'}"))
    tools_used = tool_use(turn)
    if tools_used is not None:
        calls = ", ".join(c if full else _snippet(c, 80) for c in tools_used.calls)
        joint = "; parsed: " if tools_used.well_formed is False else ": "
        body.append(Text(f"calls    {fold(tools_used.note)}" + (f"{joint}{calls}" if calls else "")))
    if turn.format_error and not (tools_used and tools_used.well_formed is False):
        body.append(Text(f"invalid  {_snippet(turn.format_error)}"))
    if position == episode.model_error_turn:
        body.append(Text("this turn's output broke the app (the episode's model error)"))
    return Panel(Group(*body), title=Text(title), title_align="left")
