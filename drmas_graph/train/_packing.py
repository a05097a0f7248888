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
given when it is 4D: boolean for "sdpa", additive (0 / dtype min) for "eager". `check_packing` runs a probe at
start-up (a packed pair of sequences against the same sequences unpacked) and names the reason when a model
cannot take it (another attention kernel, sliding-window layers, a model that builds its own mask); the
updater then trains on padded rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from drmas_graph.types import Sample

__all__ = ["MASK_KINDS", "SequenceTree", "build_tree", "check_packing", "max_nodes", "pack_rows", "tree_inputs"]

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


def _sliding_window(config: Any) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return any(t != "full_attention" for t in layer_types)
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True) is not False


@torch.no_grad()
def check_packing(model: torch.nn.Module) -> tuple[str | None, str]:
    """(mask kind, "") when ``model`` computes a packed tree exactly as it computes the separate sequences,
    else (None, the reason). Probe: two sequences sharing 3 tokens, packed (7 nodes) and as padded rows."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in MASK_KINDS:
        return None, (f"its attention implementation is {impl!r}; a tree mask needs one of {sorted(MASK_KINDS)} "
                      "(update.attn_implementation)")
    if _sliding_window(config):
        return None, "it has sliding-window attention layers, whose window a custom mask would replace"
    param = next(model.parameters())
    vocab = getattr(config, "vocab_size", None) or 8
    a, b = [1, 2, 3, 4, 5], [1, 2, 3, 6, 7]
    sequences = [[t % vocab for t in a], [t % vocab for t in b]]
    tree = build_tree(sequences)
    was_training = model.training
    model.eval()
    try:
        packed = model(**tree_inputs(tree, mask_kind=MASK_KINDS[impl], dtype=param.dtype, device=param.device),
                       use_cache=False).logits[0].float()
        plain = model(input_ids=torch.tensor(sequences, device=param.device), use_cache=False).logits.float()
    except (TypeError, ValueError, RuntimeError) as exc:
        return None, f"its forward pass refused the packed inputs ({type(exc).__name__}: {exc})"
    finally:
        model.train(was_training)
    gap = max((packed[tree.paths[s]] - plain[s]).abs().max().item() for s in range(2))
    scale = plain.abs().max().item() + 1e-6
    tolerance = 1e-4 if param.dtype == torch.float32 else 2e-2
    if not gap <= tolerance * scale:
        return None, (f"its logits on a packed probe differ from the unpacked ones by {gap:.3g} (it ignores the "
                      "4D attention mask or the position ids)")
    return MASK_KINDS[impl], ""


def sequences_of(samples: Sequence[Sample]) -> list[tuple[int, ...]]:
    """Each sample's prompt + response token ids."""
    return [tuple(s.prompt_ids) + tuple(s.response_ids) for s in samples]
