"""The embedded policy backend: an in-process transformers model with continuous batching.

Owns `transformers_policy.TransformersPolicy` (the worker thread, admission, weight updates), `_decode` (the
shared left-padded KV cache of the rows in flight), `_sampling` (batched device-side sampling with
counter-based noise, and the logprob definitions the trainer recomputes), `_cpu_linear` (oneDNN-packed
linear layers on CPU), `_adapters` (LoRA adapters on a model, per batch row), `models` (SmolLM2 from PyPI),
`tiny` (random-weight tiny models for tests; public as `drmas_graph.testing`), `_from_config` (a policy from a
model entry of the config, on this process's device) and `_world` (who this process is in a launched run).

May import: the shared modules only (types, errors, config, env, policy, _chat, _structured).
"""

from typing import Any as _Any

_SEAM = {  # public name -> the module that defines it; loaded on first use (no torch at `import drmas_graph.engine`)
    "is_peft_model": "drmas_graph.engine._adapters",
    "load_adapter_weights": "drmas_graph.engine._adapters",
    "entropy_from_logits": "drmas_graph.engine._sampling",
    "token_logprobs": "drmas_graph.engine._sampling",
    "build_policy": "drmas_graph.engine._from_config",
    "local_device": "drmas_graph.engine._from_config",
    "resolve_model_path": "drmas_graph.engine._from_config",
    "world_size": "drmas_graph.engine._world",
    "rank": "drmas_graph.engine._world",
    "local_rank": "drmas_graph.engine._world",
    "group_initialized": "drmas_graph.engine._world",
}
"""The names other sub-packages (train/, rewards/) use: LoRA adapters on a model, the logprob definitions the
trainer recomputes exactly as the engine samples, a policy from a model config (the trainer's and the judge's
embedded models) and this process's place in a launched run (one answer for the whole package)."""


def __getattr__(name: str) -> _Any:
    if name not in _SEAM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_SEAM[name]), name)
