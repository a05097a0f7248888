"""Training progress on stdout: a live rich bar on a terminal, one plain line per step elsewhere (CI logs,
`nohup`, pipes), where a live bar would print nothing until the run ends. Each case runs `RunLogger` in a
real subprocess whose stdout is a pipe or a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import time
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
    assert re.fullmatch(r"step 0 \(1/2\)  reward solver=0\.50 verifier=0\.25  step 1\.2 s  elapsed \d+\.\d s",
                        lines[0])
    assert re.fullmatch(r"step 1 \(2/2\)  reward solver=1\.00  step 2\.2 s  elapsed \d+\.\d s",
                        lines[2])  # NaN left out


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
    assert "━" in out and "2/2 steps" in out and "step 1  reward solver=1.00" in out  # the bar, its text and status
    assert "elapsed" not in out  # no plain lines


TRAIN_SCRIPT = """
import sys
from drmas_graph import SamplingParams
from drmas_graph.testing import tiny_policy
from drmas_graph.train.loop.trainer import train_graph
from tests._envs import ParityEnv
from tests.test_trainer import graph

policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=2))
train_graph(graph(), ParityEnv(n_train=2, n_test=3), policies={"solver": policy, "verifier": policy}, steps=1,
            tasks_per_step=1, group_size=2, run_dir=sys.argv[1] + "/run", update={"backend": "torch"},
            eval={"k": 2, "before_training": True}, logging={"tensorboard": False, "progress": True})
"""


def test_without_a_terminal_an_evaluation_shows_its_episodes_as_they_end(tmp_path):
    """Issue 48: the first evaluation printed nothing for minutes when stdout was a file or a pipe. Its 6 episodes
    (3 tasks x k 2) now print a line at each tenth: 1..6 of 6, with an estimate while some are left."""
    proc = subprocess.run([sys.executable, "-c", TRAIN_SCRIPT, str(tmp_path)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("evaluation", "step "))]
    before = [ln for ln in lines if ln.startswith("evaluation before training")]
    assert [re.match(r"evaluation before training: (\d)/6 episodes", ln).group(1) for ln in before] == list("123456")
    assert all(re.fullmatch(r"evaluation before training: \d/6 episodes  elapsed \d+\.\d s  ETA \d+\.\d s", ln)
               for ln in before[:-1])
    assert re.fullmatch(r"evaluation before training: 6/6 episodes  elapsed \d+\.\d s", before[-1])
    assert lines.index(before[-1]) < lines.index(next(ln for ln in lines if ln.startswith("step 0 (1/1)")))
    assert any(ln.startswith("evaluation after step 0: 6/6 episodes") for ln in lines)


def test_episode_progress_prints_a_line_at_each_tenth(capsys):
    from drmas_graph.train.loop.metrics import EpisodeProgress

    progress = EpisodeProgress("evaluation after step 2")
    for done in range(1, 49):
        progress(done, 48)
    lines = capsys.readouterr().out.splitlines()
    assert [int(ln.split(": ")[1].split("/")[0]) for ln in lines] == [5, 10, 15, 20, 24, 29, 34, 39, 44, 48]


def test_episode_progress_counts_from_the_batch_start(capsys):
    """The clock starts when the progress is made (as the batch starts), not at the first episode that ends: the
    first group's time is in `elapsed` and the estimate (it printed 'elapsed 0.0 s ETA 0.0 s' after 8/80)."""
    from drmas_graph.train.loop.metrics import EpisodeProgress

    progress = EpisodeProgress("evaluation after step 11")
    time.sleep(0.3)
    progress(8, 80)
    elapsed, eta = map(float, re.fullmatch(r"evaluation after step 11: 8/80 episodes  elapsed (\d+\.\d) s  ETA "
                                           r"(\d+\.\d) s", capsys.readouterr().out.strip()).groups())
    assert elapsed >= 0.3 and abs(eta - elapsed * 72 / 8) <= 0.15


def test_episode_progress_estimates_from_the_pace_since_the_first_episode_ended(capsys, monkeypatch):
    """80 episodes at once end in a burst (the demo's evaluation: the first 8 after 14-15 s, all 80 after 26 s).
    The estimate after 8 is the 72 left at the pace since the first ended (7 in 1.2 s: 12.3 s), not at the pace
    from the start (8 in 15.2 s: 137 s, what it printed before). One at a time, both paces are the same."""
    from drmas_graph.train.loop import metrics

    clock = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    progress = metrics.EpisodeProgress("evaluation on test")
    for done, at in [(1, 14.0), (2, 14.2), (5, 14.7), (8, 15.2)]:
        clock[0] = at
        progress(done, 80)
    assert capsys.readouterr().out.splitlines()[-1] == "evaluation on test: 8/80 episodes  elapsed 15.2 s  ETA 12.3 s"
    sequential = metrics.EpisodeProgress("check, 1 group")
    for done in range(1, 10):
        clock[0] = 15.2 + 2.0 * done  # one episode every 2 s
        sequential(done, 10)
    assert capsys.readouterr().out.splitlines()[-1] == "check, 1 group: 9/10 episodes  elapsed 18.0 s  ETA 2.0 s"
