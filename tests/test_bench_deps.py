"""Benchmarks check their optional dependencies when they start and name the extra (bench_async.py used to run
16 minutes, then die on a missing matplotlib before printing its result)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HIDE = "import sys, runpy; sys.modules[{mod!r}] = None; sys.argv = {argv!r}; runpy.run_path({path!r}, run_name='__main__')"


@pytest.mark.parametrize("script, module, extra, args", [
    ("benchmarks/bench_async.py", "matplotlib", "demo", ["--steps", "1", "--seeds", "0"]),
    ("benchmarks/stability/run.py", "matplotlib", "demo", ["--steps", "1"]),
    ("benchmarks/learning/run.py", "matplotlib", "demo", ["--tiny"]),
    ("benchmarks/bench_memory.py", "deepspeed", "deepspeed", ["--size", "tiny", "--modes", "torch,zero1"]),
])
def test_a_benchmark_without_an_optional_dependency_stops_at_once_naming_the_extra(script, module, extra, args):
    path = str(ROOT / script)
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", HIDE.format(mod=module, argv=[path, *args], path=path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"needs {module}, which is not installed: pip install 'drmas-graph[{extra}]'" in out.stderr
    assert out.stdout == "" and time.monotonic() - start < 60  # before any run
