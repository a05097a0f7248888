"""Checkpoints and resume, and pushing trained weights to inference servers.

A checkpoint is `run_dir/checkpoints/step_N/` (complete or absent: written to a temporary folder, then
renamed), each thing once:

- `<model>/model/`: the weights (Hugging Face format, safetensors) and the tokenizer: what resume loads into the
  model, and what `drmas-graph eval --checkpoint` and inference load (a LoRA model: its adapters);
- the optimizer state: `<model>/optimizer.pt` (torch backend: AdamW's two moments, float32 master weights of a
  low-precision model, the loss scale) or `<model>/deepspeed/` (DeepSpeed's files without the weights above, and
  for a float32 model without ZeRO's master copies of them: `_engines._Lean`);
- `<model>/updater_state_rank<r>.pt`: the update count and torch's RNG state;
- `trainer_state.json`: step, policy versions, world size, the run's notes (once-per-run warnings given, also
  after the checkpoint was written: `save_notes`; the zero-signal streak).

A float32 model's checkpoint is ~12 bytes per parameter (4 of weights, 8 of AdamW moments), a bfloat16 one's ~14.
`resume` restores the latest one; `keep_checkpoints` bounds how many are kept (an older one is deleted once the new
one is whole). In asynchronous training it also holds the weights the next step rolls out on (`<model>/serving`,
version `serving_version`; see `_pipeline`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

from drmas_graph.errors import ConfigError, DrmasError
from drmas_graph.train.engines import distributed
from drmas_graph.train.loop._build import is_served
from drmas_graph.train.loop._state import HasRunState, RunState, on_model_thread, run_state
from drmas_graph.train.optim import load_adapters, save_for_sync

__all__ = ["save_checkpoint", "save_notes", "resume", "checkpoint_step", "push_weights", "sync_weights", "load_into_servers",
           "sync_dir", "load_checkpoint_adapters", "RolloutWeights", "has_checkpoint", "NothingToResumeError",
           "CheckpointSpaceError"]


class NothingToResumeError(ConfigError):
    """`resume: true` (`--resume`) on a run folder that holds no checkpoint: there is nothing to continue, and
    starting at step 0 would append a second run's episodes and metrics to the first's."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(
            f"resume=true, but run folder {run_dir} holds no checkpoint ({run_dir / 'checkpoints'}/step_*): "
            "there is nothing to continue from. Start the run without resume (a new run_dir, or remove this "
            "folder if its traces are not needed); checkpoint_every sets how often a run saves one.")
        self.run_dir = run_dir


def has_checkpoint(run_dir: Path) -> bool:
    """The run folder holds a complete checkpoint (`checkpoints/step_N`) to resume from."""
    return any((run_dir / "checkpoints").glob("step_*"))


class RolloutWeights(Protocol):
    """Asynchronous training's rollout weights (`_pipeline.OneStepOff`), which a checkpoint also holds."""

    trained_version: int
    """Updates the trainer applied."""

    def save_serving(self, directory: Path) -> int:
        """Write the rollout weights into a checkpoint folder when they are not the trainer's; their version."""

    def restore(self, directory: Path, trained: int, serving: int | None) -> None:
        """Install the rollout weights a checkpoint holds (or the trainer's)."""


class CheckpointSpaceError(DrmasError, OSError):
    """A checkpoint could not be written because its disk is full. The partial checkpoint is removed; the
    checkpoints before it are whole, and `--resume` continues from the latest of them."""

    def __init__(self, root: Path, step: int, written: int, free: int) -> None:
        done = sorted(root.glob("step_*"))
        last = (f"The latest whole checkpoint, {done[-1].name} ({_size(_folder_bytes(done[-1]))}), is intact: "
                "--resume continues from it" if done else "No earlier checkpoint was saved")
        super().__init__(
            f"checkpoint step_{step:06d} could not be written: the disk of {root} is full ({_size(free)} free; "
            f"the {_size(written)} of it written so far are removed). {last}. Free disk space, or keep fewer "
            "checkpoints (keep_checkpoints) or save less often (checkpoint_every)")


_FULL_BYTES = 64 * 2**20
"""Free bytes below which a failed checkpoint write is put down to a full disk (torch.save reports one as
"unexpected pos" or "file write failed", not as ENOSPC)."""


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def save_checkpoint(run: RunState, step: int, pipeline: RolloutWeights | None = None) -> Path:
    """Write checkpoint `step` of every updater (collective: every rank saves its part, rank 0 the rest);
    `pipeline`: asynchronous training's, whose rollout weights the checkpoint also holds. A full disk raises
    `CheckpointSpaceError` (the partial checkpoint removed)."""
    root = run.run_dir / "checkpoints"
    tmp = root / f".tmp_step_{step:06d}"
    try:
        return _save_checkpoint(run, step, pipeline, root, tmp)
    except BaseException as exc:  # the partial checkpoint goes; the ones before it are whole
        free = shutil.disk_usage(root).free if root.exists() else 0
        written = _folder_bytes(tmp) if tmp.exists() else 0
        if distributed.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC or free < _FULL_BYTES
        if isinstance(exc, (OSError, RuntimeError)) and full:
            raise CheckpointSpaceError(root, step, written, free) from exc
        raise


def _save_checkpoint(run: RunState, step: int, pipeline: RolloutWeights | None, root: Path, tmp: Path) -> Path:
    final = root / f"step_{step:06d}"
    main = distributed.is_main()  # every rank saves its part (DeepSpeed); rank 0 writes the rest
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier()
    for model in run.trained_models():
        on_model_thread(model, functools.partial(model.updater.save, tmp / model.name))
        if main:
            model.policy.tokenizer.save_pretrained(tmp / model.name / "model")
    versions = {n: m.policy.version for n, m in run.models.items()}
    notes = run.notes  # what the run remembers across steps: its once-per-run warnings, the zero-signal streak
    state = {"step": step, "policy_versions": versions, "world_size": distributed.world_size(),
             "notes": {"logged_failures": sorted(notes.logged_failures), "threshold_warned": notes.threshold_warned,
                       "zero_signal_streak": notes.zero_signal.streak}}
    if pipeline is not None:  # the trained weights' version, and those the next step rolls out on
        versions.update({m.name: pipeline.trained_version for m in run.trained_models()})
        state["serving_version"] = pipeline.save_serving(tmp)
    if main:
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # a checkpoint is complete or absent
        for old in sorted(root.glob("step_*"))[: -run.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()
    return final


def save_notes(run: RunState) -> None:
    """Add the run's once-per-run warnings given so far (`RunNotes.threshold_warned`, `logged_failures`) to the latest
    checkpoint's trainer_state.json (atomically; rank 0), so that a run resumed from it does not give them again: an
    evaluation follows its step's checkpoint, so its warning is not in it. The zero-signal streak stays as saved
    (the steps after the checkpoint run again)."""
    ckpts = sorted((run.run_dir / "checkpoints").glob("step_*"))
    if not ckpts or not distributed.is_main():
        return
    path = ckpts[-1] / "trainer_state.json"
    state = json.loads(path.read_text())
    notes = state.setdefault("notes", {})
    given = {"logged_failures": sorted(set(notes.get("logged_failures", ())) | run.notes.logged_failures),
             "threshold_warned": bool(notes.get("threshold_warned")) or run.notes.threshold_warned}
    if all(notes.get(k) == v for k, v in given.items()):
        return
    notes.update(given)
    tmp = path.with_name(".trainer_state.json.tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)  # the checkpoint stays whole: the old file or the new one


def resume(run: RunState, pipeline: RolloutWeights | None = None) -> int:
    """Load the latest checkpoint into every updater (and its servers, or `pipeline`'s rollouts); return the step
    to continue at."""
    ckpts = sorted((run.run_dir / "checkpoints").glob("step_*"))
    if not ckpts:
        raise NothingToResumeError(run.run_dir)
    latest = ckpts[-1]
    state = json.loads((latest / "trainer_state.json").read_text())
    distributed.check_resume_world(state.get("world_size"), distributed.world_size(), {
        m.name: m.updater.settings.zero_stage for m in run.trained_models()
        if m.updater.settings.backend == "deepspeed"})
    for model in run.trained_models():
        on_model_thread(model, functools.partial(model.updater.load, latest / model.name))
        if pipeline is not None:  # the rollouts get their weights below
            continue
        version = state["policy_versions"].get(model.name, 0)
        if is_served(model.policy):
            sync_weights(run, model.name, version=version)  # the servers still hold whatever they served last
        model.policy.version = version
    if pipeline is not None:
        pipeline.restore(latest, int(state["step"]), state.get("serving_version"))
    notes = state.get("notes", {})  # checkpoints written before notes were saved have none
    run.notes.logged_failures.update(notes.get("logged_failures", ()))
    run.notes.threshold_warned = run.notes.threshold_warned or bool(notes.get("threshold_warned"))
    run.notes.zero_signal.streak = [tuple(s) for s in notes.get("zero_signal_streak", ())]
    return int(state["step"])


def checkpoint_step(checkpoint: Path) -> int:
    """The number of training steps a checkpoint folder was written after: its trainer_state.json's, else the N
    of its name step_N."""
    state = checkpoint / "trainer_state.json"
    if state.is_file():
        return int(json.loads(state.read_text())["step"])
    named = re.fullmatch(r"step_(\d+)", checkpoint.name)
    if named is None:
        raise ConfigError(f"{str(checkpoint)!r} is not a training checkpoint (no trainer_state.json, and its name is "
                          "not step_N); pass a run_dir/checkpoints/step_N folder")
    return int(named.group(1))


def load_checkpoint_adapters(run: RunState | HasRunState, checkpoint: str | os.PathLike) -> None:
    """Load the adapters of every LoRA model from a training checkpoint (``<checkpoint>/<model>/model``) into
    a run's models (`lora.load_adapters`), and push them to the servers of served ones."""
    state = run_state(run)
    trained = {n: m.trained for n, m in state.models.items() if m.trained is not None}
    for name in load_adapters(trained, Path(checkpoint)):
        policy = state.models[name].policy
        if is_served(policy):
            sync_weights(state, name, version=policy.version)


def sync_dir(run_dir: Path, name: str) -> Path:
    """run_dir/sync/<name>: the Hugging Face folder model `name`'s servers last loaded."""
    return run_dir.resolve() / "sync" / name


def push_weights(run_dir: Path, name: str, model: Any, policy: Any, updater: Any, *, version: int,
                 timeout_s: float | None = None) -> float:
    """Push model `name`'s trained weights to its servers; return the seconds it took (write + load).

    The Hugging Face model and tokenizer are written to run_dir/sync/<name>/ (complete or absent: written
    to a temporary folder, then renamed), then `policy.sync_weights(dir, version)` loads them into every
    server; its `WeightSyncError` (a failed load, or a server reporting another version) propagates.
    `timeout_s` bounds the load (asynchronous training; `ServedPolicy.sync_weights`).
    """
    start = time.perf_counter()
    final = sync_dir(run_dir, name)
    tmp = final.with_name(f".tmp_{name}")
    full = getattr(updater, "full_weights", None)  # ZeRO-3: a collective gather on every process
    with full() if full is not None else contextlib.nullcontext():
        if distributed.is_main():  # several processes share the servers: rank 0 writes and pushes once
            shutil.rmtree(tmp, ignore_errors=True)
            save_for_sync(model, policy, tmp)
            policy.tokenizer.save_pretrained(tmp)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
    _load(final, policy, version, timeout_s)
    return time.perf_counter() - start


def sync_weights(run: RunState, name: str, *, version: int) -> float:
    """Push model `name`'s trained weights to its servers (`push_weights`); return the seconds."""
    model = run.models[name]
    return push_weights(run.run_dir, name, model.trained, model.policy, model.updater, version=version)


def load_into_servers(run_dir: Path, name: str, policy: Any, source: Path, *, version: int,
                      timeout_s: float | None = None) -> None:
    """Load the Hugging Face folder `source` (a checkpoint's copy of what the servers served) into model `name`'s
    servers as `version`, through run_dir/sync/<name>."""
    final = sync_dir(run_dir, name)
    if distributed.is_main():
        shutil.rmtree(final, ignore_errors=True)
        shutil.copytree(source, final)
    _load(final, policy, version, timeout_s)


def _load(folder: Path, policy: Any, version: int, timeout_s: float | None) -> None:
    if distributed.is_main():
        kwargs = {} if timeout_s is None else {"timeout_s": timeout_s}
        policy.sync_weights(str(folder), version=version, **kwargs)
    distributed.barrier()  # no rank rolls out again before the servers hold the new weights
    policy.version = version
