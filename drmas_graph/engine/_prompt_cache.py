"""The embedded engine's cache of recent prompts' KV rows (`PromptCache`), for `_decode.DecodeBatch`."""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["PromptCache", "MIN_PREFIX"]

_Key = tuple[str | None, tuple[int, ...]]  # (LoRA adapter, token ids): KV rows depend on both
MIN_PREFIX = 16
"""Fewest shared tokens worth a prefix hit: a hit prefills its suffix in a forward pass of its own (a read of
every weight), so a few shared tokens (a chat template's header) cost more than they save."""


class PromptCache:
    """The KV rows of recently prefilled prompts and finished rows (LRU; one weights version).

    Identical prompts (GRPO sends a group's prompts at about the same time; members that miss the admission
    of the first ones) take an entry's KV rows and last-position logits as they are (`get`). A prompt that
    shares at least `MIN_PREFIX` leading tokens with an entry (the next turn of an episode: its earlier
    prompt and reply; agents with the same system prompt) takes the KV rows of that common prefix and
    prefills only the rest (`longest_prefix`). A causal model's KV rows at positions < k depend on the
    first k tokens only, so both give what a full prefill gives, up to the order of floating-point sums.
    Entries of finished rows hold the prompt and the reply's tokens but the last (never fed to the model),
    and no logits.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.version: int | None = None
        self.entries: OrderedDict[_Key, tuple[list, torch.Tensor | None]] = OrderedDict()

    def _at(self, version: int) -> None:
        if version != self.version:
            self.entries.clear()
            self.version = version

    def get(self, prompt: _Key, version: int) -> tuple[list, torch.Tensor] | None:
        """The entry of exactly this prompt with its last-position logits, if cached."""
        self._at(version)
        entry = self.entries.get(prompt)
        if entry is None or entry[1] is None:
            return None
        self.entries.move_to_end(prompt)
        return entry

    def longest_prefix(self, prompt: _Key, version: int) -> tuple[list, int] | None:
        """(an entry's KV rows, k): the entry (same adapter) sharing the longest prefix with the prompt, k of
        its first rows usable (k < len(prompt): the last prompt token is fed to get its logits); None when no
        entry shares `MIN_PREFIX` tokens."""
        self._at(version)
        adapter, ids = prompt
        best, best_k = None, 0
        for key in self.entries:
            if key[0] == adapter:
                k = _common_prefix(key[1], ids, len(ids) - 1)
                if k > best_k:
                    best, best_k = key, k
        if best is None or best_k < MIN_PREFIX:
            return None
        self.entries.move_to_end(best)
        return self.entries[best][0], best_k

    def put(self, prompt: _Key, kv: list, logits_V: torch.Tensor | None, version: int) -> None:
        if self.size <= 0 or version != self.version:
            return
        if logits_V is None and prompt in self.entries:  # keep the entry's logits (a 1-token reply's row)
            self.entries.move_to_end(prompt)
            return
        self.entries[prompt] = ([(k.clone(), v.clone()) for k, v in kv],
                                None if logits_V is None else logits_V.clone())
        self.entries.move_to_end(prompt)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...], limit: int) -> int:
    """How many leading tokens a and b share, at most `limit`."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect on tuple slices (C speed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
