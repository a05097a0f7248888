"""Worker of tests/test_train_distributed.py, launched with torchrun: `train_graph` runs on this rank's share
of every step's task groups. SPEC.json lists runs done one after the other in the same processes:

    {"runs": [{"run_dir": ..., "steps": 2, "resume": false, "update": {...}, "kill_in_step": null,
               "config": {...more TrainConfig fields...}}, ...]}

Each rank writes <run_dir>/history_rank<r>.json (the step records it returned). With "kill_in_step": s,
rank 1 dies (os._exit) while scoring step s, as a killed job would; torchrun then stops rank 0 too.

    python -m torch.distributed.run --nproc_per_node=2 --master_port=PORT tests/_dist_train_worker.py SPEC.json
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import zlib
from pathlib import Path
from typing import Any

from drmas_graph.train.engines import distributed as _distributed
from drmas_graph.config import TrainConfig
from drmas_graph.testing import tiny_model, tiny_tokenizer
from drmas_graph.train.loop.trainer import train_graph
from drmas_graph.engine.transformers_policy import TransformersPolicy
from drmas_graph.types import SamplingParams
from tests import _graphs
from tests._envs import ParityEnv
from tests.test_instrument import Unreachable


class PromptSeeded(TransformersPolicy):
    """Seeds a request without one from (weights version, prompt ids, how often this prompt came at this
    version), not from arrival order: with episodes run one at a time (max_concurrency=1), an episode samples
    the same tokens whichever process runs its group, and a resumed run samples what the uninterrupted one
    did. Requests that carry a seed (the trainer's per-call seeds) keep it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._seen: collections.Counter = collections.Counter()
        self._seen_lock = threading.Lock()

    def submit(self, prompt_ids, params):
        if params.seed is None:
            key = (self.version, tuple(int(t) for t in prompt_ids))
            with self._seen_lock:
                n = self._seen[key]
                self._seen[key] += 1
            params = params.replace(seed=zlib.crc32(repr((key, n)).encode()))
        return super().submit(prompt_ids, params)


def build_policy() -> PromptSeeded:
    tokenizer = tiny_tokenizer(512)
    return PromptSeeded(tiny_model(tokenizer, seed=0), tokenizer, name="tiny", seed=0,
                        sampling=SamplingParams(max_new_tokens=4))


class KillingEnv(ParityEnv):
    """ParityEnv whose rank 1 dies while scoring training step `kill_in_step`."""

    def __init__(self, kill_in_step: int | None = None):
        super().__init__(n_train=5)
        self.kill_in_step = kill_in_step

    def reward(self, task, episode):
        meta = episode.metadata
        if (meta.get("phase") == "train" and meta.get("step") == self.kill_in_step
                and os.environ.get("RANK") == "1"):
            os._exit(3)
        return super().reward(task, episode)


def config(run_dir: str | Path, *, steps: int, resume: bool = False, update: dict | None = None,
           **extra: Any) -> TrainConfig:
    fields = dict(
        run_dir=str(run_dir), steps=steps, resume=resume, tasks_per_step=2, group_size=4, max_concurrency=1,
        checkpoint_every=1, keep_checkpoints=3, update={"lr": 1e-3, **(update or {"backend": "torch"})},
        eval={"k": 2, "n_tasks": 2, "before_training": True}, logging={"progress": False, "tensorboard": False})
    return TrainConfig.model_validate({**fields, **extra})


def train(run_dir: str | Path, *, steps: int, resume: bool = False, update: dict | None = None,
          kill_in_step: int | None = None, extra: dict | None = None):
    """One run of the solver -> verifier graph, both agents on one tiny `PromptSeeded` model (or on the
    `models` / `agents` given in `extra` config fields); returns (result, policy or None)."""
    extra = extra or {}
    policy = None if "models" in extra else build_policy()
    graph = _graphs.solver_verifier(Unreachable()).compile()
    cfg = config(run_dir, steps=steps, resume=resume, update=update, **extra)
    result = train_graph(graph, KillingEnv(kill_in_step), cfg,
                         policies=None if policy is None else {"solver": policy, "verifier": policy})
    return result, policy


def main(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    for run in spec["runs"]:
        result, _ = train(run["run_dir"], steps=run["steps"], resume=run.get("resume", False),
                          update=run.get("update"), kill_in_step=run.get("kill_in_step"), extra=run.get("config"))
        rank = int(os.environ["RANK"])
        (Path(run["run_dir"]) / f"history_rank{rank}.json").write_text(json.dumps(
            {"world_size": int(os.environ["WORLD_SIZE"]), "history": result.history, "evals": result.evals}))
    _distributed.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
