"""The constrained-decoding benchmark stays runnable and its numbers agree with each other (never a timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_grammar_quick_json_is_consistent(tmp_path):
    out_json = tmp_path / "grammar.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "benchmarks/bench_grammar.py", "--quick", "--model", "tiny", "--threads",
                          "1", "--json", str(out_json)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out_json.read_text())
    xgr = r["libraries"]["xgrammar"]
    assert set(xgr["schemas"]) == {"critic", "calculator", "order", "json_object", "tools_auto"}
    for s in xgr["schemas"].values():  # a valid reply walked token by token (each accepted), end of turn included
        assert s["tokens"] >= 2 and s["compile_ms"] > 0 and s["mask_us_mean"] > 0 and s["mask_us_p90"] > 0
    for lib in ("llguidance", "outlines_core"):  # measured when installed, else said so
        assert "schemas" in r["libraries"][lib] or "skipped" in r["libraries"][lib]
    assert [row["batch"] for row in r["engine"]] == [1, 4]
    for row in r["engine"]:
        assert row["mask_s"] == pytest.approx(row["fill_s"] + row["apply_s"], rel=1e-12)
        assert row["ratio"] == pytest.approx(row["mask_s"] / row["step_s"], rel=1e-12)
    u = r["update"]
    assert u["samples"] == 4 and u["ratio"] == pytest.approx(u["constrained_s"] / u["free_s"] - 1, rel=1e-12)
    assert "update: logprobs of 4 samples" in out.stdout
