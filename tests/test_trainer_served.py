"""train_graph with served policies: rollouts go through a strict SGLang protocol double (tests/sglang_double.py,
sampling from a real tiny model), the trainer trains a local copy and pushes it to the server after every update.

What this proves: the wiring (config and Python API), the sync protocol and versioning, that the server samples
from exactly the weights the trainer trained, and that sync/server failures stop or are counted. It does not prove
a real SGLang server loads the checkpoint the same way: tests/gpu/sglang_check.py covers the server side.
"""

import os
import stat
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from drmas_graph import SamplingParams
from drmas_graph.config import load_config
from drmas_graph.errors import ConfigError
from drmas_graph.served import ServerStartError, SGLangPolicy, WeightSyncError, free_port
from drmas_graph.traces.store import TraceStore
from drmas_graph.testing import tiny_model, tiny_policy, tiny_tokenizer
from drmas_graph.train.loop.trainer import Trainer, train_graph
from tests._envs import ParityEnv
from tests.sglang_double import SGLangDouble
from tests.test_trainer import graph, small_config

SHORT = {"max_new_tokens": 6}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The base model both the server and the trainer start from."""
    tokenizer = tiny_tokenizer()
    path = tmp_path_factory.mktemp("base")
    tiny_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def double(ckpt):
    d = SGLangDouble(ckpt, weight_version="0").start()
    yield d
    d.stop()


def served_config(tmp_path, ckpt, serve, **kw):
    return small_config(tmp_path, models={"m": {"path": ckpt, "serve": serve}},
                        agents={"solver": {"model": "m", "sampling": SHORT},
                                "verifier": {"model": "m", "sampling": SHORT}}, **kw)


def test_served_model_is_trained_locally_and_the_server_samples_from_the_trained_weights(tmp_path, ckpt, double):
    cfg = served_config(tmp_path, ckpt, {"engine": "sglang", "urls": [double.url]})
    trainer = Trainer(graph(), ParityEnv(), cfg)
    try:
        policy, local = trainer.state.models["m"].policy, trainer.state.models["m"].trained
        assert isinstance(policy, SGLangPolicy) and policy.base_urls == [double.url] and policy.version == 0
        result = trainer.run()
    finally:
        trainer.close()
    sync_dir = tmp_path.resolve() / "run" / "sync" / "m"
    # one push per step, versioned by steps done; the server reports it
    pushed = [body for path, body in double.requests if path == "POST /update_weights_from_disk"]
    assert [(b["model_path"], b["weight_version"]) for b in pushed] == [(str(sync_dir), "1"), (str(sync_dir), "2")]
    assert policy.version == 2 and double.weight_version == "2"
    assert sorted(p.name for p in sync_dir.parent.iterdir()) == ["m"]  # no half-written folder left behind
    # the server now holds exactly the trainer's weights, and they moved away from the base model
    served, trained = double.model.state_dict(), local.state_dict()
    assert all(torch.equal(v, served[k]) for k, v in trained.items())
    base = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    assert sum(not torch.equal(v, base[k]) for k, v in trained.items()) > 0.5 * len(base)
    for rec in result.history:
        assert rec["time/sync_s"] > 0 and rec["model/m/sync_s"] == rec["time/sync_s"]
        assert rec["episodes"] == 8 and rec["failed_episodes"] == 0
    # step 1 sampled from the weights pushed after step 0: the server's logprobs are the trainer's recompute
    assert result.history[1]["agent/solver/logprob_mismatch"] < 1e-4
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        for step in (0, 1):
            turns = [t for e in store.episodes(step=step) for t in store.load_episode(e.id).turns]
            assert len(turns) == 16 and {t.policy_version for t in turns} == {step}
    assert load_config(tmp_path / "run" / "config.yaml").models["m"].serve.urls == [double.url]


def test_resume_pushes_the_checkpointed_weights_before_rolling_out(tmp_path, ckpt):
    def run(steps, resume):
        double = SGLangDouble(ckpt, weight_version="0").start()  # a fresh server: base weights, version 0
        cfg = served_config(tmp_path, ckpt, {"engine": "sglang", "urls": [double.url]}, steps=steps, resume=resume,
                            checkpoint_every=1, eval={"k": 1, "n_tasks": 1, "before_training": False})
        trainer = Trainer(graph(), ParityEnv(), cfg)
        try:
            trainer.run()
            return double, trainer.state.models["m"].trained.state_dict()
        finally:
            trainer.close()
            double.stop()

    run(1, resume=False)
    double, trained = run(2, resume=True)
    calls = [(path, (body or {}).get("weight_version")) for path, body in double.requests
             if path in ("POST /generate", "POST /update_weights_from_disk")]
    assert calls[0] == ("POST /update_weights_from_disk", "1")  # step 1's weights, before any rollout of step 1
    assert [v for path, v in calls if "update" in path] == ["1", "2"] and double.weight_version == "2"
    assert all(torch.equal(v, double.model.state_dict()[k]) for k, v in trained.items())


def test_a_server_reporting_a_stale_version_stops_the_run(tmp_path, ckpt, double):
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    policy = SGLangPolicy(double.url, tokenizer, name="sg", sampling=SamplingParams(max_new_tokens=6))
    local = AutoModelForCausalLM.from_pretrained(ckpt)
    double.ignore_weight_version = True  # it loads the weights but keeps reporting version 0
    cfg = small_config(tmp_path, eval={"before_training": False})
    try:
        with pytest.raises(WeightSyncError, match="pushed 1, server reports 0"):
            train_graph(graph(), ParityEnv(), cfg, policies={"solver": policy, "verifier": policy},
                        train_models={"sg": local})
    finally:
        policy.close()
    assert double.updates == 1 and policy.version == 0
    assert "reward/team_mean" not in (tmp_path / "run" / "metrics.jsonl").read_text()  # step 0 never completed


def test_episodes_routed_to_a_dead_server_are_counted_as_failed(tmp_path, ckpt, double):
    dead = f"http://127.0.0.1:{free_port()}"
    verifier = SGLangPolicy([double.url, dead], AutoTokenizer.from_pretrained(ckpt), name="sg", max_retries=0)
    solver = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=6))
    cfg = small_config(tmp_path, agents={"verifier": {"model": "sg", "frozen": True, "sampling": SHORT}})
    try:
        result = train_graph(graph(), ParityEnv(), cfg, policies={"solver": solver, "verifier": verifier})
    finally:
        verifier.close()
        solver.close()
    # new episodes alternate between the two servers: half of every batch (and of every evaluation) fails
    assert [(r["failed_episodes"], r["episodes"]) for r in result.history] == [(4, 4), (4, 4)]
    assert [e["failed_episodes"] for e in result.evals] == [2, 2]
    assert all(r["time/sync_s"] == 0.0 for r in result.history) and double.updates == 0  # frozen: never synced
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        failed = store.episodes(failed=True)
        assert len(failed) == 12 and "ServerUnavailableError" in store.load_episode(failed[0].id).error


def test_launch_starts_a_server_from_path_and_close_stops_it(tmp_path, ckpt):
    # launch_sglang runs `<python> -m sglang.launch_server ARGS`; this interpreter serves the double instead
    python = tmp_path / "python"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    python.write_text(f"#!/bin/sh\nshift 2\ncd {root} && exec {sys.executable} -m tests.sglang_double \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    args = ["--mem-fraction-static", "0.8", "--log-level=warning"]
    cfg = served_config(tmp_path, ckpt, {"engine": "sglang", "launch": True, "python": str(python), "args": args},
                        steps=1, eval={"k": 1, "n_tasks": 1, "before_training": False})
    trainer = Trainer(graph(), ParityEnv(), cfg)
    try:
        (server,) = trainer.state.models["m"].policy.servers
        assert server.argv[server.argv.index("--model-path") + 1] == ckpt
        assert server.argv[-3:] == args  # serve.args, after drmas-graph's own
        trainer.run()
        info = httpx.get(server.url + "/model_info").json()
        assert info["weight_version"] == "1" and info["model_path"] == str(tmp_path.resolve() / "run" / "sync" / "m")
    finally:
        trainer.close()
    assert not server.alive()


def test_a_launched_server_that_is_not_ready_in_ready_timeout_s_fails_the_start_and_is_stopped(tmp_path, ckpt):
    python = tmp_path / "python"  # a "server" that never answers its health check
    python.write_text("#!/bin/sh\nexec sleep 61.5\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    cfg = served_config(tmp_path, ckpt, {"engine": "sglang", "launch": True, "python": str(python),
                                         "ready_timeout_s": 1.5}, steps=1)
    started = time.monotonic()
    with pytest.raises(ServerStartError, match=r"not ready after 2 s .*models\.<name>\.serve\.ready_timeout_s"):
        Trainer(graph(), ParityEnv(), cfg)
    assert time.monotonic() - started < 30  # not the 600 s default
    assert not _running(b"sleep\x0061.5")  # the launch stopped it


def _running(cmdline: bytes) -> bool:
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(cmdline):
                return True
        except OSError:
            pass
    return False


@pytest.mark.parametrize("serve, error", [
    ({"engine": "vllm", "launch": True, "args": ["--port", "8000"]}, r"models.m.serve.args may not set --port: drmas-graph sets it \(a free port\)"),
    ({"engine": "vllm", "launch": True, "args": ["--logprobs_mode=raw_logprobs"]}, r"may not set --logprobs_mode: .*processed_logprobs"),
    ({"engine": "vllm", "launch": True, "args": ["--dtype", "half"]}, r"may not set --dtype: .*models.<name>.dtype"),
    ({"engine": "sglang", "launch": True, "args": ["--weight-version=3"]}, r"may not set --weight-version"),
    ({"engine": "sglang", "urls": ["http://127.0.0.1:9"], "args": ["--mem-fraction-static", "0.8"]},
     r"models.m.serve: .*`args` .* are for a server drmas-graph launches"),
])
def test_serve_args_refuse_what_drmas_graph_sets_and_servers_it_did_not_launch(tmp_path, ckpt, serve, error):
    with pytest.raises(ConfigError, match=error):
        train_graph(graph(), ParityEnv(), small_config(tmp_path), models={"m": {"path": ckpt, "serve": serve}})


def test_the_flags_serve_args_may_not_set_are_the_ones_a_launch_sets(monkeypatch):
    from drmas_graph.config import LoraConfig
    from drmas_graph.served import LAUNCH_FLAGS, launch_sglang, launch_vllm, sglang, vllm, vllm_launch_kwargs

    class Captured:
        def __init__(self, argv, **kw):
            self.argv = argv

        def wait_ready(self, timeout_s):
            pass

    flags = {}
    for engine, module, launch, kw in (("vllm", vllm, launch_vllm, vllm_launch_kwargs(LoraConfig(), ["a", "b"])),
                                       ("sglang", sglang, launch_sglang, {})):
        monkeypatch.setattr(module, "ServerProcess", Captured)
        argv = launch("/m", python="python", port=1, **kw).argv
        flags[engine] = {a for a in argv if a.startswith("--")} - {"--max-model-len"}  # a later one overrides it
    assert flags == {engine: set(owned) for engine, owned in LAUNCH_FLAGS.items()}


def test_construction_errors_say_what_to_do(tmp_path, ckpt):
    served = SGLangPolicy("http://127.0.0.1:9", AutoTokenizer.from_pretrained(ckpt), name="sg")  # no I/O yet
    embedded = tiny_policy(seed=0)
    try:
        with pytest.raises(ConfigError, match=r"'sg' \(SGLangPolicy.*no local weights to train.*train_models="):
            train_graph(graph(), ParityEnv(), small_config(tmp_path), policies={"solver": served, "verifier": served})
        with pytest.raises(ConfigError, match=r"train_models\['tiny-llama-v512-s0'\]: names no served policy"):
            train_graph(graph(), ParityEnv(), small_config(tmp_path), policies={"solver": embedded, "verifier": served},
                        train_models={embedded.name: embedded.model})
        with pytest.raises(ConfigError, match=r"models.m.serve: .*exactly one of `urls`"):
            train_graph(graph(), ParityEnv(), small_config(tmp_path), models={"m": {"path": ckpt, "serve": {"engine": "sglang"}}})
        with pytest.raises(ConfigError, match=r"models.m: .*`serve` needs `path`"):
            train_graph(graph(), ParityEnv(), small_config(tmp_path),
                        models={"m": {"tiny": {}, "serve": {"engine": "sglang", "launch": True}}})
    finally:
        served.close()
        embedded.close()


def test_served_runs_are_identical_at_any_max_concurrency(tmp_path, ckpt):
    """Every request carries a seed derived from the call's identity (not drawn in arrival order), so a served
    run samples the same tokens with 1 or 8 episodes in flight and trains to the same weights."""
    def run(conc):
        double = SGLangDouble(ckpt, weight_version="0").start()
        cfg = served_config(tmp_path, ckpt, {"engine": "sglang", "urls": [double.url]}, steps=2,
                            max_concurrency=conc, run_dir=str(tmp_path / f"c{conc}"),
                            eval={"k": 1, "n_tasks": 1, "before_training": False})
        trainer = Trainer(graph(), ParityEnv(), cfg)
        try:
            trainer.run()
            weights = {k: v.clone() for k, v in trainer.state.models["m"].trained.state_dict().items()}
        finally:
            trainer.close()
            double.stop()
        seeds = sorted(b["sampling_params"]["sampling_seed"] for p, b in double.requests if p == "POST /generate")
        return weights, seeds

    (w1, s1), (w8, s8) = run(1), run(8)
    assert len(s1) == 2 * 16 + 2 and len(set(s1)) == len(s1) and s1 == s8
    assert all(torch.equal(w1[k], w8[k]) for k in w1)
