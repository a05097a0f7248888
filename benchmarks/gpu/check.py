"""GPU check: 2 training steps of the math graph on CUDA, a random-weight 1.5B Llama, DeepSpeed ZeRO-2 in bf16.

    python benchmarks/gpu/check.py [--size 1.5b] [--steps 2] [--tasks 4] [--group 4] [--max-new-tokens 64]

The math example graph (graphs/math: solver -> verifier, up to 2 rounds) trains through `train_graph` with
both agents on one embedded `TransformersPolicy` serving a random-weight Llama built from a config
(benchmarks/bench_memory.py `SIZES`: "1.5b" has Qwen2.5-1.5B's shapes) and the tiny test tokenizer
(sampled ids beyond it decode to nothing; the token ids train as usual); the reward gets a small spread
(sum of sampled ids mod 7, the env subclass below) so that the update trains every sample. Update: DeepSpeed ZeRO-2, bf16
weights with float32 masters, chunked LM head. Prints per step the rollout and update seconds, tokens/s,
the rollout-vs-trainer logprob mismatch per agent and the grad norm, then the peak GPU memory.

Without a CUDA device it prints "SKIP: ..." and exits 0. ``--device cpu --size tiny`` is a dry run of the
same path on the CPU (float32, ZeRO-2 on gloo).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1.5b")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=4, help="tasks per step")
    parser.add_argument("--group", type=int, default=4, help="rollouts per task")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=None, help="model vocabulary (default: the size's)")
    args = parser.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: no CUDA device (torch.cuda.is_available() is False); run on a GPU machine, or "
              "`--device cpu --size tiny` for a CPU dry run")
        return 0

    from langchain_core.language_models.fake_chat_models import FakeListChatModel

    from benchmarks.bench_memory import SIZES, llama
    from drmas_graph import SamplingParams, train_graph
    from drmas_graph.testing import tiny_tokenizer
    from drmas_graph.engine.transformers_policy import TransformersPolicy
    from graphs.math.env import MathEnv
    from graphs.math.graph import build_graph

    device = "cuda:0" if args.device == "cuda" else "cpu"
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    tokenizer = tiny_tokenizer()
    start = time.perf_counter()
    model = llama(args.size, None, None, args.vocab or SIZES[args.size][-1], dtype, device)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: random Llama '{args.size}', {n_params / 1e9:.2f}B parameters, {dtype}, {device} "
          f"(built in {time.perf_counter() - start:.1f}s)", flush=True)
    policy = TransformersPolicy(model, tokenizer, name="llama", sampling=SamplingParams(max_new_tokens=args.max_new_tokens),
                                max_batch_size=args.tasks * args.group)
    graph = build_graph(FakeListChatModel(responses=["unused"]))

    class SpreadRewardMathEnv(MathEnv):
        """Random weights never solve a task, and equal rewards give zero advantages (nothing to train):
        add 0.01 x (sum of the sampled token ids mod 7) so every step trains on every sample."""

        def reward(self, task, episode):
            return super().reward(task, episode) + 0.01 * (sum(sum(t.response_ids) for t in episode.turns) % 7)

    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as run_dir:
        result = train_graph(
            graph, SpreadRewardMathEnv(seed=0, n_train=32, n_test=4), policies={"solver": policy, "verifier": policy},
            steps=args.steps, tasks_per_step=args.tasks, group_size=args.group, run_dir=run_dir,
            update={"lr": 1e-6, "backend": "deepspeed", "zero_stage": args.zero_stage},
            agents={a: {"model": "llama", "sampling": {"temperature": 1.0, "max_new_tokens": args.max_new_tokens}}
                    for a in ("solver", "verifier")},
            eval={"before_training": False, "n_tasks": 1, "k": 1}, logging={"tensorboard": False, "progress": False})
    policy.close()
    print("\n| step | rollout s | update s | rollout tokens/s | logprob mismatch solver / verifier | grad norm |")
    print("|---|---|---|---|---|---|")
    for rec in result.history:
        mismatch = " / ".join(f"{rec.get(f'agent/{a}/logprob_mismatch', float('nan')):.2e}" for a in ("solver", "verifier"))
        print(f"| {rec['step']} | {rec['time/rollout_s']:.1f} | {rec['time/update_s']:.1f} | "
              f"{rec['rollout/tokens_per_s']:.0f} | {mismatch} | {rec.get('model/llama/grad_norm', float('nan')):.3f} |")
    if args.device == "cuda":
        print(f"\npeak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB allocated, "
              f"{torch.cuda.max_memory_reserved() / 2**30:.1f} GiB reserved")
    ok = len(result.history) == args.steps and all(rec.get("model/llama/grad_norm", 0) > 0 for rec in result.history)
    print("PASS" if ok else "FAIL: a step did not train (see the table)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
