"""Tool-call ids are derived from the reply that made the call (rev6_b): the same in every run, so a template that
renders them gives the call after a tool result the same prompt and seed; 9 alphanumeric characters, which
Mistral's real chat template (tests/data, from Mistral-7B-Instruct-v0.3) requires."""

import re
from pathlib import Path

from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from drmas_graph import instrument
from drmas_graph._chat import parse_hermes, tool_call_id
from drmas_graph._structured import apply_spec
from drmas_graph.instrumentation._seeds import prompt_digest
from drmas_graph.testing import scripted_policy

MISTRAL_TEMPLATE = (Path(__file__).parent / "data" / "mistral_v0.3_chat_template.jinja").read_text()
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


class AppModel(FakeMessagesListChatModel):  # the app's own model, never called inside an instrumented run
    def bind_tools(self, tools, **kwargs):
        return self.bind(tools=list(tools), **kwargs)


def tool_agent():
    llm = AppModel(responses=[AIMessage("unused")]).bind_tools([add])

    def agent(state: MessagesState):
        return {"messages": [llm.invoke(state["messages"])]}

    return (StateGraph(MessagesState).add_node("agent", agent).add_node("tools", ToolNode([add]))
            .add_edge(START, "agent").add_conditional_edges("agent", tools_condition).add_edge("tools", "agent")
            .compile())


def replies(prompt: str) -> str:
    return "The answer is 3." if "[TOOL_RESULTS]" in prompt else CALL


def test_a_tool_calling_agent_on_mistrals_template_runs_and_repeats_its_prompts_and_seeds():
    """With 'call_' + 24 random hex digits the template raised at the call after the tool result, and its prompt
    (and seed) changed from run to run under a template that renders ids."""
    runs = []
    for _ in range(2):
        app = instrument(tool_agent(), {"agent": scripted_policy(replies, chat_template=MISTRAL_TEMPLATE)})
        episode = app.rollout({"messages": [HumanMessage("What is 1 + 2?")]}, metadata={"seed": 7})
        assert episode.error is None, episode.error
        runs.append(episode)
    first, second = runs
    assert [t.response_text for t in first.turns] == [CALL, "The answer is 3."]
    assert [t.prompt_ids for t in first.turns] == [t.prompt_ids for t in second.turns]
    assert [t.sampling.seed for t in first.turns] == [t.sampling.seed for t in second.turns]
    messages = first.final_state["messages"]
    call_id = messages[1].tool_calls[0]["id"]
    assert re.fullmatch(r"[0-9A-Za-z]{9}", call_id) and call_id == second.final_state["messages"][1].tool_calls[0]["id"]
    assert first.turns[0].tool_calls[0]["id"] == call_id  # the Turn keeps the id the node got (replay returns it)
    assert isinstance(messages[2], ToolMessage) and messages[2].tool_call_id == call_id and messages[2].content == "3"
    prompt = scripted_policy(replies, chat_template=MISTRAL_TEMPLATE).decode(first.turns[1].prompt_ids)
    assert f'[TOOL_CALLS] [{{"name": "add", "arguments": {{"a": 1, "b": 2}}, "id": "{call_id}"}}]' in prompt
    assert f'[TOOL_RESULTS] {{"content": 3, "call_id": "{call_id}"}}[/TOOL_RESULTS]' in prompt


def test_ids_depend_on_the_reply_and_the_calls_place_only():
    two = CALL + CALL
    ids = [c["id"] for c in parse_hermes(two).tool_calls]
    assert ids == [c["id"] for c in parse_hermes(two).tool_calls] and len(set(ids)) == 2
    assert ids[0] != parse_hermes(CALL).tool_calls[0]["id"]  # another reply
    bad = parse_hermes("<tool_call>{not json}</tool_call>").invalid_tool_calls[0]["id"]
    assert re.fullmatch(r"[0-9A-Za-z]{9}", bad) and bad == tool_call_id("<tool_call>{not json}</tool_call>", 0)
    spec = {"type": "tool", "name": "Answer"}  # structured output through a forced tool call, replied as bare JSON
    parsed, _ = apply_spec(spec, None, '{"value": 3}', parse_hermes, "node 'agent'")
    assert parsed.tool_calls[0]["id"] == tool_call_id('{"value": 3}', 0)
    assert re.fullmatch(r"[0-9A-Za-z]{9}", parsed.tool_calls[0]["id"])


MISTRAL_CALL = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]'


def test_a_tool_calling_agent_replying_in_mistrals_format_runs_with_the_mistral_parser():
    """tool_parser='mistral' reads the calls a Mistral model writes ([TOOL_CALLS] + a JSON list; the marker is a
    special token decoding may drop), and the template renders them back with the 9-character id."""
    def mistral_replies(prompt: str) -> str:
        return "The answer is 3." if "[TOOL_RESULTS]" in prompt else MISTRAL_CALL

    policy = scripted_policy(mistral_replies, chat_template=MISTRAL_TEMPLATE, tool_parser="mistral")
    episode = instrument(tool_agent(), {"agent": policy}).rollout({"messages": [HumanMessage("What is 1 + 2?")]},
                                                                   metadata={"seed": 7})
    assert episode.error is None, episode.error
    messages = episode.final_state["messages"]
    call = messages[1].tool_calls[0]
    first = episode.turns[0]  # the parser's id, made unique in the episode by the call's key, agent and prompt
    expected = tool_call_id(first.call_key, "agent", prompt_digest(first.prompt_ids), 0, tool_call_id(MISTRAL_CALL, 0))
    assert (call["name"], call["args"], call["id"]) == ("add", {"a": 1, "b": 2}, expected)
    assert messages[2].content == "3" and messages[-1].content == "The answer is 3."
    prompt = policy.decode(episode.turns[1].prompt_ids)
    assert f'[TOOL_RESULTS] {{"content": 3, "call_id": "{call["id"]}"}}[/TOOL_RESULTS]' in prompt


def test_the_mistral_parser_reads_unmarked_lists_and_leaves_other_json_as_content():
    from drmas_graph._chat import parse_mistral

    unmarked = '[{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}] then more'
    parsed = parse_mistral(unmarked)
    assert [(c["name"], c["args"]) for c in parsed.tool_calls] == [("add", {"a": 1, "b": 2})]
    assert parsed.content == "then more" and parsed.tool_calls[0]["id"] == tool_call_id(unmarked, 0)
    assert parse_mistral("[1, 2, 3]").content == "[1, 2, 3]" and not parse_mistral("[1, 2, 3]").tool_calls
    bad = parse_mistral('sure [TOOL_CALLS] [{"name": 3}]')
    assert bad.content == "sure" and not bad.tool_calls and bad.invalid_tool_calls[0]["args"] == '[{"name": 3}]'
    assert bad.invalid_tool_calls[0]["error"] == "TypeError: each call needs a string name and object arguments"


def test_the_same_call_twice_in_one_conversation_gets_two_ids_the_same_in_every_run_and_in_replay(tmp_path):
    """rev7_e: ids came from the reply and the call's place in it only, so the same reply twice in one
    conversation gave both calls one id (and the tool results one `tool_call_id`), which the API formats forbid
    (Anthropic refuses duplicate `tool_use` ids) and which leaves a tool result ambiguous."""
    from drmas_graph.traces.replay import replay
    from drmas_graph.traces.store import TraceStore

    def run():
        with TraceStore(tmp_path / "run.db") as store:
            app = instrument(tool_agent(), {"agent": scripted_policy([CALL, CALL, "It is 3, twice."])}, store=store)
            return app.rollout({"messages": [HumanMessage("Add 1 and 2, twice.")]})

    def call_ids(messages):  # (the calls' ids, the tool results' ids): ToolNode gives its messages random ids
        return ([c["id"] for m in messages for c in getattr(m, "tool_calls", ())],
                [m.tool_call_id for m in messages if isinstance(m, ToolMessage)])

    first, second = run(), run()
    ids, results = call_ids(first.final_state["messages"])
    assert len(set(ids)) == 2 and results == ids and all(re.fullmatch(r"[0-9A-Za-z]{9}", i) for i in ids)
    assert [t.tool_calls[0]["id"] for t in first.turns[:2]] == ids  # recorded as the node got them
    assert call_ids(second.final_state["messages"]) == (ids, ids)
    replayed = replay(tool_agent(), tmp_path / "run.db", first.id)
    assert replayed.divergences == [] and call_ids(replayed.final_state["messages"]) == (ids, ids)


def test_the_same_malformed_call_twice_in_one_conversation_gets_two_ids_in_the_run_and_in_replay(tmp_path):
    """A call that does not parse reaches an SDK app as a tool call (rev7_f), which the app answers by its id."""
    import openai

    from drmas_graph.traces.replay import replay
    from drmas_graph.traces.store import TraceStore

    broken = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2,}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    def loop(state: MessagesState):
        client = openai.OpenAI(api_key="sk-never-sent", max_retries=0)
        messages = [{"role": "user", "content": "Add 1 and 2."}]
        for _ in range(3):
            reply = client.chat.completions.create(model="m", messages=messages, tools=tools).choices[0].message
            if not reply.tool_calls:
                break
            messages.append(reply.model_dump(exclude_none=True))
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "bad arguments"} for c in reply.tool_calls]
        return {"messages": [AIMessage(str([m.get("tool_call_id") for m in messages if m["role"] == "tool"]))]}

    graph = StateGraph(MessagesState).add_node("agent", loop).add_edge(START, "agent").compile()
    with TraceStore(tmp_path / "run.db") as store:
        episode = instrument(graph, {"agent": scripted_policy([broken, broken, "I give up."])}, store=store).rollout(
            {"messages": []})
    ids = eval(episode.final_state["messages"][-1].content)  # noqa: S307 - the list the node wrote
    assert len(ids) == 2 and len(set(ids)) == 2 and all(re.fullmatch(r"[0-9A-Za-z]{9}", i) for i in ids)
    replayed = replay(graph, tmp_path / "run.db", episode.id)
    assert replayed.divergences == [] and eval(replayed.final_state["messages"][-1].content) == ids  # noqa: S307
