"""The int8 benchmark stays runnable and its numbers agree with each other (never a timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_int8_quick_json_is_consistent(tmp_path):
    out_json = tmp_path / "int8.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "benchmarks/bench_int8.py", "--model", "tiny", "--batches", "1,4",
                          "--repeats", "1", "--threads", "1", "--json", str(out_json)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out_json.read_text())
    assert r["model"]["linear_layers"] == 2 * 7 + 1  # 2 layers of q, k, v, o, gate, up, down; the LM head
    assert [x["batch"] for x in r["runs"]] == [1, 4] and r["exactness_batch"] == 4
    for x in r["runs"]:
        assert x["float32_ms"] > 0 and x["int8_ms"] > 0
        assert x["int8_speedup"] == pytest.approx(x["float32_ms"] / x["int8_ms"], rel=1e-12)
    f32, i8 = r["exactness"]["float32"], r["exactness"]["int8"]
    shapes = 5  # q/o (128x128), k/v (64x128), gate/up, down, the LM head
    assert f32["rows"] == i8["rows"] == 4 * shapes
    assert f32["rows_invariant"] == f32["rows"]  # the engine's float32 linear: a row's bits whatever its batch
    assert f32["rel_error_vs_float32"] < 1e-5 < i8["rel_error_vs_float32"] < 0.5
    last = out.stdout.strip().splitlines()[-1]
    assert last == (f"int8 linear speed-up at batch 4: {r['runs'][1]['int8_speedup']:.2f}x; rows batch-invariant: "
                    f"float32 {f32['rows']}/{f32['rows']}, int8 {i8['rows_invariant']}/{i8['rows']}")
