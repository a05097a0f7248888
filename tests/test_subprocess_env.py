"""Issue 58 item 3: a program a node starts gets the run's local LLM endpoint in its environment. An unmodified
app's node starts a child that calls the OpenAI SDK at the user's `OPENAI_BASE_URL`; inside a run the call is
served by the node's policy, recorded, and replayed from the record, whichever way the child was started
(`subprocess`, asyncio, `os.posix_spawn`, `os.spawnv`, fork + `os.execv`, multiprocessing's spawn and
forkserver). The child's sockets are blocked except the endpoint's, so a call that went out would fail."""

import asyncio
import json
import multiprocessing
import os
import shlex
import subprocess
import sys
from typing import TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

from drmas_graph import TraceStore, app_models, instrument, llm_env
from drmas_graph.errors import ConfigError
from drmas_graph.instrumentation import _subprocess, endpoint
from drmas_graph.testing import scripted_policy
from drmas_graph.traces.replay import replay
from tests._no_network import child_guard, no_network  # noqa: F401 - a fixture

USER_URL = "https://api.openai.com/v1"

SDK_CHILD = """
import json, sys
import openai
try:
    client = openai.OpenAI(max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": sys.argv[3]}])
    result = {"text": reply.choices[0].message.content, "base_url": str(client.base_url)}
except Exception as exc:
    result = {"error": f"{type(exc).__name__}: {exc}"}
with open(sys.argv[2], "w") as f:
    f.write(json.dumps(result))
"""

ENV_CHILD = """
import json, os, sys
with open(sys.argv[2], "w") as f:
    f.write(json.dumps(dict(os.environ)))
"""


@pytest.fixture
def user_env(monkeypatch):
    """The user's own LLM settings, which a child inherits."""
    monkeypatch.setenv("OPENAI_BASE_URL", USER_URL)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-user-never-sent")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "https://api.anthropic.com")
    monkeypatch.delenv(_subprocess.OPT_OUT, raising=False)


def python_child(cmd):
    """The target of a multiprocessing child: runs `cmd` ([python, '-c', code, *argv]) in this process."""
    sys.argv = ["-c", *cmd[3:]]
    exec(cmd[2], {"__name__": "__child__"})


async def _exec(cmd, shell):
    if shell:
        proc = await asyncio.create_subprocess_shell(shlex.join(cmd))
    else:
        proc = await asyncio.create_subprocess_exec(*cmd)
    assert await proc.wait() == 0


def _fork_exec(cmd):
    pid = os.fork()
    if pid == 0:  # the child: the new program replaces it
        try:
            os.execv(cmd[0], cmd)
        finally:
            os._exit(127)
    assert os.waitpid(pid, 0)[1] == 0


def _multiprocessing(method, cmd):
    process = multiprocessing.get_context(method).Process(target=python_child, args=(cmd,))
    process.start()
    process.join(120)
    assert process.exitcode == 0


LAUNCHERS = {
    "run": lambda cmd: subprocess.run(cmd, check=True, timeout=120),
    "asyncio_exec": lambda cmd: asyncio.run(_exec(cmd, shell=False)),
    "asyncio_shell": lambda cmd: asyncio.run(_exec(cmd, shell=True)),
    "posix_spawn": lambda cmd: os.waitpid(os.posix_spawn(cmd[0], cmd, os.environ), 0),
    "spawnv": lambda cmd: os.spawnv(os.P_WAIT, cmd[0], cmd),
    "fork_execv": _fork_exec,
    "mp_spawn": lambda cmd: _multiprocessing("spawn", cmd),
    "mp_forkserver": lambda cmd: _multiprocessing("forkserver", cmd),
}
"""How a node starts its child (`cmd`: [python, '-c', code, *argv]); each waits for it."""


class S(TypedDict, total=False):
    how: str
    question: str
    out: dict


def app_graph(code, out_path, **start):
    """One node ('worker') that starts a Python child running `code` (argv: out_path, the question) the way
    `state['how']` names, and returns what the child wrote to `out_path`. `start`: keyword arguments for
    `subprocess.run` instead (an explicit `env=`)."""
    def worker(state):
        cmd = [sys.executable, "-c", code, "-", str(out_path), state.get("question", "")]
        if start:
            subprocess.run(cmd, check=True, timeout=120, **start)
        else:
            LAUNCHERS[state["how"]](cmd)
        return {"out": json.loads(out_path.read_text())}

    return StateGraph(S).add_node("worker", worker).add_edge(START, "worker").add_edge("worker", END).compile()


def endpoint_prefix():
    return f"http://127.0.0.1:{endpoint._port()}/drmas/"


@pytest.mark.parametrize("how", sorted(LAUNCHERS))
def test_a_child_of_a_node_calls_the_policy_through_the_endpoint(how, tmp_path, user_env, request):
    # (the forkserver is reached over a unix socket, which `no_network` counts as a connection)
    no_network = [] if how == "mp_forkserver" else request.getfixturevalue("no_network")
    policy = scripted_policy(["from the policy"])
    code = child_guard(endpoint._port()) + SDK_CHILD
    app = instrument(app_graph(code, tmp_path / "out.json"), {"worker": policy}, strict=True)
    episode = app.rollout({"how": how, "question": "What is 2+2?"})
    out = episode.final_state["out"]
    # before: {'error': 'APIConnectionError: Connection error.'} (the child looked up api.openai.com)
    assert out.get("text") == "from the policy", out
    assert out["base_url"].startswith(endpoint_prefix()) and out["base_url"].endswith("/v1/")
    [turn] = episode.turns
    assert (turn.agent, turn.node, turn.call_key, turn.response_text) == ("worker", "worker", "worker", "from the policy")
    assert policy.tokenizer.decode(list(turn.prompt_ids)).count("What is 2+2?") == 1
    assert no_network == []
    policy.close()


def test_the_childs_call_is_recorded_and_replayed_from_the_record(tmp_path, user_env, no_network):
    policy = scripted_policy(["recorded answer"])
    code = child_guard(endpoint._port()) + SDK_CHILD
    with TraceStore(tmp_path / "traces.db") as store:
        app = instrument(app_graph(code, tmp_path / "out.json"), {"worker": policy}, strict=True, store=store)
        episode = app.rollout({"how": "run", "question": "Name a color."})
        assert episode.final_state["out"]["text"] == "recorded answer"
        stored = store.load_episode(episode.id)
        assert [(t.agent, t.response_text) for t in stored.turns] == [("worker", "recorded answer")]
        (tmp_path / "out.json").unlink()
        result = replay(app_graph(code, tmp_path / "out.json"), store, episode.id)  # no policy: the record answers
    # before: the replayed child sent its call to api.openai.com (here: blocked, 'APIConnectionError')
    assert result.divergences == [] and not result.stopped, result
    assert result.final_state["out"]["text"] == "recorded answer"
    assert [t.response_text for t in result.turns] == ["recorded answer"]
    assert no_network == []
    policy.close()


def run_env_child(tmp_path, graph_kwargs=None, policies=("worker",), strict=False, state=None, **start):
    """The environment a child of node 'worker' saw (started with `subprocess.run`, `start` its keywords)."""
    policy = scripted_policy(["unused"])
    app = instrument(app_graph(ENV_CHILD, tmp_path / "env.json", **start), {p: policy for p in policies},
                     strict=strict, **(graph_kwargs or {}))
    try:
        return app.invoke(state or {"how": "run"})["out"]
    finally:
        policy.close()


def test_an_explicit_env_gets_the_endpoint_for_the_llm_variables_only(tmp_path, user_env):
    given = {"PATH": os.environ["PATH"], "KEEP_ME": "yes", "OPENAI_BASE_URL": USER_URL,
             "OPENAI_API_KEY": "sk-user", "OPENAI_API_BASE": "http://localhost:8000/v1"}
    seen = run_env_child(tmp_path, env=given)
    url = seen["OPENAI_BASE_URL"]
    assert url.startswith(endpoint_prefix()) and url.endswith("/v1")
    root = url.removesuffix("/v1")
    assert {k: seen[k] for k in _subprocess.LLM_VARS} == {
        "OPENAI_BASE_URL": url, "OPENAI_API_BASE": url, "OPENAI_API_KEY": "drmas-local", "ANTHROPIC_BASE_URL": root,
        "ANTHROPIC_API_URL": root, "ANTHROPIC_API_BASE": root, "ANTHROPIC_API_KEY": "drmas-local"}
    assert seen["KEEP_ME"] == "yes" and seen["PATH"] == os.environ["PATH"]
    assert set(seen) - set(given) - _subprocess.LLM_VARS <= {"LC_CTYPE"}  # (the interpreter may add its locale)

    # an env that already names the endpoint (llm_env(agent=...)) keeps the app's choice of agent
    chosen = {}

    def worker(state):
        chosen.update(llm_env(agent="critic"))
        out = tmp_path / "env.json"
        subprocess.run([sys.executable, "-c", ENV_CHILD, "-", str(out)], check=True, env={**os.environ, **chosen})
        return {"out": json.loads(out.read_text())}

    graph = StateGraph(S).add_node("worker", worker).add_edge(START, "worker").add_edge("worker", END).compile()
    policy = scripted_policy(["unused"])
    seen = instrument(graph, {"worker": policy, "critic": policy}).invoke({})["out"]
    assert {k: seen[k] for k in chosen} == chosen
    policy.close()


def test_the_opt_out_leaves_the_child_as_the_app_made_it(tmp_path, user_env, monkeypatch):
    one = run_env_child(tmp_path, env={**os.environ, _subprocess.OPT_OUT: "off"})  # this child only
    assert (one["OPENAI_BASE_URL"], one["OPENAI_API_KEY"]) == (USER_URL, "sk-user-never-sent")
    monkeypatch.setenv(_subprocess.OPT_OUT, "0")  # every child of the app
    every = run_env_child(tmp_path)
    assert (every["OPENAI_BASE_URL"], every.get("OPENAI_API_BASE")) == (USER_URL, None)
    monkeypatch.setenv(_subprocess.OPT_OUT, "maybe")
    with pytest.raises(ConfigError, match=r"DRMAS_SUBPROCESS_ENV='maybe' .* valid values are 'off' .* and 'on'"):
        run_env_child(tmp_path)


def test_children_that_are_not_the_runs_are_untouched(tmp_path, user_env):
    out = tmp_path / "env.json"
    cmd = [sys.executable, "-c", ENV_CHILD, "-", str(out)]
    subprocess.run(cmd, check=True)  # outside any run
    assert json.loads(out.read_text())["OPENAI_BASE_URL"] == USER_URL
    given = {"PATH": "/bin"}
    assert _subprocess.child_env(given) is given and _subprocess.child_env(None) is None
    # a lenient run, a node whose agent has no policy: the app's own model answers its calls, and its child's
    assert run_env_child(tmp_path, policies=("other",))["OPENAI_BASE_URL"] == USER_URL
    # the same node in a strict run: the call is the run's (the endpoint refuses it, as in-process)
    assert run_env_child(tmp_path, policies=("other",), strict=True)["OPENAI_BASE_URL"].startswith(endpoint_prefix())

    def worker(state):
        with app_models():  # deliberate calls to the app's own model (a judge)
            subprocess.run(cmd, check=True)
        return {"out": json.loads(out.read_text())}

    graph = StateGraph(S).add_node("worker", worker).add_edge(START, "worker").add_edge("worker", END).compile()
    policy = scripted_policy(["unused"])
    assert instrument(graph, {"worker": policy}).invoke({})["out"]["OPENAI_BASE_URL"] == USER_URL
    policy.close()
