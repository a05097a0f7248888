"""An embedded policy from a model entry of the config: what training rolls out with, and what a judge built from
a model config (`rewards`) runs on. Below train/, so the judge needs nothing of the trainer.

- `build_policy`: a `TransformersPolicy` from `path` (or a tiny random one for `tiny`) on this process's device,
  rendering with the entry's `chat_template` file when it names one.
- `local_device`: a configured device for this process (under a launcher, "cuda" is this process's own GPU).
- `resolve_model_path`: the path a model entry names (`smollm2`: the packaged SmolLM2 checkpoint).
"""

from __future__ import annotations

from drmas_graph.config import ModelConfig, read_chat_template
from drmas_graph.engine._world import local_rank, world_size
from drmas_graph.errors import ConfigError
from drmas_graph.policy import Policy

__all__ = ["build_policy", "local_device", "resolve_model_path"]


def local_device(device: str, where: str = "device") -> str:
    """A model's device for this process: under a multi-process launcher a bare "cuda" means this process's
    own GPU (cuda:LOCAL_RANK); an explicit GPU index, which would put every process on one GPU, is an error."""
    if world_size() > 1 and device.startswith("cuda"):
        if device != "cuda":
            raise ConfigError(f"{where}: {device!r} would put all {world_size()} processes on one GPU; "
                              "set it to 'cuda' (each process then takes cuda:LOCAL_RANK)")
        return f"cuda:{local_rank()}"
    return device


def resolve_model_path(path: str) -> str:
    """The checkpoint a model entry's `path` names: `smollm2` is SmolLM2-135M-Instruct from its package."""
    if path == "smollm2":
        from drmas_graph.engine.models import smollm2_path

        return str(smollm2_path())
    return path


def build_policy(name: str, mc: ModelConfig, seed: int) -> Policy:
    """The embedded policy of model config `mc` (a `TransformersPolicy`, or a tiny random one for `tiny`), named
    `name`, sampling with `seed`; what training rolls out with and a judge built from a model config runs on.

    `mc.chat_template` (a file) becomes the policy's `chat_template` and its tokenizer's: a served policy built
    on that tokenizer renders with it too, and a checkpoint saves it with the tokenizer."""
    from drmas_graph.engine.transformers_policy import TransformersPolicy

    template = read_chat_template(mc.chat_template, f"models.{name}.chat_template") if mc.chat_template else None
    if mc.tiny is not None:
        from drmas_graph.engine.tiny import tiny_policy

        policy = tiny_policy(**{"seed": seed, "name": name, "max_batch_size": mc.max_batch_size,
                                "chat_template": template, "constrain": mc.constrain, **mc.tiny})
    else:
        import torch

        path, gguf_file = resolve_model_path(mc.path), mc.gguf_file
        if mc.path == "smollm2":
            gguf_file = None
        policy = TransformersPolicy.from_pretrained(path, gguf_file=gguf_file, dtype=getattr(torch, mc.torch_dtype()),
                                                    device=local_device(mc.device, f"models.{name}.device"),
                                                    name=name, seed=seed, max_batch_size=mc.max_batch_size,
                                                    chat_template=template, constrain=mc.constrain)
    if template is not None:
        policy.tokenizer.chat_template = template
    return policy
