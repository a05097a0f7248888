"""Processes and optimizer backends: rank and world size (`_world`), several processes under a launcher
(`_distributed`), the torch and DeepSpeed engines an updater steps with (`_engines`), and the update's settings
(`_settings`: `UpdateSettings`, `LossSettings`, read by the engines and the updaters alike).

May import: the shared modules and `engine` (nothing of `train.optim` or `train.loop`).
"""
