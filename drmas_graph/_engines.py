"""The optimizer backends of `ModelUpdater` and the process-group helpers they share.

- `_TorchEngine`: plain AdamW + ``clip_grad_norm_`` (averages gradients itself under torch.distributed).
- `_DeepSpeedEngine`: ``deepspeed.initialize`` with a client AdamW and ZeRO stage 0/1/2.
Both expose forward/backward/step/lr/save/load; `update.ModelUpdater` picks one from `_ENGINES` by name.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from drmas_graph.errors import ConfigError

if TYPE_CHECKING:
    from drmas_graph.update import UpdateSettings

# --- distributed helpers -----------------------------------------------------------------------------------


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _all_reduce(values: list[float], op: str, device: torch.device) -> list[float]:
    """Sum or max of ``values`` over processes (on ``device``: NCCL reduces CUDA tensors only)."""
    if _world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, op=getattr(torch.distributed.ReduceOp, op))
    return tensor.tolist()


def _barrier() -> None:
    if _world_size() > 1:
        torch.distributed.barrier()


_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_process_group(deepspeed: Any) -> None:
    """DeepSpeed needs torch.distributed. Under a launcher (torchrun, deepspeed) its env vars are used;
    with none of them set, this sets them for a single process (rank 0 of 1, a free local port)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    present = [k for k in _LAUNCHER_ENV if k in os.environ]
    if not present:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    elif len(present) < len(_LAUNCHER_ENV):
        missing = [k for k in _LAUNCHER_ENV if k not in os.environ]
        raise ConfigError(f"backend='deepspeed': environment has {', '.join(present)} but not "
                          f"{', '.join(missing)}; launch with torchrun or set all of {', '.join(_LAUNCHER_ENV)}")
    deepspeed.init_distributed()


# --- engines: the two optimizer backends -------------------------------------------------------------------


def _adamw(model: torch.nn.Module, s: UpdateSettings) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=s.lr, betas=s.betas, weight_decay=s.weight_decay, eps=1e-8)


class _TorchEngine:
    """Plain AdamW; gradients are averaged over processes by hand when torch.distributed runs."""

    def __init__(self, model: torch.nn.Module, settings: UpdateSettings) -> None:
        self.module = model
        self.optimizer = _adamw(model, settings)
        self.grad_clip = settings.grad_clip

    def forward(self, *, is_last: bool, **inputs: Any) -> Any:
        return self.module(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        """Average gradients over processes, clip, step; returns the pre-clip global grad norm."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        if _world_size() > 1:
            for p in params:
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(_world_size())
        max_norm = self.grad_clip if self.grad_clip is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def save(self, directory: Path) -> None:
        if _rank() == 0:
            torch.save({"optimizer": self.optimizer.state_dict()}, directory / "optimizer.pt")

    def load(self, directory: Path) -> None:
        _load_hf_weights(self.module, directory / "model")
        state = torch.load(directory / "optimizer.pt", map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])


def _load_hf_weights(model: torch.nn.Module, path: Path) -> None:
    """Copy weights saved with ``save_pretrained`` into ``model``'s own parameters (in place)."""
    from drmas_graph.lora import is_peft_model, load_adapter_weights

    if is_peft_model(model):  # save_pretrained wrote the LoRA adapters only
        return load_adapter_weights(model, path)
    dtype = next(model.parameters()).dtype
    loaded = type(model).from_pretrained(path, dtype=dtype)
    with torch.no_grad():
        model.load_state_dict(loaded.state_dict())


def _import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as exc:
        raise ConfigError("UpdateSettings.backend='deepspeed' but deepspeed is not importable "
                          f"({exc}); `pip install drmas-graph[deepspeed]` or set backend='torch'") from exc
    return deepspeed


def _deepspeed_config(model: torch.nn.Module, s: UpdateSettings) -> dict[str, Any]:
    param = next(model.parameters())
    if param.dtype == torch.bfloat16 and param.device.type == "cuda":
        bf16 = True
    elif param.dtype == torch.float32:
        bf16 = False
    else:
        raise ConfigError(f"backend='deepspeed' trains float32 models, or bfloat16 models on CUDA; this model is "
                          f"{param.dtype} on {param.device.type}: cast it (model.float()) or use backend='torch'")
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,  # we accumulate a variable number of micro-batches by hand
        "gradient_clipping": s.grad_clip or 0.0,
        "zero_optimization": {"stage": s.zero_stage},
        "zero_allow_untested_optimizer": True,  # the client torch AdamW
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,
    }


class _DeepSpeedEngine:
    """``deepspeed.initialize`` around the model with a client AdamW; manual gradient accumulation."""

    _TAG = "state"

    def __init__(self, model: torch.nn.Module, settings: UpdateSettings) -> None:
        deepspeed = _import_deepspeed()
        _init_process_group(deepspeed)
        config = _deepspeed_config(model, settings)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=_adamw(model, settings), config=config)
        self.module = self.engine.module
        self.zero_stage = settings.zero_stage

    def forward(self, *, is_last: bool, **inputs: Any) -> Any:
        # The boundary flag tells ZeRO whether this backward ends the accumulation (then gradients are
        # reduced); it is set before the forward pass, as `set_gradient_accumulation_boundary` asks.
        self.engine.set_gradient_accumulation_boundary(is_last)
        return self.engine(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> float:
        """Clip and step; returns the pre-clip global gradient norm.

        ZeRO-1/2 store it in ``get_global_grad_norm()`` (computed before clipping, loss scale removed).
        ZeRO-0 in float32 clips with ``deepspeed.runtime.utils.clip_grad_norm_`` and keeps no norm, so the
        norm is taken here from the (already averaged) gradients before the step.
        """
        local_norm = 0.0
        if self.zero_stage == 0:
            norms = [torch.linalg.vector_norm(p.grad.float()) for p in self.module.parameters() if p.grad is not None]
            local_norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else local_norm

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def save(self, directory: Path) -> None:
        # frozen parameters (a LoRA model's base) are not saved: they never change
        self.engine.save_checkpoint(str(directory / "deepspeed"), tag=self._TAG, exclude_frozen_parameters=True)

    def load(self, directory: Path) -> None:
        frozen = any(not p.requires_grad for p in self.module.parameters())
        path, _ = self.engine.load_checkpoint(str(directory / "deepspeed"), tag=self._TAG, load_module_strict=not frozen,
                                              load_optimizer_states=True, load_lr_scheduler_states=False)
        if path is None:
            raise ConfigError(f"no DeepSpeed checkpoint under {directory / 'deepspeed'}; was it saved with "
                              "backend='deepspeed'?")


_ENGINES: Mapping[str, Callable[[torch.nn.Module, UpdateSettings], Any]] = {
    "deepspeed": _DeepSpeedEngine,
    "torch": _TorchEngine,
}
