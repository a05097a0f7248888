"""The roofline benchmark stays runnable and its numbers agree with each other (never a timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_roofline_quick_json_is_consistent(tmp_path):
    from drmas_graph.testing import tiny_model, tiny_tokenizer

    out_json = tmp_path / "roofline.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "benchmarks/bench_roofline.py", "--quick", "--model", "tiny",
                          "--dtypes", "float32,bfloat16", "--threads", "1", "--json", str(out_json)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out_json.read_text())
    model = tiny_model(tiny_tokenizer(), seed=0)
    embed = model.get_input_embeddings().weight.numel()  # untied: the lookup reads one row per token
    assert r["model"]["params"] == sum(p.numel() for p in model.parameters())
    assert r["model"]["params_read_per_step"] == r["model"]["params"] - embed
    assert r["weight_bytes_per_step"] == {"float32": 4 * r["model"]["params_read_per_step"],
                                          "bfloat16": 2 * r["model"]["params_read_per_step"]}
    bw = r["bandwidth"]
    assert bw["roofline_GBps"] == max(bw["copy_GBps"], bw["triad_GBps"]) > 0
    want = [(d, b) for d in ("float32", "bfloat16") for b in (1, 8, 16)]
    assert [(x["dtype"], x["batch"]) for x in r["runs"]] == want
    for x in r["runs"]:
        steps = x["decode_steps"]
        assert steps == x["new_tokens"] - 1 == 8
        assert x["weight_bytes_read"] == r["model"]["params_read_per_step"] * x["bytes_per_param"] * steps
        assert x["decode_s"] == pytest.approx(max(x["full_s"] - x["first_token_s"], 1e-9), rel=1e-9)
        assert x["tokens_per_s"] == pytest.approx(x["batch"] * steps / x["decode_s"], rel=1e-9)
        assert x["implied_GBps"] == pytest.approx(x["weight_bytes_read"] / x["decode_s"] / 1e9, rel=1e-9)
        assert x["roofline_fraction"] == pytest.approx(x["implied_GBps"] / bw["roofline_GBps"], rel=1e-9)
    # the printed table carries the same numbers
    first = r["runs"][0]
    assert f"| float32 | 1 | {first['tokens_per_s']:.1f} |" in out.stdout


def test_tied_embeddings_are_read_once_per_step():
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_roofline import params_read_per_step

    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())  # counts the shared matrix once
    assert params_read_per_step(model) == (params, params)  # the LM head reads the whole shared matrix
