"""Tiny models for tests: random weights built from a config and a tokenizer trained locally (no downloads).

`tiny_policy()` gives a real `TransformersPolicy` whose answers are gibberish but whose token ids,
logprobs, batching and weight updates are all real, so users can test their graph's wiring in seconds;
`scripted_policy([...])` replies with scripted texts through the same machinery. Defined in
`drmas_graph.engine.tiny` (the trainer builds `models.<name>.tiny` from there); this is their public name.
"""

from drmas_graph.engine.tiny import CHAT_TEMPLATE, ScriptedPolicy, scripted_policy, tiny_model, tiny_policy, tiny_tokenizer

__all__ = ["tiny_policy", "tiny_tokenizer", "tiny_model", "scripted_policy", "ScriptedPolicy", "CHAT_TEMPLATE"]
