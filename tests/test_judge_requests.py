"""Every request a judge sends is one of `judge/calls` and its tokens count: a served judge on a local HTTP server
(127.0.0.1) that counts the requests it receives, whose first request answers late (after the judge's timeout_s).
Before issue 48 the openai client's own retries (max_retries 2 by default) sent requests judge/calls never
counted, and went on sending them from the abandoned call's thread."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from drmas_graph.errors import ConfigError
from drmas_graph.rewards import Judge, judge_model
from tests.test_judge import RUBRIC, TASK, episode

USAGE = {"prompt_tokens": 70, "completion_tokens": 9, "total_tokens": 79}


class CountingJudgeServer:
    """An OpenAI-compatible chat server counting requests; the first one answers after `first_delay_s`."""

    def __init__(self, first_delay_s: float):
        self.requests = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                with outer.lock:
                    outer.requests += 1
                    first = outer.requests == 1
                if first:
                    time.sleep(first_delay_s)
                message = {"role": "assistant", "content": json.dumps({"reason": "fine", "score": 0.5})}
                body = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "judge",
                                   "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                                   "usage": USAGE}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up on it
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("request_timeout", [None, 5.0])
def test_every_request_that_leaves_counts_in_judge_calls_and_tokens(request_timeout):
    """timeout_s 0.4, the first request answers after 1.5 s. Without a spec timeout the request itself times out
    at 0.4 s (no reply, no tokens); with `timeout: 5` the abandoned call's reply arrives late and its tokens
    count. Either way: the server's request count == judge/calls, tokens == answered requests * usage."""
    server = CountingJudgeServer(first_delay_s=1.5)
    try:
        spec = {"base_url": server.url, "model": "judge"}
        if request_timeout is not None:
            spec["timeout"] = request_timeout
        judge = Judge(judge_model(spec, timeout_s=0.4), RUBRIC, mode="episode", timeout_s=0.4, max_retries=1)
        judgement = judge.judge_episode(TASK, episode("5", id="e1"))
        assert judgement.reward == 0.5 and judgement.record["attempts"] == 2
        time.sleep(2.5)  # the abandoned call's thread ends (its request answered or timed out)
        metrics = judge.reward_metrics()
        answered = 2 if request_timeout else 1
        assert server.requests == metrics["judge/calls"] == 2
        assert (metrics["judge/retries"], metrics["judge/failed_calls"]) == (1, 1)
        assert metrics["judge/input_tokens"] == 70 * answered and metrics["judge/output_tokens"] == 9 * answered
    finally:
        server.close()


def test_a_model_whose_client_retries_on_its_own_is_refused():
    from langchain_openai import ChatOpenAI

    hidden = ChatOpenAI(base_url="http://127.0.0.1:9/v1", model="judge", api_key="EMPTY")  # openai's default: 2
    with pytest.raises(ConfigError, match=r"judge model 'judge' has max_retries=None: .*Build it with max_retries=0"):
        Judge(hidden, RUBRIC)
    Judge(ChatOpenAI(base_url="http://127.0.0.1:9/v1", model="judge", api_key="EMPTY", max_retries=0), RUBRIC)
    with pytest.raises(ConfigError, match="max_retries must be 0 or absent"):
        judge_model({"base_url": "http://127.0.0.1:9/v1", "model": "judge", "max_retries": 2})
    assert judge_model({"base_url": "http://127.0.0.1:9/v1", "model": "judge"}).root_client.max_retries == 0
