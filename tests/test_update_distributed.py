"""Two processes (torchrun, gloo) each given part of the samples take exactly the step of one process given
all of them: DeepSpeed ZeRO-2, and the torch backend with two mini-batches per update (one global shuffle)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from drmas_graph.train.optim.update import ModelUpdater, UpdateSettings
from tests._dist_worker import AGENT_SETTINGS, CASES, SETTINGS, build_model, checksum, make_samples

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def update_in_process(backend: str, zero_stage: int, base: UpdateSettings = SETTINGS, n_updates: int = 1):
    """The updates of one process given all seven samples: (metrics of the last, parameters, checksum)."""
    model = build_model()
    samples = make_samples(model)
    settings = UpdateSettings(**{**vars(base), "backend": backend, "zero_stage": zero_stage})
    updater = ModelUpdater(model, name="m", settings=settings, agent_settings=AGENT_SETTINGS)
    for _ in range(n_updates):
        metrics = updater.update(samples)
    return metrics.to_dict(), {k: v.detach().clone() for k, v in model.state_dict().items()}, checksum(model)


def run_workers(tmp_path: Path, case: str) -> tuple[dict, dict]:
    """Two torchrun workers on CASE: (rank 0's result.json, its parameters)."""
    # torchrun sets the rendezvous variables for its workers; drop any left by in-process DeepSpeed.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(ROOT / "tests" / "_dist_worker.py"), str(tmp_path), case]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2
    return result, torch.load(tmp_path / "params.pt", weights_only=True)


def agent_grad_norms(metrics: dict) -> set[str]:
    """The per-agent gradient norms among `metrics`' names (`agent/<a>/grad_norm`)."""
    return {k for k in metrics if k.startswith("agent/") and k.endswith("/grad_norm")}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_two_process_zero2_update_equals_one_process_update(tmp_path):
    # In-process references first. The DeepSpeed one also builds DeepSpeed's shared-memory op (once, ~60 s on
    # a fresh machine); workers that find no build would build it themselves, one at a time (torch's lock).
    ds_metrics, ds_params, _ = update_in_process("deepspeed", 2)
    want, want_params, want_checksum = update_in_process("torch", 0)
    initial = build_model().state_dict()
    assert max((want_params[k] - initial[k]).abs().max().item() for k in initial) > 1e-4  # the step moved
    for key, value in want_params.items():
        torch.testing.assert_close(ds_params[key], value, atol=1e-6, rtol=0, msg=key)

    result, got_params = run_workers(tmp_path, "zero2")
    for key, value in want_params.items():
        torch.testing.assert_close(got_params[key], value, atol=1e-5, rtol=0, msg=key)
    assert result["checksum"] == pytest.approx(want_checksum, rel=1e-6)
    got = result["metrics"]
    # per-agent gradient norms are not readable with two agents on one model under ZeRO >= 1 or several
    # processes (docs/reference/metrics.md): only the one-process torch update logs them
    assert set(got) == set(ds_metrics) == set(want) - agent_grad_norms(want)
    assert agent_grad_norms(want) == {"agent/a/grad_norm", "agent/b/grad_norm"}
    assert got["model/m/n_samples"] == 7 and got["agent/b/n_samples"] == 3
    for key in got:  # loss, pre-clip grad norm and every per-agent metric, over both processes
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key
        assert ds_metrics[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key


@pytest.mark.slow
def test_two_processes_form_the_mini_batches_of_one_process(tmp_path):
    """n_minibatches: 2 over two updates (four optimizer steps): the shuffle that cuts the samples into
    mini-batches is one for all processes, so 2 processes take the steps of 1 (a per-rank shuffle formed
    other mini-batches: the second AdamW step then differs)."""
    settings, n_updates = CASES["minibatches"]
    want, want_params, want_checksum = update_in_process("torch", 0, settings, n_updates)
    result, got_params = run_workers(tmp_path, "minibatches")
    for key, value in want_params.items():
        torch.testing.assert_close(got_params[key], value, atol=1e-5, rtol=0, msg=key)
    assert result["checksum"] == pytest.approx(want_checksum, rel=1e-6)
    got = result["metrics"]
    assert got["model/m/n_minibatches"] == want["model/m/n_minibatches"] == 2
    assert set(got) == set(want) - agent_grad_norms(want)  # not readable under several processes
    for key in got:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key


def test_a_gloo_process_group_is_left_before_the_interpreter_finalizes():
    """A process that exits with its gloo group alive can die of SIGABRT ("terminate called without an
    active exception": gloo threads take the GIL during finalization; 2 of 20 bare 2-process launches here,
    and once this file's 2-process test). The group the updater joins is destroyed by an atexit handler,
    which runs before finalization: a handler registered earlier (so run later) sees no group left."""
    code = textwrap.dedent("""
        import atexit, torch
        from drmas_graph.train.engines._engines import _import_deepspeed, _init_process_group
        atexit.register(lambda: print("group alive at exit:", torch.distributed.is_initialized()))
        _init_process_group(_import_deepspeed())
        torch.distributed.all_reduce(torch.ones(3))
        print("backend:", torch.distributed.get_backend())
    """)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend: gloo" in proc.stdout
    assert "group alive at exit: False" in proc.stdout, proc.stdout
