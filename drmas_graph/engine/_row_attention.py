"""Attention of the embedded engine's passes on CPU, computed so that a row's numbers do not depend on the rows
it shares a batch with.

Two things made them depend on it (SmolLM2-135M, float32, torch 2.13's CPU kernels, 2026-12-05):

- Padding. The engine left-pads its rows to a common length, and the attention kernels reduce over the key
  columns in vector lanes counted from column 0: a row behind a number of padding columns that is not a
  multiple of the lane width sums the same terms in another order. A prompt alone and behind 1, 3 or 17
  padding columns gave logits 3.5e-5 to 4.6e-5 apart; behind 8 or 16, the same bits.
- The batch size. torch's CPU flash attention for one query token (a decode step) is not the same function
  of a row at every batch size: 24 rows attended at once and the same rows 1, 2, 5 or 12 at a time differed
  in the last bits. Its prefill (several query tokens, causal) gave the same bits at every batch size.

The padding a row gets and the rows it decodes with depend on when requests arrive, that is, on timing: two
runs of the demo recorded different logprobs for half of their first evaluation's calls, and a sampled token
could flip. `rows_apart()` (entered around the engine's passes) makes the models' ``sdpa`` attention:

- compute each group of rows that start at the same column (usually the G rows of a GRPO group) on the columns
  from that start on: exactly the keys and queries that a row has alone, without padding;
- a decode step (one query token) as softmax(q k^T * scale) v with matmuls over the row's key/value heads
  (grouped query heads as rows, as HF's sdpa path packs them): the same bits at every batch size, and as fast
  as the flash kernel here (~0.2 ms per layer for 16 rows);
- a prefill with HF's own sdpa function (the flash kernel, causal), which is already batch-size invariant.

The linear layers are row-wise already (oneDNN's packed matmul gives a row the same bits at any batch size), and
so are the norms and the LM head; the sampler sums each row on its own (`_sampling.row_sums`). Outside
`rows_apart()` (training, other threads, other callers) the wrapped function is HF's own. A pass whose rows'
keys are not one run of columns up to the last (a suffix prefill on cached rows, `prefix_reuse`) is computed as
before, all rows at once, and so is a model on another attention implementation (eager, flash_attention_2:
`update.attn_implementation`). What this covers is measured on CPU: on a GPU, matmul kernels are chosen by
shape and a row's numbers may still depend on the batch, so the engine does not enter `rows_apart()` there.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["install", "rows_apart"]

_state = threading.local()  # .spans: {id(mask): (mask, groups)} while a pass computes rows apart, else absent
_sdpa: Callable[..., Any] | None = None  # HF's own sdpa attention function, once install() wrapped it

_Group = tuple[slice | torch.Tensor, int, int, bool]
"""(rows: a slice of the batch where they are neighbours (the engine keeps its rows longest first), else their
indices; first query column; first key column; whether the rows' mask from those columns on is the plain
causal one, so that the function gets None as it does for a row alone)."""

_UNSUPPORTED = ("softcap", "s_aux", "position_bias")
"""Keyword arguments that change what attention computes beyond a mask: such calls take HF's function."""


def install() -> bool:
    """Wrap transformers' registered ``sdpa`` attention (once per process); False when there is none to wrap."""
    global _sdpa
    if _sdpa is not None:
        return True
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
        original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    except (ImportError, KeyError):
        return False
    _sdpa = original
    AttentionInterface.register("sdpa", _sdpa_rows_apart)
    return True


@contextlib.contextmanager
def rows_apart() -> Iterator[None]:
    """Within: this thread's sdpa attention computes each row on its own columns (one forward pass)."""
    outer = getattr(_state, "spans", None)
    _state.spans = {}
    try:
        yield
    finally:
        _state.spans = outer


def _groups(mask: torch.Tensor | None, B: int, Q: int, K: int) -> list[_Group] | None:
    """The rows grouped by their first query and key columns; None when a row's keys are not one run of
    columns ending at the last one."""
    if mask is None:
        return [(slice(0, B), 0, 0, True)]
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min
    mask = mask.expand(B, mask.shape[1], Q, K)[:, 0]  # [B, Q, K]: the heads share it (HF's masks do)
    seen = mask[:, -1]  # the last query is a real token of every row: it sees all of its row's keys
    key_start = seen.int().argmax(-1)
    if not bool((seen.sum(-1) == K - key_start).all()):
        return None
    starts = key_start.tolist()
    groups: list[_Group] = []
    for ks in sorted(set(starts)):
        qs = max(0, ks - (K - Q))
        rows = [b for b, s in enumerate(starts) if s == ks]
        causal = torch.ones(Q - qs, K - ks, dtype=torch.bool, device=mask.device).tril(K - Q)
        plain = (Q - qs in (1, K - ks)) and bool((mask[rows, qs:, ks:] == causal).all())
        if rows[-1] - rows[0] + 1 == len(rows):
            groups.append((slice(rows[0], rows[-1] + 1), qs, ks, plain))
        else:
            groups.append((torch.tensor(rows, device=mask.device), qs, ks, plain))
    return groups


def _one_query(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of one (scaled) query token per row, [n, 1, H, D] (HF's layout), by matmuls over each key/value
    head with its query heads as rows: the same bits for a row at every batch size."""
    n, H, _, D = query.shape
    Hkv = key.shape[1]
    scores = torch.matmul(query.reshape(n, Hkv, H // Hkv, D), key.transpose(-1, -2))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # [n, 1, 1, K] broadcast over heads
    out = torch.matmul(torch.softmax(scores, -1), value)  # [n, Hkv, H // Hkv, D]
    return out.reshape(n, H, 1, D).transpose(1, 2)


def _sdpa_rows_apart(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    spans = getattr(_state, "spans", None)
    if spans is None or any(kwargs.get(k) is not None for k in _UNSUPPORTED) or kwargs.get("dropout", 0.0):
        return _sdpa(module, query, key, value, attention_mask, **kwargs)
    B, H, Q, D = query.shape
    K = key.shape[2]
    entry = spans.get(id(attention_mask))
    if entry is None or entry[0] is not attention_mask:
        entry = (attention_mask, _groups(attention_mask, B, Q, K))
        spans[id(attention_mask)] = entry  # the mask kept alive: its id is not reused within the pass
    groups = entry[1]
    if groups is None or H % key.shape[1]:
        return _sdpa(module, query, key, value, attention_mask, **kwargs)
    if Q == 1:  # a decode step: every row one query token, scaled once
        query = query * (kwargs.get("scaling") or 1 / math.sqrt(D))
    parts = []
    for rows, qs, ks, plain in groups:
        pick = (lambda t: t[rows]) if isinstance(rows, slice) else (lambda t: t.index_select(0, rows))
        mask = None
        if not plain:
            mask = pick(attention_mask.expand(B, attention_mask.shape[1], Q, K))[:, :, qs:, ks:]
            if mask.dtype != torch.bool:
                mask = mask > torch.finfo(mask.dtype).min
        q, k, v = pick(query)[:, :, qs:], pick(key)[:, :, ks:], pick(value)[:, :, ks:]
        if Q == 1:
            parts.append(_one_query(q, k, v, mask))
        else:
            parts.append(_sdpa(module, q, k, v, mask, **kwargs)[0])
    if len(groups) == 1 and groups[0][1] == 0:
        return parts[0], None
    if Q == 1 and all(isinstance(g[0], slice) for g in groups):
        return torch.cat(parts), None  # slices in order, covering the batch
    out = query.new_zeros(B, Q, H, value.shape[-1])  # padded queries: 0 (nothing reads them)
    for (rows, qs, _, _), o in zip(groups, parts):
        out[rows, qs:] = o
    return out, None
