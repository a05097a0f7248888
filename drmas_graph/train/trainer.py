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

The parts live next to this module: `_build` (policies and updaters from the config), `_rollouts` (G
concurrent episodes per task), `_scoring` (rewards, advantages, the step's metrics), `update` (the optimizer
step), `_checkpoints` (checkpoints, resume, weight sync), `evaluate` (avg@k, pass@k), `_pipeline`
(asynchronous training), `offpolicy` (its off-policy correction).

Departures from the reference code (langfengQ/DrMAS): no duplicate padding of per-model batches before
advantage estimation (it biases the statistics); failed episodes, bad rewards and episodes without LLM
calls are dropped from their group and counted, never silently trained on. Like the reference, episodes
that a limit stopped (truncated) and those the policy's output broke (model errors) are trained on, with
the configured rewards (`rollout.truncated_reward`, `rollout.model_error_reward`).
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drmas_graph.config import AgentConfig, TrainConfig, merge_overrides
from drmas_graph.env import BadRewardError
from drmas_graph.errors import ConfigError, RolloutError
from drmas_graph.instrumentation.instrumented import InstrumentedGraph
from drmas_graph.policy import Policy
from drmas_graph.traces.store import TraceStore
from drmas_graph.traces.weave_export import WeaveExporter, start_exporter
from drmas_graph.train import _build, _checkpoints, _distributed, _pipeline, _scoring
from drmas_graph.train._old_logprobs import with_trainer_logprobs
from drmas_graph.train._rollouts import (
    EpisodeJob,
    EpisodeSlots,
    RolloutBatch,
    StepBatch,
    episode_config,
    group_ids,
    run_episodes,
)
from drmas_graph.train.evaluate import evaluate, reply_lines
from drmas_graph.train.metrics import RunLogger
from drmas_graph.types import Episode, Sample

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

    def summary(self) -> str:
        """A short table: per-agent reward (turn reward incl. invalid-turn penalties) and avg@k / pass@k,
        at the first and the last evaluation; the training reward of the first and last step."""
        lines = []
        if self.evals:
            first, last = self.evals[0], self.evals[-1]
            k, split = last["k"], last["split"]
            lines.append(f"{'evaluation on ' + split:<28}{'step ' + str(first['step']):>12}{'step ' + str(last['step']):>12}")
            agents = sorted({key.split("/")[0] for key in last if key.endswith("/reward")})
            for a in agents:
                key = f"{a}/reward"
                lines.append(f"{'  reward ' + a:<28}{first.get(key, float('nan')):>12.3f}{last.get(key, float('nan')):>12.3f}")
            for metric in ("avg@k", "pass@k"):
                name = metric.replace("k", str(k))
                lines.append(f"{'  ' + name:<28}{first[metric]:>12.3f}{last[metric]:>12.3f}")
            lines += reply_lines(last)
        if self.history:
            first, last = self.history[0], self.history[-1]
            lines.append(f"{'training reward (team)':<28}{'step ' + str(first['step']):>12}{'step ' + str(last['step']):>12}")
            lines.append(f"{'':<28}{first['reward/team_mean']:>12.3f}{last['reward/team_mean']:>12.3f}")
        lines.append(f"run folder: {self.run_dir}")
        return "\n".join(lines)


class RunDirInUseError(ConfigError):
    """A training run (not resumed) was pointed at a run folder that already holds a run."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(f"run folder {run_dir} already holds a run ({run_dir / 'traces.db'}); train into a new "
                         f"folder (run_dir={str(free_run_dir(run_dir))!r}), or continue this run from its last "
                         "checkpoint with resume=True")
        self.run_dir = run_dir


def free_run_dir(run_dir: Path) -> Path:
    """`run_dir` with the first of -2, -3, ... that names no folder yet."""
    n = 2
    while run_dir.with_name(f"{run_dir.name}-{n}").exists():
        n += 1
    return run_dir.with_name(f"{run_dir.name}-{n}")


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


class Trainer:
    """Holds the run's pieces; `run()` is the loop. Build it through `train_graph`."""

    def __init__(self, graph: Any, env: Any, cfg: TrainConfig, *, policies: Mapping[str, Policy] | None = None,
                 train_models: Mapping[str, Any] | None = None, train: bool = True,
                 rollout_config: Mapping[str, Any] | None = None):
        self.cfg, self.env = cfg, env
        self.rollout_config = dict(rollout_config or {})
        episode_config(self.rollout_config, cfg.rollout)  # refuse a shared thread_id now, not mid-run
        self.rollout_errors: list[RolloutError] = []
        """Errors of the failed episodes of the last `rollouts` call, in job order."""
        self.reward_errors: list[BadRewardError] = []
        """Errors of the bad-reward episodes of the last step's scoring."""
        self._reward_raise_logged: set[str] = set()
        """The metrics (`bad_reward_episodes`, `judge_failed_episodes`) whose first exception was logged."""
        self.threshold_warned = False
        """Whether an evaluation warned that success_threshold is above every team reward (`evaluate`; once)."""
        self.zero_signal = _scoring.ZeroSignalWatch()
        """Warns when most advantage pools had zero variance for several steps in a row."""
        self.episode_slots = EpisodeSlots(cfg.max_concurrency)
        """`max_concurrency`: episodes in flight in this process, over every step rolling out (free schedule)."""
        if train:  # under torchrun / deepspeed: whole groups per rank (evaluation shards tasks, any number)
            _distributed.check_divisible(cfg.tasks_per_step)
        _distributed.check_no_launch({n: mc.serve.launch for n, mc in cfg.models.items() if mc.serve is not None})
        _distributed.check_zero3_served(
            [n for n, mc in cfg.models.items() if mc.trainable and mc.serve is None and (mc.update or cfg.update).zero() == 3]
            + (["<policies passed to train_graph>"] if policies and cfg.update.zero() == 3 else []))
        _distributed.init_process_group(use_deepspeed=_build.uses_deepspeed(cfg, policies))
        self.run_dir = Path(cfg.run_dir)
        # before any process creates its store: a second run would mix its episodes and metrics into the first's
        if train and not cfg.resume and any(_distributed.gather((self.run_dir / "traces.db").exists())):
            raise RunDirInUseError(self.run_dir)
        if train and cfg.resume and not any(_distributed.gather(_checkpoints.has_checkpoint(self.run_dir))):
            raise _checkpoints.NothingToResumeError(self.run_dir)  # step 0 would append to the old run's traces
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.train_models: dict[str, Any] = {}
        """Model name -> the module its updater trains (the embedded policy's own, or a served model's local copy)."""
        self._built: list[Policy] = []
        self.weave: WeaveExporter | None = None
        """Exports episodes and evaluations to W&B Weave (`logging.weave`), off the training thread."""
        self.pipeline: _pipeline.OneStepOff | None = None
        """Asynchronous training (`async.max_staleness` >= 1); None = synchronous steps."""
        self.async_fallback: str | None = None
        """Why a run configured as asynchronous trains synchronously (a second copy of a model did not fit)."""
        self._copies: dict[str, Any] = {}
        """Model name -> the trainer's own copy of an embedded model (asynchronous training)."""
        store_file = _distributed.store_path(self.run_dir)
        new_store = not store_file.exists()
        try:
            self.agent_policies, self.model_policies = _build.build_policies(
                cfg, policies, train_models, trained=self.train_models, built=self._built)
            self.agent_cfgs = {a: cfg.agents.get(a) or AgentConfig(model=self._model_of(a)) for a in self.agent_policies}
            self.train_tasks = _build.load_tasks(env, "train")
            # a resumed run appends to its own store (its config may differ in `steps`, `resume`); so does an
            # evaluation-only Trainer (train=False), which adds eval episodes to whatever run the folder holds
            pinned = not cfg.resume and (train or not (self.run_dir / "traces.db").exists())
            self.store = TraceStore(_distributed.store_path(self.run_dir),  # rank r > 0: traces.rank<r>.db
                                    config=cfg.model_dump(mode="json") if pinned else None)
            self.app = InstrumentedGraph(graph, self.agent_policies, agents=cfg.node_agents, strict=cfg.strict,
                                         store=self.store)
            # configured agents sample as configured; others keep their policy's own defaults
            self.app.sampling.update({a: _build.agent_sampling(c) for a, c in cfg.agents.items()
                                      if a in self.agent_policies})
            _build.check_sampling(self.agent_policies, self.app.sampling)
            if train and cfg.async_.max_staleness > 0:  # before the updaters: they train the copies
                self._copies, self.async_fallback = _pipeline.trainer_copies(self)
            self.updaters = _build.build_updaters(cfg, self.agent_policies, self.model_policies, self.agent_cfgs,
                                                  self.train_models, self.on_model_thread) if train else {}
            self.invalid_penalty = cfg.invalid_penalty if cfg.invalid_penalty is not None else float(
                getattr(env, "invalid_penalty", 0.0))
            self.unfinished_rewards = {"truncated_reward": cfg.rollout.truncated_reward,
                                       "model_error_reward": cfg.rollout.model_error_reward}
            """`score_episode` keywords: the rewards of truncated and model-error episodes (None: env.reward)."""
            if train and cfg.async_.max_staleness > 0 and self.async_fallback is None:
                self.pipeline = _pipeline.pipeline(self)
            self.start_step = _checkpoints.resume(self) if cfg.resume else 0
            if self.start_step == 0:  # adapters loaded by name must exist on the servers before the first rollout
                for name in (n for n, p in self.model_policies.items() if getattr(p, "lora_by_name", ())):
                    self.sync_weights(name, version=0)
            # rank 0 exports from the merged store
            self.weave = start_exporter(cfg, self.run_dir / "traces.db") if _distributed.is_main() else None
        except BaseException:
            self._close_built()  # e.g. servers launched for a run that never starts
            if getattr(self, "store", None) is not None:
                self.store.close()
                if new_store:  # no episode yet: the folder stays free for the corrected run
                    for path in (store_file, *(store_file.with_name(store_file.name + s) for s in ("-wal", "-shm"))):
                        path.unlink(missing_ok=True)
            raise
        # never overwrite a training run's config; under several processes rank 0 writes it
        if _distributed.is_main() and (train or not (self.run_dir / "config.yaml").exists()):
            cfg.to_yaml(self.run_dir / "config.yaml")
        self.result = TrainResult(run_dir=self.run_dir)

    def _model_of(self, agent: str) -> str:
        policy = self.agent_policies[agent]
        return next(name for name, p in self.model_policies.items() if p is policy)

    def on_model_thread(self, name: str, fn: Any) -> Any:
        """Run `fn()` (compute on model `name`) on its embedded policy's generation thread, else here.

        On CPU, torch compute from a second OS thread slows the embedded engine's decoding for the rest of
        the process (see `transformers_policy`): the update, the logprob passes and checkpoints of an
        embedded model run on the thread that decodes with it. A model the trainer trains a copy of
        (asynchronous training) is computed here: its policy keeps decoding meanwhile.
        """
        if name in self._copies:
            return fn()
        run = getattr(self.model_policies[name], "run_on_worker", None)
        return run(fn) if run is not None else fn()

    def trained_agents(self) -> list[str]:
        return [a for a, p in self.agent_policies.items() if self._model_of(a) in self.updaters
                and not self.agent_cfgs[a].frozen]

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> TrainResult:
        cfg = self.cfg
        logger_cls = RunLogger if _distributed.is_main() else _distributed.NullLogger  # rank 0 writes metrics
        logger = logger_cls(self.run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                            progress=cfg.logging.progress, total_steps=cfg.steps, start_step=self.start_step,
                            agents=list(self.agent_policies), run_name=cfg.name, config=cfg.model_dump(mode="json"))
        try:
            if cfg.eval.before_training and self.start_step == 0:
                self._evaluate(0, logger)
            for step, record in self.steps():
                self.result.history.append(record)
                logger.log(record)
                logger.progress(step, record)
                done = step + 1
                if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.steps:
                    self.save_checkpoint(done)
                if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.steps:
                    self._evaluate(done, logger)
            if self.start_step < cfg.steps:  # checkpoint first: asynchronous runs save the weights step N rolls out on
                self.save_checkpoint(cfg.steps)
                self._evaluate(cfg.steps, logger)
            _distributed.remove_rank_stores(self.run_dir, self.store.close)  # every rank's traces in traces.db
        finally:
            logger.close()
        return self.result

    def steps(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(step, metrics record) of each training step: rollout, score and update in turn, or pipelined with the
        later steps' rollouts (`async.max_staleness` >= 1: `_pipeline.OneStepOff` or `FreeRunning`)."""
        if self.pipeline is not None:
            yield from self.pipeline.steps(self.start_step)
            return
        for step in range(self.start_step, self.cfg.steps):
            record = self.train_step(step)
            if self.async_fallback is not None:
                record["async/synchronous_fallback"] = 1
            yield step, record

    def batch_tasks(self, step: int) -> list[Any]:
        """Tasks of a step: positions step * B ... step * B + B - 1 of `task_order`."""
        return self.task_order(step * self.cfg.tasks_per_step, self.cfg.tasks_per_step)

    def task_order(self, start: int, n: int) -> list[Any]:
        """The training tasks at positions start ... start + n - 1 of an endless sequence of seeded shuffles of
        the split."""
        n_tasks, out = len(self.train_tasks), []
        for p in range(start, start + n):
            epoch, i = divmod(p, n_tasks)
            order = list(range(n_tasks))
            random.Random(f"{self.cfg.seed}:{epoch}").shuffle(order)
            out.append(self.train_tasks[order[i]])
        return out

    def train_step(self, step: int) -> dict[str, Any]:
        """One synchronous step: `collect`, then `learn`."""
        return self.learn(self.collect(step))

    def collect(self, step: int) -> StepBatch:
        """Step `step`'s rollouts (this process's groups), scored, with advantages and the trained agents' Samples."""
        t0 = time.perf_counter()
        tasks = self.batch_tasks(step)
        batch = self._run_jobs(tasks, step, self.cfg.group_size, phase="train")
        t1 = time.perf_counter()
        scored, reward_errors = self._score_runs(batch.runs, batch.counts)
        samples, adv_stats = self._advantages(scored)
        return StepBatch(step, len(tasks) * self.cfg.group_size, batch.counts, batch.errors, scored, reward_errors,
                         samples, adv_stats, (t0, t1, time.perf_counter()))

    def learn(self, batch: StepBatch, *, publish: bool = True) -> dict[str, Any]:
        """Update every trained model on the batch's samples; return the step's metrics record. `publish` merges
        every process's traces and exports the step (the pipeline does that at the next step boundary)."""
        step, scored, samples = batch.step, batch.scored, batch.samples
        self.rollout_errors, self.reward_errors = batch.rollout_errors, batch.reward_errors
        if not any(_distributed.gather(bool(scored))):  # every rank decides alike (one rank's loss is not fatal)
            raise _scoring.nothing_to_train(step, batch.n_episodes, self.rollout_errors or self.reward_errors,
                                            self.run_dir)
        t0, t1, _ = batch.times
        t2 = time.perf_counter()
        update_metrics: dict[str, float] = {}
        sync_s = 0.0
        for name, updater in self.updaters.items():
            policy = self.model_policies[name]
            model_samples, old = self._old_logprobs(name, [s for s in samples if self.agent_policies[s.agent] is policy],
                                                    update_metrics)
            if self.pipeline is None and not _build.is_served(policy):
                with policy.updating_weights():  # the policy serves the trained module itself
                    metrics = self.on_model_thread(name, functools.partial(updater.update, model_samples,
                                                                           old_logprobs=old))
                    update_metrics.update(metrics.to_dict())
                continue
            # the trainer trains its own copy: pushed to the servers now, or (asynchronous training) installed
            # at the next step boundary (`_pipeline`)
            update_metrics.update(updater.update(model_samples, old_logprobs=old).to_dict())
            if self.pipeline is None:
                update_metrics[f"model/{name}/sync_s"] = self.sync_weights(name, version=step + 1)
                sync_s += update_metrics[f"model/{name}/sync_s"]
        t3 = time.perf_counter()
        self.store.record_training(step, [ep for _, ep, _ in scored])
        # every rank's groups
        scored, counts, adv_stats = _distributed.merge_step(scored, batch.counts, batch.adv_stats)
        batch.trained = [ep for _, ep, _ in scored]
        if publish:
            self.publish(step)
        record = _scoring.step_record(step, list(self.agent_policies), scored, counts, adv_stats, update_metrics,
                                      (t0, t1, t2, t3), sync_s)
        for warning in (_scoring.unfinished_warning(record, batch.n_episodes), self.zero_signal.observe(record)):
            if warning is not None and _distributed.is_main():
                log.warning(warning)
        return record

    def publish(self, step: int, trained: Sequence[Episode] = ()) -> None:
        """Copy every process's traces into traces.db (rank 0; where no rank writes), then export step `step`.
        `trained`: every process's trained episodes of the step, whose training data rank 0 writes after the copy
        (asynchronous training copies a step's episodes from the rank files before they are trained)."""
        _distributed.merge_traces(self.run_dir)
        if trained and _distributed.world_size() > 1 and _distributed.is_main():
            self.store.record_training(step, trained)
        if self.weave is not None:
            self.weave.submit_step(step)

    def _score(self, runs: list[tuple[Any, Episode]], counts: dict[str, int]) -> _scoring.Scored:
        """Rewards of the step's runs (`_scoring.score_runs`: masked truncated episodes and bad rewards are
        left out and counted); bad-reward errors go to `self.reward_errors`."""
        scored, self.reward_errors = self._score_runs(runs, counts)
        return scored

    def _score_runs(self, runs: list[tuple[Any, Episode]], counts: dict[str, int]
                    ) -> tuple[_scoring.Scored, list[BadRewardError]]:
        """`_scoring.score_runs`; the judgement of an episode left out (its judge gave no score) goes to the store
        now (those of the trained episodes go with their rewards, `record_training`)."""
        scored, errors = _scoring.score_runs(self.env, runs, counts, invalid_penalty=self.invalid_penalty,
                                             rollout=self.cfg.rollout, on_error=self._log_reward_raise)
        kept = {ep.id for _, ep, _ in scored}
        for _, episode in runs:
            if episode.id not in kept and episode.judgement is not None:
                self.store.update_training(episode.id, step=None, judgement=episode.judgement)
        return scored, errors

    def _advantages(self, scored: _scoring.Scored) -> tuple[list[Sample], Any]:
        """Advantages of every policy-served turn and the Samples of the trained agents' turns."""
        return _scoring.samples_with_advantages(scored, self.cfg, self.trained_agents())

    def _old_logprobs(self, name: str, samples: list[Sample], metrics: dict[str, float]) -> tuple[list[Sample], str]:
        """Model `name`'s samples and the `update(old_logprobs=...)` mode, by `cfg.old_logprobs` (auto: the
        trainer's for embedded policies, see `_old_logprobs`; as rolled out for served ones). The trainer's are
        the update's own (detached) when it takes one step (n_minibatches 1), else recomputed here first."""
        mode = self.cfg.old_logprobs
        if mode == "auto":  # asynchronous training: the trainer's (the proximal policy of decoupled PPO)
            mode = "rollout" if _build.is_served(self.model_policies[name]) and self.pipeline is None else "trainer"
        if mode == "rollout" or not samples:
            return samples, "given"
        if self.updaters[name].settings.n_minibatches == 1:
            return samples, "current"
        logprobs = self.on_model_thread(name, functools.partial(self.updaters[name].compute_logprobs, samples))
        samples, gaps = with_trainer_logprobs(samples, logprobs)
        metrics.update(gaps)
        return samples, "given"

    def sync_weights(self, name: str, *, version: int) -> float:
        """Push model `name`'s trained weights to its servers (`_checkpoints.push_weights`); return the seconds."""
        return _checkpoints.push_weights(self.run_dir, name, self.train_models[name], self.model_policies[name],
                                         self.updaters.get(name), version=version)

    def rollouts(self, tasks: Sequence[Any], step: int, group_size: int, *, phase: str
                 ) -> tuple[list[tuple[Any, Episode]], dict[str, int]]:
        """G rollouts per task, concurrently (see `_rollouts.run_episodes`: per-episode config, seed and limits).
        Failed episodes are counted (and stored), not returned; their errors go to `self.rollout_errors`.
        Truncated and model-error episodes are returned (and counted)."""
        batch = self._run_jobs(tasks, step, group_size, phase=phase)
        self.rollout_errors = batch.errors
        return batch.runs, batch.counts

    def _run_jobs(self, tasks: Sequence[Any], step: int, group_size: int, *, phase: str) -> RolloutBatch:
        ids = group_ids(tasks, phase, step)  # over the whole batch: every rank names the groups alike
        jobs = [EpisodeJob(task, ids[b], b, j) for b, task in _distributed.owned(tasks) for j in range(group_size)]
        batch = run_episodes(self.app, jobs, phase=phase, step=step, run_seed=self.cfg.seed,
                             max_concurrency=self.episode_slots, rollout=self.cfg.rollout,
                             base_config=self.rollout_config, env=self.env)
        if batch.errors:
            log.warning("%s step %d: %d of %d episodes failed; the first: %s", phase, step, len(batch.errors),
                        len(jobs), batch.errors[0])
        return batch

    _rollouts = rollouts  # the name before the layout change (issue 19); the repro scripts call it

    def _log_reward_raise(self, exc: BadRewardError) -> None:
        """The first env.reward / reward_group / turn_is_valid exception of the run, with its traceback, and the
        first judge failure (later ones are counted)."""
        metric = _scoring.failure_metric(exc)
        if exc.__cause__ is not None and metric not in self._reward_raise_logged:
            self._reward_raise_logged.add(metric)
            kind = "a judge-failed" if metric == "judge_failed_episodes" else "a bad-reward"
            log.warning("%s; the episode counts as %s episode (metric %s), it is not trained on; later ones are "
                        "counted, not logged", exc, kind, metric, exc_info=exc.__cause__)

    def _evaluate(self, step: int, logger: RunLogger) -> dict[str, Any]:
        if self.pipeline is not None:  # the rollouts in flight end, the trainer's weights reach the rollouts
            self.pipeline.settle()
        rollouts: list[Any] | None = [] if self.weave is not None else None
        record = evaluate(self, step=step, rollouts=rollouts)
        if self.weave is not None:
            self.weave.submit_evaluation(record, rollouts)
        self.result.evals.append(record)
        logger.log({"step": step, **{f"eval/{k}": v for k, v in record.items() if k != "step"}})
        return record

    def save_checkpoint(self, step: int) -> Path:
        self.result.checkpoint = _checkpoints.save_checkpoint(self, step)
        return self.result.checkpoint

    def close(self) -> None:
        if self.weave is not None:
            self.weave.close()  # exports what is queued; never raises an export error
        self.store.close()
        self._close_built()

    def _close_built(self) -> None:
        for policy in self._built:  # the policies built from `models`; a served one stops its launched server
            policy.close()
