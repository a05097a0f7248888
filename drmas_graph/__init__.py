"""drmas-graph: train an existing LangGraph multi-agent app with agent-wise GRPO (Dr. MAS).

    app = instrument(build_my_graph(), policies={"solver": policy, "verifier": policy})
    episode = app.rollout({"question": "2+3?"})

Names are imported lazily (PEP 562), so `drmas-graph traces ...` starts without loading torch.

The package is layered; each layer imports only the layers below it (`tests/test_layout.py` checks this):

    types, errors, config, env, policy (+ _chat, _structured, _importing)   what every layer shares
    instrumentation/   serve and record the LLM calls of an unmodified LangGraph app
    engine/            the embedded policy backend (transformers, continuous batching)
    served/            policies served by SGLang / vLLM over HTTP
    traces/            the trace store, replay, Weave export
    train/             the trainer: rollouts, rewards, advantages, the update, checkpoints, evaluation
    cli/               the `drmas-graph` command

Each module has one import path, its place in this tree (`drmas_graph.traces.replay`,
`drmas_graph.train.loop.trainer`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # instrumenting an app
    "instrument": "drmas_graph.instrumentation.instrumented",
    "InstrumentedGraph": "drmas_graph.instrumentation.instrumented",
    "app_models": "drmas_graph.instrumentation.instrumented",
    "llm_base_url": "drmas_graph.instrumentation.endpoint",
    "llm_env": "drmas_graph.instrumentation.endpoint",
    "Policy": "drmas_graph.policy",
    "TransformersPolicy": "drmas_graph.engine.transformers_policy",
    "builtin_chat_template": "drmas_graph.chat_templates",
    # core types
    "Episode": "drmas_graph.types",
    "Turn": "drmas_graph.types",
    "Segment": "drmas_graph.types",
    "Generation": "drmas_graph.types",
    "SamplingParams": "drmas_graph.types",
    # traces and replay
    "TraceStore": "drmas_graph.traces.store",
    "rescore": "drmas_graph.train.loop.rescore",
    "replay": "drmas_graph.traces.replay",
    "areplay": "drmas_graph.traces.replay",
    "ReplayResult": "drmas_graph.traces.replay",
    "Divergence": "drmas_graph.traces.replay",
    # training
    "train_graph": "drmas_graph.train.loop.trainer",
    "TrainResult": "drmas_graph.train.loop.trainer",
    "warm_start": "drmas_graph.train.loop.warm_start",
    "WarmStartResult": "drmas_graph.train.loop.warm_start",
    "TrainConfig": "drmas_graph.config",
    "Env": "drmas_graph.env",
    "Task": "drmas_graph.env",
    "compute_advantages": "drmas_graph.train.optim.advantages",
    "ModelUpdater": "drmas_graph.train.optim.update",
    "UpdateSettings": "drmas_graph.train.optim.update",
    "LossSettings": "drmas_graph.train.optim.update",
    # serving
    "SGLangPolicy": "drmas_graph.served",
    "VLLMPolicy": "drmas_graph.served",
    "PolicyChatModel": "drmas_graph.instrumentation.chat_model",
    # errors
    "DrmasError": "drmas_graph.errors",
    "ConfigError": "drmas_graph.errors",
    "UnknownAgentError": "drmas_graph.errors",
    "StrictModeError": "drmas_graph.errors",
    "StructuredOutputError": "drmas_graph.errors",
    "InvalidReplyError": "drmas_graph.errors",
    "UnservedCallWarning": "drmas_graph.errors",
    "PolicyError": "drmas_graph.errors",
    "RolloutError": "drmas_graph.errors",
    "NoLLMCallError": "drmas_graph.errors",
    "EpisodeInterruptedError": "drmas_graph.errors",
    "TraceStoreError": "drmas_graph.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'drmas_graph' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs
    from drmas_graph.train.optim.advantages import compute_advantages
    from drmas_graph.instrumentation.chat_model import PolicyChatModel
    from drmas_graph.chat_templates import builtin_chat_template
    from drmas_graph.config import TrainConfig
    from drmas_graph.env import Env, Task
    from drmas_graph.served import SGLangPolicy, VLLMPolicy
    from drmas_graph.train.loop.trainer import TrainResult, train_graph
    from drmas_graph.train.loop.warm_start import WarmStartResult, warm_start
    from drmas_graph.train.optim.update import LossSettings, ModelUpdater, UpdateSettings
    from drmas_graph.errors import (
        ConfigError,
        DrmasError,
        EpisodeInterruptedError,
        InvalidReplyError,
        NoLLMCallError,
        PolicyError,
        RolloutError,
        StrictModeError,
        StructuredOutputError,
        TraceStoreError,
        UnknownAgentError,
        UnservedCallWarning,
    )
    from drmas_graph.instrumentation.endpoint import llm_base_url, llm_env
    from drmas_graph.instrumentation.instrumented import InstrumentedGraph, app_models, instrument
    from drmas_graph.policy import Policy
    from drmas_graph.traces.replay import Divergence, ReplayResult, areplay, replay
    from drmas_graph.train.loop.rescore import rescore
    from drmas_graph.traces.store import TraceStore
    from drmas_graph.engine.transformers_policy import TransformersPolicy
    from drmas_graph.types import Episode, Generation, SamplingParams, Segment, Turn
