"""W&B Weave traces of a run: every episode a `drmas.episode` call, every LLM call a `drmas.turn` child call.

What appears in Weave (one project):

- `drmas.episode` (a trace root): inputs task id, group id and the graph input; output the final state
  (made JSON-safe); the episode's error as the call's exception; the episode's real start and end times;
  attributes phase, training step, run, episode id; summary `drmas` (team reward, rewards per agent,
  calls, tokens) and, rolled up by Weave from the children, `usage` per model. thread_id = the GRPO group
  id, so the G rollouts of one task sit together. Each agent's reward is also feedback `drmas.reward`
  ({agent, value}) on the episode.
- `drmas.turn` (one per LLM call, child of its episode): inputs the prompt messages (OpenAI format) and
  the bound tools; output OpenAI chat-completion shape (text, tool calls, finish reason) with `model`
  (the policy name) and `usage` (prompt/completion/total tokens) so Weave counts tokens; attributes
  agent, node, step (LangGraph superstep), call_key, trainable, sampling, policy and version; summary
  `drmas` with the turn reward, advantage, logprob sum/mean/min and token count; start = when the call
  started, end = start + its latency.
- `drmas.judge` (when a judge model gave the rewards, `Episode.judgement`; a child of its episode, placed at the
  episode's end, zero long: the record holds how long the judge took, not when): inputs the judge's prompt
  (messages), mode, rubric hash and the episode's place in the judged group; output the model, parsed scores and
  reasons, the last raw reply and every attempt's reply; the judge's failure as the call's exception; summary
  `drmas` with attempts, tokens, seconds and whether it came from the cache. No `usage`: in group mode one judge
  call scores every episode of the group, so per-episode usage would count it G times. The scores and reasons
  are also feedback `drmas.judgement` ({mode, model, scores, reasons, error}) on the episode.
- Evaluations (avg@k, pass@k) through `weave.EvaluationLogger`: one prediction per task with scores
  avg@k, pass@k, and per agent reward, avg@k and pass@k; the summary holds the trainer's eval record.

Calls are written with `client.create_call`/`finish_call` and explicit timestamps (not `weave.op`
around the export). During training a background thread exports (`WeaveExporter`): the training thread
only enqueues a step number, never waits on the network, and never sees an export error (errors are
counted, and the first one is reported once as a `WeaveExportWarning`).

`weave.init` is called with `implicitly_patch_integrations=False`: weave's LangChain auto-patching would
trace every LLM call a second time (the app's own chat model calls are what drmas-graph intercepts).
"""

from __future__ import annotations

import contextvars
import datetime
import json
import math
import queue
import random
import re
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from drmas_graph.traces import _serde
from drmas_graph.errors import ConfigError, DrmasError
from drmas_graph.types import Episode, Turn

__all__ = ["EPISODE_OP", "TURN_OP", "JUDGE_OP", "REWARD_FEEDBACK", "JUDGEMENT_FEEDBACK", "WeaveExportWarning",
           "EpisodeError", "JudgementError", "WeaveExporter", "require_weave", "connect", "evaluation_episode", "export_episode", "log_evaluation",
           "sample_groups", "export_store", "start_exporter"]

EPISODE_OP = "drmas.episode"
"""Op name of an episode's root call."""
TURN_OP = "drmas.turn"
"""Op name of one LLM call."""
JUDGE_OP = "drmas.judge"
"""Op name of the judge's verdict on an episode (`Episode.judgement`)."""
REWARD_FEEDBACK = "drmas.reward"
"""Feedback type of an agent's episode reward: payload {"agent", "value"}."""
JUDGEMENT_FEEDBACK = "drmas.judgement"
"""Feedback type of the judge's verdict: payload {"mode", "model", "scores", "reasons", "error"}."""
APP_MODEL = "app-model"
"""Model name (usage key) of calls served by the app's own model (not a policy; token counts unknown)."""


class WeaveExportWarning(UserWarning):
    """An export to Weave failed (training goes on; reported once, later failures are only counted)."""


class EpisodeError(DrmasError):
    """The recorded failure of an episode, as the exception of its Weave call."""


class JudgementError(DrmasError):
    """The judge's recorded failure on an episode (`Episode.judgement["error"]`), as the exception of its call."""


# -- the weave package and client ----------------------------------------------------------------------


def require_weave() -> Any:
    """The `weave` module, or a ConfigError naming the extra that installs it."""
    try:
        import weave
    except ImportError as exc:
        raise ConfigError("W&B Weave tracing (logging.weave, `traces export --weave`) needs the `weave` package: "
                          "pip install 'drmas-graph[weave]'") from exc
    return weave


def weave_disabled() -> bool:
    """WEAVE_DISABLED (or weave's `disabled` setting) is on: weave then logs nothing at all."""
    from weave.trace.settings import should_disable_weave

    return should_disable_weave()


def connect(project: str) -> Any:
    """`weave.init(project)` with implicit integration patching off (see the module docstring)."""
    weave = require_weave()
    return weave.init(project, settings={"implicitly_patch_integrations": False, "print_call_link": False})


def _activate(client: Any) -> bool:
    """Make `client` weave's current client (weave traces only through it); True if this call set it."""
    from weave.trace.context import weave_client_context

    current = weave_client_context.get_weave_client()
    if current is client:
        return False
    if current is not None:
        raise ConfigError(f"another Weave client ({current.entity}/{current.project}) is active in this process; "
                          "export with that client or finish it first")
    weave_client_context.set_weave_client_global(client)
    return True


def _deactivate(client: Any) -> None:
    from weave.trace.context import weave_client_context

    if weave_client_context.get_weave_client() is client:
        weave_client_context.set_weave_client_global(None)


# -- values ------------------------------------------------------------------------------------------------


def _utc(ts: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC)


def _safe(value: Any, where: str) -> Any:
    """A JSON-safe copy: LangChain messages in OpenAI form, other objects as `_serde.to_json` stores them."""
    from langchain_core.messages import BaseMessage, convert_to_openai_messages

    if isinstance(value, BaseMessage):
        return convert_to_openai_messages(value)
    if isinstance(value, Mapping):
        return {str(k): _safe(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_safe(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return json.loads(_serde.to_json(value, where))


def _logprob_stats(logprobs: Sequence[float]) -> dict[str, float | None]:
    if not logprobs:
        return {"logprob_sum": None, "logprob_mean": None, "logprob_min": None}
    total = math.fsum(logprobs)
    return {"logprob_sum": total, "logprob_mean": total / len(logprobs), "logprob_min": min(logprobs)}


def _number(values: Sequence[float] | None, i: int) -> float | None:
    if values is None or values[i] is None or not math.isfinite(values[i]):
        return None
    return float(values[i])


def _turn_output(turn: Turn) -> dict[str, Any]:
    """OpenAI chat-completion shape; `model` and `usage` at the top let Weave count tokens per model."""
    message: dict[str, Any] = {"role": "assistant", "content": turn.response_text}
    if turn.tool_calls:
        message["tool_calls"] = [
            {"id": c.get("id"), "type": "function",
             "function": {"name": c.get("name"), "arguments": json.dumps(_safe(c.get("args", {}), "tool args"))}}
            for c in turn.tool_calls]
    usage = ({"prompt_tokens": turn.n_prompt_tokens, "completion_tokens": turn.n_response_tokens,
              "total_tokens": turn.n_prompt_tokens + turn.n_response_tokens} if turn.trainable else {})
    return {"model": turn.policy or APP_MODEL, "usage": usage,
            "choices": [{"index": 0, "message": message, "finish_reason": turn.finish_reason}]}


def _turn_start(episode: Episode, position: int) -> tuple[float, bool]:
    """Unix start time of a turn, and whether it was recorded (traces older than `turn_starts` fall back to the
    episode's start)."""
    starts = episode.timings.get("turn_starts")
    if isinstance(starts, list) and len(starts) == len(episode.turns):
        return float(starts[position]), True
    return float(episode.timings.get("start", 0.0)), False


# -- one episode -----------------------------------------------------------------------------------------


def export_episode(client: Any, episode: Episode, *, train_step: int | None = None, run: str | None = None) -> Any:
    """Log one episode as a `drmas.episode` call with one `drmas.turn` child per LLM call; returns the root call.

    The client must be weave's current client (`WeaveExporter` and `export_store` see to it)."""
    import weave

    phase = (episode.metadata or {}).get("phase")
    start = float(episode.timings.get("start", 0.0))
    end = float(episode.timings.get("end", start))
    attributes = {"phase": phase, "train_step": train_step, "run": run, "episode_id": episode.id}
    inputs = {"task_id": episode.task_id, "group_id": episode.group_id,
              "input": _safe(episode.input, f"episode {episode.id} input")}
    with weave.thread(episode.group_id):
        root = client.create_call(EPISODE_OP, inputs, attributes=attributes, use_stack=False, started_at=_utc(start),
                                  display_name=f"{episode.task_id} ({phase or 'episode'})")
        for position, turn in enumerate(episode.turns):
            _export_turn(client, root, episode, position, turn, train_step)
        if episode.judgement is not None:
            _export_judgement(client, root, episode, end)
        root.summary = {"drmas": {
            "team_reward": _serde.mean(episode.rewards.values()), "rewards": dict(episode.rewards),
            "calls": len(episode.turns), "prompt_tokens": sum(t.n_prompt_tokens for t in episode.turns),
            "response_tokens": sum(t.n_response_tokens for t in episode.turns),
            "wall_s": episode.timings.get("wall_s")}}
        client.finish_call(root, _safe(episode.final_state, f"episode {episode.id} final_state"),
                           exception=EpisodeError(episode.error) if episode.error else None, ended_at=_utc(end))
    for agent, reward in episode.rewards.items():
        root.feedback.add(REWARD_FEEDBACK, {"agent": agent, "value": float(reward)})
    if episode.judgement is not None:
        verdict = {key: episode.judgement.get(key) for key in ("mode", "model", "scores", "reasons", "error")}
        root.feedback.add(JUDGEMENT_FEEDBACK, _safe(verdict, f"episode {episode.id} judgement"))
    return root


def _export_turn(client: Any, root: Any, episode: Episode, position: int, turn: Turn, train_step: int | None) -> None:
    start, recorded = _turn_start(episode, position)
    sampling = None if turn.sampling is None else _safe(turn.sampling, "sampling")
    attributes = {"agent": turn.agent, "node": turn.node, "step": turn.step, "call_key": turn.call_key,
                  "trainable": turn.trainable, "sampling": sampling, "policy": turn.policy,
                  "policy_version": turn.policy_version, "index": turn.index, "train_step": train_step,
                  "start_recorded": recorded}
    inputs = {"messages": [_safe(m, "message") for m in turn.messages], "tools": _safe(list(turn.tools), "tools")}
    call = client.create_call(TURN_OP, inputs, parent=root, attributes=attributes, use_stack=False,
                              started_at=_utc(start), display_name=f"{turn.agent} · {turn.node}")
    call.summary = {"drmas": {"turn_reward": _number(episode.turn_rewards, position),
                              "advantage": _number(episode.advantages, position),
                              "tokens": turn.n_response_tokens, **_logprob_stats(turn.response_logprobs)}}
    client.finish_call(call, _turn_output(turn), ended_at=_utc(start + turn.latency_s))
    # The parent sums its children's in-memory summaries: keep only what adds up (usage, status counts); the
    # request already sent holds the turn's full summary (finish_call serialised it).
    call.summary = {k: v for k, v in call.summary.items() if k != "drmas"}


def _export_judgement(client: Any, root: Any, episode: Episode, end: float) -> None:
    record = _safe(episode.judgement, f"episode {episode.id} judgement")
    replies = record.get("replies") or []
    inputs = {"messages": record.get("prompt") or [], "mode": record.get("mode"),
              "rubric_sha": record.get("rubric_sha"), "group_size": record.get("group_size"),
              "index": record.get("index")}
    call = client.create_call(JUDGE_OP, inputs, parent=root, attributes={"model": record.get("model")},
                              use_stack=False, started_at=_utc(end), display_name=f"judge · {record.get('model')}")
    call.summary = {"drmas": {key: record.get(key) for key in
                              ("attempts", "input_tokens", "output_tokens", "seconds", "cached")}}
    output = {"model": record.get("model"), "scores": record.get("scores"), "reasons": record.get("reasons"),
              "reply": replies[-1] if replies else None, "replies": replies}
    error = record.get("error")
    client.finish_call(call, output, exception=JudgementError(error) if error else None, ended_at=_utc(end))
    call.summary = {k: v for k, v in call.summary.items() if k != "drmas"}  # as a turn's: the parent sums children


# -- evaluations ---------------------------------------------------------------------------------------------


def log_evaluation(record: Mapping[str, Any], rollouts: Iterable[tuple[Any, Episode, Any, bool]], *,
                   threshold: float, run: str | None = None) -> Any:
    """One `weave.EvaluationLogger` evaluation: a prediction per task with scores avg_at_k / pass_at_k (team) and
    <agent>_reward, <agent>_avg_at_k, <agent>_pass_at_k (an agent succeeds when its reward >= `threshold`); the
    summary adds the trainer's eval record (avg@k, pass@k, per-agent reward ...) under "output".

    `rollouts`: (task, episode, score or None when the reward failed, success) of every finished rollout; a task's
    rollouts that never finished count as failures (out of record["k"])."""
    weave = require_weave()
    k = int(record["k"])
    by_task: dict[Any, tuple[Any, list[tuple[Episode, Any, bool]]]] = {}
    for task, episode, score, success in rollouts:
        by_task.setdefault(task.id, (task, []))[1].append((episode, score, success))
    ev = weave.EvaluationLogger(
        name=f"{run or 'run'} step {record['step']}", model={"name": run or "policies", "step": record["step"]},
        dataset=[{"task_id": t.id, "input": _safe(t.input, "task input")} for t, _ in by_task.values()] or None,
        eval_attributes={"split": record.get("split"), "k": k, "step": record["step"]}, trace_scores=False)
    for task, runs in by_task.values():
        output = [{"episode_id": ep.id, "error": ep.error, "success": ok,
                   "rewards": None if score is None else dict(score.rewards),
                   "final_state": _safe(ep.final_state, f"episode {ep.id} final_state")} for ep, score, ok in runs]
        pred = ev.log_prediction({"task_id": task.id, "input": _safe(task.input, "task input")}, output)
        for name, value in _task_scores(runs, k, threshold).items():
            pred.log_score(name, value)
        pred.finish()
    ev.log_summary({key: v for key, v in record.items() if isinstance(v, int | float | str)})
    return ev


def evaluation_episode(episode: Episode) -> Episode:
    """What `log_evaluation` logs of an episode (id, task, group, error, rewards, the final state made JSON-safe)
    and nothing else: small, and free of user objects that may not pickle, so another process can send it."""
    return Episode(id=episode.id, task_id=episode.task_id, group_id=episode.group_id, error=episode.error,
                   final_state=_safe(episode.final_state, f"episode {episode.id} final_state"),
                   rewards=dict(episode.rewards), metadata={"phase": (episode.metadata or {}).get("phase")})


def _task_scores(runs: list[tuple[Episode, Any, bool]], k: int, threshold: float) -> dict[str, float]:
    """Scores of one task's k rollouts; names keep to [A-Za-z0-9_] (Weave strips other characters)."""
    scores = {"avg_at_k": sum(ok for *_, ok in runs) / k, "pass_at_k": float(any(ok for *_, ok in runs))}
    agents = sorted({a for _, score, _ in runs if score is not None for a in score.rewards})
    for agent in agents:
        rewards = [score.rewards[agent] for _, score, _ in runs if score is not None and agent in score.rewards]
        wins = [r >= threshold for r in rewards]
        name = re.sub(r"\W", "_", agent)
        scores[f"{name}_reward"] = sum(rewards) / len(rewards)
        scores[f"{name}_avg_at_k"] = sum(wins) / k
        scores[f"{name}_pass_at_k"] = float(any(wins))
    return scores


# -- sampling ------------------------------------------------------------------------------------------------


def sample_groups(group_ids: Iterable[str | None], n: int | None, *, seed: int, step: int) -> list[str | None]:
    """`n` of the groups (all when n is None or there are no more), a seeded choice per step, in sorted order."""
    groups = sorted(set(group_ids), key=lambda g: (g is None, g or ""))
    if n is None or n >= len(groups):
        return groups
    chosen = set(random.Random(f"{seed}:weave:{step}").sample(range(len(groups)), n))
    return [g for i, g in enumerate(groups) if i in chosen]


# -- the background exporter --------------------------------------------------------------------------------


class WeaveExporter:
    """Exports a training run to Weave on a background thread; the training thread only enqueues.

    `submit_step(step)` after the step's rewards and advantages are stored: `sample_per_step` of its groups
    (all their rollouts, those the step did not train on included: failed runs with their error, runs whose
    reward failed with `unused_error`) are read from the trace store and exported. `submit_evaluation`
    logs an evaluation. Export errors never reach training: each is counted (`errors`) and the first is
    reported once as a `WeaveExportWarning`. `close()` drains the queue and flushes the client.
    """

    def __init__(self, client: Any, store_path: str | Path, *, sample_per_step: int | None, seed: int = 0,
                 run: str | None = None, evaluations: bool = True, success_threshold: float = 1.0) -> None:
        self.client, self.store_path, self.run = client, Path(store_path), run
        self.sample_per_step, self.seed, self.evaluations = sample_per_step, seed, evaluations
        self.success_threshold = success_threshold
        self.exported_episodes = 0
        """Episodes exported so far."""
        self.errors = 0
        """Exports that failed (a step's episodes, or an evaluation)."""
        self.first_error: BaseException | None = None
        self._owns_client = _activate(client)
        self._store: Any = None
        self._started = time.time()  # rollouts stored before (an earlier, killed run's) are not this run's
        self._queue: queue.Queue = queue.Queue()
        # weave keeps its settings (those weave.init got) in a context variable: run the thread in this context
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._work,), name="drmas-weave-export",
                                        daemon=True)
        self._thread.start()

    # training thread --------------------------------------------------------------------------
    def submit_step(self, step: int) -> None:
        self._queue.put(("step", step))

    def submit_evaluation(self, record: Mapping[str, Any], rollouts: list[tuple[Any, Episode, Any, bool]]) -> None:
        if self.evaluations:
            self._queue.put(("eval", (dict(record), list(rollouts))))

    def close(self) -> None:
        """Export what is queued, flush the client, stop the thread (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        try:
            self.client.flush()
        except Exception as exc:
            self._failed(exc)
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._owns_client:
            _deactivate(self.client)
            self._owns_client = False

    # export thread ----------------------------------------------------------------------------
    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            kind, arg = job
            try:
                if kind == "step":
                    self._export_step(arg)
                else:
                    log_evaluation(arg[0], arg[1], threshold=self.success_threshold, run=self.run)
            except Exception as exc:  # never reaches training: counted, the first reported once
                self._failed(exc)

    def _export_step(self, step: int) -> None:
        from drmas_graph.traces.store import TraceStore

        if self._store is None:
            self._store = TraceStore(self.store_path, readonly=True)
        used = self._store.episodes(step=step)
        unused = self._unused(step)
        chosen = set(sample_groups([s.group_id for s in used + unused], self.sample_per_step, seed=self.seed,
                                   step=step))
        for summary in used + unused:
            if summary.group_id not in chosen:
                continue
            episode = self._store.load_episode(summary.id)
            if summary.step is None and episode.error is None:
                episode.error = unused_error(step)
            elif summary.step is None and episode.error.startswith(_SCORING_ERROR):  # scoring stored why
                episode.error = unused_error(step, episode.error[len(_SCORING_ERROR):])
            export_episode(self.client, episode, train_step=step, run=self.run)
            self.exported_episodes += 1

    def _unused(self, step: int) -> list[Any]:
        """The rollouts of training step `step` that it did not train on: failed runs (their error stored) and
        finished runs whose reward failed (no error stored). The trainer names a step's groups
        "train:<step>:<task id>" ("train:<step>#<k>:<task id>" for a task's k-th group in the step); only rollouts
        stored since this exporter started count."""
        return [s for s in self._store.episodes(group_prefix=f"train:{step}") if s.step is None
                and s.group_id[len(f"train:{step}"):][:1] in (":", "#") and s.created >= self._started]

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        if self.first_error is None:
            self.first_error = exc
            warnings.warn(f"exporting to Weave failed ({type(exc).__name__}: {exc}); training goes on, later "
                          "export errors are counted (WeaveExporter.errors) but not reported", WeaveExportWarning,
                          stacklevel=2)


_SCORING_ERROR = "BadRewardError: "
"""How training stores the error of an episode whose reward was unusable (`_scoring`)."""


def unused_error(step: int, reason: str | None = None) -> str:
    """What a rollout of training step `step` that finished but was not trained on shows as its error: `reason`,
    the error scoring stored for it (without its "BadRewardError: "), else a description of every such case."""
    if reason is not None:
        return f"BadRewardError: not trained on in step {step}: {reason}"
    return (f"BadRewardError: not trained on in step {step}: its reward was unusable (env.reward or turn_is_valid "
            "raised, a reward was missing or not finite, or the judge gave no score); the step's "
            "bad_reward_episodes or judge_failed_episodes counts it")


def start_exporter(cfg: Any, store_path: Path) -> WeaveExporter | None:
    """The exporter of a training run's `logging.weave` (None when it is off; a warning when WEAVE_DISABLED)."""
    wc = cfg.logging.weave
    if wc is None:
        return None
    require_weave()
    if weave_disabled():
        warnings.warn("logging.weave is set but WEAVE_DISABLED is on: nothing is exported to Weave",
                      WeaveExportWarning, stacklevel=3)
        return None
    return WeaveExporter(connect(wc.project), store_path, sample_per_step=wc.sample_per_step, seed=cfg.seed,
                         run=cfg.name, evaluations=wc.evaluations, success_threshold=cfg.success_threshold)


# -- a stored run ---------------------------------------------------------------------------------------------


def export_store(client: Any, store_path: str | Path, *, sample_per_step: int | None = None, seed: int = 0,
                 run: str | None = None, step: int | None = None) -> int:
    """Export a stored run (its trace store) to Weave: training episodes by step (`sample_per_step` groups
    each, all when None), then every episode never used in a step (evaluation runs, failed groups); with `step`,
    only that step's training episodes. Returns the number of episodes exported. Runs on the calling thread;
    errors propagate."""
    from drmas_graph.traces.store import TraceStore

    owns = _activate(client)
    n = 0
    try:
        with TraceStore(store_path, readonly=True) as store:
            summaries = store.episodes() if step is None else store.episodes(step=step)
            by_step: dict[int | None, list[Any]] = {}
            for s in summaries:
                by_step.setdefault(s.step, []).append(s)
            for step in sorted(k for k in by_step if k is not None):
                chosen = set(sample_groups((s.group_id for s in by_step[step]), sample_per_step, seed=seed, step=step))
                for s in by_step[step]:
                    if s.group_id in chosen:
                        export_episode(client, store.load_episode(s.id), train_step=step, run=run)
                        n += 1
            for s in by_step.get(None, []):
                export_episode(client, store.load_episode(s.id), run=run)
                n += 1
        client.flush()
    finally:
        if owns:
            _deactivate(client)
    return n


def cli_export(args: Any, console: Any) -> int:
    """`drmas-graph traces export --weave PROJECT RUN_DIR [--sample-per-step N] [--step S]`."""
    if args.agent:
        raise ConfigError("--agent does not apply to --weave (an episode is exported with all its calls)")
    path = Path(args.path)
    store_path = path / "traces.db" if path.is_dir() else path
    require_weave()
    if weave_disabled():
        raise ConfigError("WEAVE_DISABLED is set: unset it to export to Weave")
    from drmas_graph.traces.store import TraceStore

    with TraceStore(store_path, readonly=True) as store:
        config = store.config
    client = connect(args.weave)
    n = export_store(client, store_path, sample_per_step=args.sample_per_step, seed=int(config.get("seed", 0)),
                     run=config.get("name"), step=args.step)
    console.print(f"exported {n} episodes to Weave project {args.weave}", markup=False)
    return 0
