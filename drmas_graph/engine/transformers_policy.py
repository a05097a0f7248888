"""`TransformersPolicy`: the embedded default backend, an in-process transformers model with continuous batching.

Requests from any thread or event loop go to one worker thread. When idle, the worker takes the first
waiting request and keeps collecting for a short quiet period (`batch_wait_s` after the last arrival, at
most `max_batch_wait_s` in all, longer while callers have announced a request they are still rendering).
While rows decode, requests that arrive join the batch at the next step and finished rows leave at once
(`_decode.DecodeBatch`): prompts are left-padded into one KV cache, identical prompts admitted together
are prefilled once and share their cache rows, a prompt that continues a recent prompt or reply (the next
turn) prefills only its new suffix, and sampling runs on the model's device for all rows in one
batched operation whose noise is keyed by (request seed, token position) (`_sampling`), so what a request
samples never depends on what else is in the batch.

Each `Generation` carries its share of the engine's seconds (`prefill_s`, `decode_s`: a decode step split equally
among its rows, a prefill pass by token share; `_decode`); `stats` holds the totals.

Logprobs are log_softmax(logits / temperature) at the sampled token, before top-k/top-p truncation
(temperature 0 = greedy, logprobs at temperature 1): the trainer recomputes the same quantity.

`run_on_worker(fn)` runs other work on the model (the trainer's update and logprob passes) on the same
worker thread, between batches. On CPU this matters: torch's OpenMP runtime (GNU libgomp) keeps one
thread team per OS thread that ever ran a parallel region, and once the teams together hold more threads
than there are cores it cuts the spin-wait of idle team threads from 300,000 to 100 iterations. The
decode loop's many short parallel regions then wake sleeping threads every time: measured on 2 cores,
one parallel region on another thread made the engine 22% slower for the rest of the process
(377 -> 295 tokens/s on the ragged benchmark).
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
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from drmas_graph.engine._adapters import adapter_kwargs, is_peft_model
from drmas_graph.engine._decode import DecodeBatch, EngineStats, Request, context_size
from drmas_graph.engine._sampling import RowParams, sample_rows, vocab_hash
from drmas_graph.errors import GrammarError, PolicyError
from drmas_graph.policy import Policy
from drmas_graph.types import Generation, SamplingParams

__all__ = ["TransformersPolicy", "sample_batch", "sample_token"]

BatchStats = EngineStats  # the engine's counters, under their earlier name
_Request = Request


class _Call:
    """A function queued to run on the worker thread (`run_on_worker`)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.future: concurrent.futures.Future = concurrent.futures.Future()

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self.fn())
        except BaseException as exc:  # noqa: BLE001 - the caller re-raises it
            self.future.set_exception(exc)


def sample_batch(logits_BV: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
                 positions: Sequence[int]) -> tuple[list[int], list[float]]:
    """Sample one token per row on the logits' device; return the ids and log_softmax(logits / T) at them.

    Row i's draw is a pure function of (seeds[i], positions[i]) and its own logits: the embedded engine's
    sampler (`_sampling.sample_rows`), for protocol doubles and tests. Temperature 0 rows take the argmax
    and report logprobs at T = 1; logprobs ignore top-k/top-p truncation.
    """
    V, device = logits_BV.shape[-1], logits_BV.device
    rp = RowParams.build(params, seeds, V, device)
    ids_B, lp_B = sample_rows(logits_BV, rp, torch.tensor(list(positions), dtype=torch.int32, device=device),
                              vocab_hash(V, device))
    return ids_B.tolist(), lp_B.tolist()


def sample_token(logits_V: torch.Tensor, params: SamplingParams, seed: int, position: int) -> tuple[int, float]:
    """`sample_batch` for one row: (id, log_softmax(logits / T)[id]) for the token at `position` of a response."""
    tokens, logprobs = sample_batch(logits_V[None], [params], [seed], [position])
    return tokens[0], logprobs[0]


class TransformersPolicy(Policy):
    """A Hugging Face causal LM served in-process, on CPU or GPU, with continuous batching.

    Args:
        model: a `PreTrainedModel` (AutoModelForCausalLM); put it on its device before passing it.
        tokenizer: its tokenizer, with a chat template (or pass chat_template=).
        name: the policy's name in traces (default: the model's `name_or_path`).
        sampling: default sampling parameters for calls that do not override them.
        seed: seeds the generator that draws per-request seeds (requests with an explicit seed use it).
        max_batch_size: most requests decoded together (later arrivals wait for a free slot).
        tool_parser: how tool calls are read back from generated text (`hermes`, `mistral`, `none`).
        chat_template: a Jinja chat template (its text) rendering the prompts instead of the tokenizer's own, e.g. one
            that renders `tools` where the model's own drops them; parsed here (a `ConfigError` names the line).
            In the YAML: `models.<name>.chat_template`, a file.
        batch_wait_s: quiet period: an idle batcher stops collecting when no request arrived for this long.
        max_batch_wait_s: an idle batcher never waits longer than this for a batch to fill.
        prompt_cache_size: recent prompts (and, with prefix_reuse, finished rows) whose KV rows are kept: an
            identical later prompt (a GRPO group member that arrives a step late) reuses them all; 0 turns the
            cache off.
        prefix_reuse: a prompt sharing a prefix with a cached prompt or finished row (an episode's next
            turn) prefills only its suffix on those KV rows (1.28x on a 4-turn SmolLM2 workload,
            docs/benchmarks.md). Off by default: the logprobs differ from a full prefill's by float summation
            order (up to 4.8e-7 measured), and whether a prompt hits depends on when others arrive, so
            seeded runs would no longer be bit-identical at every max_concurrency.
        packed_cpu_linear: on CPU, run the linear layers of generation on oneDNN with packed weights
            (`_cpu_linear`; several times faster decoding, one more copy of the weights in memory).
        lean_forward: with packed_cpu_linear, run Llama / Mistral / Qwen2 models' forward passes of generation as
            one lean function with q/k/v and gate/up fused (`_lean`; decode steps 8-16% shorter at batches 1-16
            on SmolLM2-135M). Checked against the model's own logits before its first use (off, and logged,
            where they differ or the model is another kind). Off by default: it did not shorten the demo
            measurably, and its logits equal the model's only up to float summation order (a seeded run may
            sample another token now and then than without it). Only with batch_invariant off: its attention
            is not computed row by row (with batch_invariant on, the model's own forward runs, logged).
        batch_invariant: on CPU, compute the attention of each row on its own columns (`_row_attention`), so that a
            row's tokens and logprobs are the same bits whatever it is batched with (and a seeded run the same at
            any max_concurrency). Off: decode steps ~10% shorter on the demo's workload, but a row's logprobs
            depend on its batch by ~1e-5 and a seeded run may sample another token now and then. Has no effect
            on a GPU (not implemented there: its matmul kernels are chosen by shape).
        constrain: decode each call under the grammar of the format it asks for (JSON mode, a JSON schema, tool
            calls: `drmas_graph.grammar`), as the real APIs guarantee it; False: free text, checked afterwards.
    """

    def __init__(self, model: Any, tokenizer: Any, *, name: str | None = None,
                 sampling: SamplingParams | None = None, seed: int = 0, max_batch_size: int = 32,
                 batch_wait_s: float = 0.002, max_batch_wait_s: float = 0.02, tool_parser: str = "hermes",
                 chat_template: str | None = None, prompt_cache_size: int = 16, prefix_reuse: bool = False,
                 packed_cpu_linear: bool = True, lean_forward: bool = False, batch_invariant: bool = True,
                 constrain: bool = True) -> None:
        name = name or str(getattr(model, "name_or_path", "") or type(model).__name__)
        super().__init__(tokenizer, name=name, sampling=sampling, tool_parser=tool_parser,
                         chat_template=chat_template, constrain=constrain)
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_batch_wait_s = max_batch_wait_s
        self.prompt_cache_size = prompt_cache_size
        self.prefix_reuse = prefix_reuse
        self.packed_cpu_linear = packed_cpu_linear
        self.lean_forward = lean_forward
        self.batch_invariant = batch_invariant
        self.stats = EngineStats()
        self._seed_rng = random.Random(seed)
        self._queue: queue.Queue[Request | _Call | None] = queue.Queue()
        self._calls: deque[_Call] = deque()
        self._announced = 0
        self._updates_waiting = 0
        self._state_lock = threading.Lock()
        self._weights_lock = threading.RLock()
        self._worker: threading.Thread | None = None
        self._pad_id = self._pick_pad_id()
        self.context_size = context_size(model)
        """The model's positions (config `max_position_embeddings`, GPT-2's `n_positions`), None if unknown: a
        longer prompt is refused, and generation stops ('length') where the context ends."""

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
        if self.context_size is not None and len(prompt_ids) > self.context_size:  # fails this request only
            future.set_exception(PolicyError(
                f"policy {self.name!r}: the prompt has {len(prompt_ids)} tokens, more than the model's context of "
                f"{self.context_size} positions: shorten the prompt (the messages the node sends) or serve a model "
                "with a longer context"))
            return future
        try:  # compiled here (cached by its text), so a grammar the library refuses fails this request only
            grammar = self.grammars.compile(params.grammar) if params.grammar is not None else None
        except GrammarError as exc:
            future.set_exception(exc)
            return future
        with self._state_lock:
            seed = params.seed if params.seed is not None else self._seed_rng.randrange(2**63)
            self._ensure_worker()
        self._queue.put(Request([int(t) for t in prompt_ids], params, seed, future, grammar))
        return future

    def run_on_worker(self, fn: Any) -> Any:
        """Run `fn()` on the generation worker thread when no rows are decoding; return its result (or raise).

        The trainer runs its update and logprob passes of this policy's model here, so that one OS thread
        does all of the model's compute (see the module docstring: on CPU a second thread running torch
        ops slows decoding down for the rest of the process). Generation requests wait while `fn` runs;
        a call made from the worker thread itself runs at once. Safe inside `updating_weights()`, also when
        requests arrive meanwhile: the worker never waits for the weights, it runs the queued calls while an
        update holds them and admits the requests after it.
        """
        if threading.current_thread() is self._worker:
            return fn()
        call = _Call(fn)
        with self._state_lock:
            self._ensure_worker()
        self._queue.put(call)
        return call.future.result()

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
        """Hold generation while the weights change; the version increases by one on exit.

        Rows already decoding finish on the old weights first; requests that arrive meanwhile wait.
        """
        with self._state_lock:
            self._updates_waiting += 1
        try:
            with self._weights_lock:
                yield
                self.version += 1
        finally:
            with self._state_lock:
                self._updates_waiting -= 1

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
    def vocab_size(self) -> int:
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        if head is not None and getattr(head, "weight", None) is not None:
            return int(head.weight.shape[0])
        return int(getattr(self.model.config, "vocab_size", 0) or len(self.tokenizer))

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
            if isinstance(req, _Call):  # run it before this batch starts
                self._calls.append(req)
                break
            batch.append(req)
            last = time.monotonic()
        return batch, stop

    def _drain(self, pending: deque[Request]) -> bool:
        """Move every queued request to `pending` without waiting; True when close() was requested."""
        while True:
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                return False
            if req is None:
                return True
            if isinstance(req, _Call):
                self._calls.append(req)
            else:
                pending.append(req)

    def _serve(self) -> None:
        engine = DecodeBatch(self.model, self.tokenizer, pad_id=self._pad_id, eos_ids=self.eos_token_ids,
                             cache_kwarg=self._cache_kwarg(), stats=self.stats,
                             prompt_cache_size=self.prompt_cache_size, prefix_reuse=self.prefix_reuse,
                             packed_cpu_linear=self.packed_cpu_linear,
                             row_kwargs=lambda adapters: adapter_kwargs(self.model, adapters, policy=self.name),
                             context_size=self.context_size, lean_forward=self.lean_forward,
                             batch_invariant=self.batch_invariant)
        pending: deque[Request] = deque()
        stop = holding = False
        try:
            while True:
                if not len(engine):
                    if holding:  # between batches the weights may change
                        self._weights_lock.release()
                        holding = False
                    if self._calls:
                        self._calls.popleft().run()
                        continue
                    if self._updates_waiting:
                        stop = self._drain(pending) or stop  # a call from the updater may be queued
                        if not self._calls:
                            time.sleep(0.001)
                        continue
                    if not pending:
                        if stop:
                            return
                        first = self._queue.get()
                        if first is None:
                            return
                        if isinstance(first, _Call):
                            self._calls.append(first)
                            continue
                        batch, stop = self._collect(first)
                        pending.extend(batch)
                else:
                    stop = self._drain(pending) or stop
                if not holding:
                    # never block on the weights: an update holding them may queue a call (run_on_worker) and
                    # wait for this thread; back at the top, the idle branch runs its calls until it is done
                    if not self._weights_lock.acquire(blocking=False):
                        continue
                    holding = True
                admit = self._admit(pending, engine)
                if admit or len(engine):
                    self._run_step(engine, admit)
        finally:
            if holding:
                self._weights_lock.release()
            while self._calls:  # closed (or failed) with calls queued: their callers must not hang
                call = self._calls.popleft()
                if call.future.set_running_or_notify_cancel():
                    call.future.set_exception(PolicyError(f"policy {self.name!r} was closed before the call ran"))

    def _admit(self, pending: deque[Request], engine: DecodeBatch) -> list[Request]:
        """Newcomers for the next step: free slots, no weight update or call waiting, a cache that can take them."""
        admit: list[Request] = []
        if self._updates_waiting or self._calls or not engine.can_join:
            return admit
        while pending and len(engine) + len(admit) < self.max_batch_size:
            req = pending.popleft()
            if req.future.set_running_or_notify_cancel():
                admit.append(req)
        return admit

    def _run_step(self, engine: DecodeBatch, admit: list[Request]) -> None:
        try:
            finished = self._engine_step(engine, admit)
        except BaseException as exc:  # noqa: BLE001 - every waiter must learn of the failure
            err = PolicyError(f"policy {self.name!r} failed while generating: {type(exc).__name__}: {exc}")
            err.__cause__ = exc
            for req in [row.req for row in engine.rows] + admit:
                if not req.future.done():
                    req.future.set_exception(err)
            engine.clear()
            return
        for req, gen in finished:
            req.future.set_result(gen)

    def _engine_step(self, engine: DecodeBatch, admit: list[Request]) -> list[tuple[Request, Generation]]:
        """One engine step (decode the active rows, prefill `admit`); the requests that finished."""
        return engine.step(admit, self.version)

    def _cache_kwarg(self) -> str:
        # transformers >= 5.x names the KV cache argument `cache`; older releases `past_key_values`
        model = self.model.get_base_model() if is_peft_model(self.model) else self.model
        params = inspect.signature(model.forward).parameters
        return "cache" if "cache" in params else "past_key_values"
