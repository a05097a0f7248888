"""Prefix-shared packing: the samples of a micro-batch as one sequence tree, each distinct prefix computed once.

Samples of one model share token prefixes: the G samples of a GRPO group share their prompt, and an agent's
turn k holds its earlier turns in its prompt. The trie of a micro-batch's token sequences (prompt + response)
has one node per distinct prefix. Laid out as one row of N nodes in depth-first order, each node at position id
= its depth and seeing exactly its ancestors and itself (a 4D attention mask), a causal LM computes at every node
the hidden state that each sample through it has at that position; response token t of sample b is predicted by
node path_b[P_b - 1 + t]. So logprobs, losses and gradients are those of the separate samples (up to float
summation order), for the cost of N tokens instead of B x L padded ones.

In depth-first (pre)order node j's subtree is the interval [j, end_j), so the mask is two comparisons:

    allowed[i, j] = (j <= i) and (i < end_j)          (j is an ancestor of i, or i itself)

Memory: a packed micro-batch holds at most N_max = sqrt(budget x L) nodes, where L is the longest sample and
budget the tokens an unpacked micro-batch may hold (``max_tokens_per_micro_batch``, else micro_batch_size x L):
then its activations (~N) and attention scores (~N^2) never exceed those of the unpacked micro-batch
(B x L <= budget and B x L^2 <= budget x L).

Models: the mask goes through the model's own ``attention_mask`` argument, which Hugging Face models take as
given when it is 4D: boolean for "sdpa", additive (0 / dtype min) for "eager". `check_packing` probes a module
with the attention kernel it trains with (a packed row of up to `PROBE_NODES` nodes against its sequences
unpacked; one process probes only as long a row as its packed rows need, `PackingProbes`)
and names the reason when it cannot take it (another attention kernel, attention windows named in its config,
a model that builds its own mask); the updater then trains on padded rows. A window is a number of row
positions (GPT-Neo's local layers build it from the row index), and in a packed row a sample's prompt can lie
far to the left of its response, so a packed row of several samples holds at most the probe's nodes
(`Packing.max_nodes`): a window the probe did not detect is longer than any such row. A sample longer than that
is computed alone on a padded row.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from drmas_graph.types import Sample

__all__ = ["MASK_KINDS", "Packing", "PackingProbes", "SequenceTree", "build_tree", "check_packing", "max_nodes",
           "pack_by_tokens", "pack_rows", "row_nodes", "tree_inputs", "trie_nodes"]

log = logging.getLogger(__name__)

MASK_KINDS = {"sdpa": "bool", "eager": "additive"}
"""Attention implementation -> the 4D mask format it takes."""


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def max_nodes(longest: int, budget: int) -> int:
    """N_max = floor(sqrt(budget x L)), at least L: a packed micro-batch's tokens (~N) and attention scores
    (~N^2) stay within those of an unpacked one of ``budget`` tokens whose rows are at most L long."""
    return max(longest, math.isqrt(budget * longest))


def pack_rows(rows: Sequence[int], sequences: Sequence[Sequence[int]], limit: int) -> list[list[int]]:
    """``rows`` in lexicographic order of their token sequences (so samples sharing a prefix are neighbours, and
    a sequence shares most with the one just before it), cut greedily into groups whose trie has at most
    ``limit`` nodes; a sequence longer than ``limit`` gets a group of its own."""
    order = sorted(range(len(rows)), key=lambda k: tuple(sequences[k]))
    out: list[list[int]] = []
    size, previous = 0, None
    for k in order:
        seq = sequences[k]
        added = len(seq) - (_common_prefix(previous, seq) if previous is not None else 0)
        if out and size + added <= limit:
            out[-1].append(rows[k])
            size += added
        else:
            out.append([rows[k]])
            size = len(seq)
        previous = seq
    return out


def pack_by_tokens(rows: Sequence[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Padded micro-batches (packing off): rows sorted by length (longest first), cut so that each micro-batch's
    padded size, rows x longest, stays within ``budget`` tokens; a sample longer than the budget gets its own."""
    order = sorted(range(len(rows)), key=lambda k: -lengths[k])
    out: list[list[int]] = []
    for k in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:  # out[-1][0] is its longest row
            out[-1].append(k)
        else:
            out.append([k])
    return [[rows[k] for k in group] for group in out]


@dataclass(frozen=True)
class SequenceTree:
    """The trie of some token sequences, its nodes in depth-first order (children by token)."""

    tokens_N: list[int]
    """Token of each node."""
    depth_N: list[int]
    """Depth of each node = its position id (0 for a first token)."""
    end_N: list[int]
    """One past the last node of each node's subtree: node j's subtree is [j, end_j)."""
    paths: list[list[int]]
    """Per sequence (in the order given): the node of each of its tokens."""


def build_tree(sequences: Sequence[Sequence[int]]) -> SequenceTree:
    """The trie of ``sequences``; inserting them in lexicographic order numbers the nodes depth-first."""
    children: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    depth: list[int] = []
    paths: list[list[int]] = [[] for _ in sequences]
    for s in sorted(range(len(sequences)), key=lambda k: tuple(sequences[k])):
        node = -1
        for d, token in enumerate(sequences[s]):
            key = (node, int(token))
            if key not in children:
                children[key] = len(tokens)
                tokens.append(int(token))
                depth.append(d)
            node = children[key]
            paths[s].append(node)
    end = [len(tokens)] * len(tokens)
    open_nodes: list[int] = []  # the current root-to-node path while scanning in order
    for i, d in enumerate(depth):
        while open_nodes and depth[open_nodes[-1]] >= d:
            end[open_nodes.pop()] = i
        open_nodes.append(i)
    return SequenceTree(tokens_N=tokens, depth_N=depth, end_N=end, paths=paths)


def tree_inputs(tree: SequenceTree, *, mask_kind: str, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """The forward kwargs of one packed row: input_ids and position_ids [1, N], the 4D attention mask
    [1, 1, N, N] (`MASK_KINDS` format), built on ``device``."""
    n = len(tree.tokens_N)
    index_N = torch.arange(n, device=device)
    end_N = torch.tensor(tree.end_N, device=device)
    allowed_NN = (index_N[None, :] <= index_N[:, None]) & (index_N[:, None] < end_N[None, :])
    if mask_kind == "bool":
        mask_NN = allowed_NN
    else:
        mask_NN = torch.zeros((n, n), dtype=dtype, device=device).masked_fill_(~allowed_NN, torch.finfo(dtype).min)
    return {"input_ids": torch.tensor([tree.tokens_N], dtype=torch.long, device=device),
            "position_ids": torch.tensor([tree.depth_N], dtype=torch.long, device=device),
            "attention_mask": mask_NN[None, None]}


# --- can this model take the mask? ---------------------------------------------------------------------------

PROBE_NODES = {"cuda": 4096}
"""Device type -> nodes of the packing probe's row (`check_packing`), else `PROBE_NODES_DEFAULT` (at most the
model's positions): packed rows of several samples never hold more nodes than the probe did. An attention window
the probe did not see is at least this long, so it never hides a node's ancestor within such a row. (On CPU an
sdpa probe of 2048 nodes costs a tiny model ~0.2 s; a larger probe would allow longer rows.)"""
PROBE_NODES_DEFAULT = 2048
PROBE_NODES_MIN = 256
"""The shortest probe row (`check_packing` with ``nodes``): a single process probes a module only as far as its
packed rows need, from this length up, doubling (`PackingProbes`). On CPU the full probe of a 135M model costs
~11 s; one of 256 nodes ~0.5 s."""
_FULL_LAYER_TYPES = frozenset({"full_attention", "global", "full", "attention"})


@dataclass(frozen=True)
class Packing:
    """Whether and how one module takes packed rows: what `check_packing` found."""

    mask_kind: str | None
    """The packed rows' attention-mask format (`MASK_KINDS`); None = padded rows."""
    reason: str
    """Why it trains on padded rows ("" when it packs)."""
    max_nodes: int
    """The most nodes a packed row of several samples may hold: the probe's row length (0 when it does not pack)."""
    kernel: str | None
    """The attention implementation it was probed with (a packing found for one kernel says nothing of another)."""
    most_nodes: int = 0
    """The most nodes any probe of this module can prove (its device's `PROBE_NODES`, at most its positions; 0 when
    it does not pack): a `max_nodes` below it can be raised by probing again with a longer row."""


def _windows(config: Any) -> list[str]:
    """The config's attention windows, found by name: any positive ``*window*`` or ``attention_chunk*`` value
    (sliding_window, window_size, attention_window, Llama 4's attention_chunk_size, ...; not when
    ``use_sliding_window`` is false) and any layer type other than full/global in ``layer_types``,
    ``attention_layers``, ``attention_types`` (GPT-Neo's local layers, Gemma's sliding ones); in the language
    model's sub-config (``text_config``, ...) too, not in a vision encoder's."""
    values = config.to_dict() if callable(getattr(config, "to_dict", None)) else {}
    found: list[str] = []

    def scan(d: Mapping[str, Any], where: str) -> None:
        windows_used = d.get("use_sliding_window", True) is not False
        for key, value in d.items():
            key = str(key)  # (id2label has int keys)
            if isinstance(value, Mapping):
                if any(k in key.lower() for k in ("text", "language", "llm")):
                    scan(value, f"{where}{key}.")
            elif any(k in key.lower() for k in ("window", "attention_chunk")) and windows_used and _positive(value):
                found.append(f"{where}{key}={value!r}")
            elif any(k in key.lower() for k in ("layer_types", "attention_layers", "attention_types")):
                local = sorted({t for t in _strings(value) if t.lower() not in _FULL_LAYER_TYPES})
                if local:
                    found.append(f"{where}{key} has {local}")

    scan(values, "")
    return found


def _positive(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (list, tuple)):
        return any(_positive(v) for v in value)
    return isinstance(value, (int, float)) and value > 0


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def _max_positions(config: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _probe(n_nodes: int, vocab: int) -> list[list[int]]:
    """Two sequences whose trie is one row of ``n_nodes`` nodes: a 4-token prefix, then a long branch (the first
    sequence, ``n_nodes - 4`` tokens) and a short one of 4 tokens (the second) at the end of the row. In the row the
    short branch's first node lies ``n_nodes - 7`` positions after the last prefix token (in its own sequence:
    1), so a window of at most that many row positions hides the whole prompt from it; the long branch is as long
    as the row allows, so a window that a custom mask would replace shows in it (when it is shorter)."""
    tokens = [3 + (7 * k) % max(vocab - 3, 1) for k in range(n_nodes)]  # not 0-2 (often pad/bos/eos)
    prefix, long_branch, short_branch = tokens[:4], tokens[4:n_nodes - 4], tokens[n_nodes - 4:]
    short_branch[0] = (long_branch[0] + 1 - 3) % max(vocab - 3, 1) + 3  # branches differ at their first token
    return [prefix + long_branch, prefix + short_branch]


def trie_nodes(sequences: Sequence[Sequence[int]]) -> int:
    """The number of nodes of the trie of ``sequences`` (`build_tree`): the most a packed row of them can hold."""
    ordered = sorted(map(tuple, sequences))
    return sum(len(seq) - (_common_prefix(prev, seq) if prev is not None else 0)
               for prev, seq in zip([None, *ordered[:-1]], ordered))


def row_nodes(samples: Sequence[Sample], budget: Callable[[str, int], int]) -> int:
    """The most nodes a packed row of ``samples`` can hold (what their probe must prove): per agent, `max_nodes` of
    its longest sample and ``budget(agent, longest)`` tokens, at most the trie of all the agent's samples."""
    by_agent: dict[str, list[Sample]] = {}
    for s in samples:
        by_agent.setdefault(s.agent, []).append(s)
    most = 0
    for agent, mine in by_agent.items():
        sequences = sequences_of(mine)
        longest = max(map(len, sequences))
        most = max(most, min(max_nodes(longest, budget(agent, longest)), trie_nodes(sequences)))
    return most


def _probe_length(nodes: int | None, most: int) -> int:
    """The probe row for packed rows of ``nodes`` nodes: the smallest power of 2 from PROBE_NODES_MIN that holds
    them (the probe proves 6 fewer than its length), at most ``most``; None: ``most``."""
    if nodes is None:
        return most
    n = PROBE_NODES_MIN
    while n < nodes + 6:
        n *= 2
    return min(n, most)


@torch.no_grad()
def check_packing(model: torch.nn.Module, nodes: int | None = None) -> Packing:
    """Whether ``model``, with its current attention implementation, computes a packed tree exactly as it computes
    the separate sequences. Refused: another attention kernel, an attention window in its config (`_windows`), a
    forward pass that refuses the inputs, and a probe row (`_probe`, `PROBE_NODES` long, at most the model's
    positions) whose packed logits differ from the unpacked ones (a window of row positions the config does not
    name, a mask or position ids the model ignores). The row length it proves is `Packing.max_nodes`. ``nodes``:
    prove rows of at least that many nodes, with a shorter probe where that suffices (`_probe_length`); None:
    the longest probe."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)

    def refused(reason: str) -> Packing:
        return Packing(mask_kind=None, reason=reason, max_nodes=0, kernel=impl)

    if impl not in MASK_KINDS:
        return refused(f"its attention implementation is {impl!r}; a tree mask needs one of {sorted(MASK_KINDS)} "
                       "(update.attn_implementation)")
    windows = _windows(config)
    if windows:
        return refused(f"it has local (windowed) attention layers ({', '.join(windows)}), whose window a packed row "
                       "would move or replace")
    param = next(model.parameters())
    vocab = getattr(config, "vocab_size", None) or 8
    most = PROBE_NODES.get(param.device.type, PROBE_NODES_DEFAULT)
    most = max(12, min(most, _max_positions(config) or most))
    n_nodes = max(12, _probe_length(nodes, most))
    sequences = _probe(n_nodes, vocab)
    tree = build_tree(sequences)
    was_training = model.training
    model.eval()
    try:
        packed = model(**tree_inputs(tree, mask_kind=MASK_KINDS[impl], dtype=param.dtype, device=param.device),
                       use_cache=False).logits[0].float()
        plain = [model(input_ids=torch.tensor([s], device=param.device), use_cache=False).logits[0].float()
                 for s in sequences]
    except (TypeError, ValueError, RuntimeError, IndexError) as exc:
        return refused(f"its forward pass refused the packed inputs ({type(exc).__name__}: {exc})")
    finally:
        model.train(was_training)
    gap = max((packed[tree.paths[s]] - plain[s]).abs().max().item() for s in range(2))
    scale = max(p.abs().max().item() for p in plain) + 1e-6
    tolerance = 1e-4 if param.dtype == torch.float32 else 2e-2
    if not gap <= tolerance * scale:
        return refused(f"its logits on a packed probe of {n_nodes} nodes differ from the unpacked ones by {gap:.3g} "
                       "(an attention window of row positions, or it ignores the 4D attention mask or the position "
                       "ids)")
    return Packing(mask_kind=MASK_KINDS[impl], reason="", max_nodes=n_nodes - 6, kernel=impl, most_nodes=most - 6)


class PackingProbes:
    """`check_packing` of each module an updater computes on, probed at its first use, again after its attention
    kernel changed, and again with a longer row when packed rows need more nodes than it proved (``grow``), so a
    probe result is only ever used on the module (and kernel) it was found on, for rows no longer than its probe.
    The reason a module trains on padded rows is logged once.

    ``grow`` False (several processes): every module gets the longest probe at once. A forward pass of a
    ZeRO-3-sharded model is a collective call, so a probe must not depend on one process's samples."""

    def __init__(self, name: str, *, grow: bool = True) -> None:
        self.name = name
        self.grow = grow
        self._found: weakref.WeakKeyDictionary[torch.nn.Module, Packing] = weakref.WeakKeyDictionary()

    def of(self, module: torch.nn.Module, nodes: int = 0) -> Packing:
        """How ``module`` takes packed rows of up to ``nodes`` nodes (as far as its device's probe length allows:
        `Packing.max_nodes` may be lower; rows are cut to it)."""
        kernel = getattr(getattr(module, "config", None), "_attn_implementation", None)
        found = self._found.get(module)
        short = found is not None and found.mask_kind is not None and found.max_nodes < min(nodes, found.most_nodes)
        if found is None or found.kernel != kernel or short:
            found = self._found[module] = check_packing(module, nodes if self.grow else None)
            if found.reason:
                log.warning("model %r: prefix-shared packing is off because %s; training on padded rows "
                            "(update.pack_prefixes: false silences this)", self.name, found.reason)
        return found


def sequences_of(samples: Sequence[Sample]) -> list[tuple[int, ...]]:
    """Each sample's prompt + response token ids."""
    return [tuple(s.prompt_ids) + tuple(s.response_ids) for s in samples]
