"""Policies served by inference servers over HTTP: SGLang (primary) and vLLM, plus server lifecycle.

    from drmas_graph.served import SGLangPolicy, launch_sglang
    server = launch_sglang("/models/qwen")                      # or attach: SGLangPolicy("http://host:30000", ...)
    policy = SGLangPolicy(server.url, tokenizer, name="solver", servers=[server])
    ...
    policy.sync_weights(checkpoint_dir, version=step)           # pushed N == server's weight_version, else error

Needs `httpx` (extras `sglang` / `vllm`). The servers run in their own environments (see README).

May import: the shared modules (types, errors, config, env, policy, _chat, _structured) and
`instrumentation` (the running episode's id routes its requests to one server).
"""

from drmas_graph.served._base import ServedPolicy, SyncResult
from drmas_graph.served._errors import (BadRequestError, GenerationAbortedError, ServerError, ServerStartError,
                                        ServerUnavailableError, WeightSyncError)
from drmas_graph.served._lora import serve_adapters, vllm_launch_kwargs
from drmas_graph.served._process import LAUNCH_FLAGS, ServerProcess, free_port, owned_flag
from drmas_graph.served.sglang import SGLangPolicy, launch_sglang
from drmas_graph.served.vllm import VLLMPolicy, launch_vllm

__all__ = [
    "ServedPolicy", "SGLangPolicy", "VLLMPolicy", "ServerProcess", "launch_sglang", "launch_vllm", "free_port",
    "SyncResult", "ServerError", "ServerUnavailableError", "GenerationAbortedError", "BadRequestError",
    "WeightSyncError", "ServerStartError", "serve_adapters", "vllm_launch_kwargs", "owned_flag",
    "LAUNCH_FLAGS",
]
