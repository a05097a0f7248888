"""Faster linear layers for the embedded engine on CPU: oneDNN with weights packed once per weights version.

PyTorch's CPU `F.linear` goes to the BLAS (MKL), whose sgemm is slow for the few-row products of decoding
(one row per request), and slower still on CPUs it does not pick its fastest kernels for. oneDNN's
`mkldnn._linear_pointwise` on a weight reordered once into its blocked layout is several times faster
there (what vLLM's CPU backend relies on too).

`PackedLinear.install(model)` turns the model's `nn.Linear` layers into `_PackableLinear` (a subclass whose
forward is the same `F.linear` unless a `PackedLinear` is active on the calling thread: `with mode:`, entered
around the engine's own forward passes). While active, a CPU float32 layer without autograd (bfloat16 too
where the CPU has oneDNN's bf16 kernels; elsewhere bf16 layers keep the plain op) runs on the packed copy
of its weight, repacked whenever the weight changed in place (its version counter or storage moved, as
`load_state_dict` and optimizer steps do) and after `for_version` saw a new policy version. Training,
other threads and any other caller of the model get the plain op. The packed copies cost about one more
copy of the linear weights in memory.

(An earlier version was a torch function mode; it intercepts every torch call of the forward pass, which
cost 5-7% of a decode step on SmolLM2-135M. Here only the linear layers pay one thread-local lookup.)
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["PackedLinear", "packed_linear_available"]

_active = threading.local()  # .mode: the PackedLinear active on this thread, if any; .outer: enclosing ones


@functools.cache
def _packable_dtypes() -> tuple[torch.dtype, ...]:
    """float32, and bfloat16 where this CPU has oneDNN's bf16 kernels (AVX-512 BW/VL/DQ or AVX-NE-CONVERT):
    elsewhere (an AVX2-only CPU) `_reorder_linear_weight` refuses bf16 weights, so they take the plain op."""
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def packed_linear_available() -> bool:
    """Whether this torch build has oneDNN and its packed linear ops."""
    return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class _PackableLinear(torch.nn.Linear):
    """`nn.Linear` that runs on a packed oneDNN weight while a `PackedLinear` is active on this thread."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = getattr(_active, "mode", None)
        w, b = self.weight, self.bias
        if (mode is None or torch.is_grad_enabled() or w.device.type != "cpu"
                or w.dtype not in _packable_dtypes()
                or x.dtype != w.dtype or (b is not None and b.dtype != w.dtype)):
            return F.linear(x, w, b)
        return torch.ops.mkldnn._linear_pointwise(x, mode.packed(w), b, "none", [], "")


class PackedLinear:
    """Packed oneDNN weights for the `nn.Linear` layers of installed models, used within `with mode:`."""

    def __init__(self) -> None:
        self._packed: dict[Any, tuple[Any, Any, Any, torch.Tensor]] = {}
        """id(weight) (or the ids of fused weights) -> (weight(s), version(s), data pointer, packed copy)."""
        self.repacks = 0
        self._version: int | None = None

    @staticmethod
    def install(model: torch.nn.Module) -> torch.nn.Module:
        """Make every plain `nn.Linear` of `model` (the model itself included) packable; returns `model`.

        Only exact `nn.Linear` instances change class (to a subclass with the same parameters, state dict
        and behaviour outside `with mode:`); subclasses (quantized or adapter layers) are left alone.
        """
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                module.__class__ = _PackableLinear
        return model

    def for_version(self, version: int) -> PackedLinear:
        """Drop every packed copy when the policy's weights version moved. A weight's own version counter
        does not always move: DeepSpeed ZeRO writes updated parameters through flat buffers (collectives)."""
        if version != self._version:
            self._packed.clear()
            self._version = version
        return self

    def packed(self, w: torch.Tensor) -> torch.Tensor:
        """The packed copy of weight `w` (repacked if `w` changed since)."""
        entry = self._packed.get(id(w))
        if entry is None or entry[0] is not w or entry[1] != w._version or entry[2] != w.data_ptr():
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            entry = (w, w._version, w.data_ptr(), packed)
            self._packed[id(w)] = entry
            self.repacks += 1
        return entry[3]

    def packed_fused(self, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The packed copy of `weights` concatenated along their output rows (one matmul for layers that read the
        same input, e.g. q/k/v), repacked when any of them changed since, as `packed` does for one weight."""
        key = tuple(map(id, weights))
        state = tuple((w._version, w.data_ptr()) for w in weights)
        entry = self._packed.get(key)
        if entry is None or any(a is not b for a, b in zip(entry[0], weights)) or entry[1] != state:
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights).detach(), None)
            entry = (weights, state, None, packed)
            self._packed[key] = entry
            self.repacks += 1
        return entry[3]

    def __enter__(self) -> PackedLinear:
        _active.__dict__.setdefault("outer", []).append(getattr(_active, "mode", None))  # per thread
        _active.mode = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _active.mode = _active.outer.pop()
