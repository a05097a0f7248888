"""`ServedPolicy`: the shared half of the HTTP backends (SGLang, vLLM).

One `httpx.AsyncClient` (connection pool) and one `asyncio.Semaphore` per policy, both living on the
policy's background event loop: every call, from any thread or loop, hops onto that loop first, so the
client is never used from a loop it was not created on.

Routing over several servers: a call with a route key (by default the id of the instrumented episode the
call belongs to) goes to the server that key was first given, so an episode's growing prompt keeps hitting
the same prefix cache; calls without a key go round-robin. A server that refuses connections is skipped
on the retry.

Failures: connection errors, timeouts, 502/503/504 and aborted requests are retried `max_retries` times
with exponential backoff, then raised as a `PolicyError` subclass (the rollout records the episode as
failed, never half-recorded). A 400 (unknown sampling key, bad body) is raised at once as `BadRequestError`.

Weight syncs and generation are mutually exclusive from this policy's point of view: a sync waits for the
policy's in-flight requests (they finish on the old weights and keep its version; SGLang aborts them instead
and they are retried on the new weights) and holds new ones until the server reports the new version. A sync
given `timeout_s` (asynchronous training) fails past it with a `WeightSyncError` naming the servers that did not
answer and the requests still in flight.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from drmas_graph.instrumentation import active_handler
from drmas_graph.errors import ConfigError
from drmas_graph.policy import Policy
from drmas_graph.served._errors import (BadRequestError, GenerationAbortedError, ServerError,
                                        ServerUnavailableError, WeightSyncError)
from drmas_graph.served._process import ServerProcess
from drmas_graph.types import Generation, SamplingParams

__all__ = ["ServedPolicy", "SyncResult"]

log = logging.getLogger(__name__)

_RETRY_STATUS = {502, 503, 504}
_MAX_ROUTES = 100_000


class SyncResult(dict):
    """What a weight sync did: 'version', 'seconds', per-server 'servers' replies (a plain dict)."""


def current_route_key() -> str | None:
    """The id of the instrumented episode running in this context, if any (the default route key)."""
    handler = active_handler()
    episode = getattr(handler, "episode", None)
    return getattr(episode, "id", None)


class ServedPolicy(Policy, abc.ABC):
    """A `Policy` whose model runs in one or more inference servers reached over HTTP.

    Args:
        base_urls: one URL or a list (`http://127.0.0.1:30000`); several = scale-out with sticky routing.
        tokenizer: the served model's tokenizer (prompts are rendered and responses decoded here).
        name: the policy's name in traces.
        sampling: default sampling parameters.
        max_concurrency: most requests in flight from this policy (all servers together).
        timeout_s: per-request read timeout (a generation must finish within it).
        connect_timeout_s: TCP connect timeout.
        max_retries: retries after the first attempt for retryable failures.
        backoff_s: first retry delay; doubles each retry (capped at 8x).
        servers: `ServerProcess`es this policy owns; `close()` stops them.
        seed: seeds the generator that draws a sampling seed for direct requests without one (in arrival
            order); None sends none (server randomness). Calls of instrumented rollouts started by the trainer
            always carry a seed derived from the call's identity (`drmas_graph.instrumentation._seeds`), so they never use it.
        extra_sampling_params: engine-specific sampling keys sent with every request as they are
            (e.g. `{"repetition_penalty": 1.1}`); the server rejects unknown ones (`BadRequestError`).
        constrain: decode each call under the grammar of the format it asks for (the server's structured outputs,
            `drmas_graph.grammar`); False: free text.
    """

    def __init__(self, base_urls: str | Sequence[str], tokenizer: Any, *, name: str,
                 sampling: SamplingParams | None = None, max_concurrency: int = 64, timeout_s: float = 300.0,
                 connect_timeout_s: float = 5.0, max_retries: int = 3, backoff_s: float = 0.5,
                 servers: Sequence[ServerProcess] = (), seed: int | None = 0, extra_sampling_params: dict[str, Any] | None = None,
                 tool_parser: str = "hermes",
                 chat_template: str | None = None, constrain: bool = True) -> None:
        super().__init__(tokenizer, name=name, sampling=sampling, tool_parser=tool_parser,
                         chat_template=chat_template, constrain=constrain)
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ConfigError(f"policy {name!r}: base_urls is empty; pass at least one server URL")
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ConfigError(f"policy {name!r}: base URL {u!r} must start with http:// or https://")
        if max_concurrency < 1 or max_retries < 0:
            raise ConfigError(f"policy {name!r}: max_concurrency must be >= 1 and max_retries >= 0")
        self.base_urls = [u.rstrip("/") for u in urls]
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.servers = list(servers)
        self.extra_sampling_params = dict(extra_sampling_params or {})
        self._seed_rng = random.Random(seed) if seed is not None else None
        self.retries = 0
        """Retried attempts so far (all causes), for metrics and tests."""
        self._client: httpx.AsyncClient | None = None
        self._sem: asyncio.Semaphore | None = None
        self._rr = 0
        self._routes: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._in_flight = 0
        self._idle: asyncio.Event | None = None
        self._open: asyncio.Event | None = None

    # ---- loop plumbing ----------------------------------------------------------------------
    async def _on_loop(self, coro_fn, *args, **kwargs):
        """Run `coro_fn(*args, **kwargs)` on the policy's background loop and await it from here."""
        loop = self._background_loop()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            return await coro_fn(*args, **kwargs)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro_fn(*args, **kwargs), loop))

    def _run_blocking(self, coro_fn, *args, **kwargs):
        return asyncio.run_coroutine_threadsafe(coro_fn(*args, **kwargs), self._background_loop()).result()

    def _state(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        if self._client is None:
            limits = httpx.Limits(max_connections=self.max_concurrency + 8,
                                  max_keepalive_connections=self.max_concurrency)
            timeout = httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s)
            self._client = httpx.AsyncClient(limits=limits, timeout=timeout)
            self._sem = asyncio.Semaphore(self.max_concurrency)
            self._idle = asyncio.Event()
            self._idle.set()
            self._open = asyncio.Event()
            self._open.set()
        return self._client, self._sem

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                 route_key: str | None = None) -> Generation:
        route_key = route_key if route_key is not None else current_route_key()
        return self._run_blocking(self._generate, list(prompt_ids), params, route_key)

    async def agenerate(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                        route_key: str | None = None) -> Generation:
        """Sample one response; `route_key` (default: the current episode id) pins the call to one server."""
        route_key = route_key if route_key is not None else current_route_key()
        return await self._on_loop(self._generate, list(prompt_ids), params, route_key)

    async def _generate(self, prompt_ids: list[int], params: SamplingParams, route_key: str | None) -> Generation:
        if not prompt_ids:
            raise BadRequestError(f"policy {self.name!r}: empty prompt")
        if params.seed is None and self._seed_rng is not None:
            params = params.replace(seed=self._seed_rng.randrange(2**31))
        _, sem = self._state()
        async with sem:
            attempt = 0
            exclude: set[int] = set()
            while True:
                idx = self._pick(route_key, exclude)
                url = self.base_urls[idx]
                try:
                    async with self._generating():
                        return await self._generate_once(url, prompt_ids, params)
                except (ServerUnavailableError, GenerationAbortedError) as exc:
                    if isinstance(exc, ServerUnavailableError) and len(self.base_urls) > 1:
                        exclude.add(idx)
                        if len(exclude) == len(self.base_urls):
                            exclude.clear()
                    if attempt >= self.max_retries:
                        raise type(exc)(f"{exc} (gave up after {attempt + 1} attempts)") from exc
                    attempt += 1
                    self.retries += 1
                    delay = self.backoff_s * min(2 ** (attempt - 1), 8)
                    log.warning("policy %r: %s; retry %d/%d in %.2f s", self.name, exc, attempt,
                                self.max_retries, delay)
                    await asyncio.sleep(delay)

    @abc.abstractmethod
    async def _generate_once(self, url: str, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """One HTTP generation attempt against `url`."""

    def _pick(self, route_key: str | None, exclude: set[int]) -> int:
        n = len(self.base_urls)
        if n == 1:
            return 0
        if route_key is not None and route_key in self._routes and self._routes[route_key] not in exclude:
            self._routes.move_to_end(route_key)
            return self._routes[route_key]
        for _ in range(n):
            idx = self._rr % n
            self._rr += 1
            if idx not in exclude:
                break
        if route_key is not None:
            self._routes[route_key] = idx
            self._routes.move_to_end(route_key)
            while len(self._routes) > _MAX_ROUTES:
                self._routes.popitem(last=False)
        return idx

    def route_of(self, route_key: str) -> str | None:
        """The server URL a route key is pinned to (None if it has not been routed yet)."""
        idx = self._routes.get(route_key)
        return None if idx is None else self.base_urls[idx]

    # ---- generation vs weight sync ----------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _generating(self) -> AsyncIterator[None]:
        self._state()
        await self._open.wait()
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def _exclusive(self, drain: bool = True) -> AsyncIterator[None]:
        """Hold new generations; with `drain`, also wait for the ones in flight to finish."""
        self._state()
        while not self._open.is_set():  # another sync is running
            await self._open.wait()
        self._open.clear()
        try:
            if drain:
                await self._idle.wait()
            yield
        finally:
            self._open.set()

    # ---- weight sync ------------------------------------------------------------------------
    async def sync_weights_from_disk(self, checkpoint_dir: str, version: int, *,
                                     timeout_s: float | None = None) -> SyncResult:
        """Load a Hugging Face checkpoint folder into every server and set `self.version = version`.

        Raises `WeightSyncError` if a server fails or reports another version than `version`, or when the
        sync (waiting for the requests in flight included) takes longer than `timeout_s`.
        """
        return await self._on_loop(self._sync_weights, str(checkpoint_dir), int(version), timeout_s)

    def sync_weights(self, checkpoint_dir: str, version: int, *, timeout_s: float | None = None) -> SyncResult:
        """Blocking `sync_weights_from_disk`."""
        return self._run_blocking(self._sync_weights, str(checkpoint_dir), int(version), timeout_s)

    async def _sync_weights(self, checkpoint_dir: str, version: int, timeout_s: float | None = None) -> SyncResult:
        start = time.perf_counter()
        answered: set[str] = set()

        async def one(url: str) -> dict:
            reply = await self._sync_one(url, checkpoint_dir, version)
            answered.add(url)
            return reply

        try:
            async with asyncio.timeout(timeout_s), self._exclusive(drain=self._sync_drains):
                replies = await asyncio.gather(*(one(url) for url in self.base_urls))
                self.version = version
        except TimeoutError:
            silent = [u for u in self.base_urls if u not in answered]
            raise WeightSyncError(
                f"policy {self.name!r}: weight sync to version {version} did not finish within {timeout_s:g} s: "
                f"no answer from {', '.join(silent)} ({self._in_flight} request(s) of this policy still in flight, "
                "waiting to finish on the old weights); check the server's log") from None
        return SyncResult(version=version, seconds=time.perf_counter() - start,
                          servers=dict(zip(self.base_urls, replies)))

    _sync_drains = True
    lora_by_name: tuple[str, ...] = ()
    """LoRA adapters the servers load by name (`drmas_graph.served._lora.serve_adapters`); requests name theirs."""
    lora_merged: str | None = None
    """The LoRA adapter merged into the served weights; every request names it."""
    """Whether a sync waits for this policy's in-flight requests (SGLang aborts them instead)."""

    @abc.abstractmethod
    async def _sync_one(self, url: str, checkpoint_dir: str, version: int) -> dict:
        """Load the checkpoint into the server at `url` and verify it reports `version`."""

    # ---- HTTP helpers -----------------------------------------------------------------------
    async def _request(self, method: str, url: str, *, json: Any = None, params: Any = None,
                       timeout: float | None = None, text: bool = False) -> Any:
        """One HTTP call; JSON reply (`text`: the reply's text), or None when empty. Maps transport failures
        to `ServerUnavailableError`."""
        client, _ = self._state()
        kwargs: dict[str, Any] = {"json": json, "params": params}
        if timeout is not None:
            kwargs["timeout"] = httpx.Timeout(timeout, connect=self.connect_timeout_s)
        try:
            resp = await client.request(method, url, **kwargs)
        except httpx.TimeoutException as exc:
            raise ServerUnavailableError(
                f"policy {self.name!r}: {method} {url} timed out ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise ServerUnavailableError(
                f"policy {self.name!r}: {method} {url} failed: {type(exc).__name__}: {exc}") from exc
        if resp.status_code in _RETRY_STATUS:
            raise ServerUnavailableError(f"policy {self.name!r}: {method} {url} -> HTTP {resp.status_code}: "
                                         f"{resp.text[:500]}")
        if resp.status_code in (400, 422):
            raise BadRequestError(f"policy {self.name!r}: {method} {url} rejected the request "
                                  f"(HTTP {resp.status_code}): {resp.text[:1000]}")
        if resp.status_code >= 300:
            raise ServerError(f"policy {self.name!r}: {method} {url} -> HTTP {resp.status_code}: {resp.text[:1000]}")
        if not resp.content:
            return None
        if text:
            return resp.text
        try:
            return resp.json()
        except ValueError as exc:
            raise ServerError(f"policy {self.name!r}: {method} {url} returned non-JSON: {resp.text[:300]!r}") from exc

    # ---- lifecycle --------------------------------------------------------------------------
    async def _aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def close(self) -> None:
        """Close the connection pool, stop owned servers, stop the background loop."""
        if self._loop is not None and self._client is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._aclose(), self._loop).result(timeout=5)
        for server in self.servers:
            server.close()
        super().close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
