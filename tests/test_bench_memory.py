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
    out = _run("benchmarks/bench_memory.py", "--size", "tiny", "--modes", "torch,full-logits,lora", "--samples", "2",
               "--prompt", "8", "--response", "8")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.stdout.splitlines()
            if line.startswith(("| torch", "| full-logits", "| lora"))}
    assert set(rows) == {"torch", "full-logits", "lora"}
    for cells in rows.values():
        assert float(cells[2]) > 0 and float(cells[3]) > 0 and float(cells[4]) > 0 and float(cells[5]) > 0
    assert rows["torch"][6] == rows["full-logits"][6]  # the same grad norm: the chunked head changes no number
    assert float(rows["torch"][3]) == float(rows["torch"][2])  # full training trains every parameter
    assert 0 < float(rows["lora"][3]) < 0.5 * float(rows["torch"][3])  # LoRA trains the adapter only (tiny: 21%)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on a GPU machine the check runs for real")
def test_gpu_check_skips_clearly_without_a_gpu():
    out = _run("benchmarks/gpu/check.py")
    assert out.returncode == 0 and out.stdout.startswith("SKIP: no CUDA device")
