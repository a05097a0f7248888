"""Checkpoints and resume, and pushing trained weights to inference servers.

A checkpoint is `run_dir/checkpoints/step_N/` (complete or absent: written to a temporary folder, then
renamed): per model its updater's state (Hugging Face model + tokenizer, optimizer, RNG) and
`trainer_state.json` (step, policy versions, world size). `resume` restores the latest one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import time
from pathlib import Path
from typing import Any

from drmas_graph.train import _distributed
from drmas_graph.train._build import is_served
from drmas_graph.train.lora import save_for_sync

__all__ = ["save_checkpoint", "resume", "push_weights"]


def save_checkpoint(trainer: Any, step: int) -> Path:
    """Write checkpoint `step` of every updater (collective: every rank saves its part, rank 0 the rest)."""
    root = trainer.run_dir / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    main = _distributed.is_main()  # every rank saves its part (DeepSpeed); rank 0 writes the rest
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _distributed.barrier()
    for name, updater in trainer.updaters.items():
        trainer.on_model_thread(name, functools.partial(updater.save, tmp / name))
        if main:
            trainer.model_policies[name].tokenizer.save_pretrained(tmp / name / "model")
    versions = {n: p.version for n, p in trainer.model_policies.items()}
    if main:
        (tmp / "trainer_state.json").write_text(json.dumps(
            {"step": step, "policy_versions": versions, "world_size": _distributed.world_size()}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # a checkpoint is complete or absent
        for old in sorted(root.glob("step_*"))[: -trainer.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    _distributed.barrier()
    return final


def resume(trainer: Any) -> int:
    """Load the latest checkpoint into every updater (and its servers); return the step to continue at."""
    ckpts = sorted((trainer.run_dir / "checkpoints").glob("step_*"))
    if not ckpts:
        return 0
    latest = ckpts[-1]
    state = json.loads((latest / "trainer_state.json").read_text())
    _distributed.check_resume_world(state.get("world_size"), _distributed.world_size(), {
        n: u.settings.zero_stage for n, u in trainer.updaters.items() if u.settings.backend == "deepspeed"})
    for name, updater in trainer.updaters.items():
        trainer.on_model_thread(name, functools.partial(updater.load, latest / name))
        version = state["policy_versions"].get(name, 0)
        if is_served(trainer.model_policies[name]):
            trainer.sync_weights(name, version=version)  # the servers still hold whatever they served last
        trainer.model_policies[name].version = version
    return int(state["step"])


def push_weights(run_dir: Path, name: str, model: Any, policy: Any, updater: Any, *, version: int) -> float:
    """Push model `name`'s trained weights to its servers; return the seconds it took (write + load).

    The Hugging Face model and tokenizer are written to run_dir/sync/<name>/ (complete or absent: written
    to a temporary folder, then renamed), then `policy.sync_weights(dir, version)` loads them into every
    server; its `WeightSyncError` (a failed load, or a server reporting another version) propagates.
    """
    start = time.perf_counter()
    root = run_dir.resolve() / "sync"
    final, tmp = root / name, root / f".tmp_{name}"
    full = getattr(updater, "full_weights", None)  # ZeRO-3: a collective gather on every process
    with full() if full is not None else contextlib.nullcontext():
        if _distributed.is_main():  # several processes share the servers: rank 0 writes and pushes once
            shutil.rmtree(tmp, ignore_errors=True)
            save_for_sync(model, policy, tmp)
            policy.tokenizer.save_pretrained(tmp)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
    if _distributed.is_main():
        policy.sync_weights(str(final), version=version)
    _distributed.barrier()  # no rank rolls out again before the servers hold the new weights
    policy.version = version
    return time.perf_counter() - start
