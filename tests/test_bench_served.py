"""bench_served.py's demo workload stays the demo's (its config, tasks, sampling) and its numbers agree with each
other (never a timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = os.environ.get("DRMAS_VLLM_PYTHON")


def _bench(tmp_path: Path, *args: str) -> tuple[dict, str]:
    out_json = tmp_path / "served.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "WEAVE_DISABLED": "true"}
    out = subprocess.run([sys.executable, "benchmarks/bench_served.py", "--model", "tiny", "--json", str(out_json),
                          *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out_json.read_text()), out.stdout


def _demo_sampling() -> dict:
    agents = yaml.safe_load((ROOT / "graphs/math/demo.yaml").read_text())["agents"]
    return {a: {"temperature": c["sampling"]["temperature"], "top_p": 1.0, "top_k": 0,
                "max_new_tokens": c["sampling"]["max_new_tokens"]} for a, c in sorted(agents.items())}


def _check_backend(r: dict, steps: int, policy: str) -> None:
    assert r["policy"] == policy
    assert r["sampling"] == _demo_sampling()  # solver and verifier: T 0.7, 12 tokens, as the demo samples
    assert len(r["steps"]) == steps
    for s in r["steps"]:
        assert s["episodes"] + s["dropped"] == 4 * 8  # tasks_per_step x group_size of demo.yaml
        assert s["turns"] >= s["episodes"] and s["response_tokens"] <= 12 * s["turns"]
    for key in ("wall_s", "episodes", "turns", "response_tokens", "prompt_tokens", "dropped"):
        assert r[key] == pytest.approx(sum(s[key] for s in r["steps"]), rel=1e-12)
    assert r["episodes/s"] == pytest.approx(r["episodes"] / r["wall_s"], rel=1e-12)
    assert r["tokens/s"] == pytest.approx(r["response_tokens"] / r["wall_s"], rel=1e-12)
    assert r["tokens/episode"] == pytest.approx(r["response_tokens"] / r["episodes"], rel=1e-12)
    assert r["prompt_tokens/turn"] == pytest.approx(r["prompt_tokens"] / r["turns"], rel=1e-12)


def test_demo_workload_embedded_numbers_are_consistent(tmp_path):
    r, stdout = _bench(tmp_path, "--backend", "embedded", "--steps", "1")
    assert (r["workload"], r["model"], r["steps"], list(r["backends"])) == ("demo", "tiny", 1, ["embedded"])
    e = r["backends"]["embedded"]
    _check_backend(e, 1, "TransformersPolicy")
    assert f"embedded   {e['episodes']:8d} {e['wall_s']:7.1f} {e['episodes/s']:10.2f} {e['tokens/s']:9.1f}" in stdout


def test_a_workloads_options_are_refused_with_the_other_workload():
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_served import parse_args

    args = parse_args([])
    assert (args.workload, args.model, args.steps, args.backend, args.vllm_cores) == ("demo", "smollm2", 3, "both", "all")
    args = parse_args(["--workload", "math"])
    assert (args.episodes, args.repeats, args.max_new_tokens, args.model_path) == (16, 3, 32, None)
    with pytest.raises(SystemExit) as err:
        parse_args(["--workload", "math", "--steps", "2"])
    assert err.value.code == 2
    with pytest.raises(SystemExit):
        parse_args(["--episodes", "8", "--max-new-tokens", "24"])


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.bench_vllm
def test_demo_workload_side_by_side_with_vllm(tmp_path):
    r, stdout = _bench(tmp_path, "--steps", "1", "--vllm-python", VLLM_PYTHON)
    e, v = r["backends"]["embedded"], r["backends"]["vllm"]
    _check_backend(e, 1, "TransformersPolicy")
    _check_backend(v, 1, "VLLMPolicy")
    assert r["ratio"] == {"episodes/s": e["episodes/s"] / v["episodes/s"], "tokens/s": e["tokens/s"] / v["tokens/s"]}
    assert f"embedded / vLLM: {r['ratio']['episodes/s']:.2f}x episodes/s" in stdout


def test_vllm_computes_on_the_embedded_engines_cores_unless_told_otherwise(monkeypatch):
    sys.path.insert(0, str(ROOT))
    import torch

    from benchmarks.bench_served import environment, vllm_core_env

    assert vllm_core_env("all") == {"VLLM_CPU_OMP_THREADS_BIND": f"0-{torch.get_num_threads() - 1}",
                                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert vllm_core_env("auto") == {}
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with environment(vllm_core_env("all")):  # what a server the trainer launches inherits
        assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and "VLLM_CPU_OMP_THREADS_BIND" in os.environ
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
