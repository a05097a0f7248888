"""`train_graph(graph, env)`: agent-wise GRPO (Dr. MAS) over an existing LangGraph app.

One step: sample B tasks (a seeded, resumable order) -> G concurrent rollouts each through the
instrumented graph -> rewards (team or per agent, minus the invalid-turn penalty) -> advantages
(`compute_advantages`, estimator by name) -> one `ModelUpdater.update` per trainable model -> new weights
visible to the rollout backend -> metrics, periodic evaluation (avg@k, pass@k) and checkpoints.

Weights reach the rollout backend in one of two ways. An embedded policy (`TransformersPolicy`) serves the
very module the updater trains: the update runs inside `policy.updating_weights()`, which bumps its version.
A served policy (SGLang, vLLM: anything with `sync_weights(dir, version)`) has no local model: the updater
trains a local copy, which is written to run_dir/sync/<model>/ (Hugging Face format + tokenizer) and loaded
into every server with version = steps done; a server that fails or reports another version stops the run.

Departures from the reference code (langfengQ/DrMAS): no duplicate padding of per-model batches before
advantage estimation (it biases the statistics); failed episodes, bad rewards and episodes without LLM
calls are dropped from their group and counted, never silently trained on.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import random
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drmas_graph import _distributed
from drmas_graph._old_logprobs import with_trainer_logprobs
from drmas_graph._rollouts import EpisodeJob, episode_config, run_episodes
from drmas_graph.advantages import compute_advantages
from drmas_graph.config import AgentConfig, ModelConfig, TrainConfig, merge_overrides
from drmas_graph.env import BadRewardError, EpisodeScore, is_success, score_episode, trainable_agent_turns
from drmas_graph.errors import ConfigError, RolloutError
from drmas_graph.instrumented import InstrumentedGraph
from drmas_graph.lora import model_adapters, save_for_sync
from drmas_graph.metrics import RunLogger, mean_std
from drmas_graph.policy import Policy
from drmas_graph.store import TraceStore
from drmas_graph.types import Episode, Sample, SamplingParams
from drmas_graph.weave_export import WeaveExporter, start_exporter

__all__ = ["train_graph", "TrainResult", "Trainer", "evaluate"]

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
        if self.history:
            first, last = self.history[0], self.history[-1]
            lines.append(f"{'training reward (team)':<28}{'step ' + str(first['step']):>12}{'step ' + str(last['step']):>12}")
            lines.append(f"{'':<28}{first['reward/team_mean']:>12.3f}{last['reward/team_mean']:>12.3f}")
        lines.append(f"run folder: {self.run_dir}")
        return "\n".join(lines)


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


def _is_served(policy: Policy) -> bool:
    """A policy whose weights live in inference servers and are pushed there with `sync_weights`."""
    return callable(getattr(policy, "sync_weights", None))


def _build_model(name: str, mc: ModelConfig, seed: int, adapters: Sequence[str] = ()) -> tuple[Policy, Any]:
    """The rollout policy of a configured model and the module its updater trains.

    Embedded: one `TransformersPolicy` that both generates and is trained. Served (`mc.serve`): the weights
    are loaded locally from `path` (trained, never generating) and a served policy with the same tokenizer
    rolls out through the servers (launched here from `path`, or attached to `serve.urls`).
    """
    policy = _build_policy(name, mc, seed)
    if mc.serve is None:
        return policy, policy.model
    from drmas_graph.lora import vllm_launch_kwargs
    from drmas_graph.served import SGLangPolicy, VLLMPolicy, launch_sglang, launch_vllm

    sc = mc.serve
    policy_cls, launch = {"sglang": (SGLangPolicy, launch_sglang), "vllm": (VLLMPolicy, launch_vllm)}[sc.engine]
    lora_kw = vllm_launch_kwargs(mc.lora, adapters) if mc.lora is not None and sc.engine == "vllm" else {}
    servers = [launch(_resolve_path(mc.path), dtype=mc.torch_dtype(), python=sc.python, **lora_kw)] if sc.launch else []
    served = policy_cls([s.url for s in servers] or sc.urls, policy.tokenizer, name=name, servers=servers,
                        seed=seed, timeout_s=sc.timeout_s, max_concurrency=sc.max_concurrency)
    return served, policy.model


def _check_policy_names(given: Mapping[str, Policy]) -> None:
    """Distinct policy objects must have distinct names: a name keys its model's updater, checkpoint folder,
    weight sync and traces, so two models with one name would silently become one (rev_n)."""
    first: dict[str, tuple[str, Policy]] = {}
    for agent, policy in given.items():
        other_agent, other = first.setdefault(policy.name, (agent, policy))
        if other is not policy:
            raise ConfigError(
                f"policies[{other_agent!r}] and policies[{agent!r}] are different Policy objects with the same name "
                f"{policy.name!r} (e.g. two copies of one base checkpoint); the name keys each model's updater, "
                f"checkpoints and traces. Give each its own name (tiny_policy(..., name={agent + '-model'!r}), "
                f"TransformersPolicy.from_pretrained(path, name=...)), or pass the same object to both agents to "
                "share one model")


def _attach_adapters(policy: Policy, model: Any, name: str, cfg: TrainConfig) -> Any:
    """Wrap model `name` in one LoRA adapter per agent adapter; an embedded policy generates with it, a served
    one is told how its servers get the adapters (`lora.serve_adapters`)."""
    from drmas_graph.lora import attach_adapters, serve_adapters

    mc, adapters = cfg.models[name], model_adapters(name, cfg.agents)
    peft_model = attach_adapters(model, mc.lora, adapters, seed=cfg.seed)
    if _is_served(policy):
        serve_adapters(policy, adapters, mc.serve.engine, model=name)
    elif getattr(policy, "model", None) is model:
        policy.model = peft_model
    return peft_model


def _resolve_path(path: str) -> str:
    if path == "smollm2":
        from drmas_graph.models import smollm2_path

        return str(smollm2_path())
    return path


def _build_policy(name: str, mc: ModelConfig, seed: int) -> Policy:
    from drmas_graph.transformers_policy import TransformersPolicy

    if mc.tiny is not None:
        from drmas_graph.testing import tiny_policy

        return tiny_policy(**{"seed": seed, "name": name, "max_batch_size": mc.max_batch_size, **mc.tiny})
    import torch

    path, gguf_file = _resolve_path(mc.path), mc.gguf_file
    if mc.path == "smollm2":
        gguf_file = None
    return TransformersPolicy.from_pretrained(path, gguf_file=gguf_file, dtype=getattr(torch, mc.torch_dtype()),
                                              device=_distributed.local_device(mc.device, f"models.{name}.device"),
                                              name=name, seed=seed,
                                              max_batch_size=mc.max_batch_size)


class Trainer:
    """Holds the run's pieces; `run()` is the loop. Build it through `train_graph`."""

    def __init__(self, graph: Any, env: Any, cfg: TrainConfig, *, policies: Mapping[str, Policy] | None = None,
                 train_models: Mapping[str, Any] | None = None, train: bool = True,
                 rollout_config: Mapping[str, Any] | None = None):
        self.cfg, self.env = cfg, env
        self.rollout_config = dict(rollout_config or {})
        episode_config(self.rollout_config, cfg.rollout)  # refuse a shared thread_id now, not mid-run
        self.rollout_errors: list[RolloutError] = []
        """Errors of the failed episodes of the last `_rollouts` call, in job order."""
        self.reward_errors: list[BadRewardError] = []
        """Errors of the bad-reward episodes of the last `_score` call."""
        self._reward_raise_logged = False
        _distributed.check_divisible(cfg.tasks_per_step)  # under torchrun / deepspeed: whole groups per rank
        _distributed.check_no_launch({n: mc.serve.launch for n, mc in cfg.models.items() if mc.serve is not None})
        _distributed.check_zero3_served(
            [n for n, mc in cfg.models.items() if mc.trainable and mc.serve is None and (mc.update or cfg.update).zero() == 3]
            + (["<policies passed to train_graph>"] if policies and cfg.update.zero() == 3 else []))
        _distributed.init_process_group(use_deepspeed=_uses_deepspeed(cfg, policies))
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.train_models: dict[str, Any] = {}
        """Model name -> the module its updater trains (the embedded policy's own, or a served model's local copy)."""
        self._built: list[Policy] = []
        self.weave: WeaveExporter | None = None
        """Exports episodes and evaluations to W&B Weave (`logging.weave`), off the training thread."""
        try:
            self.agent_policies, self.model_policies = self._policies(policies, train_models)
            self.agent_cfgs = {a: cfg.agents.get(a) or AgentConfig(model=self._model_of(a)) for a in self.agent_policies}
            self.train_tasks = self._tasks("train")
            # a resumed run appends to its own store (its config may differ in `steps`, `resume`); so does an
            # evaluation-only Trainer (train=False), which adds eval episodes to whatever run the folder holds
            pinned = not cfg.resume and (train or not (self.run_dir / "traces.db").exists())
            self.store = TraceStore(_distributed.store_path(self.run_dir),  # rank r > 0: traces.rank<r>.db
                                    config=cfg.model_dump(mode="json") if pinned else None)
            self.app = InstrumentedGraph(graph, self.agent_policies, agents=cfg.node_agents, strict=cfg.strict,
                                         store=self.store)
            # configured agents sample as configured; others keep their policy's own defaults
            self.app.sampling.update({a: _sampling(c) for a, c in cfg.agents.items() if a in self.agent_policies})
            self._check_sampling()
            self.updaters = self._updaters() if train else {}
            self.invalid_penalty = cfg.invalid_penalty if cfg.invalid_penalty is not None else float(
                getattr(env, "invalid_penalty", 0.0))
            self.start_step = self._resume() if cfg.resume else 0
            if self.start_step == 0:  # adapters loaded by name must exist on the servers before the first rollout
                for name in (n for n, p in self.model_policies.items() if getattr(p, "lora_by_name", ())):
                    self.sync_weights(name, version=0)
            # rank 0 exports from the merged store
            self.weave = start_exporter(cfg, self.run_dir / "traces.db") if _distributed.is_main() else None
        except BaseException:
            self._close_built()  # e.g. servers launched for a run that never starts
            if getattr(self, "store", None) is not None:
                self.store.close()
            raise
        # never overwrite a training run's config; under several processes rank 0 writes it
        if _distributed.is_main() and (train or not (self.run_dir / "config.yaml").exists()):
            cfg.to_yaml(self.run_dir / "config.yaml")
        self.result = TrainResult(run_dir=self.run_dir)

    # ---- construction -----------------------------------------------------------------------
    def _policies(self, given: Mapping[str, Policy] | None, train_models: Mapping[str, Any] | None
                  ) -> tuple[dict[str, Policy], dict[str, Policy]]:
        """agent -> Policy and model name -> Policy, from config `models`/`agents` and `policies=`; fills
        `train_models` (model name -> module to train)."""
        given = dict(given or {})
        _check_policy_names(given)
        models = {}
        for name, mc in self.cfg.models.items():
            if not any(p.name == name for p in given.values()):
                models[name], self.train_models[name] = _build_model(name, mc, self.cfg.seed,
                                                                     model_adapters(name, self.cfg.agents))
                if mc.lora is not None:
                    self.train_models[name] = _attach_adapters(models[name], self.train_models[name], name, self.cfg)
                self._built.append(models[name])
        models.update({p.name: p for p in given.values()})
        for name, model in (train_models or {}).items():
            if name not in models or not _is_served(models[name]):
                raise ConfigError(f"train_models[{name!r}]: names no served policy (served: "
                                  f"{sorted(n for n, p in models.items() if _is_served(p))}); embedded policies "
                                  "train their own `.model`")
            self.train_models[name] = model
        self.train_models.update({p.name: p.model for p in given.values() if not _is_served(p) and hasattr(p, "model")})
        agents = dict(given)
        for agent, ac in self.cfg.agents.items():
            if agent not in agents:
                if ac.model not in models:
                    raise ConfigError(f"agents.{agent}.model = {ac.model!r} names no model; models: {sorted(models)}")
                agents[agent] = models[ac.model]
        if not agents:
            raise ConfigError("no agents to train: give policies={agent: Policy} or `agents` + `models` in the config")
        by_id = {id(p): name for name, p in models.items()}
        return agents, {by_id[id(p)]: p for p in agents.values()}

    def _check_sampling(self) -> None:
        """Refuse now, not at the first request, training sampling a backend would refuse (vLLM: top-p/top-k)."""
        for agent, policy in self.agent_policies.items():
            check = getattr(policy, "check_sampling", None)
            if check is not None:
                try:
                    check(self.app.sampling.get(agent, policy.sampling))
                except ConfigError as exc:
                    raise ConfigError(f"agents.{agent}.sampling: {exc}") from None

    def _model_of(self, agent: str) -> str:
        policy = self.agent_policies[agent]
        return next(name for name, p in self.model_policies.items() if p is policy)

    def _tasks(self, split: str) -> list[Any]:
        tasks = list(self.env.tasks(split))
        if not tasks:
            raise ConfigError(f"env.tasks({split!r}) returned no tasks")
        ids = [t.id for t in tasks]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"env.tasks({split!r}) has duplicate task ids; ids must be unique and stable")
        return tasks

    def _updaters(self) -> dict[str, Any]:
        from drmas_graph.lora import build_updater
        from drmas_graph.update import LossSettings, UpdateSettings

        updaters = {}
        for name, policy in self.model_policies.items():
            mc = self.cfg.models.get(name)
            agents = [a for a, p in self.agent_policies.items() if p is policy and not self.agent_cfgs[a].frozen]
            if (mc is not None and not mc.trainable) or not agents:
                continue
            uc = mc.update if mc is not None and mc.update is not None else self.cfg.update
            settings = UpdateSettings(**uc.model_dump(), seed=self.cfg.seed)
            agent_settings = {a: LossSettings(**self.agent_cfgs[a].loss.model_dump()) for a in agents}
            if name not in self.train_models:
                raise ConfigError(f"model {name!r} ({type(policy).__name__}, agents {agents}) has no local weights to "
                                  f"train: for a served policy pass train_models={{{name!r}: <HF model with the served "
                                  "weights>} or configure it with `models.<name>.serve`; else freeze its agents")
            updaters[name] = self._on_model_thread(name, functools.partial(
                build_updater, self.train_models[name], name=name, settings=settings, agent_settings=agent_settings,
                agent_cfgs=self.agent_cfgs))
        if not updaters:
            raise ConfigError("every agent is frozen or served by a non-trainable model: nothing to train")
        return updaters

    def _on_model_thread(self, name: str, fn: Any) -> Any:
        """Run `fn()` (compute on model `name`) on its embedded policy's generation thread, else here.

        On CPU, torch compute from a second OS thread slows the embedded engine's decoding for the rest of
        the process (see `transformers_policy`): the update, the logprob passes and checkpoints of an
        embedded model run on the thread that decodes with it.
        """
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
            for step in range(self.start_step, cfg.steps):
                record = self.train_step(step)
                self.result.history.append(record)
                logger.log(record)
                logger.progress(step, record)
                done = step + 1
                if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.steps:
                    self._evaluate(done, logger)
                if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.steps:
                    self.save_checkpoint(done)
            if self.start_step < cfg.steps:
                self._evaluate(cfg.steps, logger)
                self.save_checkpoint(cfg.steps)
            _distributed.remove_rank_stores(self.run_dir, self.store.close)  # every rank's traces in traces.db
        finally:
            logger.close()
        return self.result

    def batch_tasks(self, step: int) -> list[Any]:
        """Tasks of a step: position p = step * B + i in an endless sequence of seeded shuffles of the split."""
        n, out = len(self.train_tasks), []
        for p in range(step * self.cfg.tasks_per_step, (step + 1) * self.cfg.tasks_per_step):
            epoch, i = divmod(p, n)
            order = list(range(n))
            random.Random(f"{self.cfg.seed}:{epoch}").shuffle(order)
            out.append(self.train_tasks[order[i]])
        return out

    def train_step(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        tasks = self.batch_tasks(step)
        runs, counts = self._rollouts(tasks, step, self.cfg.group_size, phase="train")
        t1 = time.perf_counter()
        scored = self._score(runs, counts)
        if not any(_distributed.gather(bool(scored))):  # every rank decides alike (one rank's loss is not fatal)
            raise self._nothing_to_train(step, len(tasks) * self.cfg.group_size)
        samples, adv_stats = self._advantages(scored)
        t2 = time.perf_counter()
        update_metrics: dict[str, float] = {}
        sync_s = 0.0
        for name, updater in self.updaters.items():
            policy = self.model_policies[name]
            model_samples = self._old_logprobs(name, [s for s in samples if self.agent_policies[s.agent] is policy],
                                               update_metrics)
            if _is_served(policy):
                update_metrics.update(updater.update(model_samples).to_dict())
                update_metrics[f"model/{name}/sync_s"] = self.sync_weights(name, version=step + 1)
                sync_s += update_metrics[f"model/{name}/sync_s"]
            else:
                with policy.updating_weights():  # the policy serves the trained module itself
                    metrics = self._on_model_thread(name, functools.partial(updater.update, model_samples))
                    update_metrics.update(metrics.to_dict())
        t3 = time.perf_counter()
        self.store.record_training(step, [ep for _, ep, _ in scored])
        scored, counts, adv_stats = _distributed.merge_step(scored, counts, adv_stats)  # every rank's groups
        _distributed.merge_traces(self.run_dir)
        if self.weave is not None:
            self.weave.submit_step(step)
        return self._step_record(step, scored, samples, counts, adv_stats, update_metrics, (t0, t1, t2, t3), sync_s)

    def _old_logprobs(self, name: str, samples: list[Sample], metrics: dict[str, float]) -> list[Sample]:
        """Model `name`'s samples with the PPO ratio's old logprobs chosen by `cfg.old_logprobs` (auto:
        recomputed by the trainer for embedded policies, see `_old_logprobs`; as rolled out for served ones)."""
        mode = self.cfg.old_logprobs
        if mode == "auto":
            mode = "rollout" if _is_served(self.model_policies[name]) else "trainer"
        if mode == "rollout" or not samples:
            return samples
        logprobs = self._on_model_thread(name, functools.partial(self.updaters[name].compute_logprobs, samples))
        samples, gaps = with_trainer_logprobs(samples, logprobs)
        metrics.update(gaps)
        return samples

    def sync_weights(self, name: str, *, version: int) -> float:
        """Push model `name`'s trained weights to its servers; return the seconds it took (write + load).

        The Hugging Face model and tokenizer are written to run_dir/sync/<name>/ (complete or absent: written
        to a temporary folder, then renamed), then `policy.sync_weights(dir, version)` loads them into every
        server; its `WeightSyncError` (a failed load, or a server reporting another version) propagates.
        """
        start = time.perf_counter()
        root = self.run_dir.resolve() / "sync"
        final, tmp = root / name, root / f".tmp_{name}"
        updater = self.updaters.get(name)
        full = getattr(updater, "full_weights", None)  # ZeRO-3: a collective gather on every process
        with full() if full is not None else contextlib.nullcontext():
            if _distributed.is_main():  # several processes share the servers: rank 0 writes and pushes once
                shutil.rmtree(tmp, ignore_errors=True)
                save_for_sync(self.train_models[name], self.model_policies[name], tmp)
                self.model_policies[name].tokenizer.save_pretrained(tmp)
                shutil.rmtree(final, ignore_errors=True)
                tmp.rename(final)
        if _distributed.is_main():
            self.model_policies[name].sync_weights(str(final), version=version)
        _distributed.barrier()  # no rank rolls out again before the servers hold the new weights
        self.model_policies[name].version = version
        return time.perf_counter() - start

    def _rollouts(self, tasks: Sequence[Any], step: int, group_size: int, *, phase: str
                  ) -> tuple[list[tuple[Any, Episode]], dict[str, int]]:
        """G rollouts per task, concurrently (see `_rollouts.run_episodes`: per-episode config, seed and limits).
        Failed episodes are counted (and stored), not returned; their errors go to `self.rollout_errors`."""
        jobs = [EpisodeJob(task, f"{phase}:{step}:{task.id}", b, j)
                for b, task in _distributed.owned(tasks) for j in range(group_size)]
        batch = run_episodes(self.app, jobs, phase=phase, step=step, run_seed=self.cfg.seed,
                             max_concurrency=self.cfg.max_concurrency, rollout=self.cfg.rollout,
                             base_config=self.rollout_config)
        self.rollout_errors = batch.errors
        if batch.errors:
            log.warning("%s step %d: %d of %d episodes failed; the first: %s", phase, step, len(batch.errors),
                        len(jobs), batch.errors[0])
        return batch.runs, batch.counts

    def _score(self, runs: list[tuple[Any, Episode]], counts: dict[str, int]) -> list[tuple[Any, Episode, EpisodeScore]]:
        scored, counts["bad_reward_episodes"] = [], 0
        self.reward_errors = []
        for task, episode in runs:
            try:
                score = score_episode(self.env, task, episode, invalid_penalty=self.invalid_penalty)
            except BadRewardError as exc:
                counts["bad_reward_episodes"] += 1
                episode.error = f"BadRewardError: {exc}"
                self.reward_errors.append(exc)
                self._log_reward_raise(exc)
                continue
            episode.rewards, episode.turn_rewards = score.rewards, score.turn_rewards
            scored.append((task, episode, score))
        return scored

    def _log_reward_raise(self, exc: BadRewardError) -> None:
        """The first env.reward / turn_is_valid exception of the run, with its traceback (later ones are counted)."""
        if exc.__cause__ is not None and not self._reward_raise_logged:
            self._reward_raise_logged = True
            log.warning("%s; the episode counts as a bad-reward episode (metric bad_reward_episodes); later "
                        "exceptions of the environment are counted, not logged", exc, exc_info=exc.__cause__)

    def _nothing_to_train(self, step: int, n: int) -> RolloutError:
        """The error that stops a run whose step lost every episode (raised with the first failure chained)."""
        first = (self.rollout_errors or self.reward_errors or [None])[0]
        err = RolloutError(f"step {step}: all {n} episodes failed or got no usable reward, nothing to train on; "
                           f"the first: {first}. Fix the graph or the environment (failed episodes are in "
                           f"{self.run_dir / 'traces.db'}, with their error)", getattr(first, "episode", None))
        err.__cause__ = first
        return err

    def _advantages(self, scored: list[tuple[Any, Episode, EpisodeScore]]) -> tuple[list[Sample], Any]:
        """Advantages for every policy-served turn; Samples for the turns of trained agents."""
        rows = []  # (episode, turn position, turn, reward, group, agent-turn index)
        for _, episode, score in scored:
            agent_turns = trainable_agent_turns(episode.turns)
            for i, turn in enumerate(episode.turns):
                if turn.trainable:
                    rows.append((episode, i, turn, score.turn_rewards[i], episode.group_id, agent_turns[i]))
        for _, episode, _ in scored:
            episode.advantages = [0.0] * len(episode.turns)
        if not rows:
            return [], None
        adv_N, stats = compute_advantages(
            [r[3] for r in rows], group_ids=[r[4] for r in rows], agent_ids=[r[2].agent for r in rows],
            episode_ids=[r[0].id for r in rows], turn_ids=[r[5] for r in rows], estimator=self.cfg.estimator,
            norm_by_std=self.cfg.norm_by_std, eps=self.cfg.adv_eps, return_stats=True)
        trained = set(self.trained_agents())
        samples = []
        for (episode, i, turn, *_), adv in zip(rows, adv_N.tolist()):
            episode.advantages[i] = adv
            if turn.agent in trained:
                samples.append(Sample.from_turn(turn, adv, episode.id))
        return samples, stats

    def _step_record(self, step: int, scored: list, samples: list[Sample], counts: dict[str, int], adv_stats: Any,
                     update_metrics: dict[str, float], t: tuple[float, float, float, float],
                     sync_s: float) -> dict[str, Any]:
        t0, t1, t2, t3 = t
        record: dict[str, Any] = {"step": step, **counts, "episodes": len(scored),
                                  "time/rollout_s": t1 - t0, "time/score_s": t2 - t1, "time/update_s": t3 - t2 - sync_s,
                                  "time/sync_s": sync_s, "time/step_s": time.perf_counter() - t0}
        episodes = [ep for _, ep, _ in scored]
        n_tokens = sum(len(turn.response_ids) for ep in episodes for turn in ep.turns)
        record["rollout/tokens_per_s"] = n_tokens / max(t1 - t0, 1e-9)
        record["reward/team_mean"] = mean_std([s.team for *_, s in scored])[0]
        record["adv/zero_variance_pools"] = getattr(adv_stats, "n_zero_variance_pools", 0)
        record["adv/pools"] = getattr(adv_stats, "n_pools", 0)
        for agent in self.agent_policies:
            rewards = [ep.rewards[agent] for ep in episodes if agent in ep.rewards]
            turns = [(ep, i) for ep in episodes for i, turn in enumerate(ep.turns) if turn.agent == agent]
            advs = [ep.advantages[i] for ep, i in turns]
            invalid = [sc.invalid[i] for _, ep, sc in scored for i, turn in enumerate(ep.turns) if turn.agent == agent]
            record[f"agent/{agent}/reward_mean"], record[f"agent/{agent}/reward_std"] = mean_std(rewards)
            record[f"agent/{agent}/adv_mean"], record[f"agent/{agent}/adv_std"] = mean_std(advs)
            record[f"agent/{agent}/calls"] = len(turns)
            record[f"agent/{agent}/invalid_rate"] = sum(invalid) / len(invalid) if invalid else 0.0
            record[f"agent/{agent}/response_len"] = mean_std(
                [len(ep.turns[i].response_ids) for ep, i in turns])[0] if turns else 0.0
            if not turns:
                record[f"agent/{agent}/never_acted"] = 1
        record.update(update_metrics)
        return record

    # ---- evaluation ---------------------------------------------------------------------------
    def _evaluate(self, step: int, logger: RunLogger) -> dict[str, Any]:
        rollouts: list[Any] | None = [] if self.weave is not None else None
        record = evaluate(self, step=step, rollouts=rollouts)
        if self.weave is not None:
            self.weave.submit_evaluation(record, rollouts)
        self.result.evals.append(record)
        logger.log({"step": step, **{f"eval/{k}": v for k, v in record.items() if k != "step"}})
        return record

    # ---- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> Path:
        root = self.run_dir / "checkpoints"
        final = root / f"step_{step:06d}"
        tmp = root / f".tmp_step_{step:06d}"
        main = _distributed.is_main()  # every rank saves its part (DeepSpeed); rank 0 writes the rest
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _distributed.barrier()
        for name, updater in self.updaters.items():
            self._on_model_thread(name, functools.partial(updater.save, tmp / name))
            if main:
                self.model_policies[name].tokenizer.save_pretrained(tmp / name / "model")
        versions = {n: p.version for n, p in self.model_policies.items()}
        if main:
            (tmp / "trainer_state.json").write_text(json.dumps(
                {"step": step, "policy_versions": versions, "world_size": _distributed.world_size()}))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)  # a checkpoint is complete or absent
            for old in sorted(root.glob("step_*"))[: -self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        _distributed.barrier()
        self.result.checkpoint = final
        return final

    def _resume(self) -> int:
        ckpts = sorted((self.run_dir / "checkpoints").glob("step_*"))
        if not ckpts:
            return 0
        latest = ckpts[-1]
        state = json.loads((latest / "trainer_state.json").read_text())
        _distributed.check_resume_world(state.get("world_size"), _distributed.world_size(), {
            n: u.settings.zero_stage for n, u in self.updaters.items() if u.settings.backend == "deepspeed"})
        for name, updater in self.updaters.items():
            self._on_model_thread(name, functools.partial(updater.load, latest / name))
            version = state["policy_versions"].get(name, 0)
            if _is_served(self.model_policies[name]):
                self.sync_weights(name, version=version)  # the servers still hold whatever they served last
            self.model_policies[name].version = version
        return int(state["step"])

    def close(self) -> None:
        if self.weave is not None:
            self.weave.close()  # exports what is queued; never raises an export error
        self.store.close()
        self._close_built()

    def _close_built(self) -> None:
        for policy in self._built:  # the policies built from `models`; a served one stops its launched server
            policy.close()


def _uses_deepspeed(cfg: TrainConfig, policies: Mapping[str, Policy] | None) -> bool:
    """Whether a model may train on DeepSpeed (then DeepSpeed sets up the process group)."""
    updates = [mc.update or cfg.update for mc in cfg.models.values() if mc.trainable]
    return any(u.backend == "deepspeed" for u in updates + ([cfg.update] if policies else []))


def _sampling(agent: AgentConfig) -> SamplingParams:
    s = agent.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                          adapter=agent.adapter)


def evaluate(trainer: Trainer, *, step: int, split: str | None = None,
             rollouts: list[Any] | None = None) -> dict[str, Any]:
    """avg@k and pass@k of the current policies on a split, with evaluation sampling. `rollouts`, when given,
    receives (task, episode, score or None, success) for every finished rollout."""
    ec = trainer.cfg.eval
    split = split or ec.split
    tasks = list(trainer.env.tasks(split))[: ec.n_tasks]
    saved = dict(trainer.app.sampling)
    trainer.app.sampling.update({
        a: saved.get(a, policy.sampling).replace(temperature=ec.temperature, top_p=ec.top_p, top_k=0,
                                                 train_logprobs=False)  # never trained on: truncation is fine
        for a, policy in trainer.agent_policies.items()})
    try:
        runs, counts = trainer._rollouts(tasks, step, ec.k, phase="eval")
    finally:
        trainer.app.sampling.clear()
        trainer.app.sampling.update(saved)
    successes: dict[str, list[bool]] = {t.id: [] for t in tasks}
    per_agent: dict[str, dict[str, list[float]]] = {}
    for task, episode in runs:
        try:
            score = score_episode(trainer.env, task, episode, invalid_penalty=trainer.invalid_penalty)
        except BadRewardError:
            successes[task.id].append(False)
            if rollouts is not None:
                rollouts.append((task, episode, None, False))
            continue
        successes[task.id].append(is_success(trainer.env, task, episode, score, trainer.cfg.success_threshold))
        if rollouts is not None:
            rollouts.append((task, episode, score, successes[task.id][-1]))
        for turn, r, bad in zip(episode.turns, score.turn_rewards, score.invalid):
            stats = per_agent.setdefault(turn.agent, {"reward": [], "invalid": [], "len": []})
            stats["reward"].append(r)
            stats["invalid"].append(float(bad))
            stats["len"].append(float(len(turn.response_ids)))
    successes, per_agent, counts, n_runs = _distributed.merge_eval(successes, per_agent, counts, len(runs))
    per_task = [sum(s) / ec.k for s in successes.values()]  # failed episodes count as failures
    record = {"step": step, "split": split, "k": ec.k, "tasks": len(tasks),
              "avg@k": sum(per_task) / len(per_task) if per_task else 0.0,
              "pass@k": sum(any(s) for s in successes.values()) / len(tasks) if tasks else 0.0,
              "failed_episodes": counts["failed_episodes"] + counts["no_llm_call_episodes"]}
    for agent, stats in sorted(per_agent.items()):
        n = len(stats["reward"])
        record[f"{agent}/reward"] = sum(stats["reward"]) / n
        record[f"{agent}/invalid_rate"] = sum(stats["invalid"]) / n
        record[f"{agent}/calls_per_episode"] = n / max(n_runs, 1)
        record[f"{agent}/response_len"] = sum(stats["len"]) / n
    return record
