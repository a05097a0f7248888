"""The memory benchmark and the GPU check stay runnable (numbers are measured by running them, not here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_bench_memory_reports_a_row_per_mode():
    out = _run("benchmarks/bench_memory.py", "--size", "tiny", "--modes", "torch,full-logits", "--samples", "2",
               "--prompt", "8", "--response", "8")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.stdout.splitlines()
            if line.startswith("| torch") or line.startswith("| full-logits")}
    assert set(rows) == {"torch", "full-logits"}
    for cells in rows.values():
        assert float(cells[2]) > 0 and float(cells[3]) > 0 and float(cells[4]) > 0  # params M, peak MB, tokens/s
    assert rows["torch"][5] == rows["full-logits"][5]  # the same grad norm: the chunked head changes no number


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on a GPU machine the check runs for real")
def test_gpu_check_skips_clearly_without_a_gpu():
    out = _run("benchmarks/gpu/check.py")
    assert out.returncode == 0 and out.stdout.startswith("SKIP: no CUDA device")
