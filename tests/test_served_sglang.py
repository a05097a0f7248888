"""SGLangPolicy against a strict SGLang protocol double (tests/sglang_double.py) that samples from a real tiny model.

What this proves: the client speaks the documented native protocol (input_ids in, output_ids + logprobs out,
pause/update/continue with JSON bodies, weight_version checks) and records exactly what the server sampled.
It does not prove a real SGLang server behaves like the double: tests/gpu/sglang_check.py does that on a GPU.
"""

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from drmas_graph import RolloutError, SamplingParams, instrument
from drmas_graph.errors import PolicyError
from drmas_graph.served import (BadRequestError, GenerationAbortedError, SGLangPolicy, ServerProcess,
                                ServerStartError, ServerUnavailableError, WeightSyncError)
from drmas_graph.testing import tiny_model, tiny_tokenizer
from tests import _graphs
from tests.sglang_double import SGLangDouble
from tests.test_instrument import Unreachable
from tests._logprobs import recompute_logprobs

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _save(tokenizer, path, seed):
    tiny_model(tokenizer, seed=seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {seed: _save(tokenizer, root / f"s{seed}", seed) for seed in (0, 1)}


@pytest.fixture
def double(ckpts):
    d = SGLangDouble(ckpts[0], weight_version="0").start()
    yield d
    d.stop()


@pytest.fixture
def policy(double, tokenizer):
    p = SGLangPolicy(double.url, tokenizer, name="sg", sampling=SamplingParams(max_new_tokens=12, temperature=0.8),
                     backoff_s=0.01, timeout_s=30)
    yield p
    p.close()


def test_instrumented_graph_records_exactly_what_the_server_sampled(policy, double, tokenizer, ckpts):
    app = instrument(_graphs.solver_verifier(Unreachable()).compile(), {"solver": policy, "verifier": policy})
    episode = app.rollout({"question": "2+3?"}, task_id="t1")
    assert [t.agent for t in episode.turns] == ["solver", "verifier"] and episode.ok
    assert len(double.sampled) == 2
    for turn, served in zip(episode.turns, double.sampled):
        assert turn.prompt_ids == tuple(served["input_ids"])
        assert turn.response_ids == tuple(served["output_ids"])
        assert turn.response_logprobs == tuple(served["logprobs"])
        assert turn.response_text == tokenizer.decode(served["output_ids"], skip_special_tokens=True)
        assert turn.policy == "sg" and turn.policy_version == 0
        ours = recompute_logprobs(ckpts[0], turn.prompt_ids, turn.response_ids, 0.8)
        assert turn.response_logprobs == pytest.approx(ours, abs=1e-4)
    # the wire format: documented keys only, eos as a stop token id, logprobs requested
    _, body = next(r for r in double.requests if r[0] == "POST /generate")
    assert body["return_logprob"] is True and body["sampling_params"]["top_k"] == -1
    assert tokenizer.eos_token_id in body["sampling_params"]["stop_token_ids"]


async def test_async_rollouts_stick_to_one_server_per_episode(ckpts, tokenizer):
    doubles = [SGLangDouble(ckpts[0], weight_version="0").start() for _ in range(2)]
    policy = SGLangPolicy([d.url for d in doubles], tokenizer, name="sg", sampling=GREEDY.replace(temperature=1.0))
    try:
        app = instrument(_graphs.solver_verifier(Unreachable()).compile(), {"solver": policy, "verifier": policy})
        episodes = await asyncio.gather(*(app.arollout({"question": f"q{i}?"}) for i in range(4)))
        seen = {i: {tuple(s["input_ids"]) for s in d.sampled} for i, d in enumerate(doubles)}
        for ep in episodes:
            homes = {i for t in ep.turns for i in seen if t.prompt_ids in seen[i]}
            assert len(homes) == 1, f"episode {ep.id} was split over servers {homes}"
            assert policy.route_of(ep.id) == doubles[homes.pop()].url
        assert all(d.sampled for d in doubles)  # new episodes go round-robin
        sync_ep = app.rollout({"question": "sync?"})  # the sync path (policy.generate from a node's thread)
        home = policy.route_of(sync_ep.id)
        assert home is not None
        served = {tuple(s["input_ids"]) for d in doubles if d.url == home for s in d.sampled}
        assert all(t.prompt_ids in served for t in sync_ep.turns)
    finally:
        policy.close()
        for d in doubles:
            d.stop()


def test_unknown_sampling_key_is_a_clear_error_and_not_retried(double, tokenizer):
    r = httpx.post(double.url + "/generate", json={"input_ids": [5, 6], "sampling_params": {"temprature": 1.0}})
    assert r.status_code == 400 and "temprature" in r.text  # the double is strict, like SGLang
    p = SGLangPolicy(double.url, tokenizer, name="sg", extra_sampling_params={"repetiton_penalty": 1.1})
    try:
        with pytest.raises(BadRequestError, match=r"rejected the request \(HTTP 400\).*repetiton_penalty"):
            p.generate([5, 6, 7], GREEDY)
        assert p.retries == 0
    finally:
        p.close()


def test_requests_without_a_seed_get_one_from_the_policys_seeded_generator(double, tokenizer):
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    runs = []
    for _ in range(2):
        p = SGLangPolicy(double.url, tokenizer, name="sg", seed=7)
        runs.append([p.generate([5, 6, 7], params).token_ids for _ in range(2)])
        p.close()
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]
    seeds = [body["sampling_params"]["sampling_seed"] for path, body in double.requests if path == "POST /generate"]
    assert seeds[:2] == seeds[2:] and len(set(seeds)) == 2


def test_weight_sync_changes_version_and_outputs(policy, double, ckpts):
    prompt = [5, 6, 7, 8, 9]
    before = policy.generate(prompt, GREEDY)
    result = policy.sync_weights(ckpts[1], version=3)
    assert policy.version == 3 and result["version"] == 3 and result["seconds"] > 0
    after = policy.generate(prompt, GREEDY)
    assert before.policy_version == 0 and after.policy_version == 3
    assert after.token_ids != before.token_ids
    assert after.logprobs == pytest.approx(recompute_logprobs(ckpts[1], prompt, after.token_ids, 1.0), abs=1e-4)
    calls = [(path, body) for path, body in double.requests if path.startswith("POST /") and "generate" not in path
             or path == "GET /model_info"]
    assert calls == [("POST /pause_generation", {}),
                     ("POST /update_weights_from_disk", {"model_path": ckpts[1], "weight_version": "3"}),
                     ("POST /continue_generation", {}),
                     ("GET /model_info", None)]


async def test_weight_sync_version_mismatch_stops_the_run(policy, double, ckpts):
    double.ignore_weight_version = True
    with pytest.raises(WeightSyncError, match="pushed 1, server reports 0"):
        await policy.sync_weights_from_disk(ckpts[1], 1)
    assert policy.version == 0


def test_failed_load_is_a_weight_sync_error(policy, double, tmp_path):
    with pytest.raises(WeightSyncError, match="Failed to update weights"):
        policy.sync_weights(str(tmp_path / "missing"), 1)
    assert double._running.is_set()  # continue_generation was sent even though the load failed


def test_aborted_request_is_retried_then_given_up(policy, double):
    double.abort_next = 1
    gen = policy.generate([5, 6, 7], GREEDY)
    assert policy.retries == 1 and len(gen.token_ids) > 0
    double.abort_next = 10
    with pytest.raises(GenerationAbortedError, match="gave up after 4 attempts") as info:
        policy.generate([5, 6, 7], GREEDY)
    assert isinstance(info.value, PolicyError)


def test_request_aborted_by_a_weight_update_is_retried_on_the_new_weights(policy, double, ckpts):
    double.step_delay_s = 0.05
    out = {}
    long = GREEDY.replace(max_new_tokens=40)
    worker = threading.Thread(target=lambda: out.update(gen=policy.generate([5, 6, 7], long)))
    worker.start()
    deadline = time.monotonic() + 10
    while not any(p == "POST /generate" for p, _ in double.requests) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    policy.sync_weights(ckpts[1], 1)
    double.step_delay_s = 0.0
    worker.join(20)
    assert out["gen"].policy_version == 1 and policy.retries >= 1
    assert [s["finish_reason"]["type"] for s in double.sampled][0] == "abort"


def test_dead_server_fails_the_episode_cleanly(policy, double):
    double.stop()
    with pytest.raises(ServerUnavailableError, match="gave up after 4 attempts"):
        policy.generate([5, 6], GREEDY)
    app = instrument(_graphs.solver_verifier(Unreachable()).compile(), {"solver": policy})
    with pytest.raises(RolloutError) as info:
        app.rollout({"question": "q"})
    assert info.value.episode.turns == [] and "ServerUnavailableError" in info.value.episode.error


def test_a_refusing_server_is_skipped(ckpts, tokenizer, double):
    dead = SGLangDouble(ckpts[0]).start()
    dead.stop()
    p = SGLangPolicy([dead.url, double.url], tokenizer, name="sg", backoff_s=0.01)
    try:
        assert all(p.generate([5, 6], GREEDY).token_ids for _ in range(3))
    finally:
        p.close()


def test_slow_server_times_out(policy, double, tokenizer):
    double.step_delay_s = 1.0
    p = SGLangPolicy(double.url, tokenizer, name="sg", timeout_s=0.3, max_retries=1, backoff_s=0.01)
    try:
        with pytest.raises(ServerUnavailableError, match="timed out"):
            p.generate([5, 6], GREEDY)
    finally:
        double.step_delay_s = 0.0
        p.close()


def _gone(pid):
    """The process no longer runs (it may linger as a zombie until init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _script(tmp_path, body):
    path = tmp_path / "server.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def test_server_process_waits_for_readiness_and_kills_its_group(tmp_path):
    from drmas_graph.served import free_port

    port = free_port()
    argv = _script(tmp_path, f"""
        import http.server, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(tmp_path / 'child.pid')!r}, "w").write(str(child.pid))
        time.sleep(0.5)
        http.server.ThreadingHTTPServer(("127.0.0.1", {port}), http.server.SimpleHTTPRequestHandler).serve_forever()
    """)
    server = ServerProcess(argv, url=f"http://127.0.0.1:{port}", ready_path="/", name="fake")
    assert server.wait_ready(30) > 0.3
    child = int((tmp_path / "child.pid").read_text())
    os.kill(child, 0)  # alive
    server.close()
    assert not server.alive()
    time.sleep(0.2)
    assert _gone(child)


def test_server_that_never_gets_ready_or_exits_reports_its_log(tmp_path):
    slow = ServerProcess(_script(tmp_path, "import time\nprint('loading shards...', flush=True)\ntime.sleep(60)\n"),
                         url="http://127.0.0.1:9", ready_path="/health", name="slow")
    with pytest.raises(ServerStartError, match=r"(?s)not ready after 1 s.*loading shards"):
        slow.wait_ready(1.0, poll_s=0.1)
    assert not slow.alive()
    crash = ServerProcess([sys.executable, "-c", "import sys; print('bad flag --foo'); sys.exit(3)"],
                          url="http://127.0.0.1:9", ready_path="/health", name="crash")
    with pytest.raises(ServerStartError, match=r"(?s)exited with code 3.*bad flag --foo"):
        crash.wait_ready(30, poll_s=0.1)


def test_server_is_stopped_when_the_interpreter_exits(tmp_path):
    pid_file = tmp_path / "pid"
    code = textwrap.dedent(f"""
        import sys
        from drmas_graph.served import ServerProcess
        s = ServerProcess([sys.executable, "-c", "import time; time.sleep(120)"], url="http://127.0.0.1:9",
                          ready_path="/", name="orphan")
        open({str(pid_file)!r}, "w").write(str(s.pid))
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=os.getcwd())
    time.sleep(0.2)
    assert _gone(int(pid_file.read_text()))
