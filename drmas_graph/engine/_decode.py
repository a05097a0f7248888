"""The embedded engine's continuous batch: active rows sharing one left-padded KV cache.

Shapes: `_B` active rows, `_N` newcomers, `_U` distinct newcomer prompts, `_L` cache length.

Every `step`: the active rows decode one token (one forward pass), the newcomers are prefilled (one
forward pass over their *distinct* prompts; rows with the same prompt share its KV cache rows; a prompt
prefilled recently under the same weights is taken from `PromptCache`, and a prompt that shares a prefix
with a recent prompt or finished row (an episode's next turn) prefills only its suffix on those KV rows, in a
second forward pass), every row
samples on the device (`_sampling.sample_rows`), one device-to-host copy brings back the sampled ids and
logprobs, rows that finished leave, and the newcomers' cache rows are merged into the batch (left-padded
to a common length; fully padded leading columns are trimmed). A row's tokens depend on its prompt,
params and seed only: its position ids and attention mask ignore the padding, and its noise is keyed by
(seed, position).

Where the time goes (`EngineStats.prefill_s` / `decode_s`, and each `Generation`'s share): a step's decode
pass (with its sampling) is split equally among the rows it decoded; its prefill pass(es) (with the newcomers'
sampling and the stacking of cached KV rows) among the newcomers by token share: a distinct prompt's
prefilled tokens (0 for a cache hit, the suffix for a prefix hit) split equally among the requests that share
it, plus one token per request for its first sample. The rest of a step (the one device-to-host copy, stop
checks, merging the rows' caches) counts as decode time, split equally among all the step's rows (a merge's
time among the rows of the next step). On a GPU the step synchronizes the device between the two passes when
it runs both, so that each is timed on its own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from drmas_graph.engine._cpu_linear import PackedLinear, packed_linear_available
from drmas_graph.engine._kv_cache import _left_pad, _merge_caches, _mergeable, _prompt_kv, _stack_prompts
from drmas_graph.engine._lean import LeanDecoder
from drmas_graph.engine._prompt_cache import MIN_PREFIX, PromptCache, _Key
from drmas_graph.engine._row_attention import install as install_row_attention, rows_apart
from drmas_graph.engine._sampling import RowParams, sample_rows, vocab_hash
from drmas_graph.grammar import Matcher, bitmask_width
from drmas_graph.types import Generation, SamplingParams

log = logging.getLogger(__name__)

__all__ = ["Request", "DecodeBatch", "StopMatcher", "EngineStats", "PromptCache", "MIN_PREFIX", "context_size"]


def context_size(model: Any) -> int | None:
    """The positions a model can attend over, from its config (`max_position_embeddings`: Llama, Qwen, ...;
    `n_positions` / `n_ctx`: GPT-2); None when the config names none. Learned positions fail past it (an index
    error), rotary ones decode on without an error into positions the model never trained on."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass
class Request:
    """One queued generation request (extend with per-request options, e.g. an adapter name)."""

    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    future: concurrent.futures.Future
    grammar: Any = None
    """`params.grammar` compiled (`drmas_graph.grammar.Grammars.compile`); None for free text."""


@dataclass
class EngineStats:
    """Counters of the engine (for benchmarks and tests)."""

    batches: int = 0
    """Admissions: groups of requests prefilled together."""
    requests: int = 0
    """Requests admitted."""
    max_batch: int = 0
    """Most rows sampled in one step (active rows plus newcomers)."""
    forward_passes: int = 0
    """Model calls (decode steps and prefills)."""
    lean_passes: int = 0
    """Of those, the ones the lean forward made (`_lean`; the rest ran the model's own forward)."""
    prefill_rows: int = 0
    """Distinct prompts prefilled."""
    prefill_tokens: int = 0
    """Prompt tokens prefilled (distinct prompts only)."""
    shared_prefill_rows: int = 0
    """Requests that reused the prefill of an identical prompt admitted with them."""
    joined_mid_decode: int = 0
    """Requests admitted while other rows were decoding."""
    prefix_cache_hits: int = 0
    """Distinct prompts whose KV rows came from the recent-prompt cache instead of a prefill."""
    partial_prefix_hits: int = 0
    """Distinct prompts that prefilled only their suffix, on the cached KV rows of a shared prefix."""
    reused_prompt_tokens: int = 0
    """Prompt tokens whose KV rows came from the cache (identical prompts and shared prefixes)."""
    prefill_s: float = 0.0
    """Seconds in prefill passes (see the module docstring for what counts as prefill)."""
    decode_s: float = 0.0
    """Seconds in decode passes and the rest of each step."""
    masked_rows: int = 0
    """Row-steps sampled under a grammar's mask (one per constrained row per step)."""
    mask_s: float = 0.0
    """Of the seconds above, those spent computing grammar masks (filling the bitmasks of constrained rows)."""


class StopMatcher:
    """Incremental stop-string check: decodes only the newest tokens (prefix/read offsets, as vLLM does).

    `feed(ids)` after each new token returns whether the text decoded so far (special tokens kept) contains
    one of the stop strings; only the part that can hold a new match is searched.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.max_len = max(len(s) for s in self.stops)
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def feed(self, ids: Sequence[int]) -> bool:
        decode = self.tokenizer.decode
        before = decode(list(ids[self.prefix_offset:self.read_offset]), skip_special_tokens=False)
        now = decode(list(ids[self.prefix_offset:]), skip_special_tokens=False)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return False  # an incomplete multi-byte character: wait for the next token
        delta = now[len(before):]
        self.text += delta
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        tail = self.text[-(len(delta) + self.max_len - 1):]
        return any(s in tail for s in self.stops)


@dataclass
class _Row:
    req: Request
    stop_ids: frozenset[int]
    matcher: StopMatcher | None
    version: int
    max_new: int
    """max_new_tokens, or fewer where the model's context ends first (finish reason 'length' there)."""
    grammar: Matcher | None = None
    """Where the response stands in its grammar (None: unconstrained)."""
    out_ids: list[int] = field(default_factory=list)
    out_lp: list[float] = field(default_factory=list)
    prefill_s: float = 0.0
    """This request's share of the prefill passes (module docstring)."""
    decode_s: float = 0.0
    """Its share of the decode steps."""

    def add(self, token: int, logprob: float) -> str | None:
        """Record a sampled token; the finish reason if the row is done."""
        self.out_ids.append(token)
        self.out_lp.append(logprob)
        if self.grammar is not None:
            if not self.grammar.accept(token):  # the mask allowed it: the grammar library disagrees with itself
                raise RuntimeError(f"token {token} at position {len(self.out_ids) - 1} was sampled under the grammar's "
                                   "mask but the grammar does not accept it")
            if self.grammar.done:
                return "stop"
        if token in self.stop_ids:
            return "stop"
        if self.matcher is not None and self.matcher.feed(self.out_ids):
            return "stop"
        if len(self.out_ids) >= self.max_new:
            return "length"
        return None

    def generation(self, reason: str) -> Generation:
        return Generation(token_ids=self.out_ids, logprobs=self.out_lp, finish_reason=reason,
                          policy_version=self.version, prefill_s=self.prefill_s, decode_s=self.decode_s)


class DecodeBatch:
    """The active rows of the embedded engine and their shared KV cache (used by one worker thread)."""

    def __init__(self, model: Any, tokenizer: Any, *, pad_id: int, eos_ids: Sequence[int], cache_kwarg: str,
                 stats: EngineStats, prompt_cache_size: int = 0, prefix_reuse: bool = False,
                 packed_cpu_linear: bool = False, row_kwargs: Callable[[list[str | None]], dict[str, Any]] | None = None,
                 context_size: int | None = None, lean_forward: bool = False, batch_invariant: bool = False) -> None:
        self.model = model
        self.context_size = context_size
        """Positions the model has (`context_size`): a row stops ('length') before feeding a token past them."""
        self.row_kwargs = row_kwargs or (lambda adapters: {})
        """Extra forward kwargs for rows that use the given LoRA adapters (None = the model's own weights)."""
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.pad_id = pad_id
        self.eos_ids = frozenset(eos_ids)
        self.cache_kwarg = cache_kwarg
        self.stats = stats
        self._vocab_hash: torch.Tensor | None = None
        self.prompt_cache = PromptCache(prompt_cache_size)
        self.prefix_reuse = prefix_reuse
        """Prefill only the suffix of a prompt that shares a prefix with a cached prompt or finished row (off by
        default: not bit-identical to a full prefill, and whether a prompt hits depends on arrival order)."""
        use_packed = packed_cpu_linear and self.device.type == "cpu" and packed_linear_available()
        self.linear_mode = PackedLinear() if use_packed else None
        if use_packed:
            PackedLinear.install(model)
        self.rows_apart = batch_invariant and self.device.type == "cpu" and install_row_attention()
        """Whether the model's sdpa attention computes each row on its own columns (`_row_attention`, on CPU):
        a row's numbers then do not depend on the rows it shares a batch with."""
        self.lean: LeanDecoder | None = None
        """The lean forward (`_lean`, with the packed CPU linears), None where it is off or cannot stand in."""
        if lean_forward and self.rows_apart:
            log.info("the embedded engine runs the model's own forward: the lean forward's attention is not "
                     "computed row by row (batch_invariant=False allows it)")
        elif lean_forward and self.linear_mode is not None:
            reason = LeanDecoder.refusal(model)
            if reason is None:
                self.lean = LeanDecoder(model, self.linear_mode, cache_kwarg=cache_kwarg)
            else:
                log.info("the embedded engine runs the model's own forward: %s", reason)
        self.clear()

    def clear(self) -> None:
        """Drop every row (after a failure or when the batch drained)."""
        self.rows: list[_Row] = []
        self.cache: Any = None
        self.mask_BL: torch.Tensor | None = None  # 1 where a cache column holds a real token of the row
        self.next_ids_B: torch.Tensor | None = None  # the token each row feeds next (sampled, on device)
        self.next_pos_B: torch.Tensor | None = None  # its position id
        self.gen_pos_B: torch.Tensor | None = None  # tokens generated so far (the noise counter)
        self.rp: RowParams | None = None
        self._carry_s = 0.0  # the last merge of the rows' caches: decode time of the next step's rows

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def can_join(self) -> bool:
        """Whether newcomers may join while rows are decoding (the cache layout supports moving rows)."""
        return not self.rows or _mergeable(self.cache)

    def _vocab(self, V: int) -> torch.Tensor:
        if self._vocab_hash is None or self._vocab_hash.numel() != V:
            self._vocab_hash = vocab_hash(V, self.device)
        return self._vocab_hash

    def _forward(self, ids_BL: torch.Tensor, mask_BL: torch.Tensor, pos_BL: torch.Tensor, cache: Any,
                 adapters: list[str | None]):
        extra = self.row_kwargs(adapters)
        with self.linear_mode or contextlib.nullcontext(), rows_apart() if self.rows_apart else contextlib.nullcontext():
            self.stats.forward_passes += 1
            lean = self.lean
            if (lean is not None and not extra and not lean.bypassed()
                    and (lean.checked or (lean.checked is None and lean.check()))):
                if cache is None:
                    from transformers.cache_utils import DynamicCache

                    cache = DynamicCache(config=self.model.config)
                self.stats.lean_passes += 1
                return lean(ids_BL, mask_BL, pos_BL, cache)
            out = self.model(input_ids=ids_BL, attention_mask=mask_BL, position_ids=pos_BL, use_cache=True,
                             logits_to_keep=1, **{self.cache_kwarg: cache}, **extra)
        return out.logits[:, -1, :], getattr(out, self.cache_kwarg)

    # ---- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, newcomers: Sequence[Request], version: int) -> list[tuple[Request, Generation]]:
        """Decode one token for every active row, prefill and sample the newcomers; return finished rows."""
        if self.linear_mode is not None:
            self.linear_mode.for_version(version)
        ids, lps = [], []
        t0 = time.perf_counter()
        if self.rows:
            ids_B, lp_B = self._decode()
            ids.append(ids_B)
            lps.append(lp_B)
            if newcomers:
                self._sync()
        t1 = time.perf_counter()
        new = None
        matchers_N = [Matcher(r.grammar, r.params.grammar) if r.grammar is not None else None for r in newcomers]
        if newcomers:
            new = self._prefill(newcomers, version, matchers_N)
            ids.append(new["ids_N"])
            lps.append(new["lp_N"])
            self.stats.joined_mid_decode += len(newcomers) if self.rows else 0
            self._sync()
        t2 = time.perf_counter()
        if not ids:
            return []
        ids_all = torch.cat(ids)
        host = torch.stack([ids_all.to(torch.float64), torch.cat(lps).to(torch.float64)]).tolist()  # one D2H copy
        new_rows = [self._new_row(r, version, m) for r, m in zip(newcomers, matchers_N)]
        self._attribute(new_rows, new, t1 - t0 + self._carry_s, t2 - t1, time.perf_counter() - t2)
        self.stats.max_batch = max(self.stats.max_batch, len(self.rows) + len(new_rows))
        finished, keep_old, keep_new = [], [], []
        for i, row in enumerate(self.rows + new_rows):
            reason = row.add(int(host[0][i]), host[1][i])
            if reason is not None:
                finished.append((row.req, row.generation(reason)))
                if i < len(self.rows):
                    self._cache_finished_row(i, row)
            elif i < len(self.rows):
                keep_old.append(i)
            else:
                keep_new.append(i - len(self.rows))
        t3 = time.perf_counter()
        self._regroup(keep_old, new, keep_new, ids_all, new_rows)
        self._carry_s = time.perf_counter() - t3
        return finished

    def _sync(self) -> None:
        """Wait for the device's queued work (a GPU's), so that the time of a pass is its own."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _attribute(self, new_rows: list[_Row], new: dict[str, Any] | None, decode_s: float, prefill_s: float,
                   rest_s: float) -> None:
        """Share a step's seconds among its rows (module docstring): the decode pass equally among the active
        rows, the prefill pass among the newcomers by token share, the rest equally among all of them."""
        if new is None:  # no prefill pass: its moment between the two is the rest's
            rest_s, prefill_s = rest_s + prefill_s, 0.0
        rest_row = rest_s / (len(self.rows) + len(new_rows))
        for row in self.rows:
            row.decode_s += decode_s / len(self.rows) + rest_row
        if new is not None:
            weights_N = new["weights_N"]
            for row, w in zip(new_rows, weights_N):
                row.prefill_s += prefill_s * w / sum(weights_N)
                row.decode_s += rest_row
        self.stats.decode_s += (decode_s if self.rows else 0.0) + rest_s
        self.stats.prefill_s += prefill_s

    def _cache_finished_row(self, i: int, row: _Row) -> None:
        """Keep a finished row's KV rows (its prompt and reply but the last token) for a next turn's prompt."""
        if not self.prefix_reuse or self.prompt_cache.size <= 0 or not _mergeable(self.cache):
            return
        ids = row.req.prompt_ids + row.out_ids[:-1]
        self.prompt_cache.put((row.req.params.adapter, tuple(ids)), _prompt_kv(self.cache, i, len(ids)), None,
                              row.version)

    def _new_row(self, req: Request, version: int, grammar: Matcher | None) -> _Row:
        p = req.params
        matcher = StopMatcher(self.tokenizer, p.stop) if p.stop else None
        room = p.max_new_tokens if self.context_size is None else self.context_size - len(req.prompt_ids)
        return _Row(req, self.eos_ids | frozenset(p.stop_token_ids), matcher, version, min(p.max_new_tokens, room),
                    grammar)

    def _bitmask(self, matchers: Sequence[Matcher | None], V: int) -> torch.Tensor | None:
        """The grammar masks of the rows about to sample (every bit set for a row without one); None when no row
        has a grammar (then sampling is exactly as without this feature)."""
        if all(m is None for m in matchers):
            return None
        t = time.perf_counter()
        bitmask_BW = torch.full((len(matchers), bitmask_width(V)), -1, dtype=torch.int32)
        for b, m in enumerate(matchers):
            if m is not None:
                m.fill(bitmask_BW, b)
        self.stats.masked_rows += sum(m is not None for m in matchers)
        self.stats.mask_s += time.perf_counter() - t
        return bitmask_BW.to(self.device, non_blocking=True)

    def _decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        B = len(self.rows)
        self.mask_BL = torch.cat([self.mask_BL, self.mask_BL.new_ones((B, 1))], dim=1)
        logits_BV, self.cache = self._forward(self.next_ids_B[:, None], self.mask_BL, self.next_pos_B[:, None],
                                              self.cache, [row.req.params.adapter for row in self.rows])
        V = logits_BV.shape[-1]
        ids_B, lp_B = sample_rows(logits_BV, self.rp, self.gen_pos_B, self._vocab(V),
                                  self._bitmask([row.grammar for row in self.rows], V))
        return ids_B, lp_B

    def _prefill(self, reqs: Sequence[Request], version: int, matchers_N: Sequence[Matcher | None]) -> dict[str, Any]:
        """Prefill the distinct prompts once (or reuse a recent prefill, or prefill only the suffix after a
        cached prefix); sample every newcomer's first token. A prompt is distinct per LoRA adapter (its KV
        cache depends on the adapter): keys are (adapter, ids)."""
        distinct: dict[_Key, int] = {}
        row_of_N = [distinct.setdefault((r.params.adapter, tuple(r.prompt_ids)), len(distinct)) for r in reqs]
        prompts = list(distinct)
        hits = {p: e for p in prompts if (e := self.prompt_cache.get(p, version)) is not None}
        partial = {p: m for p in prompts if self.prefix_reuse and p not in hits
                   and (m := self.prompt_cache.longest_prefix(p, version)) is not None}
        misses = [p for p in prompts if p not in hits and p not in partial]
        if misses:
            logits_MV, cache, mask_ML = self._forward_prompts(misses)
        fresh = self._forward_suffixes(partial) if partial else {}
        self.stats.prefill_rows += len(misses) + len(partial)
        self.stats.prefill_tokens += (sum(len(p[1]) for p in misses)
                                      + sum(len(p[1]) - k for p, (_, k) in partial.items()))
        self.stats.batches += 1
        self.stats.requests += len(reqs)
        self.stats.shared_prefill_rows += len(reqs) - len(prompts)
        self.stats.prefix_cache_hits += len(hits)
        self.stats.partial_prefix_hits += len(partial)
        self.stats.reused_prompt_tokens += sum(len(p[1]) for p in hits) + sum(k for _, k in partial.values())
        if not hits and not partial:  # the forward's cache is the newcomers' cache as it is
            logits_UV, mask_UL = logits_MV, mask_ML
            if _mergeable(cache):
                for m, p in enumerate(misses):
                    self.prompt_cache.put(p, _prompt_kv(cache, m, len(p[1])), logits_MV[m], version)
        else:
            fresh.update({p: (_prompt_kv(cache, m, len(p[1])), logits_MV[m]) for m, p in enumerate(misses)})
            for p, (kv, logits_V) in fresh.items():
                self.prompt_cache.put(p, kv, logits_V, version)
            entries = [hits.get(p) or fresh[p] for p in prompts]
            cache, mask_UL = _stack_prompts([e[0] for e in entries], [len(p[1]) for p in prompts], self.device)
            logits_UV = torch.stack([e[1] for e in entries])
        V = logits_UV.shape[-1]
        rp = RowParams.build([r.params for r in reqs], [r.seed for r in reqs], V, self.device)
        idx_N = torch.tensor(row_of_N, dtype=torch.long, device=self.device)
        zeros_N = torch.zeros(len(reqs), dtype=torch.int32, device=self.device)
        ids_N, lp_N = sample_rows(logits_UV.index_select(0, idx_N), rp, zeros_N, self._vocab(V),
                                  self._bitmask(matchers_N, V))
        prefilled = {p: len(p[1]) for p in misses} | {p: len(p[1]) - k for p, (_, k) in partial.items()}
        sharing = [row_of_N.count(u) for u in range(len(prompts))]
        weights_N = [prefilled.get(prompts[u], 0) / sharing[u] + 1 for u in row_of_N]
        return {"ids_N": ids_N, "lp_N": lp_N, "idx_N": idx_N, "weights_N": weights_N, "cache": cache, "mask_UL": mask_UL,
                "pos_N": torch.tensor([len(r.prompt_ids) for r in reqs], device=self.device), "rp": rp}

    def _forward_suffixes(self, partial: dict[_Key, tuple[list, int]]) -> dict[_Key, tuple[list, torch.Tensor]]:
        """One forward pass over the prompts' suffixes on top of their cached prefixes' KV rows.

        Row u's columns: its k_u prefix rows left-padded to K, then its suffix left-padded to S (masked gaps
        between); returns each prompt's KV rows without the gaps, and its last-position logits.
        """
        keys = list(partial)
        ks = [k for _, k in partial.values()]
        suffixes = [p[1][k:] for p, k in zip(keys, ks)]
        K, S = max(ks), max(len(t) for t in suffixes)
        prefix_kv = [[(keys_[:, :, :k], values[:, :, :k]) for keys_, values in kv] for kv, k in partial.values()]
        cache, mask_UK = _stack_prompts(prefix_kv, ks, self.device)
        ids_US = torch.full((len(keys), S), self.pad_id, dtype=torch.long)
        mask_US = torch.zeros((len(keys), S), dtype=torch.long)
        for u, t in enumerate(suffixes):
            ids_US[u, S - len(t):] = torch.tensor(t, dtype=torch.long)
            mask_US[u, S - len(t):] = 1
        pos_US = (mask_US.cumsum(-1) - 1).clamp(min=0) + torch.tensor(ks)[:, None]
        logits_UV, cache = self._forward(ids_US.to(self.device), torch.cat([mask_UK, mask_US.to(self.device)], 1),
                                         pos_US.to(self.device), cache, [a for a, _ in keys])
        out = {}
        for u, (p, k, t) in enumerate(zip(keys, ks, suffixes)):
            kv = [tuple(torch.cat([x[u:u + 1, :, K - k:K], x[u:u + 1, :, K + S - len(t):]], dim=2)
                        for x in (layer.keys, layer.values)) for layer in cache.layers]
            out[p] = (kv, logits_UV[u])
        return out

    def _forward_prompts(self, keys: list[_Key]) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """One left-padded forward pass over the (adapter, prompt) keys: (last-position logits_UV, cache, mask_UL)."""
        prompts = [p for _, p in keys]
        U, L = len(prompts), max(len(p) for p in prompts)
        ids_UL = torch.full((U, L), self.pad_id, dtype=torch.long)
        mask_UL = torch.zeros((U, L), dtype=torch.long)
        for u, p in enumerate(prompts):
            ids_UL[u, L - len(p):] = torch.tensor(p, dtype=torch.long)
            mask_UL[u, L - len(p):] = 1
        pos_UL = (mask_UL.cumsum(-1) - 1).clamp(min=0)
        mask_UL = mask_UL.to(self.device)
        logits_UV, cache = self._forward(ids_UL.to(self.device), mask_UL, pos_UL.to(self.device), None,
                                         [a for a, _ in keys])
        return logits_UV, cache, mask_UL

    # ---- batch composition ------------------------------------------------------------------
    def _regroup(self, keep_old: list[int], new: dict[str, Any] | None, keep_new: list[int],
                 ids_all: torch.Tensor, new_rows: list[_Row]) -> None:
        """Keep the unfinished rows (old first, then newcomers) and lay their caches side by side."""
        B_old = len(self.rows)
        if len(keep_old) == B_old and not keep_new and B_old:  # nobody left or joined: no cache copy
            self.next_ids_B = ids_all[:B_old]
            self.next_pos_B = self.next_pos_B + 1
            self.gen_pos_B = self.gen_pos_B + 1
            return
        V = self._vocab_hash.numel()
        parts = []  # (cache, cache rows, mask_BL, next ids, next positions, noise counters, RowParams, rows)
        if keep_old:
            k = torch.tensor(keep_old, dtype=torch.long, device=self.device)
            parts.append((self.cache, k, self.mask_BL.index_select(0, k), ids_all[:B_old].index_select(0, k),
                          self.next_pos_B.index_select(0, k) + 1, self.gen_pos_B.index_select(0, k) + 1,
                          self.rp.select(k, [self.rows[i].req.params for i in keep_old], V),
                          [self.rows[i] for i in keep_old]))
        if new is not None and keep_new:
            k = torch.tensor(keep_new, dtype=torch.long, device=self.device)
            u = new["idx_N"].index_select(0, k)  # newcomer -> its distinct prompt's cache row
            parts.append((new["cache"], u, new["mask_UL"].index_select(0, u), ids_all[B_old:].index_select(0, k),
                          new["pos_N"].index_select(0, k), torch.ones_like(k, dtype=torch.int32),
                          new["rp"].select(k, [new_rows[i].req.params for i in keep_new], V),
                          [new_rows[i] for i in keep_new]))
        if not parts:
            self.clear()
            return
        rows = [r for p in parts for r in p[7]]
        cached = [len(r.req.prompt_ids) + len(r.out_ids) - 1 for r in rows]  # tokens in each row's cache
        lengths = [p[2].shape[1] for p in parts]
        L = max(lengths)
        mergeable = _mergeable(parts[0][0])
        trim = L - max(cached) if mergeable else 0  # leading columns that are padding in every row
        # longest rows first: rows that start at the same column are neighbours, and `_row_attention` takes
        # each such run as one slice of the batch (a copy of its rows otherwise)
        order = sorted(range(len(rows)), key=lambda b: -cached[b]) if mergeable else list(range(len(rows)))
        if order == list(range(len(rows))):
            order = None  # already longest first
        self.rows = rows if order is None else [rows[b] for b in order]
        self.cache = _merge_caches([(p[0], p[1], L - n) for p, n in zip(parts, lengths)], trim, order)
        perm = None if order is None else torch.tensor(order, dtype=torch.long, device=self.device)

        def cat(tensors: list[torch.Tensor]) -> torch.Tensor:
            out = torch.cat(tensors)
            return out if perm is None else out.index_select(0, perm)

        self.mask_BL = cat([_left_pad(p[2], L - n, 1) for p, n in zip(parts, lengths)])[:, trim:]
        self.next_ids_B = cat([p[3] for p in parts])
        self.next_pos_B = cat([p[4] for p in parts])
        self.gen_pos_B = cat([p[5] for p in parts])
        self.rp = RowParams.cat([p[6] for p in parts]) if len(parts) > 1 else parts[0][6]
        if perm is not None:
            self.rp = self.rp.select(perm, [r.req.params for r in self.rows], V)
