"""`models.<name>.chat_template` (a template file per model in the YAML) and `Policy(chat_template=...)`: the file's
template renders the prompt ids, also for a served policy on the same tokenizer and after a checkpoint; a missing
file or a template that does not parse fails when the config loads, naming the model key, the file and the line."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage, SystemMessage

from drmas_graph.config import load_config
from drmas_graph.engine import build_policy
from drmas_graph.errors import ConfigError

TOOLS = [{"type": "function", "function": {"name": "multiply", "description": "Multiply two integers.",
                                           "parameters": {"type": "object", "properties": {}}}}]
MESSAGES = [SystemMessage("Be brief."), HumanMessage("What is 12 * 34?")]

# A template written for the test: one line per tool, then ChatML.
TEMPLATE = (
    "{% for t in tools or [] %}TOOL {{ t.function.name }}: {{ t.function.description }}\n{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EXPECTED = ("TOOL multiply: Multiply two integers.\n<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nWhat is 12 * 34?<|im_end|>\n<|im_start|>assistant\n")


def _config(tmp_path, template_path: str):
    (tmp_path / "train.yaml").write_text(f"graph: graphs.math.graph:build_graph\nmodels:\n  calc:\n    tiny: {{}}\n"
                                         f"    chat_template: {template_path}\n")
    return load_config(tmp_path / "train.yaml")


def test_a_template_file_renders_the_prompt_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools.jinja").write_text(TEMPLATE)
    cfg = _config(tmp_path, "tools.jinja")
    policy = build_policy("calc", cfg.models["calc"], seed=0)
    expected_ids = policy.tokenizer.encode(EXPECTED, add_special_tokens=False)
    assert policy.render(MESSAGES, TOOLS) == expected_ids
    assert policy.chat_template == TEMPLATE and policy.tokenizer.chat_template == TEMPLATE
    # the tiny model's own template renders tools differently: the file changed the ids
    default = build_policy("calc", cfg.models["calc"].model_copy(update={"chat_template": None}), seed=0)
    assert default.render(MESSAGES, TOOLS) != expected_ids
    assert default.render(MESSAGES, TOOLS)[:3] == default.tokenizer.encode("<|im_start|>system\n")[:3]
    policy.close(), default.close()


def test_a_served_policy_on_the_tokenizer_and_a_checkpoint_render_with_it(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from drmas_graph.served import VLLMPolicy

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools.jinja").write_text(TEMPLATE)
    policy = build_policy("calc", _config(tmp_path, "tools.jinja").models["calc"], seed=0)
    expected_ids = policy.tokenizer.encode(EXPECTED, add_special_tokens=False)
    # what the trainer builds for `serve`: a served policy on the embedded policy's tokenizer (no request is sent)
    served = VLLMPolicy("http://127.0.0.1:9", policy.tokenizer, name="calc")
    assert served.render(MESSAGES, TOOLS) == expected_ids
    policy.tokenizer.save_pretrained(tmp_path / "ckpt")  # what a checkpoint saves
    assert AutoTokenizer.from_pretrained(tmp_path / "ckpt").chat_template == TEMPLATE
    policy.close()


def test_a_missing_template_file_names_the_model_key_and_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, "templates/nope.jinja")
    message = str(err.value)
    assert "models.calc.chat_template" in message
    assert "chat template file 'templates/nope.jinja' does not exist" in message
    assert str(tmp_path / "templates" / "nope.jinja") in message


def test_a_template_that_does_not_parse_names_the_file_and_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, "broken.jinja")
    message = str(err.value)
    assert "models.calc.chat_template" in message
    assert "chat template file 'broken.jinja' does not parse as Jinja: line 2: unexpected '}'" in message


def test_a_python_policy_checks_its_template_at_construction():
    from drmas_graph.testing import tiny_policy

    with pytest.raises(ConfigError, match=r"the chat_template of policy 'calc' does not parse as Jinja: line 1"):
        tiny_policy(name="calc", chat_template="{% if tools %}never closed")
    policy = tiny_policy(name="calc", chat_template=TEMPLATE)
    assert policy.render(MESSAGES, TOOLS) == policy.tokenizer.encode(EXPECTED, add_special_tokens=False)
    # transformers' `{% generation %}` blocks parse
    tiny_policy(name="calc", chat_template="{% generation %}{{ messages[0].content }}{% endgeneration %}").close()
    policy.close()
