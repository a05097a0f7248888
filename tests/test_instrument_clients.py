"""Issue 47: LLM calls a node makes without LangChain (the OpenAI SDK, sync, async and streaming) are served
by the node's agent's policy through the same path as a LangChain call, answered in the SDK's protocol, and
never leave the process."""

import asyncio
import http.server
import json
import threading
from typing import TypedDict

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph

from drmas_graph import StrictModeError, TraceStore, instrument
from drmas_graph.testing import scripted_policy
from tests._no_network import no_network  # noqa: F401 - a fixture
from tests.test_instrument import Unreachable


class S(TypedDict, total=False):
    q: str
    plan: str
    out: object


@pytest.fixture(autouse=True)
def fake_keys(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-never-sent")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-never-sent")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)


def two_nodes(writer, model=None):
    """planner (a LangChain chat model) -> writer (`writer(state)` returns the node's update)."""
    model = model or Unreachable()

    def planner(state):
        return {"plan": model.invoke([HumanMessage(state["q"])]).content}

    g = StateGraph(S)
    g.add_node("planner", planner)
    g.add_node("writer", writer)
    g.add_edge(START, "planner")
    g.add_edge("planner", "writer")
    g.add_edge("writer", END)
    return g.compile()


MESSAGES = [{"role": "system", "content": "You write."}, {"role": "user", "content": "Write about cats."}]
LC_MESSAGES = [SystemMessage("You write."), HumanMessage("Write about cats.")]


def test_openai_sdk_call_is_a_turn_of_the_writer_with_the_langchain_prompt(no_network):
    import openai

    client = openai.OpenAI(max_retries=0)

    def writer(state):
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
        return {"out": reply}

    policy = scripted_policy(["a plan", "Cats purr."])
    app = instrument(two_nodes(writer), {"planner": policy, "writer": policy}, strict=True)
    episode = app.rollout({"q": "plan it"})
    planner, writer_turn = episode.turns
    assert (planner.agent, writer_turn.agent, writer_turn.node) == ("planner", "writer", "writer")
    reply = episode.final_state["out"]
    assert reply.choices[0].message.content == "Cats purr." and reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.role == "assistant" and reply.model == "gpt-4o-mini"
    # the prompt ids are exactly those of a LangChain call of the same messages
    assert list(writer_turn.prompt_ids) == policy.render(LC_MESSAGES)
    assert writer_turn.trainable and len(writer_turn.response_logprobs) == len(writer_turn.response_ids) > 0
    assert policy.decode(writer_turn.response_ids) == writer_turn.response_text == "Cats purr."
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(writer_turn.prompt_ids), len(writer_turn.response_ids))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert reply.id == "chatcmpl-" + writer_turn.message_id
    assert no_network == []
    policy.close()


def test_same_messages_through_chatopenai_and_the_sdk_render_the_same_prompt_ids(no_network):
    """The same conversation, once through ChatOpenAI and once through the OpenAI SDK, in two nodes:
    equal prompt ids, both trainable turns."""
    import openai
    from langchain_openai import ChatOpenAI

    client = openai.OpenAI(max_retries=0)
    lc = ChatOpenAI(model="gpt-4o-mini", max_retries=0)

    def both(state):
        a = lc.invoke(LC_MESSAGES).content
        b = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES).choices[0].message.content
        return {"out": [a, b]}

    g = StateGraph(S)
    g.add_node("writer", both)
    g.add_edge(START, "writer")
    g.add_edge("writer", END)
    policy = scripted_policy(["one", "two"])
    episode = instrument(g.compile(), {"writer": policy}, strict=True).rollout({"q": "x"})
    lc_turn, sdk_turn = episode.turns
    assert lc_turn.prompt_ids == sdk_turn.prompt_ids and len(lc_turn.prompt_ids) > 5
    assert episode.final_state["out"] == ["one", "two"]
    # the same node instance made both calls with the same prompt: the k-th such call has its own seed
    assert (lc_turn.call_key, sdk_turn.call_key) == ("writer", "writer")
    assert (lc_turn.node_call_index, sdk_turn.node_call_index) == (0, 1)
    assert no_network == []
    policy.close()


def test_async_openai_stream_with_tool_call_deltas(no_network):
    import openai

    client = openai.AsyncOpenAI(max_retries=0)
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                               "parameters": {"type": "object", "properties": {
                                                   "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]

    async def writer(state):
        stream = await client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, tools=tools,
                                                      stream=True, stream_options={"include_usage": True})
        content, calls, finish, usage = "", {}, None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for t in choice.delta.tool_calls or ():
                    entry = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
                    entry["id"] = t.id or entry["id"]
                    entry["name"] += t.function.name or ""
                    entry["arguments"] += t.function.arguments or ""
                finish = choice.finish_reason or finish
        return {"out": (content, calls, finish, usage.completion_tokens)}

    policy = scripted_policy(["plan", 'Sure. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'])
    app = instrument(two_nodes(writer), {"planner": policy, "writer": policy}, strict=True)
    episode = asyncio.run(app.arollout({"q": "plan"}))
    content, calls, finish, completion_tokens = episode.final_state["out"]
    turn = episode.turns[1]
    assert content == "Sure." and finish == "tool_calls" and turn.finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("add", {"a": 2, "b": 3})]
    assert calls[0]["id"] == turn.tool_calls[0]["id"]
    assert completion_tokens == len(turn.response_ids)
    assert [t["function"]["name"] for t in turn.tools] == ["add"]
    assert list(turn.prompt_ids) == policy.render(LC_MESSAGES, tools)  # the tool schema is in the prompt
    assert '"name": "add"' in policy.tokenizer.decode(list(turn.prompt_ids))
    assert no_network == []
    policy.close()


def test_response_format_json_schema_n_and_max_tokens(no_network):
    import openai

    client = openai.OpenAI(max_retries=0)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}

    def writer(state):
        reply = client.chat.completions.create(
            model="gpt-4o-mini", messages=MESSAGES, n=2, max_completion_tokens=40, stop=["END"],
            response_format={"type": "json_schema", "json_schema": {"name": "Verdict", "schema": schema}})
        return {"out": [(c.index, c.message.content) for c in reply.choices]}

    policy = scripted_policy(["plan", '{"ok": true}', '{"ok": false}'])
    app = instrument(two_nodes(writer), {"planner": policy, "writer": policy}, strict=True)
    episode = app.rollout({"q": "plan"}, metadata={"seed": 7})
    assert episode.final_state["out"] == [(0, '{"ok": true}'), (1, '{"ok": false}')]
    first, second = episode.turns[1:]
    assert first.response_format == second.response_format == {"type": "json_schema", "name": "Verdict",
                                                               "schema": schema}
    assert json.dumps(schema, sort_keys=True) in policy.tokenizer.decode(list(first.prompt_ids))
    assert first.sampling.max_new_tokens == 40 and first.sampling.stop == ("END",)
    assert first.sampling.seed != second.sampling.seed  # each choice is its own seeded call
    assert first.prompt_ids == second.prompt_ids
    assert no_network == []
    policy.close()


GEMINI = "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.0-flash:generateContent"


def test_strict_run_refuses_an_unrecognised_request_to_an_llm_host(no_network):
    import httpx

    def writer(state):
        httpx.post(GEMINI, json={"contents": [{"parts": [{"text": "hi"}]}]})
        return {"out": "unreachable"}

    policy = scripted_policy(["plan"])
    app = instrument(two_nodes(writer), {"planner": policy, "writer": policy}, strict=True)
    with pytest.raises(Exception) as info:
        app.rollout({"q": "plan"})
    assert f"node 'writer' sent a POST request with httpx to {GEMINI}" in str(
        info.value.__cause__ or info.value)
    assert isinstance(info.value.__cause__, StrictModeError)
    assert no_network == []
    policy.close()


def test_not_strict_warns_and_records_the_unserved_request(no_network):
    import httpx

    from drmas_graph.errors import UnservedCallWarning

    def writer(state):
        try:
            httpx.get("https://api.openai.com/v1/models")
        except AssertionError:  # the no_network fixture stops it at the socket
            pass
        return {"out": "done"}

    policy = scripted_policy(["plan"])
    app = instrument(two_nodes(writer), {"planner": policy, "writer": policy})
    with pytest.warns(UnservedCallWarning, match=r"node 'writer' sent a GET request with httpx to "
                                                 r"https://api.openai.com/v1/models"):
        episode = app.rollout({"q": "plan"})
    assert episode.metadata["unserved_calls"] == [
        {"node": "writer", "client": "httpx", "url": "https://api.openai.com/v1/models", "refused": False}]
    assert len(no_network) >= 1  # it did try to go out: warned, not silent
    policy.close()


def test_outside_runs_the_clients_are_untouched(no_network):
    import httpx

    with pytest.raises(Exception) as info:  # no run: the request goes to the socket as ever
        httpx.post("https://api.openai.com/v1/chat/completions", json={"model": "m", "messages": []})
    assert "a request tried to leave the process" in str(info.value) or no_network


def test_replay_sends_no_request(tmp_path, no_network):
    import openai

    client = openai.OpenAI(max_retries=0)

    def writer(state):
        return {"out": client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES).choices[0].message.content}

    from drmas_graph import replay

    policy = scripted_policy(["plan", "Cats purr."])
    store = TraceStore(tmp_path / "traces")
    graph = two_nodes(writer)
    episode = instrument(graph, {"planner": policy, "writer": policy}, store=store).rollout({"q": "plan"})
    result = replay(graph, store, episode.id)
    assert result.divergences == [] and result.state_matches and result.error is None
    assert result.final_state["out"] == "Cats purr." and [t.index for t in result.turns] == [0, 1]
    assert no_network == []
    policy.close()


class _Recording(http.server.BaseHTTPRequestHandler):
    """A chat-completions API on 127.0.0.1 that counts the requests it gets (the app's own model)."""

    requests: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).requests.append((self.path, body))
        reply = json.dumps({"id": "chatcmpl-remote", "object": "chat.completion", "created": 0, "model": body["model"],
                            "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": "remote words"}}],
                            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def remote_api():
    _Recording.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recording)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", _Recording.requests
    server.shutdown()
    server.server_close()


def test_agent_without_policy_is_answered_by_the_api_and_replay_does_not_ask_it_again(tmp_path, remote_api):
    import openai

    from drmas_graph import replay

    url, received = remote_api
    client = openai.OpenAI(base_url=url, max_retries=0)

    def writer(state):
        return {"out": client.chat.completions.create(model="remote-m", messages=MESSAGES).choices[0].message.content}

    policy = scripted_policy(["plan"])
    store = TraceStore(tmp_path / "traces")
    graph = two_nodes(writer)
    episode = instrument(graph, {"planner": policy}, store=store).rollout({"q": "plan"})
    turn = episode.turns[1]
    assert episode.final_state["out"] == "remote words" and len(received) == 1
    assert (turn.agent, turn.trainable, turn.response_text, turn.policy) == ("writer", False, "remote words", None)
    assert received[0][0] == "/v1/chat/completions" and received[0][1]["messages"] == MESSAGES
    result = replay(graph, store, episode.id)
    assert result.divergences == [] and result.final_state["out"] == "remote words"
    assert len(received) == 1  # replay answered from the recording
    with pytest.raises(Exception) as info:  # strict: an agent without a policy is refused, nothing sent
        instrument(graph, {"planner": policy}, strict=True).rollout({"q": "plan"})
    assert "agent 'writer', which has no policy (strict=True)" in str(info.value.__cause__)
    assert len(received) == 1
    policy.close()


def test_replay_refuses_an_llm_request_it_cannot_answer(tmp_path, no_network):
    """Recorded without strict: the Gemini request was warned about (and stopped at the socket here). Replay
    refuses it before any socket: it never sends a request."""
    import httpx

    from drmas_graph import replay
    from drmas_graph.errors import UnservedCallWarning

    outcomes = []

    def writer(state):
        try:
            httpx.post(GEMINI, json={"contents": []})
        except Exception as exc:  # noqa: BLE001 - the app shrugs it off; the test looks at it
            outcomes.append(type(exc).__name__)
        return {"out": "done"}

    policy = scripted_policy(["plan"])
    store = TraceStore(tmp_path / "traces")
    graph = two_nodes(writer)
    with pytest.warns(UnservedCallWarning):
        episode = instrument(graph, {"planner": policy, "writer": policy}, store=store).rollout({"q": "plan"})
    assert outcomes == ["NetworkUsed"] and len(no_network) == 1
    result = replay(graph, store, episode.id)
    assert outcomes == ["NetworkUsed", "StrictModeError"] and len(no_network) == 1
    assert result.divergences == [] and result.final_state["out"] == "done"
    policy.close()


def test_a_responses_request_that_needs_server_state_is_refused_by_name(no_network):
    import openai

    client = openai.OpenAI(max_retries=0)

    def writer(state):
        return {"out": client.responses.create(model="m", input="more", previous_response_id="resp_1").output_text}

    policy = scripted_policy(["plan"])
    with pytest.raises(Exception) as info:
        instrument(two_nodes(writer), {"planner": policy, "writer": policy}).rollout({"q": "plan"})
    assert "previous_response_id='resp_1' refers to state stored on OpenAI's servers" in str(info.value.__cause__)
    assert no_network == []
    policy.close()


def test_send_fanout_and_a_thread_pool_keep_the_node_instance(no_network):
    """SDK calls in `Send` instances and in a thread pool a node uses get the call keys a LangChain call there
    gets: 'worker[i]' per Send, the node's own key inside its pool."""
    import concurrent.futures
    import operator
    from typing import Annotated

    import openai
    from langgraph.types import Send

    client = openai.OpenAI(max_retries=0)

    class F(TypedDict, total=False):
        items: list
        out: Annotated[list, operator.add]
        item: str

    def ask(text):
        return client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}]
                                              ).choices[0].message.content

    def worker(state):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            extra = list(pool.map(ask, [state["item"] + "!"]))
        return {"out": [ask(state["item"])] + extra}

    g = StateGraph(F)
    g.add_node("worker", worker)
    g.add_conditional_edges(START, lambda s: [Send("worker", {"item": i}) for i in s["items"]], ["worker"])
    g.add_edge("worker", END)
    policy = scripted_policy(lambda prompt: "ok")
    episode = instrument(g.compile(), {"worker": policy}, strict=True).rollout({"items": ["a", "b", "c"]})
    assert sorted((t.call_key, t.node_call_index) for t in episode.turns) == [
        (f"worker[{i}]", n) for i in range(3) for n in range(2)]
    assert {t.agent for t in episode.turns} == {"worker"} and len(episode.final_state["out"]) == 6
    assert no_network == []
    policy.close()
