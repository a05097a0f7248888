"""A lean forward pass for the embedded engine: Llama-family decoders on CPU in float32, fewer and larger ops.

The engine's forward passes (decode steps, prefills, suffix prefills) call the Hugging Face model, whose
per-layer modules cost Python and dispatch time around the matmuls: on SmolLM2-135M (30 layers) a batch-1
decode step took 55 ms in the model call, of which the 211 linear layers 35 ms. `LeanDecoder` computes the same
function directly from the model's own modules and weights, with q/k/v and gate/up each fused into one oneDNN
matmul on packed weights (`PackedLinear.packed_fused`, repacked when the weights change), HF's RMSNorm formula,
its rotary embedding module, and one `scaled_dot_product_attention` per layer (grouped-query heads packed for a
single query token, as HF's sdpa path does). Measured on the same step: 41 ms at batch 1, 62 vs 82 ms at batch
8 (`benchmarks/bench_roofline.py`, docs/benchmarks.md).

What it computes is the model's function up to float summation order (fused matmuls): logits within ~1e-5
of the HF forward. The engine samples from and records the logprobs of the logits it computed, so the
recorded logprobs stay exactly those of the sampling distribution, and the trainer's recomputation differs
from them by rounding, as it did before (`agent/<a>/logprob_mismatch`).

Used only where it is the same function: `refusal(model)` names why not (another architecture than
llama / mistral / qwen2, a sliding window, another activation, tensor-parallel slices, adapter or quantized
layers, another device or dtype), and before its first use `check` compares its logits with the model's own on a
left-padded prefill and a decode step (tolerance 1e-4 of the logits' scale); a model that differs runs the HF
forward (logged once). Rows that use LoRA adapters always take the HF forward, and so does every pass while
anything hooks or replaces a module's forward (`bypassed`): such a hook sees every pass, as without it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from drmas_graph.engine._cpu_linear import PackedLinear, _PackableLinear

__all__ = ["LeanDecoder"]

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "mistral", "qwen2")
"""Decoder families whose layers are embed -> [RMSNorm, q/k/v (+bias), rotary, attention, o, RMSNorm,
gate/up/down (SiLU)] -> RMSNorm -> LM head, with these module names."""


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _rms(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """HF's LlamaRMSNorm module `norm` on a float32 input: weight * (x * rsqrt(mean(x^2) + eps))."""
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LeanDecoder:
    """The lean forward of one model (`__call__`), with its fused packed weights."""

    def __init__(self, model: Any, linear: PackedLinear, *, cache_kwarg: str = "cache") -> None:
        self.model = model
        self.linear = linear
        self.cache_kwarg = cache_kwarg
        """The model forward's KV-cache argument (`cache`, or `past_key_values` before transformers 5.x)."""
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self._modules = list(model.modules())
        self.checked: bool | None = None
        """None until `check` ran; then whether this model's lean logits matched its own."""

    # ---- may it run? ------------------------------------------------------------------------------------
    @staticmethod
    def refusal(model: Any) -> str | None:
        """Why the lean forward cannot stand in for this model's, or None."""
        cfg = getattr(model, "config", None)
        kind = getattr(cfg, "model_type", None)
        if kind not in ARCHITECTURES:
            return f"its architecture is {kind!r} (the lean forward covers {', '.join(ARCHITECTURES)})"
        if getattr(cfg, "hidden_act", "silu") != "silu":
            return f"its activation is {cfg.hidden_act!r}, not silu"
        if getattr(cfg, "pretraining_tp", 1) != 1:
            return "it splits its linear layers into tensor-parallel slices (pretraining_tp > 1)"
        window = getattr(cfg, "sliding_window", None)
        if window and getattr(cfg, "use_sliding_window", True):
            return f"it has a sliding attention window ({window})"
        inner = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or any(not hasattr(inner, name) for name in needed) or not hasattr(model, "lm_head"):
            return "its modules are not laid out as model.{embed_tokens, layers, norm, rotary_emb} + lm_head"
        norms = [inner.norm] + [getattr(layer, name, None) for layer in inner.layers
                                for name in ("input_layernorm", "post_attention_layernorm")]
        if any(not hasattr(n, "variance_epsilon") or not hasattr(n, "weight") for n in norms):
            return "its norms are not RMSNorm modules with weight and variance_epsilon"
        linears = [model.lm_head]
        for layer in inner.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attn is None or mlp is None:
                return "a decoder layer has no self_attn or mlp"
            linears += [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
            linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) not in (torch.nn.Linear, _PackableLinear) for m in linears):
            return "some of its linear layers are not plain nn.Linear (adapters, quantized layers)"
        weight = model.lm_head.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return f"its weights are {weight.dtype} on {weight.device.type} (the lean forward is for float32 on CPU)"
        return None

    def bypassed(self) -> bool:
        """Whether something watches or replaces the model's own forward passes (forward hooks or pre-hooks on
        any of its modules, global module hooks, a `forward` set on a module instance): then the engine must
        run the model's forward, as a user who hooked it expects."""
        from torch.nn.modules import module as nn_module

        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in self._modules)

    @torch.inference_mode()
    def check(self) -> bool:
        """Compare the lean logits with the model's own on a probe (2 rows, one left-padded, 12 prompt tokens,
        then one decode step); remember and return whether they match. Runs under the engine's `PackedLinear`."""
        from transformers.cache_utils import DynamicCache

        model, vocab = self.model, self.model.config.vocab_size
        ids = (torch.arange(24).view(2, 12) * 7 + 3) % max(vocab - 3, 1) + 3
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, :4] = 0
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        try:
            with self.linear:
                ref = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
                got, cache = self(ids, mask, pos, DynamicCache(config=model.config))
                gaps = [(got - ref.logits[:, -1]).abs().max()]
                nxt, pos2 = got.argmax(-1, keepdim=True), pos[:, -1:] + 1
                mask2 = torch.cat([mask, mask.new_ones(2, 1)], 1)
                ref2 = model(input_ids=nxt, attention_mask=mask2, position_ids=pos2, use_cache=True, logits_to_keep=1,
                             **{self.cache_kwarg: getattr(ref, self.cache_kwarg)}).logits[:, -1]
                got2, _ = self(nxt, mask2, pos2, cache)
                gaps.append((got2 - ref2).abs().max())
        except (RuntimeError, TypeError, ValueError, AttributeError, IndexError) as exc:
            self.checked = False
            log.warning("the embedded engine's lean forward is off for this model: it failed on a probe (%s: %s)",
                        type(exc).__name__, exc)
            return False
        scale = max(ref.logits.abs().max().item(), 1e-6)
        gap = max(g.item() for g in gaps)
        self.checked = bool(gap <= 1e-4 * scale)
        if not self.checked:
            log.warning("the embedded engine's lean forward is off for this model: its logits differ from the model's "
                        "own by %.3g on a probe (scale %.3g)", gap, scale)
        return self.checked

    # ---- weights ----------------------------------------------------------------------------------------
    def _fused(self, layers: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The packed weight of ``layers`` fused into one (`PackedLinear.packed_fused`: repacked when a weight
        changed, dropped with the others when the policy's version moved) and their concatenated biases."""
        packed = self.linear.packed_fused(tuple(m.weight for m in layers))
        biases = [m.bias for m in layers]
        if all(b is None for b in biases):
            return packed, None
        if any(b is None for b in biases):
            raise RuntimeError("only some of the fused layers have a bias")
        return packed, torch.cat(biases)

    # ---- the forward ------------------------------------------------------------------------------------
    def __call__(self, ids_BL: torch.Tensor, mask_BS: torch.Tensor, pos_BL: torch.Tensor,
                 cache: Any) -> tuple[torch.Tensor, Any]:
        """(last-position logits_BV, cache): the model's forward with ``attention_mask`` = mask_BS (S = the cache's
        columns + L, 1 = a real token), ``position_ids`` = pos_BL, appending to ``cache`` (a `DynamicCache`)."""
        model, inner = self.model, self.model.model
        B, L = ids_BL.shape
        nh, nkv, D = self.n_heads, self.n_kv, self.head_dim
        x = inner.embed_tokens(ids_BL)
        cos, sin = inner.rotary_emb(x, pos_BL)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, L, D]
        S = mask_BS.shape[1]
        real_BS = mask_BS.bool()
        if L == 1:
            allowed = real_BS[:, None, None, :]  # [B, 1, 1, S]: the grouped heads share it
        else:  # column j is seen by query i (column S - L + i) when it is real and not after it; a padded query
            # sees itself, so that no row is fully masked (its output is never read: its columns are masked)
            cols = torch.arange(S, device=ids_BL.device)
            query_cols = cols[S - L:, None]
            allowed = (real_BS[:, None, :] & (cols[None, :] <= query_cols)[None]) | (cols[None, :] == query_cols)[None]
            allowed = allowed[:, None]  # [B, 1, L, S]
        group = nh // nkv
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv_w, qkv_b = self._fused((attn.q_proj, attn.k_proj, attn.v_proj))
            gate_up_w, gate_up_b = self._fused((mlp.gate_proj, mlp.up_proj))
            h = _rms(x, layer.input_layernorm)
            q, k, v = _linear(h, qkv_w, qkv_b).split([nh * D, nkv * D, nkv * D], dim=-1)
            q = _rotate(q.view(B, L, nh, D).transpose(1, 2), cos, sin)
            k = _rotate(k.view(B, L, nkv, D).transpose(1, 2), cos, sin)
            v = v.view(B, L, nkv, D).transpose(1, 2)
            k, v = cache.update(k, v, i)
            if L == 1:  # one query token: the heads of a group attend as rows of their K/V head
                o = F.scaled_dot_product_attention(q.reshape(B, nkv, group, D), k, v, attn_mask=allowed,
                                                   scale=attn.scaling).reshape(B, 1, nh * D)
            else:
                if group > 1:
                    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=attn.scaling)
                o = o.transpose(1, 2).reshape(B, L, nh * D)
            x = x + _linear(o, self.linear.packed(attn.o_proj.weight), attn.o_proj.bias)
            h = _rms(x, layer.post_attention_layernorm)
            gate, up = _linear(h, gate_up_w, gate_up_b).chunk(2, dim=-1)
            x = x + _linear(F.silu(gate) * up, self.linear.packed(mlp.down_proj.weight), mlp.down_proj.bias)
        h = _rms(x[:, -1], inner.norm)
        head = model.lm_head
        return _linear(h, self.linear.packed(head.weight), head.bias), cache
