"""Faster linear layers for the embedded engine on CPU: oneDNN with weights packed once per weights version.

PyTorch's CPU `F.linear` goes to the BLAS (MKL), whose sgemm is slow for the few-row products of decoding
(one row per request), and slower still on CPUs it does not pick its fastest kernels for. oneDNN's
`mkldnn._linear_pointwise` on a weight reordered once into its blocked layout is several times faster
there (what vLLM's CPU backend relies on too). `PackedLinear` is a torch function mode entered around
the engine's own forward passes only (modes are per thread): every `F.linear` on a CPU float32/bfloat16
weight uses the packed copy, repacked whenever the weight changed in place (its version counter moved,
as `load_state_dict` and optimizer steps do). Training and any other caller of the model are untouched.
The packed copies cost about one more copy of the linear weights in memory.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["PackedLinear", "packed_linear_available"]

_DTYPES = (torch.float32, torch.bfloat16)


def packed_linear_available() -> bool:
    """Whether this torch build has oneDNN and its packed linear ops."""
    return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(TorchFunctionMode):
    """Within `with mode:`, `F.linear(x, w, b)` on CPU runs oneDNN on a packed copy of `w`."""

    def __init__(self) -> None:
        super().__init__()
        self._packed: dict[int, tuple[torch.Tensor, int, int, torch.Tensor]] = {}
        self.repacks = 0
        self._version: int | None = None

    def for_version(self, version: int) -> PackedLinear:
        """Drop every packed copy when the policy's weights version moved. A weight's own version counter
        does not always move: DeepSpeed ZeRO writes updated parameters through flat buffers (collectives)."""
        if version != self._version:
            self._packed.clear()
            self._version = version
        return self

    def _weight(self, w: torch.Tensor) -> torch.Tensor:
        entry = self._packed.get(id(w))
        if entry is None or entry[0] is not w or entry[1] != w._version or entry[2] != w.data_ptr():
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            entry = (w, w._version, w.data_ptr(), packed)
            self._packed[id(w)] = entry
            self.repacks += 1
        return entry[3]

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if (w.device.type == "cpu" and w.dim() == 2 and w.dtype in _DTYPES and x.dtype == w.dtype
                    and (b is None or b.dtype == w.dtype) and not torch.is_grad_enabled()):
                return torch.ops.mkldnn._linear_pointwise(x, self._weight(w), b, "none", [], "")
        return func(*args, **kwargs)
