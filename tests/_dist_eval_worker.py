"""Worker of tests/test_train_distributed.py::test_an_evaluation_under_a_launcher_..., launched with torchrun:
an evaluation-only Trainer (train=False) with tasks_per_step=3, which 2 processes could not split (evaluation
does not use it), evaluates 5 test tasks k=2 times (rank 0 takes tasks 0-1, rank 1 tasks 2-4; test-4's
reward is NaN). Rank 0 asks for the rollouts, as its Weave exporter does, and writes them with the record to
OUTDIR/eval.json; the ranks' trace stores are merged into OUTDIR/run/traces.db as `drmas-graph eval` does.

    python -m torch.distributed.run --nproc_per_node=2 --master_port=PORT tests/_dist_eval_worker.py OUTDIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from drmas_graph.config import TrainConfig
from drmas_graph.train.engines import distributed as _distributed
from drmas_graph.train.loop.evaluate import evaluate
from drmas_graph.train.loop.trainer import Trainer
from tests import _graphs
from tests._dist_train_worker import build_policy
from tests._envs import ParityEnv
from tests.test_instrument import Unreachable


def main(outdir: Path) -> None:
    policy = build_policy()
    cfg = TrainConfig.model_validate(dict(
        run_dir=str(outdir / "run"), tasks_per_step=3, group_size=2, max_concurrency=2,
        eval={"k": 2, "n_tasks": 5}, logging={"progress": False, "tensorboard": False}))
    trainer = Trainer(_graphs.solver_verifier(Unreachable()).compile(), ParityEnv(n_test=5, bad_reward=("test-4",)),
                      cfg, policies={"solver": policy, "verifier": policy}, train=False)
    try:
        rollouts = [] if _distributed.is_main() else None
        record = evaluate(trainer, step=0, rollouts=rollouts)
        _distributed.remove_rank_stores(trainer.state.run_dir, trainer.state.store.close)
    finally:
        trainer.close()
    if _distributed.is_main():
        rows = [{"task": task.id, "episode": ep.id, "final_state": ep.final_state, "ok": ok,
                 "rewards": None if score is None else score.rewards} for task, ep, score, ok in rollouts]
        (outdir / "eval.json").write_text(json.dumps({"record": record, "rollouts": rows}))
    _distributed.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
