"""A run's pieces, built from its config: the policies (embedded or served), LoRA adapters, the updaters.

- `build_policies`: agent -> Policy and model name -> Policy, from `models`/`agents` and `policies=`; a
  configured model is an embedded `TransformersPolicy` (it generates and is trained) or, with `serve`, a
  served policy whose weights the trainer trains in a local copy (`train_models`).
- `build_updaters`: one updater per trainable model (`ModelUpdater`, or `LoraUpdater` over adapters).
- `agent_sampling`, `check_sampling`: how each agent samples, refused at start where a backend would refuse.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from drmas_graph.config import AgentConfig, ModelConfig, TrainConfig, model_adapters
from drmas_graph.errors import ConfigError
from drmas_graph.policy import Policy
from drmas_graph.engine import build_policy, resolve_model_path
from drmas_graph.types import SamplingParams

__all__ = ["is_served", "build_policies", "build_updaters", "agent_sampling", "check_sampling", "load_tasks",
           "uses_deepspeed"]


def is_served(policy: Policy) -> bool:
    """A policy whose weights live in inference servers and are pushed there with `sync_weights`."""
    return callable(getattr(policy, "sync_weights", None))


def build_policies(cfg: TrainConfig, given: Mapping[str, Policy] | None, train_models: Mapping[str, Any] | None, *,
                   trained: dict[str, Any], built: list[Policy]) -> tuple[dict[str, Policy], dict[str, Policy]]:
    """agent -> Policy and model name -> Policy, from config `models`/`agents` and `policies=`.

    Fills `trained` (model name -> the module its updater trains) and `built` (the policies built here, which
    the trainer closes).
    """
    given = dict(given or {})
    _check_policy_names(given)
    models = {}
    for name, mc in cfg.models.items():
        if not any(p.name == name for p in given.values()):
            models[name], trained[name] = _build_model(name, mc, cfg.seed, model_adapters(name, cfg.agents))
            if mc.lora is not None:
                trained[name] = _attach_adapters(models[name], trained[name], name, cfg)
            built.append(models[name])
    models.update({p.name: p for p in given.values()})
    for name, model in (train_models or {}).items():
        if name not in models or not is_served(models[name]):
            raise ConfigError(f"train_models[{name!r}]: names no served policy (served: "
                              f"{sorted(n for n, p in models.items() if is_served(p))}); embedded policies "
                              "train their own `.model`")
        trained[name] = model
    trained.update({p.name: p.model for p in given.values() if not is_served(p) and hasattr(p, "model")})
    agents = dict(given)
    for agent, ac in cfg.agents.items():
        if agent not in agents:
            if ac.model not in models:
                raise ConfigError(f"agents.{agent}.model = {ac.model!r} names no model; models: {sorted(models)}")
            agents[agent] = models[ac.model]
    if not agents:
        raise ConfigError("no agents to train: give policies={agent: Policy} or `agents` + `models` in the config")
    by_id = {id(p): name for name, p in models.items()}
    return agents, {by_id[id(p)]: p for p in agents.values()}


def _build_model(name: str, mc: ModelConfig, seed: int, adapters: Sequence[str] = ()) -> tuple[Policy, Any]:
    """The rollout policy of a configured model and the module its updater trains.

    Embedded: one `TransformersPolicy` that both generates and is trained. Served (`mc.serve`): the weights
    are loaded locally from `path` (trained, never generating) and a served policy with the same tokenizer
    rolls out through the servers (launched here from `path`, or attached to `serve.urls`).
    """
    policy = build_policy(name, mc, seed)
    if mc.serve is None:
        return policy, policy.model
    from drmas_graph.served import SGLangPolicy, VLLMPolicy, launch_sglang, launch_vllm
    from drmas_graph.served import owned_flag, vllm_launch_kwargs

    sc = mc.serve
    policy_cls, launch = {"sglang": (SGLangPolicy, launch_sglang), "vllm": (VLLMPolicy, launch_vllm)}[sc.engine]
    launch_kw = vllm_launch_kwargs(mc.lora, adapters) if mc.lora is not None and sc.engine == "vllm" else {}
    if sc.ready_timeout_s is not None:
        launch_kw["ready_timeout_s"] = sc.ready_timeout_s
    if sc.args:
        for arg in sc.args:
            if (why := owned_flag(sc.engine, arg)) is not None:
                raise ConfigError(f"models.{name}.serve.args may not set {arg.split('=', 1)[0]}: drmas-graph sets "
                                  f"it ({why})")
        launch_kw["extra_args"] = [*launch_kw.get("extra_args", ()), *sc.args]
    servers = [launch(resolve_model_path(mc.path), dtype=mc.torch_dtype(), python=sc.python, **launch_kw)] if sc.launch else []
    served = policy_cls([s.url for s in servers] or sc.urls, policy.tokenizer, name=name, servers=servers,
                        seed=seed, timeout_s=sc.timeout_s, max_concurrency=sc.max_concurrency, constrain=mc.constrain)
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
    one is told how its servers get the adapters (`served._lora.serve_adapters`)."""
    from drmas_graph.served import serve_adapters
    from drmas_graph.train.optim import attach_adapters

    mc, adapters = cfg.models[name], model_adapters(name, cfg.agents)
    peft_model = attach_adapters(model, mc.lora, adapters, seed=cfg.seed)
    if is_served(policy):
        serve_adapters(policy, adapters, mc.serve.engine, model=name)
    elif getattr(policy, "model", None) is model:
        policy.model = peft_model
    return peft_model


def model_update(cfg: TrainConfig, name: str) -> Any:
    """The `UpdateConfig` of model `name`: its own `update`, else the top-level one."""
    mc = cfg.models.get(name)
    return mc.update if mc is not None and mc.update is not None else cfg.update


def build_updaters(cfg: TrainConfig, agent_policies: Mapping[str, Policy], model_policies: Mapping[str, Policy],
                   agent_cfgs: Mapping[str, AgentConfig], train_models: Mapping[str, Any],
                   on_model_thread: Callable[[str, Callable[[], Any]], Any],
                   references: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One updater per trainable model with at least one trained agent, built on the model's own thread.
    `references`: model name -> its KL reference where not the default (`optim.build_updater(reference=...)`)."""
    from drmas_graph.train.engines import LossSettings, UpdateSettings
    from drmas_graph.train.optim import build_updater

    updaters = {}
    for name, policy in model_policies.items():
        mc = cfg.models.get(name)
        agents = [a for a, p in agent_policies.items() if p is policy and not agent_cfgs[a].frozen]
        if (mc is not None and not mc.trainable) or not agents:
            continue
        settings = UpdateSettings(**model_update(cfg, name).model_dump(), seed=cfg.seed)
        agent_settings = {a: LossSettings(**agent_cfgs[a].loss.model_dump()) for a in agents}
        if name not in train_models:
            raise ConfigError(f"model {name!r} ({type(policy).__name__}, agents {agents}) has no local weights to "
                              f"train: for a served policy pass train_models={{{name!r}: <HF model with the served "
                              "weights>} or configure it with `models.<name>.serve`; else freeze its agents")
        updaters[name] = on_model_thread(name, functools.partial(
            build_updater, train_models[name], name=name, settings=settings, agent_settings=agent_settings,
            agent_cfgs=agent_cfgs, grammars=policy.grammars, reference=(references or {}).get(name)))
    if not updaters:
        raise ConfigError("every agent is frozen or served by a non-trainable model: nothing to train")
    return updaters


def check_sampling(agent_policies: Mapping[str, Policy], sampling: Mapping[str, SamplingParams]) -> None:
    """Refuse now, not at the first request, training sampling a backend would refuse (vLLM: top-p/top-k)."""
    for agent, policy in agent_policies.items():
        check = getattr(policy, "check_sampling", None)
        if check is not None:
            try:
                check(sampling.get(agent, policy.sampling))
            except ConfigError as exc:
                raise ConfigError(f"agents.{agent}.sampling: {exc}") from None


def load_tasks(env: Any, split: str) -> list[Any]:
    """`env.tasks(split)`, refused when empty or when task ids repeat."""
    tasks = list(env.tasks(split))
    if not tasks:
        raise ConfigError(f"env.tasks({split!r}) returned no tasks")
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"env.tasks({split!r}) has duplicate task ids; ids must be unique and stable")
    return tasks


def uses_deepspeed(cfg: TrainConfig, policies: Mapping[str, Policy] | None) -> bool:
    """Whether a model may train on DeepSpeed (then DeepSpeed sets up the process group)."""
    updates = [mc.update or cfg.update for mc in cfg.models.values() if mc.trainable]
    return any(u.backend == "deepspeed" for u in updates + ([cfg.update] if policies else []))


def agent_sampling(agent: AgentConfig) -> SamplingParams:
    """The training rollouts' sampling of a configured agent."""
    s = agent.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                          adapter=agent.adapter, constrain=agent.constrain)


