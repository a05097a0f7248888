"""Decode throughput of the embedded engine (TransformersPolicy) vs `model.generate` vs a vLLM server.

Two workloads on the same model, prompts, cores and sampling (temperature 1, EOS ignored so every system
does the same work; the embedded engine records logprobs, vLLM is asked for them too):

- equal: `--batch` distinct math-graph prompts (chat template applied), `--new-tokens` each, all at once.
  Baselines: `model.generate(do_sample=True)` on the left-padded batch (one call), the same with the
  engine's oneDNN packed linear layers (`gen+onednn`, CPU only: separates that gain from the engine's
  scheduling), and vLLM.
- ragged: `--requests` requests like the math graph's GRPO rollouts: `--group` copies of each prompt
  (distinct seeds), and lengths drawn between `--min-tokens` and `--max-tokens` (rows finish at different
  steps; more requests than the engine's `--max-batch` slots). `model.generate` can only stop the whole
  batch, so it decodes every row to the longest length in batches of `--max-batch`; only the requested
  tokens count for every system.

`model.generate` runs on the embedded engine's worker thread (`run_on_worker`), as the trainer's compute
does: on CPU, torch ops on a second OS thread slow the engine's decoding for the rest of the process
(GNU OpenMP's spin-wait is cut once two thread teams exceed the cores; see `transformers_policy`).

- multiturn (`--only multiturn`; not in the default set): `--episodes` conversations of `--turns` turns
  each (a system prompt, a question, then each reply and a follow-up question appended), `--turn-tokens`
  tokens per reply; every turn's prompts are sent at once. The embedded engine with its prefix cache (a
  prompt prefills only what follows the KV rows of an earlier prompt or finished row) vs with the cache
  off (every turn prefills its whole conversation). Both draw the same replies (same seeds; exact), so they
  do the same work; the cache is emptied before each timed run.

Systems alternate inside each of `--repeats` rounds (after one warm-up each); medians of tokens/s and the
ratios are printed. The vLLM CPU server (the vLLM venv: $DRMAS_VLLM_PYTHON or ./.venv-vllm) is started
with its OpenMP threads bound to the same `--threads` cores the torch runs use; it is skipped with
`--no-vllm`, without the venv, or on cuda (the venv is a CPU build).

    python benchmarks/bench_rollout.py [--model-path DIR] [--threads 2] [--device cpu|cuda --dtype bfloat16]
    python benchmarks/bench_rollout.py --device cuda --dtype bfloat16 --batch 64 --new-tokens 128 --no-vllm

Default model: SmolLM2-135M-Instruct (the demo's; the cached safetensors copy), else a tiny random Llama.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from drmas_graph import SamplingParams  # noqa: E402
from drmas_graph.engine._cpu_linear import PackedLinear, packed_linear_available  # noqa: E402
from drmas_graph.engine.transformers_policy import TransformersPolicy  # noqa: E402

_PACKED = PackedLinear() if packed_linear_available() else None

SYSTEM = ("You are a careful solver. Reply with one sentence of the form 'The answer is N.' and nothing "
          "else.")


class _IgnoreEOS(TransformersPolicy):
    """The embedded engine with no end-of-sequence ids, so every request decodes its full length."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return ()


def _prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        q = f"What is {i % 9 + 1} + {(i * 7) % 9 + 1}? The solver before you said {(i * 5) % 17}."
        text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                             tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def _model_folder(args, root: str) -> str:
    if args.model_path:
        return args.model_path
    try:
        from drmas_graph.engine.models import smollm2_path

        return smollm2_path()
    except Exception as exc:  # noqa: BLE001 - the benchmark runs on a tiny model instead
        print(f"(SmolLM2 unavailable: {exc}; using a tiny random Llama)")
        from drmas_graph.testing import tiny_model, tiny_tokenizer

        tok = tiny_tokenizer()
        path = os.path.join(root, "tiny")
        tiny_model(tok, seed=0, hidden_size=128).save_pretrained(path)
        tok.save_pretrained(path)
        return path


# ---- the three systems -------------------------------------------------------------------------
def run_embedded(policy: TransformersPolicy, prompts, lengths, seed0: int) -> int:
    futures = [policy.submit(p, SamplingParams(temperature=1.0, max_new_tokens=n, seed=seed0 + i))
               for i, (p, n) in enumerate(zip(prompts, lengths))]
    gens = [f.result() for f in futures]
    assert [len(g.token_ids) for g in gens] == list(lengths)
    return sum(lengths)


@torch.inference_mode()
def run_generate(model, pad_id: int, prompts, lengths, max_batch: int) -> int:
    device = next(model.parameters()).device
    for start in range(0, len(prompts), max_batch):
        chunk, n_new = prompts[start:start + max_batch], max(lengths[start:start + max_batch])
        L = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), L), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, L - len(p):] = torch.tensor(p)
            mask[i, L - len(p):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n_new, min_new_tokens=n_new,
                             pad_token_id=pad_id, output_scores=False)
        assert out.shape[1] == L + n_new
    return sum(lengths)


async def _vllm_all(url: str, model: str, prompts, lengths, seed0: int) -> int:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        async def one(i):
            body = {"model": model, "prompt": prompts[i], "max_tokens": lengths[i], "temperature": 1.0,
                    "top_p": 1.0, "top_k": -1, "ignore_eos": True, "logprobs": 0, "seed": seed0 + i}
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        counts = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    assert list(counts) == list(lengths), (counts, lengths)
    return sum(counts)


def vllm_cpu_binding(threads: int) -> dict[str, str]:
    """The environment that makes a vLLM CPU server compute on cores 0..threads-1 and reserve none (its default on
    a 2-core machine computes on one core and reserves the other for its API server)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def start_vllm(path: str, threads: int, max_batch: int):
    from drmas_graph.served import launch_vllm
    from drmas_graph.served.vllm import vllm_python

    python = vllm_python()
    if not python:
        print("vLLM venv not found (scripts/setup_vllm.sh, $DRMAS_VLLM_PYTHON): vLLM skipped")
        return None
    return launch_vllm(path, python=python, env=vllm_cpu_binding(threads), ready_timeout_s=900, kv_cache_gib=2,
                       extra_args=["--max-num-seqs", str(max_batch), "--served-model-name", "bench"])


def _with_packed(fn):
    """`model.generate` with the embedded engine's oneDNN linear layers, to separate the two gains."""
    with _PACKED:  # the model's layers were made packable by the engine (PackedLinear.install)
        return fn()


class _Switchable(_IgnoreEOS):
    """The embedded engine whose prompt cache can be turned off, and is emptied, between runs."""

    use_cache = True
    _reset = False

    def start(self, use_cache: bool) -> None:
        self.use_cache, self._reset = use_cache, True

    def _engine_step(self, engine, admit):
        if self._reset:
            engine.prompt_cache.entries.clear()
            self._reset = False
        engine.prompt_cache.size = self.prompt_cache_size if self.use_cache else 0
        engine.prefix_reuse = self.use_cache
        return super()._engine_step(engine, admit)


def run_multiturn(policy: _Switchable, use_cache: bool, args, seed0: int) -> int:
    """`--episodes` conversations of `--turns` turns; returns the tokens generated."""
    policy.start(use_cache)
    tok = policy.tokenizer
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {e} + {2 * e + 3}?"}]
             for e in range(args.episodes)]
    for t in range(args.turns):
        prompts = [tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False) for c in convs]
        futures = [policy.submit(p, SamplingParams(temperature=1.0, max_new_tokens=args.turn_tokens,
                                                   seed=seed0 + 100 * t + e)) for e, p in enumerate(prompts)]
        for c, f in zip(convs, futures):
            reply = tok.decode(f.result().token_ids, skip_special_tokens=True)
            c += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"Check step {t + 1}."}]
    return args.episodes * args.turns * args.turn_tokens


def measure_multiturn(args, model, tokenizer) -> dict[str, float]:
    policy = _Switchable(model, tokenizer, name="embedded", max_batch_size=args.max_batch, seed=0)
    try:
        seeds = iter(range(0, 10**9, 10**4))
        rounds: dict[str, list] = {"cache on": [], "cache off": []}
        for r in range(args.repeats + 1):  # round 0: warm-up
            seed0 = next(seeds)
            for name, on in (("cache on", True), ("cache off", False)):
                before = (policy.stats.prefill_tokens, policy.stats.reused_prompt_tokens)
                time.sleep(args.settle_s)
                wall, tokens = _timed(lambda: run_multiturn(policy, on, args, seed0))
                prefilled = policy.stats.prefill_tokens - before[0]
                reused = policy.stats.reused_prompt_tokens - before[1]
                if r:
                    rounds[name].append(wall)
                print(f"  round {r or 'warm-up'} {name:9s} {wall:6.2f} s, {tokens / wall:6.1f} tok/s, prompt tokens "
                      f"prefilled {prefilled}, reused {reused}", flush=True)
    finally:
        policy.close()
    on, off = (statistics.median(rounds[k]) for k in ("cache on", "cache off"))
    print(f"multiturn: median {on:.2f} s with the prefix cache, {off:.2f} s without: {off / on:.2f}x")
    return {"cache on": on, "cache off": off}


# ---- measurement -------------------------------------------------------------------------------
def _timed(fn) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - t0, tokens


def measure(systems: dict, repeats: int, settle_s: float = 2.0) -> dict[str, float]:
    """tokens/s per system: one warm-up each, then `repeats` interleaved rounds; medians.

    Each timed run starts `settle_s` after the previous one ended: vLLM's OpenMP threads keep spinning on
    the shared cores for about a second after its last request (measured: ~1 core-second), which would
    otherwise be charged to whichever system runs next.
    """
    for fn in systems.values():
        fn()
    rates: dict[str, list[float]] = {name: [] for name in systems}
    for r in range(repeats):
        for name, fn in systems.items():
            time.sleep(settle_s)
            wall, tokens = _timed(fn)
            rates[name].append(tokens / wall)
            print(f"  round {r + 1} {name:10s} {tokens / wall:8.1f} tok/s ({wall:.2f} s)", flush=True)
    return {name: statistics.median(v) for name, v in rates.items()}


def workloads(args, tokenizer) -> dict[str, tuple[list, list]]:
    rng = random.Random(0)
    equal = (_prompts(tokenizer, args.batch), [args.new_tokens] * args.batch)
    distinct = _prompts(tokenizer, max(1, args.requests // args.group))
    prompts = [p for p in distinct for _ in range(args.group)][: args.requests]
    lengths = [rng.randint(args.min_tokens, args.max_tokens) for _ in prompts]
    return {"equal": equal, "ragged": (prompts, lengths)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads = vLLM's bound cores")
    ap.add_argument("--batch", type=int, default=32, help="equal workload: requests")
    ap.add_argument("--new-tokens", type=int, default=64, help="equal workload: tokens per request")
    ap.add_argument("--requests", type=int, default=64, help="ragged workload: requests")
    ap.add_argument("--group", type=int, default=8, help="ragged workload: copies of each prompt (GRPO group)")
    ap.add_argument("--min-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-batch", type=int, default=32, help="engine slots (embedded max_batch_size, vLLM max-num-seqs)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=["equal", "ragged", "multiturn"], default=None)
    ap.add_argument("--episodes", type=int, default=8, help="multiturn workload: conversations")
    ap.add_argument("--turns", type=int, default=4, help="multiturn workload: turns per conversation")
    ap.add_argument("--turn-tokens", type=int, default=24, help="multiturn workload: tokens per reply")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--settle-s", type=float, default=2.0, help="idle seconds before each timed run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as root:
        path = _model_folder(args, root)
        tokenizer = AutoTokenizer.from_pretrained(path)
        dtype = getattr(torch, args.dtype)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
        if _PACKED is not None:
            PackedLinear.install(model)  # what the engine does on CPU; gen+onednn uses it too
        if args.only == "multiturn":
            print(f"model {path} ({args.dtype}, {args.device}), torch threads {torch.get_num_threads()}, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
            measure_multiturn(args, model, tokenizer)
            return
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        policy = _IgnoreEOS(model, tokenizer, name="embedded", max_batch_size=args.max_batch, seed=0)
        server = None if (args.no_vllm or args.device != "cpu") else start_vllm(path, args.threads, args.max_batch)
        print(f"model {path} ({args.dtype}, {args.device}), torch threads {torch.get_num_threads()}, "
              f"max batch {args.max_batch}, {args.repeats} interleaved rounds", flush=True)
        results = {}
        try:
            for name, (prompts, lengths) in workloads(args, tokenizer).items():
                if args.only and name != args.only:
                    continue
                print(f"{name}: {len(prompts)} requests, {len({tuple(p) for p in prompts})} distinct prompts, "
                      f"{sum(lengths)} tokens (lengths {min(lengths)}-{max(lengths)})", flush=True)
                seeds = iter(range(0, 10**9, 10**4))
                systems = {
                    "embedded": lambda p=prompts, n=lengths: run_embedded(policy, p, n, next(seeds)),
                    "generate": lambda p=prompts, n=lengths: policy.run_on_worker(
                        lambda: run_generate(model, pad_id, p, n, args.max_batch)),
                }
                if args.device == "cpu" and packed_linear_available():
                    systems["gen+onednn"] = lambda p=prompts, n=lengths: policy.run_on_worker(
                        lambda: _with_packed(lambda: run_generate(model, pad_id, p, n, args.max_batch)))
                if server is not None:
                    systems["vllm"] = lambda p=prompts, n=lengths: asyncio.run(
                        _vllm_all(server.url, "bench", p, n, next(seeds)))
                spent = (policy.stats.prefill_s, policy.stats.decode_s)
                results[name] = measure(systems, args.repeats, args.settle_s)
                prefill, decode = policy.stats.prefill_s - spent[0], policy.stats.decode_s - spent[1]
                print(f"  embedded engine time (all rounds): prefill {prefill:.2f} s ({prefill / (prefill + decode):.0%}),"
                      f" decode {decode:.2f} s", flush=True)
        finally:
            policy.close()
            if server is not None:
                server.close()
        cols = ("embedded", "generate", "gen+onednn", "vllm")
        print(f"\n{'workload':10s} " + " ".join(f"{c:>11s}" for c in cols) + "   embedded / generate, gen+onednn, vllm"
              "   (tokens/s, medians)")
        for name, r in results.items():
            cells = " ".join(f"{r[c]:11.1f}" if c in r else f"{'-':>11s}" for c in cols)
            ratios = ", ".join(f"{r['embedded'] / r[c]:.2f}x" if c in r else "-" for c in cols[1:])
            print(f"{name:10s} {cells}   {ratios}")


if __name__ == "__main__":
    main()
