"""Logprobs (and entropy) of the response tokens of a micro-batch, from a causal LM, two ways.

- full logits (``chunk_tokens=0``): the model's own forward returns logits at every position, [B, L, V];
  the response positions are gathered. Simple, and the only way for models whose logits are not
  ``lm_head(last hidden state)`` (logit soft-capping, logit scales).
- chunked (``chunk_tokens=C``): the forward stops at the last hidden states (``logits_to_keep=1``); the LM
  head runs only on the valid response tokens, C of them at a time, and each chunk runs under activation
  checkpointing, so its [C, V] float32 logits are freed after the forward and recomputed in the backward.
  Peak memory of the head: C x V floats instead of B x L x V (float32 logits at V = 152k, L = 4k are
  2.4 GB per sequence). Entropy is computed only when asked (its coefficient is > 0).

Both give the same numbers (`token_logprobs` and `entropy_from_logits` on the same logits / T rows), on padded
rows (`collate`) or on one packed row of the samples' trie (`collate_packed`). A sample decoded under a grammar
(`Sample.grammar`) has its logits masked by the grammar at each response position (rebuilt from its tokens,
`drmas_graph.grammar.Grammars.masks`) before the log-softmax: the logprobs of the distribution it was drawn from.
Axes: _B samples, _L prompt+response positions, _T response tokens, _N valid response tokens, _H hidden, _V vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from drmas_graph.errors import ConfigError
from drmas_graph.grammar import Grammars, mask_logits
from drmas_graph.train.optim._packing import build_tree, sequences_of, tree_inputs
from drmas_graph.train.optim.losses import entropy_from_logits, token_logprobs
from drmas_graph.types import Sample

__all__ = ["Batch", "check_chunked_head", "collate", "collate_packed", "response_token_stats", "take_rows"]


@dataclass(frozen=True)
class Batch:
    """A micro-batch of one agent: the model's forward inputs and, per sample b, its response tokens.

    The inputs are right-padded rows (row b = prompt + response of sample b, `collate`) or one packed row
    holding the trie of all the samples (`collate_packed`, `drmas_graph.train.optim._packing`).
    """

    agent: str
    inputs: Mapping[str, torch.Tensor]
    """Forward kwargs: input_ids [R, L] and attention_mask ([R, L], or [1, 1, N, N] packed), position_ids if packed."""
    logit_index_BT: torch.Tensor
    """Flat position (row x L + column) whose logits predict response token t of sample b (0 at padding)."""
    response_ids_BT: torch.Tensor
    old_logprobs_BT: torch.Tensor
    mask_BT: torch.Tensor
    advantages_B: torch.Tensor
    temperatures_B: torch.Tensor
    bitmask_BTW: torch.Tensor | None = None
    """The grammar masks of the response tokens (int32 bitmask, `drmas_graph.grammar`; every bit set for the tokens
    of an unconstrained sample and at padding); None when no sample of the micro-batch was decoded under one."""

    @property
    def n_tokens(self) -> int:
        return int(self.mask_BT.sum())

    @property
    def n_positions(self) -> int:
        """Token positions the forward pass computes (padding included)."""
        return int(self.inputs["input_ids"].numel())


def _bitmasks(samples: Sequence[Sample], T: int, grammars: Grammars | None) -> torch.Tensor | None:
    """[B, T, W] grammar masks of the samples' response tokens, rebuilt from their grammars (None: none has one)."""
    if all(s.grammar is None for s in samples):
        return None
    if grammars is None:
        agents = sorted({s.agent for s in samples if s.grammar is not None})
        raise ConfigError(f"samples of agent(s) {agents} were decoded under a grammar, but this updater was built "
                          "without the policy's grammars (build_updater(..., grammars=policy.grammars)): their "
                          "logprobs cannot be computed under the masks they were sampled with")
    bitmask_BTW = grammars.bitmask(len(samples) * T).view(len(samples), T, -1)
    for b, s in enumerate(samples):
        if s.grammar is not None:
            bitmask_BTW[b, :len(s.response_ids)] = grammars.masks(s.grammar, s.response_ids)
    return bitmask_BTW


def _per_sample(samples: Sequence[Sample], device: torch.device, pad_id: int,
                grammars: Grammars | None) -> dict[str, torch.Tensor | None]:
    """The [B, T] / [B] tensors of `Batch` that do not depend on the layout, T = the longest response."""
    B, T = len(samples), max(1, max(len(s.response_ids) for s in samples))
    response_ids_BT = torch.full((B, T), pad_id, dtype=torch.long)
    old_logprobs_BT = torch.zeros((B, T), dtype=torch.float32)
    mask_BT = torch.zeros((B, T), dtype=torch.bool)
    for b, s in enumerate(samples):
        R = len(s.response_ids)
        response_ids_BT[b, :R] = torch.tensor(s.response_ids, dtype=torch.long)
        old_logprobs_BT[b, :R] = torch.tensor(s.old_logprobs, dtype=torch.float32)
        mask_BT[b, :R] = True
    bitmask_BTW = _bitmasks(samples, T, grammars)
    return {"response_ids_BT": response_ids_BT.to(device), "old_logprobs_BT": old_logprobs_BT.to(device),
            "mask_BT": mask_BT.to(device), "bitmask_BTW": None if bitmask_BTW is None else bitmask_BTW.to(device),
            "advantages_B": torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=device),
            "temperatures_B": torch.tensor([s.temperature or 1.0 for s in samples], dtype=torch.float32,
                                           device=device)}


def collate(samples: Sequence[Sample], *, pad_id: int, device: torch.device, grammars: Grammars | None = None
            ) -> Batch:
    """Right-padded rows, one per sample (`grammars`: those of the policy, for samples decoded under one)."""
    B = len(samples)
    L = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    T = max(1, max(len(s.response_ids) for s in samples))
    input_ids_BL = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask_BL = torch.zeros((B, L), dtype=torch.long)
    logit_index_BT = torch.zeros((B, T), dtype=torch.long)
    for b, s in enumerate(samples):
        P, R = len(s.prompt_ids), len(s.response_ids)
        input_ids_BL[b, : P + R] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attention_mask_BL[b, : P + R] = 1
        logit_index_BT[b] = b * L + (P - 1 + torch.arange(T)).clamp(max=L - 1)
    return Batch(agent=samples[0].agent, inputs={"input_ids": input_ids_BL.to(device),
                                                 "attention_mask": attention_mask_BL.to(device)},
                 logit_index_BT=logit_index_BT.to(device), **_per_sample(samples, device, pad_id, grammars))


def collate_packed(samples: Sequence[Sample], *, pad_id: int, device: torch.device, mask_kind: str,
                   dtype: torch.dtype, grammars: Grammars | None = None) -> Batch:
    """One packed row: the trie of the samples' prompt + response sequences (`drmas_graph.train.optim._packing`)."""
    tree = build_tree(sequences_of(samples))
    T = max(1, max(len(s.response_ids) for s in samples))
    logit_index_BT = torch.zeros((len(samples), T), dtype=torch.long)
    for b, (s, path) in enumerate(zip(samples, tree.paths)):
        P, R = len(s.prompt_ids), len(s.response_ids)
        logit_index_BT[b, :R] = torch.tensor(path[P - 1: P - 1 + R], dtype=torch.long)
    return Batch(agent=samples[0].agent, inputs=tree_inputs(tree, mask_kind=mask_kind, dtype=dtype, device=device),
                 logit_index_BT=logit_index_BT.to(device), **_per_sample(samples, device, pad_id, grammars))


def response_token_stats(forward: Callable[..., Any], batch: Batch, *, lm_head: torch.nn.Module | None,
                         chunk_tokens: int, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs_BT, entropy_BT or None) of the response tokens under log softmax(logits / T), float32.

    ``forward`` runs the model (the DeepSpeed engine or the module); ``lm_head`` is the model's output
    embedding, required when ``chunk_tokens > 0``. Values at padded positions are 0.
    """
    masked = batch.bitmask_BTW is not None
    if chunk_tokens == 0:
        logits_BTV = _response_logits(forward, batch)
        if masked:
            logits_BTV = mask_logits(logits_BTV, batch.bitmask_BTW)
        entropy_BT = entropy_from_logits(logits_BTV, masked=masked) if with_entropy else None
        return token_logprobs(logits_BTV, batch.response_ids_BT), entropy_BT
    out = forward(**batch.inputs, use_cache=False, logits_to_keep=1, output_hidden_states=True)
    hidden_BLH = out.hidden_states[-1]
    del out
    mask_BT = batch.mask_BT
    hidden_NH = take_rows(hidden_BLH.reshape(-1, hidden_BLH.shape[-1]), batch.logit_index_BT[mask_BT])
    ids_N = batch.response_ids_BT[mask_BT]
    temps_N = batch.temperatures_B[:, None].expand_as(mask_BT)[mask_BT]
    bitmask_NW = batch.bitmask_BTW[mask_BT] if masked else None
    logprobs, entropies = [], []
    # no response token (only empty responses): one empty chunk, so the result still hangs on the model and the
    # LM head, and the micro-batch backpropagates 0 as on the full-logits path
    for start in range(0, max(ids_N.shape[0], 1), chunk_tokens):
        piece = slice(start, start + chunk_tokens)
        args = (lm_head, hidden_NH[piece], ids_N[piece], temps_N[piece], with_entropy,
                None if bitmask_NW is None else bitmask_NW[piece])
        if torch.is_grad_enabled() and hidden_NH.requires_grad:
            logprob_C, entropy_C = checkpoint(_head_chunk, *args, use_reentrant=False)
        else:
            logprob_C, entropy_C = _head_chunk(*args)
        logprobs.append(logprob_C)
        entropies.append(entropy_C)
    logprobs_BT = _scatter(mask_BT, logprobs)
    entropy_BT = _scatter(mask_BT, entropies) if with_entropy else None
    return logprobs_BT, entropy_BT


def _head_chunk(lm_head: torch.nn.Module, hidden_CH: torch.Tensor, ids_C: torch.Tensor, temps_C: torch.Tensor,
                with_entropy: bool, bitmask_CW: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of ids_C (and entropy) under softmax(lm_head(h) / T) for one chunk of C tokens (masked by their
    grammars where `bitmask_CW` is given)."""
    logits_CV = lm_head(hidden_CH).float() / temps_C[:, None]
    if bitmask_CW is not None:
        logits_CV = mask_logits(logits_CV, bitmask_CW)
    masked = bitmask_CW is not None
    entropy_C = entropy_from_logits(logits_CV, masked=masked) if with_entropy else logits_CV.new_zeros(0)
    return token_logprobs(logits_CV, ids_C), entropy_C


def take_rows(x_NX: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x_NX[index]`` (rows of a 2-D tensor; ``index`` of any shape), with a backward pass whose result does not
    depend on thread timing.

    The index repeats: in a packed row the first response token of every sample of a group is predicted at the
    same node (the shared prompt's last one). The backward pass of ``x[index]`` adds the repeated rows' gradients
    with parallel atomic adds on CPU, in whatever order the threads get there, so two runs of the same update
    ended with weights a few ulps apart (the demo's step-6 weights, 2026-12-05) and later sampled other tokens.
    ``index_select``'s backward adds them one index after another on CPU; on CUDA it is the other way round
    (``index_select``'s backward uses atomics; ``x[index]``'s sorts the indices first), the list in
    `torch.use_deterministic_algorithms`' documentation.
    """
    flat = index.reshape(-1)
    rows = x_NX.index_select(0, flat) if x_NX.device.type == "cpu" else x_NX[flat]
    return rows.reshape(*index.shape, *x_NX.shape[1:])


def _scatter(mask_BT: torch.Tensor, chunks: list[torch.Tensor]) -> torch.Tensor:
    values_N = torch.cat(chunks)
    return torch.zeros(mask_BT.shape, dtype=torch.float32, device=mask_BT.device).masked_scatter(mask_BT, values_N)


def _response_logits(forward: Callable[..., Any], batch: Batch) -> torch.Tensor:
    """Logits / T at the response positions, float32, [B, T, V]: softmax of them is the sampling law."""
    logits_BLV = forward(**batch.inputs, use_cache=False).logits
    logits_BTV = take_rows(logits_BLV.reshape(-1, logits_BLV.shape[-1]), batch.logit_index_BT)
    return logits_BTV.float() / batch.temperatures_B[:, None, None]


@torch.no_grad()
def check_chunked_head(model: torch.nn.Module) -> torch.nn.Module:
    """The model's LM head, after checking on a 3-token probe that its logits are ``lm_head(last hidden
    state)`` (no soft-capping or scaling after the head), which the chunked path relies on."""
    get_head = getattr(model, "get_output_embeddings", None)
    lm_head = get_head() if callable(get_head) else None
    if lm_head is None:
        raise ConfigError(f"{type(model).__name__} has no output embedding (get_output_embeddings()); "
                          "set update.logprob_chunk_tokens: 0 (full logits)")
    param = next(model.parameters())
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 4
    probe_BL = (torch.arange(1, 4, device=param.device) % vocab)[None]  # not token 0, often a zero pad embedding
    was_training = model.training
    model.eval()
    try:
        out = model(input_ids=probe_BL, use_cache=False, output_hidden_states=True)
        if getattr(out, "hidden_states", None) is None:
            raise ConfigError(f"{type(model).__name__} returns no hidden_states; set update.logprob_chunk_tokens: 0")
        gap = (lm_head(out.hidden_states[-1]).float() - out.logits.float()).abs().max().item()
    finally:
        model.train(was_training)
    scale = out.logits.float().abs().max().item() + 1e-6
    if not gap <= 1e-5 * scale:  # the same matmul on the same rows: equal up to rounding
        raise ConfigError(f"{type(model).__name__}'s logits are not its LM head applied to the last hidden state "
                          f"(max gap {gap:.3g}: soft-capping or a logit scale?); set update.logprob_chunk_tokens: 0")
    return lm_head
