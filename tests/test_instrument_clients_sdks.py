"""Issue 47: the Anthropic SDK, the OpenAI Responses and Completions APIs, LiteLLM and raw requests/aiohttp
POSTs inside a node are served by the node's agent's policy, answered in their own protocol, attributed
like LangChain calls (globs, subgraphs, an agent named on the request), and never leave the process."""

import asyncio
import json
import os
import warnings

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.graph import END, START, StateGraph

from drmas_graph import instrument
from drmas_graph.testing import scripted_policy
from tests._no_network import no_network  # noqa: F401 - a fixture
from tests.test_instrument_clients import LC_MESSAGES, MESSAGES, S, fake_keys, two_nodes  # noqa: F401

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not fetch its price list at import

ADD = {"name": "add", "description": "Add two numbers",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def one_node(fn, name="writer"):
    g = StateGraph(S)
    g.add_node(name, fn)
    g.add_edge(START, name)
    g.add_edge(name, END)
    return g.compile()


def test_anthropic_messages_sync_with_tools_and_a_tool_result(no_network):
    import anthropic

    client = anthropic.Anthropic(max_retries=0)
    history = [{"role": "user", "content": "Add 2 and 3."},
               {"role": "assistant", "content": [{"type": "text", "text": "Calling."},
                                                 {"type": "tool_use", "id": "toolu_1", "name": "add",
                                                  "input": {"a": 2, "b": 3}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}]}]

    def writer(state):
        first = client.messages.create(model="claude-x", max_tokens=40, system="You add.",
                                       messages=history[:1], tools=[ADD])
        second = client.messages.create(model="claude-x", max_tokens=30, system="You add.", messages=history,
                                        tools=[ADD])
        return {"out": (first, second)}

    policy = scripted_policy(["Calling. " + CALL, "It is 5."])
    episode = instrument(one_node(writer), {"writer": policy}, strict=True).rollout({"q": "x"})
    first, second = episode.final_state["out"]
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["text", "tool_use"]
    assert first.content[0].text == "Calling." and (first.content[1].name, first.content[1].input) == ("add", {"a": 2, "b": 3})
    assert first.content[1].id == episode.turns[0].tool_calls[0]["id"]
    assert second.content[0].text == "It is 5." and second.stop_reason == "end_turn"
    turn = episode.turns[1]
    assert second.usage.input_tokens == len(turn.prompt_ids) and second.usage.output_tokens == len(turn.response_ids)
    lc = [SystemMessage("You add."), HumanMessage("Add 2 and 3."),
          AIMessage("Calling.", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "toolu_1"}]),
          ToolMessage("5", tool_call_id="toolu_1")]
    assert list(turn.prompt_ids) == policy.render(lc, [ADD])  # a LangChain call of these messages, tools bound
    assert first.content and episode.turns[0].sampling.max_new_tokens == 40
    assert no_network == []
    policy.close()


def test_anthropic_async_stream_and_forced_tool_choice(no_network):
    import anthropic

    client = anthropic.AsyncAnthropic(max_retries=0)

    async def writer(state):
        async with client.messages.stream(model="claude-x", max_tokens=50, messages=[{"role": "user", "content": "hi"}],
                                          tools=[ADD], tool_choice={"type": "tool", "name": "add"}) as stream:
            message = await stream.get_final_message()
        return {"out": message}

    policy = scripted_policy(['{"a": 1, "b": 4}'])
    episode = asyncio.run(instrument(one_node(writer), {"writer": policy}, strict=True).arollout({"q": "x"}))
    message = episode.final_state["out"]
    assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "add", {"a": 1, "b": 4})]
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == len(episode.turns[0].response_ids)
    assert episode.turns[0].response_format == {"type": "tool", "name": "add", "schema": ADD["input_schema"]}
    assert no_network == []
    policy.close()


def test_openai_responses_api_json_and_stream(no_network):
    import openai

    client = openai.OpenAI(max_retries=0)
    tools = [{"type": "function", "name": "add", "description": "Add two numbers", "parameters": ADD["input_schema"]}]

    def writer(state):
        plain = client.responses.create(model="gpt-x", instructions="You write.", input="Write about cats.")
        called = client.responses.create(model="gpt-x", input=[{"role": "user", "content": "add 2 3"}], tools=tools)
        events = list(client.responses.create(model="gpt-x", input="Write about cats.", instructions="You write.",
                                              stream=True))
        return {"out": (plain.output_text, [(o.type, o.name, o.arguments) for o in called.output], events)}

    policy = scripted_policy(["Cats purr.", CALL, "Cats nap."])
    episode = instrument(one_node(writer), {"writer": policy}, strict=True).rollout({"q": "x"})
    text, calls, events = episode.final_state["out"]
    assert text == "Cats purr." and calls == [("function_call", "add", '{"a": 2, "b": 3}')]
    assert list(episode.turns[0].prompt_ids) == policy.render(LC_MESSAGES)
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "Cats nap."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Cats nap."
    assert events[-1].response.usage.output_tokens == len(episode.turns[2].response_ids)
    assert no_network == []
    policy.close()


def test_legacy_completions_prompt_in_text_out(tmp_path, no_network):
    import openai

    from drmas_graph import TraceStore, replay

    client = openai.OpenAI(max_retries=0)

    def writer(state):
        reply = client.completions.create(model="gpt-3.5-turbo-instruct", prompt="Once upon", max_tokens=8)
        return {"out": [reply.choices[0].text, reply.usage.prompt_tokens]}

    policy = scripted_policy([" a time"])
    store = TraceStore(tmp_path / "traces")
    graph = one_node(writer)
    episode = instrument(graph, {"writer": policy}, strict=True, store=store).rollout({"q": "x"})
    (text, prompt_tokens), turn = episode.final_state["out"], episode.turns[0]
    assert text == " a time" == turn.response_text  # the text as generated
    assert list(turn.prompt_ids) == policy.tokenizer.encode("Once upon", add_special_tokens=False)  # no template
    assert turn.sampling.max_new_tokens == 8 and prompt_tokens == len(turn.prompt_ids)
    result = replay(graph, store, episode.id)
    assert result.divergences == [] and result.final_state["out"] == [" a time", prompt_tokens]
    assert no_network == []
    policy.close()


def test_litellm_completion_and_acompletion(no_network):
    import litellm

    def writer(state):
        sync = litellm.completion(model="gpt-4o-mini", messages=MESSAGES, num_retries=0)
        other = asyncio.run(litellm.acompletion(model="anthropic/claude-3-5-haiku-latest", messages=MESSAGES,
                                                max_tokens=20, num_retries=0))
        return {"out": (sync.choices[0].message.content, other.choices[0].message.content)}

    policy = scripted_policy(["from openai", "from anthropic"])
    episode = instrument(one_node(writer), {"writer": policy}, strict=True).rollout({"q": "x"})
    assert episode.final_state["out"] == ("from openai", "from anthropic")
    first, second = episode.turns
    assert list(first.prompt_ids) == list(second.prompt_ids) == policy.render(LC_MESSAGES)
    assert second.sampling.max_new_tokens == 20
    assert no_network == []
    policy.close()


def test_raw_requests_and_aiohttp_posts_are_served(no_network):
    import aiohttp
    import requests

    body = {"model": "m", "messages": MESSAGES}

    def deltas(lines):
        chunks = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])

    async def with_aiohttp():
        async with aiohttp.ClientSession() as session:
            async with session.post("https://api.groq.com/openai/v1/chat/completions", json=body) as resp:
                resp.raise_for_status()
                whole = (await resp.json())["choices"][0]["message"]["content"]
            async with session.post("https://api.groq.com/openai/v1/chat/completions",
                                    json={**body, "stream": True}) as resp:
                lines = [line.decode().strip() async for line in resp.content]
        return whole, deltas(lines)

    def writer(state):
        raw = requests.post("https://api.together.xyz/v1/chat/completions", json=body, timeout=5)
        streamed = requests.post("https://api.together.xyz/v1/chat/completions", json={**body, "stream": True},
                                 stream=True, timeout=5)
        assert streamed.headers["content-type"] == "text/event-stream"
        text = deltas(streamed.iter_lines(decode_unicode=True))
        return {"out": (raw.status_code, raw.json()["choices"][0]["message"]["content"], text,
                        *asyncio.run(with_aiohttp()))}

    policy = scripted_policy(["via requests", "streamed by requests", "via aiohttp", "streamed by aiohttp"])
    episode = instrument(one_node(writer), {"writer": policy}, strict=True).rollout({"q": "x"})
    assert episode.final_state["out"] == (200, "via requests", "streamed by requests", "via aiohttp",
                                          "streamed by aiohttp")
    assert [t.agent for t in episode.turns] == ["writer"] * 4
    assert no_network == []
    policy.close()


def test_agent_named_on_the_request_and_node_globs_inside_a_subgraph(no_network):
    """`X-Drmas-Agent` routes like `drmas_agent` metadata; a call inside a subgraph node has its node path,
    matched by an `agents` glob, as a LangChain call there is."""
    import openai

    client = openai.OpenAI(max_retries=0)

    def draft(state):
        a = client.chat.completions.create(model="m", messages=MESSAGES).choices[0].message.content
        b = client.chat.completions.create(model="m", messages=MESSAGES,
                                           extra_headers={"X-Drmas-Agent": "critic"}).choices[0].message.content
        return {"out": [a, b]}

    outer = StateGraph(S)
    outer.add_node("team", one_node(draft, "draft"))
    outer.add_edge(START, "team")
    outer.add_edge("team", END)
    writer, critic = scripted_policy(["a draft"], name="w"), scripted_policy(["a critique"], name="c", seed=1)
    app = instrument(outer.compile(), {"writer": writer, "critic": critic}, agents={"team/*": "writer"}, strict=True)
    episode = app.rollout({"q": "x"})
    assert episode.final_state["out"] == ["a draft", "a critique"]
    assert [(t.agent, t.node, t.policy) for t in episode.turns] == [("writer", "team/draft", "w"),
                                                                      ("critic", "team/draft", "c")]
    assert no_network == []
    writer.close()
    critic.close()


NO_TOOLS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A chat template without tool support: it renders no tool schema."""


def test_a_template_that_drops_tools_is_reported():
    """A chat template without tool support renders no schema: a warning in training, an error in strict mode."""
    import openai

    from drmas_graph import StrictModeError

    client = openai.OpenAI(max_retries=0)
    tools = [{"type": "function", "function": {"name": "lookup_weather", "parameters": {"type": "object"}}}]

    def writer(state):
        return {"out": client.chat.completions.create(model="m", messages=MESSAGES, tools=tools).choices[0].message.content}

    policy = scripted_policy(["ok"], chat_template=NO_TOOLS_TEMPLATE)
    with pytest.warns(UserWarning, match=r"agent 'writer' \(node 'writer'\): the chat template of policy "
                                         r"'scripted-s0' does not render the bound tool\(s\) \['lookup_weather'\]"):
        instrument(one_node(writer), {"writer": policy}).rollout({"q": "x"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per policy and tool
        instrument(one_node(writer), {"writer": policy}).rollout({"q": "x"})
    with pytest.raises(Exception) as info:
        instrument(one_node(writer), {"writer": policy}, strict=True).rollout({"q": "x"})
    assert isinstance(info.value.__cause__, StrictModeError) and "['lookup_weather']" in str(info.value.__cause__)
    policy.close()


def test_app_models_lets_a_deliberate_call_through(no_network):
    import httpx

    from drmas_graph import app_models
    from tests._no_network import NetworkUsed

    def writer(state):
        with app_models():  # a judge: the app's own API, whatever the client
            with pytest.raises(NetworkUsed):
                httpx.post("https://api.openai.com/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
        return {"out": "judged"}

    policy = scripted_policy(["x"])
    app = instrument(two_nodes(writer), {"planner": policy, "writer": policy}, strict=True)
    episode = app.rollout({"q": "x"})
    assert episode.final_state["out"] == "judged" and len(no_network) == 1 and episode.error is None
    policy.close()


def test_a_plain_thread_outside_the_run_is_refused_in_strict_mode(no_network):
    import threading

    import openai

    from drmas_graph import StrictModeError

    client = openai.OpenAI(max_retries=0)
    seen = []

    def writer(state):
        def work():
            try:
                client.chat.completions.create(model="m", messages=MESSAGES)
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                seen.append(exc)
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        return {"out": "x"}

    policy = scripted_policy(["plan"])
    with pytest.raises(Exception) as info:
        instrument(two_nodes(writer), {"planner": policy, "writer": policy}, strict=True).rollout({"q": "x"})
    assert isinstance(seen[0], StrictModeError) and "https://api.openai.com/v1/chat/completions" in str(seen[0])
    assert "outside the context of every instrumented run" in str(info.value.__cause__)
    assert no_network == []
    policy.close()


def test_check_prints_the_calls_served_per_agent_and_names_the_unserved_ones(tmp_path, capsys, no_network):
    from drmas_graph.cli import main
    from tests._sdk_graphs import GEMINI
    from tests.test_cli_train import write_config

    cfg = write_config(tmp_path, graph="tests._sdk_graphs:sdk_solver_gemini_verifier",
                       agents={"solver": {"model": "tiny", "sampling": {"max_new_tokens": 4}},
                               "verifier": {"model": "tiny", "sampling": {"max_new_tokens": 4}}})
    status = main(["check", str(cfg), "--groups", "2", "--set", "group_size=2"])
    out = capsys.readouterr().out
    assert status == 3, out  # training runs strict: every episode's Gemini request was refused, so it failed
    assert "LLM calls served per agent: solver 4, verifier 0" in out
    assert f"unserved LLM API requests: node 'verifier', 4 x httpx {GEMINI} (refused, strict mode)" in out
    assert ("warning: agent 'verifier' has a policy but served no LLM call: it would not be trained. Likely cause: "
            f"its node 'verifier' calls its model with httpx at {GEMINI}, in a shape drmas-graph does not serve") in out
    assert (f"warning: node 'verifier' sent 4 LLM API request(s) with httpx to {GEMINI} that no policy served; "
            "drmas-graph refused them (strict mode). It serves OpenAI Chat Completions") in out
    assert no_network == []  # refused before any socket


def test_check_names_an_agent_whose_node_is_named_otherwise():
    from drmas_graph.train.loop._calls import CallCheck

    sent = CallCheck(served={"judge": 3}, app_answered={}, unserved={("judge", "requests", "https://x.ai/v2/chat", False): 2},
                     agent_of_node={"judge": "judge"})
    assert sent.lines()[1] == "unserved LLM API requests: node 'judge', 2 x requests https://x.ai/v2/chat (sent to the remote API)"
    assert sent.warnings()[0].startswith("node 'judge' sent 2 LLM API request(s) with requests to https://x.ai/v2/chat "
                                         "that no policy served; drmas-graph let them go to the remote API unserved")
    calls = CallCheck(served={"writer": 0}, app_answered={"write": 6}, unserved={})
    assert calls.lines() == ["LLM calls served per agent: writer 0",
                             "answered by the app's own model (agents without a policy): write 6"]
    assert calls.warnings() == [
        "agent 'writer' has a policy but served no LLM call: it would not be trained. Likely cause: the calls came "
        "from agent(s) ['write'], which have no policy, so the app's own model answered them. Fix: if 'writer' is "
        "meant to be one of them, name its policy after that node (agents: {'write': ...} in the config) or map the "
        "node to it with instrument(..., agents={'<node glob>': 'writer'})"]


def test_a_dropped_tool_warns_in_a_training_rollout_even_when_strict():
    """Training runs strict; its episodes carry their phase: the dropped tool warns and training goes on."""
    import openai

    client = openai.OpenAI(max_retries=0)
    tools = [{"type": "function", "function": {"name": "lookup_tide", "parameters": {"type": "object"}}}]

    def writer(state):
        return {"out": client.chat.completions.create(model="m", messages=MESSAGES, tools=tools).choices[0].message.content}

    policy = scripted_policy(["ok"], chat_template=NO_TOOLS_TEMPLATE, name="no-tools-template")
    with pytest.warns(UserWarning, match=r"does not render the bound tool\(s\) \['lookup_tide'\]"):
        episode = instrument(one_node(writer), {"writer": policy}, strict=True).rollout(
            {"q": "x"}, metadata={"phase": "train", "step": 0})
    assert episode.final_state["out"] == "ok"
    policy.close()
