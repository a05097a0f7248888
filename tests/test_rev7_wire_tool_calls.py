"""Issue 58, round 7: tool calls that do not parse, over the wire. A policy's malformed call reaches an SDK app as
the API would hand it over, a tool call with the arguments as written (rev7_f), not as a final answer; a real
API's malformed call reaches the node unchanged and is recorded as what it is (rev7_c)."""

import asyncio
import http.server
import json
import threading

import httpx
import pytest
from pydantic import TypeAdapter

from drmas_graph import instrument
from drmas_graph.testing import scripted_policy
from tests._no_network import no_network  # noqa: F401 - a fixture
from tests.test_instrument_clients import MESSAGES, fake_keys  # noqa: F401 - a fixture
from tests.test_instrument_clients_sdks import ADD, one_node

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": ADD["input_schema"]}}]
RESPONSE_TOOLS = [{"type": "function", "name": "add", "parameters": ADD["input_schema"]}]
BROKEN = '{"a": 2, "b": 3,}'  # a trailing comma: common for a model in training
CUT = '{"a": 2, "b":'  # a call cut off by max_tokens
BROKEN_REPLY = 'Let me add. <tool_call>{"name": "add", "arguments": ' + BROKEN + '}</tool_call>'
CUT_REPLY = 'Let me add. <tool_call>{"name": "add", "arguments": ' + CUT


# ---- rev7_f: a policy's call that does not parse ----------------------------------------------------------
def test_the_openai_sdk_gets_a_malformed_call_as_a_tool_call_with_its_arguments_as_written(no_network):
    """Before: content "Let me add.", tool_calls None, finish_reason "stop", exactly a final answer."""
    import openai

    client = openai.OpenAI(max_retries=0)

    def writer(state):
        reply = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS)
        chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, stream=True))
        return {"out": (reply.choices[0], chunks)}

    policy = scripted_policy([BROKEN_REPLY])
    episode = instrument(one_node(writer), {"writer": policy}, strict=True).rollout({"q": "x"})
    choice, chunks = episode.final_state["out"]
    [call] = choice.message.tool_calls
    assert (choice.message.content, choice.finish_reason) == ("Let me add.", "tool_calls")
    assert (call.function.name, call.function.arguments) == ("add", BROKEN) and len(call.id) == 9
    deltas = [c.choices[0].delta for c in chunks]
    streamed = "".join(t.function.arguments or "" for d in deltas for t in d.tool_calls or ())
    assert streamed == BROKEN and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [t.format_error.startswith("1 tool call(s) in the reply do not parse") for t in episode.turns] == [True] * 2
    assert [t.tool_calls for t in episode.turns] == [(), ()]  # the turn's parsed calls: none
    assert no_network == []


def test_every_api_format_hands_over_a_malformed_call_and_validates_against_the_sdks_models(no_network):
    """Chat Completions and Responses: the arguments as written. Anthropic (whose `input` is always an object):
    the arguments read as far as they go, `{}` when they do not read at all; its stream carries the text."""
    from anthropic.types import Message
    from openai.types.chat import ChatCompletion
    from openai.types.responses import Response

    requests = [("https://api.openai.com/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS}, ChatCompletion),
                ("https://api.openai.com/v1/responses", {"input": "add", "tools": RESPONSE_TOOLS}, Response),
                ("https://api.anthropic.com/v1/messages", {"messages": MESSAGES[1:], "max_tokens": 64, "tools": [ADD]},
                 Message),
                ("https://api.anthropic.com/v1/messages", {"messages": MESSAGES[1:], "max_tokens": 64, "tools": [ADD]},
                 Message)]

    def writer(state):
        return {"out": [TypeAdapter(model).validate_python(httpx.post(url, json={"model": "m", **body}).json())
                        for url, body, model in requests]}

    policy = scripted_policy([BROKEN_REPLY, BROKEN_REPLY, BROKEN_REPLY, CUT_REPLY])
    episode = instrument(one_node(writer), {"writer": policy}, strict=True).rollout({"q": "x"})
    chat, response, broken, cut = episode.final_state["out"]
    assert chat.choices[0].message.tool_calls[0].function.arguments == BROKEN
    [text, call] = response.output
    assert (text.content[0].text, call.type, call.name, call.arguments) == ("Let me add.", "function_call", "add", BROKEN)
    assert broken.stop_reason == cut.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in broken.content] == [("text", None), ("tool_use", {})]
    assert cut.content[1].input == {"a": 2} and cut.content[1].name == "add"  # the complete key of a cut-off call
    assert no_network == []


def test_an_anthropic_stream_carries_the_arguments_as_written(no_network):
    """The SDK's own stream reader then reads a cut-off call as far as it goes and fails by name on one that
    does not read: what it does with the API's stream of the same text."""
    import anthropic

    client = anthropic.AsyncAnthropic(max_retries=0)

    async def final(**kwargs):
        async with client.messages.stream(**kwargs) as events:
            return await events.get_final_message()

    def writer(state):
        kwargs = {"model": "c", "max_tokens": 64, "messages": MESSAGES[1:], "tools": [ADD]}
        cut = asyncio.run(final(**kwargs))
        try:
            asyncio.run(final(**kwargs))
            broken = None
        except ValueError as exc:
            broken = str(exc)
        return {"out": (cut, broken)}

    episode = instrument(one_node(writer), {"writer": scripted_policy([CUT_REPLY, BROKEN_REPLY])}).rollout({"q": "x"})
    cut, broken = episode.final_state["out"]
    assert cut.stop_reason == "tool_use" and cut.content[1].input == {"a": 2}
    assert broken.startswith("Unable to parse tool parameter JSON from model") and BROKEN in broken
    assert no_network == []


def test_langchain_still_gets_the_call_in_invalid_tool_calls_with_its_name_and_arguments(no_network):
    """As ChatOpenAI does with the real API's malformed call: the name and the arguments string (before: no name,
    and the whole call block as the arguments)."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="gpt-4o-mini", max_retries=0).bind_tools(TOOLS)

    def writer(state):
        return {"out": llm.invoke("add 2 and 3")}

    episode = instrument(one_node(writer), {"writer": scripted_policy([BROKEN_REPLY])}).rollout({"q": "x"})
    message = episode.final_state["out"]
    assert message.tool_calls == [] and message.content == "Let me add."
    [call] = message.invalid_tool_calls
    assert (call["name"], call["args"]) == ("add", BROKEN) and call["error"].startswith("JSONDecodeError")
    assert no_network == []


def test_a_conversation_handed_back_with_a_malformed_call_is_read_as_it_is(no_network):
    """The APIs take a conversation whose assistant turn holds a call with malformed arguments (the app sends back
    what it got, and the tool's error); before, reading it raised JSONDecodeError out of the SDK call."""
    import openai
    from langchain_core.messages import AIMessage

    client = openai.OpenAI(max_retries=0)
    chat = [MESSAGES[1], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": BROKEN}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "invalid arguments"}]
    items = [{"role": "user", "content": "add"},
             {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": BROKEN},
             {"type": "function_call_output", "call_id": "call_2", "output": "invalid arguments"}]

    def writer(state):
        first = client.chat.completions.create(model="m", messages=chat, tools=TOOLS)
        second = client.responses.create(model="m", input=items, tools=RESPONSE_TOOLS)
        return {"out": (first.choices[0].message.content, second.output_text)}

    episode = instrument(one_node(writer), {"writer": scripted_policy(["Sorry.", "Oops."])}, strict=True).rollout({})
    assert episode.final_state["out"] == ("Sorry.", "Oops.")
    for turn, call_id in zip(episode.turns, ["call_1", "call_2"], strict=True):
        [handed_back] = [m for m in turn.messages if isinstance(m, AIMessage)]
        assert handed_back.tool_calls == [] and handed_back.invalid_tool_calls[0]["args"] == BROKEN
        assert handed_back.invalid_tool_calls[0]["id"] == call_id
    assert no_network == []


# ---- rev7_c: the app's own model's malformed call ---------------------------------------------------------
def _sse(events):
    return "".join((f"event: {name}\n" if name else "") + "data: " + (d if isinstance(d, str) else json.dumps(d))
                   + "\n\n" for name, d in events).encode()


CHAT = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "gpt-x",
        "choices": [{"index": 0, "finish_reason": "length", "message": {
            "role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": CUT}}]}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 8, "total_tokens": 17}}
HEAD = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 0, "model": "gpt-x"}
CHAT_EVENTS = [
    (None, {**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [
        {"index": 0, "id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2,'}}]},
        "finish_reason": None}]}),
    (None, {**HEAD, "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": ' "b":'}}]}, "finish_reason": None}]}),
    (None, {**HEAD, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
    (None, "[DONE]")]
RESPONSE = {"id": "resp_1", "object": "response", "created_at": 0, "model": "gpt-x", "status": "incomplete",
            "incomplete_details": {"reason": "max_output_tokens"}, "error": None, "instructions": None,
            "metadata": {}, "parallel_tool_calls": True, "temperature": None, "top_p": None, "tool_choice": "auto",
            "tools": [], "output": [{"type": "function_call", "id": "fc_1", "call_id": "call_3", "name": "add",
                                     "arguments": CUT, "status": "incomplete"}]}
MESSAGE_START = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "content": [],
                 "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 9, "output_tokens": 0}}
MESSAGE_EVENTS = [
    ("message_start", {"type": "message_start", "message": MESSAGE_START}),
    ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {
        "type": "tool_use", "id": "toolu_1", "name": "add", "input": {}}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
        "type": "input_json_delta", "partial_json": CUT}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                       "usage": {"output_tokens": 8}}),
    ("message_stop", {"type": "message_stop"})]
ANSWERS = {"/v1/chat/completions": (CHAT, _sse(CHAT_EVENTS)), "/v1/responses": (RESPONSE, None),
           "/v1/messages": (None, _sse(MESSAGE_EVENTS))}


@pytest.fixture
def cutting_api():
    """A real API (a stand-in on 127.0.0.1) whose every answer is a tool call cut off by max_tokens."""
    received = []

    class Api(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            received.append(self.path)
            answer, events = ANSWERS[self.path]
            payload, kind = (events, "text/event-stream") if body.get("stream") else (json.dumps(answer).encode(),
                                                                                        "application/json")
            self.send_response(200)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()
    server.server_close()


@pytest.mark.filterwarnings("ignore:policies. agent")  # (the planner's policy is there to make a run)
def test_an_app_models_cut_off_call_reaches_the_node_unchanged_and_is_recorded(cutting_api):
    """An agent without a policy: before, reading the answer into a turn raised JSONDecodeError out of the SDK
    call (the node never got the answer; no turn). Chat JSON and stream, Responses, an Anthropic stream."""
    import anthropic
    import openai

    url, received = cutting_api
    gpt = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    claude = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)

    def tool_user(state):
        chat = gpt.chat.completions.create(model="gpt-x", messages=MESSAGES, tools=TOOLS)
        streamed = "".join(t.function.arguments or "" for c in gpt.chat.completions.create(
            model="gpt-x", messages=MESSAGES, tools=TOOLS, stream=True) for t in c.choices[0].delta.tool_calls or ())
        response = gpt.responses.create(model="gpt-x", input="add", tools=RESPONSE_TOOLS)
        events = [e.delta.partial_json for e in claude.messages.create(
            model="claude-x", max_tokens=8, messages=MESSAGES[1:], tools=[ADD], stream=True)
            if e.type == "content_block_delta"]
        return {"out": (chat.choices[0].message.tool_calls[0].function.arguments, streamed,
                        response.output[0].arguments, events)}

    outside = tool_user({})["out"]
    assert outside == (CUT, '{"a": 2, "b":', CUT, [CUT])
    episode = instrument(one_node(tool_user, "tool_user"), {"planner": scripted_policy(["unused"])}).rollout({})
    assert episode.final_state["out"] == outside and len(received) == 8  # each call sent, inside the run too
    assert [(t.agent, t.trainable, t.tool_calls) for t in episode.turns] == [("tool_user", False, ())] * 4
    assert [t.finish_reason for t in episode.turns] == ["length"] * 4
    for turn in episode.turns:
        assert turn.format_error.startswith("1 tool call(s) in the reply do not parse: JSONDecodeError")
