"""Which LLM calls the check's episodes made, who answered them, and what went out unserved.

`calls_of` counts, over every episode of the preflight (scored or failed), the calls each agent's policy served
(its trainable turns), the calls the app's own model answered (agents without a policy), and the LLM API requests
no policy served (`Episode.metadata["unserved_calls"]`, written by the instrumentation's HTTP hook: a request
shape it does not serve, a call from a thread outside the run). `CallCheck.warnings` names each agent with a
policy that served no call, with the likely cause and the fix, and every node whose requests went unserved.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from drmas_graph.instrumentation import UNSERVED_KEY
from drmas_graph.types import Episode

__all__ = ["CallCheck", "calls_of"]

_SERVED_APIS = ("OpenAI Chat Completions, Completions or Responses, or Anthropic Messages, over httpx, requests or "
                "aiohttp (the OpenAI and Anthropic SDKs, LiteLLM), or any LangChain chat model")


@dataclass(frozen=True)
class CallCheck:
    """The LLM calls of the check's episodes, by agent and by who answered them."""

    served: dict[str, int]
    """Agent with a policy -> calls its policy served (0 for one that served none)."""
    app_answered: dict[str, int]
    """Agent without a policy -> calls the app's own model answered."""
    unserved: dict[tuple[str, str, str, bool], int]
    """(node, client, URL, refused) -> LLM API requests no policy served (refused in strict mode, else sent)."""
    agent_of_node: dict[str, str] = field(default_factory=dict)
    """Node path of each unserved request -> the agent its calls would belong to."""

    def lines(self) -> list[str]:
        rows = ["LLM calls served per agent: " + ", ".join(f"{a} {n}" for a, n in self.served.items())]
        if self.app_answered:
            rows.append("answered by the app's own model (agents without a policy): "
                        + ", ".join(f"{a} {n}" for a, n in self.app_answered.items()))
        for (node, client, url, refused), n in self.unserved.items():
            rows.append(f"unserved LLM API requests: node {node!r}, {n} x {client} {url} "
                        f"({'refused, strict mode' if refused else 'sent to the remote API'})")
        return rows

    def warnings(self) -> list[str]:
        out = [self._silent(agent) for agent, n in self.served.items() if n == 0]
        for (node, client, url, refused), n in self.unserved.items():
            fate = "refused them (strict mode)" if refused else "let them go to the remote API unserved and unrecorded"
            out.append(f"node {node!r} sent {n} LLM API request(s) with {client} to {url} that no policy served; "
                       f"drmas-graph {fate}. It serves {_SERVED_APIS}: send the node's calls through one of these "
                       "(e.g. the OpenAI SDK's chat.completions), or wrap a deliberate call to the real API (a "
                       "judge) in drmas_graph.app_models()")
        return out

    def _silent(self, agent: str) -> str:
        head = f"agent {agent!r} has a policy but served no LLM call: it would not be trained. Likely cause: "
        mine = [(node, client, url) for (node, client, url, _), _n in self.unserved.items()
                if self.agent_of_node.get(node) == agent]
        if mine:
            node, client, url = mine[0]
            return (head + f"its node {node!r} calls its model with {client} at {url}, in a shape drmas-graph does "
                    f"not serve (see the warning below). Fix: use {_SERVED_APIS}")
        if self.app_answered:
            return (head + f"the calls came from agent(s) {sorted(self.app_answered)}, which have no policy, so the "
                    f"app's own model answered them. Fix: if {agent!r} is meant to be one of them, name its policy "
                    f"after that node (agents: {{{sorted(self.app_answered)[0]!r}: ...}} in the config) or map the "
                    f"node to it with instrument(..., agents={{'<node glob>': {agent!r}}})")
        return (head + "no call came from a node mapped to it: the graph did not reach its node in these episodes, "
                "or the node calls its model through something drmas-graph cannot see (a gRPC or websocket client, "
                "a subprocess, a native library). Fix: check the graph's edges and the agent's name against the "
                f"node paths, and send the calls through {_SERVED_APIS}")


def calls_of(episodes: Sequence[Episode], agents: Sequence[str], agent_for_node: Callable[[str], str]) -> CallCheck:
    """The calls of `episodes` for the agents with a policy `agents` (`agent_for_node`: node path -> agent)."""
    served = {a: 0 for a in agents}
    app_answered: Counter[str] = Counter()
    unserved: Counter[tuple[str, str, str, bool]] = Counter()
    for episode in episodes:
        for turn in episode.turns:
            if turn.trainable and turn.agent in served:
                served[turn.agent] += 1
            elif not turn.trainable:
                app_answered[turn.agent] += 1
        for r in episode.metadata.get(UNSERVED_KEY) or ():
            unserved[(str(r.get("node")), str(r.get("client")), str(r.get("url")), bool(r.get("refused")))] += 1
    nodes = {node: agent_for_node(node) for node, _, _, _ in unserved if not node.startswith("<")}
    return CallCheck(served=served, app_answered=dict(app_answered), unserved=dict(unserved), agent_of_node=nodes)
