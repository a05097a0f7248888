"""Core types: what one LLM call and one run of a graph look like once recorded.

Naming: token ids and logprobs are stored as tuples (immutable, cheap to hash and compare); a `Turn` is
one LLM call (one training sample), an `Episode` is one run of the whole graph on one input.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import BaseMessage

__all__ = ["SamplingParams", "Generation", "Turn", "Segment", "Episode", "Sample", "new_id"]


def new_id() -> str:
    """A fresh random id (32 hex characters)."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class SamplingParams:
    """How a policy samples one response. Logprobs are always log_softmax(logits / temperature)."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (logprobs are then taken at temperature 1)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to at least top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or negative keeps all."""
    max_new_tokens: int = 256
    """Upper bound on response length in tokens."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends after the token that completes one of them (the token is kept)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation, besides the tokenizer's end-of-sequence ids."""
    seed: int | None = None
    """Seed of this request's sampler; None draws one from the policy's own seeded generator."""
    train_logprobs: bool = True
    """Whether the response's logprobs feed a training update; False (evaluation) lets a backend whose logprobs
    would be those of the truncated distribution (vLLM with top-p/top-k) serve the request."""
    adapter: str | None = None
    """LoRA adapter that generates this response (`drmas_graph.train.optim.lora`); None = the model's own weights."""
    constrain: bool = True
    """Decode a call under the grammar of the format it asks for (JSON mode, a JSON schema, tool calls), as the
    real APIs guarantee that format; False: free text, checked after it is generated (`drmas_graph.grammar`)."""
    grammar: str | None = None
    """The grammar this response is decoded under (an xgrammar structural tag, `drmas_graph.grammar.grammar_for`),
    set per call from the format it asks for; logprobs are then those of the masked distribution. None: none."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Generation:
    """What a policy backend returns for one prompt."""

    token_ids: tuple[int, ...]
    """The sampled response token ids, exactly as sampled (stop/eos token included when it ended the text)."""
    logprobs: tuple[float, ...]
    """log p(token) under the sampling distribution (before top-p/top-k truncation; after the grammar's mask where
    the request has one), one per token id."""
    finish_reason: str
    """'stop' (eos, stop token or stop string), 'length' (max_new_tokens) or 'abort'."""
    policy_version: int
    """Version of the weights that produced every token of this response."""
    prefill_s: float = field(default=0.0, compare=False)
    """Engine seconds spent prefilling this prompt, its share of each prefill pass it took part in (by prompt
    tokens prefilled; the embedded engine: `engine._decode`); 0 where the backend does not measure it."""
    decode_s: float = field(default=0.0, compare=False)
    """Engine seconds spent decoding this response, its share of each decode step it took part in (an equal
    share of the step per row); 0 where the backend does not measure it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        object.__setattr__(self, "logprobs", tuple(float(x) for x in self.logprobs))
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"Generation has {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs; "
                "a backend must return one logprob per sampled token"
            )


@dataclass(frozen=True)
class Turn:
    """One LLM call made by one node during an episode: one training sample."""

    agent: str
    """The agent the call was attributed to (drmas_agent metadata > `agent:<name>` entry > `agents` glob > node
    path)."""
    node: str
    """Node path; a node inside a subgraph is 'outer/inner'."""
    step: int
    """LangGraph superstep (`langgraph_step`) of the node that made the call; -1 outside a node."""
    index: int
    """Position of this call in the episode, in the order calls started (0-based)."""
    messages: tuple[BaseMessage, ...]
    """The prompt as LangChain messages."""
    prompt_ids: tuple[int, ...]
    """Exactly the token ids the policy saw (chat template applied); empty when not trainable."""
    response_ids: tuple[int, ...]
    """The sampled token ids, never re-tokenized text; empty when not trainable."""
    response_logprobs: tuple[float, ...]
    """One logprob per response id, log_softmax(logits / temperature) at sampling time."""
    response_text: str
    """The response decoded from response_ids (special tokens skipped); the model's text if not trainable."""
    tool_calls: tuple[dict, ...] = ()
    """Tool calls parsed from the response, LangChain style: {'name', 'args', 'id', 'type'}."""
    finish_reason: str = "stop"
    """'stop', 'length', 'tool_calls' or 'abort'."""
    policy: str | None = None
    """Name of the policy that served the call; None when the app's own model served it."""
    policy_version: int | None = None
    """Weights version that produced the response."""
    trainable: bool = True
    """False when the call was served by the app's original model (no policy for its agent)."""
    latency_s: float = 0.0
    """Wall time of the call, rendering and parsing included."""
    call_key: str = ""
    """Node instance the call came from: the node path, plus '[i]' for the i-th `Send` to that node."""
    node_call_index: int = 0
    """Position of this call among the calls of the same call_key, in arrival order (replay matches calls by
    both; calls one node instance makes concurrently are matched by prompt, and their seeds do not depend on
    this index, so it is the one identity field that follows thread timing)."""
    sampling: SamplingParams | None = None
    """The sampling parameters used (the trainer needs the temperature to recompute logprobs)."""
    tools: tuple[dict, ...] = ()
    """Tool schemas bound to the model for this call (OpenAI function format)."""
    message_id: str | None = None
    """Id of the AIMessage returned to the node (replay returns the same id, so states compare equal)."""
    response_format: dict | None = None
    """Structured output the call asked for and the prompt carried (`with_structured_output`, a forced
    `tool_choice`): {'type': 'json_schema'|'tool', 'name', 'schema'}, {'type': 'json_object'} or
    {'type': 'any_tool', 'names'}; None for free text. `Policy.render(messages, tools, response_format)`
    reproduces prompt_ids."""
    format_error: str | None = None
    """Why the reply is not what the call asked for: not the JSON a structured-output call asked for, or a
    tool call (tools bound) that does not parse; None when it is. Training counts such a turn as invalid."""
    agent_name: str | None = None
    """LangChain agent name of the run that made the call (`lc_agent_name` metadata: `create_agent(name=...)`,
    a Deep Agents agent or sub-agent); None outside a named agent."""
    segment: int = 0
    """Which run of the episode's thread made the call: its position in `Episode.segments` (0 = the first
    run; later ones answer an interrupt or continue a conversation)."""
    tool_parser: str | None = None
    """The policy's tool parser that read the reply (`Policy.tool_parser`: 'hermes', 'mistral', 'none'; replay reads
    the recorded reply with it); None when the app's own model served the call, or when the store predates it."""
    call_sampling: dict | None = None
    """The sampling parameters the call itself passed that a policy honours: {'stop': [...], 'max_tokens': int or
    None} (replay compares them); None when the store predates it."""

    @property
    def n_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def n_response_tokens(self) -> int:
        return len(self.response_ids)


@dataclass(frozen=True)
class Segment:
    """One run of an episode's thread. An episode is several runs when the environment answers the graph's
    `interrupt()`s (`Command(resume=...)`) or plays the user of a conversation (the next input)."""

    kind: str
    """'start' (the episode's first run), 'resume' (it answered interrupts) or 'input' (the next user input)."""
    input: Any = None
    """What the thread was run with: the `Command(resume=...)` or the next graph input; None for 'start',
    which ran on `Episode.input`."""
    interrupts: tuple[dict, ...] = ()
    """The interrupts the run stopped at, each {'node': node path, 'id', 'value'}; empty when it finished."""


@dataclass
class Episode:
    """One run of the whole graph on one input. Mutable: training fills rewards and advantages."""

    id: str = field(default_factory=new_id)
    """Unique id of the episode."""
    task_id: str | None = None
    """Stable id of the task (graph input) this episode ran on."""
    group_id: str | None = None
    """Episodes of the same task rolled out together share a group id (GRPO's group)."""
    input: Any = None
    """The graph input the episode ran on (replay runs the graph on it again)."""
    turns: list[Turn] = field(default_factory=list)
    """Every LLM call, in the order the calls started."""
    final_state: Any = None
    """The graph's output (what graph.invoke returned); of a run that raised (truncated, a model error, failed), its
    state as of its last completed superstep (None when it raised before any)."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Reward per agent (a team reward is stored under every agent); filled by training."""
    turn_rewards: list[float] | None = None
    """Per-turn reward R_i (team reward minus invalid-turn penalty), aligned with turns; filled by training."""
    advantages: list[float] | None = None
    """Per-turn advantage, aligned with turns; filled by training."""
    error: str | None = None
    """Set when the run failed: the exception type and message."""
    timings: dict[str, Any] = field(default_factory=dict)
    """'start' and 'end' (unix time), 'wall_s', 'llm_s' (sum of call latencies), 'turn_starts' (unix start of each turn);
    'engine': {agent: {'prefill_s', 'decode_s'}}, the engine seconds of the agent's calls (`Generation.prefill_s`,
    `decode_s`), where its policy measures them (the embedded engine)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form extras (the input, the run config's thread id, the training step, `group_index`: its position in
    its GRPO group, ...)."""
    truncated: str | None = None
    """'<limit>: <why>' when a limit stopped the run before its end (limit: max_llm_calls, timeout_s or
    recursion_limit); its turns are kept, rewarded and trained on. None when it ran to its end."""
    model_error: str | None = None
    """'turn <i> (agent, node): <exception>' when the policy's own output broke the app (a reply that is not the
    JSON a structured-output call asked for, an unparsable output, tool arguments that fail the tool's
    schema); the episode is kept with `rollout.model_error_reward`. None otherwise."""
    model_error_turn: int | None = None
    """Position in `turns` of the turn whose output caused `model_error` (training counts it as invalid)."""
    judgement: dict[str, Any] | None = None
    """What a judge model made of the episode when its reward came from one (`drmas_graph.rewards.Judge`): the
    mode, the judge's prompt, raw replies, parsed scores and reasons, attempts, tokens, whether it came from
    the cache, and the error if the judge failed. None when no judge scored it."""
    segments: list[Segment] = field(default_factory=list)
    """Every run of the episode's thread, in order, when there was more than one or the last one stopped at
    an interrupt; empty for an episode that ran once to the end."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def outcome(self) -> str:
        """'finished', 'truncated' (a limit stopped it), 'model_error' (the policy's output broke the app) or
        'failed' (anything else: not trained on)."""
        if self.error is not None:
            return "failed"
        return "truncated" if self.truncated else "model_error" if self.model_error else "finished"

    @property
    def truncated_by(self) -> str | None:
        """The limit that truncated the episode (the part of `truncated` before ':'); None if not truncated."""
        return self.truncated.split(":", 1)[0] if self.truncated else None

    @property
    def stop_reason(self) -> str | None:
        """Why the run did not finish normally (`error`, `truncated` or `model_error`); None if it did."""
        return self.error or self.truncated or self.model_error

    def by_agent(self) -> dict[str, list[Turn]]:
        """Turns grouped by agent, each list in call order; agents in order of first call."""
        out: dict[str, list[Turn]] = {}
        for turn in self.turns:
            out.setdefault(turn.agent, []).append(turn)
        return out

    def trainable_turns(self) -> list[Turn]:
        return [t for t in self.turns if t.trainable]

    @property
    def agents(self) -> list[str]:
        return list(self.by_agent())

    def _start_clock(self) -> None:
        self.timings["start"] = time.time()

    def _stop_clock(self) -> None:
        end = time.time()
        self.timings["end"] = end
        self.timings["wall_s"] = end - self.timings.get("start", end)
        self.timings["llm_s"] = sum(t.latency_s for t in self.turns)


@dataclass(frozen=True)
class Sample:
    """One trainable LLM call, ready for a policy-gradient update."""

    prompt_ids: tuple[int, ...]
    """Prompt token ids, exactly as the policy saw them."""
    response_ids: tuple[int, ...]
    """Sampled response token ids."""
    old_logprobs: tuple[float, ...]
    """Logprobs recorded at rollout time, log_softmax(logits / temperature); the importance-ratio baseline."""
    advantage: float
    """Scalar advantage, broadcast over the response tokens."""
    agent: str
    """Agent that made the call (per-agent loss settings and metrics key on it)."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy, treated as 1): the trainer divides logits by it."""
    episode_id: str = ""
    """Episode the call belongs to."""
    turn_index: int = 0
    """Position of the call in its episode."""
    behaviour_logprobs: tuple[float, ...] | None = None
    """Logprobs of the older weights that sampled the response (asynchronous training: pi_behav of the off-policy
    correction, `drmas_graph.train.optim.offpolicy`); None when the trainer's own weights sampled it."""
    grammar: str | None = None
    """The grammar the response was decoded under (`SamplingParams.grammar`): the update computes every logprob
    under the masks it gives the response's positions. None: unconstrained."""

    @staticmethod
    def from_turn(turn: Turn, advantage: float, episode_id: str = "") -> Sample:
        temperature = turn.sampling.temperature if turn.sampling is not None else 1.0
        return Sample(prompt_ids=turn.prompt_ids, response_ids=turn.response_ids,
                      old_logprobs=turn.response_logprobs, advantage=float(advantage), agent=turn.agent,
                      temperature=temperature or 1.0, episode_id=episode_id, turn_index=turn.index,
                      grammar=turn.sampling.grammar if turn.sampling is not None else None)
