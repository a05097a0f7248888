"""Traces: every episode of a run, stored exactly, and what is done with stored episodes.

Owns `store.TraceStore` (one SQLite file per run; rows and their layout in `_serde`, summaries and counts in
`_queries`), `replay` (re-run a
graph with every LLM call answered from a recording, reporting the first divergence) and `weave_export`
(episodes and evaluations as W&B Weave traces).

May import: the shared modules (types, errors, config, env, policy, _chat, _structured) and
`instrumentation` (replay serves calls through the same interception point).
"""
