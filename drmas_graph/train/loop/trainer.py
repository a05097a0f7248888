"""`train_graph(graph, env)`: agent-wise GRPO (Dr. MAS) over an existing LangGraph app.

One step: sample B tasks (a seeded, resumable order) -> G concurrent rollouts each through the
instrumented graph -> rewards (team or per agent, minus the invalid-turn penalty; an environment with
`reward_group`, e.g. a judge, scores each group at once) -> advantages
(`compute_advantages`, estimator by name) -> one `ModelUpdater.update` per trainable model -> new weights
visible to the rollout backend -> metrics, periodic evaluation (avg@k, pass@k) and checkpoints.

Weights reach the rollout backend in one of two ways. An embedded policy (`TransformersPolicy`) serves the
very module the updater trains: the update runs inside `policy.updating_weights()`, which bumps its version.
A served policy (SGLang, vLLM: anything with `sync_weights(dir, version)`) has no local model: the updater
trains a local copy, which is written to run_dir/sync/<model>/ (Hugging Face format + tokenizer) and loaded
into every server with version = steps done; a server that fails or reports another version stops the run.

With `async.max_staleness` >= 1 the steps are pipelined (`_pipeline`): later steps' rollouts run while the
trainer updates on this one, the trainer trains a copy of an embedded model, and the new weights reach the
rollouts at the step boundary (`async.schedule: one_step_off`) or right after each update (`free`).

The run's pieces are built once from the config (`_setup.build_run`) into a frozen `_state.RunState` (one
`ModelSlot` per model: its policy, agents, trained module, updater; the store, app, env, run folder, ...) that every
part takes. One step reads top to bottom below: `collect` (roll out, score, advantages, samples: a `StepBatch`),
`learn` (update, store the scores, the step's metrics), `publish` (every process's traces, the export); `Trainer`
holds the run and the loop, and the asynchronous pipeline drives the same three functions. The parts live
next to this module: `_build` (policies and updaters from the config), `_rollouts` (G concurrent episodes per task),
`_scoring` (rewards, advantages, the step's metrics), `_learn` (every trained model's update, `optim.update`),
`_checkpoints` (checkpoints, resume, weight sync), `evaluate` (avg@k, pass@k), `_pipeline` (asynchronous training),
`optim.offpolicy` (its off-policy correction).

Departures from the reference code (langfengQ/DrMAS): no duplicate padding of per-model batches before
advantage estimation (it biases the statistics); failed episodes, bad rewards and episodes without LLM
calls are dropped from their group and counted, never silently trained on. Like the reference, episodes
that a limit stopped (truncated) and those the policy's output broke (model errors) are trained on, with
the configured rewards (`rollout.truncated_reward`, `rollout.model_error_reward`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drmas_graph.config import TrainConfig, merge_overrides
from drmas_graph.env import Group
from drmas_graph.errors import RolloutError
from drmas_graph.policy import Policy
from drmas_graph.traces.weave_export import WeaveExporter, start_exporter
from drmas_graph.train.engines import distributed
from drmas_graph.train.loop import _checkpoints, _pipeline, _scoring
from drmas_graph.train.loop._learn import update_models
from drmas_graph.train.loop._rollouts import StepBatch, roll_out
from drmas_graph.train.loop._setup import RunDirInUseError, build_run, free_run_dir
from drmas_graph.train.loop._state import RunState, abandon, close
from drmas_graph.train.loop._timing import time_line, timed
from drmas_graph.train.loop.evaluate import evaluate, reply_lines
from drmas_graph.train.loop.metrics import RunLogger, Stopwatch
from drmas_graph.types import Episode

__all__ = ["train_graph", "TrainResult", "Trainer", "evaluate", "RunDirInUseError"]

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a training run produced."""

    run_dir: Path
    """Folder holding traces.db, metrics.jsonl, tensorboard/ and checkpoints/."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """One metrics record per training step."""
    evals: list[dict[str, Any]] = field(default_factory=list)
    """One record per evaluation (step 0 = before training)."""
    checkpoint: Path | None = None
    """The last checkpoint written."""
    warm_start: Any = None
    """The warm start before the RL (`warm_start.WarmStartResult`: demonstrations, loss, scores before and after);
    None without `warm_start` in the config."""

    def summary(self) -> str:
        """A short table: the warm start's rows when there was one (`WarmStartResult.lines`), per-agent reward
        (turn reward incl. invalid-turn penalties) and avg@k / pass@k,
        at the first and the last evaluation; the training reward of the first and last step ('-' for a step
        where no episode got a reward), with its episode counts (rewarded, unjudged, failed, bad reward) where
        some got none, and per agent with tools its tool calls per turn and share of well-formed tool calls. One column where there was only one (one evaluation, one step). Then where the time went
        (`_timing.time_line`): 'time per step: rollout 12.1 s (prefill 1.2, decode 9.8), score 0.4 s, ...'."""

        def row(label: str, *cells: Any) -> str:
            # a column of 12 characters, at least one space before it ('step 11 done' is 12 long)
            return f"{label:<28}" + "".join(f"{c:>12.3f}" if isinstance(c, float) else f" {c!s:>11}" for c in cells)

        lines = self.warm_start.lines() if self.warm_start is not None else []
        if self.evals:
            ends = self.evals[:1] if len(self.evals) == 1 else [self.evals[0], self.evals[-1]]
            last = ends[-1]
            k, split = last["k"], last["split"]
            lines.append(row("evaluation on " + split, *("before" if e["step"] == 0 else f"step {e['step'] - 1} done"
                                                          for e in ends)))  # numbered as the training steps
            agents = sorted({key[:-len("/reward")] for key in last if key.endswith("/reward")})  # names may hold '/' 
            for a in agents:
                lines.append(row("  reward " + a, *(float(e.get(f"{a}/reward", float("nan"))) for e in ends)))
            for metric in ("avg@k", "pass@k"):
                lines.append(row("  " + metric.replace("k", str(k)),  # '-': no task had a judged episode
                                 *(float(e[metric]) if metric in e else "-" for e in ends)))
            if any(e.get("unjudged_episodes") for e in ends):  # left out of avg@k and pass@k
                lines.append(row("  unjudged episodes", *(int(e.get("unjudged_episodes", 0)) for e in ends)))
            lines += reply_lines(last)
        if self.history:
            ends = self.history[:1] if len(self.history) == 1 else [self.history[0], self.history[-1]]
            lines.append(row("training reward (team)", *(f"step {h['step']}" for h in ends)))
            lines.append(row("", *(float(h["reward/team_mean"]) if "reward/team_mean" in h else "-" for h in ends)))
            counts = (("episodes", "episodes with a reward"), ("judge_failed_episodes", "unjudged episodes"),
                      ("failed_episodes", "failed episodes"), ("bad_reward_episodes", "bad-reward episodes"))
            if any(h.get(key) for h in ends for key, _ in counts[1:]):  # some got no reward: say how many
                lines += [row("  " + label, *(int(h.get(key, 0)) for h in ends)) for key, label in counts]
            lines += _tool_rows(ends, row)
        if (line := time_line(self.history, self.evals)) is not None:
            lines.append(line)
        lines.append(f"run folder: {self.run_dir}")
        return "\n".join(lines)


def _tool_rows(ends: Sequence[dict[str, Any]], row: Any) -> list[str]:
    """Per agent with tools bound in one of the `ends` steps: its tool calls per turn and the share of well-formed
    tool calls ('-' where a step had no such turn, `_scoring.tool_use`)."""
    suffix = "/tool_calls_per_turn"
    agents = sorted({k[len("agent/"):-len(suffix)] for h in ends for k in h
                     if k.startswith("agent/") and k.endswith(suffix)})
    lines = []
    for a in agents:  # an agent's name may hold '/' (a node inside a subgraph)
        for key, label in ((f"agent/{a}/tool_calls_per_turn", "tool calls/turn"),
                           (f"agent/{a}/tool_calls_well_formed", "well-formed calls")):
            lines.append(row(f"  {label} {a}", *(float(h[key]) if key in h else "-" for h in ends)))
    return lines


def _after(steps_done: int) -> str:
    """When an evaluation ran, numbered as training steps are (from 0, as metrics.jsonl's `step`, errors and the
    trace store): 'before' training, 'after step 2' (its record's `step` counts the steps done: 3)."""
    return "before" if steps_done == 0 else f"after step {steps_done - 1}"


def train_graph(graph: Any, env: Any, config: TrainConfig | None = None, *,
                policies: Mapping[str, Policy] | None = None, train_models: Mapping[str, Any] | None = None,
                rollout_config: Mapping[str, Any] | None = None, **overrides: Any) -> TrainResult:
    """Train the policies behind `graph` on `env` with agent-wise GRPO.

    Args:
        graph: the app's compiled LangGraph graph (or StateGraph builder); it is not modified.
        env: tasks(split), reward(task, episode), optional turn_is_valid(task, turn) (see `Env`).
        config: a `TrainConfig` (or None for defaults); `overrides` replace fields (`steps=3`,
            `eval__k=2` for nested ones).
        policies: agent -> Policy built in Python (instead of, or on top of, `config.models`).
        train_models: policy name -> the Hugging Face model to train for a *served* policy given in
            `policies` (its local copy, with the weights the servers started from; it never generates).
            After each update it is pushed to the servers. Embedded policies train their own `.model`.
        rollout_config: a LangGraph RunnableConfig merged into every episode's config (`configurable`,
            `recursion_limit`, `callbacks`, ...); each episode still gets its own `configurable.thread_id`
            (see the config's `rollout` section for limits per episode).

    Served models, from a config (`models.<name>.serve`, see `ServeConfig`) or from Python:

        policy = SGLangPolicy(url, tokenizer, name="qwen")          # servers started from /models/qwen
        local = AutoModelForCausalLM.from_pretrained("/models/qwen")
        train_graph(graph, env, cfg, policies={"solver": policy}, train_models={"qwen": local})
    """
    cfg = merge_overrides(config, overrides)
    trainer = Trainer(graph, env, cfg, policies=policies, train_models=train_models, rollout_config=rollout_config)
    try:
        return trainer.run()
    finally:
        trainer.close()


# ---- one training step, top to bottom: collect (roll out, score, advantages, samples), learn (update, store,
# metrics), publish (every process's traces, the export) ----------------------------------------------------------


def batch_tasks(run: RunState, step: int) -> list[Any]:
    """Tasks of a step: positions step * B ... step * B + B - 1 of `RunState.task_order`."""
    return run.task_order(step * run.cfg.tasks_per_step, run.cfg.tasks_per_step)


def collect(run: RunState, step: int) -> StepBatch:
    """Step `step`'s rollouts (this process's groups), scored, with advantages and the trained agents' Samples."""
    group_size = run.cfg.group_size
    times = Stopwatch()
    tasks = batch_tasks(run, step)
    batch = roll_out(run.app, run.env, tasks, step, group_size, phase="train", seed=run.cfg.seed,
                     rollout=run.cfg.rollout, base_config=run.rollout_config, slots=run.episode_slots)
    times.lap("rollout")
    groups, unscored = _scoring.score_runs(run.env, batch.runs, batch.counts, invalid_penalty=run.invalid_penalty,
                                           rollout=run.cfg.rollout,
                                           on_error=_scoring.first_failures_logger(run.notes.logged_failures))
    _scoring.store_scores(run.store, step=None, unscored=unscored)  # why each was left out
    groups, adv_stats = _scoring.with_advantages(groups, run.cfg)
    samples = _scoring.trained_samples(groups, run.trained_agents())
    times.lap("score")
    return StepBatch(step, len(tasks) * group_size, batch.counts, batch.errors, groups, unscored,
                     samples, adv_stats, times)


def learn(run: RunState, batch: StepBatch, *, pipelined: bool) -> dict[str, Any]:
    """Update every trained model on the batch's samples, store the trained episodes' scores; return the step's
    metrics record (and set `batch.trained`: every process's groups). `pipelined`: asynchronous training (the new
    weights reach the rollouts at the pipeline's next step boundary)."""
    step, groups, times = batch.step, batch.groups, batch.times
    episodes = [ep for group in groups for ep in group.episodes]
    if not any(distributed.gather(bool(episodes))):  # every rank decides alike (one rank's loss is not fatal)
        err = _scoring.nothing_to_train(step, batch.n_episodes,
                                        batch.rollout_errors or [u.error for u in batch.unscored], run.run_dir)
        _, counts, _ = distributed.merge_step(groups, batch.counts, batch.adv_stats)
        # what was measured: the counts (failed, unjudged, ...) and the times
        err.step_record = {"step": step, **counts, "episodes": 0, "time/rollout_s": times.laps["rollout"],
                           "time/score_s": times.laps["score"], "time/step_s": times.total()}
        raise err
    times.skip()  # a pipelined step waited for its update
    update_metrics, sync_s = update_models(run, batch.samples, step=step, pipelined=pipelined)
    times.lap("update")
    _scoring.store_scores(run.store, step=step, groups=groups)
    groups, counts, adv_stats = distributed.merge_step(groups, batch.counts, batch.adv_stats)  # every rank's
    batch.trained = groups
    record = _scoring.step_record(step, list(run.agent_policies), groups, counts, adv_stats, update_metrics,
                                  times, sync_s)
    for warning in (_scoring.unfinished_warning(record, batch.n_episodes), run.notes.zero_signal.observe(record)):
        if warning is not None and distributed.is_main():
            log.warning(warning)
    return record


def publish(run: RunState, weave: WeaveExporter | None, step: int, trained: Sequence[Group] = ()) -> None:
    """Copy every process's traces into traces.db (rank 0; where no rank writes), then export step `step`.
    `trained`: every process's trained groups of the step, whose training data rank 0 writes after the copy
    (asynchronous training copies a step's episodes from the rank files before they are trained)."""
    distributed.merge_traces(run.run_dir)
    if trained and distributed.world_size() > 1 and distributed.is_main():
        _scoring.store_scores(run.store, step=step, groups=trained)
    if weave is not None:
        weave.submit_step(step)


class Trainer:
    """The training loop over a run built once from its config (`state`, a `RunState`); `run()` is the loop.
    Build it through `train_graph`; `train=False` builds no updaters (evaluation, `drmas-graph check`)."""

    def __init__(self, graph: Any, env: Any, cfg: TrainConfig, *, policies: Mapping[str, Policy] | None = None,
                 train_models: Mapping[str, Any] | None = None, train: bool = True,
                 rollout_config: Mapping[str, Any] | None = None):
        self.state = build_run(graph, env, cfg, policies=policies, train_models=train_models, train=train,
                               rollout_config=rollout_config)
        """The run's pieces (policies, updaters, store, app, env, run folder); see `RunState`."""
        self.pipeline: _pipeline.OneStepOff | None = None
        """Asynchronous training (`async.max_staleness` >= 1); None = synchronous steps."""
        self.weave: WeaveExporter | None = None
        """Exports episodes and evaluations to W&B Weave (`logging.weave`), off the training thread."""
        run = self.state
        try:  # rank 0 exports from the merged store
            self.weave = start_exporter(cfg, run.run_dir / "traces.db") if distributed.is_main() else None
            if train and cfg.async_.max_staleness > 0 and run.async_fallback is None:
                self.pipeline = _pipeline.pipeline(
                    run, collect=functools.partial(collect, run), learn=functools.partial(learn, run, pipelined=True),
                    publish=functools.partial(publish, run, self.weave))
            resume = cfg.resume and _checkpoints.has_checkpoint(run.run_dir)  # else only a warm start was done
            self.start_step = _checkpoints.resume(run, self.pipeline) if resume else 0
            if self.start_step == 0:  # adapters loaded by name must exist on the servers before the first rollout
                for name in (n for n, m in run.models.items() if getattr(m.policy, "lora_by_name", ())):
                    _checkpoints.sync_weights(run, name, version=0)
        except BaseException:
            if self.weave is not None:
                self.weave.close()
            # e.g. servers launched for a run that never starts
            abandon(run.built, run.store, distributed.store_path(run.run_dir) if run.new_store else None)
            raise
        # never overwrite a training run's config; under several processes rank 0 writes it
        if distributed.is_main() and (train or not (run.run_dir / "config.yaml").exists()):
            cfg.to_yaml(run.run_dir / "config.yaml")
        self.result = TrainResult(run_dir=run.run_dir, warm_start=run.warm_start)

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> TrainResult:
        cfg = self.state.cfg
        logger_cls = RunLogger if distributed.is_main() else distributed.NullLogger  # rank 0 writes metrics
        logger = logger_cls(self.state.run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                            progress=cfg.logging.progress, total_steps=cfg.steps, start_step=self.start_step,
                            agents=list(self.state.agent_policies), run_name=cfg.name,
                            config=cfg.model_dump(mode="json"))
        try:
            if cfg.eval.before_training and self.start_step == 0:
                self._evaluate(0, logger)
            for step, record in self.steps():
                done = step + 1
                try:  # the step's line carries its checkpoint's time, and is logged if the checkpoint fails
                    if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.steps:
                        record["time/checkpoint_s"] = timed(self.save_checkpoint, done)
                finally:
                    self.result.history.append(record)
                    logger.log(record)
                    logger.progress(step, record)
                if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.steps:
                    self._evaluate(done, logger)
            if self.start_step < cfg.steps:  # checkpoint first: asynchronous runs save the weights step N rolls out on
                self.save_checkpoint(cfg.steps)
                self._evaluate(cfg.steps, logger)
            distributed.remove_rank_stores(self.state.run_dir, self.state.store.close)  # every rank's traces
        except RolloutError as exc:  # a step with nothing to train on: what it measured is still logged
            record = getattr(exc, "step_record", None)
            if record is not None:
                self.result.history.append(record)
                logger.log(record)
                logger.progress(record["step"], record)
                exc.result = self.result  # the CLI prints its summary before the error
            raise
        finally:
            try:  # a run that stops early (an error, a kill) cancels and joins the steps still rolling out
                if self.pipeline is not None:
                    self.pipeline.stop()
            finally:
                logger.close()
        return self.result

    def steps(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(step, metrics record) of each training step: `collect`, `learn` and `publish` in turn, or pipelined with
        the later steps' rollouts (`async.max_staleness` >= 1: `_pipeline.OneStepOff` or `FreeRunning`)."""
        if self.pipeline is not None:
            yield from self.pipeline.steps(self.start_step)
            return
        for step in range(self.start_step, self.state.cfg.steps):
            record = self.train_step(step)
            if self.state.async_fallback is not None:
                record["async/synchronous_fallback"] = 1
            yield step, record

    def train_step(self, step: int) -> dict[str, Any]:
        """One synchronous step: `collect`, `learn`, `publish`; its metrics record."""
        record = learn(self.state, collect(self.state, step), pipelined=False)
        publish(self.state, self.weave, step)
        return record

    # ---- its parts ----------------------------------------------------------------------------
    def batch_tasks(self, step: int) -> list[Any]:
        """Tasks of a step (`batch_tasks`)."""
        return batch_tasks(self.state, step)

    def rollouts(self, tasks: Sequence[Any], step: int, group_size: int, *, phase: str
                 ) -> tuple[list[tuple[Any, Episode]], dict[str, int]]:
        """G rollouts per task (`_rollouts.roll_out`): the finished, truncated and model-error runs and the counts;
        failed episodes are counted (and stored)."""
        run = self.state
        batch = roll_out(run.app, run.env, tasks, step, group_size, phase=phase, seed=run.cfg.seed,
                         rollout=run.cfg.rollout, base_config=run.rollout_config, slots=run.episode_slots)
        return batch.runs, batch.counts

    def sync_weights(self, name: str, *, version: int) -> float:
        """Push model `name`'s trained weights to its servers (`_checkpoints.sync_weights`); return the seconds."""
        return _checkpoints.sync_weights(self.state, name, version=version)

    def _evaluate(self, step: int, logger: RunLogger) -> dict[str, Any]:
        if self.pipeline is not None:  # the rollouts in flight end, the trainer's weights reach the rollouts
            self.pipeline.settle()
        rollouts: list[Any] | None = [] if self.weave is not None else None
        label = "evaluation before training" if step == 0 else f"evaluation {_after(step)}"
        record = evaluate(self.state, step=step, rollouts=rollouts, progress=logger.episodes(label))
        _checkpoints.save_notes(self.state)  # its warning, once per run: also for a run resumed from the checkpoint
        if self.weave is not None:
            self.weave.submit_evaluation(record, rollouts)
        self.result.evals.append(record)
        logger.log({"step": step, **{f"eval/{k}": v for k, v in record.items() if k != "step"}})
        return record

    def save_checkpoint(self, step: int) -> Path:
        self.result.checkpoint = _checkpoints.save_checkpoint(self.state, step, self.pipeline)
        return self.result.checkpoint

    def close(self) -> None:
        if self.weave is not None:
            self.weave.close()  # exports what is queued; never raises an export error
        if self.pipeline is not None:  # no rollout thread may write to the store once it is closed
            self.pipeline.stop()
        close(self.state.built, self.state.store)
