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

import asyncio
import concurrent.futures
import json
import random
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drmas_graph import _distributed
from drmas_graph.advantages import compute_advantages
from drmas_graph.config import AgentConfig, ModelConfig, TrainConfig, merge_overrides
from drmas_graph.env import BadRewardError, EpisodeScore, is_success, score_episode, trainable_agent_turns
from drmas_graph.errors import ConfigError, NoLLMCallError, RolloutError
from drmas_graph.instrumented import InstrumentedGraph
from drmas_graph.metrics import RunLogger, mean_std
from drmas_graph.policy import Policy
from drmas_graph.store import TraceStore
from drmas_graph.types import Episode, Sample, SamplingParams

__all__ = ["train_graph", "TrainResult", "Trainer", "evaluate"]


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
                **overrides: Any) -> TrainResult:
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

    Served models, from a config (`models.<name>.serve`, see `ServeConfig`) or from Python:

        policy = SGLangPolicy(url, tokenizer, name="qwen")          # servers started from /models/qwen
        local = AutoModelForCausalLM.from_pretrained("/models/qwen")
        train_graph(graph, env, cfg, policies={"solver": policy}, train_models={"qwen": local})
    """
    cfg = merge_overrides(config, overrides)
    trainer = Trainer(graph, env, cfg, policies=policies, train_models=train_models)
    try:
        return trainer.run()
    finally:
        trainer.close()


def _is_served(policy: Policy) -> bool:
    """A policy whose weights live in inference servers and are pushed there with `sync_weights`."""
    return callable(getattr(policy, "sync_weights", None))


def _build_model(name: str, mc: ModelConfig, seed: int) -> tuple[Policy, Any]:
    """The rollout policy of a configured model and the module its updater trains.

    Embedded: one `TransformersPolicy` that both generates and is trained. Served (`mc.serve`): the weights
    are loaded locally from `path` (trained, never generating) and a served policy with the same tokenizer
    rolls out through the servers (launched here from `path`, or attached to `serve.urls`).
    """
    policy = _build_policy(name, mc, seed)
    if mc.serve is None:
        return policy, policy.model
    from drmas_graph.served import SGLangPolicy, VLLMPolicy, launch_sglang, launch_vllm

    sc = mc.serve
    policy_cls, launch = {"sglang": (SGLangPolicy, launch_sglang), "vllm": (VLLMPolicy, launch_vllm)}[sc.engine]
    servers = [launch(_resolve_path(mc.path), dtype=mc.dtype, python=sc.python)] if sc.launch else []
    served = policy_cls([s.url for s in servers] or sc.urls, policy.tokenizer, name=name, servers=servers,
                        seed=seed, timeout_s=sc.timeout_s, max_concurrency=sc.max_concurrency)
    return served, policy.model


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
    return TransformersPolicy.from_pretrained(path, gguf_file=gguf_file, dtype=getattr(torch, mc.dtype),
                                              device=_distributed.local_device(mc.device, f"models.{name}.device"),
                                              name=name, seed=seed,
                                              max_batch_size=mc.max_batch_size)


class Trainer:
    """Holds the run's pieces; `run()` is the loop. Build it through `train_graph`."""

    def __init__(self, graph: Any, env: Any, cfg: TrainConfig, *, policies: Mapping[str, Policy] | None = None,
                 train_models: Mapping[str, Any] | None = None, train: bool = True):
        self.cfg, self.env = cfg, env
        if cfg.logging.weave:
            raise ConfigError("logging.weave is not implemented yet (episodes are traced in run_dir/traces.db); "
                              "set logging.weave: false")
        _distributed.check_divisible(cfg.tasks_per_step)  # under torchrun / deepspeed: whole groups per rank
        _distributed.check_no_launch({n: mc.serve.launch for n, mc in cfg.models.items() if mc.serve is not None})
        _distributed.init_process_group(use_deepspeed=_uses_deepspeed(cfg, policies))
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.train_models: dict[str, Any] = {}
        """Model name -> the module its updater trains (the embedded policy's own, or a served model's local copy)."""
        self._built: list[Policy] = []
        try:
            self.agent_policies, self.model_policies = self._policies(policies, train_models)
            self.agent_cfgs = {a: cfg.agents.get(a) or AgentConfig(model=self._model_of(a)) for a in self.agent_policies}
            self.train_tasks = self._tasks("train")
            # a resumed run appends to its own store (its config may differ in `steps`, `resume`)
            self.store = TraceStore(_distributed.store_path(self.run_dir),  # rank r > 0: traces.rank<r>.db
                                    config=None if cfg.resume else cfg.model_dump(mode="json"))
            self.app = InstrumentedGraph(graph, self.agent_policies, agents=cfg.node_agents, strict=cfg.strict,
                                         store=self.store)
            # configured agents sample as configured; others keep their policy's own defaults
            self.app.sampling.update({a: _sampling(c) for a, c in cfg.agents.items() if a in self.agent_policies})
            self.updaters = self._updaters() if train else {}
            self.invalid_penalty = cfg.invalid_penalty if cfg.invalid_penalty is not None else float(
                getattr(env, "invalid_penalty", 0.0))
            self.start_step = self._resume() if cfg.resume else 0
        except BaseException:
            self._close_built()  # e.g. servers launched for a run that never starts
            raise
        if _distributed.is_main():
            cfg.to_yaml(self.run_dir / "config.yaml")
        self.result = TrainResult(run_dir=self.run_dir)

    # ---- construction -----------------------------------------------------------------------
    def _policies(self, given: Mapping[str, Policy] | None, train_models: Mapping[str, Any] | None
                  ) -> tuple[dict[str, Policy], dict[str, Policy]]:
        """agent -> Policy and model name -> Policy, from config `models`/`agents` and `policies=`; fills
        `train_models` (model name -> module to train)."""
        given = dict(given or {})
        models = {}
        for name, mc in self.cfg.models.items():
            if not any(p.name == name for p in given.values()):
                models[name], self.train_models[name] = _build_model(name, mc, self.cfg.seed)
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
        from drmas_graph.update import LossSettings, ModelUpdater, UpdateSettings

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
            updaters[name] = ModelUpdater(self.train_models[name], name=name, settings=settings,
                                          agent_settings=agent_settings)
        if not updaters:
            raise ConfigError("every agent is frozen or served by a non-trainable model: nothing to train")
        return updaters

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
        self._reseed(step)
        runs, counts = self._rollouts(tasks, step, self.cfg.group_size, phase="train")
        t1 = time.perf_counter()
        scored = self._score(runs, counts)
        samples, adv_stats = self._advantages(scored)
        t2 = time.perf_counter()
        update_metrics: dict[str, float] = {}
        sync_s = 0.0
        for name, updater in self.updaters.items():
            policy = self.model_policies[name]
            model_samples = [s for s in samples if self.agent_policies[s.agent] is policy]
            if _is_served(policy):
                update_metrics.update(updater.update(model_samples).to_dict())
                update_metrics[f"model/{name}/sync_s"] = self.sync_weights(name, version=step + 1)
                sync_s += update_metrics[f"model/{name}/sync_s"]
            else:
                with policy.updating_weights():  # the policy serves the trained module itself
                    update_metrics.update(updater.update(model_samples).to_dict())
        t3 = time.perf_counter()
        self.store.record_training(step, [ep for _, ep, _ in scored])
        scored, counts, adv_stats = _distributed.merge_step(scored, counts, adv_stats)  # every rank's groups
        _distributed.merge_traces(self.run_dir)
        return self._step_record(step, scored, samples, counts, adv_stats, update_metrics, (t0, t1, t2, t3), sync_s)

    def sync_weights(self, name: str, *, version: int) -> float:
        """Push model `name`'s trained weights to its servers; return the seconds it took (write + load).

        The Hugging Face model and tokenizer are written to run_dir/sync/<name>/ (complete or absent: written
        to a temporary folder, then renamed), then `policy.sync_weights(dir, version)` loads them into every
        server; its `WeightSyncError` (a failed load, or a server reporting another version) propagates.
        """
        start = time.perf_counter()
        root = self.run_dir.resolve() / "sync"
        final, tmp = root / name, root / f".tmp_{name}"
        if _distributed.is_main():  # several processes share the servers: rank 0 writes and pushes once
            shutil.rmtree(tmp, ignore_errors=True)
            self.train_models[name].save_pretrained(tmp, safe_serialization=True)
            self.model_policies[name].tokenizer.save_pretrained(tmp)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            self.model_policies[name].sync_weights(str(final), version=version)
        _distributed.barrier()  # no rank rolls out again before the servers hold the new weights
        self.model_policies[name].version = version
        return time.perf_counter() - start

    def _reseed(self, step: int) -> None:
        for name, policy in self.model_policies.items():
            rng = getattr(policy, "_seed_rng", None)
            if rng is not None:
                rng.seed(f"{self.cfg.seed}:{name}:{step}")

    def _rollouts(self, tasks: Sequence[Any], step: int, group_size: int, *, phase: str
                  ) -> tuple[list[tuple[Any, Episode]], dict[str, int]]:
        """G rollouts per task, concurrently. Failed episodes are counted (and stored), not returned."""
        counts = {"failed_episodes": 0, "no_llm_call_episodes": 0}

        async def main() -> list[Any]:
            # sync graph nodes run in the loop's default executor: size it so every episode can be in flight
            asyncio.get_running_loop().set_default_executor(
                concurrent.futures.ThreadPoolExecutor(self.cfg.max_concurrency, thread_name_prefix="rollout"))
            gate = asyncio.Semaphore(self.cfg.max_concurrency)

            async def one(task: Any, group: str) -> tuple[Any, Episode] | None:
                async with gate:
                    try:
                        return task, await self.app.arollout(task.input, task_id=task.id, group_id=group,
                                                              metadata={"phase": phase, "step": step})
                    except NoLLMCallError:
                        counts["no_llm_call_episodes"] += 1
                    except RolloutError:
                        counts["failed_episodes"] += 1
                    return None

            return await asyncio.gather(*(one(t, f"{phase}:{step}:{t.id}") for _, t in _distributed.owned(tasks)
                                          for _ in range(group_size)))

        results = asyncio.run(main())
        return [r for r in results if r is not None], counts

    def _score(self, runs: list[tuple[Any, Episode]], counts: dict[str, int]) -> list[tuple[Any, Episode, EpisodeScore]]:
        scored, counts["bad_reward_episodes"] = [], 0
        for task, episode in runs:
            try:
                score = score_episode(self.env, task, episode, invalid_penalty=self.invalid_penalty)
            except BadRewardError as exc:
                counts["bad_reward_episodes"] += 1
                episode.error = f"BadRewardError: {exc}"
                continue
            episode.rewards, episode.turn_rewards = score.rewards, score.turn_rewards
            scored.append((task, episode, score))
        return scored

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
        record = evaluate(self, step=step)
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
            updater.save(tmp / name)
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
            updater.load(latest / name)
            version = state["policy_versions"].get(name, 0)
            if _is_served(self.model_policies[name]):
                self.sync_weights(name, version=version)  # the servers still hold whatever they served last
            self.model_policies[name].version = version
        return int(state["step"])

    def close(self) -> None:
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
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens)


def evaluate(trainer: Trainer, *, step: int, split: str | None = None) -> dict[str, Any]:
    """avg@k and pass@k of the current policies on a split, with evaluation sampling."""
    ec = trainer.cfg.eval
    split = split or ec.split
    tasks = list(trainer.env.tasks(split))[: ec.n_tasks]
    saved = dict(trainer.app.sampling)
    trainer.app.sampling.update({
        a: saved.get(a, policy.sampling).replace(temperature=ec.temperature, top_p=ec.top_p, top_k=0)
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
            continue
        successes[task.id].append(is_success(trainer.env, task, episode, score, trainer.cfg.success_threshold))
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
