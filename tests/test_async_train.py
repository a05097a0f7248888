"""Asynchronous training, one step off (`async.max_staleness` >= 1, `drmas_graph.train.loop._pipeline`): the next step's
rollouts run during the update, on the weights one update older; runs are reproducible to the last digit at any
max_concurrency, kill-and-resume trains every group once, the trainer's copy reaches the rollouts at the step
boundary, and served policies get their pushes there (SGLang protocol double)."""

import json
import logging
import threading

import pytest
import torch

from drmas_graph import SamplingParams
from drmas_graph.served import SGLangPolicy, WeightSyncError
from drmas_graph.testing import tiny_policy
from drmas_graph.traces.store import TraceStore
from drmas_graph.train.loop import _pipeline
from drmas_graph.train.loop.trainer import Trainer
from tests._envs import ParityEnv
from tests.sglang_double import SGLangDouble
from tests.test_trainer import _sampled, graph, params, small_config
from tests.test_trainer_served import ckpt, served_config  # noqa: F401 - the fixture

ASYNC = {"async": {"max_staleness": 1}}
NO_EVAL = {"k": 1, "n_tasks": 1, "before_training": False}


def run_async(tmp_path, run_dir, *, steps=3, conc=8, hook=None, app=None, n_train=5, policy=None, **kw):
    """A one-step-off run (or as `kw`'s `async` says) of the solver -> verifier graph (or `app`) on one tiny
    model (or `policy`); returns (result, trainer weights, rollout weights, trainer). `hook(trainer)` runs before
    `run()`."""
    policy = policy or tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=4))
    cfg = small_config(tmp_path, run_dir=str(tmp_path / run_dir), steps=steps, tasks_per_step=2,
                       max_concurrency=conc, eval=NO_EVAL, **{**ASYNC, **kw})
    trainer = Trainer(app if app is not None else graph(), ParityEnv(n_train=n_train), cfg,
                      policies={"solver": policy, "verifier": policy})
    try:
        if hook is not None:
            hook(trainer)
        result = trainer.run()
        trained = {k: v.clone() for k, v in trainer.state.models[policy.name].trained.state_dict().items()}
    finally:
        trainer.close()
    return result, trained, params(policy), trainer


def test_one_step_off_is_reproducible_at_any_max_concurrency_with_groups_one_update_stale(tmp_path):
    initial = params(tiny_policy(seed=0))
    r1, trained1, served1, t1 = run_async(tmp_path, "c1", conc=1)
    r8, trained8, served8, t8 = run_async(tmp_path, "c8", conc=8)
    assert t8.pipeline is not None and t8.state.models[t8.state.agent_policies["solver"].name].trained is not \
        t8.state.agent_policies["solver"].model  # the trainer trained a copy; the policy decoded with its own module
    assert all(torch.equal(trained1[k], trained8[k]) for k in trained1)  # bit for bit
    assert sum(not torch.equal(v, initial[k]) for k, v in trained8.items()) > 0.5 * len(initial)
    assert all(torch.equal(served8[k], trained8[k]) for k in trained8)  # the last install before the final eval
    keys = ("reward/team_mean", "agent/solver/is_weight_mean", "agent/verifier/is_weight_max", "model/" +
            t8.state.agent_policies["solver"].name + "/grad_norm")
    for h1, h8 in zip(r1.history[1:], r8.history[1:]):
        assert [h1[k] for k in keys] == [h8[k] for k in keys]
    # staleness: step 0 rolled out on v0 and trained in update 0; step s on v(s-1), trained in update s
    assert [h["async/staleness_mean"] for h in r8.history] == [0.0, 1.0, 1.0]
    assert [h["agent/solver/staleness_max"] for h in r8.history] == [0, 1, 1]
    assert [h["async/dropped_groups"] + h["async/dropped_samples"] for h in r8.history] == [0, 0, 0]
    assert "agent/solver/is_weight_mean" not in r8.history[0]  # nothing stale in step 0: every weight is 1
    for h in r8.history[1:]:  # pi_prox / pi_behav after one small update: near 1, never capped
        assert 0.5 < h["agent/solver/is_weight_mean"] < 1.5 and h["agent/solver/is_capped_frac"] == 0.0
    with TraceStore(tmp_path / "c8" / "traces.db", readonly=True) as store:
        for step in range(3):
            versions = {t.policy_version for ref in store.episodes(step=step) for t in store.load_episode(ref.id).turns}
            assert versions == {max(0, step - 1)}, step
        assert _sampled(store, 2) == _sampled(TraceStore(tmp_path / "c1" / "traces.db", readonly=True), 2)


def test_the_policy_gets_the_configured_kernel_and_exact_behaviour_logprobs(tmp_path):
    """update.attn_implementation reaches the policy's own module too (embedded policies generate with it), and the
    behaviour logprobs recomputed on it are packed for its kernel: at lr 0, pi_prox = pi_behav, every importance
    weight is 1."""
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=4))
    policy.model.set_attn_implementation("eager")  # as the user loaded it
    result, _, _, trainer = run_async(tmp_path, "kernel", steps=2, policy=policy,
                                      update={"lr": 0.0, "backend": "torch", "attn_implementation": "sdpa"})
    copy = trainer.state.models[policy.name].trained
    assert copy is not policy.model and policy.model.config._attn_implementation == "sdpa"
    assert copy.config._attn_implementation == "sdpa"
    step1 = result.history[1]
    for agent in ("solver", "verifier"):
        assert step1[f"agent/{agent}/is_weight_max"] == pytest.approx(1.0, abs=1e-5)
        assert step1[f"agent/{agent}/is_weight_mean"] == pytest.approx(1.0, abs=1e-6)


def test_async_metrics_with_several_minibatches_read_the_sampling_policys_logprobs(tmp_path):
    """rev6_f: one step off with n_minibatches 2, the update's old logprobs are the proximal policy's (v(u),
    recomputed). Step 1 was sampled by v0, the start weights: its kl_start must be that of v0 to itself (~0, it
    read v1's: 0.027), and every sample is stale, so there is no rollout-vs-trainer numerics gap to report
    (logprob_mismatch and rollout_logprob_gap measured v0 -> v1 before); step 0 (sampled by v0, trained by v0)
    keeps both, at float noise."""
    result, _, _, _ = run_async(tmp_path, "kl", steps=2, update={"lr": 1e-2, "backend": "torch", "n_minibatches": 2,
                                                                   "kl_start_metric": True})
    step0, step1 = result.history
    with TraceStore(tmp_path / "kl" / "traces.db", readonly=True) as store:
        assert {t.policy_version for ref in store.episodes(step=1) for t in store.load_episode(ref.id).turns} == {0}
    for agent in ("solver", "verifier"):
        assert abs(step1[f"agent/{agent}/kl_start"]) < 1e-6 and abs(step0[f"agent/{agent}/kl_start"]) < 1e-6
        assert step0[f"agent/{agent}/logprob_mismatch"] < 1e-5 and step0[f"agent/{agent}/rollout_logprob_gap"] < 1e-5
        assert f"agent/{agent}/logprob_mismatch" not in step1 and f"agent/{agent}/rollout_logprob_gap" not in step1
        assert 0.5 < step1[f"agent/{agent}/is_weight_mean"] < 1.5


def test_the_next_steps_rollouts_run_during_the_update(tmp_path):
    """Update u waits until step u+1's rollouts have started: a synchronous loop would never get there (the test
    would time out), the pipelined one does. The last update has no next step: it does not wait (it waited out
    its 120 s timeout before), and step 3 is never collected."""
    steps = 3
    started = {s: threading.Event() for s in range(steps + 1)}
    waited = []

    def hook(trainer):
        collect, name = trainer.pipeline.collect, trainer.state.trained_models()[0].name
        updater = trainer.state.models[name].updater
        update = updater.update

        def observed_collect(step):
            started[step].set()
            return collect(step)

        def waiting_update(samples, **kwargs):
            u = updater.n_updates
            if u + 1 < steps:
                waited.append(started[u + 1].wait(timeout=120))
            return update(samples, **kwargs)

        trainer.pipeline.collect = observed_collect
        updater.update = waiting_update

    run_async(tmp_path, "overlap", steps=steps, hook=hook)
    assert waited == [True, True]
    assert [s for s in started if started[s].is_set()] == [0, 1, 2]  # no step 3 rolled out


class Killed(Exception):
    """The run died (raised by `kill_after_checkpoint`'s hook)."""


def kill_after_checkpoint(step):
    """A `hook(trainer)`: the run raises `Killed` right after it saved checkpoint `step`."""

    def hook(trainer):
        save = trainer.save_checkpoint

        def save_then_die(done):
            path = save(done)
            if done == step:
                raise Killed
            return path

        trainer.save_checkpoint = save_then_die

    return hook


def test_kill_and_resume_trains_every_group_once_and_gives_the_same_weights(tmp_path):
    _, straight, _, _ = run_async(tmp_path, "a", steps=4, checkpoint_every=1)
    with pytest.raises(Killed):  # checkpoint 2 is saved while step 2 rolls out on v1
        run_async(tmp_path, "b", steps=4, checkpoint_every=1, hook=kill_after_checkpoint(2))
    state = json.loads((tmp_path / "b" / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["serving_version"] == 1 and state["policy_versions"]["tiny-llama-v512-s0"] == 2
    assert (tmp_path / "b" / "checkpoints" / "step_000002" / "tiny-llama-v512-s0" / "serving" / "model.safetensors").is_file()
    resumed, weights, _, _ = run_async(tmp_path, "b", steps=4, checkpoint_every=1, resume=True)
    assert [r["step"] for r in resumed.history] == [2, 3]
    assert all(torch.equal(weights[k], straight[k]) for k in straight)  # bit for bit
    # a finished run extended with resume: its final checkpoint holds v(c-1), so step c rolls out as it would have
    run_async(tmp_path, "c", steps=2, checkpoint_every=1)
    _, extended, _, _ = run_async(tmp_path, "c", steps=4, checkpoint_every=1, resume=True)
    assert all(torch.equal(extended[k], straight[k]) for k in straight)
    with TraceStore(tmp_path / "a" / "traces.db", readonly=True) as a, \
            TraceStore(tmp_path / "b" / "traces.db", readonly=True) as b:
        for step in range(4):  # each step's groups trained once, with the same tokens
            assert _sampled(a, step) == _sampled(b, step) and len(_sampled(b, step)) == 16


def test_synchronous_by_default_and_when_the_copy_does_not_fit(tmp_path, monkeypatch, caplog):
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=4))
    trainer = Trainer(graph(), ParityEnv(), small_config(tmp_path, steps=1, eval=NO_EVAL),
                      policies={"solver": policy, "verifier": policy})
    try:  # the default: no pipeline, the updater trains the policy's own module, no async metrics
        assert trainer.pipeline is None and trainer.state.models[policy.name].trained is policy.model
        record = trainer.train_step(0)
        assert not [k for k in record if k.startswith("async/") or "staleness" in k]
    finally:
        trainer.close()
    monkeypatch.setattr(_pipeline, "_free_bytes", lambda module: 1000)  # a device with 1 kB free
    with caplog.at_level(logging.WARNING, logger="drmas_graph.train.loop._pipeline"):
        result, _, _, trainer = run_async(tmp_path, "fallback", steps=2)
    assert trainer.pipeline is None and "training synchronously" in trainer.state.async_fallback
    assert "needs a second copy of its weights" in caplog.text
    assert [h["async/synchronous_fallback"] for h in result.history] == [1, 1]


def test_served_policy_gets_its_pushes_at_the_step_boundaries(tmp_path, ckpt):  # noqa: F811
    double = SGLangDouble(ckpt, weight_version="0").start()
    cfg = served_config(tmp_path, ckpt, {"engine": "sglang", "urls": [double.url]}, steps=3, eval=NO_EVAL, **ASYNC)
    trainer = Trainer(graph(), ParityEnv(), cfg)
    try:
        result = trainer.run()
        local = {k: v.clone() for k, v in trainer.state.models["m"].trained.state_dict().items()}
    finally:
        trainer.close()
        double.stop()
    pushed = [b["weight_version"] for p, b in double.requests if p == "POST /update_weights_from_disk"]
    assert pushed == ["0", "1", "2", "3"]  # v0 at the first boundary (what a checkpoint copies), then one per update
    generated = [b for p, b in double.requests if p in ("POST /generate", "POST /update_weights_from_disk")]
    # every generation of step s (2 groups x 4 episodes x 2 calls) came between the pushes of v(s-1) and v(s)
    versions = [s["weight_version"] for s in double.sampled]
    assert versions == ["0"] * 32 + ["1"] * 16 + ["3"] * 2  # steps 0 and 1 on v0, step 2 on v1; final eval on v3
    assert len(generated) == 50 + 4
    assert [h["async/staleness_mean"] for h in result.history] == [0.0, 1.0, 1.0]
    assert all(torch.equal(v, double.model.state_dict()[k]) for k, v in local.items())


def test_a_weight_sync_that_waits_on_a_hung_request_fails_naming_the_server(tmp_path, ckpt):  # noqa: F811
    """A sync waits for the policy's requests in flight (they finish on the old weights, with its version: vLLM's
    way); one that does not finish within timeout_s fails the sync with the server's URL, and never hangs."""
    from transformers import AutoTokenizer

    class Draining(SGLangPolicy):
        _sync_drains = True

    double = SGLangDouble(ckpt, weight_version="0").start()
    policy = Draining(double.url, AutoTokenizer.from_pretrained(ckpt), name="m", timeout_s=30)
    long = SamplingParams(max_new_tokens=30, temperature=0.0)
    try:
        double.step_delay_s = 0.05
        out = {}
        worker = threading.Thread(target=lambda: out.update(gen=policy.generate([5, 6, 7], long)))
        worker.start()
        while not policy._in_flight:
            threading.Event().wait(0.01)
        with pytest.raises(WeightSyncError, match=rf"weight sync to version 1 did not finish within 0.2 s: no answer "
                                                  rf"from {double.url} \(1 request\(s\) of this policy still in flight"):
            policy.sync_weights(ckpt, 1, timeout_s=0.2)
        policy.sync_weights(ckpt, 1, timeout_s=30)  # waits for the request, then loads
        worker.join(30)
        assert out["gen"].policy_version == 0 and policy.version == 1  # it finished on the old weights
        assert [s["weight_version"] for s in double.sampled] == ["0"]
    finally:
        double.step_delay_s = 0.0
        policy.close()
        double.stop()
