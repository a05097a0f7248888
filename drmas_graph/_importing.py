"""The one `module:attr` importer: every setting that names a Python object by a string goes through
`import_spec` (`--graph`, `--reward`, `--judge`, a config's `graph:` and `env:`, `env.reward.python`, a
judge model's `{import: ...}`), so they accept the same specs and fail the same way.

A spec is ``package.module:attr`` (or ``:attr.sub`` for an attribute of an attribute). The current folder is
importable, as under ``python -m``: a module of the project you run drmas-graph from is found without
installing it (the folder is put at the front of `sys.path` once, the first time a spec is imported).
Installed packages are found as usual. A spec that does not name an object raises `ConfigError` naming the
setting, the spec and the fix.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from typing import Any

from drmas_graph.errors import ConfigError

__all__ = ["import_spec"]


def import_spec(spec: str, *, setting: str) -> Any:
    """The object ``package.module:attr[.sub]`` names, importing the module (the current folder is importable,
    like ``python -m``). `setting` names where the spec came from (``--graph``, ``env.reward.python``) for the
    error: a `ConfigError` when the spec is malformed, the module does not import or lacks the attribute."""
    module_name, _, attr_path = str(spec).partition(":")
    if not module_name or not attr_path or ":" in attr_path:
        raise ConfigError(f"{setting} {spec!r} must look like 'package.module:attribute' (a module path, a colon, "
                          "the name of an object in it)")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(_import_failed(setting, spec, module_name, exc, cwd)) from exc
    done: list[str] = []
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            where = module_name + "".join(f".{d}" for d in done)
            close = difflib.get_close_matches(attr, [n for n in dir(obj) if not n.startswith("__")], n=3)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(f"{setting} {spec!r}: {where!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, attr)
        done.append(attr)
    return obj


def _import_failed(setting: str, spec: str, module_name: str, exc: ImportError, cwd: str) -> str:
    missing = getattr(exc, "name", None)
    if isinstance(exc, ModuleNotFoundError) and missing and (module_name + ".").startswith(missing + "."):
        return (f"{setting} {spec!r}: no module named {missing!r} (looked in the current folder {cwd} and the "
                f"installed packages): run from the folder that holds {missing.split('.')[0]!r}, or install it")
    return f"{setting} {spec!r}: importing module {module_name!r} failed ({type(exc).__name__}: {exc})"
