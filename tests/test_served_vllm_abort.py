"""Real vLLM server: a request aborted by a pause is retried to completion.

Its own module, so it gets a fresh server (module-scoped fixtures): on a server that has just been
through weight syncs, the abort-by-pause did not reach the in-flight request in a full-suite run.
"""

import threading
import time

import httpx

from drmas_graph import SamplingParams
from drmas_graph.served import VLLMPolicy
from tests.test_served_vllm import ckpt, policy, pytestmark, server, tokenizer  # noqa: F401  (fixtures)


def test_request_aborted_by_a_pause_is_retried(policy, server):
    # 3000 tokens take 3-10 s on a 2-core machine, depending on its load
    params = SamplingParams(temperature=1.0, max_new_tokens=3000)
    p = VLLMPolicy(server.url, policy.tokenizer, name="vllm", backoff_s=0.5, max_retries=10,
                   extra_sampling_params={"ignore_eos": True})
    try:
        out = {}
        worker = threading.Thread(target=lambda: out.update(gen=p.generate([5, 6, 7], params)))
        worker.start()
        # A pause that lands before the request reaches the engine, or after it finished, aborts nothing,
        # and neither the request's arrival nor the pause's landing can be observed from here (/metrics
        # lag by seconds). So pause and resume until the policy has seen an abort: one pause lands while
        # the request runs. Each resends the request from the start, so a bounded number of them is fine.
        deadline = time.monotonic() + 120
        while worker.is_alive() and p.retries == 0 and time.monotonic() < deadline:
            time.sleep(0.3)
            assert httpx.post(server.url + "/pause", params={"mode": "abort"}, timeout=30).json() == {"status": "paused"}
            httpx.post(server.url + "/resume", timeout=30)
        worker.join(120)
        assert p.retries >= 1, "no pause landed while the request ran"
        assert out["gen"].finish_reason == "length" and len(out["gen"].token_ids) == 3000
    finally:
        p.close()
