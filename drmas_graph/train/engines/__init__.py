"""Processes and optimizer backends: several processes under a launcher (`distributed`: sharding, gathers, rank 0's
writes, trace merges; who this process is comes from `drmas_graph.engine`), the torch and DeepSpeed
engines an updater steps with (`ENGINES`, with the collectives they share: `all_reduce`,
`default_group_barrier`), and the update's settings (`UpdateSettings`, `LossSettings`, read by the engines and
the updaters alike).

The names below are what `train.optim` and `train.loop` use; `_engines` and `_settings` are this package's own.

May import: the shared modules and `engine` (nothing of `train.optim` or `train.loop`).
"""

from drmas_graph.train.engines import distributed
from drmas_graph.train.engines._engines import ENGINES, all_reduce, default_group_barrier
from drmas_graph.train.engines._settings import LossSettings, UpdateSettings

__all__ = ["ENGINES", "LossSettings", "UpdateSettings", "all_reduce", "default_group_barrier", "distributed"]
