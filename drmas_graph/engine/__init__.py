"""The embedded policy backend: an in-process transformers model with continuous batching.

Owns `transformers_policy.TransformersPolicy` (the worker thread, admission, weight updates), `_decode` (the
shared left-padded KV cache of the rows in flight), `_sampling` (batched device-side sampling with
counter-based noise, and the logprob definitions the trainer recomputes), `_cpu_linear` (oneDNN-packed
linear layers on CPU), `_adapters` (LoRA adapters on a model, per batch row), `models` (SmolLM2 from PyPI)
and `tiny` (random-weight tiny models for tests; public as `drmas_graph.testing`).

May import: the shared modules only (types, errors, config, env, policy, _chat, _structured).
"""
