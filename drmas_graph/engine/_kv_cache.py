"""The embedded engine's KV cache rows: dynamic cache layers with room to grow, and moving rows between caches.

A decode step writes its column into spare room (`_growing_layer_class`) instead of concatenating the whole cache;
prompts' KV rows are stacked left-padded (`_stack_prompts`); a regroup lays the rows that stay and the newcomers
side by side, longest first, in one new buffer per layer (`_merge_caches`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_SPARE_COLUMNS = 64  # room left after the last cache column, so decode steps append in place


@functools.cache
def _growing_layer_class() -> type:
    """`DynamicLayer` whose keys/values are a prefix view of a buffer with spare columns (made once).

    The plain layer concatenates the whole cache to append one column every decode step (a full copy of
    the KV cache per step); this one writes the new column into the buffer's spare room and only copies
    when the room is used up (or the rows were regrouped: `_merge_caches` then builds a new buffer).
    """
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        key_buf: torch.Tensor | None = None
        value_buf: torch.Tensor | None = None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            n, add = self.keys.shape[-2], key_states.shape[-2]
            if not _is_prefix_view(self.keys, self.key_buf, n + add):
                self.key_buf = _with_room(self.keys, n + add + _SPARE_COLUMNS)
                self.value_buf = _with_room(self.values, n + add + _SPARE_COLUMNS)
            self.key_buf[:, :, n:n + add].copy_(key_states)
            self.value_buf[:, :, n:n + add].copy_(value_states)
            self.keys, self.values = self.key_buf[:, :, :n + add], self.value_buf[:, :, :n + add]
            return self.keys, self.values

    return GrowingLayer


def _is_prefix_view(t: torch.Tensor, buf: torch.Tensor | None, need: int) -> bool:
    """Whether `t` is buf[:, :, :n] and the buffer holds `need` columns."""
    return (buf is not None and t.data_ptr() == buf.data_ptr() and t.shape[:2] == buf.shape[:2]
            and t.stride() == buf.stride() and need <= buf.shape[2])


def _with_room(t: torch.Tensor, columns: int) -> torch.Tensor:
    """A (B, H, columns, D) buffer whose first columns hold `t`."""
    buf = t.new_empty((t.shape[0], t.shape[1], columns, t.shape[3]))
    buf[:, :, :t.shape[2]].copy_(t)
    return buf


def _mergeable(cache: Any) -> bool:
    """Whether the cache is a list of plain full-attention dynamic layers, whose rows can be moved freely."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    kinds = (DynamicLayer, _growing_layer_class())
    return bool(layers) and all(type(layer) in kinds and layer.is_initialized for layer in layers)


def _prompt_kv(cache: Any, row: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One prompt's (keys, values) per layer, (1, heads, n, head_dim), without its left padding."""
    return [(layer.keys[row:row + 1, :, -n:], layer.values[row:row + 1, :, -n:]) for layer in cache.layers]


def _stack_prompts(kvs: list[list[tuple[torch.Tensor, torch.Tensor]]], lengths: list[int],
                   device: torch.device) -> tuple[Any, torch.Tensor]:
    """A dynamic cache holding the prompts' KV rows left-padded to a common length, and its mask_UL."""
    from transformers.cache_utils import DynamicCache

    L = max(lengths)
    layers = [tuple(torch.cat([_left_pad(kv[li][j], L - n, 2) for kv, n in zip(kvs, lengths)]) for j in (0, 1))
              for li in range(len(kvs[0]))]
    mask_UL = (torch.arange(L)[None, :] >= torch.tensor([L - n for n in lengths])[:, None]).long()
    return DynamicCache(ddp_cache_data=layers), mask_UL.to(device)


def _left_pad(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _merge_caches(parts: list[tuple[Any, torch.Tensor, int]], trim: int, order: list[int] | None = None) -> Any:
    """One cache holding the selected rows of each part, each left-padded by its pad, minus `trim` columns; with
    `order` (a permutation other than the identity), row b of the result is row order[b] of the parts' rows laid
    end to end.

    Several parts (or padding/trimming) need plain dynamic layers (`_mergeable`); otherwise only the row
    selection of a single part is done, through the cache's own `batch_select_indices`.
    """
    target = parts[0][0]
    if not _mergeable(target):
        if len(parts) > 1 or parts[0][2] or trim:
            raise RuntimeError(f"cannot merge KV caches of type {type(target).__name__}")
        target.batch_select_indices(parts[0][1])
        return target
    growing = _growing_layer_class()
    B = sum(rows.numel() for _, rows, _ in parts)
    dest = None  # where each of the parts' rows goes, when not in their order
    if order is not None:
        dest = torch.empty(B, dtype=torch.long)
        dest[torch.tensor(order)] = torch.arange(B)
        dest = dest.to(parts[0][0].layers[0].keys.device)
    L = parts[0][2] + parts[0][0].layers[0].keys.shape[2]  # every part's length once left-padded
    for li, layer in enumerate(target.layers):
        new = growing()
        new.device, new.is_initialized = layer.device, True
        for name, buf_name in (("keys", "key_buf"), ("values", "value_buf")):
            sources = [getattr(c.layers[li], name) for c, _, _ in parts]
            t = sources[0]
            buf = t.new_empty((B, t.shape[1], L - trim + _SPARE_COLUMNS, t.shape[3]))
            b = 0
            for (_, rows, pad), src in zip(parts, sources):  # padded column j holds src column j - pad
                n = rows.numel()
                first = max(pad, trim)
                block = src[:, :, first - pad:].index_select(0, rows)
                if dest is None:
                    dst = buf[b:b + n]
                    if first > trim:
                        dst[:, :, :first - trim].zero_()  # padding: masked, but must not hold NaN garbage
                    dst[:, :, first - trim:L - trim].copy_(block)
                else:
                    if first > trim:
                        buf[dest[b:b + n], :, :first - trim] = 0
                    buf[dest[b:b + n], :, first - trim:L - trim] = block
                b += n
            setattr(new, name, buf[:, :, :L - trim])
            setattr(new, buf_name, buf)
        target.layers[li] = new
    return target
