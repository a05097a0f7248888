"""Where training metrics go: metrics.jsonl (always), TensorBoard, W&B (optional), and progress on stdout.

Progress (`logging.progress`): a rich progress bar where rich can draw one live (a terminal, Jupyter);
otherwise (CI logs, `nohup`, a pipe), where the bar would show nothing until it stops, one plain line per
step on stdout, flushed at once:

    step 2 (3/10)  reward solver=0.50 verifier=0.25  step 2.4 s  elapsed 7.1 s

(steps are numbered from 0, as metrics.jsonl's `step`, errors and the trace store; `(3/10)` counts those done).

An evaluation (and `drmas-graph check`) shows its episodes as they end (`EpisodeProgress`): on the bar's status,
or a plain line at each tenth of them:

    evaluation before training: 12/48 episodes  elapsed 30.2 s  ETA 90.6 s
"""

from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path
from typing import Any

__all__ = ["EpisodeProgress", "RunLogger", "Stopwatch", "mean_std", "progress_status"]


def mean_std(values: list[float], ddof: int = 1) -> tuple[float, float]:
    """Mean and std with divisor n - ddof (1: unbiased; 0: the population std, the spread of the values
    themselves); std 0 for fewer than two values, NaN mean for no values."""
    n = len(values)
    if n == 0:
        return math.nan, 0.0
    mu = sum(values) / n
    if n < 2:
        return mu, 0.0
    return mu, math.sqrt(sum((v - mu) ** 2 for v in values) / (n - ddof))


class Stopwatch:
    """A step's phases, timed: `lap(phase)` ends the phase that ran since the last lap (or the start), `skip()`
    leaves out the time since the last lap (a step waiting between its phases), `total()` is the time since the
    start. The step record's `time/...` metrics are its laps."""

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter()
        self.laps: dict[str, float] = {}
        """Phase -> its seconds."""

    def lap(self, phase: str) -> float:
        """End `phase` now; its seconds."""
        now = time.perf_counter()
        self.laps[phase], self._last = now - self._last, now
        return self.laps[phase]

    def skip(self) -> None:
        """Start the next phase now (the time since the last lap is no phase's)."""
        self._last = time.perf_counter()

    def total(self) -> float:
        """Seconds since the start."""
        return time.perf_counter() - self.start


def progress_status(agents: list[str], record: dict[str, Any]) -> str:
    """The progress bar's text for a step: reward per agent, then the episodes that did not finish (truncated,
    model errors) or got no reward (unjudged: the judge gave none; failed; bad rewards) when there were any:
    'reward solver=0.50 judge=0.25  truncated 3/8  model errors 1/8  unjudged 4/8'."""
    parts = [f"{a}={record[f'agent/{a}/reward_mean']:.2f}" for a in agents
             if isinstance(record.get(f"agent/{a}/reward_mean"), float)
             and not math.isnan(record[f"agent/{a}/reward_mean"])]
    status = "reward " + " ".join(parts)
    total = sum(record.get(k, 0) for k in ("episodes", "failed_episodes", "no_llm_call_episodes",
                                           "bad_reward_episodes", "judge_failed_episodes",
                                           "masked_truncated_episodes"))
    for key, name in (("truncated_episodes", "truncated"), ("model_error_episodes", "model errors"),
                      ("judge_failed_episodes", "unjudged"), ("failed_episodes", "failed"),
                      ("bad_reward_episodes", "bad rewards")):
        if record.get(key):
            status += f"  {name} {record[key]}/{total}"
    return status


class EpisodeProgress:
    """`progress(done, total)` of a batch of episodes: a plain line on stdout (flushed) each time `done` passes a
    tenth of `total` (and at the last), with the time since it was made (made as the batch starts: the first
    episodes' time counts) and an estimate of what is left; or, given `show`, the same text handed to it (the
    bar's status).

    The estimate is the episodes left at the pace they have ended since the first one ended. Episodes that run
    at once end in a burst, so the pace from the batch start overshoots: the demo's evaluation (80 episodes at
    once) estimated 137 s after 8 of them, with 10.7 s left. Until a second call, the pace from the start."""

    def __init__(self, label: str, show: Any = None) -> None:
        self.label, self.show = label, show
        self._started = time.perf_counter()
        self._shown = 0
        self._first: tuple[int, float] | None = None
        """(done, time) at the first call that counted an ended episode."""

    def text(self, done: int, total: int) -> str:
        now = time.perf_counter()
        elapsed = now - self._started
        eta = ""
        if 0 < done < total:
            if self._first is not None and done > self._first[0] and now > self._first[1]:
                pace = (done - self._first[0]) / (now - self._first[1])
            else:
                pace = done / max(elapsed, 1e-9)
            eta = f"  ETA {(total - done) / pace:.1f} s"
        return f"{self.label}: {done}/{total} episodes  elapsed {elapsed:.1f} s{eta}"

    def __call__(self, done: int, total: int) -> None:
        if self._first is None and done > 0:
            self._first = (done, time.perf_counter())
        if self.show is not None:
            self.show(self.text(done, total))
        elif done == total or done * 10 // max(total, 1) > self._shown * 10 // max(total, 1):
            self._shown = done
            print(self.text(done, total), flush=True)


class RunLogger:
    """Writes one JSON line per step (and per evaluation) and mirrors scalars to TensorBoard / W&B."""

    def __init__(self, run_dir: Path, *, tensorboard: bool, wandb: bool, progress: bool, total_steps: int,
                 start_step: int, agents: list[str], run_name: str, config: dict[str, Any]) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._truncate_after(start_step)
        self._file = self.path.open("a")
        self._tb = self._tensorboard(run_dir) if tensorboard else None
        self._wandb = self._wandb_run(run_name, config) if wandb else None
        self.agents = agents
        self.total_steps = total_steps
        self._progress = None
        self._lines = False
        """Progress as one plain line per step (rich cannot draw a live bar on this stdout)."""
        self._started = time.perf_counter()
        if progress:
            from rich import get_console

            console = get_console()  # rich's console on stdout (log handlers that use rich print above the bar)
            self._lines = not (console.is_interactive or console.is_jupyter)
        if progress and not self._lines:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("[bold]{task.completed}/{task.total} steps"), BarColumn(),
                                      TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                      TimeRemainingColumn(), console=console)
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, status="starting")
            self._progress.start()

    def _truncate_after(self, start_step: int) -> None:
        """On resume at step `start_step`, drop the lines of what will run again: training steps from
        `start_step` on, evaluations after more than `start_step` steps (an evaluation's `step` counts the steps
        done before it: the one of the checkpoint resumed from is kept, it does not run again)."""
        if not self.path.exists():
            return

        def kept_line(record: dict[str, Any]) -> bool:
            step = record.get("step", 0)
            return step <= start_step if any(k.startswith("eval/") for k in record) else step < start_step

        kept = [line for line in self.path.read_text().splitlines() if line.strip() and kept_line(json.loads(line))]
        self.path.write_text("".join(line + "\n" for line in kept))

    @staticmethod
    def _tensorboard(run_dir: Path) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            warnings.warn("logging.tensorboard is on but the tensorboard package is not installed; "
                          "`pip install tensorboard` or set logging.tensorboard=false", stacklevel=3)
            return None
        return SummaryWriter(str(run_dir / "tensorboard"))

    @staticmethod
    def _wandb_run(name: str, config: dict[str, Any]) -> Any:
        import wandb  # an explicit opt-in: a missing package is an error, not a silent no-op

        return wandb.init(project="drmas-graph", name=name, config=config)

    def log(self, record: dict[str, Any]) -> None:
        record = {"time": time.time(), **record}
        self._file.write(json.dumps(record, default=float) + "\n")
        self._file.flush()
        step = int(record.get("step", 0))
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def progress(self, step: int, record: dict[str, Any]) -> None:
        """Show that `step` is done: advance the bar, or print its line (see the module docstring)."""
        status = progress_status(self.agents, record)
        if self._lines:
            print(f"step {step} ({step + 1}/{self.total_steps})  {status}  "
                  f"step {record.get('time/step_s', math.nan):.1f} s  "
                  f"elapsed {time.perf_counter() - self._started:.1f} s", flush=True)
        elif self._progress is not None:
            self._progress.update(self._task, completed=step + 1, status=f"step {step}  {status}")

    def episodes(self, label: str) -> EpisodeProgress | None:
        """Progress of a batch of episodes outside the steps (an evaluation) where progress is on: lines, or the
        bar's status."""
        if self._lines:
            return EpisodeProgress(label)
        if self._progress is not None:
            return EpisodeProgress(label, lambda text: self._progress.update(self._task, status=text))
        return None

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
