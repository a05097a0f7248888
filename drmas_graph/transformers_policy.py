"""`TransformersPolicy`: the embedded default backend, an in-process transformers model with dynamic batching.

Requests from any thread or event loop go to one worker thread. The worker takes the first waiting
request, keeps collecting for a short quiet period (`batch_wait_s` after the last arrival, at most
`max_batch_wait_s` in all, longer while callers have announced a request they are still rendering), and
decodes the whole batch together: left-padded prompts, one KV cache, per-row sampling parameters and
per-row seeded generators. Concurrent episodes and parallel branches therefore share forward passes.

Logprobs are log_softmax(logits / temperature) at the sampled token, before top-k/top-p truncation
(temperature 0 = greedy, logprobs at temperature 1): the trainer recomputes the same quantity.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import os
import queue
import random
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from drmas_graph.errors import PolicyError
from drmas_graph.lora import adapter_kwargs, is_peft_model
from drmas_graph.policy import Policy
from drmas_graph.types import Generation, SamplingParams

__all__ = ["TransformersPolicy", "sample_batch", "sample_token"]


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    future: concurrent.futures.Future


@dataclass
class BatchStats:
    """Counters of the dynamic batcher (for benchmarks and tests)."""

    batches: int = 0
    requests: int = 0
    max_batch: int = 0
    forward_passes: int = 0


def _keep_mask(scaled_V: torch.Tensor, logp_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Tokens allowed by top-k, then top-p (nucleus, Holtzman et al. 2020; the top token is always kept)."""
    keep_V = torch.ones_like(scaled_V, dtype=torch.bool)
    if 0 < params.top_k < scaled_V.numel():
        keep_V &= scaled_V >= torch.topk(scaled_V, params.top_k).values[-1]
    if params.top_p < 1.0:
        sorted_logp, order = torch.sort(logp_V, descending=True)
        mass_before = torch.cumsum(sorted_logp.exp(), -1) - sorted_logp.exp()
        keep_V &= torch.zeros_like(keep_V).scatter(0, order, mass_before < params.top_p)
    return keep_V


def sample_batch(logits_BV: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator]) -> tuple[list[int], list[float]]:
    """Sample one token per row; return the ids and log_softmax(logits / T) at them.

    Gumbel-max: argmax(logits / T - log E) with E ~ Exp(1) drawn from the row's own generator samples
    exactly from softmax(logits / T) over the tokens top-k/top-p keep, and a row's draws never depend on
    the other rows of the batch. Temperature 0 rows take the argmax and report logprobs at T = 1. The
    logprob is taken from the untruncated distribution, which is what a trainer recomputes from logits.
    """
    logits_BV = logits_BV.float()
    temps_B = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
    scaled_BV = logits_BV / temps_B[:, None]
    logp_BV = torch.log_softmax(scaled_BV, -1)
    noise_BV = torch.ones_like(scaled_BV)
    for i, p in enumerate(params):
        if p.temperature == 0:
            continue
        noise_BV[i].exponential_(generator=generators[i])
        if 0 < p.top_k < scaled_BV.shape[-1] or p.top_p < 1.0:
            noise_BV[i].masked_fill_(~_keep_mask(scaled_BV[i], logp_BV[i], p), float("inf"))
    tokens_B = (scaled_BV - noise_BV.log()).argmax(-1)
    return tokens_B.tolist(), logp_BV.gather(1, tokens_B[:, None]).squeeze(1).tolist()


def sample_token(logits_V: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """`sample_batch` for one row: (id, log_softmax(logits / T)[id])."""
    tokens, logprobs = sample_batch(logits_V[None], [params], [generator])
    return tokens[0], logprobs[0]


class TransformersPolicy(Policy):
    """A Hugging Face causal LM served in-process, on CPU or GPU, with dynamic batching.

    Args:
        model: a `PreTrainedModel` (AutoModelForCausalLM); put it on its device before passing it.
        tokenizer: its tokenizer, with a chat template (or pass chat_template=).
        name: the policy's name in traces (default: the model's `name_or_path`).
        sampling: default sampling parameters for calls that do not override them.
        seed: seeds the generator that draws per-request seeds (requests with an explicit seed use it).
        max_batch_size: most requests decoded together.
        batch_wait_s: quiet period: the batcher stops collecting when no request arrived for this long.
        max_batch_wait_s: the batcher never waits longer than this for a batch to fill.
    """

    def __init__(self, model: Any, tokenizer: Any, *, name: str | None = None,
                 sampling: SamplingParams | None = None, seed: int = 0, max_batch_size: int = 32,
                 batch_wait_s: float = 0.002, max_batch_wait_s: float = 0.02, tool_parser: str = "hermes",
                 chat_template: str | None = None) -> None:
        name = name or str(getattr(model, "name_or_path", "") or type(model).__name__)
        super().__init__(tokenizer, name=name, sampling=sampling, tool_parser=tool_parser,
                         chat_template=chat_template)
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_batch_wait_s = max_batch_wait_s
        self.stats = BatchStats()
        self._seed_rng = random.Random(seed)
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._announced = 0
        self._state_lock = threading.Lock()
        self._weights_lock = threading.RLock()
        self._worker: threading.Thread | None = None
        self._pad_id = self._pick_pad_id()

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, gguf_file: str | None = None,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        **kwargs: Any) -> TransformersPolicy:
        """Load a model and its tokenizer from a local folder (or a GGUF file inside it) and serve it."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=dtype).to(device)
        kwargs.setdefault("name", os.path.basename(os.path.normpath(str(path))))
        return cls(model, tokenizer, **kwargs)

    # ---- public generation API --------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> concurrent.futures.Future:
        """Queue one request; the future resolves to a `Generation`."""
        if not prompt_ids:
            raise PolicyError(f"policy {self.name!r}: empty prompt")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._state_lock:
            seed = params.seed if params.seed is not None else self._seed_rng.randrange(2**63)
            self._ensure_worker()
        self._queue.put(_Request([int(t) for t in prompt_ids], params, seed, future))
        return future

    async def agenerate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        return await asyncio.wrap_future(self.submit(prompt_ids, params))

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        return self.submit(prompt_ids, params).result()

    @contextlib.contextmanager
    def announce(self) -> Iterator[None]:
        """Tell the batcher a request is being prepared, so it waits for it (up to max_batch_wait_s)."""
        with self._state_lock:
            self._announced += 1
        try:
            yield
        finally:
            with self._state_lock:
                self._announced -= 1

    @contextlib.contextmanager
    def updating_weights(self) -> Iterator[None]:
        """Hold generation while the weights change; the version increases by one on exit."""
        with self._weights_lock:
            yield
            self.version += 1

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the weights (no batch ever sees a mix of old and new) and bump the version."""
        with self.updating_weights():
            self.model.load_state_dict(state_dict)

    def close(self) -> None:
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=5)
            self._worker = None
        super().close()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(super().eos_token_ids)
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
        return tuple(sorted(ids))

    # ---- the batcher ------------------------------------------------------------------------
    def _pick_pad_id(self) -> int:
        for tid in (getattr(self.tokenizer, "pad_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if tid is not None:
                return int(tid)
        return 0

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._serve, name=f"{self.name}-batcher", daemon=True)
            self._worker.start()

    def _collect(self, first: _Request) -> tuple[list[_Request], bool]:
        batch, stop = [first], False
        start = last = time.monotonic()
        while len(batch) < self.max_batch_size:
            now = time.monotonic()
            waiting_for_announced = self._announced > 0
            quiet_left = (self.max_batch_wait_s if waiting_for_announced else self.batch_wait_s) - (now - last)
            timeout = min(quiet_left, self.max_batch_wait_s - (now - start))
            if timeout <= 0:
                break
            try:
                req = self._queue.get(timeout=timeout)
            except queue.Empty:
                if not self._announced:
                    break
                continue
            if req is None:
                stop = True
                break
            batch.append(req)
            last = time.monotonic()
        return batch, stop

    def _serve(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, stop = self._collect(first)
            live = [r for r in batch if r.future.set_running_or_notify_cancel()]
            if live:
                try:
                    with self._weights_lock:
                        gens = self._generate_batch(live)
                except BaseException as exc:  # noqa: BLE001 - every waiter must learn of the failure
                    err = PolicyError(f"policy {self.name!r} failed while generating: {type(exc).__name__}: {exc}")
                    err.__cause__ = exc
                    for r in live:
                        r.future.set_exception(err)
                else:
                    for r, g in zip(live, gens):
                        r.future.set_result(g)
            if stop:
                return

    @torch.inference_mode()
    def _generate_batch(self, reqs: list[_Request]) -> list[Generation]:
        B = len(reqs)
        self.stats.batches += 1
        self.stats.requests += B
        self.stats.max_batch = max(self.stats.max_batch, B)
        version = self.version
        L = max(len(r.prompt_ids) for r in reqs)
        ids_BL = torch.full((B, L), self._pad_id, dtype=torch.long)
        mask_BL = torch.zeros((B, L), dtype=torch.long)
        for i, r in enumerate(reqs):
            n = len(r.prompt_ids)
            ids_BL[i, L - n:] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask_BL[i, L - n:] = 1
        pos_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
        eos = set(self.eos_token_ids)
        stop_ids = [eos | set(r.params.stop_token_ids) for r in reqs]
        gens = [torch.Generator().manual_seed(r.seed) for r in reqs]
        out_ids: list[list[int]] = [[] for _ in reqs]
        out_lp: list[list[float]] = [[] for _ in reqs]
        reason: list[str | None] = [None] * B
        ids_BL, mask_BL, pos_BL = ids_BL.to(self.device), mask_BL.to(self.device), pos_BL.to(self.device)
        past = None
        cache_kw = self._cache_kwarg()
        adapters = adapter_kwargs(self.model, [r.params.adapter for r in reqs], policy=self.name)  # LoRA per row
        step_ids, step_pos = ids_BL, pos_BL
        for _ in range(max(r.params.max_new_tokens for r in reqs)):
            out = self.model(input_ids=step_ids, attention_mask=mask_BL, position_ids=step_pos,
                             use_cache=True, logits_to_keep=1, **{cache_kw: past}, **adapters)
            self.stats.forward_passes += 1
            past = getattr(out, cache_kw)
            logits_BV = out.logits[:, -1, :].float().cpu()
            live = [i for i in range(B) if reason[i] is None]
            tokens, logprobs = sample_batch(logits_BV[live], [reqs[i].params for i in live], [gens[i] for i in live])
            next_ids = [self._pad_id] * B
            for i, tok, lp in zip(live, tokens, logprobs):
                out_ids[i].append(tok)
                out_lp[i].append(lp)
                reason[i] = self._finish_reason(tok, out_ids[i], reqs[i].params, stop_ids[i])
                next_ids[i] = tok
            if all(x is not None for x in reason):
                break
            step_ids = torch.tensor(next_ids, dtype=torch.long, device=self.device).view(B, 1)
            mask_BL = torch.cat([mask_BL, torch.ones((B, 1), dtype=torch.long, device=self.device)], dim=1)
            step_pos = step_pos[:, -1:] + 1
        return [Generation(token_ids=o, logprobs=lp, finish_reason=rs or "length", policy_version=version)
                for o, lp, rs in zip(out_ids, out_lp, reason)]

    def _cache_kwarg(self) -> str:
        # transformers >= 5.x names the KV cache argument `cache`; older releases `past_key_values`
        model = self.model.get_base_model() if is_peft_model(self.model) else self.model
        params = inspect.signature(model.forward).parameters
        return "cache" if "cache" in params else "past_key_values"

    def _finish_reason(self, token: int, ids: list[int], params: SamplingParams, stop_ids: set[int]) -> str | None:
        if token in stop_ids:
            return "stop"
        if params.stop:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            if any(s in text for s in params.stop):
                return "stop"
        if len(ids) >= params.max_new_tokens:
            return "length"
        return None
