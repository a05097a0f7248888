"""Free-running asynchronous training (`async.schedule: free`, `drmas_graph.train.loop._pipeline.FreeRunning`): step s
starts once the rollout weights are at most `max_staleness` versions behind it, every update's weights reach the
rollouts at once (episodes in flight sample their next call with them), groups stay whole, staleness stays within
the bound, a killed run resumes without losing or repeating a group, and served policies get pushes while other
steps' episodes are in flight (SGLang protocol double)."""

import json
import threading
import time

import pytest
import torch
from langgraph.graph import END, START, StateGraph

from drmas_graph.config import TrainConfig
from drmas_graph.testing import tiny_policy
from drmas_graph.traces.store import TraceStore
from drmas_graph.train.loop import _pipeline
from drmas_graph.train.loop.trainer import Trainer
from tests._envs import ParityEnv
from tests._graphs import QA
from tests.sglang_double import SGLangDouble
from tests.test_async_train import NO_EVAL, Killed, kill_after_checkpoint, run_async
from tests.test_instrument import Unreachable
from tests.test_trainer import _sampled, params
from tests.test_trainer_served import ckpt, served_config  # noqa: F401 - the fixture

FREE = {"max_staleness": 2, "schedule": "free"}


def gated_graph(gate):
    """solver -> gate (plain Python: `gate(state)` may block) -> verifier."""
    from langchain_core.messages import HumanMessage, SystemMessage

    llm = Unreachable()

    def solver(state):
        return {"answer": llm.invoke([SystemMessage("Solve it."), HumanMessage(state["question"])]).content}

    def wait(state):
        gate(state)
        return {}

    def verifier(state):
        msgs = [SystemMessage("Check it."), HumanMessage(f"{state['question']} -> {state['answer']}")]
        return {"verdict": llm.invoke(msgs).content}

    g = StateGraph(QA)
    for name, fn in (("solver", solver), ("gate", wait), ("verifier", verifier)):
        g.add_node(name, fn)
    g.add_edge(START, "solver")
    g.add_edge("solver", "gate")
    g.add_edge("gate", "verifier")
    g.add_edge("verifier", END)
    return g.compile()


class HoldStepOne:
    """The gate of `gated_graph` for step 1 (tasks distinct from every other step's: `ParityEnv(n_train=10)`):
    step 1's episodes sample their solver call, then wait in the gate until the rollouts hold v1, and update 0
    starts only when all of them have made that call. So whatever the timing, step 1's solver calls are sampled
    by v0 and its verifier calls by v1 (update 1 needs step 1 done: never v2)."""

    def __init__(self, episodes: int = 8, timeout_s: float = 300.0) -> None:
        self.episodes, self.timeout_s = episodes, timeout_s
        self.arrived, self.lock, self.all_arrived = 0, threading.Lock(), threading.Event()

    def attach(self, trainer) -> None:
        self.trainer = trainer
        tasks = {s: {t.input["question"] for t in trainer.batch_tasks(s)} for s in range(trainer.state.cfg.steps)}
        self.questions = tasks[1]
        assert all(not (self.questions & q) for s, q in tasks.items() if s != 1)
        learn = trainer.pipeline.learn  # the step functions the pipeline drives

        def learn_after_step_one_sampled(batch, **kwargs):
            if batch.step == 0:
                assert self.all_arrived.wait(timeout=self.timeout_s), "step 1's episodes never reached the gate"
            return learn(batch, **kwargs)

        trainer.pipeline.learn = learn_after_step_one_sampled

    def __call__(self, state) -> None:
        if state["question"] not in self.questions:
            return
        with self.lock:
            self.arrived += 1
            if self.arrived == self.episodes:
                self.all_arrived.set()
        deadline = time.monotonic() + self.timeout_s
        while self.trainer.pipeline.serving_version < 1 and time.monotonic() < deadline:
            time.sleep(0.01)


def run_free(tmp_path, run_dir, *, steps=4, async_=FREE, **kw):
    """`run_async` on the free schedule; returns (result, trainer weights, trainer)."""
    result, trained, _, trainer = run_async(tmp_path, run_dir, steps=steps, **{"async": async_}, **kw)
    return result, trained, trainer


def turn_versions(run_dir, step):
    """The weights version of each turn of each episode of `step`, as (solver's, verifier's) pairs."""
    with TraceStore(run_dir / "traces.db", readonly=True) as store:
        return [tuple(t.policy_version for t in store.load_episode(ref.id).turns) for ref in store.episodes(step=step)]


def test_steps_start_up_to_max_staleness_ahead_and_staleness_stays_within_it(tmp_path):
    """Step s starts when the rollout weights are v(s - 2) or newer: steps 0, 1 and 2 at once. Step 0's rollouts
    wait here until step 2's have started: one step off (or a synchronous loop) never gets there."""
    started: dict[int, tuple[int, float]] = {}
    step2 = threading.Event()
    waited = []

    def hook(trainer):
        collect = trainer.pipeline.collect

        def observed(step):
            started[step] = (trainer.pipeline.serving_version, time.perf_counter())
            if step == 2:
                step2.set()
            if step == 0:
                waited.append(step2.wait(timeout=120))
            return collect(step)

        trainer.pipeline.collect = observed

    initial = params(tiny_policy(seed=0))
    result, trained, trainer = run_free(tmp_path, "free", steps=5, hook=hook)
    assert isinstance(trainer.pipeline, _pipeline.FreeRunning) and waited == [True]
    assert sorted(started) == [0, 1, 2, 3, 4]
    assert all(version >= step - 2 for step, (version, _) in started.items())  # never more than 2 behind
    assert started[3][0] >= 1 and started[4][0] >= 2
    assert sum(not torch.equal(v, initial[k]) for k, v in trained.items()) > 0.5 * len(initial)
    h = result.history
    assert [r["step"] for r in h] == [0, 1, 2, 3, 4]
    assert all(0 <= r["async/staleness_max"] <= 2 for r in h) and h[0]["async/staleness_max"] == 0
    assert all(r["async/dropped_groups"] == 0 and r["async/dropped_samples"] == 0 for r in h)
    assert h[0]["async/steps_in_flight"] == 2  # steps 1 and 2 roll out while update 0 trains
    for step in range(5):
        versions = turn_versions(tmp_path / "free", step)
        assert len(versions) == 8 and all(len(v) == 2 for v in versions)  # whole groups: 2 x 4 episodes
        assert all(max(0, step - 2) <= v <= step for pair in versions for v in pair), (step, versions)
        assert all(pair[0] <= pair[1] for pair in versions)  # an episode's later call never has older weights


def test_new_weights_reach_episodes_in_flight(tmp_path):
    """Step 1 starts on v0. Its episodes sample the solver's call, then wait in the gate node until update 0's
    weights are installed: their verifier call is sampled by v1, within the same episode, and trains with
    staleness 0 (no importance weight) while the solver's call trains 1 update stale (with one)."""
    gate = HoldStepOne()
    result, _, _ = run_free(tmp_path, "gated", steps=3, app=gated_graph(gate), hook=gate.attach, n_train=10)
    assert sorted(set(turn_versions(tmp_path / "gated", 1))) == [(0, 1)]
    h1 = result.history[1]
    assert h1["agent/solver/staleness_max"] == 1 and h1["agent/verifier/staleness_max"] == 0
    assert "agent/solver/is_weight_mean" in h1 and "agent/verifier/is_weight_mean" not in h1


def test_kill_and_resume_trains_every_group_once(tmp_path):
    with pytest.raises(Killed):  # checkpoint 2 is saved after update 1, while steps 2..3 roll out
        run_free(tmp_path, "b", steps=4, checkpoint_every=1, hook=kill_after_checkpoint(2))
    state = json.loads((tmp_path / "b" / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["serving_version"] == 2  # installed at once: the rollouts held v2 too
    resumed, _, _ = run_free(tmp_path, "b", steps=4, checkpoint_every=1, resume=True)
    assert [r["step"] for r in resumed.history] == [2, 3]
    assert all(r["async/staleness_max"] <= 2 for r in resumed.history)
    assert resumed.history[0]["async/staleness_max"] == 0  # step 2 rolled out again, on the checkpoint's v2
    with TraceStore(tmp_path / "b" / "traces.db", readonly=True) as store:
        for step in range(4):  # each step's groups trained once
            assert len(_sampled(store, step)) == 16, step


def test_max_concurrency_bounds_the_episodes_of_every_step_in_flight(tmp_path):
    """Steps 0, 1 and 2 roll out at once, but no more than `max_concurrency` episodes run at once over all of
    them (one bound per process, as in the synchronous loop: `EpisodeSlots`), and the bound is used."""
    lock, inside = threading.Lock(), {"now": 0, "most": 0}

    def api(state):
        with lock:
            inside["now"] += 1
            inside["most"] = max(inside["most"], inside["now"])
        time.sleep(0.2)
        with lock:
            inside["now"] -= 1

    result, _, trainer = run_free(tmp_path, "bounded", steps=3, conc=3, app=gated_graph(api))
    assert inside["most"] == 3  # a bound per step would let up to 3 steps x 3 episodes in
    assert len(result.history) == 3 and trainer.state.episode_slots.free == 3
    assert [h["async/dropped_groups"] for h in result.history] == [0, 0, 0]


def test_a_later_step_never_takes_the_slots_the_next_step_needs(tmp_path):
    """max_concurrency 8 is one step's episodes, and step 0's thread starts 0.5 s after the others: step 1's
    episodes, which hold their slots until v1 (they wait for it in the gate), still let every episode of step 0
    take a slot first (the pipeline announced the steps in order). First come, first served would give step 1
    all 8 slots, and update 0 would wait for step 0 forever."""
    gate = HoldStepOne(timeout_s=60)

    def hook(trainer):
        gate.attach(trainer)
        collect = trainer.pipeline.collect

        def late(step):
            if step == 0:
                time.sleep(0.5)
            return collect(step)

        trainer.pipeline.collect = late

    result, _, _ = run_free(tmp_path, "late", steps=3, conc=8, app=gated_graph(gate), hook=hook, n_train=10)
    assert sorted(set(turn_versions(tmp_path / "late", 1))) == [(0, 1)] and len(result.history) == 3


def test_free_schedule_needs_a_staleness_bound():
    with pytest.raises(ValueError, match=r"async.schedule=free needs async.max_staleness >= 1"):
        TrainConfig.model_validate({"async": {"schedule": "free"}})
    with pytest.raises(ValueError, match=r"async.schedule"):
        TrainConfig.model_validate({"async": {"max_staleness": 1, "schedule": "eager"}})
    assert TrainConfig.model_validate({"async": FREE}).model_dump()["async"]["schedule"] == "free"


def test_served_policy_gets_pushes_while_other_steps_roll_out(tmp_path, ckpt):  # noqa: F811
    """Steps 0..2 start on v0; each update's weights are pushed at once (SGLang: pause, load, continue), and the
    episodes in flight sample their next call from the server's new weights."""
    double = SGLangDouble(ckpt, weight_version="0").start()
    gate = HoldStepOne()  # step 1's episodes wait after the solver's call until v1 is on the server
    cfg = served_config(tmp_path, ckpt, {"engine": "sglang", "urls": [double.url]}, steps=3, eval=NO_EVAL,
                        **{"async": FREE})
    trainer = Trainer(gated_graph(gate), ParityEnv(n_train=10), cfg)
    gate.attach(trainer)
    try:
        result = trainer.run()
        local = {k: v.clone() for k, v in trainer.state.models["m"].trained.state_dict().items()}
    finally:
        trainer.close()
        double.stop()
    pushed = [b["weight_version"] for p, b in double.requests if p == "POST /update_weights_from_disk"]
    assert pushed == ["1", "2", "3"]  # one per update, as soon as it is done
    assert [p for p, _ in double.requests].count("POST /pause_generation") == 3
    assert sorted(set(turn_versions(tmp_path / "run", 1))) == [(0, 1)]
    assert all(r["async/staleness_max"] <= 2 and r["async/dropped_groups"] == 0 for r in result.history)
    assert all(torch.equal(v, double.model.state_dict()[k]) for k, v in local.items())




def test_a_run_that_dies_stops_and_joins_its_rollout_threads_before_it_closes_the_store(tmp_path):
    """Killed after checkpoint 2 once step 3's episodes wait in the gate (for up to 60 s): when `run()` raises,
    no rollout thread of the run is left (step 3's episodes were cancelled, its thread joined) and the store is
    closed after it; later, nothing writes to it (the node left behind in the gate only returns)."""
    released, arrived = threading.Event(), threading.Event()
    step3: set[str] = set()

    def gate(state):
        if state["question"] in step3:
            arrived.set()
            released.wait(timeout=60)

    def attach(trainer):  # 10 tasks, 2 a step: step 3's are no other step's
        step3.update(t.input["question"] for t in trainer.batch_tasks(3))
        save = trainer.save_checkpoint

        def save_then_die(done):
            path = save(done)
            if done == 2:  # steps 2 and 3 roll out
                assert arrived.wait(timeout=60), "step 3's episodes never reached the gate"
                raise Killed
            return path

        trainer.save_checkpoint = save_then_die

    before = set(threading.enumerate())
    try:
        with pytest.raises(Killed):
            run_free(tmp_path, "k", steps=4, checkpoint_every=1, app=gated_graph(gate), hook=attach, n_train=10)
        left = [t.name for t in threading.enumerate() if t not in before and t.name.startswith("rollouts-step-")]
        assert left == []
    finally:
        released.set()
