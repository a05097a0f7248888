"""`Judge`: rewards from a judge model that reads a rubric and the rendered trajectories; `JudgedEnv`.

One judge call scores one unit: an episode (mode episode), a whole GRPO group (mode group: the G attempts of
a task side by side, scored relative to each other) or each agent of an episode (mode agent). A call asks for
structured output (`with_structured_output(schema, method="json_schema", include_raw=True)`) where the model
has it, else for the JSON in the text; either way the raw reply is parsed and validated here. An unusable
reply (not the JSON, a score outside [0, 1], the wrong attempts or agents), an exception or a timeout is
retried up to `max_retries` times (a retry after an unusable reply shows the model that reply and what was
wrong with it), then the unit's episodes get a Judgement with an error: never a silent 0.

The calls run outside every instrumented run (`app_models()`), so they are never turns of an episode, at
most `max_concurrency` at once across threads; a call past `timeout_s` is abandoned (its attempt fails, and
its slot frees when the call returns: give a served model its own request timeout; `judge_model` gives a
`base_url` model `timeout_s` as its request timeout unless the spec names one). Every request that leaves is
one of `judge/calls`: a model's client must not retry on its own (`max_retries` 0 where its class has that
field; `judge_model` builds them so, and a model given with hidden retries is refused), so an abandoned call
sends nothing more, and its tokens, when its reply arrives late, still count in the token figures.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypedDict

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from drmas_graph.errors import ConfigError, DrmasError, JudgeError
from drmas_graph.instrumentation import app_models
from drmas_graph.rewards._cache import JudgeCache, cache_key
from drmas_graph.rewards._models import model_name
from drmas_graph.rewards._render import MODES, build_prompt
from drmas_graph.rewards._schema import (ReplyError, Verdict, clip_reply, json_schema, parse_reply, reply_text,
                                         schema_for)
from drmas_graph.types import Episode

__all__ = ["Judge", "Judgement", "JudgementRecord", "JudgedEnv", "METRIC_KEYS"]

METRIC_KEYS = ("judge/calls", "judge/retries", "judge/failed_calls", "judge/cache_hits", "judge/input_tokens",
               "judge/output_tokens", "judge/seconds")
"""The counters `Judge.reward_metrics` returns: model calls made, retries among them, calls that gave no usable
reply (unparsable, out of range, exception, timeout), units answered from the cache, the tokens of the calls
(the model's `usage_metadata`; cache hits cost none), and the seconds spent waiting for calls."""

_SETTING_FIELDS = {"temperature": ("temperature",), "seed": ("seed",),
                   "max_tokens": ("max_tokens", "max_output_tokens")}
"""Judge setting -> the chat-model fields that take it (the first one the model's class declares)."""


class JudgementRecord(TypedDict):
    """`Episode.judgement`: the judge's audit record of one episode, JSON-able, stored with the episode (the
    trace store, `traces show`, the UI, the Weave export). Group mode: the prompt, replies, attempts, tokens
    and seconds are the whole group's call(s), shared by its episodes."""

    mode: str
    """'episode', 'group' or 'agent'."""
    model: str
    """The judge model's name (`Judge.name`; part of the cache key)."""
    rubric_sha: str
    """The first 12 hex digits of the rubric's sha256."""
    prompt: list[dict[str, str]]
    """The two messages sent, `[{"role": "system", "content": ...}, {"role": "user", "content": ...}]`."""
    replies: list[str]
    """The raw reply of every call, in order ('' for a call that raised or timed out)."""
    scores: float | dict[str, float] | None
    """The episode's score in [0, 1] (modes episode, group) or {agent: score} (mode agent); None when failed."""
    reasons: str | dict[str, str] | None
    """The judge's reason for each score, shaped like `scores`."""
    attempts: int
    """Judge calls made for the unit: 1 + its retries (not the group's attempt number: that is index + 1)."""
    input_tokens: int
    """Input tokens of those calls (the model's `usage_metadata`)."""
    output_tokens: int
    """Output tokens of those calls."""
    cached: bool
    """Whether the result came from the judge's cache (then the other fields are the original call's)."""
    seconds: float
    """Seconds the calls took."""
    group_size: int | None
    """Group mode: the episodes judged together (G); None in the other modes."""
    index: int | None
    """Group mode: the episode's position in its group (0-based: the judge's attempt_{index + 1}); else None."""
    error: str | None
    """Why the judge gave no usable score (every call's error and the last reply); None when scored."""


@dataclass(frozen=True)
class Judgement:
    """What the judge made of one episode."""

    reward: float | dict[str, float] | None
    """Modes episode and group: a float in [0, 1]; mode agent: {agent: float}; None when the judge failed."""
    error: str | None
    """Why the judge gave no usable score (the attempts' errors and the last raw reply); None when scored."""
    record: JudgementRecord
    """The JSON-able audit record, stored as `Episode.judgement` (its fields: `JudgementRecord`)."""


class _CallFailed(DrmasError):
    """A judge call that raised or timed out (the message says which)."""


class _Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(METRIC_KEYS, 0.0)

    def add(self, **values: float) -> None:
        with self._lock:
            for key, value in values.items():
                self._values[f"judge/{key}"] += value

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self._values = self._values, dict.fromkeys(METRIC_KEYS, 0.0)
        return out


def _configured(model: Any, values: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A copy of `model` with temperature / seed / max_tokens set on the fields its class declares (a model
    without a `seed` field, e.g. Anthropic's, gets none); the fields set."""
    fields = getattr(type(model), "model_fields", {})
    update = {}
    for key, value in values.items():
        field = next((f for f in _SETTING_FIELDS[key] if f in fields), None)
        if value is not None and field is not None:
            update[field] = value
    return (model.model_copy(update=update) if update else model), update


def _has_structured_output(model: Any) -> bool:
    """Whether `model.with_structured_output(..., method="json_schema", include_raw=True)` works (LangChain's
    base class raises NotImplementedError for models without tool binding)."""
    try:
        model.with_structured_output(json_schema(Verdict), method="json_schema", include_raw=True)
    except NotImplementedError:
        return False
    return True


class Judge:
    """Rewards from a judge model: `rubric` in plain text, one of three modes (see the module docstring).

    Args:
        model: any LangChain chat model (`judge_model` builds one from a config spec).
        rubric: what a good attempt is; the judge's prompt quotes it.
        mode: "episode" (a score per episode), "group" (one call sees a GRPO group and scores its attempts
            relative to each other), "agent" ({agent: score} per episode, each agent judged on its own replies).
        max_retries: retries of a call whose reply is unusable or that failed, before the episode fails.
        timeout_s: seconds one call may take; a slower one fails (and is retried).
        max_concurrency: most judge calls at once, across every thread using this judge.
        cache: SQLite file caching usable results across runs (None: in memory only).
        temperature: set on the model's `temperature` field where its class has one (as seed and max_tokens).
        seed: set on the model's `seed` field where its class has one.
        max_tokens: the longest reply, set on the model's `max_tokens` (or `max_output_tokens`) field.
        name: the model's name in records and cache keys (default: its `model_name`/`model` field).
    """

    def __init__(self, model: BaseChatModel, rubric: str, *, mode: Literal["episode", "group", "agent"] = "group",
                 max_retries: int = 2, timeout_s: float = 120.0, max_concurrency: int = 4,
                 cache: str | Path | None = None, temperature: float = 0.0, seed: int | None = 0,
                 max_tokens: int = 512, name: str | None = None):
        _check_arguments(rubric, mode, max_retries, timeout_s, max_concurrency, max_tokens)
        self.rubric, self.mode, self.max_retries, self.max_tokens = rubric, mode, max_retries, max_tokens
        self.timeout_s, self.max_concurrency = float(timeout_s), max_concurrency
        self.name = name or model_name(model)
        _check_no_client_retries(model, self.name)
        self.model, self.settings = _configured(model, {"temperature": temperature, "seed": seed,
                                                        "max_tokens": max_tokens})
        self.structured = _has_structured_output(self.model)
        """Whether calls ask for structured output (else the JSON is parsed from the reply's text)."""
        self.rubric_sha = hashlib.sha256(rubric.encode()).hexdigest()[:12]
        self._cache = JudgeCache(cache)
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._counters = _Counters()

    def __repr__(self) -> str:
        return f"Judge({self.name!r}, mode={self.mode!r}, rubric_sha={self.rubric_sha!r})"

    # -- the environment protocol --------------------------------------------------------------------------

    def reward_group(self, task: Any, episodes: Sequence[Episode]) -> list[float | dict[str, float] | JudgeError]:
        """The rewards of a group's episodes, in order: a float (or {agent: float}), or a `JudgeError` for an
        episode the judge could not score. Sets every `episode.judgement` to its record."""
        out: list[float | dict[str, float] | JudgeError] = []
        for episode, judgement in zip(episodes, self.judge_group(task, episodes)):
            episode.judgement = judgement.record
            out.append(judgement.reward if judgement.error is None else JudgeError(judgement.error))
        return out

    def reward(self, task: Any, episode: Episode) -> float | dict[str, float]:
        """One episode's reward (a group of one in group mode); sets `episode.judgement`; raises `JudgeError`."""
        judgement = self.judge_episode(task, episode)
        episode.judgement = judgement.record
        if judgement.error is not None:
            raise JudgeError(judgement.error)
        return judgement.reward

    def reward_metrics(self) -> dict[str, float]:
        """The counters of `METRIC_KEYS` since the last call (then reset)."""
        return self._counters.take()

    # -- judging -------------------------------------------------------------------------------------------

    def judge_group(self, task: Any, episodes: Sequence[Episode]) -> list[Judgement]:
        """One Judgement per episode, in order. Group mode: ONE call sees them all; the other modes judge the
        episodes concurrently, one call each."""
        episodes = list(episodes)
        if self.mode == "group" or len(episodes) <= 1:
            return self._judge_unit(task, episodes) if episodes else []
        with ThreadPoolExecutor(max_workers=min(len(episodes), self.max_concurrency)) as pool:
            return list(pool.map(lambda e: self._judge_unit(task, [e])[0], episodes))

    def judge_episode(self, task: Any, episode: Episode) -> Judgement:
        """The Judgement of one episode (in group mode, judged as a group of one)."""
        return self._judge_unit(task, [episode])[0]

    def _judge_unit(self, task: Any, episodes: list[Episode]) -> list[Judgement]:
        agents = tuple(episodes[0].agents) if self.mode == "agent" else ()
        prompt = build_prompt(self.mode, self.rubric, task, episodes, agents)
        if self.mode == "agent" and not agents:
            result = _result(None, [], 0, [0, 0], 0.0, ["the episode made no LLM call, so it has no agent to score"])
            return [self._judgement(task, episodes, 0, prompt, result, cached=False)]
        key = cache_key(self.name, self.mode, self.settings, prompt)  # the prompt holds the rubric and trajectories
        result = self._cache.get(key)
        cached = result is not None
        if cached:
            self._counters.add(cache_hits=1)
        else:
            result = self._ask(prompt, schema_for(self.mode, len(episodes), agents))
            if result["error"] is None:
                self._cache.put(key, result)
        return [self._judgement(task, episodes, i, prompt, result, cached) for i in range(len(episodes))]

    def _ask(self, prompt: list[dict[str, str]], schema: Any) -> dict[str, Any]:
        """Call the model until a reply parses (at most 1 + max_retries calls); the result (JSON-able)."""
        base: list[Any] = [SystemMessage(prompt[0]["content"]), HumanMessage(prompt[1]["content"])]
        messages = base
        replies: list[str] = []
        errors: list[str] = []
        tokens = [0, 0]
        start = time.monotonic()
        for attempt in range(1, self.max_retries + 2):
            if attempt > 1:
                self._counters.add(retries=1)
            try:
                message = self._call(messages, schema)
            except _CallFailed as exc:
                replies.append("")
                errors.append(f"attempt {attempt}: {exc}")
                self._counters.add(failed_calls=1)
                continue
            usage = getattr(message, "usage_metadata", None) or {}
            tokens[0] += int(usage.get("input_tokens", 0))
            tokens[1] += int(usage.get("output_tokens", 0))
            text = reply_text(message)
            replies.append(text)
            try:
                if (getattr(message, "response_metadata", None) or {}).get("finish_reason") == "length":
                    raise ReplyError(f"the reply was cut at max_tokens={self.max_tokens} (raise the judge's "
                                     "max_tokens)")
                items = parse_reply(text, schema)
            except ReplyError as exc:
                errors.append(f"attempt {attempt}: {exc}")
                self._counters.add(failed_calls=1)
                messages = [*base, AIMessage(text), HumanMessage(f"That reply cannot be used: {exc}. Reply "
                                                                     "again with only the JSON object.")]
                continue
            return _result(items, replies, attempt, tokens, time.monotonic() - start, [])
        return _result(None, replies, self.max_retries + 1, tokens, time.monotonic() - start, errors)

    def _call(self, messages: list[Any], schema: Any) -> Any:
        """One model call in its own thread, outside every instrumented run, holding a concurrency slot until
        it returns; the reply message. `_CallFailed` when it raises or takes longer than timeout_s."""
        runnable = (self.model.with_structured_output(json_schema(schema), method="json_schema", include_raw=True)
                    if self.structured else self.model)
        box: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                with app_models():
                    box["value"] = runnable.invoke(messages)
            except BaseException as exc:  # reported to the caller, who retries
                cut = _cut_reply(exc)  # a reply the client refused (cut at max_tokens): parsed and counted
                box["value" if cut is not None else "error"] = cut if cut is not None else exc
            finally:
                self._count_tokens(box.get("value"))  # here: a call abandoned at timeout_s counts its tokens too
                self._slots.release()
                done.set()

        self._slots.acquire()
        self._counters.add(calls=1)
        start = time.monotonic()
        threading.Thread(target=work, name=f"drmas-judge-{self.name}", daemon=True).start()
        finished = done.wait(self.timeout_s)
        self._counters.add(seconds=time.monotonic() - start)
        if not finished:
            raise _CallFailed(f"no reply within timeout_s={self.timeout_s:g}")
        if "error" in box:
            raise _CallFailed(f"the model call raised {type(box['error']).__name__}: {box['error']}")
        value = box["value"]
        return value["raw"] if isinstance(value, dict) and "raw" in value else value

    def _count_tokens(self, value: Any) -> None:
        message = value["raw"] if isinstance(value, dict) and "raw" in value else value
        usage = getattr(message, "usage_metadata", None) or {}
        self._counters.add(input_tokens=usage.get("input_tokens", 0), output_tokens=usage.get("output_tokens", 0))

    def _judgement(self, task: Any, episodes: list[Episode], index: int, prompt: list[dict[str, str]],
                   result: dict[str, Any], cached: bool) -> Judgement:
        items, group = result["items"], self.mode == "group"
        scores: Any = None
        reasons: Any = None
        error = None if items is not None else self._error(task, episodes, index, result)
        if items is not None and self.mode == "agent":
            agents = episodes[0].agents
            scores = {a: score for a, (score, _) in zip(agents, items)}
            reasons = {a: reason for a, (_, reason) in zip(agents, items)}
        elif items is not None:
            scores, reasons = items[index if group else 0]
        record: JudgementRecord = {"mode": self.mode, "model": self.name, "rubric_sha": self.rubric_sha, "prompt": prompt,
                  "replies": list(result["replies"]), "scores": scores, "reasons": reasons,
                  "attempts": result["attempts"], "input_tokens": result["input_tokens"],
                  "output_tokens": result["output_tokens"], "cached": cached, "seconds": result["seconds"],
                  "group_size": len(episodes) if group else None, "index": index if group else None,
                  "error": error}
        reward = dict(scores) if isinstance(scores, dict) else scores
        return Judgement(reward=reward, error=error, record=record)

    def _error(self, task: Any, episodes: list[Episode], index: int, result: dict[str, Any]) -> str:
        episode = episodes[index]
        where = f"episode {episode.id} (task {getattr(task, 'id', None)!r}"
        where += f", attempt {index + 1} of a group of {len(episodes)})" if self.mode == "group" else ")"
        last = next((r for r in reversed(result["replies"]) if r), "")
        return (f"judge {self.name!r} gave no usable score for {where} after {result['attempts']} call(s): "
                f"{'; '.join(result['errors'])}. Last reply: {clip_reply(last)!r}. Fix: raise the judge's "
                "max_retries or timeout_s, or use a judge model that follows the reply format (one with "
                "structured output)")


def _result(items: list | None, replies: list[str], attempts: int, tokens: list[int], seconds: float,
            errors: list[str]) -> dict[str, Any]:
    return {"items": items, "replies": replies, "attempts": attempts, "input_tokens": tokens[0],
            "output_tokens": tokens[1], "seconds": seconds, "errors": errors,
            "error": None if items is not None else "; ".join(errors)}


def _check_no_client_retries(model: Any, name: str) -> None:
    """Refuse a model whose client retries on its own (a `max_retries` field not 0; ChatOpenAI's None means the
    openai client's default, 2): its retries are requests `judge/calls` and the token figures never see, and an
    abandoned call's thread would go on sending them."""
    if "max_retries" in getattr(type(model), "model_fields", {}) and getattr(model, "max_retries", 0) != 0:
        raise ConfigError(f"judge model {name!r} has max_retries={model.max_retries!r}: its client would retry "
                          "requests the judge never counts (judge/calls, tokens). Build it with max_retries=0 (a "
                          "judge_model spec does) and set the Judge's own max_retries instead")


def _check_arguments(rubric: Any, mode: str, max_retries: int, timeout_s: float, max_concurrency: int,
                     max_tokens: int) -> None:
    if not isinstance(rubric, str) or not rubric.strip():
        raise ConfigError(f"Judge: rubric must be a non-empty string saying what a good attempt is, got {rubric!r}")
    if mode not in MODES:
        raise ConfigError(f"Judge: unknown mode {mode!r}; valid modes: {list(MODES)}")
    for key, value, least in (("max_retries", max_retries, 0), ("max_concurrency", max_concurrency, 1),
                              ("max_tokens", max_tokens, 1)):
        if not isinstance(value, int) or value < least:
            raise ConfigError(f"Judge: {key} must be an integer >= {least}, got {value!r}")
    if not timeout_s > 0:
        raise ConfigError(f"Judge: timeout_s must be > 0 seconds, got {timeout_s!r}")


class JudgedEnv:
    """An environment whose rewards come from a judge; everything else (tasks, turn_is_valid, is_success,
    invalid_penalty, resume, next_input, ...) is the wrapped env's, present exactly when it has it."""

    def __init__(self, env: Any, judge: Judge):
        self.env = env
        self.judge = judge

    def __getattr__(self, name: str) -> Any:
        if name in ("env", "judge"):  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.env, name)

    def __repr__(self) -> str:
        return f"JudgedEnv({self.env!r}, {self.judge!r})"

    def reward(self, task: Any, episode: Episode) -> float | dict[str, float]:
        """The judge's reward of one episode (`Judge.reward`); raises `JudgeError`."""
        return self.judge.reward(task, episode)

    def reward_group(self, task: Any, episodes: Sequence[Episode]) -> list[float | dict[str, float] | JudgeError]:
        """The judge's rewards of a group (`Judge.reward_group`)."""
        return self.judge.reward_group(task, episodes)

    def reward_metrics(self) -> dict[str, float]:
        """The wrapped env's own reward metrics (if it has any) and the judge's counters."""
        own = getattr(self.env, "reward_metrics", None)
        return {**(own() if callable(own) else {}), **self.judge.reward_metrics()}


def _cut_reply(exc: BaseException) -> AIMessage | None:
    """The reply inside an OpenAI client's `LengthFinishReasonError` (the structured-output parser refuses a
    reply cut at max_tokens, but the server answered and billed it): its text, tokens and finish reason, so the
    attempt is recorded and counted like any unusable reply. None for any other exception."""
    completion = getattr(exc, "completion", None)
    choices = getattr(completion, "choices", None)
    if not choices:
        return None
    usage = getattr(completion, "usage", None)
    n_in, n_out = (getattr(usage, "prompt_tokens", 0) or 0, getattr(usage, "completion_tokens", 0) or 0)
    return AIMessage(choices[0].message.content or "", response_metadata={"finish_reason": choices[0].finish_reason},
                     usage_metadata={"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out})
