"""Who this process is in a launched run: the world size and the ranks, one answer for the whole package.

A launcher (torchrun, the deepspeed launcher) tells each process its place through the environment
(WORLD_SIZE, RANK, LOCAL_RANK); the process group, once joined, says the same. Before the group exists the
launcher's variables answer (configs are checked and devices chosen before joining); after, the group
answers. Everything in drmas-graph that needs the world size or a rank calls these functions, so a check
made before the group exists and a collective made after it never disagree.
"""

from __future__ import annotations

import os

import torch

__all__ = ["world_size", "rank", "local_rank", "group_initialized"]


def group_initialized() -> bool:
    """Whether this process has joined a torch.distributed process group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def world_size() -> int:
    """Processes in the run: the process group's size once joined, else the launcher's WORLD_SIZE (1 without)."""
    return torch.distributed.get_world_size() if group_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank: in the process group once joined, else the launcher's RANK (0 without)."""
    return torch.distributed.get_rank() if group_initialized() else int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """This process's index on its machine (the launcher's LOCAL_RANK; 0 without)."""
    return int(os.environ.get("LOCAL_RANK", "0"))
