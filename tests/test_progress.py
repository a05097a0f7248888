"""Training progress on stdout: a live rich bar on a terminal, one plain line per step elsewhere (CI logs,
`nohup`, pipes), where a live bar would print nothing until the run ends. Each case runs `RunLogger` in a
real subprocess whose stdout is a pipe or a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
from pathlib import Path
from drmas_graph.train.loop.metrics import RunLogger

logger = RunLogger(Path(sys.argv[1]), tensorboard=False, wandb=False, progress=True, total_steps=2, start_step=0,
                   agents=["solver", "verifier"], run_name="p", config={})
for step, (solver, verifier) in enumerate([(0.5, 0.25), (1.0, float("nan"))]):
    record = {"step": step, "agent/solver/reward_mean": solver, "agent/verifier/reward_mean": verifier,
              "time/step_s": 1.25 + step}
    logger.log(record)
    logger.progress(step, record)
    print(f"MARK after step {step}", flush=True)
logger.close()
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TTY_COMPATIBLE", "TTY_INTERACTIVE", "FORCE_COLOR")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), TERM="xterm-256color",
               COLUMNS="120")
    return env


def test_without_a_terminal_every_step_prints_one_plain_line_at_once(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 4 and lines[1] == "MARK after step 0" and lines[3] == "MARK after step 1"  # no bar
    assert re.fullmatch(r"step 1/2  reward solver=0\.50 verifier=0\.25  step 1\.2 s  elapsed \d+\.\d s", lines[0])
    assert re.fullmatch(r"step 2/2  reward solver=1\.00  step 2\.2 s  elapsed \d+\.\d s", lines[2])  # NaN left out


def test_on_a_terminal_the_rich_bar_stays(tmp_path):
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, env=_env(), stdout=slave,
                            stderr=subprocess.PIPE)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    os.close(master)
    out = b"".join(chunks).decode(errors="replace")
    assert "━" in out and "step 2/2" in out and "reward solver=1.00" in out  # the bar, its text and status
    assert "elapsed" not in out  # no plain lines
