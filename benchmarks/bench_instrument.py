"""Instrumentation overhead per LLM call, the throughput gain of dynamic batching, and the cost of an SDK call.

(a) The same greedy 16-token call on the tiny model, made (1) directly on the policy (render, generate,
    decode) and (2) as `llm.invoke(messages)` from inside a node of an instrumented graph (interception,
    routing, rendering, parsing, Turn recording). Calls alternate; medians over `--calls` each.
(b) 8 concurrent episodes of a solver -> verifier graph with the dynamic batcher, against the same
    policy limited to one request at a time (max_batch_size=1). Ratio of episodes/s. The default model
    is a random Llama with hidden 256 and 4 layers generating 64 tokens per call; with the smallest
    model (--hidden 64 --layers 2) the Python cost of each call (LangGraph, LangChain, chat template;
    serialized by the GIL across the 8 episode threads) takes a larger share and the gain is smaller.
(c) The same call made with the OpenAI SDK (`client.chat.completions.create`, caught at the HTTP layer,
    answered as a `chat.completion`) against a LangChain chat model's `llm.invoke`, both inside one
    instrumented node and both served by the same policy. Calls alternate; medians over `--calls` each;
    the ratio is SDK / LangChain (target within 5%). The SDK's own work (building the request, parsing the
    answer: the same with or without drmas-graph) is timed too, with a mock transport outside the run.

    python benchmarks/bench_instrument.py [--calls 200] [--episodes 8] [--rounds 3] [--hidden 256 --layers 4]
                                          [--only a|b|c]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langgraph.graph import END, START, StateGraph  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._apps import QA, AppModel, solver_verifier  # noqa: E402
from drmas_graph import SamplingParams, app_models, instrument  # noqa: E402
from drmas_graph.testing import tiny_policy  # noqa: E402

MSGS = [SystemMessage("You are a careful solver."), HumanMessage("What is 12 + 30? Reply with just the number.")]


def overhead(n_calls: int) -> dict[str, float]:
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=16, temperature=0), batch_wait_s=0.0)
    policy.eos_token_ids  # noqa: B018 - warm caches
    llm = AppModel()
    direct_s, intercepted_s = [], []

    def node(state):
        for _ in range(n_calls):
            t0 = time.perf_counter()
            ids = policy.render(MSGS)
            gen = policy.generate(ids, policy.sampling)
            policy.parse(policy.decode(gen.token_ids))
            direct_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            llm.invoke(MSGS)
            intercepted_s.append(time.perf_counter() - t0)
        return {"n": n_calls}

    g = StateGraph(QA)
    g.add_node("solver", node)
    g.add_edge(START, "solver")
    g.add_edge("solver", END)
    app = instrument(g.compile(), {"solver": policy})
    episode = app.rollout({"n": 0})
    assert len(episode.turns) == n_calls
    d, i = statistics.median(direct_s), statistics.median(intercepted_s)
    return {"direct_ms": d * 1e3, "instrumented_ms": i * 1e3, "overhead_us": (i - d) * 1e6,
            "overhead_ratio": (i - d) / d}


def sdk_vs_langchain(n_calls: int) -> dict[str, float]:
    """(c): medians of the same served call through the OpenAI SDK and through a LangChain chat model."""
    import openai

    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=16, temperature=0), batch_wait_s=0.0)
    llm, client = AppModel(), openai.OpenAI(api_key="never-sent", max_retries=0)
    http = importlib.import_module(next(c.__module__.split(".")[0] for c in type(client._client).__mro__
                                        if c.__module__.startswith("httpx")))  # httpx, or httpx2 (openai>=3)
    canned = {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "usage": {
        "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, "choices": [{
            "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "42"}}]}
    bare = openai.OpenAI(api_key="never-sent", max_retries=0, http_client=http.Client(
        transport=http.MockTransport(lambda request: http.Response(200, json=canned))))
    messages = [{"role": "system", "content": MSGS[0].content}, {"role": "user", "content": MSGS[1].content}]
    sdk_s, langchain_s, own_s, texts = [], [], [], set()

    def node(state):
        for _ in range(n_calls + 1):  # the first round warms every path (imports, caches) and is not counted
            t0 = time.perf_counter()
            reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages)
            sdk_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            message = llm.invoke(MSGS)
            langchain_s.append(time.perf_counter() - t0)
            texts.update((reply.choices[0].message.content, message.content))
            with app_models():  # the SDK's own work (build the request, parse the answer), transport free
                t0 = time.perf_counter()
                bare.chat.completions.create(model="gpt-4o-mini", messages=messages)
                own_s.append(time.perf_counter() - t0)
        return {"n": n_calls}

    g = StateGraph(QA)
    g.add_node("solver", node)
    g.add_edge(START, "solver")
    g.add_edge("solver", END)
    episode = instrument(g.compile(), {"solver": policy}, strict=True).rollout({"n": 0})
    assert len(episode.turns) == 2 * (n_calls + 1) and len(texts) == 1  # greedy: both paths, one reply
    assert len({t.prompt_ids for t in episode.turns}) == 1  # the same prompt ids through both paths
    policy.close()
    s, lc, own = (statistics.median(x[1:]) for x in (sdk_s, langchain_s, own_s))
    return {"sdk_ms": s * 1e3, "langchain_ms": lc * 1e3, "ratio": s / lc, "sdk_own_ms": own * 1e3}


def batching(n_episodes: int, rounds: int, hidden: int, layers: int, new_tokens: int) -> dict[str, float]:
    graph = solver_verifier()
    results = {}
    for label, max_batch in (("one_at_a_time", 1), ("dynamic", 32)):
        policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=new_tokens), max_batch_size=max_batch,
                             hidden_size=hidden, num_layers=layers)
        app = instrument(graph, {"solver": policy, "verifier": policy})
        inputs = [{"question": f"What is {i} + {i}?"} for i in range(n_episodes)]
        app.batch(inputs[:2])  # warm-up
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            app.batch(inputs)
            times.append(time.perf_counter() - t0)
        results[label] = n_episodes / statistics.median(times)
        results[f"{label}_max_batch"] = policy.stats.max_batch
        policy.close()
    results["speedup"] = results["dynamic"] / results["one_at_a_time"]
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256, help="(b): hidden size of the random model")
    ap.add_argument("--layers", type=int, default=4, help="(b): layers of the random model")
    ap.add_argument("--new-tokens", type=int, default=64, help="(b): tokens generated per call")
    ap.add_argument("--only", choices=["a", "b", "c"], help="run one measurement")
    args = ap.parse_args()
    if args.only in (None, "a"):
        o = overhead(args.calls)
        print(f"(a) per-call: direct {o['direct_ms']:.2f} ms, instrumented {o['instrumented_ms']:.2f} ms, "
              f"overhead {o['overhead_us']:.0f} us = {100 * o['overhead_ratio']:.1f}% (target < 5%)")
    if args.only in (None, "c"):
        c = sdk_vs_langchain(args.calls)
        print(f"(c) per-call, served: OpenAI SDK {c['sdk_ms']:.2f} ms, LangChain chat model {c['langchain_ms']:.2f} ms, "
              f"ratio {c['ratio']:.3f} (target within 5%); of the SDK call, {c['sdk_own_ms']:.2f} ms are the SDK's own "
              "work (request and response objects, measured with a mock transport outside the run)")
    if args.only not in (None, "b"):
        return
    b = batching(args.episodes, args.rounds, args.hidden, args.layers, args.new_tokens)
    print(f"(b) {args.episodes} concurrent episodes (random Llama, hidden {args.hidden}, {args.layers} layers, "
          f"{args.new_tokens} tokens per call): one-at-a-time {b['one_at_a_time']:.2f} ep/s, dynamic batching "
          f"{b['dynamic']:.2f} ep/s (max batch {b['dynamic_max_batch']}), speedup {b['speedup']:.2f}x (target >= 3x)")


if __name__ == "__main__":
    main()
