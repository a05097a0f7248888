"""Training: agent-wise GRPO (Dr. MAS) over an instrumented graph.

One step, and the module of each part: `trainer` (the loop, `train_graph`) -> `_rollouts` (G concurrent
episodes per task, each with its own config, seed and limits) -> `_scoring` (rewards, `advantages.
compute_advantages`, the step's metrics) -> `update.ModelUpdater` (the optimizer step: `losses`, `_logprobs`,
`_old_logprobs`, `_reference`, micro-batches packed into sequence trees in `_packing`, the optimizer backends in
`_engines`, settings in `_settings`, metrics in `_update_metrics`; `lora.LoraUpdater` for one adapter per agent;
both implement `_updater.Updater`) -> `_checkpoints` (weights to servers,
checkpoints, resume) -> `evaluate` (avg@k, pass@k). Also: `_build` (policies and updaters from the config),
`_distributed` (several processes under a launcher), `metrics` (where metrics go), `rescore` (new rewards and
advantages for a stored run).

May import: every layer below it (shared modules, instrumentation, engine, served, traces).
"""
