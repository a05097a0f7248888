"""The optimizer backends of `ModelUpdater` and the process-group helpers they share.

- `_TorchEngine`: plain AdamW + ``clip_grad_norm_`` (averages gradients itself under torch.distributed).
- `_DeepSpeedEngine`: ``deepspeed.initialize`` with a client AdamW and ZeRO stage 0-3; its checkpoint holds the
  optimizer state without a second copy of the weights (`_Lean`).
Both expose forward/backward/step/lr/save/load; `update.ModelUpdater` picks one from `ENGINES` by name.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import socket
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from drmas_graph.errors import ConfigError
from drmas_graph.engine import rank as _rank, world_size as _world_size  # the package's one answer

if TYPE_CHECKING:
    from drmas_graph.train.engines._settings import UpdateSettings

# --- distributed helpers -----------------------------------------------------------------------------------


def all_reduce(values: list[float], op: str, device: torch.device) -> list[float]:
    """Sum or max of ``values`` over processes (on ``device``: NCCL reduces CUDA tensors only)."""
    if _world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, op=getattr(torch.distributed.ReduceOp, op))
    return tensor.tolist()


def default_group_barrier() -> None:
    """Wait for every rank on the default process group (the one the engines reduce gradients on: NCCL on
    CUDA); `distributed.barrier` waits on the gloo group that carries Python objects."""
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
    destroy_gloo_group_at_exit()


def destroy_gloo_group_at_exit() -> None:
    """Leave a gloo process group before the interpreter finalizes (an ``atexit`` handler; registering twice
    keeps one).

    A process that exits with its gloo group alive can die of SIGABRT ("terminate called without an active
    exception"): gloo's worker threads still release the last collective's tensors, which takes the GIL,
    and a thread taking the GIL while the interpreter finalizes is ended by a forced unwind through C++ code
    that cannot unwind. It hit a 2-process test on a busy machine (and 2 of 20 bare 2-process gloo launches
    here); atexit handlers run before finalization starts. The NCCL backend aborts its communicators in its
    own destructor, and destroying it while a peer may still run a collective can hang: it is left alone.
    """
    atexit.unregister(_destroy_gloo_group)
    atexit.register(_destroy_gloo_group)


def _destroy_gloo_group() -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


# --- engines: the two optimizer backends -------------------------------------------------------------------


def _adamw(model: torch.nn.Module, s: UpdateSettings) -> torch.optim.AdamW:
    return _adamw_over([p for p in model.parameters() if p.requires_grad], s)


def _adamw_over(params: list[torch.Tensor], s: UpdateSettings) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=s.lr, betas=tuple(s.betas), weight_decay=s.weight_decay, eps=1e-8)


class _LossScale:
    """Dynamic loss scaling for float16 gradients (Micikevicius et al. 2018, "Mixed Precision Training"):
    the loss is multiplied by ``scale`` before backward so small gradients survive float16; a step whose
    unscaled gradients are not finite is skipped and halves the scale; 1000 good steps in a row double it.
    The constants are DeepSpeed's fp16 defaults (initial_scale_power 16, loss_scale_window 1000)."""

    def __init__(self, enabled: bool) -> None:
        self.scale = 2.0**16 if enabled else 1.0
        self.enabled = enabled
        self.good_steps = 0

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if not finite:
            self.scale, self.good_steps = max(self.scale / 2, 1.0), 0
            return
        self.good_steps += 1
        if self.good_steps % 1000 == 0:
            self.scale *= 2


class _TorchEngine:
    """Plain AdamW; gradients are averaged over processes by hand when torch.distributed runs.

    Low-precision (bfloat16/float16) parameters get a float32 master copy, as DeepSpeed's bf16/fp16
    optimizers keep: every backward adds the low-precision gradients into float32 master gradients (and
    frees them), AdamW steps the masters, and the masters are cast back into the module's parameters.
    Without masters, AdamW on bfloat16 weights rounds away every update smaller than 2^-8 of the weight
    (at lr 1e-6 almost all of them). float16 gradients are computed from a dynamically scaled loss.
    """

    def __init__(self, model: torch.nn.Module, settings: UpdateSettings) -> None:
        self.module = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        # float32 parameters are their own master; the others get a float32 copy
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
                        for p in self.params]
        self.optimizer = _adamw_over(self.masters, settings)
        self.grad_clip = settings.grad_clip
        self.loss_scale = _LossScale(enabled=any(p.dtype == torch.float16 for p in self.params))

    def forward(self, *, is_last: bool, **inputs: Any) -> Any:
        return self.module(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.loss_scale.scale).backward()
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                if master is p or p.grad is None:
                    continue
                grad = p.grad.float()
                master.grad = grad if master.grad is None else master.grad.add_(grad)
                p.grad = None

    def step(self) -> float:
        """Average gradients over processes, unscale, clip, step; returns the pre-clip global grad norm
        (inf for a float16 step skipped because of an overflow)."""
        grads = [m.grad for m in self.masters if m.grad is not None]
        if _world_size() > 1:
            for g in grads:
                torch.distributed.all_reduce(g)
                g.div_(_world_size())
        if self.loss_scale.scale != 1.0:
            for g in grads:
                g.div_(self.loss_scale.scale)
        max_norm = self.grad_clip if self.grad_clip is not None else math.inf
        params = [m for m in self.masters if m.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        finite = math.isfinite(norm)
        self.loss_scale.update(finite)
        if finite or not self.loss_scale.enabled:
            self.optimizer.step()
            self._copy_masters_to_params()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    @torch.no_grad()
    def _copy_masters_to_params(self) -> None:
        for p, master in zip(self.params, self.masters):
            if master is not p:
                p.copy_(master)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def full_weights(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def save(self, directory: Path) -> None:
        if _rank() == 0:
            masters = [None if m is p else m.detach() for p, m in zip(self.params, self.masters)]
            torch.save({"optimizer": self.optimizer.state_dict(), "masters": masters,
                        "loss_scale": (self.loss_scale.scale, self.loss_scale.good_steps)},
                       directory / "optimizer.pt")

    def load(self, directory: Path, *, weights: Path | None) -> None:
        """Optimizer state and float32 masters from ``directory``; the weights from the Hugging Face folder
        ``weights`` (None: already in the module)."""
        if weights is not None:
            _load_hf_weights(self.module, weights)
        state = torch.load(directory / "optimizer.pt", map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for p, master, saved in zip(self.params, self.masters, state.get("masters") or []):
                if saved is not None and master is not p:
                    master.copy_(saved)
        self.loss_scale.scale, self.loss_scale.good_steps = state.get("loss_scale", (self.loss_scale.scale, 0))
        self._copy_masters_to_params()


def _load_hf_weights(model: torch.nn.Module, path: Path) -> None:
    """Copy weights saved with ``save_pretrained`` into ``model``'s own parameters (in place)."""
    from drmas_graph.engine import is_peft_model, load_adapter_weights

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
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if dtypes - {torch.float32, torch.bfloat16} or len(dtypes) > 1:
        raise ConfigError(f"backend='deepspeed' trains float32 or bfloat16 models (one dtype; DeepSpeed keeps float32 "
                          f"master weights for bfloat16); this model has {sorted(map(str, dtypes))}: cast it "
                          "(model.to(torch.bfloat16)) or use backend='torch' (float16 with dynamic loss scaling)")
    bf16 = dtypes == {torch.bfloat16}
    if bf16 and s.zero() == 0:
        raise ConfigError("backend='deepspeed' with zero_stage=0 accumulates bfloat16 gradients in bfloat16 (its "
                          "DDP_BFLOAT16 path); set zero_stage 1 or 2 (float32 gradient accumulation and master "
                          "weights, the same numbers as backend='torch'), or train in float32")
    # a float32 model's masters are its weights: resumed from the loaded weights, not saved (`_Lean`)
    masters = {"load_from_fp32_weights": False} if _masters_are_weights(model, s) else {}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,  # we accumulate a variable number of micro-batches by hand
        "gradient_clipping": s.grad_clip or 0.0,
        "zero_optimization": {"stage": s.zero(), **_offload(s), **masters},
        "zero_force_ds_cpu_optimizer": False,  # ZeRO-Offload steps the client torch AdamW on the CPU
        "zero_allow_untested_optimizer": True,  # the client torch AdamW
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,
    }


def _masters_are_weights(model: torch.nn.Module, s: UpdateSettings) -> bool:
    """ZeRO 1-2 keeps float32 master copies of the trained parameters: for a float32 model they equal its weights."""
    return s.zero() in (1, 2) and all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


def _model_device(model: torch.nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        raise ConfigError(f"backend='deepspeed' trains a model on one device; this model's parameters are on "
                          f"{sorted(map(str, devices))}: move it with model.to(device)")
    return devices.pop()


def _deepspeed_device(local_rank: int) -> torch.device:
    """The device DeepSpeed puts the model of local rank ``local_rank`` on (its accelerator's)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().device_name(local_rank))


@contextlib.contextmanager
def _local_rank_of(device: torch.device) -> Iterator[None]:
    """Make DeepSpeed keep the model on ``device``, where the rollout policy serves it.

    ``deepspeed.initialize`` moves the model to the accelerator device of LOCAL_RANK (it offers no
    ``dont_change_device``). With one process, LOCAL_RANK is pointed at the model's GPU for the call (and
    restored); with several, each process must hold its model on its local rank's device. A model on a
    device DeepSpeed would not train on is refused here, before anything moved.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if _world_size() == 1 and device.type != "cpu" and device.index is not None:
        local_rank = device.index
    target = _deepspeed_device(local_rank)
    if target != device:
        raise ConfigError(
            f"backend='deepspeed' would move this model from {device} (where its policy serves it) to {target}: "
            + ("put the model on the GPU of this process's local rank (models.<name>.device), " if _world_size() > 1
               else "use backend='torch' for a CPU model on a machine with GPUs, or move the model to a GPU, ")
            + "or select DeepSpeed's accelerator with DS_ACCELERATOR (cpu / cuda)")
    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(local_rank)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved


def _offload(s: UpdateSettings) -> dict[str, Any]:
    if not s.offload_optimizer:
        return {}
    return {"offload_optimizer": {"device": "cpu", "pin_memory": torch.cuda.is_available()}}


class _DeepSpeedEngine:
    """``deepspeed.initialize`` around the model with a client AdamW; manual gradient accumulation."""

    _TAG = "state"

    def __init__(self, model: torch.nn.Module, settings: UpdateSettings) -> None:
        deepspeed = _import_deepspeed()
        _init_process_group(deepspeed)
        config = _deepspeed_config(model, settings)
        device = _model_device(model)
        with _local_rank_of(device):
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=model, optimizer=_adamw(model, settings), config=config)
        if _model_device(model) != device:  # a DeepSpeed behaviour the checks above did not foresee
            raise ConfigError(f"DeepSpeed moved the model from {device} to {_model_device(model)}; please report this")
        self.module = self.engine.module
        self.zero_stage = settings.zero()
        self.masters_are_weights = _masters_are_weights(model, settings)
        """ZeRO 1-2 on a float32 model: its float32 master weights equal the weights (not saved, `_Lean`)."""

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

    def full_weights(self) -> contextlib.AbstractContextManager:
        """ZeRO-3 shards every parameter over the processes (outside forward passes a process holds only
        its shard); inside this block they are whole on every process (read-only)."""
        if self.zero_stage < 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None)

    def save(self, directory: Path) -> None:
        """DeepSpeed's checkpoint of the optimizer, without what the checkpoint already holds (ZeRO 0-2, `_Lean`): the
        module's weights (the caller saved them: the Hugging Face folder, or a LoRA model's adapters) and, for a
        float32 model, ZeRO's float32 master weights (equal to them). Frozen parameters (a LoRA model's base) are
        not saved: they never change."""
        lean = self.zero_stage < 3
        if lean:
            self.engine.checkpoint_engine = _Lean(self.engine.checkpoint_engine, drop_masters=self.masters_are_weights)
        try:
            self.engine.save_checkpoint(str(directory / "deepspeed"), tag=self._TAG, exclude_frozen_parameters=True)
        finally:
            if lean:
                self.engine.checkpoint_engine = self.engine.checkpoint_engine.inner
        if lean and _rank() == 0:  # DeepSpeed's scripts rebuild weights from its files, which no longer hold them
            for script in ("zero_to_fp32.py", "zero_to_torch.py"):
                (directory / "deepspeed" / script).unlink(missing_ok=True)

    def load(self, directory: Path, *, weights: Path | None) -> None:
        """Optimizer state from ``directory``; the weights from the Hugging Face folder ``weights`` (None: already in
        the module, as `LoraUpdater.load` restores them). A checkpoint written before checkpoints were lean holds
        the module's weights itself: they are loaded from it."""
        frozen = any(not p.requires_grad for p in self.module.parameters())

        def load_module(src: Mapping[str, torch.Tensor], dst: torch.nn.Module) -> None:
            if src:
                dst.load_state_dict(src, strict=not frozen)
            elif weights is not None:
                _load_hf_weights(dst, weights)

        path, _ = self.engine.load_checkpoint(str(directory / "deepspeed"), tag=self._TAG, load_module_strict=not frozen,
                                              load_optimizer_states=True, load_lr_scheduler_states=False,
                                              custom_load_fn=load_module if self.zero_stage < 3 else None)
        if path is None:
            raise ConfigError(f"no DeepSpeed checkpoint under {directory / 'deepspeed'}; was it saved with "
                              "backend='deepspeed'?")


class _Lean:
    """DeepSpeed's checkpoint engine (`engine.checkpoint_engine`), writing its files without duplicated weights:
    the model-states file without the module's weights (``module``: {}), and with ``drop_masters`` the ZeRO
    optimizer-states file without its float32 master partitions (a float32 model's masters equal its weights, and
    `_deepspeed_config` has ZeRO restore them from the loaded weights: ``load_from_fp32_weights`` false)."""

    def __init__(self, inner: Any, *, drop_masters: bool) -> None:
        self.inner, self.drop_masters = inner, drop_masters

    def save(self, state_dict: dict[str, Any], path: str) -> Any:
        from deepspeed.checkpoint.constants import SINGLE_PARTITION_OF_FP32_GROUPS as MASTERS

        if "module" in state_dict:
            state_dict = {**state_dict, "module": {}}
        optimizer = state_dict.get("optimizer_state_dict")
        if self.drop_masters and isinstance(optimizer, dict) and MASTERS in optimizer:
            state_dict = {**state_dict, "optimizer_state_dict": {**optimizer, MASTERS: []}}
        return self.inner.save(state_dict, path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


ENGINES: Mapping[str, Callable[[torch.nn.Module, UpdateSettings], Any]] = {
    "deepspeed": _DeepSpeedEngine,
    "torch": _TorchEngine,
}
