"""`--graph module:attr` and config `graph:`/`env:` specs: import the object they name."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from drmas_graph.errors import ConfigError

__all__ = ["import_object"]


def import_object(spec: str) -> Any:
    """``package.module:attr.sub`` -> the object; a ConfigError naming the spec otherwise."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ConfigError(f"--graph {spec!r} must look like 'package.module:attribute'")
    if os.getcwd() not in sys.path:  # like `python -m`, find modules of the current project
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"--graph {spec!r}: cannot import module {module_name!r} ({e})") from e
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ConfigError(f"--graph {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    return obj
