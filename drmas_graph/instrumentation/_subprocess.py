"""A program a node starts gets the run's local LLM endpoint in its environment, so its LLM calls are the node's.

An unmodified app's node may start another program (a script, a CLI agent, a worker process) whose OpenAI or
Anthropic SDK reads `OPENAI_BASE_URL` / `ANTHROPIC_BASE_URL` (the user's API) and sends its calls there, out
of the run's sight: unserved, unrecorded, not refused even in strict mode, and sent again by a replay. So a
child started in the context of a node gets the endpoint variables of `endpoint.llm_env()` (the node's own
agent, as routed for its in-process calls): its calls are served by the policy, recorded as the node's turns,
and answered from the recording in a replay.

When (all of): the starting code runs in the context of a running episode or replay (`ACTIVE_HANDLER`,
`_intercept.is_running`; context variables follow LangGraph into its threads and tasks), not in `app_models()`
nor in a policy's own requests (`POLICY_REQUESTS`); and the call would be the run's: the node's agent has a
policy, or the run is strict (the endpoint then refuses the call with HTTP 403 and fails the episode, as
in-process), or it is a replay (which never sends a request: a call the recording lacks is a divergence).
Elsewhere (outside runs, a thread that does not carry the run's context, an agent without a policy in a
lenient run, where the app's own model answers) the child's environment is the app's, untouched.

What: the child's environment (the app's `env=`, else `os.environ`) with the endpoint's LLM variables
(`endpoint.OPENAI_URL_VARS`, `endpoint.ANTHROPIC_URL_VARS`, `OPENAI_API_KEY`, `ANTHROPIC_API_KEY`) set over the
app's values, whatever host those named (api.openai.com, a proxy, a local server: in-process, a node's SDK call
is served wherever it points too); every other variable is kept. An API whose base-URL variables already hold
a URL of this endpoint (`env=llm_env(agent="critic")`) keeps the app's choice. The opt-out: `OPT_OUT=off` in the
child's environment (in `env=` for one child, or in `os.environ`, which children inherit, for all) leaves it
untouched.

Where (CPython 3.11's paths; each wrapped once by `install`, and unchanged outside runs):
- `subprocess.Popen._execute_child(..., env, ...)`: every Popen (`subprocess.run`/`call`/`check_output`,
  `os.popen`, asyncio's `create_subprocess_exec`/`_shell`, which build one in the awaiting task) passes its
  environment here, before `_posixsubprocess.fork_exec` or `os.posix_spawn`.
- `os.posix_spawn` / `os.posix_spawnp`, called directly.
- `os.fork` (`os.register_at_fork`) with `os.execv` / `os.execve`: a fork in such a context makes the
  variables in the parent (a URL made in the child would be unknown to the parent's endpoint); `os.execv` /
  `os.execve` in the forked child (every `os.exec*` and, on POSIX, `os.spawn*` ends in one of them) hand them to
  the new program.
- `multiprocessing.spawn.get_preparation_data`: a `spawn` or `forkserver` child unpickles its preparation data
  before it imports the app's main module; an entry there sets the variables in the child's `os.environ` (with
  stdlib callables only: the child need not import drmas_graph).

Not covered: a `multiprocessing` `fork` child (a copy of the node, run context included), `os.system` (the
shell gets the process's own environment), a child started by a thread that does not carry the run's context.
"""

from __future__ import annotations

import functools
import importlib
import operator
import os
import subprocess
import threading
from collections.abc import Callable, Mapping
from typing import Any

from langchain_core.runnables.config import var_child_runnable_config

from drmas_graph.errors import ConfigError
from drmas_graph.instrumentation._intercept import (
    ACTIVE_HANDLER,
    APP_MODELS,
    POLICY_REQUESTS,
    CallSite,
    is_running,
    node_path,
)
from drmas_graph.instrumentation.endpoint import (
    ANTHROPIC_URL_VARS,
    OPENAI_URL_VARS,
    PLACEHOLDER_KEY,
    is_endpoint_url,
    llm_env,
)

__all__ = ["install", "child_env", "OPT_OUT", "LLM_VARS"]

OPT_OUT = "DRMAS_SUBPROCESS_ENV"
"""Environment variable: 'off' (or '0', 'false', 'no') in a child's environment leaves it as the app made it;
'on' (or '1', 'true', 'yes', unset) gives a child started inside a node the run's endpoint."""
_OFF, _ON = ("off", "0", "false", "no"), ("on", "1", "true", "yes", "")

_APIS = ((OPENAI_URL_VARS, "OPENAI_API_KEY"), (ANTHROPIC_URL_VARS, "ANTHROPIC_API_KEY"))
"""Each API's base-URL variables and its key variable."""
LLM_VARS = frozenset(OPENAI_URL_VARS + ANTHROPIC_URL_VARS + ("OPENAI_API_KEY", "ANTHROPIC_API_KEY"))

_fork = threading.local()
"""`_fork.env`: the endpoint variables made before a fork in this thread (None: none), for the child."""
_forked_env: dict[str, str] | None = None
"""In a process forked inside a node: the endpoint variables made for it in the parent before the fork."""


def child_env(env: Mapping[Any, Any] | None) -> Mapping[Any, Any] | None:
    """The environment of a child started here with `env` (None: the child inherits `os.environ`): `env` itself
    where children are left alone, else a new dict, the endpoint's LLM variables over `env` (module docstring)."""
    if not _inside_node():
        return env
    base = {os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()}
    if _opted_out(base):
        return env
    chosen = {urls: next((base[n] for n in urls if is_endpoint_url(base.get(n, ""))), None) for urls, _ in _APIS}
    ours = None if all(chosen.values()) else (_forked_env or llm_env())
    for urls, key in _APIS:
        url = chosen[urls] or ours[urls[0]]  # type: ignore[index]
        base.update({name: url for name in urls})
        base[key] = PLACEHOLDER_KEY
    return base


def _inside_node() -> bool:
    """Whether a child started here belongs to a running episode or replay whose policy serves its calls."""
    if _forked_env is not None:
        return True
    handler = ACTIVE_HANDLER.get()
    if handler is None or handler is APP_MODELS or POLICY_REQUESTS.get() or not is_running(handler):
        return False
    return _the_runs_call(handler)


def _the_runs_call(handler: Any) -> bool:
    """Whether an LLM call made here is the run's to answer: every call in a replay (`offline`: answered from
    the recording) and a strict run (served or refused); a lenient run's call when its agent has a policy. Reads
    what `_http` reads of a handler: `offline`, and the recorder's `app` (its `strict`, routing and policies)."""
    if getattr(handler, "offline", False):
        return True
    app = getattr(handler, "app", None)
    if app is None:
        return False
    if getattr(app, "strict", False):
        return True
    metadata = dict((var_child_runnable_config.get() or {}).get("metadata") or {})
    node = node_path(metadata)
    site = CallSite(model=None, messages=[], stop=None, tools=[], metadata=metadata, node=node, step=-1, call_key=node)
    return app.agent_of(site) in app.policies


def _opted_out(env: Mapping[str, str]) -> bool:
    value = env.get(OPT_OUT, "").strip().lower()
    if value in _OFF:
        return True
    if value in _ON:
        return False
    raise ConfigError(f"{OPT_OUT}={env[OPT_OUT]!r} in the environment of a subprocess started inside a node: valid "
                      "values are 'off' (the child keeps the app's LLM variables) and 'on' (the default: its LLM "
                      "calls go to the run's local endpoint)")


class _Call:
    """Pickles as `fn(*args)`: what the child runs while it unpickles (stdlib callables only)."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


def _set_in_child(variables: dict[str, str]) -> _Call:
    """An object whose unpickling runs `os.environ.update(variables)` (as `methodcaller('update', variables)`
    applied to `getattr(import_module('os'), 'environ')`)."""
    environ = _Call(getattr, (_Call(importlib.import_module, ("os",)), "environ"))
    return _Call(operator.methodcaller("update", variables), (environ,))


_PREPARATION_KEY = "drmas_graph_llm_env"
"""The entry of a `spawn`/`forkserver` child's preparation data that sets its variables (multiprocessing's
`prepare` ignores keys it does not know)."""


def _before_fork() -> None:
    _fork.env = (_forked_env or dict(llm_env())) if _inside_node() else None


def _after_fork_in_parent() -> None:
    _fork.env = None


def _after_fork_in_child() -> None:
    global _forked_env
    _forked_env = getattr(_fork, "env", None)


_installed = False
_install_lock = threading.Lock()


def install() -> None:
    """Wrap the places children are started (module docstring), once; outside runs each calls the original."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _wrap_popen()
        _wrap_os()
        _wrap_multiprocessing()
        _installed = True


def _wrap_popen() -> None:
    orig = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest, **kwargs):
        return orig(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, child_env(env), *rest, **kwargs)

    subprocess.Popen._execute_child = _execute_child  # type: ignore[attr-defined]


def _wrap_os() -> None:
    for name in ("posix_spawn", "posix_spawnp"):
        orig_spawn = getattr(os, name, None)
        if orig_spawn is not None:
            setattr(os, name, _with_child_env(orig_spawn))
    if not hasattr(os, "register_at_fork"):
        return
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
    orig_execv, orig_execve = os.execv, os.execve

    @functools.wraps(orig_execv)
    def execv(path, argv):
        if _forked_env is None:
            return orig_execv(path, argv)
        return orig_execve(path, argv, child_env(None) or os.environ)

    @functools.wraps(orig_execve)
    def execve(path, argv, env):
        return orig_execve(path, argv, env if _forked_env is None else child_env(env))

    os.execv, os.execve = execv, execve


def _with_child_env(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def spawn(path, argv, env, /, **kwargs):
        return orig(path, argv, child_env(env), **kwargs)

    return spawn


def _wrap_multiprocessing() -> None:
    from multiprocessing import spawn

    orig = spawn.get_preparation_data

    @functools.wraps(orig)
    def get_preparation_data(name):
        data = orig(name)
        env = child_env(None)  # (the child starts with the parent's os.environ)
        if env is not None:
            data[_PREPARATION_KEY] = _set_in_child({k: v for k, v in env.items() if k in LLM_VARS})
        return data

    spawn.get_preparation_data = get_preparation_data

