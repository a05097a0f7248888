"""Old module paths of the flat layout (before 0.2), kept importable for one release.

`from drmas_graph.trainer import Trainer`, `import drmas_graph.store` and `from drmas_graph import
_distributed` still work: each old path is an alias of the module's new path (the same module object, so
monkeypatching through the old path patches the real module), with a `DeprecationWarning` naming the new
path. The few names that left their module (`drmas_graph.lora`'s serving and adapter helpers) are forwarded
from where they live now, with a warning naming it.

`drmas_graph.replay` and `drmas_graph.rescore` are two names at once: exported functions and old module paths.
Python binds `import drmas_graph.replay as m` (and `drmas_graph.replay` after `import drmas_graph.replay`)
to the package's attribute, which has to stay the function, so that attribute is a `FunctionAndModule`:
calling it calls the function, and any other name is looked up in (and set on) the moved module, with a
`DeprecationWarning` naming its new path. `from drmas_graph.replay import replay_episode` imports the module
itself. Old code of either kind keeps working, and `drmas_graph.replay(...)` is the function it always was
(same signature and docs; `is` tells them apart).

This module imports nothing of drmas_graph at import time (modules are named by strings).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["MOVED", "MOVED_NAMES", "STABLE", "install", "FunctionAndModule"]

_NEW_PACKAGE = {
    "instrumentation": ("instrumented", "_intercept", "_recorder", "chat_model", "_threads", "_task_paths", "_limits",
                        "_seeds"),
    "engine": ("transformers_policy", "_decode", "_sampling", "_cpu_linear", "models"),
    "traces": ("store", "_serde", "replay", "weave_export"),
    "train": ("trainer", "_rollouts", "advantages", "losses", "update", "_engines", "lora", "_logprobs", "_reference",
              "_old_logprobs", "_update_metrics", "_distributed", "metrics", "rescore"),
}
_TRAIN_GROUPS = {
    "engines": ("_engines", "_distributed", "_world", "_settings"),
    "optim": ("update", "_packing", "_logprobs", "_old_logprobs", "losses", "offpolicy", "_update_metrics", "_reference",
              "_updater", "advantages", "lora"),
    "loop": ("trainer", "_pipeline", "_rollouts", "_scoring", "evaluate", "_check", "_checkpoints", "rescore", "_state",
             "_setup", "_learn", "_build", "metrics", "_metric_reference"),
}
_TRAIN = {m: f"drmas_graph.train.{group}.{m}" for group, ms in _TRAIN_GROUPS.items() for m in ms}
STABLE: dict[str, str] = {f"drmas_graph.train.{m}": _TRAIN[m] for m in (
    "trainer", "update", "losses", "advantages", "offpolicy", "lora", "evaluate", "rescore", "metrics")}
"""Public module path -> the module's place (train/'s groups): the same module, imported without a warning."""
_PUBLIC = {real: public for public, real in STABLE.items()}
MOVED: dict[str, str] = {
    f"drmas_graph.{m}": _PUBLIC.get(_TRAIN[m], _TRAIN[m]) if pkg == "train" else f"drmas_graph.{pkg}.{m}"
    for pkg, ms in _NEW_PACKAGE.items() for m in ms}
"""Old module path -> its new path (its public path where it has one)."""
MOVED["drmas_graph._cli_train"] = "drmas_graph.cli._train"

MOVED_NAMES: dict[str, dict[str, str]] = {
    "drmas_graph.train.optim.lora": {
        **dict.fromkeys(("is_peft_model", "adapter_kwargs", "load_adapter_weights"), "drmas_graph.engine._adapters"),
        **dict.fromkeys(("serve_adapters", "served_adapter", "vllm_launch_kwargs"), "drmas_graph.served._lora"),
        **dict.fromkeys(("resolve_adapters", "model_adapters"), "drmas_graph.config"),
        "BASE": "drmas_graph.config",
    },
}
"""New module path -> {name that left it: the module it lives in now}."""
_RENAMED = {("drmas_graph.config", "BASE"): "BASE_ADAPTER"}


def _forwarder(module: types.ModuleType) -> Any:
    """A module `__getattr__` that finds names which left `module`, warning where they are now."""
    moved = MOVED_NAMES[module.__name__]

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
        new = moved[name]
        new_name = _RENAMED.get((new, name), name)
        warnings.warn(f"{module.__name__}.{name} moved to {new}.{new_name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), new_name)

    return __getattr__


class _Aliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old module paths (and nothing else); each loads as the module at its new path."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED or fullname in STABLE else None

    def __init__(self) -> None:
        self._real_specs: dict[str, Any] = {}

    def create_module(self, spec: Any) -> types.ModuleType:
        module = importlib.import_module(MOVED.get(spec.name) or STABLE[spec.name])
        self._real_specs[spec.name] = module.__spec__  # importlib gives it the alias's spec; exec_module undoes that
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        alias = module.__spec__.name
        module.__spec__ = self._real_specs.pop(alias)
        if module.__name__ in MOVED_NAMES and "__getattr__" not in vars(module):
            module.__getattr__ = _forwarder(module)  # type: ignore[attr-defined]
        if alias in STABLE:
            return  # a public path of the module: no warning
        warnings.warn(f"{alias} moved to {MOVED[alias]}; import from there (the old path goes away in the next "
                      "release)", DeprecationWarning, stacklevel=2)


class FunctionAndModule:
    """An exported function whose name is also an old module path: called, it is the function; any other
    attribute is the moved module's (read with a `DeprecationWarning`; set on the module, so monkeypatching
    through the old path patches the real module)."""

    def __init__(self, function: Callable[..., Any], old: str) -> None:
        vars(self).update({"_old": old, "_module_name": MOVED[old]})
        functools.update_wrapper(self, function)  # __wrapped__, __name__, __doc__, ...: help() and signature()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__wrapped__(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        module = importlib.import_module(self._module_name)
        value = getattr(module, name)  # an AttributeError names the module
        warnings.warn(f"{self._old}.{name}: the module {self._old} moved to {self._module_name}; import from there "
                      f"({self._old} is the function {self.__name__})", DeprecationWarning, stacklevel=2)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("__"):  # the wrapper's own attributes (update_wrapper)
            vars(self)[name] = value
        else:
            setattr(importlib.import_module(self._module_name), name, value)

    def __repr__(self) -> str:
        return f"<function {self.__module__}.{self.__qualname__} (also the old module path {self._old})>"


def install() -> None:
    """Put the alias finder on `sys.meta_path` (once)."""
    if not any(isinstance(f, _Aliases) for f in sys.meta_path):
        sys.meta_path.append(_Aliases())
