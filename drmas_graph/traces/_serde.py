"""How an `Episode` becomes rows of the trace store and back, and how rows are exported.

The table layout (`SCHEMA`) lives here, next to the code that fills it; `drmas_graph.traces.store` runs the
transactions. Token ids are little-endian int32 buffers (4 bytes a token), logprobs float64 (8 bytes a token,
so the Python floats a policy returned come back bit for bit), everything else is JSON. Nothing here unpickles
or evaluates anything: the only objects rebuilt from a trace are LangChain messages (`messages_from_dict`),
LangGraph `Command`s and `Send`s (from their fields) and `SamplingParams`.

JSON values that are not JSON (`to_json`): LangChain messages become ``{"__message__": <messages_to_dict
form>}`` and are rebuilt on load, so are LangGraph `Command`s (``{"__command__": <fields>}``, the input
of a run that resumes an interrupt or steers the graph) and `Send`s (``{"__send__": <fields>}``, e.g. a
Command's `goto`); a Command's `update` and `goto` come back as the same list or tuple, pairs as tuples
(``"__forms__"`` says which), so the reconstructed Command equals the recorded one. Other dataclasses,
pydantic models and numpy values become their dict/list/scalar forms (loaded back as plain data); anything
else becomes ``{"__unserializable__": "<type>", "repr": "<repr>"}`` and a `TraceStoreWarning` names where it
was. Elsewhere tuples load back as lists and mapping keys as strings, as in any JSON.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import sys
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from langchain_core.messages import BaseMessage, messages_from_dict, messages_to_dict

from drmas_graph.errors import ConfigError
from drmas_graph.types import Episode, SamplingParams, Segment, Turn

__all__ = [
    "SCHEMA",
    "EPISODE_COLUMNS",
    "TURN_COLUMNS",
    "TraceStoreWarning",
    "episode_rows",
    "episode_from_rows",
    "to_json",
    "from_json",
    "mean",
    "check_aligned",
]

IDS_DTYPE = np.dtype("<i4")
"""Token ids: little-endian int32."""
LOGPROBS_DTYPE = np.dtype("<f8")
"""Logprobs: little-endian float64, the same bits as the Python floats in `Turn.response_logprobs`."""

_MESSAGE_TAG = "__message__"
_COMMAND_TAG = "__command__"
_SEND_TAG = "__send__"
_FORMS_KEY = "__forms__"
"""In a stored Command: {field: 'list' | 'tuple' | 'list of pairs' | 'tuple of pairs'} for `update`/`goto`."""
_UNSERIALIZABLE_TAG = "__unserializable__"
_INT32 = np.iinfo(np.int32)


class TraceStoreWarning(UserWarning):
    """Something was stored lossily (a value that has no JSON form was stored as its repr)."""


def ids_to_blob(ids: Sequence[int], where: str) -> bytes:
    """Token ids as int32 little-endian bytes; a ConfigError naming `where` if an id does not fit."""
    ids_T = np.asarray(ids, dtype=np.int64)
    if ids_T.size and (ids_T.min() < _INT32.min or ids_T.max() > _INT32.max):
        raise ConfigError(f"{where}: token id {int(ids_T.max())} does not fit in int32")
    return ids_T.astype(IDS_DTYPE).tobytes()


def blob_to_ids(blob: bytes) -> tuple[int, ...]:
    return tuple(np.frombuffer(blob, dtype=IDS_DTYPE).tolist())


def logprobs_to_blob(logprobs: Sequence[float]) -> bytes:
    return np.asarray(logprobs, dtype=LOGPROBS_DTYPE).tobytes()


def blob_to_logprobs(blob: bytes) -> tuple[float, ...]:
    return tuple(np.frombuffer(blob, dtype=LOGPROBS_DTYPE).tolist())


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def to_json(value: Any, where: str) -> str:
    """`value` as JSON text; never raises on odd values (see the module docstring). `where` names it."""
    try:
        return _dumps(value)  # fast path: plain JSON data; a message or any other object raises TypeError
    except (TypeError, ValueError):
        return _dumps(_jsonable(value, where, set()))


def _jsonable(value: Any, where: str, active: set[int]) -> Any:
    """A JSON-ready copy of `value`; `active` holds the ids of the containers being walked (cycles)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, BaseMessage):
        data = messages_to_dict([value])[0]
        return {_MESSAGE_TAG: _jsonable(data, where, active)}
    if _is_langgraph(value, "Command"):  # a run input (resume, update, goto): replay needs it back as it was
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        data = _jsonable(fields, where, active)
        forms = {name: form for name in ("update", "goto") if (form := _sequence_form(fields[name])) is not None}
        return {_COMMAND_TAG: {**data, _FORMS_KEY: forms} if forms else data}
    if _is_langgraph(value, "Send"):
        fields = {"node": value.node, "arg": value.arg, "timeout": value.timeout}
        return {_SEND_TAG: _jsonable(fields, where, active)}
    if isinstance(value, enum.Enum):
        return _jsonable(value.value, where, active)
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    if id(value) in active:
        return _unserializable(value, where, "a reference cycle")
    if isinstance(value, Mapping):
        active.add(id(value))
        try:
            return {_json_key(k): _jsonable(v, f"{where}[{k!r}]", active) for k, v in value.items()}
        finally:
            active.discard(id(value))
    if isinstance(value, list | tuple | set | frozenset):
        active.add(id(value))
        try:
            items = [_jsonable(v, f"{where}[{i}]", active) for i, v in enumerate(value)]
        finally:
            active.discard(id(value))
        return _canonical_order(items) if isinstance(value, set | frozenset) else items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return _jsonable(fields, where, active)
    model_dump = getattr(value, "model_dump", None)  # pydantic v2 models
    if callable(model_dump) and not isinstance(value, type):
        try:
            return _jsonable(model_dump(), where, active)
        except Exception:  # a model whose own serializer fails is stored as its repr below
            pass
    return _unserializable(value, where, "no JSON form")


def _canonical_order(items: list[Any]) -> list[Any]:
    """A set's elements (in JSON form) sorted by their JSON text: a set is stored as the same list in every
    process, whatever the iteration order the process's hash seed (PYTHONHASHSEED) gives strings."""
    return sorted(items, key=lambda item: json.dumps(item, sort_keys=True, ensure_ascii=False))


def _is_langgraph(value: Any, name: str) -> bool:
    """A LangGraph `Command` or `Send` (imported lazily: only a run that was given one has it loaded)."""
    types = sys.modules.get("langgraph.types")
    return types is not None and isinstance(value, getattr(types, name))


def _sequence_form(value: Any) -> str | None:
    """How a Command's `update` or `goto` sequence was built, which its JSON list does not say; None if no
    sequence."""
    if not isinstance(value, list | tuple):
        return None
    pairs = bool(value) and all(isinstance(item, tuple) and len(item) == 2 for item in value)
    return ("tuple" if isinstance(value, tuple) else "list") + (" of pairs" if pairs else "")


def _as_form(value: Any, form: str) -> Any:
    """A revived JSON list back in its `_sequence_form`."""
    if isinstance(value, list) and form.endswith(" of pairs"):
        value = [tuple(item) for item in value]
    return tuple(value) if isinstance(value, list) and form.startswith("tuple") else value


def _json_key(key: Any) -> str:
    """A mapping key as `json.dumps` would write it (1 -> "1", True -> "true"); other types via str()."""
    if isinstance(key, str):
        return key
    return _dumps(key) if key is None or isinstance(key, bool | int | float) else str(key)


def _unserializable(value: Any, where: str, why: str) -> dict[str, str]:
    type_name = f"{type(value).__module__}.{type(value).__qualname__}"
    try:
        text = repr(value)
    except Exception as e:  # a broken __repr__ must not crash the run
        text = f"<repr failed: {type(e).__name__}>"
    warnings.warn(
        f"{where}: {type_name} has {why}; stored as its repr ({_UNSERIALIZABLE_TAG!r} marker)",
        TraceStoreWarning,
        stacklevel=2,
    )
    return {_UNSERIALIZABLE_TAG: type_name, "repr": text}


def from_json(text: str | None) -> Any:
    """Parse JSON written by `to_json`, rebuilding the tagged LangChain messages."""
    if text is None:
        return None
    value = json.loads(text)
    return _revive(value) if any(tag in text for tag in (_MESSAGE_TAG, _COMMAND_TAG, _SEND_TAG)) else value


def _revive(value: Any) -> Any:
    if isinstance(value, dict):
        if len(value) == 1 and _MESSAGE_TAG in value:
            return messages_from_dict([value[_MESSAGE_TAG]])[0]
        if len(value) == 1 and _COMMAND_TAG in value and isinstance(value[_COMMAND_TAG], dict):
            from langgraph.types import Command

            fields = _revive(value[_COMMAND_TAG])
            forms = fields.pop(_FORMS_KEY, None) or {"goto": "tuple"}  # stores before forms: goto as Command's ()
            for name, form in forms.items():
                fields[name] = _as_form(fields.get(name), form)
            return Command(**fields)
        if len(value) == 1 and _SEND_TAG in value and isinstance(value[_SEND_TAG], dict):
            from langgraph.types import Send, TimeoutPolicy

            fields = _revive(value[_SEND_TAG])
            timeout = fields.get("timeout")
            return Send(fields["node"], fields.get("arg"),
                        timeout=TimeoutPolicy(**timeout) if isinstance(timeout, dict) else timeout)
        return {k: _revive(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_revive(v) for v in value]
    return value


def messages_to_json(messages: Sequence[BaseMessage], where: str) -> str:
    data = messages_to_dict(list(messages))
    try:
        return _dumps(data)
    except (TypeError, ValueError):  # odd values in additional_kwargs / response_metadata
        return _dumps(_jsonable(data, where, set()))


def messages_from_json(text: str) -> tuple[BaseMessage, ...]:
    return tuple(messages_from_dict(json.loads(text)))


def sampling_to_json(sampling: SamplingParams | None) -> str | None:
    return None if sampling is None else _dumps(dataclasses.asdict(sampling))


def sampling_from_json(text: str | None) -> SamplingParams | None:
    return None if text is None else SamplingParams(**json.loads(text))


# -- the table layout ----------------------------------------------------------------------------

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS episodes (
    id TEXT PRIMARY KEY,
    task_id TEXT,
    group_id TEXT,
    step INTEGER,                 -- training step the episode was used in; NULL until then
    error TEXT,
    n_turns INTEGER NOT NULL,
    n_prompt_tokens INTEGER NOT NULL,
    n_response_tokens INTEGER NOT NULL,
    agents TEXT NOT NULL,         -- JSON list, in order of first call
    reward REAL,                  -- mean of `rewards` over agents; NULL without rewards
    rewards TEXT NOT NULL,        -- JSON {agent: reward}
    input TEXT,                   -- JSON graph input (replay runs the graph on it)
    final_state TEXT,             -- JSON (see to_json)
    timings TEXT NOT NULL,
    metadata TEXT NOT NULL,
    created REAL NOT NULL,
    trained REAL,                 -- Unix time update_training recorded `step`; NULL otherwise (old stores too)
    truncated TEXT,               -- Episode.truncated: '<limit>: <why>' when a limit stopped the run; NULL otherwise
    model_error TEXT,             -- Episode.model_error: the policy's output that broke the app; NULL otherwise
    model_error_turn INTEGER,     -- Episode.model_error_turn: position of the offending turn
    segments TEXT,                -- JSON Episode.segments (runs of the thread: resumes and next inputs); NULL: one run
    judgement TEXT                -- JSON Episode.judgement (what a judge model made of the episode); NULL if none
);
CREATE TABLE IF NOT EXISTS rewards (
    episode_id TEXT NOT NULL REFERENCES episodes (id),
    agent TEXT NOT NULL,
    reward REAL,
    PRIMARY KEY (episode_id, agent)
);
CREATE TABLE IF NOT EXISTS turns (
    episode_id TEXT NOT NULL REFERENCES episodes (id),
    position INTEGER NOT NULL,    -- position in Episode.turns
    call_index INTEGER NOT NULL,  -- Turn.index
    agent TEXT NOT NULL,
    node TEXT NOT NULL,
    step INTEGER NOT NULL,        -- LangGraph superstep (Turn.step)
    call_key TEXT NOT NULL,
    node_call_index INTEGER NOT NULL,
    messages TEXT NOT NULL,       -- JSON, langchain_core messages_to_dict
    prompt_ids BLOB NOT NULL,     -- int32 little-endian
    response_ids BLOB NOT NULL,   -- int32 little-endian
    response_logprobs BLOB NOT NULL,  -- float64 little-endian
    n_prompt_tokens INTEGER NOT NULL,
    n_response_tokens INTEGER NOT NULL,
    response_text TEXT NOT NULL,
    tool_calls TEXT NOT NULL,
    finish_reason TEXT NOT NULL,
    policy TEXT,
    policy_version INTEGER,
    trainable INTEGER NOT NULL,
    latency_s REAL NOT NULL,
    sampling TEXT,
    tools TEXT NOT NULL,
    message_id TEXT,              -- id of the AIMessage returned to the node
    turn_reward REAL,             -- Episode.turn_rewards[position]; NULL until training fills it
    advantage REAL,               -- Episode.advantages[position]; NULL until training fills it
    response_format TEXT,         -- JSON Turn.response_format (structured output asked for); NULL for free text
    format_error TEXT,            -- Turn.format_error: why the reply is not what the call asked for; NULL if it is
    agent_name TEXT,              -- Turn.agent_name (LangChain lc_agent_name); NULL outside a named agent
    segment INTEGER,              -- Turn.segment (run of the episode's thread); NULL = 0
    tool_parser TEXT,             -- Turn.tool_parser (the policy's parser that read the reply); NULL: none recorded
    call_sampling TEXT,           -- JSON Turn.call_sampling (the call's own stop and max_tokens); NULL: none recorded
    PRIMARY KEY (episode_id, position)
);
CREATE INDEX IF NOT EXISTS turns_by_agent ON turns (agent, episode_id);
CREATE INDEX IF NOT EXISTS episodes_by_step ON episodes (step);
CREATE INDEX IF NOT EXISTS episodes_by_task ON episodes (task_id);
"""

EPISODE_COLUMNS = (
    "id", "task_id", "group_id", "step", "error", "n_turns", "n_prompt_tokens", "n_response_tokens",
    "agents", "reward", "rewards", "input", "final_state", "timings", "metadata", "created", "trained",
    "truncated", "model_error", "model_error_turn",
    "segments", "judgement",
)  # fmt: skip
ADDED_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("episodes", "trained", "REAL"),
    ("turns", "response_format", "TEXT"),
    ("episodes", "truncated", "TEXT"),
    ("episodes", "model_error", "TEXT"),
    ("episodes", "model_error_turn", "INTEGER"),
    ("turns", "format_error", "TEXT"),
    ("episodes", "segments", "TEXT"),
    ("turns", "agent_name", "TEXT"),
    ("turns", "segment", "INTEGER"),
    ("episodes", "judgement", "TEXT"),
    ("turns", "tool_parser", "TEXT"),
    ("turns", "call_sampling", "TEXT"),
)
"""Columns added to the layout after schema version 1 was released: (table, column, SQL type), each
nullable. They keep the schema version: opening an older store to write adds them (NULL in old rows),
opening one read-only reads them as NULL (`absent_columns`, `select_list`). Add new columns here (and keep commas
out of the SQL comment after a column in `SCHEMA`: SQLite's DROP COLUMN, which the tests use to make an older
store, looks back from a dropped last column for the comma before it)."""
TURN_COLUMNS = (
    "episode_id", "position", "call_index", "agent", "node", "step", "call_key", "node_call_index",
    "messages", "prompt_ids", "response_ids", "response_logprobs", "n_prompt_tokens", "n_response_tokens",
    "response_text", "tool_calls", "finish_reason", "policy", "policy_version", "trainable", "latency_s",
    "sampling", "tools", "message_id", "turn_reward", "advantage",
    "response_format", "format_error",
    "agent_name", "segment", "tool_parser", "call_sampling",
)  # fmt: skip


def absent_columns(conn: Any) -> set[tuple[str, str]]:
    """The `ADDED_COLUMNS` an (older) store lacks, as (table, column)."""
    present: dict[str, set[str]] = {}
    for table in {t for t, _, _ in ADDED_COLUMNS}:
        present[table] = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
    return {(t, c) for t, c, _ in ADDED_COLUMNS if c not in present[t]}


def add_absent_columns(conn: Any) -> list[str]:
    """Add the `ADDED_COLUMNS` an older store lacks (inside the caller's write transaction); their names."""
    added = []
    for table, column, sql_type in ADDED_COLUMNS:
        if (table, column) in absent_columns(conn):
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {sql_type}")
            added.append(f"{table}.{column}")
    return added


def select_list(table: str, columns: Sequence[str], absent: set[tuple[str, str]]) -> str:
    """`columns` for a SELECT, with NULL in place of the ones an older store lacks."""
    return ", ".join(f"NULL AS {c}" if (table, c) in absent else c for c in columns)


# -- episodes <-> rows -------------------------------------------------------------------------------


def mean(values: Iterable[float]) -> float | None:
    """The mean reward (the team reward when every agent got it); None for no rewards."""
    values = [float(v) for v in values]
    return math.fsum(values) / len(values) if values else None


def check_aligned(name: str, values: Sequence[float], n_turns: int, episode_id: str) -> None:
    if len(values) != n_turns:
        raise ConfigError(
            f"episode {episode_id}: {name} has {len(values)} values but the episode has {n_turns} turns; "
            "give one value per turn"
        )


def episode_rows(episode: Episode, step: int | None) -> tuple[tuple, list[tuple], list[tuple]]:
    """The rows of one episode: (episodes row, turns rows, rewards rows)."""
    n_turns = len(episode.turns)
    for name, values in (("turn_rewards", episode.turn_rewards), ("advantages", episode.advantages)):
        if values is not None:
            check_aligned(name, values, n_turns, episode.id)
    turn_rows = [_turn_row(episode, position, turn) for position, turn in enumerate(episode.turns)]
    episode_row = (
        episode.id,
        episode.task_id,
        episode.group_id,
        step,
        episode.error,
        n_turns,
        sum(t.n_prompt_tokens for t in episode.turns),
        sum(t.n_response_tokens for t in episode.turns),
        json.dumps(episode.agents),
        mean(episode.rewards.values()),
        to_json(dict(episode.rewards), "rewards"),
        to_json(episode.input, "input"),
        to_json(episode.final_state, "final_state"),
        to_json(dict(episode.timings), "timings"),
        to_json(dict(episode.metadata), "metadata"),
        time.time(),
        None,  # trained: set by TraceStore.update_training/record_training, never guessed at write time
        episode.truncated,
        episode.model_error,
        episode.model_error_turn,
        to_json(list(episode.segments), "segments") if episode.segments else None,
        judgement_to_json(episode.judgement),
    )
    reward_rows = [(episode.id, agent, float(r)) for agent, r in episode.rewards.items()]
    return episode_row, turn_rows, reward_rows


def _turn_row(episode: Episode, position: int, turn: Turn) -> tuple:
    where = f"episode {episode.id} turn {position}"
    return (
        episode.id,
        position,
        turn.index,
        turn.agent,
        turn.node,
        turn.step,
        turn.call_key,
        turn.node_call_index,
        messages_to_json(turn.messages, f"{where} messages"),
        ids_to_blob(turn.prompt_ids, f"{where} prompt_ids"),
        ids_to_blob(turn.response_ids, f"{where} response_ids"),
        logprobs_to_blob(turn.response_logprobs),
        len(turn.prompt_ids),
        len(turn.response_ids),
        turn.response_text,
        to_json(list(turn.tool_calls), f"{where} tool_calls"),
        turn.finish_reason,
        turn.policy,
        turn.policy_version,
        int(turn.trainable),
        float(turn.latency_s),
        sampling_to_json(turn.sampling),
        to_json(list(turn.tools), f"{where} tools"),
        turn.message_id,
        None if episode.turn_rewards is None else float(episode.turn_rewards[position]),
        None if episode.advantages is None else float(episode.advantages[position]),
        None if turn.response_format is None else to_json(turn.response_format, f"{where} response_format"),
        turn.format_error,
        turn.agent_name,
        turn.segment or None,
        turn.tool_parser,
        None if turn.call_sampling is None else to_json(turn.call_sampling, f"{where} call_sampling"),
    )


def _turn_from_row(row: Mapping[str, Any]) -> Turn:
    return Turn(
        agent=row["agent"],
        node=row["node"],
        step=row["step"],
        index=row["call_index"],
        messages=messages_from_json(row["messages"]),
        prompt_ids=blob_to_ids(row["prompt_ids"]),
        response_ids=blob_to_ids(row["response_ids"]),
        response_logprobs=blob_to_logprobs(row["response_logprobs"]),
        response_text=row["response_text"],
        tool_calls=tuple(json.loads(row["tool_calls"])),
        finish_reason=row["finish_reason"],
        policy=row["policy"],
        policy_version=row["policy_version"],
        trainable=bool(row["trainable"]),
        latency_s=row["latency_s"],
        call_key=row["call_key"],
        node_call_index=row["node_call_index"],
        sampling=sampling_from_json(row["sampling"]),
        tools=tuple(json.loads(row["tools"])),
        message_id=row["message_id"],
        response_format=None if row.get("response_format") is None else json.loads(row["response_format"]),
        format_error=row.get("format_error"),
        agent_name=row.get("agent_name"),
        segment=row.get("segment") or 0,
        tool_parser=row.get("tool_parser"),
        call_sampling=None if row.get("call_sampling") is None else json.loads(row["call_sampling"]),
    )


def _per_turn(values: list[float | None]) -> list[float] | None:
    """A per-turn column back as Episode.turn_rewards/advantages: None if never set. SQLite stores NaN
    as NULL, so a NULL next to set values is NaN."""
    if all(v is None for v in values):
        return None
    return [math.nan if v is None else v for v in values]


def episode_from_rows(row: Mapping[str, Any], turn_rows: list[tuple]) -> Episode:
    """The Episode back from its `EPISODE_COLUMNS` row (as a mapping) and its `TURN_COLUMNS` rows."""
    turns = [dict(zip(TURN_COLUMNS, t, strict=True)) for t in turn_rows]
    return Episode(
        id=row["id"],
        task_id=row["task_id"],
        group_id=row["group_id"],
        input=from_json(row["input"]),
        turns=[_turn_from_row(t) for t in turns],
        final_state=from_json(row["final_state"]),
        rewards=json.loads(row["rewards"]),
        turn_rewards=_per_turn([t["turn_reward"] for t in turns]),
        advantages=_per_turn([t["advantage"] for t in turns]),
        error=row["error"],
        timings=json.loads(row["timings"]),
        metadata=from_json(row["metadata"]),
        truncated=row.get("truncated"),
        model_error=row.get("model_error"),
        model_error_turn=row.get("model_error_turn"),
        segments=segments_from_json(row.get("segments")),
        judgement=judgement_from_json(row.get("judgement")),
    )


def segments_from_json(text: str | None) -> list[Segment]:
    """`Episode.segments` back from its column (Commands revived; interrupts as dicts); [] for NULL."""
    return [Segment(kind=s["kind"], input=s.get("input"), interrupts=tuple(s.get("interrupts") or ()))
            for s in from_json(text) or ()]


def judgement_to_json(judgement: Mapping[str, Any] | None) -> str | None:
    """`Episode.judgement` for its column: JSON, NULL when no judge scored the episode."""
    if judgement is None:
        return None
    if not isinstance(judgement, Mapping):
        raise ConfigError(f"Episode.judgement is a {type(judgement).__name__}; it must be a dict (the judge's record) "
                          "or None")
    return to_json(dict(judgement), "judgement")


def judgement_from_json(text: str | None) -> dict[str, Any] | None:
    """`Episode.judgement` back from its column: the record as written (plain JSON data); None for NULL."""
    return None if text is None else json.loads(text)
