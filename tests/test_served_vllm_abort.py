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
    params = SamplingParams(temperature=1.0, max_new_tokens=3000)  # ~10 s of generation on this CPU
    p = VLLMPolicy(server.url, policy.tokenizer, name="vllm", backoff_s=0.5,
                   extra_sampling_params={"ignore_eos": True})
    try:
        # vLLM's /metrics lag, so the request is given time to reach the engine; a pause sent before it
        # arrives only delays it (no abort), so that attempt is repeated with a longer head start
        for head_start_s in (1.0, 2.0, 4.0):
            out = {}
            worker = threading.Thread(target=lambda: out.update(gen=p.generate([5, 6, 7], params)))
            worker.start()
            time.sleep(head_start_s)
            assert httpx.post(server.url + "/pause", params={"mode": "abort"}, timeout=30).json() == {"status": "paused"}
            httpx.post(server.url + "/resume", timeout=30)
            worker.join(120)
            if p.retries >= 1:
                break
        assert p.retries >= 1 and out["gen"].finish_reason == "length" and len(out["gen"].token_ids) == 3000
    finally:
        p.close()
