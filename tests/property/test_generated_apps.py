"""Property-based tests (issue 28): generated LangGraph apps, instrumented, keep the library's guarantees.

Hypothesis draws an app from the grammar in `apps.py` (sequential and conditional nodes, `Send` fan-out,
subgraphs as nodes and invoked inside nodes, create_agent tool loops, Functional API tasks, interrupts,
structured output, several agents and policies) and timings; `invariants.py` says what must hold. A failure
prints the app description (Hypothesis shrinks it first). Profiles: tests/conftest.py ('ci' by default,
`--hypothesis-profile=long` for a long hunt).
"""

import dataclasses

import pytest
from hypothesis import assume, given, note, settings
from hypothesis import strategies as st

from drmas_graph import TraceStore
from drmas_graph.traces.replay import replay
from tests.property import invariants as inv
from tests.property import network, threads
from tests.property.apps import KNOWN_DEFECTS, Timing, apps, timings
from tests.property.invariants import build
from tests.property.scratch import fresh_dir

pytestmark = [pytest.mark.property,  # an agent on a branch the run did not take made no call: expected here
              pytest.mark.filterwarnings("ignore:agents.*matched no LLM call in the first episode"),
              pytest.mark.filterwarnings(r"ignore:.*agent\(s\).*made no LLM call in the first episode")]
seeds = st.integers(0, 2**20)


@pytest.fixture(scope="module", autouse=True)
def _policies():
    yield inv.policies()
    inv.close_policies()


@pytest.fixture(scope="module", autouse=True)
def _no_network():
    """Every connect but the local endpoint's is refused and counted (`network.guarded`; the invariants check the
    count), with placeholder API keys and the SDKs' default base URLs."""
    keys = {"OPENAI_API_KEY": "sk-never-sent", "ANTHROPIC_API_KEY": "sk-ant-never-sent"}
    with pytest.MonkeyPatch.context() as env, network.guarded():
        for name, value in keys.items():
            env.setenv(name, value)
        for name in ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL"):
            env.delenv(name, raising=False)
        yield


@given(app=apps(), timing=st.tuples(timings, timings, timings), seed=seeds)
def test_generated_apps_are_attributed_reproducible_stored_and_replayed(app, timing, seed):
    note(inv.describe(app))
    built = build(app, Timing(timing[0]))
    first, store, _ = inv.recorded(app, built, seed)
    with store:
        built.timing.seed = timing[1]
        second = inv.roll(app, built, first.wiring, None, seed)
        inv.check_attribution(app, second)
        inv.check_same_under_other_timing(app, first, second)
        inv.check_store_round_trip(app, store, first.episode)
        inv.check_clean_replay(app, inv.replay_stored(app, store, first.episode, timing[2]))


@given(app=apps(), data=st.data(), seed=seeds)
def test_a_changed_prompt_is_reported_at_its_call(app, data, seed):
    note(inv.describe(app))
    first, store, _ = inv.recorded(app, build(app), seed)
    store.close()
    site = data.draw(st.sampled_from(inv.sites_called(first.episode, ("llm", "structured", "interrupt", "agent"),
                                                      app)), label="changed site")
    changed = app.with_call(site, prompt="Answer at length.")
    result = inv.replay_changed(app, changed, first.episode, data.draw(timings, label="replay timing"))
    inv.check_divergence_at(app, result, site, ("prompt_changed",))


@given(app=apps(need="llm"), data=st.data(), seed=seeds)
def test_a_changed_reply_is_reported_where_it_flows(app, data, seed):
    note(inv.describe(app))
    assume(not KNOWN_DEFECTS["new_interrupt"] or all(c.kind != "interrupt" for c in app.calls()))
    first, store, _ = inv.recorded(app, build(app), seed)
    store.close()
    flaky = {c.site for n in app.nodes() if n.retry for c in n.calls}  # a failed attempt's reply flows nowhere
    plain = [s for s in inv.sites_called(first.episode, ("llm", "interrupt"), app) if s not in flaky]
    if not plain:  # its only plain call site sits on a branch this run did not take
        return
    index = data.draw(st.sampled_from([t.index for t in first.episode.turns if inv.site_of(t) in plain]),
                      label="changed turn")
    episode = inv.with_reply(first.episode, index, inv.policies()[first.episode.turns[index].policy])
    result = inv.replay_changed(app, app, episode, data.draw(timings, label="replay timing"))
    inv.check_changed_reply(app, result)


@pytest.mark.xfail(KNOWN_DEFECTS["rev4_s"], strict=True,
                   reason="rev4_s: replay does not compare a call's structured-output request with the recording")
@given(app=apps(need="structured"), data=st.data(), seed=seeds)
def test_a_changed_schema_is_reported_at_its_call(app, data, seed):
    note(inv.describe(app))
    first, store, _ = inv.recorded(app, build(app), seed)
    store.close()
    verdicts = [s for s in inv.sites_called(first.episode, ("structured",), app)
                if next(c for c in app.calls() if c.site == s).schema == "Verdict"]
    if not verdicts:
        return
    site = data.draw(st.sampled_from(verdicts), label="changed site")
    result = inv.replay_changed(app, app.with_call(site, schema="Verdict+reason"), first.episode,
                                data.draw(timings, label="replay timing"))
    inv.check_divergence_at(app, result, site, ("format_changed", "tools_changed"))


@given(app=apps(need="llm"), data=st.data(), seed=seeds)
def test_a_capped_episode_is_truncated_stored_and_replays_to_the_cap(app, data, seed):
    """rev4_m and rev4_o as properties: a `max_llm_calls` cap stops the episode at any call (in a later run of
    an interrupted thread, among parallel branches); the store keeps every run, and replay under other timing
    reports no divergence and stops where the cap stopped the recording."""
    app = dataclasses.replace(app, run="rollout")  # max_llm_calls is a rollout's
    note(inv.describe(app))
    full, store, _ = inv.recorded(app, build(app), seed)
    store.close()
    n_calls = len(full.episode.turns)
    cap = data.draw(st.integers(1, n_calls), label="max_llm_calls")
    built = build(app, Timing(data.draw(timings, label="recording timing")))
    with TraceStore(fresh_dir() / "traces.db") as store:
        run = inv.roll(app, built, full.wiring, store, seed, max_llm_calls=cap)
        inv.check_truncated(app, run, cap, n_calls)
        inv.check_store_round_trip(app, store, run.episode)
        result = inv.replay_stored(app, store, run.episode, data.draw(timings, label="replay timing"))
    inv.check_truncated_replay(app, result, cap < n_calls)


@settings(max_examples=max(10, settings().max_examples // 4))  # ci: 10 (several rollouts and replays each)
@given(app=apps(), seed=seeds)
def test_a_thread_continued_by_later_rollouts_replays_each_of_them(app, seed):
    """rev5_b and rev5_g as properties: a paused thread resumed by a second rollout (else its next input), with
    sub-agents that remember across episodes, then a rollout from an older checkpoint; every episode replays."""
    assume(app.kind == "graph" and app.checkpointer == "memory")
    note(inv.describe(app))
    built = build(app)
    with TraceStore(fresh_dir() / "traces.db") as store:
        episodes = threads.continue_thread(app, built, store, seed)
        assert built.model.calls == 0, f"the app's own model answered {built.model.calls} call(s)\n{inv.describe(app)}"
        for k, episode in enumerate(episodes):
            if episode.error or not episode.turns:  # the paused first run: its replay is the suite's other tests'
                continue
            result = replay(built.graph, store, episode.id, agents=inv.wiring(app).agents)  # its saver holds the thread
            note(f"episode {k} of the thread: {[t.node for t in episode.turns]}")
            inv.check_clean_replay(app, result)


@settings(max_examples=max(2, settings().max_examples // 20))  # ci: 2 (a process start each); long: 150
@given(app=apps(), seed=seeds, hash_seed=st.integers(1, 2**16))
def test_a_replay_in_another_process_agrees_with_the_replay_in_this_one(app, seed, hash_seed):
    """rev5_e as a property: the stored episode replays the same in a fresh process with another PYTHONHASHSEED
    (the CLI's and the UI's case) as in the recording process."""
    note(inv.describe(app))
    first, store, folder = inv.recorded(app, build(app), seed)
    store.close()
    here = inv.replay_stored(app, folder / "traces.db", first.episode, 0)
    inv.check_clean_replay(app, here)
    there = threads.replay_elsewhere(app, folder / "traces.db", first.episode.id, hash_seed)
    assert there["divergences"] == [] and there["state_matches"], (
        f"replay with PYTHONHASHSEED={hash_seed}: {there['divergences'][:1]}, state_matches "
        f"{there['state_matches']}\n{inv.describe(app)}")
    assert there["state"] == inv.state_text(here.final_state), f"another process replays another state\n{inv.describe(app)}"
