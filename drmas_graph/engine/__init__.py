"""The embedded policy backend: an in-process transformers model with continuous batching.

Owns `transformers_policy.TransformersPolicy` (the worker thread, admission, weight updates), `_decode` (the
shared left-padded KV cache of the rows in flight), `_sampling` (batched device-side sampling with
counter-based noise, and the logprob definitions the trainer recomputes), `_cpu_linear` (oneDNN-packed
linear layers on CPU), `_adapters` (LoRA adapters on a model, per batch row), `models` (SmolLM2 from PyPI)
and `tiny` (random-weight tiny models for tests; public as `drmas_graph.testing`).

May import: the shared modules only (types, errors, config, env, policy, _chat, _structured).
"""

from typing import Any as _Any

_SEAM = {  # public name -> the module that defines it; loaded on first use (no torch at `import drmas_graph.engine`)
    "is_peft_model": "drmas_graph.engine._adapters",
    "load_adapter_weights": "drmas_graph.engine._adapters",
    "entropy_from_logits": "drmas_graph.engine._sampling",
    "token_logprobs": "drmas_graph.engine._sampling",
}
"""The names other sub-packages (train/) use: LoRA adapters on a model, and the logprob definitions the
trainer recomputes exactly as the engine samples."""


def __getattr__(name: str) -> _Any:
    if name not in _SEAM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_SEAM[name]), name)
