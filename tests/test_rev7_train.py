"""Issue 58 (no silent wrong results, round 7), the training side: what `check` says about model errors, skipped
zero-advantage mini-batches, metrics that were not measured, a resumed run's once-per-run warning, per-agent tool
use, SIGTERM, the state a reward sees of an unfinished episode, and what a checkpoint holds."""

import dataclasses
import logging

import pytest
import torch

from drmas_graph import SamplingParams
from drmas_graph.testing import tiny_policy
from drmas_graph.train.loop.trainer import Trainer
from drmas_graph.train.optim import ModelUpdater
from drmas_graph.types import Sample
from tests.test_cli_train import write_config
from tests.test_trainer import small_config
from tests.test_update import fresh_model, max_diff, rollout, settings, snapshot  # noqa: F401 (a fixture)


# --- item 3: `check` names what applies to model errors ----------------------------------------------------------


def test_check_names_the_model_error_reward_and_the_request_that_failed(tmp_path):
    from graphs.research.env import ResearchEnv
    from graphs.research.graph import build_graph
    from drmas_graph.train import preflight

    agents = ["clarify", "write_brief", "researcher", "report"]
    policies = {a: tiny_policy(seed=i, name=f"tiny-{a}", sampling=SamplingParams(max_new_tokens=4))
                for i, a in enumerate(agents)}
    cfg = small_config(tmp_path, group_size=2, rollout={"model_error_reward": -0.5})
    trainer = Trainer(build_graph(), ResearchEnv(), cfg, policies=policies, train=False)
    try:
        report = preflight(trainer, 1)
    finally:
        trainer.close()
    assert report.counts["model_error_episodes"] == 2  # every broken-JSON reply breaks the app (3 attempts)
    (line,) = [w for w in report.warnings() if "model errors" in w]
    # before: "2 of 2 episodes did not finish (truncated or model errors): see the config's `rollout` limits"
    assert line.startswith(
        "2 of 2 episodes were model errors, the policy's reply broke the app: agent 'clarify' 2 (first: turn 2 (node "
        "'clarify') failed its structured-output request (json_schema 'ClarifyWithUser'): InvalidReplyError: ")
    assert line.endswith("Make the agent's reply what its call asks for (its prompt and format instructions; "
                         "agents.clarify.sampling.max_new_tokens if replies are cut off); they train with "
                         "rollout.model_error_reward (-0.5)")
    assert not [w for w in report.warnings() if "truncated" in w]


def test_check_names_the_limit_that_truncated_the_episodes(tmp_path):
    from graphs.reflection.env import ReflectionEnv
    from graphs.reflection.graph import build_graph
    from drmas_graph.train import preflight
    from tests.test_instrument import Unreachable

    policies = {a: tiny_policy(seed=i, name=f"tiny-{a}", sampling=SamplingParams(max_new_tokens=3))
                for i, a in enumerate(["assistant", "judge"])}
    cfg = small_config(tmp_path, group_size=2, rollout={"max_llm_calls": 3, "truncated_reward": None})
    trainer = Trainer(build_graph(Unreachable()), ReflectionEnv(), cfg, policies=policies, train=False)
    try:
        report = preflight(trainer, 1)
    finally:
        trainer.close()
    (line,) = [w for w in report.warnings() if "truncated" in w]
    assert line == ("2 of 2 episodes were truncated by a limit (2 by rollout.max_llm_calls: 3): raise it if the "
                    "episodes legitimately need more; they train with rollout.truncated_reward (null: env.reward "
                    "scores them)")


# --- item 6: a mini-batch of zero-advantage samples takes no optimizer step ---------------------------------------


@pytest.mark.parametrize("backend", [("torch", 0), ("deepspeed", 1)])
def test_a_zero_advantage_minibatch_moves_no_weight_after_steps_built_momentum(rollout, backend):  # noqa: F811
    if backend[0] == "deepspeed":
        pytest.importorskip("deepspeed")
    model = fresh_model()
    updater = ModelUpdater(model, name="m", settings=settings(backend, n_minibatches=2))
    first = updater.update(rollout)  # AdamW's moments are not 0 now
    assert (first.n_minibatches, first.skipped_minibatches) == (2, 0)
    before = snapshot(model, updater)
    zero = [dataclasses.replace(s, advantage=0.0) for s in rollout]
    metrics = updater.update(zero)
    assert (metrics.n_minibatches, metrics.skipped_minibatches) == (0, 2)
    assert max_diff(before, snapshot(model, updater)) == 0.0  # before: both steps moved every weight (momentum)
    one = [dataclasses.replace(s, advantage=1.0 if i == 0 else 0.0) for i, s in enumerate(rollout)]
    metrics = updater.update(one)  # one mini-batch holds the sample with an advantage, the other none
    assert (metrics.n_minibatches, metrics.skipped_minibatches) == (1, 1)
    assert max_diff(before, snapshot(model, updater)) > 1e-4


def test_skipped_minibatches_are_counted_in_the_step_record(tmp_path):
    from tests._envs import ParityEnv
    from drmas_graph.train.loop.trainer import train_graph
    from tests.test_trainer import graph

    class Constant(ParityEnv):
        def reward(self, task, episode):
            return 1.0  # every group has zero variance: every advantage is 0

    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=3))
    cfg = small_config(tmp_path, steps=1, update={"lr": 1e-3, "backend": "torch", "n_minibatches": 2},
                       eval={"k": 1, "n_tasks": 1, "before_training": False})
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    result = train_graph(graph(), Constant(), cfg, policies={"solver": policy, "verifier": policy})
    (record,) = result.history
    name = policy.name
    assert record[f"model/{name}/n_minibatches"] == 0 and record[f"model/{name}/skipped_minibatches"] == 2
    assert f"model/{name}/grad_norm" not in record and f"model/{name}/loss" not in record  # nothing measured
    assert all(torch.equal(v, before[k]) for k, v in policy.model.state_dict().items())


# --- item 7: no entropy or kl_ref where nothing was measured ------------------------------------------------------


def test_entropy_and_kl_ref_are_absent_for_an_agent_whose_samples_had_no_token():
    s = settings(("torch", 0), entropy_coef=0.01, kl_coef=0.1)
    updater = ModelUpdater(fresh_model(), name="m", settings=s)
    samples = [Sample(prompt_ids=(1, 2, 3), response_ids=(5, 6), old_logprobs=(-1.0, -1.0), advantage=1.0,
                      agent="a"),
               Sample(prompt_ids=(1, 2, 3), response_ids=(), old_logprobs=(), advantage=1.0, agent="b")]
    logged = updater.update(samples).to_dict()
    assert {"agent/a/entropy", "agent/a/kl_ref", "agent/a/ratio_max", "agent/a/pg_loss"} <= set(logged)
    # before: agent/b/entropy, kl_ref, ratio_max, pg_loss, clip_frac, ... each logged as 0.0
    assert sorted(k for k in logged if k.startswith("agent/b/")) == ["agent/b/grad_norm", "agent/b/n_samples"]


# --- item 8: a resumed run warns about success_threshold once ---------------------------------------------------


def test_a_run_resumed_after_the_threshold_warning_does_not_warn_again(tmp_path, caplog):
    from drmas_graph.cli import main

    # per agent: every team reward is 0.5 < success_threshold 1; Ctrl-C at step 1's first reward, after the
    # evaluation that followed step 0's checkpoint warned
    cfg = write_config(tmp_path, env="tests.test_first_hour:InterruptedEnv", checkpoint_every=1, steps=3,
                       env_kwargs={"n_train": 4, "n_test": 2, "interrupt_at": 5, "per_agent": True},
                       eval={"k": 1, "n_tasks": 1, "before_training": False, "every": 1})

    def warnings():
        out = [r.getMessage() for r in caplog.records if "success_threshold" in r.getMessage()]
        caplog.clear()
        return out

    with caplog.at_level(logging.WARNING, logger="drmas_graph.train.loop.evaluate"):
        assert main(["train", str(cfg)]) == 130
        (warning,) = warnings()
        assert warning.startswith("success_threshold 1 is above every team reward of the evaluation at step 1 ")
        assert main(["train", str(cfg), "--resume", "--set", "env_kwargs.interrupt_at=0"]) == 0
        assert warnings() == []  # before: the same warning again at the resumed run's first evaluation


# --- item 4: per-agent tool use ---------------------------------------------------------------------------------


def _turn(agent, tools=(), tool_calls=(), format_error=None, response_format=None):
    from drmas_graph.types import Turn

    return Turn(agent=agent, node=agent, step=1, index=0, messages=(), prompt_ids=(1,), response_ids=(2,),
                response_logprobs=(-1.0,), response_text="x", tools=tools, tool_calls=tool_calls,
                format_error=format_error, response_format=response_format)


def test_tool_use_counts_parsed_calls_and_well_formed_turns():
    from drmas_graph.train.loop._scoring import tool_use

    add = ({"type": "function", "function": {"name": "add"}},)
    call = {"name": "add", "args": {"a": 1}, "id": "c1", "type": "tool_call"}
    turns = [_turn("a", add, (call, call)),  # two calls, both parse
             _turn("a", add, (call,), format_error="1 tool call(s) in the reply do not parse: ..."),  # one of two
             _turn("a", add),  # tools bound, a plain answer: no attempt
             _turn("a", add, format_error="the call forces a call of tool 'add', but ...",
                   response_format={"type": "tool", "name": "add"}),  # a forced call that failed
             _turn("a", add, format_error="not the JSON asked for", response_format={"type": "json_object"}),
             _turn("a")]  # no tools bound: not counted
    # per turn with tools: (2 + 1 + 0 + 0 + 0) / 5; attempted: the first, second and fourth, well formed: the first
    assert tool_use("a", turns) == {"agent/a/tool_calls_per_turn": 0.6, "agent/a/tool_calls_well_formed": 1 / 3}
    assert tool_use("a", [_turn("a", add)]) == {"agent/a/tool_calls_per_turn": 0.0}  # no attempt: no share
    assert tool_use("a", [_turn("a")]) == {}  # no turn with tools: nothing measured


def tool_graph(llm):
    """A `caller` node that asks its model with the tool `add` bound, then a `writer` without tools."""
    from typing import TypedDict

    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langgraph.graph import END, START, StateGraph

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    class S(TypedDict, total=False):
        question: str
        answer: str

    def caller(state):
        return {"answer": llm.bind_tools([add]).invoke([HumanMessage("Use the tool: " + state["question"])]).text}

    def writer(state):
        return {"answer": llm.invoke([HumanMessage("Write it down.")]).text}

    return (StateGraph(S).add_node("caller", caller).add_node("writer", writer).add_edge(START, "caller")
            .add_edge("caller", "writer").add_edge("writer", END).compile())


def test_tool_metrics_are_logged_per_agent_and_summarised(tmp_path):
    import json

    from drmas_graph.testing import scripted_policy
    from drmas_graph.train.loop.trainer import train_graph
    from tests._envs import ParityEnv
    from tests.test_instrument import Unreachable

    both = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>' * 2
    broken = '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
    caller = iter([both, broken, "No tool needed."] * 10)  # each step's 3 calls get one of each, in some order

    class Env(ParityEnv):
        def reward(self, task, episode):
            return 1.0

    def reply(prompt):
        return next(caller) if "Use the tool" in prompt else "done"

    policy = scripted_policy(reply)
    cfg = small_config(tmp_path, steps=2, tasks_per_step=1, group_size=3, max_concurrency=1,
                       eval={"k": 1, "n_tasks": 1, "before_training": False})
    result = train_graph(tool_graph(Unreachable()), Env(), cfg, policies={"caller": policy, "writer": policy})
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for record in (line for line in lines if "episodes" in line):
        assert record["agent/caller/tool_calls_per_turn"] == pytest.approx(2 / 3)  # (2 + 0 + 0) calls / 3 turns
        assert record["agent/caller/tool_calls_well_formed"] == 0.5  # of the 2 that attempted, 1 parsed
        assert not [k for k in record if k.startswith("agent/writer/tool_calls")]  # no tools bound: absent
    summary = result.summary().splitlines()
    assert "  tool calls/turn caller           0.667       0.667" in summary
    assert "  well-formed calls caller         0.500       0.500" in summary


# --- item 2: SIGTERM stops training as Ctrl-C does, and says so -------------------------------------------------


class BlockingEnv:
    """`tests._envs.ParityEnv` whose training reward number `block_at` (1-based; 0: never) writes the file `ready`
    and then waits (sleeps) for the signal that stops the run."""

    def __init__(self, block_at=0, ready="", **kwargs):
        from tests._envs import ParityEnv

        self.env, self.block_at, self.ready, self.calls = ParityEnv(**kwargs), block_at, ready, 0
        self.invalid_penalty = self.env.invalid_penalty

    def tasks(self, split):
        return self.env.tasks(split)

    def turn_is_valid(self, task, turn):
        return self.env.turn_is_valid(task, turn)

    def reward(self, task, episode):
        import time
        from pathlib import Path

        if task.id.startswith("train"):
            self.calls += 1
            if self.calls == self.block_at:
                Path(self.ready).write_text("scoring")
                time.sleep(120)  # SIGTERM arrives here
        return self.env.reward(task, episode)


def test_sigterm_says_what_was_saved_and_the_run_resumes_to_the_uninterrupted_weights(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from drmas_graph.cli import main

    ready = tmp_path / "ready"
    common = dict(env="tests.test_rev7_train:BlockingEnv", checkpoint_every=1, steps=3,
                  eval={"k": 1, "n_tasks": 1, "before_training": False})
    cfg = write_config(tmp_path, **common, env_kwargs={"n_train": 4, "n_test": 2, "block_at": 5,  # step 1's first
                                                       "ready": str(ready)})
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    run = subprocess.Popen([sys.executable, "-m", "drmas_graph.cli", "train", str(cfg)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready.exists(), run.communicate(timeout=60)
        run.send_signal(signal.SIGTERM)
        _, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    # before: killed by the signal's default action (a shell reports 143), nothing printed
    assert run.returncode == 143, stderr
    assert "Traceback" not in stderr and stderr.splitlines()[-1] == (
        f"drmas-graph: terminated (SIGTERM); last checkpoint {ckpt} (1 of 3 steps done); continue with "
        f"`drmas-graph train {cfg} --resume`")
    assert main(["train", str(cfg), "--resume", "--set", "env_kwargs.block_at=0"]) == 0
    # nothing lost: the resumed run ends with the weights of a run never stopped
    straight = tmp_path / "straight"
    straight.mkdir()
    assert main(["train", str(write_config(straight, **common, env_kwargs={"n_train": 4, "n_test": 2}))]) == 0
    final = "checkpoints/step_000003/tiny/model/model.safetensors"
    assert (tmp_path / "run" / final).read_bytes() == (straight / "run" / final).read_bytes()


# --- item 1: the reward of an unfinished episode sees the state as it stood ------------------------------------


def draft_then_check(llm, checkpointer=None):
    """`writer` drafts (free text), then `checker` asks for a `Verdict` (a forced tool call): a reply that is no such
    call breaks the app, a model error after the writer acted."""
    from typing import TypedDict

    from langchain_core.messages import HumanMessage
    from langgraph.graph import END, START, StateGraph
    from pydantic import BaseModel

    class Verdict(BaseModel):
        ok: bool

    class S(TypedDict, total=False):
        question: str
        draft: str
        ok: bool

    def writer(state):
        return {"draft": llm.invoke([HumanMessage(state["question"])]).content}

    def checker(state):
        return {"ok": llm.with_structured_output(Verdict).invoke([HumanMessage(state["draft"])]).ok}

    graph = (StateGraph(S).add_node("writer", writer).add_node("checker", checker).add_edge(START, "writer")
             .add_edge("writer", "checker").add_edge("checker", END))
    return graph.compile(checkpointer=checkpointer)


@pytest.mark.parametrize("saver", [False, True], ids=["no-checkpointer", "checkpointer"])
def test_the_reward_of_a_model_error_episode_sees_what_the_other_agents_did(tmp_path, saver):
    from langgraph.checkpoint.memory import InMemorySaver

    from drmas_graph import TraceStore
    from drmas_graph.testing import scripted_policy
    from drmas_graph.train.loop.trainer import train_graph
    from tests._envs import ParityEnv
    from tests.test_instrument import Unreachable

    seen = []

    class Env(ParityEnv):
        def reward(self, task, episode):
            seen.append((episode.outcome, episode.final_state))
            return 1.0 if (episode.final_state or {}).get("draft") == "a draft" else 0.0

    writer, checker = scripted_policy(["a draft"], name="w"), scripted_policy(["no verdict"], name="c")
    cfg = small_config(tmp_path, steps=1, tasks_per_step=1, group_size=2, rollout={"model_error_reward": None},
                       eval={"k": 1, "n_tasks": 1, "before_training": False})
    graph = draft_then_check(Unreachable(), InMemorySaver() if saver else None)
    result = train_graph(graph, Env(n_train=1), cfg, policies={"writer": writer, "checker": checker})
    assert result.history[0]["model_error_episodes"] == 2
    question = "What is 0 + 0?"
    # before: final_state None (the run raised), so the reward could not see the writer's draft
    assert seen[:2] == [("model_error", {"question": question, "draft": "a draft"})] * 2
    assert result.history[0]["reward/team_mean"] == 1.0
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        stored = [store.load_episode(e.id) for e in store.episodes(step=0)]
    assert [e.final_state for e in stored] == [{"question": question, "draft": "a draft"}] * 2


def test_a_rollout_that_raises_keeps_its_state_as_of_its_last_superstep():
    from drmas_graph import instrument
    from drmas_graph.errors import RolloutError
    from drmas_graph.testing import scripted_policy
    from tests.test_instrument import Unreachable

    app = instrument(draft_then_check(Unreachable()), {"writer": scripted_policy(["a draft"], name="w"),
                                                        "checker": scripted_policy(["no verdict"], name="c")})
    with pytest.raises(RolloutError) as raised:
        app.rollout({"question": "q"})
    episode = raised.value.episode
    assert episode.outcome == "model_error" and episode.final_state == {"question": "q", "draft": "a draft"}


# --- item 5: a checkpoint holds what resume needs, once --------------------------------------------------------


def _optimizer_state(updater):
    engine = updater._engine
    optimizer = getattr(engine, "optimizer", None)
    state = (optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer).state_dict()["state"]
    return {(k, name): v.clone() for k, entry in state.items() for name, v in entry.items() if torch.is_tensor(v)}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_deepspeed_checkpoint_holds_no_second_copy_of_the_weights_and_resumes_exactly(rollout, tmp_path,  # noqa: F811
                                                                                       stage):
    pytest.importorskip("deepspeed")
    s = settings(("deepspeed", stage), n_minibatches=2)
    first, second = rollout[:4], rollout[2:]
    model = fresh_model()
    updater = ModelUpdater(model, name="m", settings=s)
    updater.update(first)
    updater.save(tmp_path / "ckpt")
    saved, saved_state = snapshot(model, updater), _optimizer_state(updater)
    updater.update(second)
    expected = snapshot(model, updater)

    n = sum(p.numel() for p in model.parameters())
    files = {f.relative_to(tmp_path / "ckpt").as_posix(): f.stat().st_size
             for f in (tmp_path / "ckpt").rglob("*") if f.is_file()}
    assert files["model/model.safetensors"] > 4 * n  # the weights, once (float32)
    # AdamW's two moments, 8 bytes per parameter: ZeRO-0 keeps them in the model-states file, ZeRO 1-2 in their own
    # (before: the model-states file held the weights again, 4 bytes per parameter, and ZeRO 1-2's file 12 bytes
    # per parameter, its float32 master weights too)
    optimizer = "mp_rank_00_model_states.pt" if stage == 0 else "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert 8 * n < files[f"deepspeed/state/{optimizer}"] < 8.2 * n
    assert stage == 0 or files["deepspeed/state/mp_rank_00_model_states.pt"] < 0.1 * n
    assert not [f for f in files if f.endswith(".py")]  # DeepSpeed's recovery scripts: nothing left to recover

    resumed_model = fresh_model(seed=3)  # other weights: they must come from the checkpoint
    resumed = ModelUpdater(resumed_model, name="m", settings=s)
    resumed.load(tmp_path / "ckpt")
    assert max_diff(snapshot(resumed_model, resumed), saved) == 0.0
    state = _optimizer_state(resumed)
    assert state.keys() == saved_state.keys() and all(torch.equal(state[k], saved_state[k]) for k in state)
    resumed.update(second)
    assert max_diff(snapshot(resumed_model, resumed), expected) == 0.0  # bit for bit


def test_keep_checkpoints_1_keeps_the_latest_and_removes_it_only_once_its_successor_is_whole(tmp_path):
    from tests._envs import ParityEnv
    from tests.test_trainer import graph

    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=3))
    cfg = small_config(tmp_path, keep_checkpoints=1, eval={"k": 1, "n_tasks": 1, "before_training": False})
    trainer = Trainer(graph(), ParityEnv(), cfg, policies={"solver": policy, "verifier": policy})
    root = tmp_path / "run" / "checkpoints"
    try:
        trainer.save_checkpoint(1)
        (model,) = trainer.state.trained_models()
        save = model.updater.save

        def broken(directory):
            save(directory)
            raise OSError("the disk went away")  # after the new checkpoint's files, before it is whole

        model.updater.save = broken
        with pytest.raises(OSError, match="the disk went away"):
            trainer.save_checkpoint(2)
        assert sorted(p.name for p in root.iterdir()) == ["step_000001"]  # the latest whole one stays
        model.updater.save = save
        trainer.save_checkpoint(2)
        assert sorted(p.name for p in root.iterdir()) == ["step_000002"]
    finally:
        trainer.close()
