"""Issue 58 items 1 and 2: the run's local endpoint reads every request body a client may send (chunked
transfer encoding, a body that ends where the client closes) and answers a malformed one with a 4xx that says
what was wrong, never a false 404; its URLs live exactly as long as their run or replay, and a request to one
whose run ended is told which episode ended."""

import asyncio
import gc
import http.client
import json
import socket
import weakref
from typing import TypedDict
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from langgraph.graph import END, START, StateGraph

from drmas_graph import TraceStore, instrument, llm_base_url
from drmas_graph.instrumentation import endpoint
from drmas_graph.testing import scripted_policy
from drmas_graph.traces.replay import replay

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}]}


class S(TypedDict, total=False):
    out: object


def one_node(fn):
    return StateGraph(S).add_node("worker", fn).add_edge(START, "worker").add_edge("worker", END).compile()


def raw(url, head, body=b"", shut=False):
    """POST to the endpoint over a bare socket: `head` the request line's target after the URL's path and the
    headers ('/chat/completions HTTP/1.1\\r\\nTransfer-Encoding: chunked'); (status, error message or reply)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        sock.sendall(f"POST {parts.path}{head}\r\nHost: x\r\n\r\n".encode() + body)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        response = http.client.HTTPResponse(sock)
        response.begin()
        data = json.loads(response.read())
    if response.status == 200:
        return 200, data["choices"][0]["message"]["content"]
    return response.status, data["error"]["message"]


def test_a_chunked_request_from_httpx_is_served_sync_and_async():
    def worker(state):
        base = llm_base_url()

        def body():  # an iterator body: httpx sends it chunked, without a Content-Length
            yield json.dumps(CHAT)[:10].encode()
            yield json.dumps(CHAT)[10:].encode()

        async def abody():
            yield json.dumps(CHAT).encode()

        async def second():
            async with httpx.AsyncClient(timeout=60) as client:
                return await client.post(base + "/chat/completions", content=abody())

        with httpx.Client(timeout=60) as client:
            first = client.post(base + "/chat/completions", content=body())
        replies = [first, asyncio.run(second())]
        assert [r.request.headers.get("transfer-encoding") for r in replies] == ["chunked", "chunked"]
        return {"out": [(r.status_code, r.json()["choices"][0]["message"]["content"]) for r in replies]}

    policy = scripted_policy(["one", "two"])
    episode = instrument(one_node(worker), {"worker": policy}, strict=True).rollout({})
    # before: [(404, ...), ...] 'POST /v1/chat/completions is no API the endpoint serves', and no turn
    assert episode.final_state["out"] == [(200, "one"), (200, "two")]
    assert [t.response_text for t in episode.turns] == ["one", "two"]
    assert policy.tokenizer.decode(list(episode.turns[0].prompt_ids)).count("Say hi.") == 1
    policy.close()


def chunked(*pieces, end=b"0\r\n\r\n"):
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + end


BODY = json.dumps(CHAT).encode()
CASES = [  # (head after the path, body, shut the sending side, status, what the answer says)
    ("/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked", b"%x;ext=1\r\n%s\r\n" % (9, BODY[:9])
     + chunked(BODY[9:], end=b"0\r\nX-Trailer: t\r\n\r\n"), False, 200, "one"),
    ("/chat/completions HTTP/1.1\r\nConnection: close", BODY, True, 200, "two"),
    ("/chat/completions HTTP/1.0", BODY, True, 200, "three"),
    ("/chat/completions HTTP/1.1", BODY, False, 400, "came without a body"),
    ("/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked", b"zz\r\n" + BODY, False, 400,
     "a chunk size must be hexadecimal, got the line b'zz\\r\\n'"),
    ("/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked", b"3\r\n" + BODY + b"\r\n0\r\n\r\n", False, 400,
     "a chunk of 3 bytes (hex 3) is not followed by CRLF"),
    ("/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked", chunked(BODY, end=b""), True, 400,
     f"the chunked body ended after {len(BODY)} bytes, before its last chunk"),
    ("/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked", chunked(b"hello"), False, 400,
     "the body of POST /v1/chat/completions is not JSON"),
    ("/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked", chunked(b'{"model": "m"}'), False, 400,
     "is no request of that API: an OpenAI Chat Completions request needs a 'messages' list; it has keys ['model']"),
    ("/embeddings HTTP/1.1\r\nTransfer-Encoding: chunked", chunked(b'{"input": "x"}'), False, 404,
     "POST /v1/embeddings is no API the endpoint serves"),
    ("/chat/completions HTTP/1.1\r\nTransfer-Encoding: gzip, chunked", chunked(BODY), False, 501,
     "Transfer-Encoding 'gzip, chunked': the endpoint reads 'chunked' only"),
    ("/chat/completions HTTP/1.1\r\nContent-Length: 12x", BODY, False, 400, "Content-Length '12x' is not one number"),
    ("/chat/completions HTTP/1.1\r\nContent-Length: 400", BODY, True, 400,
     f"the body ended after {len(BODY)} of its 400 bytes"),
]


def test_bodies_over_a_raw_socket_are_read_or_refused_with_what_was_wrong():
    def worker(state):
        base = llm_base_url()
        return {"out": [raw(base, head, body, shut) for head, body, shut, _, _ in CASES]}

    policy = scripted_policy(["one", "two", "three"])
    episode = instrument(one_node(worker), {"worker": policy}).rollout({})
    answers = episode.final_state["out"]
    for (head, _, _, status, says), (got, message) in zip(CASES, answers, strict=True):
        assert got == status and says in message, (head, got, message)
    assert [t.response_text for t in episode.turns] == ["one", "two", "three"]
    policy.close()


def calling_graph(urls):
    """One node that makes two URLs and one call through the first (over a bare socket)."""
    def worker(state):
        urls.extend([llm_base_url(), llm_base_url(agent="worker", api="anthropic")])
        return {"out": raw(urls[-2], "/chat/completions HTTP/1.1\r\nContent-Length: %d" % len(BODY), BODY)}

    return one_node(worker)


def token_of(url):
    return urlsplit(url).path.split("/")[2]


def test_a_runs_urls_are_freed_when_it_ends_and_then_name_the_episode():
    urls = []
    policy = scripted_policy(["one", "two"])
    app = instrument(calling_graph(urls), {"worker": policy})
    first = app.rollout({})
    second = app.rollout({})
    assert (first.final_state["out"], second.final_state["out"]) == ((200, "one"), (200, "two"))
    # before: the second run's URLs stayed bound (with the recorder and its episode) until the next
    # llm_base_url() call in some later run
    assert [token_of(u) for u in urls if token_of(u) in endpoint._bindings] == []
    status, message = raw(urls[-2], "/chat/completions HTTP/1.1\r\nContent-Length: %d" % len(BODY), BODY)
    assert status == 410, message
    assert f"it stood for node 'worker' of episode {second.id} (task None), which ended at " in message, message
    assert "its episode ended" in message
    policy.close()


def test_an_ended_runs_episode_is_freed():
    policy = scripted_policy(["one"])
    episode = instrument(calling_graph([]), {"worker": policy}).rollout({})
    assert episode.final_state["out"] == (200, "one")
    ref = weakref.ref(episode)
    del episode
    gc.collect()
    # before: the endpoint's binding held the recorder, and the recorder the episode
    assert ref() is None
    policy.close()


def sdk_graph(urls):
    def writer(state):
        base = llm_base_url()
        urls.append(base)
        sdk = openai.OpenAI(base_url=base, api_key="drmas-local", max_retries=0, timeout=30)
        reply = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "part"}])
        return {"out": reply.choices[0].message.content}

    return StateGraph(S).add_node("writer", writer).add_edge(START, "writer").add_edge("writer", END).compile()


def test_a_replays_urls_are_freed_when_it_ends(tmp_path):
    urls = []
    policy = scripted_policy(["first"])
    with TraceStore(tmp_path / "traces.db") as store:
        episode = instrument(sdk_graph(urls), {"writer": policy}, store=store).rollout({})
        result = replay(sdk_graph(urls), store, episode.id)
    assert result.divergences == [] and result.final_state["out"] == "first"
    replayed = token_of(urls[1])
    # before: a URL made in a replay was live forever (and held the replay's handler)
    assert replayed not in endpoint._bindings
    status, message = raw(urls[1], "/chat/completions HTTP/1.1\r\nContent-Length: %d" % len(BODY), BODY)
    assert status == 410 and "node 'writer' of a replay, which ended at " in message, message
    policy.close()
