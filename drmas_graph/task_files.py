"""Tasks from files: an environment built from a YAML `env` mapping, no Python beyond the app.

    env:
      tasks: data/train.jsonl          # .jsonl, .json, .csv, .parquet, or a Hugging Face `datasets` folder
      test: data/test.jsonl            # optional
      input: {messages: [{role: user, content: "{question}"}]}   # "{column}" filled from each row
      answer: answer                   # optional: the reference-answer column
      id: id                           # optional: the id column (default: a stable hash of the row)
      reward: {judge: {model: {path: smollm2}, rubric: "..."}}   # or {python: my_rewards:score}

Each row of a file becomes a `drmas_graph.env.Task`: `input` is the template with every string filled from
the row (`str.format`: `{column}`, `{{` for a literal brace; mapping keys are left as they are), `answer` the
answer column's value, `id` the id column's value (as a string) or `row-<12 hex digits of sha1(row as
JSON)>`, `meta` the row itself. `TaskFileEnv` hands the tasks out by split; its reward is a Python function,
or a judge model (`env_from_config` wraps it in `drmas_graph.rewards.JudgedEnv`).

Every problem with the files is a `ConfigError` naming the file, the row and the fix: a missing or empty
file, an unknown extension, a template key a row lacks (with the columns the row has), a missing answer or
id column, duplicate ids.

May import: the shared modules and `rewards` (the judge).
"""

from __future__ import annotations

import csv
import hashlib
import json
import string
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from drmas_graph._importing import import_spec
from drmas_graph.config import JudgeConfig, TaskFilesConfig, TrainConfig
from drmas_graph.env import Task
from drmas_graph.errors import ConfigError

__all__ = ["TaskFileEnv", "load_rows", "template_keys", "fill_template", "load_tasks", "env_from_config",
           "build_judge", "judge_from_config", "tasks_from_config", "FORMATS"]

FORMATS = (".jsonl", ".json", ".csv", ".parquet")
"""File extensions `load_rows` reads (besides a Hugging Face `datasets` folder)."""

Row = dict[str, Any]


# ---- rows -------------------------------------------------------------------------------------------


def load_rows(path: str | Path, *, split: str = "train") -> list[Row]:
    """The rows of a task file, each a dict of column -> value, in file order.

    .jsonl: one JSON object per line (blank lines skipped); .json: a list of objects; .csv: a header line,
    then one row per line (values are strings); .parquet: read with pyarrow; a folder: a Hugging Face
    `datasets` dataset saved with `save_to_disk` (a DatasetDict gives its `split`)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"task file {str(path)!r} does not exist")
    if path.is_dir():
        rows = _dataset_rows(path, split)
    else:
        suffix = path.suffix.lower()
        reader = _READERS.get(suffix)
        if reader is None:
            raise ConfigError(f"task file {str(path)!r}: unknown extension {suffix or '(none)'!r}; use one of "
                              f"{', '.join(FORMATS)} or a Hugging Face `datasets` folder (save_to_disk)")
        rows = reader(path)
    if not rows:
        raise ConfigError(f"task file {str(path)!r} has no rows; add one task per row")
    return rows


def _jsonl_rows(path: Path) -> list[Row]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"task file {str(path)!r}, line {number}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"task file {str(path)!r}, line {number}: a row must be a JSON object of columns, "
                              f"got {type(row).__name__}")
        rows.append(row)
    return rows


def _json_rows(path: Path) -> list[Row]:
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"task file {str(path)!r}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(data, list):
        raise ConfigError(f"task file {str(path)!r}: must hold a JSON list of objects (one per task), got "
                          f"{type(data).__name__}; for one object per line use .jsonl")
    for number, row in enumerate(data, 1):
        if not isinstance(row, dict):
            raise ConfigError(f"task file {str(path)!r}, row {number}: a row must be a JSON object of columns, "
                              f"got {type(row).__name__}")
    return data


def _csv_rows(path: Path) -> list[Row]:
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for number, row in enumerate(rows, 1):
        if None in row:
            raise ConfigError(f"task file {str(path)!r}, row {number}: more values than the header has columns "
                              f"({', '.join(repr(k) for k in row if k is not None)}); quote values that hold commas")
    return rows


def _parquet_rows(path: Path) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"task file {str(path)!r}: reading Parquet needs pyarrow: pip install pyarrow") from None
    return pq.read_table(path).to_pylist()


def _dataset_rows(path: Path, split: str) -> list[Row]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"task file {str(path)!r} is a folder, read as a Hugging Face `datasets` dataset "
                          "(save_to_disk), which needs the datasets package: pip install datasets") from None
    try:
        data = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise ConfigError(f"task file {str(path)!r} is a folder but not a saved Hugging Face dataset ({exc}); "
                          f"give a file ({', '.join(FORMATS)}) or a folder written by Dataset.save_to_disk") from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ConfigError(f"task file {str(path)!r}: the dataset has splits {sorted(data)}, not {split!r}; save "
                              f"the split as its own dataset and name its folder")
        data = data[split]
    return data.to_list()


_READERS: dict[str, Callable[[Path], list[Row]]] = {
    ".jsonl": _jsonl_rows, ".json": _json_rows, ".csv": _csv_rows, ".parquet": _parquet_rows,
}


# ---- templates ------------------------------------------------------------------------------------


def template_keys(template: Any) -> list[str]:
    """The columns a template reads (`{question}` -> 'question'; `{a[0]}`, `{a.b}` -> 'a'), in order.
    Raises ConfigError for a string that is not a valid format string or that uses positional fields."""
    keys: list[str] = []
    for text in _strings(template):
        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
        except ValueError as exc:
            raise ConfigError(f"input template {text!r}: {exc} (write '{{{{' and '}}}}' for literal braces)") from None
        for name in fields:
            key = name.split(".", 1)[0].split("[", 1)[0]
            if not key or key.isdigit():
                raise ConfigError(f"input template {text!r}: '{{{name}}}' is positional; name a column, e.g. "
                                  "'{question}'")
            keys.append(key)
    return list(dict.fromkeys(keys))


def fill_template(template: Any, row: Mapping[str, Any]) -> Any:
    """`template` with every string filled from `row` (`str.format_map`), through dicts, lists and tuples;
    other values (and mapping keys) as they are. A missing column raises KeyError (`load_tasks` names the row)."""
    if isinstance(template, str):
        return template.format_map(row)
    if isinstance(template, Mapping):
        return {k: fill_template(v, row) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(fill_template(v, row) for v in template)
    return template


def _strings(template: Any) -> list[str]:
    if isinstance(template, str):
        return [template]
    if isinstance(template, Mapping):
        return [s for v in template.values() for s in _strings(v)]
    if isinstance(template, (list, tuple)):
        return [s for v in template for s in _strings(v)]
    return []


# ---- tasks --------------------------------------------------------------------------------------


def load_tasks(path: str | Path, input: Any, *, answer: str | None = None, id: str | None = None,
               split: str = "train") -> list[Task]:
    """One `Task` per row of the file: input = the filled template, answer = the `answer` column, id = the `id`
    column (a string) or a stable hash of the row, meta = the row. Ids must be unique within the file."""
    rows = load_rows(path, split=split)
    where = str(path)
    keys = template_keys(input)
    for key in keys:
        if not any(key in row for row in rows):
            raise ConfigError(f"env.input uses '{{{key}}}', but no row of {where!r} has a column {key!r} (row 1 has "
                              f"columns: {_columns(rows[0])}); fix the template or the file")
    for column, role in ((answer, "answer"), (id, "id")):
        if column is not None and not any(column in row for row in rows):
            raise ConfigError(f"env.{role} = {column!r}, but no row of {where!r} has that column (row 1 has columns: "
                              f"{_columns(rows[0])}); name one of them or remove env.{role}")
    tasks: list[Task] = []
    first_row_of: dict[str, int] = {}
    for number, row in enumerate(rows, 1):
        for key in keys:
            if key not in row:
                raise ConfigError(f"row {number} of {where!r} has no column {key!r} that env.input uses (its "
                                  f"columns: {_columns(row)}); add it or fix the template")
        for column, role in ((answer, "answer"), (id, "id")):
            if column is not None and column not in row:
                raise ConfigError(f"row {number} of {where!r} has no {role} column {column!r} (its columns: "
                                  f"{_columns(row)})")
        try:
            filled = fill_template(input, row)
        except (KeyError, IndexError, AttributeError, ValueError, TypeError) as exc:
            raise ConfigError(f"row {number} of {where!r}: env.input cannot be filled from it ({type(exc).__name__}: "
                              f"{exc}); its columns: {_columns(row)}") from None
        task_id = str(row[id]) if id is not None else _row_id(row)
        if task_id in first_row_of:
            what = f"the same {id!r} {task_id!r}" if id is not None else ("the same content (its id is a hash of the "
                                                                         "row): remove the duplicate or add an id column")
            raise ConfigError(f"rows {first_row_of[task_id]} and {number} of {where!r} have {what}; task ids must be "
                              "unique")
        first_row_of[task_id] = number
        tasks.append(Task(id=task_id, input=filled, answer=row[answer] if answer is not None else None, meta=dict(row)))
    return tasks


def _row_id(row: Row) -> str:
    """`row-` + 12 hex digits of sha1 of the row as canonical JSON: stable across runs and machines."""
    text = json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
    return f"row-{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def _columns(row: Row) -> str:
    return ", ".join(repr(k) for k in row) or "(none)"


# ---- the environment -------------------------------------------------------------------------------


class TaskFileEnv:
    """An environment over tasks read from files: `tasks('train')` and `tasks('test')`, and a reward from a
    Python function `reward(task, episode) -> float | {agent: float}` (the task's `answer` is the reference).

    Without a function it has no reward of its own: `env_from_config` then wraps it in
    `drmas_graph.rewards.JudgedEnv`, whose judge scores the episodes."""

    def __init__(self, train: Sequence[Task], test: Sequence[Task] | None = None, *,
                 reward: Callable[[Task, Any], float | Mapping[str, float]] | None = None) -> None:
        if not train:
            raise ConfigError("TaskFileEnv needs at least one training task")
        self._splits = {"train": list(train), "test": list(test) if test is not None else list(train)}
        self._reward = reward

    def tasks(self, split: str) -> list[Task]:
        if split not in self._splits:
            raise ConfigError(f"tasks from files have the splits 'train' (env.tasks) and 'test' (env.test), not "
                              f"{split!r}; set eval.split to one of them")
        return list(self._splits[split])

    def reward(self, task: Task, episode: Any) -> float | Mapping[str, float]:
        if self._reward is None:
            raise ConfigError("this TaskFileEnv has no reward function: pass reward=... or wrap it in "
                              "drmas_graph.rewards.JudgedEnv(env, judge)")
        return self._reward(task, episode)


def env_from_config(cfg: TaskFilesConfig, *, run_dir: str | Path) -> Any:
    """The environment of an `env` mapping: a `TaskFileEnv` with the python reward, or the `TaskFileEnv`
    wrapped in a `JudgedEnv` whose judge caches at run_dir/<judge.cache>. Tasks are read first (a file error
    costs no model load)."""
    train, test = _load_splits(cfg)
    if cfg.reward.python is not None:
        return TaskFileEnv(train, test, reward=_reward_function(cfg.reward.python))
    from drmas_graph.rewards import JudgedEnv

    return JudgedEnv(TaskFileEnv(train, test), build_judge(cfg.reward.judge, run_dir=run_dir))


def build_judge(jc: JudgeConfig, *, run_dir: str | Path | None) -> Any:
    """A `drmas_graph.rewards.Judge` from a `judge` section; its cache is run_dir/<cache> (a relative `cache`
    without a run_dir, or `cache: null`, has none)."""
    from drmas_graph.rewards import Judge, judge_model

    if jc.rubric_file is not None:
        path = Path(jc.rubric_file)
        if not path.is_file():
            raise ConfigError(f"env.reward.judge.rubric_file {jc.rubric_file!r} does not exist")
        rubric = path.read_text(encoding="utf-8")
    else:
        rubric = jc.rubric or ""
    if not rubric.strip():
        raise ConfigError("env.reward.judge: the rubric is empty; say what a good episode is")
    cache = None
    if jc.cache is not None and (run_dir is not None or Path(jc.cache).is_absolute()):
        cache = Path(run_dir or ".") / jc.cache
        cache.parent.mkdir(parents=True, exist_ok=True)
    model = judge_model(jc.model, run_dir=Path(run_dir) if run_dir is not None else None, timeout_s=jc.timeout_s)
    return Judge(model, rubric, mode=jc.mode, max_retries=jc.max_retries, timeout_s=jc.timeout_s,
                 max_concurrency=jc.max_concurrency, cache=cache, temperature=jc.temperature, seed=jc.seed,
                 max_tokens=jc.max_tokens)


def judge_from_config(cfg: TrainConfig | str | Path, *, run_dir: str | Path | None = None) -> Any:
    """The judge of a training config whose `env` is a mapping with `reward.judge` (for `traces rescore
    --judge CONFIG.yaml`); its cache is in `run_dir` (default: the config's run_dir)."""
    cfg = _train_config(cfg)
    if not isinstance(cfg.env, TaskFilesConfig) or cfg.env.reward.judge is None:
        raise ConfigError("the config has no judge: its `env` must be a mapping with `reward: {judge: ...}`")
    return build_judge(cfg.env.reward.judge, run_dir=run_dir if run_dir is not None else cfg.run_dir)


def tasks_from_config(cfg: TrainConfig | str | Path) -> list[Task]:
    """Every task of a config's `env` mapping, training tasks first, then the test tasks not among them (by
    id): what a judge needs to see the reference answers when re-scoring a stored run."""
    cfg = _train_config(cfg)
    if not isinstance(cfg.env, TaskFilesConfig):
        raise ConfigError("the config's `env` is not a mapping of task files (tasks, input, reward)")
    train, test = _load_splits(cfg.env)
    seen = {t.id for t in train}
    return [*train, *(t for t in test if t.id not in seen)]


def _load_splits(cfg: TaskFilesConfig) -> tuple[list[Task], list[Task]]:
    def load(path: str, split: str) -> list[Task]:
        return load_tasks(path, cfg.input, answer=cfg.answer, id=cfg.id, split=split)

    train = load(cfg.tasks, "train")
    if cfg.test is not None:
        return train, load(cfg.test, "test")
    if Path(cfg.tasks).is_dir() and _has_test_split(Path(cfg.tasks)):
        return train, load(cfg.tasks, "test")
    return train, train


def _has_test_split(path: Path) -> bool:
    import datasets  # load_rows succeeded on this folder, so `datasets` is installed

    data = datasets.load_from_disk(str(path))
    return isinstance(data, datasets.DatasetDict) and "test" in data


def _reward_function(spec: str) -> Callable[..., Any]:
    fn = import_spec(spec, setting="env.reward.python")
    if not callable(fn):
        raise ConfigError(f"env.reward.python {spec!r} is a {type(fn).__name__}, not a function (task, episode) -> "
                          "float | {agent: float}")
    return fn


def _train_config(cfg: TrainConfig | str | Path) -> TrainConfig:
    if isinstance(cfg, TrainConfig):
        return cfg
    from drmas_graph.config import load_config

    return load_config(cfg)
