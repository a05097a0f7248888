"""The package's layout: sub-packages by layer, imports pointing down the layers, no import cycles, no
module over 600 lines, and every exported name resolving to its object whatever the import order.

Imports are read with `ast` from the source (top-level, inside functions and under TYPE_CHECKING alike),
so a lazy import cannot hide a cycle or an upward dependency.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "drmas_graph"

SHARED = {"types", "errors", "config", "env", "policy", "_chat", "_structured", "_importing", "grammar",
          "chat_templates"}
"""Top-level modules every layer may import (`_importing` is the one `module:attr` importer that the CLI, task
files and the judge's models all use; `grammar` is the one description of a call's constraint that the recorder
builds, the engine and the servers decode under and the trainer rebuilds masks from; `chat_templates` reads
and checks the chat template a model is given, a file or a built-in, for the config and every policy)."""
FACADES = {"", "testing", "ui.__main__"}
"""The package itself, the public name of the tiny test models and `python -m drmas_graph.ui` (the command
line's entry point): they may import anything."""
LAYERS = {  # layer -> the layers it may import (besides itself and the shared modules)
    "shared": set(),
    "instrumentation": set(),
    "engine": set(),
    "served": {"instrumentation"},
    "traces": {"instrumentation"},
    "train": {"instrumentation", "engine", "served", "traces"},  # the package itself: its public seam (lazy names)
    "train.engines": {"engine"},
    "train.optim": {"engine", "train.engines"},
    "train.loop": {"instrumentation", "engine", "served", "traces", "train.optim", "train.engines"},
    "ui": {"instrumentation", "traces"},
    "rewards": {"instrumentation", "engine"},
    "task_files": {"rewards"},  # a module, not a package: tasks from files, rewards from the judge
    "cli": {"instrumentation", "engine", "served", "traces", "train", "ui", "rewards", "task_files"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _layer(module: str) -> str:
    head = module.split(".")[0]
    if module in SHARED:
        return "shared"
    if module in FACADES:
        return "facade"
    group = ".".join(module.split(".")[:2])
    if group in LAYERS:  # train's groups (train.engines, train.optim, train.loop) are layers of their own
        return group
    if head in LAYERS:
        return head
    raise AssertionError(f"drmas_graph.{module} belongs to no layer: move it into a sub-package or add it to "
                         "SHARED / FACADES in tests/test_layout.py (and say why)")


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """drmas_graph modules imported by `module` (relative to the package, '' = the package)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                base = f"drmas_graph.{base}" if base else "drmas_graph"
            subs = [f"{base}.{a.name}" for a in node.names]
            # `from pkg import sub` depends on the submodule only; `from pkg import name` on pkg
            names = subs + ([base] if any(n.removeprefix("drmas_graph.") not in modules for n in subs) else [])
        else:
            continue
        for name in names:
            if name == "drmas_graph" or not name.startswith("drmas_graph."):
                continue
            rel = name.removeprefix("drmas_graph.")
            while rel and rel not in modules:  # `from pkg import name`: the module is pkg
                rel = rel.rpartition(".")[0]
            if rel and rel != module:
                found.add(rel)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_every_module_belongs_to_a_layer_and_imports_only_downward():
    bad = []
    for module, deps in _graph().items():
        layer = _layer(module)
        if layer == "facade":
            continue
        for dep in deps:
            dep_layer = _layer(dep)
            allowed = LAYERS[layer] | {f"{a}.{g}" for a in LAYERS[layer] for g in ("engines", "optim", "loop")}
            if dep_layer == "facade" or (dep_layer not in ("shared", layer) and dep_layer not in allowed):
                bad.append(f"drmas_graph.{module} ({layer}) imports drmas_graph.{dep} ({dep_layer})")
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = {m: d for m, d in _graph().items() if _layer(m) != "facade"}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_config_does_not_import_training_code():
    assert _graph()["config"] <= {"errors", "chat_templates"}
    assert _graph()["chat_templates"] <= {"errors"}


def test_no_module_over_600_lines():
    long = {m: len(p.read_text().splitlines()) for m, p in _modules().items()}
    assert {m: n for m, n in long.items() if n > 600} == {}


def test_every_sub_package_says_what_it_owns_and_may_import():
    for package in LAYERS.keys() - {"shared"}:
        folder = ROOT / package.replace(".", "/")
        path = folder / "__init__.py" if folder.is_dir() else ROOT / f"{package}.py"
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "May import" in doc, f"{path.relative_to(ROOT.parent)}: say what it may import"


def test_registries_match_the_names_the_config_accepts():
    from drmas_graph import config
    from drmas_graph.train.optim.advantages import ADVANTAGE_ESTIMATORS
    from drmas_graph.train.optim.losses import LOSS_AGGREGATIONS

    assert set(config.ESTIMATORS) == set(ADVANTAGE_ESTIMATORS)
    assert set(config.LOSS_AGGREGATIONS) == set(LOSS_AGGREGATIONS)


_EVERY_NAME_AFTER_EVERY_MODULE = """
import importlib, pkgutil, sys, types, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", DeprecationWarning)
    import drmas_graph
    names = [m.name for m in pkgutil.walk_packages(drmas_graph.__path__, "drmas_graph.") if not m.name.endswith("__main__")]
    for name in names:
        importlib.import_module(name)
ours = [str(w.message) for w in caught if "drmas_graph" in str(w.message)]
wrong = [n for n in drmas_graph.__all__ if isinstance(getattr(drmas_graph, n), types.ModuleType)]
exec("from drmas_graph import " + ", ".join(drmas_graph.__all__))
wrong += [n for n in drmas_graph.__all__ if isinstance(eval(n), types.ModuleType)]
renamed = [k for k, m in sys.modules.items() if k.startswith("drmas_graph") and m.__name__ != k]
print(len(names), sorted(set(wrong)), renamed, ours)
"""


def test_every_exported_name_is_its_object_after_every_module_is_imported():
    """`from drmas_graph import replay` is the function even after every sub-module (`drmas_graph.traces.replay`
    among them) was imported, in a fresh interpreter, with no deprecation warning naming drmas_graph (third-party
    ones are not ours to judge); each module is known by one name (no alias of another module in `sys.modules`)."""
    out = subprocess.run([sys.executable, "-c", _EVERY_NAME_AFTER_EVERY_MODULE], capture_output=True, text=True,
                         check=True, cwd=ROOT.parent).stdout.split()
    assert int(out[0]) > 40 and out[1:] == ["[]", "[]", "[]"]


@pytest.mark.parametrize("old", ["drmas_graph.trainer", "drmas_graph.store", "drmas_graph.replay",
                                 "drmas_graph._distributed", "drmas_graph.train.update", "drmas_graph.train.trainer"])
def test_a_module_has_one_import_path(old):
    """The flat layout's paths (never released) are gone, not aliases: one module, one path."""
    code = f"import importlib\ntry:\n    importlib.import_module({old!r})\nexcept ModuleNotFoundError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT.parent)
    assert out.stdout.strip() == f"No module named {old!r}"


def test_the_train_package_offers_the_loops_face_without_a_warning():
    import drmas_graph.train.loop as loop

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from drmas_graph.train import Trainer, preflight  # the package's public seam
    assert Trainer is loop.Trainer and preflight is loop.preflight
    import drmas_graph.train as train

    assert train.__all__ == loop.__all__


# ---- public seams: no private module or name of another sub-package; no `trainer: Any` ---------------------

PRIVATE_IMPORTS_ALLOWED: dict[str, str] = {}
"""`importer: imported` -> why this private import across sub-packages is needed (none: each sub-package offers
the others a public seam)."""

PRIVATE_IMPORTS_PENDING: set[str] = set()
"""Private imports waiting for a branch to merge (none)."""

TRAINER_ANY_PENDING: set[str] = set()
"""Functions taking `trainer: Any` waiting for a branch to merge (none)."""


TRAIN_GROUPS = ("train.engines", "train.optim", "train.loop")
"""train/'s groups: each an owner of its own private names, like a top-level sub-package."""


def _owner(module: str) -> str:
    """The sub-package a module belongs to ('' for the package itself, a top-level module's own name; one of
    train's groups for a module inside it)."""
    group = ".".join(module.split(".")[:2])
    return group if group in TRAIN_GROUPS else module.split(".")[0]


def _private_imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """`module: imported` for each private module or private name of another sub-package that `module`
    imports (the shared top-level modules, `_chat` and the like, are everyone's)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                base = f"drmas_graph.{base}" if base else "drmas_graph"
            targets = [(base, a.name) for a in node.names]
        else:
            continue
        for base, name in targets:
            if not base.startswith("drmas_graph."):
                if base != "drmas_graph" or name is None:
                    continue
                base, name = f"drmas_graph.{name}", None  # `from drmas_graph import sub`
            rel = base.removeprefix("drmas_graph.")
            if name is not None and f"{rel}.{name}" in modules:  # `from pkg import sub`: the module sub
                rel, name = f"{rel}.{name}", None
            if _owner(rel) in (_owner(module), *SHARED):
                continue
            if any(part.startswith("_") for part in rel.split(".")) or (name or "").startswith("_"):
                found.add(f"{module or 'drmas_graph'}: {rel}" + (f".{name}" if name else ""))
    return found


def test_no_private_import_across_sub_packages():
    """Sub-packages talk through public seams (STYLE 14): a private module (`instrumentation._intercept`) or
    a private name (`_build_policy`) is used only inside its own sub-package."""
    modules = _modules()
    found = set().union(*(_private_imports(m, p, modules) for m, p in modules.items()))
    unexpected = found - PRIVATE_IMPORTS_ALLOWED.keys() - PRIVATE_IMPORTS_PENDING
    assert not unexpected, ("private imports across sub-packages (offer a public name in the imported "
                            "sub-package instead):\n" + "\n".join(sorted(unexpected)))
    stale = (PRIVATE_IMPORTS_ALLOWED.keys() | PRIVATE_IMPORTS_PENDING) - found
    assert not stale, "allowed private imports that no longer happen: drop them:\n" + "\n".join(sorted(stale))


def test_the_private_import_check_finds_one(tmp_path):
    (tmp_path / "served").mkdir()
    path = tmp_path / "served" / "_base.py"
    path.write_text("from drmas_graph.instrumentation._intercept import ACTIVE_HANDLER\n"
                    "from drmas_graph.instrumentation import _threads, active_handler\n"
                    "from drmas_graph.train._build import build_policy\nfrom drmas_graph.train import _build_policy\n"
                    "from drmas_graph.served._errors import ServerError\nfrom drmas_graph._chat import parse_hermes\n"
                    "from drmas_graph.instrumentation.instrumented import _cut_at_stop, instrument\n")
    modules = {"served._base": path, "instrumentation._threads": path, "instrumentation": path,
               "instrumentation._intercept": path, "instrumentation.instrumented": path, "train._build": path,
               "train": path, "served._errors": path}
    assert _private_imports("served._base", path, modules) == {
        "served._base: instrumentation._intercept.ACTIVE_HANDLER", "served._base: instrumentation._threads",
        "served._base: train._build.build_policy", "served._base: train._build_policy",
        "served._base: instrumentation.instrumented._cut_at_stop"}


TRAIN_FACE_BYPASSES: dict[str, str] = {}
"""`importer: imported` -> why a train group reaches past another group's face (at most 3; none today)."""


def _face(group: str) -> set[str]:
    """The names in `__all__` of a train group's `__init__`."""
    tree = ast.parse((ROOT / group.replace(".", "/") / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"drmas_graph/{group.replace('.', '/')}/__init__.py: no __all__")


def _face_bypasses(module: str, path: Path, faces: dict[str, set[str]]) -> set[str]:
    """`module: imported` for each import, by a module of one train group, of another group that is not a name
    of that group's face (`from drmas_graph.train.optim import ModelUpdater`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            targets = [(node.module, a.name) for a in node.names]
        else:
            continue
        for base, name in targets:
            rel = base.removeprefix("drmas_graph.")
            group = ".".join(rel.split(".")[:2])
            if not base.startswith("drmas_graph.") or group not in faces or group == _owner(module):
                continue
            if rel != group or name not in faces[group]:
                found.add(f"{module}: {rel}" + (f".{name}" if name else ""))
    return found


def test_train_groups_use_each_other_only_through_their_faces():
    """engines/, optim/ and loop/ are boundaries: a group imports another only as `from drmas_graph.train.<group>
    import <name in its __all__>`, so each face lists everything the others use."""
    faces = {g: _face(g) for g in TRAIN_GROUPS}
    found = set().union(*(_face_bypasses(m, p, faces) for m, p in _modules().items() if _owner(m) in TRAIN_GROUPS))
    assert len(TRAIN_FACE_BYPASSES) <= 3
    assert found == set(TRAIN_FACE_BYPASSES), ("imports past a train group's face (add the name to that group's "
                                              "__all__ instead):\n" + "\n".join(sorted(found - set(TRAIN_FACE_BYPASSES))))
    for group, names in faces.items():  # each face is small and every name in it resolves
        module = importlib.import_module(f"drmas_graph.{group}")
        assert len(names) <= 16 and all(hasattr(module, n) for n in names), group


def test_the_face_check_finds_a_bypass(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("from drmas_graph.train.optim.update import ModelUpdater\nfrom drmas_graph.train.optim import "
                    "compute_advantages, _tally\nimport drmas_graph.train.engines._world\n"
                    "from drmas_graph.train.loop import _state\nfrom drmas_graph.types import Sample\n")
    faces = {"train.optim": {"compute_advantages"}, "train.engines": set(), "train.loop": set()}
    assert _face_bypasses("train.loop._learn", path, faces) == {
        "train.loop._learn: train.optim.update.ModelUpdater", "train.loop._learn: train.optim._tally",
        "train.loop._learn: train.engines._world"}


def _trainer_any(tree: ast.AST) -> list[str]:
    """Functions with a parameter `trainer` annotated `Any` (a bag of another object's attributes, STYLE 13)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            for a in args:
                note = a.annotation
                text = ast.unparse(note) if note is not None else ""
                if a.arg == "trainer" and text.strip("'\"") in ("Any", "typing.Any"):
                    out.append(node.name)
    return out


def test_no_function_takes_trainer_any():
    """Each function takes the typed run state, or only the fields it needs, never `trainer: Any`."""
    found = {f"{m}.{name}" for m, p in _modules().items() for name in _trainer_any(ast.parse(p.read_text()))}
    assert found - TRAINER_ANY_PENDING == set(), f"functions taking `trainer: Any`: {sorted(found - TRAINER_ANY_PENDING)}"
    assert TRAINER_ANY_PENDING - found == set(), f"no longer taking `trainer: Any`: {sorted(TRAINER_ANY_PENDING - found)}"


def test_the_trainer_any_check_finds_one():
    tree = ast.parse("def a(trainer: Any): ...\ndef b(trainer: 'Any', n: int): ...\nasync def c(*, trainer: typing.Any): ...\n"
                     "def d(trainer: RunState): ...\ndef e(state: Any): ...\nclass X:\n    def __init__(self, trainer: Any): ...\n")
    assert _trainer_any(tree) == ["a", "b", "c", "__init__"]
