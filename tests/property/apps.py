"""A grammar of LangGraph apps (Hypothesis strategies) and a builder that turns an app description into a real,
compiled app.

The apps are ordinary LangGraph apps built the way their docs build them; this module never imports
drmas_graph. Every LLM call goes to the app's own chat model (`AppModel`), which answers and counts, so a call
the instrumentation failed to serve is visible (`AppModel.calls`, and its reply text `APP_MODEL_REPLY`).

A description is a small tree of frozen dataclasses: an `App` is a chain of `Step`s (a node, a conditional
branch between two nodes, or a `Send` fan-out to one worker node), or a Functional API entrypoint that calls
`@task`s. A `Node` makes LLM calls (`Call`s, each a call site with its own id and prompt) directly, as a
subgraph used as a node, or by invoking a subgraph or a `create_agent` agent from its function once, k times
in turn, through `.batch` or through a `ThreadPoolExecutor`. `Route` says how each top-level unit's calls are
mapped to an agent and which of the scripted policies serves it. Sleeps before calls come from `Timing`, whose
seed the tests change between runs of the same app.

Round 5 (issue 40) grew the grammar past the suite's three limits (one process, one rollout per thread, only
`rollout()`): `App.run` runs the app by any of its run methods (`RUN_METHODS`); a call's prompt may read the
run config's `configurable` or LangGraph's `context=` (`Call.source`); a node may have a `CachePolicy` or a
`RetryPolicy`; a `vote` node calls two agents at once with one prompt (`drmas_agent` metadata); a `nested`
node runs its subgraph as a separately instrumented app (`build(..., nest=)`: the instrumenting is the test's,
this module never imports drmas_graph); an `invoke` subgraph may keep its memory on the thread
(`Node.memory`: compiled with `checkpointer=True`). Several rollouts of one thread and replays in another
process are the tests' (`test_generated_apps.py`). Issue 47: a call site's calls may go through another client
(`Call.client`, drawn from `clients.CLIENTS`: the OpenAI and Anthropic SDKs sync, async and streamed, LiteLLM,
a raw httpx POST, the run's local endpoint).
"""

from __future__ import annotations

import concurrent.futures
import enum
import itertools
import json
import operator
import os
import random
import time
import zlib
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypedDict

from hypothesis import strategies as st
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import RunnableLambda
from langchain_core.tools import tool
from langgraph.cache.memory import InMemoryCache
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.config import get_config
from langgraph.func import entrypoint, task
from langgraph.graph import END, START, StateGraph
from langgraph.runtime import get_runtime
from langgraph.types import CachePolicy, RetryPolicy, Send, interrupt
from pydantic import BaseModel, create_model

from tests.property.clients import CLIENTS, ask_sdk

KNOWN_DEFECTS: dict[str, bool] = {
    "rev4_p": False,  # a node runs a subgraph / agent more than once (in turn or via .batch): wrong path, agent
    "rev4_q": False,  # a node runs a subgraph / agent in a ThreadPoolExecutor: the node is lost
    "rev4_n": False,  # a set or an Enum in the final state or in an interrupt value: false replay mismatch
    "rev4_u": False,  # compile(checkpointer=False) with a thread_id: every rollout fails
    "rev4_s": False,  # a changed structured-output schema replays with no divergence (the check is xfail)
    "new_interrupt": False,  # found here: a one-run episode replayed into a run that stops at interrupt() reports
    # missing_call, not interrupt_changed (tests/property/found_replay_ignores_new_interrupt.py); the
    # changed-reply check leaves apps with interrupts out
}
"""Known defects, True while unfixed: the grammar leaves out the pattern that triggers each one (rev4_s marks
its check xfail instead), so the suite stays green meanwhile. Set an entry to False once its fix is merged
(then the generator covers that pattern again). For a run that hunts defects, `DRMAS_PROPERTY_PATTERNS=all`
(or a list: `rev4_p,rev4_q`) generates those patterns whatever this says."""

_HUNT = os.environ.get("DRMAS_PROPERTY_PATTERNS", "")
for _name in (KNOWN_DEFECTS if _HUNT == "all" else [n for n in _HUNT.split(",") if n]):
    if _name not in KNOWN_DEFECTS:
        raise ValueError(f"DRMAS_PROPERTY_PATTERNS names {_name!r}; known: {sorted(KNOWN_DEFECTS)} or 'all'")
    KNOWN_DEFECTS[_name] = False

APP_MODEL_REPLY = "APP MODEL ANSWERED"
PROMPTS = ("Answer briefly.", "Think, then answer.", "Summarise the notes.", "Check the last result.")
VALUE_KINDS = ("str", "int", "list", "set", "enum")
"""What a call's node writes to the state besides its reply (set and Enum: see rev4_n)."""
INVOKE_MODES = ("once", "seq", "batch", "pool")
RUN_METHODS = ("rollout", "invoke", "ainvoke", "stream", "astream", "astream_events", "batch")
"""How the app is run (rev5_h: a streamed run stored no final state). Only `rollout` answers interrupts."""
SOURCES = ("", "configurable", "context")
"""Where a call's prompt takes a per-run value from besides the state (rev5_a): nowhere, the run config's
`configurable['persona']`, or LangGraph's `context=` (`Runtime.context.user`)."""
PERSONA, USER = "a pirate", "bob"


@dataclass(frozen=True)
class Ctx:
    """The apps' `context_schema`: `context=Ctx(user=...)` (LangGraph's Runtime context)."""

    user: str = "anonymous"


# -- descriptions -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One LLM call site: every prompt it sends starts with the system message 'site <site>: <prompt>'."""

    site: str
    """Id of the call site ('s3'): how a recorded turn is traced back to the description."""
    kind: Literal["llm", "structured", "interrupt", "agent"]
    """A plain call, a structured-output call, interrupt() then a call, or a create_agent agent with a tool."""
    prompt: str
    """The site's instruction (the changed-app check edits it)."""
    schema: str = ""
    """structured: the pydantic schema's key in SCHEMAS."""
    method: str = ""
    """structured: 'tool' (BaseChatModel.with_structured_output) or 'json_schema' (bind(response_format=...))."""
    value: str = "str"
    """What the node writes besides its reply: one of VALUE_KINDS."""
    source: str = ""
    """One of SOURCES: a per-run value the prompt reads."""
    client: str = "langchain"
    """One of `clients.CLIENTS`: the app's LangChain model, or another client (`clients.ask_sdk`)."""


@dataclass(frozen=True)
class Node:
    """A node of the top-level graph (or the worker of a fan-out)."""

    name: str
    kind: Literal["call", "subgraph", "invoke", "vote", "nested"]
    """call: the node makes its call; subgraph: the node is a compiled subgraph whose nodes m0, m1.. make the
    calls; invoke: the node's function invokes a subgraph (or a create_agent agent) `k` times by `mode`;
    vote: the node calls agents 'v0_<name>' and 'v1_<name>' at once with one prompt (drmas_agent metadata);
    nested: the node invokes a subgraph of `calls[1:]` as a separately instrumented app (`build(..., nest=)`),
    then makes its own call `calls[0]`."""
    calls: tuple[Call, ...]
    mode: str = "once"
    """invoke: one of INVOKE_MODES."""
    k: int = 1
    agent_name: str = ""
    """invoke of a create_agent agent: its name (create_agent(name=...)); '' for a subgraph."""
    cache: bool = False
    """The node has a LangGraph CachePolicy (the graph is compiled with a cache) (rev5_f)."""
    retry: bool = False
    """The node has a RetryPolicy; its first attempt fails after its call (a flaky tool), once per run."""
    memory: bool = False
    """invoke (once) of a subgraph compiled with checkpointer=True: it keeps its own state on the thread."""


@dataclass(frozen=True)
class Step:
    kind: Literal["single", "branch", "fan"]
    """single: one node; branch: a conditional edge picks one of two nodes; fan: `k` Sends to one worker."""
    nodes: tuple[Node, ...]
    k: int = 1


@dataclass(frozen=True)
class Route:
    """How the calls of one top-level unit (node or task) reach an agent, and which policy serves it."""

    unit: str
    style: Literal["path", "rename", "glob", "name"]
    """path: the agent is the node path; rename: agents={path: name}; glob: agents={'<unit>/*' or '*<task>':
    name}; name: agents={'agent:<agent name>': name} (create_agent agents only)."""
    policy: int
    """Index of the scripted policy that serves the unit's agents."""


@dataclass(frozen=True)
class App:
    kind: Literal["graph", "functional"]
    steps: tuple[Step, ...] = ()
    tasks: tuple[Call, ...] = ()
    """functional: the @task call sites, task i named 't<i>'."""
    parallel: bool = False
    """functional: the entrypoint starts every task before waiting on any (else in turn, each after the last)."""
    checkpointer: Literal["memory", "none", "false"] = "memory"
    routes: tuple[Route, ...] = ()
    run: str = "rollout"
    """One of RUN_METHODS."""

    def nodes(self) -> list[Node]:
        return [node for step in self.steps for node in step.nodes]

    def calls(self) -> list[Call]:
        return list(self.tasks) + [c for node in self.nodes() for c in node.calls]

    def with_call(self, site: str, **changes: Any) -> App:
        """This app with one call site changed (the changed-app checks)."""
        from dataclasses import replace

        def call(c: Call) -> Call:
            return replace(c, **changes) if c.site == site else c

        steps = tuple(replace(s, nodes=tuple(replace(n, calls=tuple(map(call, n.calls))) for n in s.nodes))
                      for s in self.steps)
        return replace(self, steps=steps, tasks=tuple(map(call, self.tasks)))


# -- the grammar ------------------------------------------------------------------------------------------


@st.composite
def apps(draw: Any, need: str | None = None) -> App:
    """An app description. `need='structured'` / `'llm'` makes sure the app has a call site of that kind."""
    sites = itertools.count()
    values = [v for v in VALUE_KINDS if not (KNOWN_DEFECTS["rev4_n"] and v in ("set", "enum"))]

    def call(kinds: tuple[str, ...], value: bool = True, source: bool = True) -> Call:
        kind = draw(st.sampled_from(kinds))
        schema = draw(st.sampled_from(SCHEMAS_DRAWN)) if kind == "structured" else ""
        method = draw(st.sampled_from(("tool", "json_schema"))) if kind == "structured" else ""
        number = next(sites)
        return Call(f"s{number}", kind, draw(st.sampled_from(PROMPTS)), schema, method,
                    draw(st.sampled_from(values)) if value else "str",
                    draw(st.sampled_from(SOURCES)) if source and kind != "agent" else "",
                    draw(st.one_of(st.just("langchain"), st.sampled_from(CLIENTS[1:]))) if kind != "agent"
                    else "langchain")  # half the sites LangChain, half one of the other clients

    if draw(st.integers(0, 4)) == 0:  # a Functional API app
        tasks = tuple(call(("llm", "structured"), source=False) for _ in range(draw(st.integers(1, 3))))
        app = App("functional", tasks=tasks, parallel=draw(st.booleans()),
                  routes=tuple(Route(f"t{i}", draw(st.sampled_from(("path", "rename", "glob"))),
                                     draw(st.integers(0, 2))) for i in range(len(tasks))),
                  run=draw(st.sampled_from(RUN_METHODS)))
        return _needed(draw, app, need)

    names = (f"n{i}" for i in itertools.count())
    modes = [m for m in INVOKE_MODES if not (KNOWN_DEFECTS["rev4_q"] and m == "pool")]

    def node(in_fan: bool) -> Node:
        kind = draw(st.sampled_from(("call", "subgraph", "invoke", "vote", "nested")))
        name = next(names)
        if kind == "call":
            kinds = ("llm", "structured") if in_fan else ("llm", "structured", "interrupt")
            the_call = call(kinds, value=not in_fan)
            flaky = the_call.kind != "interrupt" and draw(st.booleans())  # interrupt() then a retry: another shape
            return Node(name, "call", (the_call,), cache=draw(st.booleans()), retry=flaky and draw(st.booleans()))
        if kind == "vote":
            return Node(name, "vote", (call(("llm",), value=False),))
        if kind == "nested":  # its own call, then the nested app's m0, m1..
            return Node(name, "nested", tuple(call(("llm", "structured"), value=False)
                                              for _ in range(draw(st.integers(2, 3)))))
        if kind == "subgraph":
            return Node(name, "subgraph", tuple(call(("llm", "structured"), value=False)
                                                for _ in range(draw(st.integers(1, 2)))))
        mode = draw(st.sampled_from(modes))
        k = 1 if mode == "once" or KNOWN_DEFECTS["rev4_p"] else draw(st.integers(1, 3))  # rev4_p: runs after the first
        if draw(st.booleans()):
            return Node(name, "invoke", (call(("agent",), value=False),), mode, k, agent_name=f"bot_{name}")
        memory = mode == "once" and not in_fan and draw(st.booleans())  # one run per node: LangGraph's rule
        return Node(name, "invoke", tuple(call(("llm", "structured"), value=False)
                                          for _ in range(draw(st.integers(1, 2)))), mode, k, memory=memory)

    steps = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(("single", "branch", "fan")))
        if kind == "single":
            steps.append(Step("single", (node(False),)))
        elif kind == "branch":
            steps.append(Step("branch", (node(False), node(False))))
        else:
            steps.append(Step("fan", (node(True),), draw(st.integers(1, 3))))
    pauses = any(c.kind == "interrupt" for s in steps for n in s.nodes for c in n.calls)
    savers = ["memory"] if pauses else ["memory", "none"] + ([] if KNOWN_DEFECTS["rev4_u"] else ["false"])
    routes = []
    for step in steps:
        for n in step.nodes:
            styles = ("path",) if n.kind in ("vote", "nested") else (
                ("path", "rename", "glob") + (("name",) if n.agent_name else ()))
            routes.append(Route(n.name, draw(st.sampled_from(styles)), draw(st.integers(0, 2))))
    saver = draw(st.sampled_from(savers))
    if saver != "memory":  # a sub-agent's memory lives on the parent's checkpointed thread
        steps = [Step(s.kind, tuple(_forget(n) for n in s.nodes), s.k) for s in steps]
    methods = ("rollout",) if pauses else RUN_METHODS
    if any(n.kind == "subgraph" for s in steps for n in s.nodes):  # LangGraph's own astream_events applies no
        # output_schema to a subgraph node (its 'note' reaches the parent; in a fan: InvalidUpdateError 'topic'),
        # unlike invoke: the plain graph differs the same way (FINDINGS.md), so replay (invoke) cannot agree
        methods = tuple(m for m in methods if m != "astream_events")
    app = App("graph", steps=tuple(steps), checkpointer=saver, routes=tuple(routes),
              run=draw(st.sampled_from(methods)))
    return _needed(draw, app, need)


def _forget(node: Node) -> Node:
    from dataclasses import replace

    return replace(node, memory=False) if node.memory else node


def _needed(draw: Any, app: App, need: str | None) -> App:
    from hypothesis import assume

    assume(need is None or any(c.kind == need for c in app.calls()))
    return app


timings = st.integers(0, 2**16)
"""A timing seed: how long every call site sleeps before its call (see `Timing`)."""


# -- the builder ------------------------------------------------------------------------------------------


class AppModel(BaseChatModel):
    """The app's own chat model: answers APP_MODEL_REPLY and counts its calls (it must never be called for an
    agent that has a policy)."""

    calls: int = 0

    @property
    def _llm_type(self) -> str:
        return "app-model"

    def bind_tools(self, tools: Any, *, tool_choice: Any = None, **kwargs: Any) -> Any:
        from langchain_core.utils.function_calling import convert_to_openai_tool

        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

    def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> ChatResult:
        self.calls += 1
        return ChatResult(generations=[ChatGeneration(message=AIMessage(APP_MODEL_REPLY))])


class Level(enum.Enum):
    LOW = "low"
    HIGH = "high"


SCHEMAS: dict[str, type[BaseModel]] = {
    "Verdict": create_model("Verdict", ok=(bool, ...)),
    "Score": create_model("Score", score=(int, ...), reason=(str, ...)),
    "Verdict+reason": create_model("Verdict", ok=(bool, ...), reason=(str, ...)),
}
"""Structured-output schemas by key. 'Verdict+reason' is 'Verdict' with one more required field under the same
name: the changed-schema check swaps it in."""
SCHEMAS_DRAWN = ("Verdict", "Score")


def _last(a: Any, b: Any) -> Any:
    return b


class State(TypedDict, total=False):
    """Channels with a reducer start from their type's empty value (LangGraph), so only `note`, which the
    workers of a fan-out write together, has one besides `log`."""

    topic: str
    item: int
    after: str
    log: Annotated[list, operator.add]
    note: Annotated[str, _last]
    count: int
    items: list
    tags: set
    level: Level


class SubIn(TypedDict, total=False):
    topic: str
    item: int
    after: str


class SubOut(TypedDict, total=False):
    log: list


class Timing:
    """Sleeps before calls, drawn from a seed: the same app run with another seed interleaves differently."""

    def __init__(self, seed: int = 0, max_s: float = 0.01) -> None:
        self.seed, self.max_s = seed, max_s

    def sleep(self, where: str, instance: Any) -> None:
        time.sleep(random.Random(f"{self.seed}/{where}/{instance}").random() * self.max_s)


@tool
def lookup(q: str) -> str:
    """Look a word up."""
    return f"found {q}"


def after_of(state: dict) -> str:
    """The text a call builds on: the fan-out's or subgraph's 'after', else the last logged reply."""
    return state.get("after") or (state.get("log") or ["-"])[-1]


@dataclass
class Built:
    """A compiled app and its knobs."""

    graph: Any
    model: AppModel
    timing: Timing
    checkpointed: bool


class Flaky(Exception):
    """A node's first attempt fails after its LLM call (a flaky tool); its RetryPolicy runs it again."""


def build(app: App, timing: Timing | None = None, nest: Any = None) -> Built:
    """The compiled LangGraph app for a description. `nest(node, graph)` turns the subgraph of a `nested` node
    into what the node invokes (an instrumented app: the test's; the plain subgraph without it)."""
    model, timing = AppModel(), timing or Timing()
    if app.kind == "functional":
        return Built(_functional(app, model, timing), model, timing, True)
    saver = {"memory": InMemorySaver(), "none": None, "false": False}[app.checkpointer]
    g = StateGraph(State, context_schema=Ctx)
    prev = START
    for i, step in enumerate(app.steps):
        for node in step.nodes:
            g.add_node(node.name, _node(node, model, timing, nest),
                       cache_policy=CachePolicy(ttl=600) if node.cache else None,
                       retry_policy=RetryPolicy(max_attempts=2, initial_interval=0.001, jitter=False,
                                                retry_on=Flaky) if node.retry else None)
        if step.kind == "single":
            g.add_edge(prev, step.nodes[0].name)
            prev = step.nodes[0].name
            continue
        join = f"j{i}"
        g.add_node(join, _join)
        if step.kind == "branch":
            left, right = (n.name for n in step.nodes)
            g.add_conditional_edges(prev, _router(left, right), [left, right])
        else:
            g.add_conditional_edges(prev, _fan(step.nodes[0].name, step.k), [step.nodes[0].name])
        for node in step.nodes:
            g.add_edge(node.name, join)
        prev = join
    g.add_edge(prev, END)
    cache = InMemoryCache() if any(n.cache for n in app.nodes()) else None
    return Built(g.compile(checkpointer=saver, cache=cache), model, timing, app.checkpointer == "memory")


def _join(state: dict) -> dict:
    return {}


def _router(left: str, right: str) -> Any:
    def route(state: dict) -> str:
        return (left, right)[zlib.crc32(after_of(state).encode()) % 2]
    return route


def _fan(worker: str, k: int) -> Any:
    def fan(state: dict) -> list[Send]:
        return [Send(worker, {"topic": state["topic"], "item": i, "after": after_of(state)}) for i in range(k)]
    return fan


def ask(call: Call, model: AppModel, human: str) -> str:
    """Make the call site's LLM call; a structured answer comes back as its JSON."""
    messages = [SystemMessage(f"site {call.site}: {call.prompt}"), HumanMessage(human)]
    if call.client != "langchain":
        return ask_sdk(call, messages, SCHEMAS)
    if call.kind != "structured":
        return model.invoke(messages).content
    schema = SCHEMAS[call.schema]
    if call.method == "tool":
        return json.dumps(model.with_structured_output(schema).invoke(messages).model_dump(), sort_keys=True)
    bound = model.bind(response_format={"type": "json_schema", "json_schema": {
        "name": schema.__name__, "schema": schema.model_json_schema()}})
    return json.dumps(schema.model_validate_json(bound.invoke(messages).content).model_dump(), sort_keys=True)


def _values(kind: str, reply: str) -> dict:
    odd = zlib.crc32(reply.encode()) % 2
    return {"str": {"note": reply[:12]}, "int": {"count": len(reply)}, "list": {"items": [reply[:6], len(reply)]},
            "set": {"tags": {reply[:6], "seen"}}, "enum": {"level": (Level.LOW, Level.HIGH)[odd]}}[kind]


def _per_run(source: str) -> str:
    """The per-run value a prompt reads (rev5_a): the run config's or the Runtime context's."""
    if source == "configurable":
        return f" as {get_config()['configurable'].get('persona')}"
    if source == "context":
        return f" for {get_runtime(Ctx).context.user}"
    return ""


def _call_node(call: Call, model: AppModel, timing: Timing, flaky: bool = False) -> Any:
    failed: set[str] = set()  # task namespaces whose first attempt failed (one per task: a retry reuses it)

    def fn(state: dict) -> dict:
        item = state.get("item", -1)
        human = f"{state.get('topic')} #{item} after: {after_of(state)}{_per_run(call.source)}"
        if state.get("log") and call.value == "str":  # what a sub-agent with memory remembers shows
            human += f" (seen {len(state['log'])})"
        if call.kind == "interrupt":
            ask_for = {"site": call.site, "after": after_of(state)}
            if call.value == "set":
                ask_for["checks"] = {"tone", call.site}
            human += f" answer: {interrupt(ask_for)}"
        timing.sleep(call.site, item)
        reply = ask(call, model, human)
        if flaky:
            ns = str(get_config()["configurable"].get("checkpoint_ns"))
            if ns not in failed:
                failed.add(ns)
                raise Flaky(f"site {call.site}: the tool after the call failed; retried")
        return {"log": [f"{call.site}:{reply}"], **_values(call.value, reply)}
    return fn


def _subgraph(calls: tuple[Call, ...], model: AppModel, timing: Timing, memory: bool = False) -> Any:
    g = StateGraph(State, input_schema=SubIn, output_schema=SubOut)
    prev = START
    for j, call in enumerate(calls):
        g.add_node(f"m{j}", _call_node(call, model, timing))
        g.add_edge(prev, f"m{j}")
        prev = f"m{j}"
    g.add_edge(prev, END)
    return g.compile(checkpointer=True) if memory else g.compile()


def _vote(node: Node, model: AppModel, timing: Timing) -> Any:
    call = node.calls[0]

    def fn(state: dict) -> dict:
        messages = [SystemMessage(f"site {call.site}: {call.prompt}"), HumanMessage(f"{state.get('topic')} vote")]

        def one(j: int) -> str:
            timing.sleep(f"{node.name}/voter", j)  # which voter's call arrives first changes with the timing
            agent = f"v{j}_{node.name}"
            return f"{call.site}:{agent}:{model.invoke(messages, config={'metadata': {'drmas_agent': agent}}).content}"

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            return {"log": list(pool.map(one, range(2)))}
    return fn


def _agent(call: Call, name: str, model: AppModel) -> Any:
    from langchain.agents import create_agent

    return create_agent(model, tools=[lookup], system_prompt=f"site {call.site}: {call.prompt}", name=name)


def _node(node: Node, model: AppModel, timing: Timing, nest: Any = None) -> Any:
    if node.kind == "call":
        return _call_node(node.calls[0], model, timing, flaky=node.retry)
    if node.kind == "subgraph":
        return _subgraph(node.calls, model, timing)
    if node.kind == "vote":
        return _vote(node, model, timing)
    if node.kind == "nested":
        inner = _subgraph(node.calls[1:], model, timing)
        app = nest(node, inner) if nest is not None else inner

        def nested(state: dict) -> dict:
            log = app.invoke({"topic": state.get("topic"), "item": -1, "after": after_of(state)})["log"]
            own = ask(node.calls[0], model, f"{state.get('topic')} sum up: {log[-1]}")
            return {"log": log + [f"{node.calls[0].site}:{own}"]}
        return nested
    body = (_agent(node.calls[0], node.agent_name, model) if node.agent_name
            else _subgraph(node.calls, model, timing, memory=node.memory))

    def fn(state: dict) -> dict:
        topic, after = state.get("topic"), after_of(state)

        def run(j: int) -> list[str]:
            timing.sleep(f"{node.name}/run", j)
            if node.agent_name:
                out = body.invoke({"messages": [HumanMessage(f"{topic} #{j} after: {after}")]})
                return [f"{node.calls[0].site}:{out['messages'][-1].content}"]
            return body.invoke({"topic": topic, "item": j, "after": after})["log"]

        if node.mode == "batch":
            runs = RunnableLambda(run).batch(list(range(node.k)))
        elif node.mode == "pool":
            with concurrent.futures.ThreadPoolExecutor(node.k) as pool:
                runs = list(pool.map(run, range(node.k)))
        else:
            runs = [run(j) for j in range(node.k)]
        return {"log": [entry for entries in runs for entry in entries]}
    return fn


def _functional(app: App, model: AppModel, timing: Timing) -> Any:
    def make(call: Call) -> Any:
        def fn(topic: str, i: int, after: str) -> str:
            timing.sleep(call.site, i)
            return f"{call.site}:{ask(call, model, f'{topic} #{i} after: {after}')}"
        return fn

    tasks = [task(name=f"t{i}")(make(call)) for i, call in enumerate(app.tasks)]

    @entrypoint(checkpointer=InMemorySaver())
    def main(inp: dict) -> dict:
        if app.parallel:
            return {"log": [f.result() for f in [t(inp["topic"], i, "-") for i, t in enumerate(tasks)]]}
        log = []
        for i, t in enumerate(tasks):
            log.append(t(inp["topic"], i, log[-1] if log else "-").result())
        return {"log": log}

    return main
