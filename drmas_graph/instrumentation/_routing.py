"""Which agent an LLM call belongs to, and the checks of `instrument(..., agents=...)`.

The agent of a call is, by precedence (the first that applies):

1. `drmas_agent` in the call's run metadata: set on the call (`llm.invoke(msgs, config={"metadata":
   {"drmas_agent": "judge"}})`) or on any runnable around it (`subgraph.with_config(metadata=...)`).
2. An `agents` entry `"agent:<glob>"` matching the LangChain agent name of the call's run: the
   `lc_agent_name` run metadata that `langchain.agents.create_agent(name=...)` sets, and so every
   Deep Agents agent and sub-agent. Several named agents may run inside one LangGraph node (Deep Agents
   runs its sub-agents in the main agent's `tools` node, all at path `tools/model`): their names tell them
   apart, whatever node they run in.
3. An `agents` entry that is a glob over node paths ('outer/inner' inside subgraphs, 'entry/task' for a
   Functional API task), first match in the mapping's order.
4. The node path itself.

Node-path globs are `fnmatch` globs over the whole path (`*` also matches '/'). A glob that matches no node
of the graph is refused at construction unless it can match a path *under* a node: a node's function may
invoke a subgraph, and an `@entrypoint` calls `@task`s, whose paths ('essay_workflow/write') no static
view of the graph lists. Globs that could only be checked at run time, and `agent:` entries, are reported
after the first episode if no call matched them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from drmas_graph.errors import UnknownAgentError

__all__ = ["AGENT_NAME_PREFIX", "AgentRouter", "under_node", "can_match_under"]

AGENT_NAME_PREFIX = "agent:"
"""An `agents` key with this prefix is a glob over LangChain agent names (`lc_agent_name`), not node paths."""


class AgentRouter:
    """The agent of each call from its run metadata and node path (see the module docstring)."""

    def __init__(self, agents: Mapping[str, str], nodes: Sequence[str]) -> None:
        self.by_name: list[tuple[str, str]] = []
        """(agent-name glob, agent), in the mapping's order."""
        self.by_node: list[tuple[str, str]] = []
        """(node-path glob, agent), in the mapping's order."""
        self.unverified: set[str] = set()
        """`agents` keys that no static node matches (agent names, paths under a node): checked after a run."""
        self.matched: set[str] = set()
        """`agents` keys that matched at least one call."""
        self.names_seen: set[str] = set()
        """LangChain agent names seen on calls (for messages about `agent:` entries)."""
        for key, agent in agents.items():
            if key.startswith(AGENT_NAME_PREFIX):
                if not key[len(AGENT_NAME_PREFIX):]:
                    raise UnknownAgentError(f"agents: {key!r} (agent {agent!r}) names no agent; write "
                                            f"'{AGENT_NAME_PREFIX}<name>' with the agent's name, e.g. 'agent:researcher'")
                self.by_name.append((key[len(AGENT_NAME_PREFIX):], agent))
                self.unverified.add(key)
                continue
            self.by_node.append((key, agent))
            if any(fnmatch.fnmatchcase(n, key) for n in nodes):
                continue
            if not any(can_match_under(n, key) for n in nodes):
                raise UnknownAgentError(
                    f"agents: pattern {key!r} (agent {agent!r}) matches no node; nodes found: {list(nodes)}. "
                    "Patterns are globs over node paths ('outer/inner' inside subgraphs, also for a subgraph "
                    "that a node's function invokes, 'entry/task' for Functional API tasks); "
                    f"'{AGENT_NAME_PREFIX}<name>' maps a LangChain agent by its name.")
            self.unverified.add(key)
        self._cache: dict[tuple[str, str | None], tuple[str, str | None]] = {}

    def agent_of(self, metadata: Mapping[str, Any], node: str) -> str:
        """The agent of a call with run `metadata` made in node path `node`."""
        explicit = metadata.get("drmas_agent")
        if explicit:
            return str(explicit)
        name = metadata.get("lc_agent_name")
        name = str(name) if name else None
        found = self._cache.get((node, name))
        if found is None:
            found = self._resolve(node, name)
            self._cache[(node, name)] = found
        agent, key = found
        if name is not None:
            self.names_seen.add(name)  # set.add and dict writes are atomic: calls on many threads need no lock
        if key is not None:
            self.matched.add(key)
        return agent

    def _resolve(self, node: str, name: str | None) -> tuple[str, str | None]:
        """(agent, the `agents` key that chose it or None)."""
        if name is not None:
            for pattern, agent in self.by_name:
                if fnmatch.fnmatchcase(name, pattern):
                    return agent, AGENT_NAME_PREFIX + pattern
        for pattern, agent in self.by_node:
            if fnmatch.fnmatchcase(node, pattern):
                return agent, pattern
        return node, None

    def unmatched(self) -> list[str]:
        """`agents` keys that no static node matches and that no call has matched yet."""
        return sorted(self.unverified - self.matched)


def under_node(node: str, pattern: str) -> bool:
    """True when `pattern` names something inside `node` part by part ('research/*' under 'research')."""
    nodes, parts = node.split("/"), pattern.split("/")
    return len(parts) > len(nodes) and all(fnmatch.fnmatchcase(n, p) for n, p in zip(nodes, parts))


def can_match_under(node: str, pattern: str) -> bool:
    """True when the glob `pattern` matches some path 'node/...' (fnmatch semantics: `*` also matches '/').

    The glob runs as a small automaton over the prefix 'node/'; if any state survives the prefix, the rest
    of the pattern can match some remainder (every glob token matches at least one string)."""
    tokens = _glob_tokens(pattern)
    states = _closure({0}, tokens)
    for char in node + "/":
        states = _closure({j for i in states for j in _step(tokens, i, char)}, tokens)
        if not states:
            return False
    return True


def _glob_tokens(pattern: str) -> list[str]:
    """The glob as tokens: '*', '?', a bracket class '[...]' (as written) or one literal character
    (an unclosed '[' is a literal, as in fnmatch)."""
    tokens, i, n = [], 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "[":
            j = i + 1
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j < n:
                tokens.append(pattern[i:j + 1])
                i = j + 1
                continue
        tokens.append(char)
        i += 1
    return tokens


def _closure(states: Iterable[int], tokens: Sequence[str]) -> set[int]:
    """`states` plus every state reachable by letting a '*' match nothing."""
    out, todo = set(), list(states)
    while todo:
        i = todo.pop()
        if i in out:
            continue
        out.add(i)
        if i < len(tokens) and tokens[i] == "*":
            todo.append(i + 1)
    return out


def _step(tokens: Sequence[str], i: int, char: str) -> list[int]:
    """The states after token `i` consumes `char`."""
    if i >= len(tokens):
        return []
    token = tokens[i]
    if token == "*":
        return [i]
    if token == "?" or (len(token) > 1 and fnmatch.fnmatchcase(char, token)) or token == char:
        return [i + 1]
    return []
