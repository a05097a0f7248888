"""What the UI reads from a run folder: its trace store (read-only), its metrics log and its tokenizers.

A run folder is what `train_graph` writes: ``traces.db``, ``metrics.jsonl`` and ``checkpoints/``. Only the
files named here are ever opened, found from the folders given on the command line (and the ``tokenizer.json``
of the model folder a run's config names, `turns.find_tokenizer`); no path comes from a request. The run may still be training: the store is opened read-only (SQLite WAL readers never block the
writer) and the metrics log is re-read from where the last read stopped.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drmas_graph.errors import ConfigError, StoreNotFoundError
from drmas_graph.traces.store import OUTCOMES, SORTS, EpisodeFilter, EpisodeSummary, ReplyCount, TraceStore
from drmas_graph.ui.turns import TokenizerFile, find_tokenizer, load_tokenizer

__all__ = ["Run", "EpisodeQuery", "EpisodeList", "number_param", "open_runs", "check_run_folder", "STARTING", "OUTCOMES",
           "SORTS", "PAGE_SIZES", "PHASES"]

MAX_INT = 2**63 - 1
"""The largest integer a URL parameter may hold (SQLite's INTEGER); a larger one is a 400, not an overflow."""

PAGE_SIZES = (25, 50, 100, 500)
"""Page sizes the episode list offers."""

COUNT_AT_MOST = 5_000
"""The episode list counts matches up to this many ("5000+ episodes"): counting every match of a filter that
reads each episode's row costs about a second per 100,000 episodes."""

PHASES = ("train", "eval", "all")
"""The episode list's phase choices; without one it shows training episodes (all, in a store that has none)."""


def number_param(params: Mapping[str, str], name: str, kind: type) -> Any:
    """URL parameter `name` as an int or a finite float (None when absent); ConfigError (a 400) naming it when it
    is not one, or an int beyond SQLite's range."""
    text = params.get(name, "").strip()
    if not text:
        return None
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(f"parameter {name}={text!r} is not a{'n integer' if kind is int else ' number'}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"parameter {name}={text!r} is not a finite number")
    if isinstance(value, int) and not -MAX_INT <= value <= MAX_INT:
        raise ConfigError(f"parameter {name}={text!r} is out of range (at most {MAX_INT} in size)")
    return value


@dataclass(frozen=True)
class EpisodeQuery:
    """The episode list's filters, sort and page, as they appear in the URL."""

    step: int | None = None
    """Only episodes trained in this step."""
    phase: str | None = None
    """'train', 'eval' or 'all'; None: 'train' when the store has training episodes."""
    group: str | None = None
    """Only this GRPO group."""
    agent: str | None = None
    """Only episodes where this agent made a call (reward bounds, reward sort and reply then apply to it)."""
    task: str | None = None
    """Only this task id."""
    outcome: str | None = None
    """One of `OUTCOMES`."""
    min_reward: float | None = None
    """Lowest reward (inclusive)."""
    max_reward: float | None = None
    """Highest reward (inclusive)."""
    reply: str | None = None
    """Words of a reply, in order."""
    sort: str = "created"
    """One of `SORTS`."""
    desc: bool = False
    """Descending order."""
    after: str | None = None
    """Cursor: the page after this episode."""
    before: str | None = None
    """Cursor: the page before this episode."""
    per_page: int = 50
    """One of `PAGE_SIZES`."""

    @staticmethod
    def from_params(params: dict[str, str]) -> EpisodeQuery:
        """Parse URL parameters; a bad value raises ConfigError naming the parameter."""

        def number(name: str, kind: type) -> Any:
            return number_param(params, name, kind)

        def choice(name: str, valid: Any, default: Any = None) -> Any:
            value = params.get(name) or default
            if value is not None and value not in valid:
                raise ConfigError(f"parameter {name}={value!r}: valid values are {', '.join(map(str, valid))}")
            return value

        number("page", int)  # pages are cursors now; an old link's page number is still checked, then ignored
        per_page = number("per_page", int)
        per_page = 50 if per_page is None else per_page
        if per_page not in PAGE_SIZES:
            raise ConfigError(f"parameter per_page={per_page}: valid page sizes are {', '.join(map(str, PAGE_SIZES))}")
        return EpisodeQuery(
            step=number("step", int), phase=choice("phase", PHASES), group=params.get("group") or None,
            agent=params.get("agent") or None, task=params.get("task") or None, outcome=choice("outcome", OUTCOMES),
            min_reward=number("min_reward", float), max_reward=number("max_reward", float),
            reply=params.get("reply", "").strip() or None, sort=choice("sort", SORTS, "created"),
            desc=params.get("desc") == "1", after=params.get("after") or None, before=params.get("before") or None,
            per_page=per_page,
        )

    def params(self, **changes: Any) -> dict[str, str]:
        """The URL parameters of this query with some fields changed (defaults left out)."""
        values = {**self.__dict__, **changes}
        defaults = EpisodeQuery().__dict__
        out = {}
        for name, value in values.items():
            if value is None or value == defaults[name]:
                continue
            out[name] = "1" if value is True else str(value)
        return out

    def filter(self, phases: Sequence[str]) -> EpisodeFilter:
        """The store's filter of this query (`phases`: the store's, for the default phase)."""
        phase = self.phase or ("train" if "train" in phases else "all")
        return EpisodeFilter(step=self.step, phase=None if phase == "all" else phase, agent=self.agent,
                             task_id=self.task, group_id=self.group, outcome=self.outcome, min_reward=self.min_reward,
                             max_reward=self.max_reward, reply=self.reply)


@dataclass(frozen=True)
class EpisodeList:
    """One page of the episode list."""

    rows: list[EpisodeSummary]
    """The page's episodes."""
    replies: dict[str, dict[str, str]]
    """Each row's last reply per agent."""
    total: int
    """Episodes matching the filters, over all pages (counted up to `COUNT_AT_MOST`)."""
    more: bool
    """Whether the count stopped at `COUNT_AT_MOST` (the page says "N+")."""
    query: EpisodeQuery
    """What was asked."""
    phase: str
    """The phase shown ('all' for every one)."""
    next: str | None
    """Cursor of the next page (None: this is the last)."""
    previous: str | None
    """Cursor of the previous page (None: this is the first)."""


@dataclass
class _MetricsLog:
    """metrics.jsonl, read incrementally: a run that is still training appends lines."""

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    offset: int = 0
    malformed: int = 0
    """Lines that are not a JSON object (skipped; the Runs page shows how many)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self) -> list[dict[str, Any]]:
        with self.lock:
            if not self.path.is_file():
                return []
            if self.path.stat().st_size < self.offset:  # rewritten (a new run in the folder): start over
                self.records, self.offset, self.malformed = [], 0, 0
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line being written is read next time, whole
            for line in data[:end].splitlines():
                if line.strip():
                    self._add(line)
            self.offset += end
            return list(self.records)


    def _add(self, line: bytes) -> None:
        try:
            record = json.loads(line)
        except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
            record = None
        if isinstance(record, dict):
            self.records.append(record)
        else:
            self.malformed += 1


class Run:
    """One run folder: its name in URLs, its trace store, metrics and tokenizers."""

    def __init__(self, name: str, folder: Path):
        self.name = name
        """Name in URLs (the folder's name, made unique)."""
        self.folder = folder
        """The run folder."""
        self.store_path = folder / "traces.db"
        """Its trace store."""
        self._metrics = _MetricsLog(folder / "metrics.jsonl")
        self._store: TraceStore | None = None
        self._tokenizers: dict[Path, Any] = {}
        self._replies: tuple[int, list[Any]] | None = None
        self._lock = threading.Lock()

    def waiting(self) -> bool:
        """Whether the run has written neither its trace store nor its metrics log yet (it has just started)."""
        return not self.store_path.is_file() and not self._metrics.path.is_file()

    def not_written(self) -> str | None:
        """What the run has not written yet, as a page says it (None once its trace store exists)."""
        if self.store_path.is_file():
            return None
        if self.waiting():
            return (f"run {self.name!r} has not written anything yet: neither traces.db nor metrics.jsonl in "
                    f"{self.folder}. Training creates its trace store once its models are loaded; its first "
                    "episodes and metrics show when its first step ends.")
        return f"run {self.name!r} has no episodes: no traces.db in {self.folder} (its metrics are on the Runs page)."

    # -- trace store ----------------------------------------------------------------------------------

    def store(self) -> TraceStore:
        """The run's trace store, opened read-only once it exists (StoreNotFoundError before)."""
        with self._lock:
            if self._store is None:
                if not self.store_path.is_file():
                    raise StoreNotFoundError(f"run {self.name!r}: no trace store at {self.store_path} (yet)")
                self._store = TraceStore(self.store_path, readonly=True)
            return self._store

    def agents(self) -> tuple[str, ...]:
        """The agents that made calls in the run's stored episodes (none before its trace store exists): the
        charts take a metric key's agent whole by them, '/' included ('agent/team/solve/reward_mean')."""
        try:
            return self.store().facets().agents
        except StoreNotFoundError:
            return ()

    def episode_page(self, query: EpisodeQuery) -> EpisodeList:
        """The episodes matching `query`, sorted, one page of them, how many match in all and their replies."""
        store = self.store()
        phases = store.facets().phases
        selected = query.filter(phases)
        page = store.query(selected, sort=query.sort, descending=query.desc, limit=query.per_page,
                           after=query.after, before=query.before)
        replies = store.last_replies([s.id for s in page.rows])
        total = store.count(selected, at_most=COUNT_AT_MOST)
        return EpisodeList(page.rows, replies, total, total >= COUNT_AT_MOST, query, selected.phase or "all",
                           page.next, page.previous)

    def replies_memo(self, compute: Callable[[list[ReplyCount]], Any]) -> Any:
        """`compute` of `TraceStore.reply_counts` over every phase and step without rewards, kept until the store
        holds more episodes (replies never change once written): what the answers view's charts draw."""
        store = self.store()
        version = store.count()
        with self._lock:
            if self._replies is None or self._replies[0] != version:
                self._replies = (version, compute(store.reply_counts(rewards=False)))
            return self._replies[1]

    def choices(self) -> dict[str, Any]:
        """Values the filters offer: steps, agents and phases present in the store."""
        facets = self.store().facets()
        return {"steps": facets.steps, "agents": facets.agents, "phases": facets.phases}

    # -- metrics --------------------------------------------------------------------------------------

    def metrics(self) -> list[dict[str, Any]]:
        """Every record of metrics.jsonl so far (training steps and evaluations), in order."""
        return self._metrics.read()

    def malformed_metrics(self) -> int:
        """Lines of metrics.jsonl read so far that were not a JSON object (skipped)."""
        return self._metrics.malformed

    # -- tokenizers -----------------------------------------------------------------------------------

    def tokenizer(self, policy: str | None) -> Any:
        """The tokenizer of `policy` the run folder holds (`turns.find_tokenizer`: its latest checkpoint's, else
        what its servers loaded, else the model folder its config names), or None when it holds none (yet):
        tokens are then shown as ids. Looked up on every call, so a checkpoint saved after the UI started is
        picked up; each file is loaded once."""
        if not policy:
            return None
        path = self.tokenizer_file(policy).path
        if path is None:
            return None
        with self._lock:
            if path not in self._tokenizers:
                self._tokenizers[path] = load_tokenizer(path)
            return self._tokenizers[path]

    def tokenizer_file(self, policy: str) -> TokenizerFile:
        """Where the tokenizer of `policy` is in the run folder, or where it was looked for."""
        try:
            config = self.store().config
        except StoreNotFoundError:
            config = {}
        return find_tokenizer(self.folder, policy, config)

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None


STARTING = ("config.yaml", "checkpoints", "tensorboard", "sync", "eval", "traces.db-wal", "traces.db-shm",
            "traces.db-journal")
"""What a run folder may hold before its trace store and metrics log exist (besides hidden files, ``*.log`` and
other processes' ``traces.rank*.db``): a folder holding only these is a run that has just started."""


def check_run_folder(folder: Path) -> bool:
    """Whether `folder` holds a run's trace store or metrics log (True), or is a run folder that has not written
    either yet (False: empty, or holding only `STARTING` names, as while training loads its models). ConfigError,
    naming what is missing and the fix, for a folder that is not a run folder (it holds run folders, or other
    files)."""
    if (folder / "traces.db").is_file() or (folder / "metrics.jsonl").is_file():
        return True
    entries = sorted(folder.iterdir())
    runs = [e for e in entries if e.is_dir() and ((e / "traces.db").is_file() or (e / "metrics.jsonl").is_file())]
    if runs:
        shown = " ".join(str(r) for r in runs[:8]) + (" ..." if len(runs) > 8 else "")
        raise ConfigError(f"{folder} is not a run folder but holds {len(runs)} (it has no traces.db or metrics.jsonl "
                          f"itself): give those, e.g. drmas-graph ui {shown}")
    other = [e.name + ("/" if e.is_dir() else "") for e in entries if not _starting(e.name)]
    if other:
        raise ConfigError(f"{folder} is not a run folder: it has neither traces.db nor metrics.jsonl (what training "
                          f"writes into its run_dir) and holds other things ({', '.join(other[:5])}"
                          f"{', ...' if len(other) > 5 else ''}): give the run_dir of a training run (an empty "
                          "folder is waited for: a run that has not written anything yet)")
    return False


def _starting(name: str) -> bool:
    return (name in STARTING or name.startswith(".") or name.endswith(".log")
            or (name.startswith("traces.rank") and ".db" in name))


def open_runs(folders: Sequence[str | Path]) -> dict[str, Run]:
    """Runs by URL name for the run folders given (`check_run_folder`: a run that has not written anything yet
    is kept and waited for; a folder that is not a run folder is refused, naming what it lacks); names are the
    folders' names, suffixed '-2', '-3' when repeated."""
    if not folders:
        raise ConfigError("give at least one run folder (the run_dir of a training run)")
    runs: dict[str, Run] = {}
    for given in folders:
        folder = Path(given)
        if folder.is_file() and folder.suffix in (".db", ".sqlite"):
            raise ConfigError(f"{folder} is a trace store; give its run folder ({folder.parent})")
        if not folder.is_dir():
            raise ConfigError(f"run folder {folder} does not exist")
        check_run_folder(folder)
        base = folder.resolve().name or "run"
        name, n = base, 1
        while name in runs:
            n += 1
            name = f"{base}-{n}"
        runs[name] = Run(name, folder.resolve())
    return runs
