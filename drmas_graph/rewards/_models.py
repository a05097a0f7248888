"""The judge's chat model from a config spec (`judge_model`), and its name."""

from __future__ import annotations

import json
import re
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

    - `"provider:model"` (e.g. "openai:gpt-4.1-mini"): langchain's `init_chat_model`; a missing package
      (langchain, the provider's integration) is a one-line ConfigError naming it and its install (the
      `judge` extra holds langchain and langchain-openai). Built with max_retries=0, as a served model.
    - `{"base_url": URL, "model": NAME, ...}`: an OpenAI-compatible server (vLLM, SGLang) through ChatOpenAI
      (langchain-openai, in the `judge` extra),
      api_key "EMPTY" unless given, max_retries 0 (the client's own retries are off: the Judge's `max_retries`
      are the retries, each counted); other keys are ChatOpenAI fields (e.g. `timeout`). Without `timeout`, the
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


JUDGE_EXTRA = "pip install 'drmas-graph[judge]'"
"""The install of the documented judge forms' packages: langchain (`provider:model`) and langchain-openai
(`openai:...` and `{base_url, model}`)."""


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (the CLI prints an error as one line)."""
    return " ".join(str(exc).split())


def _missing(exc: ImportError) -> str:
    """The package an ImportError says is missing: the deepest module not found in its chain (langchain's
    "requires the langchain-openai package" may hide that `openai` is the one missing), else the package
    langchain names."""
    chain: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    found = [c.name for c in chain if isinstance(c, ModuleNotFoundError) and c.name]
    if found:
        return found[-1].split(".")[0].replace("_", "-")
    named = re.search(r"requires the ([\w.-]+) package", str(exc))
    return named.group(1) if named else _one_line(exc)


def _install(package: str) -> str:
    """How to install `package`: the judge extra when it holds it, else the package itself."""
    return JUDGE_EXTRA if package in ("langchain", "langchain-openai", "openai") else f"pip install {package}"


def _api_model(spec: str) -> BaseChatModel:
    try:
        from langchain.chat_models import init_chat_model
    except ImportError as exc:
        raise ConfigError(f"judge model {spec!r} ('provider:model') is built by langchain's init_chat_model, and "
                          f"{_missing(exc)} is not installed: {_install(_missing(exc))}") from None
    try:
        return init_chat_model(spec, max_retries=0)
    except ImportError as exc:
        package = _missing(exc)
        raise ConfigError(f"judge model {spec!r} needs the package {package}, which is not installed: "
                          f"{_install(package)}") from None
    except ValueError as exc:
        raise ConfigError(f"judge model {spec!r}: {_one_line(exc)}. Give 'provider:model', e.g. "
                          "'openai:gpt-4.1-mini'") from None
    except Exception as exc:  # the provider's client refused (e.g. no API key in the environment)
        raise ConfigError(f"judge model {spec!r} could not be built: {type(exc).__name__}: {_one_line(exc)}. "
                          "Fix: set the provider's API key (e.g. OPENAI_API_KEY) or the named setting") from None


def _served_model(spec: dict[str, Any]) -> BaseChatModel:
    try:
        from langchain_openai import ChatOpenAI
    except ImportError as exc:
        raise ConfigError(f"judge model {spec!r} (an OpenAI-compatible server) needs langchain-openai, and "
                          f"{_missing(exc)} is not installed: {JUDGE_EXTRA}") from None
    if not spec.get("model"):
        raise ConfigError(f"judge model {spec!r}: `model` must name the served model (the server's "
                          "--served-model-name, by default the path it loaded)")
    if spec.get("max_retries", 0) != 0:
        raise ConfigError(f"judge model {spec!r}: max_retries must be 0 or absent (the client's own retries are "
                          "requests the judge never counts); set the judge's max_retries instead")
    spec.setdefault("api_key", "EMPTY")
    spec["max_retries"] = 0
    try:
        return ChatOpenAI(**spec)
    except Exception as exc:  # pydantic's ValidationError, the client's own checks
        raise ConfigError(f"judge model {spec!r}: {type(exc).__name__}: {_one_line(exc)}") from None


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
    from drmas_graph.engine import build_policy

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
