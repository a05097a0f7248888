"""The roofline benchmark stays runnable and its numbers agree with each other (never a timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = os.environ.get("DRMAS_VLLM_PYTHON")


def _bench(tmp_path: Path, *args: str) -> tuple[dict, str]:
    out_json = tmp_path / "roofline.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "benchmarks/bench_roofline.py", "--quick", "--model", "tiny",
                          "--threads", "1", "--json", str(out_json), *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out_json.read_text()), out.stdout


def check_runs(r: dict, want: list[tuple[str, str, int]]) -> None:
    """Every row's numbers follow from its two timings, the parameter count and the roofline."""
    bw = r["bandwidth"]
    assert bw["roofline_GBps"] == max(bw["copy_GBps"], bw["triad_GBps"]) > 0
    assert [(x["engine"], x["dtype"], x["batch"]) for x in r["runs"]] == want
    for x in r["runs"]:
        steps = x["decode_steps"]
        assert steps == x["new_tokens"] - 1 == 8
        assert x["weight_bytes_per_step"] == r["weight_bytes_per_step"][x["dtype"]]
        assert x["weight_bytes_read"] == r["model"]["params_read_per_step"] * x["bytes_per_param"] * steps
        assert x["decode_s"] == pytest.approx(max(x["full_s"] - x["first_token_s"], 1e-9), rel=1e-9)
        assert x["tokens_per_s"] == pytest.approx(x["batch"] * steps / x["decode_s"], rel=1e-9)
        assert x["step_ms"] == pytest.approx(1000 * x["decode_s"] / steps, rel=1e-9)
        assert x["implied_GBps"] == pytest.approx(x["weight_bytes_read"] / x["decode_s"] / 1e9, rel=1e-9)
        assert x["roofline_fraction"] == pytest.approx(x["implied_GBps"] / bw["roofline_GBps"], rel=1e-9)


def test_bench_roofline_quick_json_is_consistent(tmp_path):
    from drmas_graph.testing import tiny_model, tiny_tokenizer

    r, stdout = _bench(tmp_path, "--dtypes", "float32,bfloat16")
    model = tiny_model(tiny_tokenizer(), seed=0, hidden_size=128)
    embed = model.get_input_embeddings().weight.numel()  # untied: the lookup reads one row per token
    assert r["model"]["params"] == sum(p.numel() for p in model.parameters())
    assert r["model"]["params_read_per_step"] == r["model"]["params"] - embed
    assert r["weight_bytes_per_step"] == {"float32": 4 * r["model"]["params_read_per_step"],
                                          "bfloat16": 2 * r["model"]["params_read_per_step"]}
    check_runs(r, [("embedded", d, b) for d in ("float32", "bfloat16") for b in (1, 8, 16)])
    assert "vllm" not in r
    # the printed table carries the same numbers
    first = r["runs"][0]
    assert f"| embedded | float32 | 1 | {first['tokens_per_s']:.1f} | {first['step_ms']:.1f} |" in stdout


def test_vllm_options_are_checked_before_anything_runs():
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_roofline import parse_args

    args = parse_args(["--vllm", "--vllm-python", "/x/python", "--model", "tiny", "--dtypes", "float32,bfloat16"])
    assert (args.vllm, args.vllm_python, args.dtypes, args.settle_s) == (True, "/x/python", ["float32", "bfloat16"], 2.0)
    assert parse_args(["--model", "tiny"]).vllm is False
    for bad in (["--dtypes", "bfloat16"], ["--model", "smollm2-random"]):  # vLLM: float32 only; no tokenizer
        with pytest.raises(SystemExit) as err:
            parse_args(["--vllm", "--vllm-python", "/x/python", "--model", "tiny", *bad])
        assert err.value.code == 2


def test_tied_embeddings_are_read_once_per_step():
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_roofline import params_read_per_step

    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())  # counts the shared matrix once
    assert params_read_per_step(model) == (params, params)  # the LM head reads the whole shared matrix


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.bench_vllm
def test_vllm_rows_next_to_the_embedded_ones(tmp_path):
    r, stdout = _bench(tmp_path, "--dtypes", "float32,bfloat16", "--batches", "1,4", "--vllm",
                       "--vllm-python", VLLM_PYTHON, "--settle-s", "0.5")
    check_runs(r, [("embedded", d, b) for d in ("float32", "bfloat16") for b in (1, 4)]
               + [("vllm", "float32", 1), ("vllm", "float32", 4)])
    v = r["vllm"]
    assert (v["dtype"], v["prefix_caching"], v["python"]) == ("float32", False, VLLM_PYTHON)
    assert "--no-enable-prefix-caching" in v["extra_args"] and v["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0-0"
    assert "vLLM: bfloat16 skipped: the vLLM half runs float32 only" in stdout
    last = r["runs"][-1]
    assert f"| vllm | float32 | 4 | {last['tokens_per_s']:.1f} | {last['step_ms']:.1f} |" in stdout
