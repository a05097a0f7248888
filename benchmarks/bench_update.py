"""One policy update, packed vs unpacked, on the CPU demo's workload and on a multi-turn one (and TRL's GRPO).

    python benchmarks/bench_update.py [--model auto|smollm2|tiny] [--tasks 4] [--group 8] [--repeats 2]
        [--episodes 2] [--rounds 8] [--threads 2] [--no-trl] [--autocast]

Workloads (the same samples for every path):
- demo: one training step of `graphs/math/demo.yaml` (the checked math graph, solver + verifier, G = 8, the
  demo's update settings: DeepSpeed ZeRO-0, float32, micro-batches of 8), rolled out with the embedded policy
  in a child process (its engine thread must not share this process's OpenMP teams with the timed update).
  The figures in docs/benchmarks.md were measured on the demo's earlier math graph (2 to 4 calls per
  episode; the checked graph makes 3 to 5).
  Model: SmolLM2-135M-Instruct when its safetensors cache exists (`--model auto`), else a tiny random Llama.
- multi-turn: one agent, `--rounds` (8) tool rounds per episode, `--episodes` (2) episodes of one task: turn
  k's prompt is the system prompt, the question and turns 1..k-1 (the call the agent made, the tool's
  result), as an agent loop that appends to its context builds it (token ids concatenated: the prefix property
  a chat template that re-renders the history preserves). Calls are ~20 tokens, results ~20 tokens.

Paths, each from the same initial weights, timed after one warm-up update (fastest of `--repeats`):
- unpacked: what the trainer did before prefix-shared packing: the old-logprob pass (`compute_logprobs`,
  `old_logprobs: auto` for an embedded policy) + the update on padded rows;
- packed: the update on packed sequence trees with the old logprobs taken from its own forward pass
  (`old_logprobs="current"`, one optimizer step);
- the two halves alone (packed + the old-logprob pass; unpacked without it), to show where the gain comes from;
- trl: TRL's `GRPOTrainer.compute_loss` + backward over micro-batches of 8 and one AdamW step (its on-policy
  path: old logprobs = its own, detached; loss_type "bnpo" = token mean), when trl is installed.

Printed: seconds per update, the token positions its training passes computed (padding included; the
old-logprob pass, when there is one, computes the padded rows once more), tokens/s (prompt + response tokens of the
samples / seconds: what a user gets) and the FLOP/s the machine did (6 x parameters x computed token positions
for forward + backward, +2 x for the old-logprob pass) against its measured float32 matmul peak. The last line is the demo workload's
`update speedup packed/unpacked: X.XXx`.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WEAVE_DISABLED", "true")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# --- workloads ---------------------------------------------------------------------------------------------


def _demo_config(model: str, tasks: int, group: int, run_dir: str) -> Any:
    from drmas_graph.config import load_config

    overrides = [f"run_dir={run_dir}", "steps=1", f"tasks_per_step={tasks}", f"group_size={group}",
                 "logging.progress=false", "logging.tensorboard=false", "eval.before_training=false"]
    if model == "tiny":
        overrides += ["models.smollm2.path=null", "models.smollm2.tiny={}"]
    return load_config(ROOT / "graphs/math/demo.yaml", overrides)


def _resolve_model(choice: str) -> str:
    if choice != "auto":
        return choice
    from drmas_graph.engine.models import cache_dir

    target = cache_dir() / "smollm2-135m-instruct"
    return "smollm2" if (target / "config.json").exists() and any(target.glob("*.safetensors")) else "tiny"


def demo_samples(model: str, tasks: int, group: int) -> list[Any]:
    """One step of the demo's rollouts (child process): its trainable samples with advantages."""
    from drmas_graph.cli._train import build_graph_and_env
    from drmas_graph.train.loop import _scoring
    from drmas_graph.train.loop.trainer import Trainer

    cfg = _demo_config(model, tasks, group, tempfile.mkdtemp())
    graph, env = build_graph_and_env(cfg)
    trainer = Trainer(graph, env, cfg, train=False)
    try:
        runs, counts = trainer.rollouts(trainer.batch_tasks(0), 0, cfg.group_size, phase="train")
        run = trainer.state
        groups, _ = _scoring.score_runs(run.env, runs, counts, invalid_penalty=run.invalid_penalty,
                                        rollout=cfg.rollout, on_error=_scoring.first_failures_logger(set()))
        groups, _ = _scoring.with_advantages(groups, cfg)
        samples = _scoring.trained_samples(groups, list(trainer.state.agent_policies))
    finally:
        trainer.close()
    if all(s.advantage == 0 for s in samples):  # a random tiny model earns no reward: nothing would train
        import dataclasses

        print("demo: every advantage is 0 (no reward); the benchmark gives the samples advantages +-1")
        samples = [dataclasses.replace(s, advantage=(-1.0) ** i) for i, s in enumerate(samples)]
    return samples


def multi_turn_samples(tokenizer: Any, *, episodes: int, rounds: int, seed: int = 0) -> list[Any]:
    """`episodes` runs of one tool-using agent on one task, `rounds` tool calls each (module docstring)."""
    from drmas_graph.types import Sample

    rng = random.Random(seed)

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    head = ids("<|im_start|>system\nYou are a research agent. Call search(query) until you can answer, then reply "
               "with the answer.<|im_end|>\n<|im_start|>user\nWho founded the company that built the first river "
               "town bridge, and in which year was that person born?<|im_end|>\n<|im_start|>assistant\n")
    words = "river town bridge founder company year city person born built first old new north south".split()
    out = []
    for episode in range(episodes):
        context = list(head)
        for k in range(rounds):
            query = " ".join(rng.choice(words) for _ in range(4))
            call = ids(f'<tool_call>{{"name": "search", "arguments": {{"query": "{query}"}}}}</tool_call>')
            result = ids("<|im_end|>\n<|im_start|>tool\n" + " ".join(rng.choice(words) for _ in range(12))
                         + "<|im_end|>\n<|im_start|>assistant\n")
            out.append(Sample(tuple(context), tuple(call), tuple(-rng.uniform(0.1, 3.0) for _ in call),
                              advantage=rng.choice((-1.0, 1.0)), agent="researcher", temperature=1.0,
                              episode_id=f"e{episode}", turn_index=k))
            context += call + result
    return out


# --- the paths ---------------------------------------------------------------------------------------------


def _settings(cfg: Any, **changes: Any) -> Any:
    from drmas_graph.train.optim.update import UpdateSettings

    return UpdateSettings(**{**cfg.update.model_dump(), "seed": cfg.seed, **changes})


def _agent_settings(cfg: Any, agents: set[str]) -> dict[str, Any]:
    from drmas_graph.config import LossConfig
    from drmas_graph.train.optim.update import LossSettings

    return {a: LossSettings(**(cfg.agents[a].loss if a in cfg.agents else LossConfig(micro_batch_size=8)).model_dump())
            for a in agents}


def time_path(model: Any, samples: list[Any], settings: Any, agent_settings: dict[str, Any], *, recompute: bool,
              repeats: int) -> tuple[float, int]:
    """(fastest of `repeats` updates after one warm-up, token positions of its training passes) of one path.
    The fastest, not the median: on a shared machine other work only ever adds time."""
    from drmas_graph.train.optim._old_logprobs import with_trainer_logprobs
    from drmas_graph.train.optim.update import ModelUpdater

    updater = ModelUpdater(copy.deepcopy(model), name="m", settings=settings, agent_settings=agent_settings)
    times, forward = [], 0
    for i in range(repeats + 1):
        start = time.perf_counter()
        if recompute:  # the trainer's old-logprob pass, then the update
            batch, _ = with_trainer_logprobs(samples, updater.compute_logprobs(samples))
            metrics = updater.update(batch)
        else:
            metrics = updater.update(samples, old_logprobs="current")
        if i:
            times.append(time.perf_counter() - start)
        forward = metrics.forward_tokens
    return min(times), forward


def time_trl(model: Any, tokenizer: Any, samples: list[Any], micro: int, repeats: int) -> float | None:
    """TRL GRPOTrainer's loss + backward over micro-batches of `micro` samples and one AdamW step (fastest s)."""
    try:
        import torch
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        print(f"trl: skipped ({exc}); `pip install trl \"torch==<your torch>\"` adds it")
        return None
    model = copy.deepcopy(model)
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=micro, num_generations=micro,
                      use_cpu=True, report_to=[], loss_type="bnpo", beta=0.0, save_strategy="no",
                      max_completion_length=max(len(s.response_ids) for s in samples))
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["x"] * micro}), processing_class=tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    pad = tokenizer.pad_token_id or 0
    batches = [samples[k:k + micro] for k in range(0, len(samples), micro)]
    trainer.current_gradient_accumulation_steps = len(batches)  # set by HF's training loop, which we bypass
    model.train()
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        for batch in batches:
            P, C = max(len(s.prompt_ids) for s in batch), max(len(s.response_ids) for s in batch)
            prompt = torch.tensor([[pad] * (P - len(s.prompt_ids)) + list(s.prompt_ids) for s in batch])  # left pad
            completion = torch.tensor([list(s.response_ids) + [pad] * (C - len(s.response_ids)) for s in batch])
            inputs = {"prompt_ids": prompt, "prompt_mask": (torch.arange(P)[None] >= torch.tensor(
                          [P - len(s.prompt_ids) for s in batch])[:, None]).long(),
                      "completion_ids": completion, "completion_mask": (torch.arange(C)[None] < torch.tensor(
                          [len(s.response_ids) for s in batch])[:, None]).long(),
                      "advantages": torch.tensor([s.advantage for s in batch])}
            trainer.compute_loss(model, inputs).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - start)
    return min(times)


def matmul_peak() -> float:
    """Measured float32 GFLOP/s of a 2048 x 2048 matmul on this process's threads (best of 5)."""
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    return 2 * 2048**3 / best / 1e9


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_workload(name: str, model: Any, tokenizer: Any, samples: list[Any], cfg: Any, args: argparse.Namespace,
                 peak: float) -> float:
    """Print the workload's table; return the speedup packed/unpacked."""
    n_params = sum(p.numel() for p in model.parameters())
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    agents = {s.agent for s in samples}
    extra = {"autocast": "bf16"} if args.autocast else {}
    paths = {
        "unpacked": (dict(pack_prefixes=False), True, "old-logprob pass + padded rows (before)"),
        "packed": (dict(pack_prefixes=True), False, "packed trees, old logprobs from the update's forward"),
        "packed + pass": (dict(pack_prefixes=True), True, "packed trees + the old-logprob pass"),
        "unpacked, no pass": (dict(pack_prefixes=False), False, "padded rows, old logprobs from the forward"),
    }
    print(f"\n{name}: {len(samples)} samples of {sorted(agents)}, {tokens} prompt + response tokens, "
          f"{len(build_distinct(samples))} distinct prefixes; model {n_params / 1e6:.1f}M parameters")
    print(f"| path | s / update | tokens in the training passes | tokens/s | model GFLOP/s (% of {peak:.0f} measured peak) "
          "| what |")
    print("|---|---|---|---|---|---|")
    seconds = {}
    for path, (changes, recompute, what) in paths.items():
        s, forward = time_path(model, samples, _settings(cfg, **changes, **extra), _agent_settings(cfg, agents),
                               recompute=recompute, repeats=args.repeats)
        seconds[path] = s
        flops = (6 + (2 if recompute else 0)) * n_params * forward / s / 1e9  # what the machine computed
        print(f"| {path} | {s:.2f} | {forward} | {tokens / s:.0f} | {flops:.1f} ({100 * flops / peak:.1f}%) | {what} |")
    if args.trl:
        s = time_trl(model, tokenizer, samples, 8, args.repeats)
        if s is not None:
            seconds["trl"] = s
            padded = sum(max(len(x.prompt_ids) for x in b) + max(len(x.response_ids) for x in b)
                         for b in (samples[k:k + 8] for k in range(0, len(samples), 8)) for _ in b)
            flops = 6 * n_params * padded / s / 1e9
            print(f"| trl GRPOTrainer | {s:.2f} | - | {tokens / s:.0f} | {flops:.1f} ({100 * flops / peak:.1f}%) | "
                  "its loss + backward, micro-batches of 8, one AdamW step |")
    speedup = seconds["unpacked"] / seconds["packed"]
    print(f"{name}: packed/unpacked {speedup:.2f}x; packing alone {seconds['unpacked'] / seconds['packed + pass']:.2f}x, "
          f"no old-logprob pass alone {seconds['unpacked'] / seconds['unpacked, no pass']:.2f}x"
          + (f"; packed vs trl {seconds['trl'] / seconds['packed']:.2f}x" if "trl" in seconds else ""))
    return speedup


def build_distinct(samples: list[Any]) -> list[int]:
    from drmas_graph.train.optim._packing import build_tree, sequences_of

    return build_tree(sequences_of(samples)).tokens_N


def load_model(choice: str) -> tuple[Any, Any]:
    import torch

    if choice == "smollm2":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from drmas_graph.engine.models import smollm2_path

        path = smollm2_path()
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)
    from drmas_graph.testing import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    return tiny_model(tokenizer, seed=0), tokenizer  # the weights `models.<m>.tiny: {}` builds (seed = run seed 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="auto", choices=["auto", "smollm2", "tiny"])
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=2, help="multi-turn workload: episodes of the task")
    parser.add_argument("--rounds", type=int, default=8, help="multi-turn workload: tool rounds per episode")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--no-trl", dest="trl", action="store_false")
    parser.add_argument("--autocast", action="store_true", help="run every path's forward passes under bf16 autocast")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    choice = _resolve_model(args.model)
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:  # rollouts off this process
        samples = pool.submit(demo_samples, choice, args.tasks, args.group).result()
    cfg = _demo_config(choice, args.tasks, args.group, tempfile.mkdtemp())
    model, tokenizer = load_model(choice)
    peak = matmul_peak()
    print(f"model {choice}, {torch.get_num_threads()} torch threads, measured float32 matmul peak {peak:.0f} GFLOP/s"
          + (", bf16 autocast" if args.autocast else ""))
    multi = run_workload("multi-turn", model, tokenizer,
                         multi_turn_samples(tokenizer, episodes=args.episodes, rounds=args.rounds), cfg, args, peak)
    demo = run_workload("demo", model, tokenizer, samples, cfg, args, peak)
    print(f"multi-turn update speedup packed/unpacked: {multi:.2f}x")
    print(f"update speedup packed/unpacked: {demo:.2f}x")


if __name__ == "__main__":
    main()
