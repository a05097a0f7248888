"""Multi-process train_graph: 2 gloo processes on CPU under torchrun (and the deepspeed launcher) shard the
task groups, train exactly like one process on the same groups, resume after a kill (at the same or another
world size), and leave every rank's episodes in the run's trace store exactly once."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drmas_graph.engine import _world, local_device
from drmas_graph.train.engines import distributed as _distributed
from drmas_graph.errors import ConfigError
from drmas_graph.traces.store import TraceStore
from drmas_graph.types import Episode, Turn
from tests import _dist_train_worker as worker

ROOT = Path(__file__).resolve().parents[1]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
ZERO2 = {"backend": "deepspeed", "zero_stage": 2}


@pytest.fixture
def launched(monkeypatch):
    """`launched(n, LOCAL_RANK=...)` makes this process look like one of n a launcher started, before it joins
    their process group: the launcher's variables then answer the world size (`_world`). Earlier tests may
    have left this pytest process in a 1-process DeepSpeed group, which would answer instead."""

    def as_worker(world_size: int, **env: str) -> None:
        monkeypatch.setattr(_world, "group_initialized", lambda: False)
        for key, value in {"WORLD_SIZE": str(world_size), **env}.items():
            monkeypatch.setenv(key, value)

    return as_worker


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_env() -> dict[str, str]:
    """This environment without rendezvous variables (the launcher sets its workers' own)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT", "LOCAL_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", WEAVE_DISABLED="true", TOKENIZERS_PARALLELISM="false")
    return env


def torchrun(tmp_path: Path, name: str, runs: list[dict]) -> subprocess.CompletedProcess:
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps({"runs": runs}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(ROOT / "tests" / "_dist_train_worker.py"), str(spec)]
    return subprocess.run(cmd, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=600)


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step_{step:06d}" / "tiny" / "model" / "model.safetensors")


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=atol, rtol=0, msg=key)


def rows(run_dir: Path, sql: str) -> list[tuple]:
    conn = sqlite3.connect(run_dir / "traces.db")
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")
def test_two_processes_train_like_one_resume_after_a_kill_and_merge_their_traces(tmp_path):
    # R: one process (this one, plain torch AdamW), 2 steps of 2 groups x 4 episodes, a checkpoint per step.
    ref_dir = tmp_path / "ref"
    worker.train(ref_dir, steps=2)
    want = weights(ref_dir, 2)
    moved = max((want[k] - v).abs().max().item() for k, v in weights(ref_dir, 1).items())
    assert moved > 1e-4  # step 2 changed the weights: the comparisons below are not vacuous
    # C: R killed after its first checkpoint; two processes resume it below (world size 1 -> 2).
    shutil.copytree(ref_dir, tmp_path / "c")
    shutil.rmtree(tmp_path / "c" / "checkpoints" / "step_000002")

    # Launch 1: A, two processes on DeepSpeed ZeRO-2, 2 steps; then B, the same, but rank 1 dies in step 2.
    a_dir, b_dir, c_dir = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    first = torchrun(tmp_path, "first", [{"run_dir": str(a_dir), "steps": 2, "update": ZERO2},
                                         {"run_dir": str(b_dir), "steps": 2, "update": ZERO2, "kill_in_step": 1}])
    assert first.returncode != 0 and "exitcode  : 3" in first.stderr, first.stderr[-5000:]
    assert (b_dir / "checkpoints" / "step_000001").is_dir() and not (b_dir / "checkpoints" / "step_000002").exists()
    assert (b_dir / "traces.rank1.db").exists()  # rank 1's episodes of the killed step, not merged yet
    # Launch 2: B resumed by two processes; C resumed by two processes.
    second = torchrun(tmp_path, "second", [{"run_dir": str(b_dir), "steps": 2, "resume": True, "update": ZERO2},
                                           {"run_dir": str(c_dir), "steps": 2, "resume": True}])
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-8000:]

    # Weights: 2 processes == 1 process on the same groups; killed-and-resumed == uninterrupted.
    assert_same(weights(a_dir, 2), want, atol=1e-5)
    assert_same(weights(b_dir, 2), weights(a_dir, 2), atol=1e-6)
    assert_same(weights(c_dir, 2), want, atol=1e-5)

    # Metrics are reduced over both ranks, identical on both, and written once by rank 0.
    histories = [json.loads((a_dir / f"history_rank{r}.json").read_text()) for r in (0, 1)]
    assert [h["world_size"] for h in histories] == [2, 2]
    for h in histories:
        assert [r["episodes"] for r in h["history"]] == [8, 8]  # 2 groups x 4, one group per rank
        assert [(e["step"], e["tasks"]) for e in h["evals"]] == [(0, 2), (2, 2)]
        assert h["history"][0]["agent/solver/calls"] == 8
    for key in ("reward/team_mean", "agent/solver/advantage_std", "model/tiny/grad_norm", "agent/verifier/pg_loss"):
        assert histories[0]["history"][1][key] == histories[1]["history"][1][key], key
    lines = [json.loads(x) for x in (a_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "episodes" in x] == [0, 1]
    assert [x["step"] for x in lines if "eval/avg@k" in x] == [0, 2]

    # Traces: every episode of both ranks in traces.db exactly once, the rank files merged and removed.
    for run in (a_dir, b_dir, c_dir):
        assert not list(run.glob("traces.rank*")), run
    for step in (0, 1):
        groups = rows(a_dir, f"SELECT group_id, count(*) FROM episodes WHERE step = {step} GROUP BY group_id")
        assert len(groups) == 2 and all(n == 4 for _, n in groups)  # rank 0's group and rank 1's group
    assert rows(a_dir, "SELECT count(*), count(DISTINCT id) FROM episodes") == [(8 + 8 + 2 * 4, 8 + 8 + 2 * 4)]
    assert rows(a_dir, "SELECT count(*) FROM turns") == [(2 * 24,)]  # solver + verifier per episode
    with TraceStore(a_dir / "traces.db", readonly=True) as store:  # training data came along with the copy
        rank1_group = max(g for g, _ in rows(a_dir, "SELECT group_id, 1 FROM episodes WHERE step = 1"))
        episode = next(store.iter_episodes(step=1, task_id=rank1_group.split(":")[-1]))
        assert episode.advantages is not None and len(episode.advantages) == 2 and episode.rewards
    # B: the killed step's episodes of both ranks are kept (untrained), the resumed ones trained once.
    assert rows(b_dir, "SELECT step, count(*) FROM episodes WHERE step IS NOT NULL GROUP BY step") == [(0, 8), (1, 8)]
    killed_rank1 = rows(b_dir, "SELECT count(*) FROM episodes WHERE step IS NULL AND group_id LIKE 'train:1:%'")
    assert killed_rank1[0][0] >= 1


def test_tasks_per_step_must_divide_over_the_processes(launched, tmp_path):
    launched(4)
    with pytest.raises(ConfigError, match=r"tasks_per_step=6 is not divisible by the number of processes \(4\).*"
                                          r"multiple of 4 \(e\.g\. 8\) or launch 1 or 2 or 3 or 6 processes"):
        worker.train_graph(None, None, worker.config(tmp_path / "run", steps=1), tasks_per_step=6)


def test_resume_at_another_world_size_is_refused_only_for_partitioned_optimizer_state():
    _distributed.check_resume_world(2, 1, {"m": 0})  # whole optimizer state on every rank: any world size
    _distributed.check_resume_world(None, 2, {})  # checkpoints without a world size were saved by 1 process
    _distributed.check_resume_world(2, 2, {"m": 2})
    with pytest.raises(ConfigError, match=r"saved by 2 processes and this run has 1.*m \(zero_stage=2\).*"
                                          r"resume with 2 processes"):
        _distributed.check_resume_world(2, 1, {"m": 2, "other": 0})


def _episode(group: str) -> Episode:
    turn = Turn(agent="a", node="n", step=1, index=0, messages=(), prompt_ids=(1, 2), response_ids=(3,),
                response_logprobs=(-0.5,), response_text="x")
    return Episode(task_id=group.split(":")[-1], group_id=group, turns=[turn])


def test_merge_copies_each_rank_episode_once_with_its_training_data(tmp_path):
    main, other = TraceStore(tmp_path / "traces.db"), TraceStore(tmp_path / "traces.rank1.db")
    mine, theirs = _episode("train:0:t0"), [_episode("train:0:t1"), _episode("train:0:t1")]
    main.write_episode(mine)
    for ep in theirs:
        other.write_episode(ep)
        ep.rewards, ep.turn_rewards, ep.advantages = {"a": 1.0}, [1.0], [0.5]
    other.record_training(0, theirs)
    assert _distributed.merge_traces(tmp_path) == 2
    late = _episode("eval:1:t2")
    other.write_episode(late)
    assert _distributed.merge_traces(tmp_path) == 1  # only what is new
    assert _distributed.merge_traces(tmp_path) == 0
    assert [e.id for e in main.episodes()] == [mine.id, theirs[0].id, theirs[1].id, late.id]
    copied = main.load_episode(theirs[1].id)
    assert copied.advantages == [0.5] and copied.rewards == {"a": 1.0} and copied.turns[0].response_ids == (3,)
    assert main.summary(theirs[0].id).step == 0
    other.close()  # a leftover rank file (e.g. of a killed run): merged and removed at the end of a run
    _distributed.remove_rank_stores(tmp_path, other.close)
    assert not list(tmp_path.glob("traces.rank*")) and len(main) == 4
    main.close()


CLI_CONFIG = """\
name: launched
run_dir: {run_dir}
graph: tests._graphs:solver_verifier
env: tests._envs:ParityEnv
models:
  tiny: {{tiny: {{seed: 0}}}}
agents:
  solver: {{model: tiny, sampling: {{max_new_tokens: 4}}}}
  verifier: {{model: tiny, sampling: {{max_new_tokens: 4}}}}
update: {{lr: 0.001, backend: deepspeed, zero_stage: 2}}
steps: 1
tasks_per_step: 2
group_size: 2
eval: {{k: 1, n_tasks: 2, before_training: false}}
logging: {{progress: false, tensorboard: false}}
"""


@pytest.mark.slow
@needs_deepspeed
def test_cli_train_under_the_deepspeed_launcher_then_resumed_under_torchrun(tmp_path):
    run_dir = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CLI_CONFIG.format(run_dir=run_dir))
    deepspeed = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                 str(free_port()), "--module", "drmas_graph.cli", "train", str(cfg)]
    proc = subprocess.run(deepspeed, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    assert "'--local_rank=1', 'train'" in proc.stdout + proc.stderr  # what the launcher passes
    assert proc.stdout.count("run folder:") == 1  # rank 0 alone reports
    ckpt = run_dir / "checkpoints" / "step_000001" / "tiny"
    partitions = sorted(p.name for p in (ckpt / "deepspeed" / "state").glob("*optim_states.pt"))
    assert len(partitions) == 2, partitions  # ZeRO-2: each rank saved its optimizer partition
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["episodes"]) for r in records if "episodes" in r] == [(0, 4)]  # both ranks' groups

    torchrun_cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                    "-m", "drmas_graph.cli", "train", str(cfg), "--set", "resume=true", "--set", "steps=2"]
    proc = subprocess.run(torchrun_cmd, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["episodes"]) for r in records if "episodes" in r] == [(0, 4), (1, 4)]
    assert rows(run_dir, "SELECT step, count(*) FROM episodes GROUP BY step") == [(None, 4), (0, 4), (1, 4)]
    assert not list(run_dir.glob("traces.rank*"))


@pytest.mark.slow
def test_two_processes_roll_out_through_shared_servers_and_rank_0_pushes_the_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from drmas_graph.testing import tiny_model, tiny_tokenizer
    from tests.sglang_double import SGLangDouble

    tokenizer, base = tiny_tokenizer(), tmp_path / "base"
    tiny_model(tokenizer, seed=0).save_pretrained(base)
    tokenizer.save_pretrained(base)
    double = SGLangDouble(str(base), weight_version="0").start()
    try:
        run_dir = tmp_path / "run"
        sampling = {"max_new_tokens": 4}
        served = {"models": {"m": {"path": str(base), "serve": {"engine": "sglang", "urls": [double.url]}}},
                  "agents": {"solver": {"model": "m", "sampling": sampling},
                             "verifier": {"model": "m", "sampling": sampling}},
                  "group_size": 2, "eval": {"k": 1, "n_tasks": 2, "before_training": False}}
        proc = torchrun(tmp_path, "served", [{"run_dir": str(run_dir), "steps": 2, "config": served}])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
        pushed = [body["weight_version"] for path, body in double.requests if path == "POST /update_weights_from_disk"]
        assert pushed == ["1", "2"]  # one push per step, by rank 0 (not one per process)
        generated = [path for path, _ in double.requests if path == "POST /generate"]
        assert len(generated) == 2 * (2 * 2 * 2) + 2 * 2  # steps x episodes x calls + the final eval: both ranks
        trained = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step_000002" / "m" / "model")
        served_weights = double.model.state_dict()
        assert all(torch.equal(v, served_weights[k]) for k, v in trained.state_dict().items())
        versions = rows(run_dir, "SELECT e.step, group_concat(DISTINCT t.policy_version) FROM episodes e "
                                 "JOIN turns t ON t.episode_id = e.id WHERE e.step IS NOT NULL GROUP BY e.step")
        assert versions == [(0, "0"), (1, "1")]  # rank 1 sampled step 1 from the weights rank 0 pushed
    finally:
        double.stop()


def test_serve_launch_is_refused_under_a_multi_process_launcher(launched):
    launched(2)
    with pytest.raises(ConfigError, match=r"models\.m\.serve\.launch: true would start one server per process.*"
                                          r"serve\.urls"):
        _distributed.check_no_launch({"m": True, "other": False})
    _distributed.check_no_launch({"other": False})


def test_zero3_with_an_embedded_policy_is_refused_under_a_multi_process_launcher(launched, tmp_path):
    from drmas_graph.config import TrainConfig
    from drmas_graph.train.loop.trainer import Trainer
    from tests import _graphs
    from tests._envs import ParityEnv
    from tests.test_instrument import Unreachable

    cfg = TrainConfig.model_validate(dict(
        run_dir=str(tmp_path), tasks_per_step=2, models={"m": {"tiny": {}}},
        agents={"solver": {"model": "m"}, "verifier": {"model": "m"}},
        update={"backend": "deepspeed", "zero_stage": 3}, logging={"progress": False, "tensorboard": False}))
    launched(2)
    with pytest.raises(ConfigError, match=r"models\.m: update\.zero_stage 3 under 2 processes needs served rollouts"):
        Trainer(_graphs.solver_verifier(Unreachable()).compile(), ParityEnv(), cfg)
    _distributed.check_zero3_served([])  # nothing embedded on ZeRO-3: fine


def test_each_process_takes_its_own_gpu(launched):
    assert local_device("cuda") == "cuda"  # one process: as configured
    launched(2, LOCAL_RANK="1")
    assert local_device("cuda") == "cuda:1" and local_device("cpu") == "cpu"
    with pytest.raises(ConfigError, match=r"models\.m\.device: 'cuda:0' would put all 2 processes on one GPU; "
                                          r"set it to 'cuda'"):
        local_device("cuda:0", "models.m.device")


def test_an_evaluation_under_a_launcher_ignores_tasks_per_step_and_hands_rank_0_every_rollout(tmp_path):
    """Evaluation-only runs are not refused over tasks_per_step (they shard tasks, any number), and rank 0's
    rollouts (what its Weave export logs) hold every rank's tasks, agreeing with the merged record (rev3_c)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(ROOT / "tests" / "_dist_eval_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "eval.json").read_text())
    record, rollouts = out["record"], out["rollouts"]
    assert record["tasks"] == 5 and record["k"] == 2 and record["failed_episodes"] == 0
    by_task: dict[str, list[bool]] = {}
    for row in rollouts:
        by_task.setdefault(row["task"], []).append(row["ok"])
    assert sorted(by_task) == [f"test-{i}" for i in range(5)] and all(len(v) == 2 for v in by_task.values())
    assert [row["task"] for row in rollouts[:4]] == ["test-0", "test-0", "test-1", "test-1"]  # rank 0's first
    assert sum(sum(v) / 2 for v in by_task.values()) / 5 == pytest.approx(record["avg@k"])
    assert sum(any(v) for v in by_task.values()) / 5 == pytest.approx(record["pass@k"])
    assert [row["rewards"] for row in rollouts if row["task"] == "test-4"] == [None, None]  # NaN reward: no score
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:  # rank 1's episodes, as stored
        for row in rollouts:
            stored = store.load_episode(row["episode"])
            assert stored.task_id == row["task"] and row["final_state"]["answer"] == stored.final_state["answer"]


def test_one_world_size_before_and_after_the_process_group():
    """The launcher's WORLD_SIZE / RANK answer until this process joins a group, the group after, for every
    caller (checks before joining and collectives after can never disagree). A fresh process: a group lives
    as long as its process."""
    code = f"""
import torch
from drmas_graph.train.engines import _engines, distributed as _distributed
assert (_distributed.world_size(), _distributed.rank(), _distributed.is_main()) == (2, 1, False)
assert (_engines._world_size(), _engines._rank()) == (2, 1)
assert _distributed.owned(list("abcd")) == [(2, "c"), (3, "d")]
_distributed.check_divisible(4)
torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
assert (_distributed.world_size(), _distributed.rank(), _distributed.is_main()) == (1, 0, True)
assert (_engines._world_size(), _engines._rank()) == (1, 0)
torch.distributed.destroy_process_group()
print("ok")
"""
    env = {**launcher_env(), "WORLD_SIZE": "2", "RANK": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.slow
def test_two_processes_train_one_step_off_like_one_and_resume_after_a_kill(tmp_path):
    """Asynchronous training (`async.max_staleness: 1`) under torchrun: each rank rolls out its groups of step s+1
    while the ranks update together on step s; the weights equal one process's, also after rank 1 dies while
    scoring step 2 (in its rollout thread) and the run is resumed; every rank's episodes are merged once."""
    extra = {"async": {"max_staleness": 1}}
    ref_dir, a_dir, b_dir = tmp_path / "ref", tmp_path / "a", tmp_path / "b"
    worker.train(ref_dir, steps=3, extra=extra)
    want = weights(ref_dir, 3)
    first = torchrun(tmp_path, "first", [{"run_dir": str(a_dir), "steps": 3, "config": extra},
                                         {"run_dir": str(b_dir), "steps": 3, "config": extra, "kill_in_step": 2}])
    assert first.returncode != 0 and "exitcode  : 3" in first.stderr, first.stderr[-5000:]
    second = torchrun(tmp_path, "second", [{"run_dir": str(b_dir), "steps": 3, "resume": True, "config": extra}])
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-8000:]
    assert_same(weights(a_dir, 3), want, atol=1e-5)
    assert_same(weights(b_dir, 3), weights(a_dir, 3), atol=1e-6)
    histories = [json.loads((a_dir / f"history_rank{r}.json").read_text())["history"] for r in (0, 1)]
    assert [h["async/staleness_mean"] for h in histories[0]] == [0.0, 1.0, 1.0]
    assert histories[0][2]["agent/solver/is_weight_mean"] == histories[1][2]["agent/solver/is_weight_mean"]
    assert not list(a_dir.glob("traces.rank*"))
    for step in range(3):
        groups = rows(a_dir, f"SELECT group_id, count(*) FROM episodes WHERE step = {step} GROUP BY group_id")
        assert len(groups) == 2 and all(n == 4 for _, n in groups)
    assert rows(a_dir, "SELECT count(*), count(DISTINCT id) FROM episodes") == [(3 * 8 + 2 * 4, 3 * 8 + 2 * 4)]


@pytest.mark.slow
def test_two_processes_train_free_running(tmp_path):
    """`async.schedule: free` under torchrun: each rank starts its groups of steps s+1..s+2 while the ranks update
    together on step s and installs each update's weights at once; the ranks agree on every update (the same
    gradient norm and staleness), staleness stays within max_staleness and every rank's episodes are merged once."""
    extra = {"async": {"max_staleness": 2, "schedule": "free"}}
    a_dir = tmp_path / "a"
    run = torchrun(tmp_path, "free", [{"run_dir": str(a_dir), "steps": 4, "config": extra}])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-8000:]
    histories = [json.loads((a_dir / f"history_rank{r}.json").read_text())["history"] for r in (0, 1)]
    norms = [[v for k, v in sorted(h.items()) if k.endswith("/grad_norm")] for h in histories[0]]
    assert norms == [[v for k, v in sorted(h.items()) if k.endswith("/grad_norm")] for h in histories[1]]
    assert all(n and all(x > 0 for x in n) for n in norms)
    assert [h["async/staleness_max"] for h in histories[0]] == [h["async/staleness_max"] for h in histories[1]]
    assert all(h["async/staleness_max"] <= 2 and h["async/dropped_groups"] == 0 for h in histories[0])
    assert histories[0][0]["async/staleness_max"] == 0
    assert not list(a_dir.glob("traces.rank*"))
    for step in range(4):
        groups = rows(a_dir, f"SELECT group_id, count(*) FROM episodes WHERE step = {step} GROUP BY group_id")
        assert len(groups) == 2 and all(n == 4 for _, n in groups)
        versions = rows(a_dir, f"SELECT DISTINCT t.policy_version FROM turns t JOIN episodes e ON t.episode_id = e.id "
                               f"WHERE e.step = {step}")
        assert all(max(0, step - 2) <= v <= step for (v,) in versions), (step, versions)


def test_a_merge_reads_a_snapshot_and_later_merges_bring_what_a_rank_wrote_since(tmp_path, monkeypatch):
    """Suspected in issue 48 (async.schedule free, several processes): rank 1's background threads go on writing
    while rank 0 merges, and a judgement, an error or an evaluation's rewards written into an episode after a merge
    copied it never reached traces.db (merges copied only episodes traces.db lacked). Rank 1 now snapshots its
    store (an episode written after the snapshot waits for the next merge, never half-read), and a later merge
    copies those late writes, without replacing anything rank 0 wrote."""
    main, other = TraceStore(tmp_path / "traces.db"), TraceStore(tmp_path / "traces.rank1.db")
    scored, failed, evaluated, trained = (_episode(g) for g in ("train:1:a", "train:1:b", "eval:1:c", "train:1:d"))
    for ep in (scored, failed, evaluated, trained):
        other.write_episode(ep)
    monkeypatch.setattr(_distributed, "world_size", lambda: 2)
    monkeypatch.setattr(_distributed, "barrier", lambda **kw: None)
    monkeypatch.setattr(_distributed, "is_main", lambda: False)
    monkeypatch.setattr(_distributed, "rank", lambda: 1)
    assert _distributed.merge_traces(tmp_path) == 0  # rank 1: its snapshot
    late = _episode("train:2:e")
    other.write_episode(late)  # after the snapshot: a background rollout of a later step
    monkeypatch.setattr(_distributed, "is_main", lambda: True)
    monkeypatch.setattr(_distributed, "rank", lambda: 0)
    assert _distributed.merge_traces(tmp_path) == 4 and late.id not in {e.id for e in main.episodes()}
    # rank 1 scores step 1 after the merge; rank 0 records the trained one's training data itself
    other.update_training(scored.id, step=None, judgement={"mode": "group", "scores": [1.0]})
    other.update_training(failed.id, step=None, error="JudgeError: no usable score after 3 attempts")
    other.update_training(evaluated.id, step=None, rewards={"a": 0.5}, turn_rewards=[0.5])
    trained.rewards, trained.turn_rewards, trained.advantages = {"a": 1.0}, [1.0], [0.25]
    main.record_training(1, [trained])
    other.update_training(trained.id, step=None, rewards={"a": 0.0}, turn_rewards=[0.0])  # never replaces rank 0's
    monkeypatch.setattr(_distributed, "is_main", lambda: False)
    monkeypatch.setattr(_distributed, "rank", lambda: 1)
    _distributed.merge_traces(tmp_path)
    monkeypatch.setattr(_distributed, "is_main", lambda: True)
    monkeypatch.setattr(_distributed, "rank", lambda: 0)
    assert _distributed.merge_traces(tmp_path) == 1  # the late episode
    assert main.load_episode(scored.id).judgement == {"mode": "group", "scores": [1.0]}
    assert main.load_episode(failed.id).error == "JudgeError: no usable score after 3 attempts"
    copied = main.load_episode(evaluated.id)
    assert copied.rewards == {"a": 0.5} and copied.turn_rewards == [0.5] and main.summary(evaluated.id).reward == 0.5
    kept = main.load_episode(trained.id)
    assert kept.rewards == {"a": 1.0} and kept.turn_rewards == [1.0] and kept.advantages == [0.25]
    other.close()
    _distributed.remove_rank_stores(tmp_path, other.close)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("traces.rank")] and len(main) == 5
    main.close()
