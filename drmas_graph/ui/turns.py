"""How one recorded turn reads as text, the same on the episode page and in `drmas-graph traces show`: the prompt
the policy was given, the tool calls it made, the flags it carries (the app's own model served it; it was decoded
under a grammar, and for which format).

The prompt: a turn records the exact token ids the policy saw (`Turn.prompt_ids`, its chat template applied) and
the messages the node sent (`Turn.messages`). The ids are decoded with the policy's tokenizer where the run folder
holds it (`find_tokenizer`); where it does not, the text cannot be shown exactly and the messages stand in, said
so (`PromptText.note`). No other tokenizer is ever tried: a tokenizer of another model decodes the same ids into
plausible, wrong text.

Needs only the ``tokenizers`` package (no torch, no Jinja2): the command line imports it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drmas_graph.errors import DrmasError
from drmas_graph.types import Turn

__all__ = ["TokenizerFile", "find_tokenizer", "load_tokenizer", "unknown_id", "PromptText", "prompt_text", "ToolUse",
           "tool_use", "turn_flags", "constraint"]


@dataclass(frozen=True)
class TokenizerFile:
    """Where a policy's tokenizer is in a run folder, or where it was looked for."""

    path: Path | None
    """Its tokenizer.json; None: none found."""
    shown: str
    """How the page names it: relative to the run folder where it is inside it ('checkpoints/step_000002/solver/
    model/tokenizer.json'); empty when none was found."""
    looked: tuple[str, ...]
    """Where it was looked for, in order (what a page says when none was found)."""


def find_tokenizer(folder: Path, policy: str, config: Mapping[str, Any] | None = None) -> TokenizerFile:
    """The tokenizer of model `policy` (`Turn.policy`) that run folder `folder` holds, first found of:

    - ``checkpoints/step_*/POLICY/model/tokenizer.json``, the latest checkpoint first (every checkpoint saves it);
    - ``sync/POLICY/tokenizer.json``, what a served model's servers last loaded;
    - ``tokenizer.json`` in the folder the run's `config` (the trace store's config: the training config) names
      as ``models.POLICY.path``: an absolute path, or one relative to where training ran, known when the folder
      is the config's relative ``run_dir`` under it. A bundled name (``smollm2``) or a ``tiny`` model names no
      folder: found once the run checkpoints.

    Looked up on every call (a checkpoint saved later is found then)."""
    folder = Path(folder).resolve()
    inside = [*(c / policy / "model" / "tokenizer.json"
                for c in sorted((folder / "checkpoints").glob("step_*"), reverse=True)),
              folder / "sync" / policy / "tokenizer.json"]
    for path in inside:  # a link out of the run folder is not followed
        if path.is_file() and path.resolve().is_relative_to(folder):
            return TokenizerFile(path, str(path.relative_to(folder)), ())
    model_folder, where = _config_model_folder(folder, policy, config or {})
    if model_folder is not None and (model_folder / "tokenizer.json").is_file():
        return TokenizerFile(model_folder / "tokenizer.json", str(model_folder / "tokenizer.json"), ())
    return TokenizerFile(None, "", (f"checkpoints/step_*/{policy}/model/tokenizer.json",
                                    f"sync/{policy}/tokenizer.json", where))


def _config_model_folder(folder: Path, policy: str, config: Mapping[str, Any]) -> tuple[Path | None, str]:
    """(the model folder the run's config names for `policy` or None, how the lookup is described)."""
    models = config.get("models")
    entry = models.get(policy) if isinstance(models, Mapping) else None
    path = entry.get("path") if isinstance(entry, Mapping) else None
    if not isinstance(path, str) or not path:
        return None, f"models.{policy}.path of the run's config (none)"
    where = f"models.{policy}.path of the run's config ({path})"
    if Path(path).is_absolute():
        return Path(path), where
    run_dir = config.get("run_dir")
    parts = Path(run_dir).parts if isinstance(run_dir, str) and not Path(run_dir).is_absolute() else ()
    if parts and ".." not in parts and folder.parts[-len(parts):] == parts:  # training ran where run_dir starts
        return folder.parents[len(parts) - 1] / path, where
    return None, where + ": relative to where training ran, which the run folder does not tell"


def load_tokenizer(path: Path) -> Any:
    """The `tokenizers.Tokenizer` saved at `path` (a tokenizer.json); DrmasError naming it when it cannot be read."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 (the Rust library raises a bare Exception for a malformed file)
        raise DrmasError(f"cannot read the tokenizer {path} ({e}): remove or repair the file") from None


def unknown_id(tokenizer: Any, turn: Turn) -> int | None:
    """The smallest token id of `turn` (prompt or response) that `tokenizer` does not have, or None: a tokenizer
    with an id missing is not the one the policy used, and decodes nothing of the turn."""
    unknown = [i for i in set(turn.prompt_ids) | set(turn.response_ids) if i < 0 or tokenizer.id_to_token(i) is None]
    return min(unknown, default=None)


@dataclass(frozen=True)
class PromptText:
    """The prompt of a turn as text, and what that text is."""

    text: str | None
    """`Turn.prompt_ids` decoded with the policy's tokenizer, special tokens kept: exactly what the policy saw,
    its chat template applied; None when they cannot be decoded (then the recorded messages stand in)."""
    note: str
    """What `text` is (how many ids, which tokenizer), or why there is none and what is shown instead."""


def prompt_text(turn: Turn, tokenizer: Any, where: TokenizerFile) -> PromptText:
    """The prompt of `turn` decoded with `tokenizer` (loaded from `where`; None when none was found)."""
    messages = "the recorded messages are shown instead: what the node sent, before the chat template"
    if not turn.prompt_ids:
        who = "the app's own model served this call" if not turn.trainable else "the turn recorded none"
        return PromptText(None, f"no prompt token ids ({who}): {messages}")
    if tokenizer is None:
        return PromptText(None, f"the exact prompt cannot be shown: no tokenizer of policy {turn.policy!r} in the run "
                                f"folder (looked for {', '.join(where.looked)}); {messages}")
    unknown = unknown_id(tokenizer, turn)
    if unknown is not None:
        return PromptText(None, f"the exact prompt cannot be shown: the turn holds token id {unknown}, which "
                                f"{where.shown} does not have: it is not the tokenizer of policy {turn.policy!r}; "
                                f"{messages}")
    text = tokenizer.decode(list(turn.prompt_ids), skip_special_tokens=False)
    return PromptText(text, f"exactly what the policy saw: the {len(turn.prompt_ids)} prompt token ids decoded with "
                            f"{where.shown} (special tokens kept)")


@dataclass(frozen=True)
class ToolUse:
    """The tool calls a turn made and whether they parsed."""

    calls: tuple[str, ...]
    """Each call that parsed, as 'name({"arg": value})' (`Turn.tool_calls`)."""
    well_formed: bool | None
    """True: it made tool calls and all parsed; False: a call in the reply did not parse (`Turn.format_error`);
    None: it made no tool call (it answered in text)."""
    note: str
    """One line saying so ('2 tool calls, all parsed', 'a tool call did not parse: ...', 'no tool call')."""


def tool_use(turn: Turn) -> ToolUse | None:
    """What `turn` did with tools, or None when it was given none and made no call. A `format_error` of a turn
    that asked for structured output (`response_format`) is about that output, not a tool call: not counted here."""
    if not turn.tools and not turn.tool_calls:
        return None
    calls = tuple(f"{c.get('name')}({json.dumps(c.get('args', {}), ensure_ascii=False, default=str)})"
                  for c in turn.tool_calls)
    if turn.format_error and turn.response_format is None:
        parsed = f" ({len(calls)} other{'s' if len(calls) != 1 else ''} parsed)" if calls else ""
        return ToolUse(calls, False, f"a tool call did not parse{parsed}: {turn.format_error}")
    if calls:
        return ToolUse(calls, True, f"{len(calls)} tool call{'s' if len(calls) != 1 else ''}, all parsed")
    return ToolUse(calls, None, "no tool call (answered in text)")


def turn_flags(turn: Turn) -> list[tuple[str, str]]:
    """(label, what it means) of each flag `turn` carries, shown next to it on the episode page and in `traces
    show`. A new per-turn flag is one entry here."""
    flags = []
    if not turn.trainable:
        flags.append(("not trainable", "the app's own model served this call: not trained on"))
    constrained = constraint(turn)
    if constrained is not None:
        flags.append((f"constrained: {constrained[0]}", constrained[1]))
    return flags


def constraint(turn: Turn) -> tuple[str, str] | None:
    """(what kind, what it guaranteed) of the grammar `turn` was decoded under (`Turn.sampling.grammar`,
    `drmas_graph.grammar`), or None when it was not: the kind is the format its call asked for (`json_object`,
    `json_schema`, `tools (forced)`, `tools (required)`) or, for tools offered without a structured-output request,
    the `tool_choice` the grammar encodes (`tools (auto)`, `tools (none)`)."""
    grammar = turn.sampling.grammar if turn.sampling is not None else None
    if grammar is None:
        return None
    spec = turn.response_format or {}
    name = f" {spec['name']!r}" if spec.get("name") else ""
    if spec.get("type") == "json_object":
        return "json_object", "decoded under a grammar: JSON mode, the reply is one JSON object"
    if spec.get("type") == "json_schema":
        return "json_schema", f"decoded under a grammar: one JSON object valid against the schema{name}"
    if spec.get("type") == "tool":
        return "tools (forced)", f"decoded under a grammar: a call of the forced tool{name}, arguments valid"
    if spec.get("type") == "any_tool":
        names = ", ".join(spec.get("names", []))
        return "tools (required)", f"decoded under a grammar: one or more calls of {names}, arguments valid"
    try:
        fmt = json.loads(grammar).get("format", {})
    except (ValueError, AttributeError):
        fmt = {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("any_text", "any_tokens"):
        return "tools (none)", "decoded under a grammar: tool_choice none, free text that never opens a tool call"
    if kind in ("triggered_tags", "token_triggered_tags"):
        if fmt.get("at_least_one"):
            return "tools (required)", "decoded under a grammar: one or more tool calls, arguments valid"
        return "tools (auto)", ("decoded under a grammar: tool_choice auto, free text or, once the reply opens a tool "
                                "call, a call of a bound tool with valid arguments")
    return "grammar", f"decoded under a grammar the viewer does not name: {grammar[:200]}"
