"""Issue 58, round 7: a served HTTP call is one call whatever the client's retry settings (rev7_a), and only LLM
API requests are served: a POST to another service on an API-like path reaches that service (rev7_d)."""

import asyncio
import http.server
import json
import os
import pickle
import threading

import httpx
import pytest
import requests

from drmas_graph import instrument, llm_base_url
from drmas_graph.errors import ConfigError, InvalidReplyError, RolloutError, StrictModeError, UnservedCallWarning
from drmas_graph.instrumentation import EpisodeLimitError
from drmas_graph.testing import scripted_policy
from tests._no_network import no_network  # noqa: F401 - a fixture
from tests.test_instrument_clients import MESSAGES, fake_keys  # noqa: F401 - a fixture
from tests.test_instrument_clients_sdks import one_node

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not fetch its price list at import

SCHEMA = {"type": "object", "properties": {"total": {"type": "integer"}}, "required": ["total"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "Sum", "schema": SCHEMA}}
ANTHROPIC_FORMAT = {"format": {"type": "json_schema", "schema": SCHEMA}}
NOT_JSON = "is not one: 'five'"  # what the structured-output failure says about the reply "five"


def caught(fn):
    """Run `fn`, return the exception it raised (the app's `except Exception` fallback)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc
    raise AssertionError("no error")


# ---- rev7_a: an error raised while serving is raised once, as itself ---------------------------------------
def test_an_anthropic_reply_that_breaks_its_format_is_one_generation_and_the_error_itself(no_network):
    """The Anthropic SDK with its default max_retries=2: before, it took the StructuredOutputError raised in its
    transport for a connection failure, retried it (3 generations, 3 trainable turns) and raised
    APIConnectionError("Connection error."); sync, async and a stream alike."""
    import anthropic

    errors = []

    def writer(state):
        claude, aclaude = anthropic.Anthropic(), anthropic.AsyncAnthropic()
        kwargs = {"model": "claude-x", "max_tokens": 32, "messages": MESSAGES[1:], "output_config": ANTHROPIC_FORMAT}
        errors.append(caught(lambda: claude.messages.create(**kwargs)))
        errors.append(caught(lambda: asyncio.run(aclaude.messages.create(**kwargs))))

        async def stream():
            async with aclaude.messages.stream(**kwargs) as events:
                await events.get_final_message()
        errors.append(caught(lambda: asyncio.run(stream())))
        return {"out": "fallback"}

    policy = scripted_policy(["five"])
    episode = instrument(one_node(writer), {"writer": policy}).rollout({"q": "x"})
    assert [type(e) for e in errors] == [type(errors[0])] * 3 and all(NOT_JSON in str(e) for e in errors)
    assert all(isinstance(e, InvalidReplyError) and isinstance(e, anthropic.AnthropicError) for e in errors)
    assert type(errors[0]).__name__ == "InvalidReplyError" and errors[0].turn_index == 0
    assert type(pickle.loads(pickle.dumps(errors[0]))) is InvalidReplyError  # (a worker process hands it on)
    assert [t.response_text for t in episode.turns] == ["five"] * 3 and policy.stats.requests == 3
    assert [bool(t.format_error) for t in episode.turns] == [True] * 3
    assert no_network == []


def test_errors_refused_before_serving_reach_an_anthropic_app_as_themselves(no_network):
    """ConfigError (an image part), EpisodeLimitError (max_llm_calls) and StrictModeError (an agent without a
    policy in a strict run) were each retried twice by the SDK and reached the app as "Connection error."."""
    import anthropic

    claude = anthropic.Anthropic()  # max_retries=2
    image = {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}
    got = {}

    def writer(state):
        got["config"] = caught(lambda: claude.messages.create(model="c", max_tokens=8, messages=[image]))
        claude.messages.create(model="c", max_tokens=8, messages=MESSAGES[1:])  # served: the one call allowed
        got["limit"] = caught(lambda: claude.messages.create(model="c", max_tokens=8, messages=MESSAGES[1:]))
        return {"out": "done"}

    policy = scripted_policy(["fine"])
    episode = instrument(one_node(writer), {"writer": policy}).rollout({"q": "x"}, metadata={"max_llm_calls": 1})
    assert isinstance(got["config"], ConfigError) and "content block of type 'image'" in str(got["config"])
    assert isinstance(got["limit"], EpisodeLimitError) and "rollout.max_llm_calls=1" in str(got["limit"])
    assert isinstance(got["limit"], anthropic.AnthropicError) and episode.truncated.startswith("max_llm_calls")
    assert len(episode.turns) == 1 and policy.stats.requests == 1

    def planner(state):
        got["strict"] = caught(lambda: claude.messages.create(model="c", max_tokens=8, messages=MESSAGES[1:]))
        return {"out": "done"}

    with pytest.raises(RolloutError, match="StrictModeError"):  # the refusal fails the episode though caught
        instrument(one_node(planner, "planner"), {"other": policy}, strict=True).rollout({"q": "x"})
    assert isinstance(got["strict"], StrictModeError) and "planner" in str(got["strict"])
    assert no_network == []


def test_the_openai_sdk_and_litellm_serve_a_failing_call_once(no_network):
    """The OpenAI SDK (max_retries=2) lets the error through as it is; LiteLLM (its default settings, and the
    OpenAI SDK's max_retries=3 under it) maps it to its own error, which names the failure."""
    import litellm
    import openai

    errors = []

    def writer(state):
        errors.append(caught(lambda: openai.OpenAI().chat.completions.create(
            model="m", messages=MESSAGES, response_format=JSON_SCHEMA)))
        errors.append(caught(lambda: litellm.completion(model="gpt-4o-mini", messages=MESSAGES,
                                                        response_format=JSON_SCHEMA)))
        errors.append(caught(lambda: litellm.completion(model="gpt-4o-mini", messages=MESSAGES,
                                                        response_format=JSON_SCHEMA, max_retries=3)))
        errors.append(caught(lambda: litellm.completion(model="anthropic/claude-3-5-haiku-latest", messages=MESSAGES,
                                                        max_tokens=20, response_format=JSON_SCHEMA)))
        return {"out": "fallback"}

    policy = scripted_policy(["five"])
    episode = instrument(one_node(writer), {"writer": policy}).rollout({"q": "x"})
    assert isinstance(errors[0], InvalidReplyError) and NOT_JSON in str(errors[0])
    assert all("but the policy's reply is not one" in str(e) for e in errors[1:]), errors
    assert len(episode.turns) == 4 and policy.stats.requests == 4
    assert no_network == []


def test_the_local_endpoint_tells_both_sdks_not_to_retry_its_errors():
    """An episode limit is HTTP 429 and a policy failure HTTP 500, which both SDKs retry by default (every
    retry of the 500 one more generation); the endpoint's `x-should-retry: false` stops that."""
    import anthropic
    import openai

    calls, got = [], {}

    def replies(prompt):
        calls.append(prompt)
        if len(calls) > 1:
            raise RuntimeError("the policy server is down")
        return "fine"

    def writer(state):
        gpt = openai.OpenAI(base_url=llm_base_url(), api_key="k")  # max_retries=2, both
        claude = anthropic.Anthropic(base_url=llm_base_url(api="anthropic"), api_key="k")
        gpt.chat.completions.create(model="m", messages=MESSAGES)
        got["failed"] = caught(lambda: claude.messages.create(model="c", max_tokens=8, messages=MESSAGES[1:]))
        got["openai"] = caught(lambda: gpt.chat.completions.create(model="m", messages=MESSAGES))
        got["anthropic"] = caught(lambda: claude.messages.create(model="c", max_tokens=8, messages=MESSAGES[1:]))
        return {"out": "done"}

    episode = instrument(one_node(writer), {"writer": scripted_policy(replies)}).rollout(
        {"q": "x"}, metadata={"max_llm_calls": 2})
    assert len(calls) == 2 and len(episode.turns) == 1  # the failing generation was asked for once
    assert got["failed"].status_code == 500 and "the policy server is down" in str(got["failed"])
    for name in ("failed", "openai", "anthropic"):
        error = got[name]
        assert error.response.headers["x-should-retry"] == "false"
        assert error.response.request.headers["x-stainless-retry-count"] == "0"  # the first attempt's answer
    assert got["openai"].status_code == got["anthropic"].status_code == 429
    assert "rollout.max_llm_calls=2" in str(got["anthropic"])


# ---- rev7_d: only LLM API requests are served --------------------------------------------------------------
class _Service(http.server.BaseHTTPRequestHandler):
    """An app's own service (a chat-history store, a search API) that answers every POST with what it got."""

    received: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).received.append((self.path, body))
        payload = json.dumps({"stored": body}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def service():
    _Service.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Service)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Service.received
    server.shutdown()
    server.server_close()


NOT_LLM = [  # a path of each recognised API, with a body that has the key drmas-graph reads but is no API request
    ("/api/v1/messages", {"conversation": "c1", "messages": [{"role": "user", "content": "hi"}]}),
    ("/api/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),  # no max_tokens
    ("/v1/chat/completions", {"model": "m", "messages": "not a list"}),
    ("/notes/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/search/completions", {"prompt": "cats"}),
    ("/hooks/responses", {"input": "a form's answers"}),
]
IS_LLM = [  # the same paths with each API's required keys: served, wherever they go
    ("/api/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
    ("/notes/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("/search/completions", {"model": "m", "prompt": "cats"}),
    ("/hooks/responses", {"model": "m", "input": "hi"}),
]


@pytest.mark.parametrize("client", ["requests", "httpx"])
def test_posts_to_other_services_on_api_paths_reach_them_and_api_requests_are_served(service, client):
    """Before, each NOT_LLM request was taken for an LLM call: answered by the policy, never sent, recorded as
    a trainable turn. A strict run neither refuses nor counts them."""
    url, received = service
    post = requests.post if client == "requests" else httpx.post

    def writer(state):
        sent = [post(url + path, json=body, timeout=10).json() for path, body in NOT_LLM]
        served = [post(url + path, json=body, timeout=10).json() for path, body in IS_LLM]
        return {"out": (sent, served)}

    policy = scripted_policy(["one", "two", "three", "four"])
    episode = instrument(one_node(writer), {"writer": policy}, strict=True).rollout({"q": "x"})
    sent, served = episode.final_state["out"]
    assert sent == [{"stored": body} for _, body in NOT_LLM] and received == NOT_LLM
    assert [t.response_text for t in episode.turns] == ["one", "two", "three", "four"]
    assert [a.get("type") or a.get("object") for a in served] == ["message", "chat.completion", "text_completion",
                                                                  "response"]
    assert "unserved_calls" not in episode.metadata


def test_llm_requests_that_are_not_served_are_still_refused_and_counted(service):
    """What is an LLM API request but not served is refused in a strict run (warned about otherwise) and counted,
    never sent silently: any request to a known LLM host (here one whose path no API of the table has), and a
    request shaped like an API's in full from a thread outside the run."""
    import anthropic

    url, received = service
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    refusals = []

    def post_outside():
        try:
            requests.post(url + "/notes/chat/completions", json=chat, timeout=10)
        except StrictModeError as exc:
            refusals.append(exc)

    def writer(state):
        refusals.append(caught(lambda: anthropic.Anthropic().messages.count_tokens(model="c", messages=MESSAGES[1:])))
        outside = threading.Thread(target=post_outside)
        outside.start()
        outside.join()
        return {"out": requests.post("https://api.openai.com/v1/chat/completions", timeout=10,
                                     json={"messages": chat["messages"]}).json()}  # a known host: no model needed

    with pytest.raises(RolloutError, match="StrictModeError") as info:
        instrument(one_node(writer), {"writer": scripted_policy(["hello"])}, strict=True).rollout({"q": "x"})
    episode = info.value.episode
    assert received == [] and all(isinstance(e, StrictModeError) for e in refusals) and len(refusals) == 2
    assert isinstance(refusals[0], anthropic.AnthropicError)  # raised as itself through the Anthropic SDK
    assert "in a shape drmas-graph does not serve" in str(refusals[0])
    assert "outside the context of every instrumented run" in str(refusals[1])
    assert [(u["url"], u["refused"]) for u in episode.metadata["unserved_calls"]] == [
        ("https://api.anthropic.com/v1/messages/count_tokens", True),
        (url + "/notes/chat/completions", True)]
    assert [t.response_text for t in episode.turns] == ["hello"]
