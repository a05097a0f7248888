"""Building a run from its config: `build_run` (a `RunState`), and the run folder's guard (`RunDirInUseError`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from drmas_graph.config import AgentConfig, TrainConfig
from drmas_graph.errors import ConfigError
from drmas_graph.instrumentation.instrumented import InstrumentedGraph
from drmas_graph.policy import Policy
from drmas_graph.traces.store import TraceStore
from drmas_graph.train.engines import distributed
from drmas_graph.train.loop import _build, _checkpoints, _pipeline, _warm
from drmas_graph.train.loop._rollouts import EpisodeSlots, episode_config
from drmas_graph.train.loop._state import ModelSlot, RunNotes, RunState, abandon, on_model_thread

__all__ = ["build_run", "RunDirInUseError", "free_run_dir"]


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


def build_run(graph: Any, env: Any, cfg: TrainConfig, *, policies: Mapping[str, Policy] | None = None,
              train_models: Mapping[str, Any] | None = None, train: bool = True,
              rollout_config: Mapping[str, Any] | None = None, warm_only: bool = False) -> RunState:
    """The run's pieces from its config (see `RunState`). `train=False` builds no updaters (evaluation, check).
    With `warm_start` in the config, the warm start runs (or its checkpoint is loaded) before the updaters are built
    (`_warm.prepare`); `warm_only`: it alone, no updater (`warm_start()`). A failure closes what was built (launched
    servers) and, when the store is new, removes it again."""
    rollout_config = dict(rollout_config or {})
    episode_config(rollout_config, cfg.rollout)  # refuse a shared thread_id now, not mid-run
    _require_packages(cfg, policies, train)  # before any model is loaded
    _check_processes(cfg, policies, train)
    run_dir = Path(cfg.run_dir)
    # a folder holding only this run's warm start (begun or done) is this run's: its RL starts there (`resume` also
    # starts it from a warm start done, before the RL's first checkpoint)
    warm = cfg.warm_start is not None and all(distributed.gather(_warm.holds_only_warm_start(run_dir)))
    warm_done = cfg.warm_start is not None and all(distributed.gather(_warm.warm_start_done(run_dir)))
    # before any process creates its store: a second run would mix its episodes and metrics into the first's
    if train and not cfg.resume and not warm and any(distributed.gather((run_dir / "traces.db").exists())):
        raise RunDirInUseError(run_dir)
    if (train and cfg.resume and not (warm or warm_done)
            and not any(distributed.gather(_checkpoints.has_checkpoint(run_dir)))):
        raise _checkpoints.NothingToResumeError(run_dir)  # step 0 would append to the old run's traces
    run_dir.mkdir(parents=True, exist_ok=True)
    store_file = distributed.store_path(run_dir)
    new_store = not store_file.exists()
    trained: dict[str, Any] = {}
    built: list[Policy] = []
    store: TraceStore | None = None
    try:
        agent_policies, model_policies = _build.build_policies(cfg, policies, train_models, trained=trained,
                                                               built=built)
        by_policy = {id(p): n for n, p in model_policies.items()}
        agent_cfgs = {a: cfg.agents.get(a) or AgentConfig(model=by_policy[id(p)]) for a, p in agent_policies.items()}
        train_tasks = _build.load_tasks(env, "train")
        # a resumed run appends to its own store (its config may differ in `steps`, `resume`); so does an
        # evaluation-only run (train=False), which adds eval episodes to whatever run the folder holds
        pinned = not cfg.resume and not warm and (train or not (run_dir / "traces.db").exists())
        store = TraceStore(store_file, config=cfg.model_dump(mode="json") if pinned else None)
        app = InstrumentedGraph(graph, agent_policies, agents=cfg.node_agents, strict=cfg.strict, store=store)
        # configured agents sample as configured; others keep their policy's own defaults
        app.sampling.update({a: _build.agent_sampling(c) for a, c in cfg.agents.items() if a in agent_policies})
        _build.check_sampling(agent_policies, app.sampling)
        models = {name: ModelSlot(name, policy, tuple(a for a, p in agent_policies.items() if p is policy),
                                  trained=trained.get(name)) for name, policy in model_policies.items()}
        penalty = cfg.invalid_penalty if cfg.invalid_penalty is not None else float(getattr(env, "invalid_penalty", 0.0))
        run = RunState(
            cfg=cfg, env=env, run_dir=run_dir, rollout_config=rollout_config, models=models,
            agent_policies=agent_policies, agent_cfgs=agent_cfgs, store=store, app=app, train_tasks=train_tasks,
            invalid_penalty=penalty, episode_slots=EpisodeSlots(cfg.max_concurrency), built=built,
            async_fallback=None, new_store=new_store, notes=RunNotes())
        if not train:
            return run
        references, warm_start = _warm.prepare(run, warm_only=warm_only)  # the weights the RL starts from
        if warm_only:
            return dataclasses.replace(run, warm_start=warm_start)
        copies: dict[str, Any] = {}
        fallback = None
        if cfg.async_.max_staleness > 0:  # before the updaters: they train the copies
            copies, fallback = _pipeline.trainer_copies(cfg, model_policies, agent_policies, agent_cfgs, trained)
        models = {name: dataclasses.replace(m, trained=trained.get(name), copy=copies.get(name))
                  for name, m in models.items()}
        updaters = _build.build_updaters(cfg, agent_policies, model_policies, agent_cfgs, trained,
                                         lambda name, fn: on_model_thread(models[name], fn), references)
        models = {name: dataclasses.replace(m, updater=updaters.get(name)) for name, m in models.items()}
        return dataclasses.replace(run, models=models, async_fallback=fallback, warm_start=warm_start)
    except BaseException:
        abandon(built, store, store_file if new_store else None)
        raise


def _importable(name: str) -> bool:
    """`name` can be imported (a module set to None in sys.modules, as tests and import blockers do, cannot)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


def _require_packages(cfg: TrainConfig, policies: Mapping[str, Policy] | None, train: bool) -> None:
    """Refuse a config whose optional packages are missing, naming the config key, the package and the extra,
    before any model is loaded or any file written (DeepSpeed for a `deepspeed` backend, peft for `lora`)."""
    missing = []
    if train and _build.uses_deepspeed(cfg, policies) and not _importable("deepspeed"):
        missing.append("update.backend 'deepspeed' needs the deepspeed package: pip install 'drmas-graph[deepspeed]' "
                       "(or set update.backend: torch, the same numbers without ZeRO)")
    lora = sorted(n for n, mc in cfg.models.items() if mc.lora is not None)
    if lora and not _importable("peft"):
        missing.append(f"models.{lora[0]}.lora needs the peft package: pip install 'drmas-graph[lora]' (or remove "
                       "`lora` to fine-tune the whole model)")
    if missing:
        raise ConfigError("; ".join(missing))


def _check_processes(cfg: TrainConfig, policies: Mapping[str, Policy] | None, train: bool) -> None:
    """Under torchrun / deepspeed: what several processes cannot do is refused, then the process group starts."""
    if train:  # whole groups per rank (evaluation shards tasks, any number)
        distributed.check_divisible(cfg.tasks_per_step)
    distributed.check_no_launch({n: mc.serve.launch for n, mc in cfg.models.items() if mc.serve is not None})
    distributed.check_zero3_served(
        [n for n, mc in cfg.models.items() if mc.trainable and mc.serve is None and (mc.update or cfg.update).zero() == 3]
        + (["<policies passed to train_graph>"] if policies and cfg.update.zero() == 3 else []))
    distributed.init_process_group(use_deepspeed=_build.uses_deepspeed(cfg, policies))
