"""Multi-process `train_graph`: ranks, sharding of task groups, reductions, rank-0 gating, trace-store merge.

A launcher starts one process per accelerator and tells each who it is through the environment:

    torchrun --nproc_per_node N -m drmas_graph.cli train cfg.yaml          # RANK, WORLD_SIZE, LOCAL_RANK, ...
    deepspeed --num_gpus N --module drmas_graph.cli train cfg.yaml         # the same variables, and also
                                                                           # `--local_rank=R` before the args

`init_process_group` joins that group (through DeepSpeed when a model trains on it, else torch.distributed:
NCCL on CUDA, gloo on CPU). Nothing else here starts processes or moves tensors by hand: the update is the
`ModelUpdater`'s (gradients all-reduced by DeepSpeed / torch, normalizers summed over processes); this
module decides who does what around it.

- Sharding: a step's B task groups are cut into P contiguous blocks, rank r runs groups [rB/P, (r+1)B/P).
  A group never splits, so every advantage pool (group, agent) is computed on one rank, exactly as one
  process would. `owned` yields each group with its *global* index (its identity for seeds and ids).
  Evaluation tasks are sharded the same way (uneven blocks allowed) and the counts gathered (and the
  rollouts, when rank 0 exports them to Weave: `merge_rollouts`).
- Reductions: the step's scored episodes (slimmed: no messages, prompts or graph state) are gathered to
  every rank, so the step record is computed over all groups, identically everywhere.
- Served models (`serve.urls`): every rank rolls out through the same servers; after an update rank 0 writes
  run_dir/sync/<model> and pushes it, the others wait for it (`serve.launch` is refused: one server per rank).
- Rank 0 alone writes metrics.jsonl / TensorBoard / W&B / the progress bar (`NullLogger` elsewhere),
  config.yaml and the non-sharded parts of checkpoints; every rank takes part in saving (DeepSpeed writes
  each rank's optimizer partition).
- Traces: rank 0 writes run_dir/traces.db, rank r > 0 its own run_dir/traces.rank<r>.db (one writer per
  SQLite file: no lock contention between ranks, each file crash-safe on its own). At every step end, once
  all ranks have recorded their training data and checkpointed their write-ahead logs, rank 0 copies the
  episodes it does not hold yet from every traces.rank*.db (read as immutable files) into traces.db (one transaction per file, keyed by episode id, so each episode lands
  exactly once even if a merge is repeated); at the end of a run the rank files are merged and removed.
  Files left by a killed run are merged by the next run in that folder, whatever its world size.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from drmas_graph.engine import group_initialized, local_rank, rank, world_size
from drmas_graph.env import Group
from drmas_graph.errors import ConfigError, TraceStoreError

__all__ = [
    "NullLogger", "barrier", "check_divisible", "check_no_launch", "check_resume_world", "gather", "init_process_group",
    "is_main", "local_rank", "merge_eval", "merge_rollouts", "merge_step", "merge_traces", "owned",
    "rank", "shutdown", "remove_rank_stores", "store_path", "world_size",
]

T = TypeVar("T")

_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_RANK_STORE_GLOB = "traces.rank*.db"
_objects_group: Any = None
"""A gloo group for object collectives when the default group is NCCL (objects travel on CPU)."""


# --- who am I (`_world`: the launcher's variables before the process group exists, the group after) -----


def is_main() -> bool:
    """Rank 0: the process that writes the run's metrics, config and checkpoint metadata."""
    return rank() == 0


# --- the process group -----------------------------------------------------------------------------------


def init_process_group(use_deepspeed: bool) -> None:
    """Join the launcher's process group, if a launcher started several processes (no-op otherwise).

    With DeepSpeed in use, `deepspeed.init_distributed` does it (it picks NCCL on CUDA, gloo on CPU, as the
    updater's engines expect); else torch.distributed with NCCL on CUDA, gloo on CPU.
    """
    if world_size() <= 1 or group_initialized():
        return
    missing = [k for k in _LAUNCHER_ENV if k not in os.environ]
    if missing:
        raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but the environment lacks {', '.join(missing)}; "
                          "launch with torchrun or the deepspeed launcher (they set all of "
                          f"{', '.join(_LAUNCHER_ENV)})")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
    if use_deepspeed:
        from drmas_graph.train.engines._engines import _import_deepspeed, _init_process_group

        _init_process_group(_import_deepspeed())
    else:
        from drmas_graph.train.engines._engines import destroy_gloo_group_at_exit

        torch.distributed.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        destroy_gloo_group_at_exit()


def shutdown() -> None:
    """Leave a multi-process group at the end of a command, so that the process exits cleanly instead of
    tearing down the communication threads during interpreter exit (a 1-process group is kept: later
    DeepSpeed engines in this process reuse it)."""
    global _objects_group
    if group_initialized() and world_size() > 1:
        torch.distributed.destroy_process_group()
        _objects_group = None


def _group() -> Any:
    global _objects_group
    if torch.distributed.get_backend() == "gloo":
        return None
    if _objects_group is None:
        _objects_group = torch.distributed.new_group(backend="gloo")
    return _objects_group


def barrier(timeout_s: float | None = None) -> None:
    """Wait for every rank (no-op in one process). With `timeout_s`: a monitored barrier (gloo), which raises a
    RuntimeError naming the ranks that did not arrive within that many seconds."""
    if world_size() > 1 and timeout_s is None:
        torch.distributed.barrier(group=_group())
    elif world_size() > 1:
        torch.distributed.monitored_barrier(group=_group(), timeout=datetime.timedelta(seconds=timeout_s),
                                            wait_all_ranks=True)


def gather(obj: T) -> list[T]:
    """`obj` of every rank, in rank order, on every rank (picklable objects; a collective call)."""
    if world_size() == 1:
        return [obj]
    parts: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(parts, obj, group=_group())
    return parts


# --- validation ------------------------------------------------------------------------------------------


def check_divisible(tasks_per_step: int, processes: int | None = None) -> None:
    """Every rank runs the same number of whole groups: tasks_per_step must be a multiple of the processes."""
    processes = processes or world_size()
    if tasks_per_step % processes:
        fits = [n for n in range(1, tasks_per_step + 1) if tasks_per_step % n == 0]
        raise ConfigError(
            f"tasks_per_step={tasks_per_step} is not divisible by the number of processes ({processes}): each "
            f"process runs whole task groups, the same number on every process; set tasks_per_step to a multiple "
            f"of {processes} (e.g. {processes * max(1, round(tasks_per_step / processes))}) or launch "
            f"{' or '.join(map(str, fits))} processes")


def check_no_launch(launch_by_model: dict[str, bool]) -> None:
    """Under a multi-process launcher, served models attach to servers every rank shares (`serve.urls`):
    `serve.launch` would start one server per process, and rank 0 pushes new weights to its own only."""
    launched = sorted(name for name, launch in launch_by_model.items() if launch)
    if launched and world_size() > 1:
        raise ConfigError(
            f"models.{launched[0]}.serve.launch: true would start one server per process ({world_size()} "
            "processes); start the servers once and give every process their addresses in serve.urls (rank 0 "
            "pushes the new weights to all of them after each update)")


def check_zero3_served(embedded_zero3: list[str]) -> None:
    """ZeRO-3 shards the weights over processes: an embedded policy generating from them would gather them in
    every forward pass, and processes generating different batches would wait on each other forever."""
    if embedded_zero3 and world_size() > 1:
        raise ConfigError(
            f"models.{embedded_zero3[0]}: update.zero_stage 3 under {world_size()} processes needs served "
            "rollouts (models.<name>.serve: the local copy trains, the servers generate); for an embedded policy "
            "use zero_stage 1 or 2")


def check_resume_world(saved: int | None, now: int, zero_stages: dict[str, int]) -> None:
    """A checkpoint saved with `saved` processes can be resumed with `now` processes, unless a model's
    optimizer state is partitioned over processes (DeepSpeed ZeRO-1/2: one partition per rank)."""
    saved = saved or 1
    partitioned = {name: stage for name, stage in zero_stages.items() if stage >= 1}
    if saved != now and partitioned:
        names = ", ".join(f"{n} (zero_stage={s})" for n, s in sorted(partitioned.items()))
        raise ConfigError(
            f"the checkpoint was saved by {saved} processes and this run has {now}: the DeepSpeed ZeRO "
            f"optimizer state of {names} is split into {saved} partitions; resume with {saved} processes, "
            "or train with update.zero_stage: 0 (or backend: torch) to resume at any world size")


# --- sharding --------------------------------------------------------------------------------------------


def owned(items: Sequence[T]) -> list[tuple[int, T]]:
    """(global index, item) of this rank's contiguous block of `items` (all of them in one process)."""
    n, p, r = len(items), world_size(), rank()
    return [(i, items[i]) for i in range(r * n // p, (r + 1) * n // p)]


# --- reductions ------------------------------------------------------------------------------------------


def _slim(episode: Any) -> Any:
    """The episode without what the step metrics never read (messages, prompts, graph input and state; of the tool
    calls and tool schemas only their names, which `_scoring.tool_use` counts): small to send, and free of user
    objects that may not pickle."""
    turns = [dataclasses.replace(t, messages=(), prompt_ids=(), tool_calls=tuple(_named(c) for c in t.tool_calls),
                                 tools=tuple(_named(x.get("function", x)) for x in t.tools)) for t in episode.turns]
    return dataclasses.replace(episode, turns=turns, input=None, final_state=None, metadata={}, segments=[])


def _named(item: Any) -> dict[str, Any]:
    return {"name": str(item.get("name"))}


def merge_step(groups: list[Group], counts: dict[str, int], adv_stats: Any) -> tuple[list[Group], dict[str, int], Any]:
    """The step's groups, counts and advantage-pool stats of every rank, in rank order. Tasks come back as None
    and episodes slimmed (`_slim`); counts and pool stats are summed."""
    if world_size() == 1:
        return groups, counts, adv_stats
    slim = [dataclasses.replace(g, task=None, episodes=tuple(_slim(ep) for ep in g.episodes)) for g in groups]
    parts = gather((slim, counts, adv_stats))
    merged_counts: dict[str, int] = {}
    for _, part_counts, _ in parts:
        for key, value in part_counts.items():
            merged_counts[key] = merged_counts.get(key, 0) + value
    stats = [s for _, _, s in parts if s is not None]
    merged_stats = type(stats[0])(**{f.name: sum(getattr(s, f.name) for s in stats)
                                     for f in dataclasses.fields(stats[0])}) if stats else None
    return [row for part, _, _ in parts for row in part], merged_counts, merged_stats


def merge_eval(successes: dict[str, list[bool]], per_agent: dict[str, dict[str, list[float]]],
               counts: dict[str, int], n_runs: int
               ) -> tuple[dict[str, list[bool]], dict[str, dict[str, list[float]]], dict[str, int], int]:
    """An evaluation's per-task successes, per-agent value lists, counts and episode count over all ranks."""
    if world_size() == 1:
        return successes, per_agent, counts, n_runs
    all_successes: dict[str, list[bool]] = {task: [] for task in successes}
    all_agents: dict[str, dict[str, list[float]]] = {}
    all_counts: dict[str, int] = {}
    total = 0
    for part_successes, part_agents, part_counts, part_runs in gather((successes, per_agent, counts, n_runs)):
        for task, values in part_successes.items():
            all_successes.setdefault(task, []).extend(values)
        for agent, stats in part_agents.items():
            for key, values in stats.items():
                all_agents.setdefault(agent, {}).setdefault(key, []).extend(values)
        for key, value in part_counts.items():
            all_counts[key] = all_counts.get(key, 0) + value
        total += part_runs
    return all_successes, all_agents, all_counts, total


def merge_rollouts(rollouts: list[tuple[Any, Any, Any, bool]], tasks: Sequence[Any], portable: Callable[[Any], Any]
                   ) -> list[tuple[Any, Any, Any, bool]]:
    """An evaluation's (task, episode, score, success) rows of every rank, in rank order, on every rank (a
    collective call). Tasks travel as their ids and come back as the objects of `tasks` (every rank holds the
    same list); episodes travel as `portable(episode)` (free of user objects that may not pickle)."""
    if world_size() == 1:
        return rollouts
    by_id = {task.id: task for task in tasks}
    parts = gather([(task.id, portable(episode), score, ok) for task, episode, score, ok in rollouts])
    return [(by_id[task_id], episode, score, ok) for part in parts for task_id, episode, score, ok in part]


class NullLogger:
    """What ranks other than 0 get instead of a `RunLogger`: they write no metrics."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log(self, record: dict[str, Any]) -> None:
        pass

    def progress(self, step: int, record: dict[str, Any]) -> None:
        pass

    def episodes(self, label: str) -> None:
        return None

    def close(self) -> None:
        pass


# --- traces ----------------------------------------------------------------------------------------------


def store_path(run_dir: Path) -> Path:
    """This rank's trace store: run_dir/traces.db on rank 0, run_dir/traces.rank<r>.db on rank r > 0."""
    return run_dir / "traces.db" if is_main() else run_dir / f"traces.rank{rank()}.db"


def merge_traces(run_dir: Path) -> int:
    """Rank 0 copies the episodes it lacks from every run_dir/traces.rank*.db into run_dir/traces.db.

    Call it at a step boundary. Each rank r > 0 first writes a snapshot of its store (`_snapshot`: SQLite's
    backup, one read transaction, so the rollouts and scoring its background threads go on writing under
    asynchronous training neither block it nor tear it), so rank 0 reads plain database files and never shares
    SQLite's WAL index with another process (which SQLite does not support across machines); files no running
    rank owns (left by a killed run with more processes) rank 0 checkpoints itself. What a rank writes into an
    episode after it was copied (its scoring: an error, a judgement) is copied by a later merge
    (`_merge_late_writes`). Returns the episodes copied (0 on other ranks).
    """
    if not is_main():
        _snapshot(store_path(run_dir))
    barrier()
    copied = 0
    if is_main():
        for path in sorted(run_dir.glob(_RANK_STORE_GLOB)):
            if _file_rank(path) >= world_size():
                _checkpoint(path)
            source = path if _file_rank(path) >= world_size() else Path(f"{path}{_SNAPSHOT_SUFFIX}")
            copied += _merge_store(run_dir / "traces.db", source)
    barrier()
    return copied


def remove_rank_stores(run_dir: Path, close_own: Callable[[], None]) -> None:
    """End of a run: every rank closes its store (`close_own()`), rank 0 merges and deletes the rank files."""
    if world_size() == 1 and not any(run_dir.glob(_RANK_STORE_GLOB)):
        return
    if not is_main():
        close_own()
    barrier()
    if is_main():
        for path in sorted(run_dir.glob(_RANK_STORE_GLOB)):
            _checkpoint(path)  # its writer has closed it
            _merge_store(run_dir / "traces.db", path)
            for suffix in ("", "-wal", "-shm", _SNAPSHOT_SUFFIX):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
    barrier()


def _file_rank(path: Path) -> int:
    """r of traces.rank<r>.db."""
    return int(path.name[len("traces.rank"):-len(".db")])


_SNAPSHOT_SUFFIX = ".merge"
"""traces.rank<r>.db.merge: the snapshot of rank r's store that rank 0 merges from (not matched by the glob)."""


def _snapshot(path: Path) -> None:
    """A consistent copy of the store at `path` in `path` + `_SNAPSHOT_SUFFIX` (SQLite's online backup, all pages
    in one step: one read transaction, while this process's other connections may write)."""
    source = sqlite3.connect(str(path), timeout=60.0)
    target = sqlite3.connect(f"{path}{_SNAPSHOT_SUFFIX}")
    try:
        source.backup(target)
        target.execute("PRAGMA journal_mode=DELETE")  # every page in the file itself, for an immutable reader
    finally:
        target.close()
        source.close()


def _checkpoint(path: Path) -> None:
    """Copy the file's write-ahead log into the database file and empty it (SQLite ``wal_checkpoint(TRUNCATE)``,
    which also syncs the file), so that a reader opening it ``immutable`` sees every committed episode."""
    conn = sqlite3.connect(str(path), timeout=60.0, isolation_level=None)
    try:
        busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    finally:
        conn.close()
    if busy:
        raise TraceStoreError(f"could not checkpoint trace store {path}: another connection is using it")


def _columns(conn: sqlite3.Connection, schema: str, table: str) -> list[str]:
    return [row[1] for row in conn.execute(f"PRAGMA {schema}.table_info({table})")]


def _merge_late_writes(conn: sqlite3.Connection) -> None:
    """Into episodes copied by an earlier merge, what their process wrote since (asynchronous training scores a
    step's episodes on a background thread, after a merge may have copied them): an error (a bad reward, a judge
    failure), a judgement, and the rewards of an episode not trained on (rank 0 records the training data of the
    trained ones itself). Only values the target lacks: nothing rank 0 wrote is replaced."""
    for column in ("error", "judgement"):
        conn.execute(f"UPDATE main.episodes AS m SET {column} = s.{column} FROM src.episodes AS s "
                     f"WHERE s.id = m.id AND m.{column} IS NULL AND s.{column} IS NOT NULL")
    conn.execute("CREATE TEMP TABLE late_rewards AS SELECT m.id FROM main.episodes AS m JOIN src.episodes AS s "
                 "ON s.id = m.id WHERE m.step IS NULL AND m.reward IS NULL AND s.reward IS NOT NULL")
    conn.execute("UPDATE main.episodes AS m SET rewards = s.rewards, reward = s.reward FROM src.episodes AS s "
                 "WHERE s.id = m.id AND m.id IN (SELECT id FROM temp.late_rewards)")
    conn.execute("INSERT OR REPLACE INTO main.rewards (episode_id, agent, reward) SELECT episode_id, agent, reward "
                 "FROM src.rewards WHERE episode_id IN (SELECT id FROM temp.late_rewards)")
    conn.execute("UPDATE main.turns AS m SET turn_reward = s.turn_reward FROM src.turns AS s WHERE s.episode_id = "
                 "m.episode_id AND s.position = m.position AND m.episode_id IN (SELECT id FROM temp.late_rewards)")
    conn.execute("DROP TABLE temp.late_rewards")


def _merge_store(target: Path, source: Path) -> int:
    """Copy the episodes (with their turns and rewards) of `source` that `target` lacks, in one transaction.
    `source` is read as an immutable file: no lock, no WAL (a rank's snapshot, or a file whose writer is gone)."""
    conn = sqlite3.connect(target.resolve().as_uri(), uri=True, timeout=60.0, isolation_level=None)
    try:
        conn.execute("ATTACH DATABASE ? AS src", (source.resolve().as_uri() + "?immutable=1",))
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("CREATE TEMP TABLE new_ids AS SELECT id FROM src.episodes "
                         "WHERE id NOT IN (SELECT id FROM main.episodes) ORDER BY rowid")
            for table, key in (("episodes", "id"), ("turns", "episode_id"), ("rewards", "episode_id")):
                cols = ", ".join(_columns(conn, "main", table))
                conn.execute(f"INSERT INTO main.{table} ({cols}) SELECT {cols} FROM src.{table} "
                             f"WHERE {key} IN (SELECT id FROM temp.new_ids) ORDER BY rowid")
            copied = conn.execute("SELECT count(*) FROM temp.new_ids").fetchone()[0]
            conn.execute("DROP TABLE temp.new_ids")
            _merge_late_writes(conn)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        conn.execute("DETACH DATABASE src")
    finally:
        conn.close()
    return copied

