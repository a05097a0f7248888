"""GPU check of SGLangPolicy against a real SGLang server (not collected by pytest: run it as a script).

    python tests/gpu/sglang_check.py [--sglang-python PY] [--model-path DIR] [--dtype bfloat16]

On a CUDA machine where `PY -c "import sglang"` works (default: this python), it:
  1. builds a tiny random Qwen2 (head_dim 64) + the tiny tokenizer in a temp folder (no downloads), or uses
     `--model-path`, plus a perturbed copy ("step 1");
  2. launches `python -m sglang.launch_server` on 127.0.0.1 (weight_version 0) and waits for /health_generate;
  3. runs the math example graph (solver -> verifier) through `instrument()` with SGLangPolicy and checks every
     turn: ids and logprobs aligned, finish reasons, version 0, and logprobs vs our own float32 recomputation
     of log_softmax(logits / T) with the same weights (bf16 servers differ by rounding: reported, loose bound);
  4. syncs the step-1 weights from disk (pause -> update_weights_from_disk -> continue) as version 1, checks
     /model_info reports "1", greedy output changed, and each generation reports policy_version 1;
  5. stops the server and prints a PASS/FAIL table; exit status 0 only if everything passed.
Budget: ~1-3 min (server start dominates).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((name, bool(ok), detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {name} {detail}", flush=True)
    return ok


def summary() -> int:
    failed = [r for r in RESULTS if not r[1]]
    print("\n==== SGLang GPU check summary ====")
    for name, ok, detail in RESULTS:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}  {detail}")
    verdict = "PASS" if RESULTS and not failed else "FAIL"
    print(f"RESULT: {verdict} ({len(RESULTS) - len(failed)}/{len(RESULTS)} checks)")
    return 0 if RESULTS and not failed else 1


def build_models(root: str, model_path: str | None) -> tuple[str, str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_path is None:
        from drmas_graph.testing import tiny_model, tiny_tokenizer

        tok = tiny_tokenizer()
        model_path = os.path.join(root, "step0")
        tiny_model(tok, seed=0, arch="qwen2", hidden_size=256).save_pretrained(model_path)
        tok.save_pretrained(model_path)
    else:
        tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05 * (p.std() if p.numel() > 1 else 1.0))
    step1 = os.path.join(root, "step1")
    model.save_pretrained(step1)
    tok.save_pretrained(step1)
    return model_path, step1


def recompute(path: str, prompt_ids, response_ids, temperature: float) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    with torch.inference_mode():
        ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=device)
        logits = model(input_ids=ids).logits[0].float()[len(prompt_ids) - 1: -1] / (temperature or 1.0)
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(list(response_ids), device=device).view(-1, 1))
    return lp.view(-1).tolist()


def run(args) -> None:
    from transformers import AutoTokenizer

    from drmas_graph import SamplingParams, instrument
    from drmas_graph.cli._train import StandInChatModel
    from drmas_graph.served import SGLangPolicy, launch_sglang
    from graphs.math.graph import build_graph

    py = args.sglang_python or sys.executable
    probe = subprocess.run([py, "-c", "import sglang, torch; print(sglang.__version__, torch.cuda.is_available())"],
                           capture_output=True, text=True)
    if not check("sglang importable with CUDA", probe.returncode == 0 and probe.stdout.strip().endswith("True"),
                 (probe.stdout.strip() or probe.stderr.strip()[-300:])):
        return
    with tempfile.TemporaryDirectory() as root:
        base, step1 = build_models(root, args.model_path)
        t0 = time.perf_counter()
        server = launch_sglang(base, python=py, dtype=args.dtype, ready_timeout_s=args.ready_timeout,
                               extra_args=["--mem-fraction-static", "0.3", "--disable-cuda-graph",
                                           "--context-length", "4096", *args.extra_args],
                               log_path=os.path.join(root, "sglang.log"))
        check("server ready", True, f"in {time.perf_counter() - t0:.0f} s at {server.url}")
        tok = AutoTokenizer.from_pretrained(base)
        policy = SGLangPolicy(server.url, tok, name="sglang", servers=[server], backoff_s=0.5,
                              sampling=SamplingParams(temperature=0.7, max_new_tokens=24))
        try:
            check("initial version", policy.refresh_version() == 0, f"version {policy.version}")
            app = instrument(build_graph(StandInChatModel(), max_rounds=2), {"solver": policy, "verifier": policy})
            episode = app.rollout({"question": "What is 2 + 3?"})
            check("instrumented episode ok", episode.ok and len(episode.turns) >= 2,
                  f"{len(episode.turns)} turns, agents {episode.agents}")
            bound = 1e-3 if args.dtype in ("float32", "float") else 0.1
            for t in episode.turns:
                aligned = len(t.response_ids) == len(t.response_logprobs) > 0
                ours = recompute(base, t.prompt_ids, t.response_ids, 0.7)
                diff = max(abs(a - b) for a, b in zip(ours, t.response_logprobs))
                mean = sum(abs(a - b) for a, b in zip(ours, t.response_logprobs)) / len(ours)
                check(f"turn {t.index} ({t.agent}) ids/logprobs", aligned and t.policy_version == 0
                      and t.finish_reason in ("stop", "length") and mean < bound,
                      f"{len(t.response_ids)} tokens, finish {t.finish_reason}, |logprob - ours| max {diff:.2e} "
                      f"mean {mean:.2e} (bound {bound:g})")
                text = tok.decode(list(t.response_ids), skip_special_tokens=True)
                check(f"turn {t.index} decode", t.response_text == text)
            prompt = tok.encode("What is 2 + 3?", add_special_tokens=False)
            greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
            before = policy.generate(prompt, greedy)
            result = policy.sync_weights(step1, 1)
            info = __import__("httpx").get(server.url + "/model_info", timeout=30).json()
            check("weight sync", policy.version == 1 and str(info.get("weight_version")) == "1",
                  f"{result['seconds']:.2f} s, /model_info weight_version {info.get('weight_version')!r}")
            after = policy.generate(prompt, greedy)
            check("new weights serve", after.policy_version == 1 and after.token_ids != before.token_ids,
                  f"greedy ids changed: {before.token_ids[:6]} -> {after.token_ids[:6]}")
            ours = recompute(step1, prompt, after.token_ids, 0.0)
            mean = sum(abs(a - b) for a, b in zip(ours, after.logprobs)) / len(ours)
            check("logprobs after sync", mean < bound, f"mean |diff| {mean:.2e} vs step-1 weights")
        finally:
            policy.close()
            check("server stopped", not server.alive(), f"pid {server.pid}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sglang-python", default=os.environ.get("DRMAS_SGLANG_PYTHON"))
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ready-timeout", type=float, default=240.0)
    ap.add_argument("extra_args", nargs="*", help="more sglang.launch_server flags (after --)")
    args = ap.parse_args()
    try:
        run(args)
    except Exception as exc:  # noqa: BLE001 - the summary must say what broke
        traceback.print_exc()
        check("no exception", False, f"{type(exc).__name__}: {str(exc)[:2000]}")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
