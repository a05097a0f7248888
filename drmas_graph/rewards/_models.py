"""The judge's chat model from a config spec (`judge_model`), and its name."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel

from drmas_graph._importing import import_spec
from drmas_graph.errors import ConfigError

__all__ = ["judge_model", "model_name"]

_KINDS = ("'provider:model' (an API model, langchain's init_chat_model), {base_url: URL, model: NAME} (an "
          "OpenAI-compatible server: vLLM, SGLang), {import: 'module:attr'} (a chat model or a factory of one), "
          "{path: ...} or {tiny: {...}} (an embedded policy, ModelConfig fields)")


def judge_model(spec: str | Mapping[str, Any], *, run_dir: Path | None = None,
                timeout_s: float | None = None) -> BaseChatModel:
    """The judge's chat model from a YAML spec.

    - `"provider:model"` (e.g. "openai:gpt-4.1-mini"): langchain's `init_chat_model`; a missing integration
      package is a ConfigError naming it.
    - `{"base_url": URL, "model": NAME, ...}`: an OpenAI-compatible server (vLLM, SGLang) through ChatOpenAI,
      api_key "EMPTY" unless given; other keys are ChatOpenAI fields (e.g. `timeout`). Without `timeout`, the
      request times out after ``timeout_s`` (the judge's own limit), so an abandoned call frees its
      concurrency slot then instead of when the server answers.
    - `{"import": "module:attr"}`: a chat model object, or a zero-argument factory returning one.
    - `{"path": "smollm2", ...}` or `{"tiny": {...}}`: an embedded policy built from these `ModelConfig`
      fields, answering greedily (temperature 0) through `PolicyChatModel`.

    Relative paths (`path`, the modules of `import`) are relative to the working directory, as every path of a
    config. `run_dir` (the run's folder) is accepted so a config builder can pass it; no kind writes there.
    """
    del run_dir
    if isinstance(spec, str):
        return _api_model(spec)
    if not isinstance(spec, Mapping):
        raise ConfigError(f"judge model spec {spec!r} is a {type(spec).__name__}; give one of {_KINDS}")
    spec = dict(spec)
    if "base_url" in spec:
        if timeout_s is not None:
            spec.setdefault("timeout", timeout_s)
        return _served_model(spec)
    if "import" in spec:
        return _imported_model(spec)
    if "path" in spec or "tiny" in spec:
        return _embedded_model(spec)
    raise ConfigError(f"judge model spec {spec!r} names no model (keys {sorted(spec)}); give one of {_KINDS}")


def _api_model(spec: str) -> BaseChatModel:
    from langchain.chat_models import init_chat_model

    try:
        return init_chat_model(spec)
    except ImportError as exc:
        raise ConfigError(f"judge model {spec!r} needs a LangChain integration package that is not installed: "
                          f"{exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"judge model {spec!r}: {exc}. Give 'provider:model', e.g. 'openai:gpt-4.1-mini'") from exc


def _served_model(spec: dict[str, Any]) -> BaseChatModel:
    try:
        from langchain_openai import ChatOpenAI
    except ImportError as exc:
        raise ConfigError("a judge model given by base_url (an OpenAI-compatible server) needs langchain-openai: "
                          "pip install langchain-openai") from exc
    if not spec.get("model"):
        raise ConfigError(f"judge model {spec!r}: `model` must name the served model (the server's "
                          "--served-model-name, by default the path it loaded)")
    spec.setdefault("api_key", "EMPTY")
    try:
        return ChatOpenAI(**spec)
    except ValueError as exc:  # pydantic's ValidationError
        raise ConfigError(f"judge model {spec!r}: {exc}") from exc


def _imported_model(spec: dict[str, Any]) -> BaseChatModel:
    target, extra = spec.pop("import"), sorted(spec)
    if extra:
        raise ConfigError(f"judge model {{import: {target!r}}} takes no other keys, got {extra}")
    obj: Any = import_spec(target, setting="judge model import")
    if not isinstance(obj, BaseChatModel) and callable(obj):
        obj = obj()
    if not isinstance(obj, BaseChatModel):
        raise ConfigError(f"judge model import {target!r} gave a {type(obj).__name__}, not a LangChain chat model "
                          "(BaseChatModel) or a zero-argument function returning one")
    return obj


def _embedded_model(spec: dict[str, Any]) -> BaseChatModel:
    from drmas_graph.config import ModelConfig
    from drmas_graph.instrumentation.chat_model import PolicyChatModel
    from drmas_graph.train import build_policy

    try:
        mc = ModelConfig(**spec)
    except ValueError as exc:
        raise ConfigError(f"judge model {spec!r} is not a valid embedded model (ModelConfig fields): {exc}") from exc
    source = mc.path or "tiny" + json.dumps(mc.tiny, sort_keys=True)
    policy = build_policy(f"judge:{source}", mc, seed=0)  # the name keys the judge's cache
    return PolicyChatModel(policy=policy, temperature=0.0)


def model_name(model: Any) -> str:
    """A chat model's name for records and cache keys: its `model_name`/`model` field, a policy's name, else
    its class name."""
    for attr in ("model_name", "model", "model_id"):
        value = getattr(model, attr, None)
        if isinstance(value, str) and value:
            return value
    policy = getattr(model, "policy", None)
    if policy is not None and getattr(policy, "name", None):
        return str(policy.name)
    return type(model).__name__
