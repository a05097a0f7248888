"""Chat templates: the built-in ones the package ships, and reading and checking a template given to a model.

A model whose own chat template drops `tools` (SmolLM2's does) cannot be asked for a tool call: the schema never
reaches the prompt. A template that renders them is given to the model instead of its own:

- in the YAML, `models.<name>.chat_template: builtin:<name>` (a built-in below) or a template file's path;
- in Python, the template's text: `TransformersPolicy(..., chat_template=builtin_chat_template("smollm2-tools"))`,
  or any `Policy(..., chat_template=text)`.

The built-ins are files in this folder (package data); `BUILTIN_CHAT_TEMPLATES` names them and says what each
renders. Like `config`, this module imports only `drmas_graph.errors` (Jinja2 is imported when a template is checked).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from drmas_graph.errors import ConfigError

__all__ = ["BUILTIN_PREFIX", "BUILTIN_CHAT_TEMPLATES", "builtin_chat_template", "check_chat_template",
           "read_chat_template"]

BUILTIN_PREFIX = "builtin:"
"""How `models.<name>.chat_template` names a built-in template instead of a file (`builtin:smollm2-tools`)."""

BUILTIN_CHAT_TEMPLATES: dict[str, str] = {
    "smollm2-tools": "SmolLM2's ChatML plus tools in the Hermes syntax of the `hermes` tool parser (the tools as JSON "
                     "in `<tools>` in the system message, calls as `<tool_call>{\"name\": ..., \"arguments\": {...}}"
                     "</tool_call>`, results as a `tool` turn); without tools, what SmolLM2's own template renders. "
                     "Fits any ChatML model whose template drops tools.",
}
"""Built-in chat templates by name -> what each renders (its file: `<name>.jinja` in this folder)."""


def builtin_chat_template(name: str) -> str:
    """The text of built-in chat template `name` (`smollm2-tools`, or `builtin:smollm2-tools`), for a policy's
    `chat_template=`; `ConfigError` listing the built-ins when there is no such one."""
    key = name.removeprefix(BUILTIN_PREFIX)
    if key not in BUILTIN_CHAT_TEMPLATES:
        raise ConfigError(f"there is no built-in chat template {key!r}: the built-ins are "
                          f"{', '.join(sorted(BUILTIN_CHAT_TEMPLATES))} (`{BUILTIN_PREFIX}<name>` in the YAML); or "
                          "give the path of a template file")
    return resources.files(__name__).joinpath(f"{key}.jinja").read_text(encoding="utf-8")


def check_chat_template(template: str, what: str) -> None:
    """Parse a Jinja chat template as Hugging Face tokenizers compile it (sandboxed, `trim_blocks`,
    `lstrip_blocks`, loop controls, `{% generation %}` blocks) and raise `ConfigError` naming the template
    (`what`: its file, its policy) and the line when it does not parse: a broken template fails here, not at
    the first call. A built-in's name given where the text belongs (`builtin:smollm2-tools`) is refused too: as
    a template it would render that name and nothing else."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    name = template.strip()
    if name.startswith(BUILTIN_PREFIX) and "\n" not in name:
        raise ConfigError(f"{what} is {name!r}, the name of a built-in template, not a template: pass its text, "
                          f"builtin_chat_template({name.removeprefix(BUILTIN_PREFIX)!r}) "
                          "(drmas_graph.chat_templates); the YAML's `models.<name>.chat_template` takes the name")

    class _Generation(Extension):  # transformers' `{% generation %}...{% endgeneration %}` marks assistant text
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, "jinja2.ext.loopcontrols"])
    try:
        env.parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{what} does not parse as Jinja: line {exc.lineno}: {exc.message}; fix the template "
                          "there") from None


def read_chat_template(path: str | Path, where: str = "") -> str:
    """The text of a chat template: built-in `builtin:<name>` (`builtin_chat_template`), else a file (a relative
    `path` is relative to the working directory), checked by `check_chat_template`. `where` names the setting
    (`models.smollm2.chat_template`) the errors start with."""
    prefix = f"{where}: " if where else ""
    if str(path).startswith(BUILTIN_PREFIX):
        try:
            return builtin_chat_template(str(path))
        except ConfigError as e:
            raise ConfigError(f"{prefix}{e}") from None
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{prefix}chat template file {str(path)!r} does not exist (looked for "
                          f"{str(file.resolve())!r}; a relative path is relative to the working directory; "
                          f"a built-in is `{BUILTIN_PREFIX}<name>`: {', '.join(sorted(BUILTIN_CHAT_TEMPLATES))})")
    text = file.read_text(encoding="utf-8")
    check_chat_template(text, f"{prefix}chat template file {str(path)!r}")
    return text
