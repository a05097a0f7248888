"""What a turn reads as, on the episode page and in `drmas-graph traces show` (`drmas_graph.ui.turns`): the exact
prompt decoded from its recorded ids with the tokenizer the run folder holds (else the recorded messages, said so),
the tool calls it made and whether they parsed; and the per-agent tool-use curves of the Runs page."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
from langchain_core.messages import HumanMessage, SystemMessage

from drmas_graph.cli import main
from drmas_graph.testing import tiny_tokenizer
from drmas_graph.traces.store import TraceStore
from drmas_graph.types import Episode, Turn
from drmas_graph.ui._app import UiApp
from tests.test_ui import get

MESSAGES = [{"role": "system", "content": "you are solver"}, {"role": "user", "content": "2 + 2? <b>"}]
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def chat() -> tuple[object, str, list[int]]:
    """The tiny chat tokenizer, the ChatML text of `MESSAGES` its template renders, and that text's token ids."""
    tokenizer = tiny_tokenizer()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return tokenizer, text, tokenizer(text, add_special_tokens=False)["input_ids"]


def turn(index: int, ids: list[int], **changes) -> Turn:
    fields = dict(agent="solver", node="solve", step=1, index=index,
                  messages=(SystemMessage("you are solver"), HumanMessage("2 + 2? <b>")), prompt_ids=tuple(ids),
                  response_ids=(7, 8), response_logprobs=(-0.1, -0.2), response_text="4", policy="tiny",
                  policy_version=1, call_key="solve")
    fields.update(changes)
    return Turn(**fields)


def write_store(path: Path, ids: list[int], config: dict | None = None) -> None:
    """Episode 'ep' (one turn of policy 'tiny', prompt `ids`) and episode 'tools' (a parsed call, a call that did
    not parse, no call though tools were given, a structured-output failure, a call by the app's own model)."""
    not_parsed = '1 tool call(s) in the reply do not parse: Expecting value: line 1 column 7 (char 6)'
    with TraceStore(path, config=config) as store:
        store.write_episode(Episode(id="ep", turns=[turn(0, ids)]))
        store.write_episode(Episode(id="tools", turns=[
            turn(0, ids, tools=(ADD,), finish_reason="tool_calls",
                 tool_calls=({"name": "add", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"},)),
            turn(1, ids, tools=(ADD,), format_error=not_parsed),
            turn(2, ids, tools=(ADD,)),
            turn(3, ids, format_error="the reply is not JSON", response_format={"type": "json_object"}),
            turn(4, (), response_ids=(), response_logprobs=(), policy=None, policy_version=None, trainable=False,
                 tools=(ADD,), tool_calls=({"name": "add", "args": {"a": 5, "b": 6}, "id": "c2", "type": "tool_call"},)),
        ]))


def save_tokenizer(tokenizer, folder: Path) -> Path:
    folder.mkdir(parents=True)
    tokenizer.save_pretrained(str(folder))
    return folder / "tokenizer.json"


def decoded(path: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).decode(ids, skip_special_tokens=False)


def prompt_block(body: str, position: int) -> str:
    """The HTML of turn `position`'s prompt: from its prompt element to the response."""
    start = body.index(f'id="prompt-{position}"')
    return body[start:body.index('class="msg ai response"', start)]


# -- the prompt text ---------------------------------------------------------------------------------------------


def test_the_episode_page_shows_the_prompt_ids_decoded_with_the_checkpoints_tokenizer(tmp_path, chat):
    tokenizer, text, ids = chat
    run = tmp_path / "run"
    write_store(run / "traces.db", ids)
    app = UiApp([run])
    block = prompt_block(get(app, "/runs/run/episodes/ep")[1], 0)
    assert "the exact prompt cannot be shown: no tokenizer of policy &#39;tiny&#39; in the run folder" in block
    assert 'class="prompt-text"' not in block and "<pre>2 + 2? &lt;b&gt;</pre>" in block  # the messages stand in

    path = save_tokenizer(tokenizer, run / "checkpoints" / "step_000002" / "tiny" / "model")
    assert decoded(path, ids) == text  # the ids are the ChatML text the template rendered
    block = prompt_block(get(app, "/runs/run/episodes/ep")[1], 0)
    assert (f"exactly what the policy saw: the {len(ids)} prompt token ids decoded with "
            "checkpoints/step_000002/tiny/model/tokenizer.json (special tokens kept)") in block
    shown = re.search(r'<pre class="prompt-text">(.*?)</pre>', block, re.S).group(1)
    assert html.unescape(shown) == decoded(path, ids) == text
    assert shown.startswith("&lt;|im_start|&gt;system\nyou are solver&lt;|im_end|&gt;")  # escaped, line breaks kept
    app.close()


def test_a_tokenizer_that_does_not_have_the_prompts_ids_is_not_used(tmp_path, chat):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    _, _, ids = chat
    run = tmp_path / "run"
    write_store(run / "traces.db", ids)
    folder = run / "checkpoints" / "step_000001" / "tiny" / "model"
    folder.mkdir(parents=True)
    Tokenizer(WordLevel({"a": 0, "b": 1, "c": 2}, unk_token="a")).save(str(folder / "tokenizer.json"))
    app = UiApp([run])
    block = prompt_block(get(app, "/runs/run/episodes/ep")[1], 0)
    assert (f"the exact prompt cannot be shown: the turn holds token id {min(i for i in [*ids, 7, 8] if i > 2)}, which "
            "checkpoints/step_000001/tiny/model/tokenizer.json does not have: it is not the tokenizer of policy "
            "&#39;tiny&#39;") in block and 'class="prompt-text"' not in block
    body = get(app, "/runs/run/episodes/ep")[1]  # nor its response: the token ids are shown
    assert '<span class="t t8" title="id 7 · logprob -0.1000">⟨7⟩</span>' in body
    app.close()


def test_before_a_checkpoint_the_model_folder_the_runs_config_names_decodes_the_prompt(tmp_path, chat,
                                                                                       monkeypatch):
    """Training ran in tmp_path with run_dir runs/r and models.tiny.path models/tiny (relative to it): the viewer,
    started elsewhere, finds models/tiny beside runs/ (not in its own working directory)."""
    tokenizer, text, ids = chat
    run = tmp_path / "runs" / "r"
    path = save_tokenizer(tokenizer, tmp_path / "models" / "tiny")
    write_store(run / "traces.db", ids, config={"run_dir": "runs/r", "models": {"tiny": {"path": "models/tiny"}}})
    monkeypatch.chdir(run)
    app = UiApp([run])
    block = prompt_block(get(app, "/runs/r/episodes/ep")[1], 0)
    assert f"decoded with {path} (special tokens kept)" in block
    assert html.unescape(re.search(r'<pre class="prompt-text">(.*?)</pre>', block, re.S).group(1)) == text
    app.close()
    other = tmp_path / "elsewhere" / "r"  # the same store in a folder that is not runs/r: where training ran is unknown
    other.mkdir(parents=True)
    (run / "traces.db").rename(other / "traces.db")
    app = UiApp([other])
    block = prompt_block(get(app, "/runs/r/episodes/ep")[1], 0)
    assert ("models.tiny.path of the run&#39;s config (models/tiny): relative to where training ran, which the run "
            "folder does not tell") in block and 'class="prompt-text"' not in block
    app.close()


def test_traces_show_prints_the_prompt_ids_decoded_and_says_when_it_cannot(tmp_path, chat, capsys, monkeypatch):
    tokenizer, text, ids = chat
    run = tmp_path / "run"
    write_store(run / "traces.db", ids)
    assert main(["traces", "show", str(run / "traces.db"), "ep"]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert ("prompt not shown exactly: the exact prompt cannot be shown: no tokenizer of policy 'tiny' in the run "
            "folder (looked for checkpoints/step_*/tiny/model/tokenizer.json, sync/tiny/tokenizer.json, "
            "models.tiny.path of the run's config (none)); the recorded messages are shown instead") in out
    assert "message system: you are solver" in out and "message human: 2 + 2? <b>" in out

    path = save_tokenizer(tokenizer, run / "sync" / "tiny")  # a served model's last pushed weights
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["traces", "show", str(run / "traces.db"), "ep", "--full"]) == 0
    lines = [line.strip("│ ").rstrip() for line in capsys.readouterr().out.splitlines()]
    at = lines.index(f"prompt   (exactly what the policy saw: the {len(ids)} prompt token ids decoded with "
                     "sync/tiny/tokenizer.json (special tokens kept))")
    end = next(i for i in range(at, len(lines)) if lines[i].startswith("response "))
    assert "\n".join(lines[at + 1:end]) == decoded(path, ids) == text  # its final line break too
    assert main(["traces", "show", str(run / "traces.db"), "ep"]) == 0  # folded: one line
    out = capsys.readouterr().out
    assert "         <|im_start|>system you are solver<|im_end|> <|im_start|>user 2 + 2? <b><|im_end|>" in out


# -- tool calls, flags -------------------------------------------------------------------------------------------


def test_the_episode_page_shows_each_turns_tool_calls_and_whether_they_parsed(tmp_path, chat):
    run = tmp_path / "run"
    write_store(run / "traces.db", chat[2])
    app = UiApp([run])
    body = get(app, "/runs/run/episodes/tools")[1]

    def tool_status(position: int) -> tuple[str, str] | None:
        found = re.search(rf'id="tool-use-{position}">.*?<p class="tool-status (\w+)">(.*?)</p>', body, re.S)
        return found and (found.group(1), html.unescape(found.group(2)))

    assert tool_status(0) == ("ok", "1 tool call, all parsed")
    assert '"name": "add",\n    "args": {\n      "a": 1,' in html.unescape(body)
    assert tool_status(1) == ("warn", "a tool call did not parse: 1 tool call(s) in the reply do not parse: "
                                      "Expecting value: line 1 column 7 (char 6)")
    assert tool_status(2) == ("note", "no tool call (answered in text)")
    assert tool_status(3) is None and "format error: the reply is not JSON" in body  # structured output, not a call
    assert tool_status(4) == ("ok", "1 tool call, all parsed")
    summaries = re.findall(r"<summary><b>#(\d)</b>(.*?)</summary>", body, re.S)
    assert [n for n, s in summaries if "tool call did not parse" in s] == ["1"]
    assert [n for n, s in summaries if ('title="the app&#39;s own model served this call: not trained on">not '
                                        "trainable</span>") in s] == ["4"]
    app.close()


def test_traces_show_prints_each_turns_tool_calls_and_whether_they_parsed(tmp_path, chat, capsys, monkeypatch):
    run = tmp_path / "run"
    write_store(run / "traces.db", chat[2])
    monkeypatch.setenv("COLUMNS", "300")
    assert main(["traces", "show", str(run / "traces.db"), "tools"]) == 0
    lines = [line.strip("│ ").rstrip() for line in capsys.readouterr().out.splitlines()]
    calls = [line for line in lines if line.startswith(("calls ", "invalid "))]
    assert calls == [
        'calls    1 tool call, all parsed: add({"a": 1, "b": 2})',
        "calls    a tool call did not parse: 1 tool call(s) in the reply do not parse: Expecting value: line 1 "
        "column 7 (char 6)",
        "calls    no tool call (answered in text)",
        "invalid  the reply is not JSON",
        'calls    1 tool call, all parsed: add({"a": 5, "b": 6})',
    ]
    assert any("policy app model (not trainable)" in line for line in lines)


# -- the per-agent tool-use curves ---------------------------------------------------------------------------------


def test_the_runs_page_draws_each_agents_tool_use_among_the_first_charts(tmp_path):
    """metrics.jsonl with `agent/<a>/tool_calls_per_turn` and `agent/<a>/tool_calls_well_formed` (the second left
    out at a step where no turn of the agent attempted a call): a curve per agent, before "Every other metric"."""
    run = tmp_path / "run"
    run.mkdir()
    records = [
        {"step": 0, "agent/solver/tool_calls_per_turn": 1.5, "agent/solver/tool_calls_well_formed": 0.5,
         "agent/checker/tool_calls_per_turn": 0.0},
        {"step": 1, "agent/solver/tool_calls_per_turn": 0.0, "agent/checker/tool_calls_per_turn": 0.25,
         "agent/checker/tool_calls_well_formed": 1.0},
        {"step": 2, "agent/solver/tool_calls_per_turn": 2.0, "agent/solver/tool_calls_well_formed": 0.75,
         "agent/checker/tool_calls_per_turn": 0.5, "agent/checker/tool_calls_well_formed": 0.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    app = UiApp([run])
    body = get(app, "/")[1]
    first = body[body.index('id="charts"'):body.index("Every other metric") if "Every other metric" in body else None]
    figures = {m.group(1): m.group(0) for m in re.finditer(r"<figcaption>(.*?)</figcaption>.*?</figure>", first, re.S)}
    per_turn, well_formed = (figures["tool calls per turn, per agent"],
                             figures["tool calls well formed, per agent (steps where one was attempted)"])
    assert re.findall(r"<title>(.*?)</title>", per_turn) == [
        "run / solver: step 0, 1.5", "run / solver: step 1, 0", "run / solver: step 2, 2",
        "run / checker: step 0, 0", "run / checker: step 1, 0.25", "run / checker: step 2, 0.5"]
    assert re.findall(r"<title>(.*?)</title>", well_formed) == [
        "run / solver: step 0, 0.5", "run / solver: step 2, 0.75",  # no point where the metric was left out
        "run / checker: step 1, 1", "run / checker: step 2, 0"]
    app.close()


# -- constrained turns --------------------------------------------------------------------------------------------

MULTIPLY = {"type": "function", "function": {"name": "multiply", "description": "a * b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CONSTRAINED = [  # (how the app calls, the scripted reply (valid under the grammar), the flag's label or None)
    ("free", "Hi.", None),
    ("json_object", '{"a": 1}', "constrained: json_object"),
    ("json_schema", '{"ok": true}', "constrained: json_schema"),
    ("forced", '{"a": 2, "b": 3}', "constrained: tools (forced)"),
    ("required", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
     "constrained: tools (required)"),
    ("auto", "It is 6.", "constrained: tools (auto)"),
    ("none", "It is 6.", "constrained: tools (none)"),
]


def constrained_episode(monkeypatch) -> Episode:
    """One episode of an app whose node makes one call of each kind of `CONSTRAINED` through ChatOpenAI, served by a
    scripted policy that decodes under the grammars (`constrain=True`): the turns as the recorder writes them."""
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph
    from pydantic import BaseModel

    from drmas_graph import instrument
    from drmas_graph.testing import scripted_policy

    class Ok(BaseModel):
        ok: bool

    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-used")
    llm = ChatOpenAI(model="gpt-4o-mini", base_url="http://127.0.0.1:9/v1", max_retries=0, timeout=2)
    calls = {"free": llm, "json_object": llm.bind(response_format={"type": "json_object"}),
             "json_schema": llm.with_structured_output(Ok, method="json_schema"),
             "forced": llm.bind_tools([MULTIPLY], tool_choice="multiply"),
             "required": llm.bind_tools([MULTIPLY, ADD], tool_choice="required"),
             "auto": llm.bind_tools([MULTIPLY, ADD]), "none": llm.bind_tools([MULTIPLY, ADD], tool_choice="none")}

    def ask(state):
        return {"replies": [str(calls[kind].invoke([HumanMessage("2 * 3?")])) for kind, _, _ in CONSTRAINED]}

    graph = StateGraph(dict).add_node("ask", ask).add_edge(START, "ask").add_edge("ask", END)
    policy = scripted_policy([reply for _, reply, _ in CONSTRAINED], name="tiny", constrain=True)
    episode = instrument(graph, {"ask": policy}).rollout({"q": "2 * 3?"})
    policy.close()
    assert episode.ok, episode.error
    return episode


def test_the_episode_page_and_traces_show_say_which_turns_were_constrained(tmp_path, capsys, monkeypatch):
    episode = constrained_episode(monkeypatch)
    assert [t.sampling.grammar is not None for t in episode.turns] == [False] + [True] * 6
    run = tmp_path / "run"
    with TraceStore(run / "traces.db") as store:
        store.write_episode(episode)
    app = UiApp([run])
    body = get(app, "/runs/run/episodes/" + episode.id)[1]
    summaries = dict(re.findall(r"<summary><b>#(\d)</b>(.*?)</summary>", body, re.S))
    badges = {int(n): re.findall(r'<span class="badge flag" title="([^"]*)">(constrained: [^<]*)</span>', s)
              for n, s in summaries.items()}
    assert [[html.unescape(label) for _, label in badges[i]] for i in range(7)] == [
        [label] if label else [] for _, _, label in CONSTRAINED]
    assert html.unescape(badges[2][0][0]) == "decoded under a grammar: one JSON object valid against the schema 'Ok'"
    assert html.unescape(badges[3][0][0]) == ("decoded under a grammar: a call of the forced tool 'multiply', "
                                              "arguments valid")
    app.close()

    monkeypatch.setenv("COLUMNS", "300")
    assert main(["traces", "show", str(run / "traces.db"), episode.id]) == 0
    policies = re.findall(r"policy (tiny@0(?: \([^)]*\)*)?)   latency", capsys.readouterr().out)
    assert policies == ["tiny@0"] + [f"tiny@0 ({label})" for _, _, label in CONSTRAINED[1:]]


def test_a_turn_that_asked_for_a_format_without_a_grammar_is_not_flagged_constrained():
    from drmas_graph.types import SamplingParams
    from drmas_graph.ui.turns import turn_flags

    unconstrained = turn(0, [1], response_format={"type": "json_object"}, sampling=SamplingParams(constrain=False))
    assert turn_flags(unconstrained) == []  # constrain: false, or a store from before constrained decoding
    odd = turn(0, [1], sampling=SamplingParams(grammar='{"type": "structural_tag", "format": {"type": "regex"}}'))
    assert [label for label, _ in turn_flags(odd)] == ["constrained: grammar"]
