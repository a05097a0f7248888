"""Peak memory and tokens/s of one policy update, by training mode, for a random-weight Llama of a given size.

    python benchmarks/bench_memory.py [--size 50m] [--modes torch,full-logits,ckpt,zero1,zero2,zero3]
        [--nproc 1] [--device cpu|cuda] [--dtype auto] [--samples 8] [--prompt 256] [--response 256]

Every mode runs in fresh processes (``--nproc`` of them, a gloo/NCCL group like torchrun's), so peaks do
not leak from one mode into the next. Each process builds the model from a config (`SIZES`, or
``--hidden/--layers/--vocab``), takes one warm-up update and one timed update (``n_minibatches`` 1, all
samples of one agent, micro-batches of ``--micro`` samples) and reports:
- peak memory: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the process's peak resident set size
  minus its size after the imports (weights + gradients + optimizer state + activations);
- tokens/s: prompt + response tokens of the timed update / its wall time (all processes together).
The table shows the largest per-process peak. ZeRO shards optimizer state (1), gradients (2) and weights (3)
over the processes, so it saves memory only with ``--nproc`` >= 2; with one process it shows its overhead.
Modes are entries of `MODES` (settings changes + an optional model transform), so a mode such as a LoRA
adapter is one more entry.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks._deps import require  # noqa: E402

# (hidden, layers, attention heads, kv heads, intermediate, vocab): Llama-style shapes of real model sizes.
SIZES: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 2, 128, 512),
    "50m": (512, 8, 8, 4, 1536, 32000),
    "150m": (768, 12, 12, 4, 2048, 49152),
    "0.5b": (896, 24, 14, 2, 4864, 151936),       # Qwen2.5-0.5B shapes
    "1.5b": (1536, 28, 12, 2, 8960, 151936),      # Qwen2.5-1.5B shapes
    "8b": (4096, 32, 32, 8, 14336, 128256),       # Llama-3-8B shapes
}


@dataclass(frozen=True)
class Mode:
    """One column of the table: changes to `UpdateSettings` and an optional transform of the model."""

    settings: dict[str, Any]
    doc: str
    prepare: Callable[[Any], Any] | None = None
    """Model -> model to train (e.g. wrap it with a LoRA adapter); None trains the model as built."""
    extra: dict[str, Any] = field(default_factory=dict)


MODES: dict[str, Mode] = {
    "torch": Mode({"backend": "torch"}, "plain AdamW, float32 masters, chunked LM head (the default path)"),
    "full-logits": Mode({"backend": "torch", "logprob_chunk_tokens": 0}, "as torch, full [B, L, V] logits"),
    "ckpt": Mode({"backend": "torch", "gradient_checkpointing": True}, "as torch + activation checkpointing"),
    "zero0": Mode({"backend": "deepspeed", "zero_stage": 0}, "DeepSpeed, no sharding (float32 models only)"),
    "zero1": Mode({"backend": "deepspeed", "zero_stage": 1}, "DeepSpeed ZeRO-1: optimizer state sharded"),
    "zero2": Mode({"backend": "deepspeed", "zero_stage": 2}, "ZeRO-2: + gradients sharded"),
    "zero3": Mode({"backend": "deepspeed", "zero_stage": 3}, "ZeRO-3: + weights sharded"),
    "zero2-offload": Mode({"backend": "deepspeed", "zero_stage": 2, "offload_optimizer": True},
                          "ZeRO-2 with optimizer state and masters in CPU memory"),
    "lora": Mode({"backend": "torch"}, "as torch, training one LoRA adapter (r=16, all-linear) over the frozen base",
                 prepare=lambda model: _lora(model)),
}


def _lora(model: Any) -> Any:
    """The model wrapped with one r=16 adapter on every linear layer (what `models.<m>.lora` builds)."""
    from drmas_graph.config import LoraConfig
    from drmas_graph.train.optim.lora import attach_adapters

    peft_model = attach_adapters(model, LoraConfig(r=16, alpha=32), ["agent"])
    peft_model.set_adapter("agent")
    return peft_model


def llama(size: str, hidden: int | None, layers: int | None, vocab: int | None, dtype: Any, device: str) -> Any:
    """A random-weight LlamaForCausalLM with the shapes of `SIZES[size]` (each overridable)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    h, n, heads, kv, inter, v = SIZES[size]
    if hidden is not None:
        h, inter = hidden, hidden * 3
    config = LlamaConfig(hidden_size=h, num_hidden_layers=layers or n, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab or v,
                         max_position_embeddings=8192, tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def samples_for(args: argparse.Namespace, vocab: int, rank: int) -> list[Any]:
    import random

    from drmas_graph.types import Sample

    rng = random.Random(rank)
    return [Sample(tuple(rng.randrange(1, vocab) for _ in range(args.prompt)),
                   tuple(rng.randrange(1, vocab) for _ in range(args.response)),
                   tuple(-rng.uniform(1, 10) for _ in range(args.response)),
                   advantage=rng.choice((-1.0, 1.0)), agent="a") for _ in range(args.samples)]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One process of one mode: build, warm up, time one update, report peak memory and tokens."""
    import torch

    from drmas_graph.train.optim.update import LossSettings, ModelUpdater, UpdateSettings

    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    device = f"cuda:{local_rank}" if args.device == "cuda" else "cpu"
    dtype = {"auto": torch.bfloat16 if args.device == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[args.dtype]
    if args.nproc > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo")
    mode = MODES[args.child]
    from transformers import LlamaForCausalLM  # noqa: F401  (imports are not the update's memory)

    if mode.settings.get("backend") == "deepspeed":
        import deepspeed  # noqa: F401
    base_mb = _rss_mb()
    if args.device == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats()
    model = llama(args.size, args.hidden, args.layers, args.vocab, dtype, device)
    if mode.prepare is not None:
        model = mode.prepare(model)
    n_params = sum(p.numel() for p in model.parameters())
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    settings = UpdateSettings(**{"lr": 1e-6, **mode.settings})
    updater = ModelUpdater(model, name="m", settings=settings,
                           agent_settings={"a": LossSettings(micro_batch_size=args.micro)})
    samples = samples_for(args, model.config.vocab_size, rank)
    updater.update(samples)  # warm-up: optimizer state, DeepSpeed buffers
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    metrics = updater.update(samples)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if args.device == "cuda":
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_mb
    return {"mode": args.child, "rank": rank, "params_m": n_params / 1e6, "trained_m": n_trained / 1e6, "peak_mb": peak_mb, "seconds": seconds,
            "tokens": len(samples) * (args.prompt + args.response), "grad_norm": metrics.grad_norm}


def run_mode(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Launch ``--nproc`` processes of one mode (rank env vars as torchrun sets them) and merge their rows."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, os.path.abspath(__file__), "--child", name] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if v is not None and k not in ("child", "modes")]
    procs = []
    for rank in range(args.nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.nproc),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    rows = []
    for p in procs:
        out, err = p.communicate()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if p.returncode != 0 or not lines:
            return {"mode": name, "error": (err.strip().splitlines() or ["no output"])[-1][:160]}
        rows.append(json.loads(lines[-1]))
    return {"mode": name, "params_m": rows[0]["params_m"], "trained_m": rows[0]["trained_m"], "peak_mb": max(r["peak_mb"] for r in rows),
            "tokens_per_s": sum(r["tokens"] for r in rows) / max(r["seconds"] for r in rows),
            "grad_norm": rows[0]["grad_norm"]}


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"model {args.size} (random Llama), {args.samples} samples x ({args.prompt} prompt + {args.response} "
             f"response) tokens per process, {args.nproc} process(es), {args.device}, dtype {args.dtype}",
             "", "| mode | params (M) | trained (M) | peak memory / process (MB) | tokens/s | grad norm | what |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['mode']} | | | failed: {r['error']} | | | {MODES[r['mode']].doc} |")
        else:
            lines.append(f"| {r['mode']} | {r['params_m']:.2f} | {r['trained_m']:.2f} | {r['peak_mb']:.0f} | "
                         f"{r['tokens_per_s']:.0f} | "
                         f"{r['grad_norm']:.4f} | {MODES[r['mode']].doc} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="50m", choices=sorted(SIZES))
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--modes", default="torch,full-logits,ckpt,zero1,zero2,zero3")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--micro", type=int, default=4, help="samples per micro-batch")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args)), flush=True)
        return
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; valid: {', '.join(MODES)}")
    deepspeed_modes = [m for m in args.modes.split(",") if MODES[m].settings.get("backend") == "deepspeed"]
    if deepspeed_modes:  # checked now, not when the first such mode starts
        require({"deepspeed": "deepspeed"}, f"modes {deepspeed_modes}", skip="--modes without them")
    results = []
    for name in args.modes.split(","):
        results.append(run_mode(name, args))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(table(results, args))


if __name__ == "__main__":
    main()
