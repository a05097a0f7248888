"""Optional dependencies of the benchmarks, checked when a benchmark starts (not after it ran for minutes).

`require({"matplotlib": "demo"}, "the reward plot (--plot)")` exits at once, naming the missing module and
the drmas-graph extra that installs it, and what to pass instead (e.g. `--plot ''` to skip the plot).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping

__all__ = ["missing", "require"]


def missing(modules: Mapping[str, str]) -> dict[str, str]:
    """{module: extra} of the modules that are not installed."""
    return {m: extra for m, extra in modules.items() if importlib.util.find_spec(m) is None}


def require(modules: Mapping[str, str], what: str, skip: str = "") -> None:
    """Exit with status 2 when a module `what` needs is missing; the message names each module's extra and
    `skip`, the flag that does without it."""
    absent = missing(modules)
    if not absent:
        return
    extras = sorted(set(absent.values()))
    hint = f" ({skip} does without it)" if skip else ""
    names = ", ".join(sorted(absent))
    install = " ".join(f"'drmas-graph[{e}]'" for e in extras)
    print(f"{sys.argv[0]}: {what} needs {names}, which is not installed: pip install {install}{hint}",
          file=sys.stderr)
    raise SystemExit(2)
