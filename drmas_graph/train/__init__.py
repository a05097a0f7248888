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


def __getattr__(name: str):  # TEMPORARY (helper seams): the structure branch exports build_policy; drop this then
    if name == "build_policy":
        from drmas_graph.train._build import build_policy
        return build_policy
    raise AttributeError(f"module 'drmas_graph.train' has no attribute {name!r}")
