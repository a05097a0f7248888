"""Issue 47 item 7: the real `openai`, `anthropic` and `litellm` packages, and raw `httpx`, `requests` and
`aiohttp` POSTs, pointed at a recording LLM API on 127.0.0.1 (`base_url=`). Outside a run each call reaches it
(so its count of zero below can fail); inside an instrumented run the same call is served by the node's
agent's policy, recorded as a turn with the prompt ids of a LangChain call of the same messages, and the
API receives zero requests."""

import asyncio
import json
import os

import pytest
from langchain_core.messages import AIMessage, ToolMessage

from drmas_graph import TraceStore, instrument, replay
from drmas_graph.testing import scripted_policy
from tests._recording_api import REMOTE_TEXT, recording_api  # noqa: F401 - a fixture
from tests.test_instrument_clients import LC_MESSAGES, MESSAGES, fake_keys, two_nodes  # noqa: F401 - a fixture
from tests.test_instrument_clients_sdks import ADD, CALL, one_node

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not fetch its price list at import

TOOLS = [{"type": "function", "function": {"name": "add", "description": ADD["description"],
                                           "parameters": ADD["input_schema"]}}]


def _calls(message) -> str:
    return "".join(f"|{c.function.name}{c.function.arguments}" for c in message.tool_calls or ())


# ---- the same call with each client: `base` is the API's URL; returns the reply's text ----------------------
def openai_sync(base):
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    return client.chat.completions.create(model="gpt-x", messages=MESSAGES).choices[0].message.content


def openai_async(base):
    import openai

    async def call():
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        reply = await client.chat.completions.create(model="gpt-x", messages=MESSAGES)
        await client.close()
        return reply.choices[0].message.content

    return asyncio.run(call())


def openai_stream(base):
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    chunks = list(client.chat.completions.create(model="gpt-x", messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def openai_tools(base):
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    message = client.chat.completions.create(model="gpt-x", messages=MESSAGES, tools=TOOLS).choices[0].message
    return (message.content or "") + _calls(message)


def openai_responses(base):
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    return client.responses.create(model="gpt-x", instructions="You write.", input="Write about cats.").output_text


def anthropic_sync(base):
    import anthropic

    client = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0)
    reply = client.messages.create(model="claude-x", max_tokens=32, system="You write.", messages=MESSAGES[1:])
    return reply.content[0].text


def anthropic_stream(base):
    import anthropic

    client = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0)
    with client.messages.stream(model="claude-x", max_tokens=32, system="You write.", messages=MESSAGES[1:]) as s:
        text = "".join(s.text_stream)
        assert s.get_final_message().content[0].text == text
    return text


def litellm_completion(base):
    import litellm

    reply = litellm.completion(model="openai/gpt-x", api_base=base + "/v1", api_key="k", messages=MESSAGES,
                               num_retries=0)
    return reply.choices[0].message.content


def litellm_acompletion_anthropic(base):
    import litellm

    reply = asyncio.run(litellm.acompletion(model="anthropic/claude-x", api_base=base + "/v1/messages", api_key="k",
                                            messages=MESSAGES, max_tokens=32, num_retries=0))
    return reply.choices[0].message.content


def raw_httpx(base):
    import httpx

    reply = httpx.post(base + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=10)
    return reply.json()["choices"][0]["message"]["content"]


def raw_requests(base):
    import requests

    reply = requests.post(base + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=10)
    return reply.json()["choices"][0]["message"]["content"]


def raw_aiohttp(base):
    import aiohttp

    async def call():
        async with aiohttp.ClientSession() as session:
            async with session.post(base + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}) as r:
                return (await r.json())["choices"][0]["message"]["content"]

    return asyncio.run(call())


CLIENTS = {  # client -> (call, the API path it posts to, tools it binds)
    "openai": (openai_sync, "/v1/chat/completions", []),
    "openai-async": (openai_async, "/v1/chat/completions", []),
    "openai-stream": (openai_stream, "/v1/chat/completions", []),
    "openai-tools": (openai_tools, "/v1/chat/completions", TOOLS),
    "openai-responses": (openai_responses, "/v1/responses", []),
    "anthropic": (anthropic_sync, "/v1/messages", []),
    "anthropic-stream": (anthropic_stream, "/v1/messages", []),
    "litellm": (litellm_completion, "/v1/chat/completions", []),
    "litellm-anthropic": (litellm_acompletion_anthropic, "/v1/messages", []),
    "httpx": (raw_httpx, "/v1/chat/completions", []),
    "requests": (raw_requests, "/v1/chat/completions", []),
    "aiohttp": (raw_aiohttp, "/v1/chat/completions", []),
}


@pytest.mark.parametrize("client", CLIENTS)
def test_outside_a_run_the_call_reaches_the_recording_api(client, recording_api):
    """The control: the API works and each client really sends there, so the zeros below can fail."""
    call, path, _ = CLIENTS[client]
    assert call(recording_api.url) == REMOTE_TEXT
    assert [p for p, _ in recording_api.received] == [path]
    assert "Write about cats." in json.dumps(recording_api.received[0][1])


@pytest.mark.parametrize("client", CLIENTS)
def test_inside_a_run_the_call_is_a_turn_and_the_api_gets_zero_requests(client, recording_api):
    call, _, tools = CLIENTS[client]
    reply = CALL if tools else "Cats purr."

    def writer(state):
        return {"out": call(recording_api.url)}

    policy = scripted_policy([reply])
    episode = instrument(one_node(writer), {"writer": policy}, strict=True).rollout({"q": "x"})
    assert recording_api.received == []
    (turn,) = episode.turns
    assert (turn.agent, turn.node, turn.trainable, turn.policy) == ("writer", "writer", True, policy.name)
    assert list(turn.prompt_ids) == policy.render(LC_MESSAGES, tools)  # as a LangChain call of these messages
    assert policy.decode(turn.response_ids) == turn.response_text == reply
    assert len(turn.response_logprobs) == len(turn.response_ids) > 0
    expected = "|add" + json.dumps({"a": 2, "b": 3}) if tools else "Cats purr."
    assert episode.final_state["out"] == expected
    policy.close()


def test_a_tool_loop_through_the_openai_sdk_sends_nothing_and_replays(tmp_path, recording_api):
    """Two turns of a tool loop (the tool result goes back in the second request): both served, both prompts
    those of the LangChain messages, replay answers from the recording, and the API receives nothing."""
    import openai

    client = openai.OpenAI(base_url=recording_api.url + "/v1", api_key="k", max_retries=0)

    def writer(state):
        history = list(MESSAGES)
        first = client.chat.completions.create(model="gpt-x", messages=history, tools=TOOLS).choices[0]
        call = first.message.tool_calls[0]
        history += [first.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        second = client.chat.completions.create(model="gpt-x", messages=history, tools=TOOLS).choices[0]
        return {"out": [first.finish_reason, call.function.name, second.message.content, second.finish_reason]}

    policy = scripted_policy([CALL, "It is 5."])
    store = TraceStore(tmp_path / "traces")
    graph = one_node(writer)
    episode = instrument(graph, {"writer": policy}, strict=True, store=store).rollout({"q": "x"})
    assert episode.final_state["out"] == ["tool_calls", "add", "It is 5.", "stop"]
    first, second = episode.turns
    call_id = first.tool_calls[0]["id"]
    lc = [*LC_MESSAGES, AIMessage("", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": call_id}]),
          ToolMessage("5", tool_call_id=call_id)]
    assert list(second.prompt_ids) == policy.render(lc, TOOLS)
    result = replay(graph, store, episode.id)
    assert result.divergences == [] and result.final_state["out"] == episode.final_state["out"]
    assert recording_api.received == []
    policy.close()


def test_a_node_without_a_policy_is_answered_by_the_api_once_and_replay_asks_nothing(tmp_path, recording_api):
    """An agent without a policy: the app's own model (the recording API) answers, its Anthropic `tool_use`
    reply is recorded with the finish reason every turn uses ('tool_calls'), and replay gives the Anthropic
    client the same `stop_reason` and blocks without a request."""
    import anthropic

    recording_api.overrides["/v1/messages"] = {
        "id": "msg_remote", "type": "message", "role": "assistant", "model": "claude-x", "stop_sequence": None,
        "content": [{"type": "text", "text": "Adding."},
                    {"type": "tool_use", "id": "toolu_9", "name": "add", "input": {"a": 2, "b": 3}}],
        "stop_reason": "tool_use", "usage": {"input_tokens": 7, "output_tokens": 5}}
    client = anthropic.Anthropic(base_url=recording_api.url, api_key="k", max_retries=0)

    def writer(state):
        reply = client.messages.create(model="claude-x", max_tokens=32, messages=MESSAGES[1:], tools=[ADD])
        return {"out": [reply.stop_reason, [(b.type, getattr(b, "name", None)) for b in reply.content]]}

    graph = two_nodes(writer)
    policy = scripted_policy(["a plan"])
    store = TraceStore(tmp_path / "traces")
    episode = instrument(graph, {"planner": policy}, store=store).rollout({"q": "x"})
    expected = ["tool_use", [("text", None), ("tool_use", "add")]]
    assert episode.final_state["out"] == expected and len(recording_api.received) == 1
    turn = episode.turns[1]
    assert (turn.trainable, turn.finish_reason, turn.response_text) == (False, "tool_calls", "Adding.")
    assert [(c["name"], c["args"], c["id"]) for c in turn.tool_calls] == [("add", {"a": 2, "b": 3}, "toolu_9")]
    result = replay(graph, store, episode.id)
    assert result.divergences == [] and result.final_state["out"] == expected
    assert len(recording_api.received) == 1  # replay sent nothing
    policy.close()



def test_an_anthropic_reply_cut_at_a_stop_sequence_says_which_and_replays(tmp_path, recording_api):
    """Anthropic names the stop sequence a reply ended at (`stop_reason: "stop_sequence"`), in the JSON answer
    and in the stream's `message_delta`; replay answers the same."""
    import anthropic

    client = anthropic.Anthropic(base_url=recording_api.url, api_key="k", max_retries=0)

    def writer(state):
        kwargs = {"model": "claude-x", "max_tokens": 32, "messages": MESSAGES[1:], "stop_sequences": ["END", "STOP"]}
        whole = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
        plain = client.messages.create(model="claude-x", max_tokens=32, messages=MESSAGES[1:])
        return {"out": [(m.stop_reason, m.stop_sequence, m.content[0].text) for m in (whole, streamed, plain)]}

    policy = scripted_policy(["Cats purr.STOP then END", "Cats nap.END", "Cats sleep."])
    store = TraceStore(tmp_path / "traces")
    graph = one_node(writer)
    episode = instrument(graph, {"writer": policy}, strict=True, store=store).rollout({"q": "x"})
    expected = [("stop_sequence", "STOP", "Cats purr."), ("stop_sequence", "END", "Cats nap."),
                ("end_turn", None, "Cats sleep.")]
    assert episode.final_state["out"] == expected
    assert [t.finish_reason for t in episode.turns] == ["stop", "stop", "stop"]
    assert replay(graph, store, episode.id).final_state["out"] == expected
    assert recording_api.received == []
    policy.close()


def test_structured_output_helpers_of_both_sdks_get_parsed_objects(recording_api):
    """`chat.completions.parse(response_format=Model)`, `responses.parse(text_format=Model)` and Anthropic's
    `messages.parse(output_format=Model)` send a JSON schema; each is honoured (recorded on the turn as the
    schema asked for) and the SDK's own parser builds the object from the policy's reply."""
    import anthropic
    import openai
    from pydantic import BaseModel

    class Sum(BaseModel):
        total: int

    oai = openai.OpenAI(base_url=recording_api.url + "/v1", api_key="k", max_retries=0)
    claude = anthropic.Anthropic(base_url=recording_api.url, api_key="k", max_retries=0)

    def writer(state):
        chat = oai.chat.completions.parse(model="gpt-x", messages=MESSAGES, response_format=Sum)
        resp = oai.responses.parse(model="gpt-x", input="Add 2 and 3.", text_format=Sum)
        msg = claude.messages.parse(model="claude-x", max_tokens=32, messages=MESSAGES[1:], output_format=Sum)
        return {"out": [chat.choices[0].message.parsed, resp.output_parsed, msg.parsed_output]}

    policy = scripted_policy(['{"total": 5}', '{"total": 6}', '{"total": 7}'])
    episode = instrument(one_node(writer), {"writer": policy}, strict=True).rollout({"q": "x"})
    assert episode.final_state["out"] == [Sum(total=5), Sum(total=6), Sum(total=7)]
    for turn in episode.turns:
        assert turn.response_format["type"] == "json_schema" and turn.format_error is None
        assert turn.response_format["schema"]["properties"] == {"total": {"title": "Total", "type": "integer"}}
    assert recording_api.received == []
    policy.close()


def test_an_anthropic_reply_that_breaks_its_output_format_fails_by_name(recording_api):
    import anthropic

    from drmas_graph.errors import StructuredOutputError

    claude = anthropic.Anthropic(base_url=recording_api.url, api_key="k", max_retries=0)
    schema = {"type": "object", "properties": {"total": {"type": "integer"}}, "required": ["total"]}

    def writer(state):
        claude.messages.create(model="claude-x", max_tokens=32, messages=MESSAGES[1:],
                               output_config={"format": {"type": "json_schema", "schema": schema}})
        return {"out": "unreachable"}

    policy = scripted_policy(["five"])
    with pytest.raises(Exception) as info:
        instrument(one_node(writer), {"writer": policy}, strict=True).rollout({"q": "x"})
    assert "stopped after 1 LLM call(s): turn 0 (agent 'writer', node 'writer" in str(info.value)
    assert "the call asks for a JSON object (json_schema), but the policy's reply is not one: 'five'" in str(info.value)
    app_error = info.value.__cause__  # the error itself, which the SDK let through (not a "Connection error.")
    assert isinstance(app_error, StructuredOutputError) and isinstance(app_error, anthropic.AnthropicError)
    assert info.value.episode.turns[0].format_error and recording_api.received == []
    policy.close()


RESPONSE_TOOLS = [{"type": "function", "name": "add", "parameters": ADD["input_schema"]}]
WIRE = [  # (path, request body, model of the JSON answer or of each stream event)
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS}, "chat"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "stream": True, "n": 2,
                              "stream_options": {"include_usage": True}}, "chat_chunk"),
    ("/v1/completions", {"prompt": "Once upon", "max_tokens": 5}, "completion"),
    ("/v1/completions", {"prompt": "Once upon", "max_tokens": 5, "stream": True}, "completion_chunk"),
    ("/v1/responses", {"input": "add 2 3", "tools": RESPONSE_TOOLS,
                       "tool_choice": {"type": "function", "name": "add"}}, "response"),
    ("/v1/responses", {"input": "add 2 3", "tools": RESPONSE_TOOLS, "stream": True}, "response_event"),
    ("/v1/responses", {"input": "Write.", "stream": True, "max_output_tokens": 3}, "response_event"),
    ("/v1/messages", {"messages": MESSAGES[1:], "max_tokens": 40, "tools": [ADD]}, "message"),
    ("/v1/messages", {"messages": MESSAGES[1:], "max_tokens": 40, "tools": [ADD], "stream": True}, "message_event"),
]


def _sdk_models():
    from anthropic.types import Message, RawMessageStreamEvent
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.responses import Response, ResponseStreamEvent

    return {"chat": ChatCompletion, "chat_chunk": ChatCompletionChunk, "completion": Completion,
            "completion_chunk": Completion, "response": Response, "response_event": ResponseStreamEvent,
            "message": Message, "message_event": RawMessageStreamEvent}


def test_every_answer_validates_against_the_sdks_own_models(recording_api):
    """The SDKs build their objects without validation (`construct`), so a missing field would only show up
    when code reads it: each answer body and each stream event is validated here, strictly, with the
    installed `openai` and `anthropic` packages' pydantic models."""
    import httpx
    from pydantic import TypeAdapter

    def writer(state):
        return {"out": [httpx.post(recording_api.url + path, json={"model": "m", **body}).text
                        for path, body, _ in WIRE]}

    replies = ["Adding. " + CALL, "Adding. " + CALL, "Adding. " + CALL, " a time", " upon", '{"a": 2, "b": 3}', CALL,
               "Cats purr on and on", "Adding. " + CALL, "Adding. " + CALL]  # (n=2: two replies)
    policy = scripted_policy(replies)
    episode = instrument(one_node(writer), {"writer": policy}, strict=True).rollout({"q": "x"})
    models, checked = _sdk_models(), []
    for (path, body, kind), text in zip(WIRE, episode.final_state["out"], strict=True):
        adapter = TypeAdapter(models[kind])
        if not body.get("stream"):
            adapter.validate_python(json.loads(text))
            checked.append(kind)
            continue
        events = [json.loads(line[len("data: "):]) for line in text.split("\n") if line.startswith("data: {")]
        assert text.rstrip().endswith("data: [DONE]") == path.endswith("completions")
        for event in events:
            if kind == "completion_chunk" and event["choices"] and event["choices"][0]["finish_reason"] is None:
                continue  # the API sends finish_reason null until the last chunk; the SDK's model types it non-null
            adapter.validate_python(event)
            checked.append(event.get("type", kind))
    assert checked.count("chat_chunk") == 2 * 5 + 1  # per choice: role, content, tool call x 2, finish; usage
    assert {"response.created", "response.output_item.added", "response.function_call_arguments.delta",
            "response.output_text.delta", "response.completed", "response.incomplete"} <= set(checked)
    assert {"message_start", "content_block_delta", "message_delta", "message_stop"} <= set(checked)
    assert recording_api.received == []
    policy.close()


def test_completions_echo_and_a_responses_tool_output_given_as_parts(recording_api):
    """Legacy Completions with `echo: true` answer the prompt followed by the completion (the turn holds the
    completion only); a Responses `function_call_output` given as `input_text` parts is the tool message's
    text, as a string output is."""
    import openai

    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    client = openai.OpenAI(base_url=recording_api.url + "/v1", api_key="k", max_retries=0)
    call = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'}

    def writer(state):
        echoed = client.completions.create(model="m", prompt="Once upon", max_tokens=5, echo=True).choices[0].text
        parts = client.responses.create(model="m", tools=RESPONSE_TOOLS, input=[
            {"role": "user", "content": "add 2 3"}, call,
            {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "5"}]}])
        return {"out": [echoed, parts.output_text]}

    policy = scripted_policy([" a time", "It is 5."])
    episode = instrument(one_node(writer), {"writer": policy}, strict=True).rollout({"q": "x"})
    assert episode.final_state["out"] == ["Once upon a time", "It is 5."]
    assert episode.turns[0].response_text == " a time"
    lc = [HumanMessage("add 2 3"), AIMessage("", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "call_1"}]),
          ToolMessage("5", tool_call_id="call_1")]
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD["input_schema"]}}]
    assert list(episode.turns[1].prompt_ids) == policy.render(lc, tools)
    assert recording_api.received == []
    policy.close()
