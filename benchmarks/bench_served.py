"""Rollout throughput of the embedded engine (TransformersPolicy) against a vLLM CPU server, side by side.

    python benchmarks/bench_served.py [--workload demo] [--model smollm2|tiny] [--steps 3] [--backend both]
    python benchmarks/bench_served.py --workload math [--episodes 16] [--max-new-tokens 32] [--model-path DIR]

`--workload demo` (the default): the CPU demo's own rollouts, through the demo's own code path. The trainer is
built from `graphs/math/demo.yaml` as `drmas-graph train` builds it (`load_config` + `build_graph_and_env` +
`Trainer(..., train=False)`: the checked math graph, solver + verifier on one SmolLM2-135M-Instruct, float32,
`max_batch_size` 32, `max_concurrency` 32), once per backend:
- embedded: the config as it is;
- vLLM: the same config with `models.smollm2.serve: {engine: vllm, launch: true, python: <the vLLM venv>}`; the
  trainer launches the server from the same weights (and stops it in `trainer.close()`).
Each backend rolls out `trainer.rollouts(trainer.batch_tasks(step), step, group_size, phase="train")`: step 0 as
a warm-up (not timed), then steps 1..`--steps`, each 4 tasks x G = 8 = 32 concurrent episodes, with the demo's
per-agent sampling (temperature 0.7, max_new_tokens 12) and the demo's per-episode seeds. Both backends get
the same tasks and the same start weights (train=False: no update between steps). Printed per backend: episodes/s
and response tokens/s over the timed steps (episodes kept for scoring / wall time; tokens = the response tokens of
their turns), turns and response tokens per episode, response and prompt tokens per turn (the two samplers draw
different replies, so episodes differ in length: these say whether the workloads matched), the setup time
(model load, plus the vLLM server's start; not in the rates), then embedded / vLLM for both rates (issue 50's
target: >= 1.2x in both). `--model tiny`: a tiny random Llama (hidden 128, head dim 32, which vLLM's CPU build
serves) saved to a temporary folder that both backends load, to check the wiring in a minute.

`--workload math` (the earlier measurement): graphs/math/graph.py (solver -> verifier, up to `--rounds` solver
turns) under `instrument()` with both agents on one policy; `--episodes` episodes run concurrently (asyncio),
`--repeats` times after one warm-up episode; both backends load the same weights (a tiny random Llama by default,
or `--model-path`) and sample at temperature 1 with the same `--max-new-tokens`. It also times weight sync from
disk, median of 3: the embedded policy's `from_pretrained` + `load_state_dict` vs `VLLMPolicy.sync_weights`
(pause -> collective_rpc reload_weights -> update_weight_version -> resume -> /weight_info check).

The vLLM half needs the vLLM venv (scripts/setup_vllm.sh; `--vllm-python`, $DRMAS_VLLM_PYTHON or ./.venv-vllm);
without it only the embedded numbers are printed. `--json PATH` writes the demo workload's numbers.

The vLLM server computes on the same cores as the embedded engine (`--vllm-cores all`, the default:
VLLM_CPU_OMP_THREADS_BIND=0..T-1 for this process's T torch threads, VLLM_CPU_NUM_OF_RESERVED_CPU=0, as
bench_roofline.py and bench_rollout.py bind it). `--vllm-cores auto` leaves vLLM's own default, which on a
2-core machine computes on one core and reserves the other for its API server (and the vLLM figures of this
benchmark before 2026-12-05 were measured that way).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WEAVE_DISABLED", "true")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.bench_rollout import vllm_cpu_binding  # noqa: E402
from drmas_graph import SamplingParams, instrument  # noqa: E402
from drmas_graph.cli._train import StandInChatModel  # noqa: E402
from drmas_graph.engine.transformers_policy import TransformersPolicy  # noqa: E402
from graphs.math.graph import build_graph  # noqa: E402


# --- the demo's workload -----------------------------------------------------------------------------------

DEMO_CONFIG = os.path.join(ROOT, "graphs", "math", "demo.yaml")
DEMO_MODEL = "smollm2"
"""The demo's one model entry (both agents share it)."""


def demo_config(model_path: str, run_dir: str, vllm_python: str | None = None) -> object:
    """`graphs/math/demo.yaml` as `drmas-graph train` loads it, in `run_dir`, on `model_path` ('smollm2' = the
    demo's own); with `vllm_python`, the model rolls out through a vLLM server that the trainer launches."""
    from drmas_graph.config import load_config

    overrides = [f"run_dir={run_dir}", "logging.progress=false", "logging.tensorboard=false",
                 "eval.before_training=false", f"models.{DEMO_MODEL}.path={json.dumps(model_path)}"]
    if vllm_python is not None:
        overrides += [f"models.{DEMO_MODEL}.serve.engine=vllm", f"models.{DEMO_MODEL}.serve.launch=true",
                      f"models.{DEMO_MODEL}.serve.python={json.dumps(vllm_python)}"]
    return load_config(DEMO_CONFIG, overrides)


def tiny_checkpoint(folder: str) -> str:
    """A tiny random Llama + its tokenizer saved in `folder` (hidden 128: head dim 32, which vLLM CPU serves)."""
    from drmas_graph.testing import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    tiny_model(tok, seed=0, hidden_size=128).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _step_numbers(runs: list, wall_s: float) -> dict[str, float]:
    """One timed step's totals over the episodes kept for scoring (`trainer.rollouts`' runs)."""
    turns = [t for _, episode in runs for t in episode.turns]
    return {"wall_s": wall_s, "episodes": len(runs), "turns": len(turns),
            "response_tokens": sum(t.n_response_tokens for t in turns),
            "prompt_tokens": sum(len(t.prompt_ids) for t in turns)}


def demo_backend(cfg: object, steps: int) -> dict:
    """Build the demo's trainer from `cfg` (timed: `setup_s`), roll out step 0 untimed, then steps 1..`steps`."""
    from drmas_graph.cli._train import build_graph_and_env
    from drmas_graph.train.loop.trainer import Trainer

    graph, env = build_graph_and_env(cfg)
    t0 = time.perf_counter()
    trainer = Trainer(graph, env, cfg, train=False)
    setup_s = time.perf_counter() - t0
    try:
        state = trainer.state
        sampling = {agent: {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                            "max_new_tokens": s.max_new_tokens} for agent, s in sorted(state.app.sampling.items())}
        trainer.rollouts(trainer.batch_tasks(0), 0, cfg.group_size, phase="train")  # warm-up
        per_step = []
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            runs, counts = trainer.rollouts(trainer.batch_tasks(step), step, cfg.group_size, phase="train")
            numbers = _step_numbers(runs, time.perf_counter() - t0)
            numbers["dropped"] = counts["failed_episodes"] + counts["no_llm_call_episodes"]
            per_step.append(numbers)
    finally:
        trainer.close()  # stops a launched vLLM server
    total = {key: sum(s[key] for s in per_step) for key in per_step[0]}
    return {"policy": type(state.models[DEMO_MODEL].policy).__name__, "setup_s": setup_s, "sampling": sampling,
            "steps": per_step, **total,
            "episodes/s": total["episodes"] / total["wall_s"],
            "tokens/s": total["response_tokens"] / total["wall_s"],
            "turns/episode": total["turns"] / total["episodes"],
            "tokens/episode": total["response_tokens"] / total["episodes"],
            "tokens/turn": total["response_tokens"] / total["turns"],
            "prompt_tokens/turn": total["prompt_tokens"] / total["turns"]}


def vllm_core_env(cores: str) -> dict[str, str]:
    """The vLLM server's CPU binding for `--vllm-cores`: this process's torch threads' cores (`all`), or empty for
    vLLM's own default (`auto`)."""
    return {} if cores == "auto" else vllm_cpu_binding(torch.get_num_threads())


@contextlib.contextmanager
def environment(extra: dict[str, str]):
    """`extra` in os.environ within (a server the trainer launches inherits it), restored after."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_demo(args: argparse.Namespace, python: str | None) -> dict:
    """Both backends on the demo's workload, one after the other in this process; printed and returned."""
    with tempfile.TemporaryDirectory() as root:
        model_path = tiny_checkpoint(os.path.join(root, "tiny")) if args.model == "tiny" else DEMO_MODEL
        cfg = demo_config(model_path, os.path.join(root, "embedded"))
        print(f"demo workload: {DEMO_CONFIG} (steps 1..{args.steps} after warm-up step 0; {cfg.tasks_per_step} "
              f"tasks x G = {cfg.group_size} per step, max_concurrency {cfg.max_concurrency}); model: "
              f"{'tiny random Llama (hidden 128, 2 layers)' if args.model == 'tiny' else 'SmolLM2-135M-Instruct'}, "
              f"{cfg.models[DEMO_MODEL].torch_dtype()}; torch threads {torch.get_num_threads()}", flush=True)
        rows = {}
        if args.backend in ("both", "embedded"):
            rows["embedded"] = demo_backend(cfg, args.steps)
        if args.backend in ("both", "vllm") and python:
            print(f"vLLM's CPU binding (--vllm-cores {args.vllm_cores}): {vllm_core_env(args.vllm_cores) or 'its own default'}",
                  flush=True)
            with environment(vllm_core_env(args.vllm_cores)):
                rows["vllm"] = demo_backend(demo_config(model_path, os.path.join(root, "vllm"), python), args.steps)
    result = {"workload": "demo", "model": args.model, "steps": args.steps, "vllm_cores": args.vllm_cores,
              "vllm_env": vllm_core_env(args.vllm_cores), "backends": rows}
    if len(rows) == 2:
        e, v = rows["embedded"], rows["vllm"]
        if e["sampling"] != v["sampling"]:  # one config for both: a difference is a defect of this benchmark
            raise SystemExit(f"the backends sampled differently: embedded {e['sampling']}, vLLM {v['sampling']}")
        result["ratio"] = {"episodes/s": e["episodes/s"] / v["episodes/s"], "tokens/s": e["tokens/s"] / v["tokens/s"]}
    print_demo(result)
    if args.backend in ("both", "vllm") and not python:
        print("\nvLLM venv not found (run scripts/setup_vllm.sh, set DRMAS_VLLM_PYTHON): embedded numbers only.")
    return result


def print_demo(result: dict) -> None:
    rows = result["backends"]
    for name, r in rows.items():
        print(f"{name} ({r['policy']}): sampling " + "; ".join(
            f"{agent} T={s['temperature']} top_p={s['top_p']} max_new_tokens={s['max_new_tokens']}"
            for agent, s in r["sampling"].items()) + "; step walls " + ", ".join(f"{s['wall_s']:.1f}" for s in r["steps"])
            + f" s; dropped episodes {r['dropped']}")
    print(f"\n{'backend':10s} {'episodes':>8s} {'wall s':>7s} {'episodes/s':>10s} {'tokens/s':>9s} {'turns/ep':>8s} "
          f"{'tokens/ep':>9s} {'tokens/turn':>11s} {'prompt/turn':>11s} {'setup s':>8s}")
    for name, r in rows.items():
        print(f"{name:10s} {r['episodes']:8d} {r['wall_s']:7.1f} {r['episodes/s']:10.2f} {r['tokens/s']:9.1f} "
              f"{r['turns/episode']:8.2f} {r['tokens/episode']:9.1f} {r['tokens/turn']:11.2f} "
              f"{r['prompt_tokens/turn']:11.1f} {r['setup_s']:8.1f}")
    if len(rows) == 2:
        e, v = rows["embedded"], rows["vllm"]
        print(f"\nembedded / vLLM: {result['ratio']['episodes/s']:.2f}x episodes/s, {result['ratio']['tokens/s']:.2f}x "
              f"tokens/s (target >= 1.2x in both)\nsetup, not in the rates: embedded {e['setup_s']:.1f} s (model load), "
              f"vLLM {v['setup_s']:.1f} s (the trainer's local copy + the server's start: ~"
              f"{v['setup_s'] - e['setup_s']:.0f} s)")


# --- the math graph (the earlier measurement) ---------------------------------------------------------------


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
    server = launch_vllm(base, python=python, ready_timeout_s=600, env=vllm_core_env(args.vllm_cores))
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


def run_math(args: argparse.Namespace, python: str | None) -> None:
    with tempfile.TemporaryDirectory() as root:
        base, step1 = _checkpoint(args, root)
        print(f"model: {args.model_path or 'tiny random Llama (hidden 128, 2 layers)'}; {args.episodes} concurrent "
              f"episodes x {args.repeats}, max_new_tokens={args.max_new_tokens}, T=1.0, torch threads "
              f"{torch.get_num_threads()}", flush=True)
        rows = {"embedded (TransformersPolicy)": embedded(args, base, step1)}
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


MATH_DEFAULTS = {"episodes": 16, "repeats": 3, "rounds": 2, "max_new_tokens": 32, "model_path": None}
DEMO_DEFAULTS = {"model": "smollm2", "steps": 3, "backend": "both", "json": None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options; one workload's options given with the other workload are refused."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("demo", "math"), default="demo",
                    help="demo: graphs/math/demo.yaml's rollouts (default); math: the earlier graphs/math/graph.py run")
    ap.add_argument("--vllm-python", default=None, help="the vLLM venv's python (default: $DRMAS_VLLM_PYTHON)")
    ap.add_argument("--vllm-cores", choices=("all", "auto"), default="all",
                    help="all (default): the vLLM server computes on cores 0..T-1, T = this process's torch threads, "
                         "none reserved (as bench_roofline/bench_rollout bind it); auto: vLLM's own default (on a "
                         "2-core machine one core computes, the other is reserved for its API server)")
    demo = ap.add_argument_group("--workload demo")
    demo.add_argument("--model", choices=("smollm2", "tiny"), help="the demo's SmolLM2-135M-Instruct (default) or "
                      "a tiny random Llama saved for both backends")
    demo.add_argument("--steps", type=int, help="timed steps after the warm-up step (default 3)")
    demo.add_argument("--backend", choices=("both", "embedded", "vllm"), help="which backends to run (default both)")
    demo.add_argument("--json", help="also write the numbers to this JSON file")
    math = ap.add_argument_group("--workload math")
    math.add_argument("--episodes", type=int, help="concurrent episodes per measurement (default 16)")
    math.add_argument("--repeats", type=int, help="measurements, median reported (default 3)")
    math.add_argument("--rounds", type=int, help="max solver turns per episode (default 2)")
    math.add_argument("--max-new-tokens", type=int, help="default 32")
    math.add_argument("--model-path", help="a Hugging Face model folder (default: a tiny random Llama)")
    args = ap.parse_args(argv)
    mine, other = (DEMO_DEFAULTS, MATH_DEFAULTS) if args.workload == "demo" else (MATH_DEFAULTS, DEMO_DEFAULTS)
    given = [f"--{k.replace('_', '-')}" for k in other if getattr(args, k) is not None]
    if given:
        other_name = "math" if args.workload == "demo" else "demo"
        ap.error(f"{', '.join(given)}: options of --workload {other_name}, not of --workload {args.workload}")
    for key, value in mine.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.workload == "demo" and args.steps < 1:
        ap.error("--steps must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    from drmas_graph.served.vllm import vllm_python

    python = args.vllm_python or vllm_python()
    if args.workload == "demo" and args.backend == "vllm" and not python:
        raise SystemExit("--backend vllm: no vLLM venv (run scripts/setup_vllm.sh, set DRMAS_VLLM_PYTHON or pass "
                         "--vllm-python)")
    if args.workload == "math":
        run_math(args, python)
        return
    result = run_demo(args, python)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
