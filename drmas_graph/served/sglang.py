"""`SGLangPolicy` and `launch_sglang`: token-in/token-out generation through SGLang's native API.

Protocol (SGLang 0.5.x, see docs/advanced_features/sglang_for_rl.md and the rollout-engines reference):

- `POST /generate {input_ids, sampling_params, return_logprob: true}`. `sampling_params` uses documented keys
  only (SGLang answers 400 to an unknown one). Ids come from `output_ids` (the stop/eos token is kept), the
  logprob of output token i from `meta_info.output_token_logprobs[i][0]`, the weights version from
  `meta_info.weight_version`. `finish_reason.type` stop/length/abort maps to 'stop'/'length'/'abort'; an
  abort (e.g. the server was paused for an update) raises `GenerationAbortedError` and is retried.
- Weight sync from disk: `POST /pause_generation {}` -> `POST /update_weights_from_disk {model_path,
  weight_version}` -> `POST /continue_generation {}`, then `GET /model_info` must report the pushed version.
- Readiness: `GET /health_generate` returns 200 (it runs a 1-token generation).

Logprobs: by default SGLang's sampler takes the logprobs after dividing by the temperature and before top-k/
top-p filtering, i.e. log_softmax(logits / T), our convention (greedy: T = 1). The environment variable
SGLANG_RETURN_ORIGINAL_LOGPROB=1 would switch it to pre-temperature logprobs, so `launch_sglang` sets it to
false. This is read from SGLang's sampler source and checked here only against the protocol double;
tests/gpu/sglang_check.py checks it against a real server (GPU), comparing with our own recomputation.
Reported elsewhere, not verified: SGLang may honour `sampling_seed` only with --enable-deterministic-inference.

Constrained decoding: a request decoded under a grammar (`SamplingParams.grammar`, `drmas_graph.grammar`) sends it
as `sampling_params.structural_tag`, which SGLang compiles with xgrammar (its default grammar backend). SGLang sets
the logits of the tokens the grammar disallows to -inf before its sampler (`SamplingBatchInfo.apply_logits_bias`,
then `Sampler`), so the logprobs it returns are those of the masked distribution, as the embedded engine records
and the trainer recomputes. Read from SGLang's source; checked against the protocol double only.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from typing import Any

from drmas_graph.served._base import ServedPolicy
from drmas_graph.served._lora import served_adapter
from drmas_graph.served._errors import BadRequestError, GenerationAbortedError, ServerError, WeightSyncError
from drmas_graph.served._process import ServerProcess, free_port
from drmas_graph.types import Generation, SamplingParams

__all__ = ["SGLangPolicy", "launch_sglang", "sglang_sampling_params"]


def sglang_sampling_params(params: SamplingParams, eos_token_ids: Sequence[int] = ()) -> dict[str, Any]:
    """Our `SamplingParams` as SGLang `sampling_params` (documented keys only)."""
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    stop_ids = sorted(set(params.stop_token_ids) | set(eos_token_ids))
    if stop_ids:
        out["stop_token_ids"] = stop_ids
    if params.seed is not None:
        out["sampling_seed"] = int(params.seed)
    if params.grammar is not None:  # the same structural tag the embedded engine decodes under (xgrammar)
        out["structural_tag"] = params.grammar
    return out


class SGLangPolicy(ServedPolicy):
    """A policy served by one or more SGLang servers (see `ServedPolicy` for routing, retries, concurrency).

    `version` starts at the server's `weight_version` when it is an integer (else 0) once `refresh_version()`
    or the first sync ran; each `Generation.policy_version` is the version the server reports for it.
    """

    async def _generate_once(self, url: str, prompt_ids: list[int], params: SamplingParams) -> Generation:
        served_adapter(self, params)  # merged weights: the request's adapter must be the one merged in
        sampling = {**sglang_sampling_params(params, self.eos_token_ids), **self.extra_sampling_params}
        body = {"input_ids": prompt_ids, "sampling_params": sampling,
                "return_logprob": True, "logprob_start_len": -1}
        reply = await self._request("POST", url + "/generate", json=body)
        return self._parse_generation(url, reply)

    def _parse_generation(self, url: str, reply: Any) -> Generation:
        if isinstance(reply, list) and len(reply) == 1:
            reply = reply[0]
        if not isinstance(reply, dict) or "output_ids" not in reply or "meta_info" not in reply:
            raise ServerError(f"policy {self.name!r}: {url}/generate reply has no output_ids/meta_info: "
                              f"{str(reply)[:300]}")
        meta = reply["meta_info"]
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else str(finish)
        if kind == "abort":
            raise GenerationAbortedError(f"policy {self.name!r}: {url} aborted the request: "
                                         f"{finish.get('message', '')}".rstrip(": "))
        if kind not in ("stop", "length"):
            raise ServerError(f"policy {self.name!r}: {url} returned an unknown finish_reason {finish!r}")
        ids = [int(t) for t in reply["output_ids"]]
        entries = meta.get("output_token_logprobs")
        if entries is None or len(entries) != len(ids):
            raise ServerError(f"policy {self.name!r}: {url} returned {len(ids)} output ids but "
                              f"{None if entries is None else len(entries)} logprob entries; was return_logprob lost?")
        logprobs = []
        for i, (entry, tid) in enumerate(zip(entries, ids)):
            if entry[0] is None or int(entry[1]) != tid:
                raise ServerError(
                    f"policy {self.name!r}: {url} logprob entry {i} {entry!r} does not match output id {tid}")
            logprobs.append(float(entry[0]))
        return Generation(token_ids=ids, logprobs=logprobs, finish_reason=kind,
                          policy_version=self._parse_version(meta.get("weight_version")))

    def _parse_version(self, weight_version: Any) -> int:
        if weight_version is None or weight_version == "default":
            return self.version
        try:
            return int(weight_version)
        except (TypeError, ValueError):
            raise ServerError(f"policy {self.name!r}: server weight_version {weight_version!r} is not an integer; "
                              "launch it with --weight-version 0 or sync weights with an integer version") from None

    async def _model_info(self, url: str) -> dict:
        return await self._request("GET", url + "/model_info")

    async def _gather_versions(self) -> dict[str, int]:
        values = await asyncio.gather(*(self._version_of(u) for u in self.base_urls))
        return dict(zip(self.base_urls, values))

    def refresh_version(self) -> int:
        """Set `version` from the servers' `weight_version` (they must agree); return it."""
        versions = self._run_blocking(self._gather_versions)
        distinct = set(versions.values())
        if len(distinct) != 1:
            raise WeightSyncError(f"policy {self.name!r}: servers report different weight versions: {versions}")
        self.version = distinct.pop()
        return self.version

    async def _version_of(self, url: str) -> int:
        return self._parse_version((await self._model_info(url)).get("weight_version"))

    _sync_drains = False  # pause_generation aborts in-flight requests; they are retried after the update

    async def _sync_one(self, url: str, checkpoint_dir: str, version: int) -> dict:
        await self._request("POST", url + "/pause_generation", json={})
        try:
            reply = await self._request("POST", url + "/update_weights_from_disk", timeout=max(self.timeout_s, 600),
                                        json={"model_path": checkpoint_dir, "weight_version": str(version)})
        except BadRequestError as exc:  # SGLang answers a failed load with 400 {"success": false, "message"}
            raise WeightSyncError(f"policy {self.name!r}: {url} failed to load {checkpoint_dir!r}: {exc}") from exc
        finally:
            await self._request("POST", url + "/continue_generation", json={})
        if not isinstance(reply, dict) or not reply.get("success", False):
            raise WeightSyncError(f"policy {self.name!r}: {url} failed to load {checkpoint_dir!r}: {reply!r}")
        reported = (await self._model_info(url)).get("weight_version")
        if str(reported) != str(version):
            raise WeightSyncError(f"policy {self.name!r}: weight sync to {url}: pushed {version}, server reports "
                                  f"{reported}; stopping (the server may have loaded other weights)")
        return reply


def launch_sglang(model_path: str, *, port: int | None = None, host: str = "127.0.0.1", dtype: str = "auto",
                  extra_args: Sequence[str] = (), python: str | None = None, weight_version: int = 0,
                  ready_timeout_s: float = 600.0, env: dict[str, str] | None = None,
                  log_path: str | None = None) -> ServerProcess:
    """Start `python -m sglang.launch_server` on `model_path` and wait until `/health_generate` answers 200.

    `python` is the interpreter of the environment with sglang (default: this one). The server binds
    `host` (127.0.0.1) and starts at `--weight-version weight_version`. Returns the `ServerProcess`
    (stop it with `close()`; it is also stopped at exit).
    """
    port = port or free_port(host)
    argv = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", os.fspath(model_path),
            "--host", host, "--port", str(port), "--dtype", dtype, "--weight-version", str(weight_version),
            *extra_args]
    env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false", **(env or {})}  # logprobs after temperature (ours)
    server = ServerProcess(argv, url=f"http://{host}:{port}", ready_path="/health_generate", env=env,
                           log_path=log_path, name="sglang")
    server.wait_ready(ready_timeout_s)
    return server
