"""bench_async runs end to end on tiny settings (a benchmark no test runs breaks silently): every mode's row,
the ratio lines, the last line's format and the plot."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_async_runs_every_mode_and_ends_with_the_ratio(tmp_path):
    plot = tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_async.py", "--workloads", "a,b", "--seeds", "0", "--steps", "2",
         "--tasks", "1", "--group", "2", "--api-mean", "0.02", "--hidden", "64", "--layers", "1", "--tokens", "4",
         "--free-staleness", "1", "--plot", str(plot)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    for workload in ("a", "b"):
        assert f"workload ({workload}) one-step-off/sync throughput:" in proc.stdout
        assert f"workload ({workload}) free (max_staleness 1)/sync throughput:" in proc.stdout
        assert f"workload ({workload}) free (max_staleness 1) reward, last half: " in proc.stdout
        assert "against sync (one seed: no noise estimate)" in proc.stdout
    assert sum(line.split()[:1] in (["sync"], ["async"], ["free"]) and len(line.split()) >= 7 for line in lines) == 6
    # the result line comes before the plot is drawn (a missing matplotlib never costs the numbers)
    shown = [line for line in lines if line.strip()]
    assert re.fullmatch(r"async/sync throughput: \d+\.\d\dx", shown[-2]) and shown[-1] == f"plot: {plot}"
    assert shown[-3].startswith("workload (a), best asynchronous schedule: ")
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_bench_async_calls_a_difference_noise_only_within_two_standard_errors():
    from benchmarks.bench_async import _noise

    # diff 0.12; 2 x sqrt(0.0004 / 3 + 0.01 / 3) = 0.1178
    assert _noise([0.70, 0.72, 0.74], [0.5, 0.6, 0.7]) == "+0.120 against sync, 2 standard errors 0.118: NOT within noise"
    assert _noise([0.68, 0.70, 0.72], [0.5, 0.6, 0.7]).endswith("2 standard errors 0.118: within noise")
