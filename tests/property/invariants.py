"""What every generated app must satisfy when instrumented, computed from its description alone.

`wiring(app)` derives, from the description (never from the library's code), the node path, agent, agent name
and policy of every call site, and the `policies=` / `agents=` arguments that say so. The scripted policies
reply deterministically from the prompt (so two runs of one app match) and give valid structured output.
Each `check_*` function asserts one invariant of the issue, with a message naming the app description.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import note

from drmas_graph import RolloutError, TraceStore, instrument, llm_base_url
from drmas_graph.testing import scripted_policy
from drmas_graph.traces.replay import ReplayResult, comparable, replay, replay_episode
from drmas_graph.traces._compare import state_text  # noqa: F401  (the replay process prints it)
from drmas_graph.types import Episode
from tests.property import apps as _apps
from tests.property import clients, network
from tests.property.scratch import fresh_dir
from tests.property.apps import APP_MODEL_REPLY, PERSONA, USER, App, Built, Call, Ctx, Timing

clients.ENDPOINT[:] = [llm_base_url]  # the `endpoint` client's URL: this node's, in this run
POLICY_NAMES = ("pol-a", "pol-b", "pol-c")
SITE = re.compile(r"^site (s\d+): ")
MARK = "MUTATED"


@dataclass(frozen=True)
class Expect:
    """Where a call site's calls must be attributed."""

    path: str
    agent: str
    policy: str
    agent_name: str | None = None


@dataclass(frozen=True)
class Wiring:
    sites: dict[str, Expect]
    agents: dict[str, str]
    policy_of_agent: dict[str, str]
    voters: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """Site of a `vote` node -> the agents its two same-prompt calls go to (one call each)."""


def wiring(app: App) -> Wiring:
    """Expected node path, agent and policy of every call site; the `agents=` map that makes them so."""
    routes = {r.unit: r for r in app.routes}
    sites: dict[str, Expect] = {}
    agents: dict[str, str] = {}

    def place(unit: str, call: Call, path: str, agent_name: str | None = None) -> None:
        route = routes[unit]
        policy = POLICY_NAMES[route.policy]
        if route.style == "path":
            agent = path
        elif route.style == "rename":
            agent = agents[path] = f"a_{call.site}"
        elif route.style == "glob":
            pattern = f"*{unit}" if app.kind == "functional" else (unit if path == unit else f"{unit}/*")
            agent = agents[pattern] = f"g_{unit}"
        else:
            agent = agents[f"agent:{agent_name}"] = f"n_{agent_name}"
        sites[call.site] = Expect(path, agent, policy, agent_name)

    for i, call in enumerate(app.tasks):
        place(f"t{i}", call, f"main/t{i}")
    voters: dict[str, tuple[str, ...]] = {}
    extra: dict[str, str] = {}
    for node in app.nodes():
        for j, call in enumerate(node.calls):
            if node.kind == "nested" and j > 0:  # its own instrumented app serves m{j-1} (`nest`): not this episode's
                continue
            if node.kind == "vote":
                voters[call.site] = (f"v0_{node.name}", f"v1_{node.name}")
                sites[call.site] = Expect(node.name, "", POLICY_NAMES[routes[node.name].policy])
                extra.update({v: sites[call.site].policy for v in voters[call.site]})
            elif node.kind in ("call", "nested"):
                place(node.name, call, node.name)
            elif node.agent_name:
                place(node.name, call, f"{node.name}/model", node.agent_name)
            else:
                place(node.name, call, f"{node.name}/m{j}")
    policy_of_agent = {e.agent: e.policy for e in sites.values() if e.agent} | extra
    return Wiring(sites, agents, policy_of_agent, voters)


def build(app: App, timing: Timing | None = None) -> Built:
    """`apps.build` with every `nested` node's subgraph instrumented as its own app (policies m0, m1.. of the
    node's route): an instrumented app run inside a node of another (rev5_c)."""
    routes = {r.unit: r for r in app.routes}

    def nest(node: Any, graph: Any) -> Any:
        policy = policies()[POLICY_NAMES[routes[node.name].policy]]
        return instrument(graph, {f"m{j}": policy for j in range(len(node.calls) - 1)}, strict=True)
    return _apps.build(app, timing, nest=nest)


def reply_to(name: str) -> Any:
    """A scripted policy's replies: a function of the rendered prompt only."""

    def answer(prompt: str) -> str:
        tag = f"{zlib.crc32(prompt.encode()):08x}"
        if '"Verdict"' in prompt:
            return json.dumps({"ok": int(tag, 16) % 2 == 0})
        if '"Score"' in prompt:
            return json.dumps({"score": int(tag, 16) % 10, "reason": f"r{tag[:4]}"})
        if '"lookup"' in prompt:  # a create_agent agent: look up once, then answer
            if "<|im_start|>tool" not in prompt:
                return '<tool_call>{"name": "lookup", "arguments": {"q": "w' + tag[:4] + '"}}</tool_call>'
            return f"{name} found {tag[:6]}"
        return f"{name} says {tag[:6]}"
    return answer


_POLICIES: dict[str, Any] = {}


def policies() -> dict[str, Any]:
    """The three scripted policies (built once per process: their tiny models take a moment)."""
    if not _POLICIES:
        for i, name in enumerate(POLICY_NAMES):
            _POLICIES[name] = scripted_policy(reply_to(name), seed=i, name=name)
    return _POLICIES


def close_policies() -> None:
    for p in _POLICIES.values():
        p.close()
    _POLICIES.clear()


def describe(app: App) -> str:
    return f"app description: {app!r}"


@dataclass
class Run:
    built: Built
    wiring: Wiring
    episode: Episode
    error: BaseException | None


def instrumented(built: Built, wired: Wiring, store: TraceStore | None) -> Any:
    pols = policies()
    return instrument(built.graph, {a: pols[p] for a, p in wired.policy_of_agent.items()}, agents=wired.agents,
                      store=store)


def answer_interrupts(episode: Episode, interrupts: list) -> Any:
    return {i.id: f"yes to {i.value['site']}" for i in interrupts}


def run_config(thread: str | None = None) -> dict:
    """Every run's config: a thread, and a per-run value prompts may read (`Call.source`)."""
    return {"configurable": {"thread_id": thread or uuid.uuid4().hex, "persona": PERSONA}}


def context(app: App) -> Any:
    return Ctx(user=USER) if app.kind == "graph" else None


def roll(app: App, built: Built, wired: Wiring, store: TraceStore | None, seed: int,
         max_llm_calls: int | None = None) -> Run:
    """One instrumented run of the built app by its run method (`App.run`; `rollout` answers interrupts), as
    the issue's user would run it; `max_llm_calls` caps a rollout's calls (truncated at the call past the cap)."""
    network.ATTEMPTS.clear()
    if app.run != "rollout":
        return _roll_by_method(app, built, wired, store)
    try:
        episode = instrumented(built, wired, store).rollout(
            {"topic": "cats"}, run_config(), metadata={"seed": seed, "max_llm_calls": max_llm_calls},
            resume=answer_interrupts, context=context(app))
        return Run(built, wired, episode, None)
    except RolloutError as exc:
        return Run(built, wired, exc.episode, exc)


def _roll_by_method(app: App, built: Built, wired: Wiring, store: TraceStore | None) -> Run:
    """The run by invoke / ainvoke / stream / astream / astream_events / batch: its episode is the one the
    store holds afterwards (the methods return the graph's output, not an episode)."""
    import asyncio

    own = store is None
    if own:
        store = TraceStore(fresh_dir() / "traces.db")
    before = {s.id for s in store.episodes()}
    app_ = instrumented(built, wired, store)
    x, config, kwargs = {"topic": "cats"}, run_config(), {"context": context(app)}

    async def drain(stream: Any) -> None:
        async for _ in stream:
            pass
    error = None
    try:
        if app.run == "invoke":
            app_.invoke(x, config, **kwargs)
        elif app.run == "ainvoke":
            asyncio.run(app_.ainvoke(x, config, **kwargs))
        elif app.run == "stream":
            list(app_.stream(x, config, stream_mode="updates", **kwargs))
        elif app.run == "astream":
            asyncio.run(drain(app_.astream(x, config, stream_mode=["updates", "values"], **kwargs)))
        elif app.run == "astream_events":
            asyncio.run(drain(app_.astream_events(x, config, version="v2", **kwargs)))
        else:
            app_.batch([x], [config], **kwargs)
    except Exception as exc:  # noqa: BLE001 - checked below: attribution asserts no error
        error = exc
    (new,) = [s.id for s in store.episodes() if s.id not in before]
    episode = store.load_episode(new)
    if own:
        store.close()
    return Run(built, wired, episode, error)


def site_of(turn: Any) -> str:
    found = SITE.match(str(turn.messages[0].content)) if turn.messages else None
    assert found, f"a call no site of the app made: {turn.messages!r}"
    return found.group(1)


def check_attribution(app: App, run: Run) -> None:
    """Every call is served by the policy of the agent its node path or name maps to; never the app's model."""
    got = [(t.index, t.node, t.agent, t.agent_name, t.policy, t.trainable, t.response_text[:40])
           for t in run.episode.turns]
    note(f"turns (index, node, agent, agent_name, policy, trainable, reply): {got}")
    wrong = []
    for turn in run.episode.turns:
        want = run.wiring.sites[site_of(turn)]
        if site_of(turn) in run.wiring.voters and turn.agent in run.wiring.voters[site_of(turn)]:
            want = dataclasses.replace(want, agent=turn.agent)  # either voter; each once (below)
        seen = Expect(turn.node, turn.agent, turn.policy if turn.trainable else "the app's own model",
                      turn.agent_name if want.agent_name else None)
        if seen != want:
            wrong.append(f"site {site_of(turn)}: expected {want}, got {seen}")
    assert not wrong, "calls attributed to the wrong agent:\n" + "\n".join(wrong) + f"\n{describe(app)}"
    assert run.built.model.calls == 0, (f"the app's own model was called {run.built.model.calls} time(s) although "
                                        f"every agent has a policy\n{describe(app)}")
    check_no_network(app)
    assert run.error is None, f"the rollout failed: {run.episode.error}\n{describe(app)}"
    assert run.episode.turns, f"no LLM call recorded\n{describe(app)}"
    for site, agents in run.wiring.voters.items():  # every node instance (a fan's worker) asks each voter once
        for key in {t.call_key for t in run.episode.turns if site_of(t) == site}:
            voted = sorted(t.agent for t in run.episode.turns if site_of(t) == site and t.call_key == key)
            assert voted == sorted(agents), f"site {site} ({key}): calls by {voted}, want one each by {agents}\n{describe(app)}"


def check_no_network(app: App) -> None:
    """Nothing tried to reach the network (`network.guarded`): every client's call was served in the process
    (the local endpoint's connect is the one allowed)."""
    assert not network.ATTEMPTS, (f"{len(network.ATTEMPTS)} request(s) tried to leave the process: "
                                  f"{network.ATTEMPTS[:3]}\n{describe(app)}")


def identities(episode: Episode) -> list[tuple]:
    """Each call as (prompt, call key, seed, agent, node), in a timing-independent order. `node_call_index` is
    left out: it is the arrival order among a node instance's calls, so concurrent calls of one node (`.batch`,
    a thread pool) swap it under other timings; seeds and replay's matching do not depend on it."""
    return sorted((_prompt(t), t.call_key, t.sampling.seed if t.sampling else None, t.agent, t.node)
                  for t in episode.turns)


def _prompt(turn: Any) -> str:
    return "\n".join(f"{m.type}: {m.content}" for m in turn.messages)


def check_same_under_other_timing(app: App, first: Run, second: Run) -> None:
    a, b = identities(first.episode), identities(second.episode)
    diff = [f"- {x}" for x in a if x not in b] + [f"+ {x}" for x in b if x not in a]
    assert a == b, ("call keys / seeds differ between two runs of the same app with other timings "
                    "(- first run, + second run):\n" + "\n".join(diff) + f"\n{describe(app)}")
    assert comparable(first.episode.final_state) == comparable(second.episode.final_state), (
        f"final states differ under other timings\n{describe(app)}")


def check_store_round_trip(app: App, store: TraceStore, episode: Episode) -> None:
    loaded = store.load_episode(episode.id)
    for field in dataclasses.fields(episode.turns[0]):
        for i, (mine, theirs) in enumerate(zip(episode.turns, loaded.turns)):
            x, y = getattr(mine, field.name), getattr(theirs, field.name)
            if field.name == "messages":
                x, y = [m.model_dump() for m in x], [m.model_dump() for m in y]
            assert x == y, f"turn {i}: field {field.name} changed in the store: {x!r} -> {y!r}\n{describe(app)}"
    assert len(loaded.turns) == len(episode.turns), f"the store lost turns\n{describe(app)}"
    assert [dataclasses.astuple(s)[:1] + (comparable(s.interrupts),) for s in loaded.segments] == [
        dataclasses.astuple(s)[:1] + (comparable(s.interrupts),) for s in episode.segments], (
        f"segments changed in the store\n{describe(app)}")
    assert _stored_as(comparable(episode.final_state), comparable(loaded.final_state)), (
        f"final state changed in the store: {loaded.final_state!r} vs {episode.final_state!r}\n{describe(app)}")


def _stored_as(live: Any, stored: Any) -> bool:
    """`stored` is `live` as JSON keeps it: a set as a list in any order, an Enum as its value (what the store
    writes, by design; replay must compare in that form: rev4_n)."""
    if isinstance(live, (set, frozenset)):
        return isinstance(stored, list) and len(stored) == len(live) and set(stored) == live
    if isinstance(live, enum.Enum):
        return stored == live.value
    if isinstance(live, dict):
        return isinstance(stored, dict) and live.keys() == stored.keys() and all(
            _stored_as(v, stored[k]) for k, v in live.items())
    if isinstance(live, (list, tuple)):
        return isinstance(stored, list) and len(live) == len(stored) and all(map(_stored_as, live, stored))
    return live == stored


def check_clean_replay(app: App, result: ReplayResult) -> None:
    check_no_network(app)
    assert not result.divergences, (f"replay of the unchanged app reports {result.divergences[0]}\n"
                                    f"{describe(app)}")
    assert result.state_matches, (f"replay of the unchanged app: final state differs\n{result.state_diff}\n"
                                  f"{describe(app)}")
    assert not result.stopped and result.unreproducible is None, f"replay stopped: {result}\n{describe(app)}"


def check_truncated(app: App, run: Run, cap: int, n_calls: int) -> None:
    """An episode capped below its number of calls is truncated by the cap, keeps exactly `cap` calls, and
    every turn's run (`Turn.segment`) is a recorded segment; one capped at its number of calls finishes."""
    episode = run.episode
    if cap >= n_calls:
        assert run.error is None and episode.outcome == "finished", (
            f"capped at {cap} of {n_calls} calls, the episode did not finish: {episode.stop_reason}\n{describe(app)}")
        return
    assert episode.outcome == "truncated" and episode.truncated_by == "max_llm_calls", (
        f"capped at {cap} of {n_calls} calls: outcome {episode.outcome} ({episode.stop_reason})\n{describe(app)}")
    assert len(episode.turns) == cap, f"capped at {cap}: {len(episode.turns)} turns kept\n{describe(app)}"
    runs = max(len(episode.segments), 1)
    assert all(t.segment < runs for t in episode.turns), (
        f"a turn points past the recorded runs: {[t.segment for t in episode.turns]} of {runs}\n{describe(app)}")


def check_truncated_replay(app: App, result: ReplayResult, truncated: bool) -> None:
    """The unchanged app replays a capped recording without divergence and stops where the cap stopped it."""
    check_no_network(app)
    assert not result.divergences, (f"replay of the unchanged, capped app reports {result.divergences[0]}\n"
                                    f"{describe(app)}")
    assert result.stopped == truncated, f"replay stopped={result.stopped}, truncated={truncated}\n{describe(app)}"
    assert result.state_matches, f"final state differs\n{result.state_diff}\n{describe(app)}"


def recorded(app: App, built: Built, seed: int) -> tuple[Run, TraceStore, Path]:
    """Roll the app out once into a fresh trace store; asserts the rollout itself went right."""
    folder = fresh_dir()
    store = TraceStore(folder / "traces.db")
    run = roll(app, built, wiring(app), store, seed)
    check_attribution(app, run)
    return run, store, folder


def replay_changed(app: App, changed: App, episode: Episode, timing_seed: int) -> ReplayResult:
    note(f"changed app: {changed!r}")
    return replay_episode(build(changed, Timing(timing_seed)).graph, episode, agents=wiring(app).agents)


def replay_stored(app: App, store: TraceStore, episode: Episode, timing_seed: int) -> ReplayResult:
    return replay(build(app, Timing(timing_seed)).graph, store, episode.id, agents=wiring(app).agents)


def check_divergence_at(app: App, result: ReplayResult, site: str, kinds: tuple[str, ...]) -> None:
    check_no_network(app)
    want = wiring(app).sites[site]
    assert result.divergences, (f"site {site} changed, yet replay reports no divergence (state_matches="
                                f"{result.state_matches})\n{describe(app)}")
    first = result.divergences[0]
    agents = wiring(app).voters.get(site) or (want.agent,)  # a vote site: either voter's call comes first
    assert first.kind in kinds and first.node == want.path and first.agent in agents, (
        f"site {site} changed: expected a {' or '.join(kinds)} divergence at node {want.path!r} (agent "
        f"{want.agent!r}), got {first}\n{describe(app)}")


def check_changed_reply(app: App, result: ReplayResult) -> None:
    """A changed recorded reply shows where it flows: in the first divergence's prompt, else the final state.
    In an app with a conditional branch the reply also picks the branch (`_router` hashes it), so the first
    divergence may be the other branch's run: a call the recording lacks, one it has that is not made, or an
    interrupt it did not stop at. Replay sends nothing (`check_no_network`)."""
    check_no_network(app)
    if result.divergences:
        first = result.divergences[0]
        rerouted = any(step.kind == "branch" for step in app.steps) and first.kind in (
            "unrecorded_call", "missing_call", "interrupt_changed")
        # a nested app's own policy answers live in a replay: the changed reply reaches it, and what it answers
        # then reaches the nesting node's own call, which diverges without the mark
        rerouted = rerouted or any(n.kind == "nested" and n.name == first.node for n in app.nodes())
        assert rerouted or MARK in first.diff, (f"a recorded reply was changed; the first divergence must be a call that reads "
                                    f"it, got {first}\n{describe(app)}")
        return
    assert not result.state_matches and MARK in result.state_diff, (
        f"a recorded reply was changed, yet replay reports no divergence and state_matches="
        f"{result.state_matches}\n{describe(app)}")


def with_reply(episode: Episode, index: int, policy: Any) -> Episode:
    """The episode with turn `index`'s reply replaced by a marked one (ids re-tokenized)."""
    turns = list(episode.turns)
    text = f"{MARK} {turns[index].response_text}"
    turns[index] = dataclasses.replace(turns[index], response_text=text,
                                       response_ids=tuple(policy.tokenizer.encode(text, add_special_tokens=False)))
    return dataclasses.replace(episode, turns=turns)


def sites_called(episode: Episode, kinds: tuple[str, ...], app: App) -> list[str]:
    by_site = {c.site: c for c in app.calls()}
    return sorted({site_of(t) for t in episode.turns if by_site[site_of(t)].kind in kinds},
                  key=lambda s: int(s[1:]))
