"""Worker of tests/test_update_distributed.py, launched with torchrun: `update`s of this rank's share of a
fixed sample list, with the settings of CASE (`CASES`). Rank 0 writes metrics and a parameter checksum to
<outdir>/result.json and the parameters to <outdir>/params.pt.

    python -m torch.distributed.run --nproc_per_node=2 --master_port=PORT tests/_dist_worker.py OUTDIR [CASE]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from drmas_graph.testing import tiny_model, tiny_tokenizer
from drmas_graph.train.engines import distributed as _distributed
from drmas_graph.types import Sample
from drmas_graph.train.optim.update import LossSettings, ModelUpdater, UpdateSettings

# Agent a: micro-batches of 2; agent b: of 1, with its own clip range.
AGENT_SETTINGS = {"a": LossSettings(micro_batch_size=2), "b": LossSettings(micro_batch_size=1, clip_high=0.05)}
SETTINGS = UpdateSettings(lr=1e-3, grad_clip=0.5, backend="deepspeed", zero_stage=2)
CASES = {
    "zero2": (SETTINGS, 1),
    # two mini-batches (two optimizer steps) per update, two updates: the shuffle must be one for all ranks
    "minibatches": (UpdateSettings(lr=1e-3, grad_clip=0.5, backend="torch", n_minibatches=2), 2),
}
"""Case -> (settings, number of `update` calls)."""
# Rank 0 gets 5 samples (a, a, b, a, b: 4 micro-batches), rank 1 gets 2 (a, b: 2 micro-batches), so rank 1
# runs two zero-loss passes to stay in step with rank 0's gradient reductions.
SHARES = [(0, 5), (5, 7)]


def build_model() -> torch.nn.Module:
    return tiny_model(tiny_tokenizer(), seed=3)


def make_samples(model: torch.nn.Module) -> list[Sample]:
    """Seven samples of agents a and b with varied prompt/response lengths; old logprobs are the model's own
    plus a seeded offset, so some ratios leave the clip range."""
    gen = torch.Generator().manual_seed(11)
    agents = ["a", "a", "b", "a", "b", "a", "b"]
    drafts = []
    for i, agent in enumerate(agents):
        prompt = torch.randint(3, 500, (4 + 3 * i % 7,), generator=gen).tolist()
        response = torch.randint(3, 500, (2 + 5 * i % 9,), generator=gen).tolist()
        advantage = (-1.0) ** i * (1 + i / 7)
        drafts.append(Sample(tuple(prompt), tuple(response), (0.0,) * len(response), advantage=advantage,
                             agent=agent, temperature=0.8 if agent == "a" else 1.0, turn_index=i))
    updater = ModelUpdater(model, name="probe", settings=UpdateSettings(backend="torch"))
    out = []
    for draft, logprobs in zip(drafts, updater.compute_logprobs(drafts)):
        offset = 0.3 * torch.randn(len(draft.response_ids), generator=gen)
        out.append(Sample(draft.prompt_ids, draft.response_ids, tuple((logprobs + offset).tolist()),
                          draft.advantage, draft.agent, draft.temperature, turn_index=draft.turn_index))
    return out


def checksum(model: torch.nn.Module) -> dict[str, float]:
    params = torch.cat([p.detach().flatten().double() for p in model.parameters()])
    return {"sum": float(params.sum()), "abs_sum": float(params.abs().sum())}


def main(outdir: Path, case: str) -> None:
    rank = int(os.environ["RANK"])
    model = build_model()
    samples = make_samples(model)
    settings, n_updates = CASES[case]
    if settings.backend == "torch":  # DeepSpeed joins the launcher's process group itself; torch needs it joined
        _distributed.init_process_group(use_deepspeed=False)
    updater = ModelUpdater(model, name="m", settings=settings, agent_settings=AGENT_SETTINGS)
    start, end = SHARES[rank]
    for _ in range(n_updates):
        metrics = updater.update(samples[start:end])
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, outdir / "params.pt")
        result = {"world_size": int(os.environ["WORLD_SIZE"]), "metrics": metrics.to_dict(),
                  "checksum": checksum(model)}
        (outdir / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "zero2")
