"""Rollout throughput of the math graph: the embedded TransformersPolicy vs a vLLM server, plus weight-sync time.

The math example graph (graphs/math/graph.py: solver -> verifier, up to `--rounds` solver turns) runs under
`instrument()` with both agents on one policy; `--episodes` episodes run concurrently (asyncio), `--repeats`
times after one warm-up episode. Both backends load the same weights (a tiny random Llama by default, or any
Hugging Face folder with `--model-path`, e.g. a safetensors copy of SmolLM2-135M-Instruct) and sample at
temperature 1 with the same `--max-new-tokens`. Weight sync from disk, median of 3: the embedded policy's
`from_pretrained` + `load_state_dict` vs `VLLMPolicy.sync_weights` (pause -> collective_rpc reload_weights ->
update_weight_version -> resume -> /weight_info check).

    python benchmarks/bench_served.py [--episodes 16] [--max-new-tokens 32] [--model-path DIR]

The vLLM half needs the vLLM venv (scripts/setup_vllm.sh; $DRMAS_VLLM_PYTHON or ./.venv-vllm); without it
only the embedded numbers are printed. The vLLM server is started and stopped by this script.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from drmas_graph import SamplingParams, instrument  # noqa: E402
from drmas_graph.cli._train import StandInChatModel  # noqa: E402
from drmas_graph.engine.transformers_policy import TransformersPolicy  # noqa: E402
from graphs.math.graph import build_graph  # noqa: E402


def _questions(n: int) -> list[dict]:
    return [{"question": f"What is {i % 9 + 1} + {(i * 7) % 9 + 1}?"} for i in range(n)]


def _checkpoint(args, root: str) -> tuple[str, str]:
    """(weights folder, a second folder with perturbed weights for the sync timing)."""
    from transformers import AutoModelForCausalLM

    if args.model_path:
        base = args.model_path
    else:
        from drmas_graph.testing import tiny_model, tiny_tokenizer

        tok = tiny_tokenizer()
        base = os.path.join(root, "step0")
        tiny_model(tok, seed=0, hidden_size=128).save_pretrained(base)  # head_dim 32: vLLM CPU supports it
        tok.save_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    step1 = os.path.join(root, "step1")
    model.save_pretrained(step1)
    return base, step1


async def _rollouts(policy, args) -> dict[str, float]:
    app = instrument(build_graph(StandInChatModel(), max_rounds=args.rounds), {"solver": policy, "verifier": policy})
    await app.arollout(_questions(1)[0])  # warm-up
    eps_s, toks_s = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        episodes = await asyncio.gather(*(app.arollout(q) for q in _questions(args.episodes)))
        wall = time.perf_counter() - t0
        tokens = sum(t.n_response_tokens for ep in episodes for t in ep.turns)
        eps_s.append(len(episodes) / wall)
        toks_s.append(tokens / wall)
    return {"episodes/s": statistics.median(eps_s), "tokens/s": statistics.median(toks_s)}


def _median_time(fn, n: int = 3) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def embedded(args, base: str, step1: str) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    policy = TransformersPolicy.from_pretrained(base, name="embedded", sampling=sampling, seed=0)
    try:
        out = asyncio.run(_rollouts(policy, args))
        out["sync_s"] = _median_time(lambda: policy.load_state_dict(
            AutoModelForCausalLM.from_pretrained(step1, dtype=torch.float32).state_dict()))
        return out
    finally:
        policy.close()


def served_vllm(args, base: str, step1: str, python: str) -> dict[str, float]:
    from transformers import AutoTokenizer

    from drmas_graph.served import VLLMPolicy, launch_vllm

    t0 = time.perf_counter()
    server = launch_vllm(base, python=python, ready_timeout_s=600)
    start_s = time.perf_counter() - t0
    policy = VLLMPolicy(server.url, AutoTokenizer.from_pretrained(base), name="vllm",
                        sampling=SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens), servers=[server])
    try:
        out = asyncio.run(_rollouts(policy, args))
        versions = iter(range(1, 100))
        paths = iter([step1, base] * 10)
        out["sync_s"] = _median_time(lambda: policy.sync_weights(next(paths), next(versions)))
        out["server_start_s"] = start_s
        return out
    finally:
        policy.close()  # stops the server too


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=16, help="concurrent episodes per measurement")
    ap.add_argument("--repeats", type=int, default=3, help="measurements (median reported)")
    ap.add_argument("--rounds", type=int, default=2, help="max solver turns per episode")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--model-path", default=None, help="a Hugging Face model folder (default: a tiny random Llama)")
    ap.add_argument("--vllm-python", default=None, help="the vLLM venv's python (default: $DRMAS_VLLM_PYTHON)")
    args = ap.parse_args()
    torch.manual_seed(0)

    from drmas_graph.served.vllm import vllm_python

    with tempfile.TemporaryDirectory() as root:
        base, step1 = _checkpoint(args, root)
        print(f"model: {args.model_path or 'tiny random Llama (hidden 128, 2 layers)'}; {args.episodes} concurrent "
              f"episodes x {args.repeats}, max_new_tokens={args.max_new_tokens}, T=1.0, torch threads "
              f"{torch.get_num_threads()}", flush=True)
        rows = {"embedded (TransformersPolicy)": embedded(args, base, step1)}
        python = args.vllm_python or vllm_python()
        if python:
            rows["vLLM server (VLLMPolicy)"] = served_vllm(args, base, step1, python)
        print(f"\n{'backend':32s} {'episodes/s':>11s} {'tokens/s':>10s} {'weight sync s':>14s}")
        for name, r in rows.items():
            print(f"{name:32s} {r['episodes/s']:11.2f} {r['tokens/s']:10.1f} {r['sync_s']:14.3f}")
        if len(rows) == 2:
            e, v = rows.values()
            print(f"\nvLLM / embedded: {v['episodes/s'] / e['episodes/s']:.2f}x episodes/s, "
                  f"{v['tokens/s'] / e['tokens/s']:.2f}x tokens/s; vLLM server start {v['server_start_s']:.0f} s "
                  "(not in the rates)")
        else:
            print("\nvLLM venv not found (run scripts/setup_vllm.sh, set DRMAS_VLLM_PYTHON): embedded numbers only.")


if __name__ == "__main__":
    main()
