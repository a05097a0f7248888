"""Batched, device-side token sampling with per-request counter-based noise.

Shapes: `_B` rows (requests), `_V` vocabulary, `_K` top-k candidates, `_N` blocks of `_C` = 256 tokens.

Each row's randomness is a pure function of (request seed, token position, index): a 32-bit integer hash
(xorshift-multiply rounds on int32 tensors, whose multiplication wraps modulo 2^32; a test checks the
result against the same hash in Python integers) gives uniforms u, E = -log(u) ~ Exp(1), and the
exponential race `argmax_i w_i / E_i` (equivalently Gumbel-max) draws i with probability w_i / sum_j w_j.
It runs in two levels so the noise costs O(V / 256 + 256) per row instead of O(V): the vocabulary is cut
into blocks of 256, a race over the block masses W_b picks a block, a second race (fresh noise) picks a
token inside it: P(i) = W_b / W * w_i / W_b = w_i / W, exactly softmax(logits / T) over the tokens
top-k/top-p keep. Like one-level Gumbel-max, a draw only flips under float noise when two race scores tie
to ~1e-7 (inverse-CDF sampling over a cumulative sum would flip far more often). A row's draw therefore
never depends on the other rows of the batch, on the batch size, or on the device's RNG state, and no
per-row generator is touched: one batch of tensor ops on the logits' device samples every row.
Temperature 0 rows take the argmax.

Logprobs are log_softmax(logits / T) at the sampled token over the *untruncated* vocabulary (T = 1 for
greedy rows): the quantity a trainer recomputes from a forward pass. A row decoded under a grammar has the logits
of the tokens its grammar disallows set to -inf first (`drmas_graph.grammar.mask_logits`): its draw and its
logprob are those of the renormalised distribution over the allowed tokens, which the trainer recomputes under
the same mask.

Top-k keeps the k highest logits (ties at the k-th value kept); top-p (nucleus, Holtzman et al. 2020) keeps
the smallest set of most likely tokens whose probability reaches top_p (the top token always). With both
set, top-p applies to the distribution renormalised after top-k, as Hugging Face `generate`
(`TopKLogitsWarper` then `TopPLogitsWarper`) and vLLM (`apply_top_k_top_p`) do: p = [.40, .35, .25],
top_k=2, top_p=0.5 keeps token 0 alone (.40 / .75 = .53 >= .5). (SGLang filters both on the untruncated
distribution, `filter_apply_order="joint"`, and would keep tokens 0 and 1 there.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from drmas_graph.errors import ConfigError
from drmas_graph.grammar import mask_logits
from drmas_graph.types import SamplingParams

__all__ = ["RowParams", "entropy_from_logits", "hash_uniform", "mix32", "mix32_py", "row_keys", "row_sums", "sample_rows",
           "split_seed", "token_logprobs", "truncated_weights", "vocab_hash"]

_MASK32 = 0xFFFFFFFF
_MUL_A = 0x7FEB352D  # odd multipliers (bijective modulo 2^32), below 2^31 so they fit an int32
_MUL_B = 0x68E31DA5
_GOLDEN = 0x1E3779B9
_BLOCK = 256  # tokens per block of the two-level race
_STAGE_BLOCK, _STAGE_TOKEN = 0x2545F491, 0x4F6CDD1D  # key salts of the two races
_TOP_P_CANDIDATES = 256  # nucleus from the top-K tokens when they hold top_p of the mass (exact), else 16x more


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of the 32-bit patterns held in an int32 tensor."""
    return (x >> s) & ((1 << (32 - s)) - 1)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit finalizer (xorshift-multiply) on the bit patterns of an int32 tensor."""
    x = x ^ _shr(x, 16)
    x = x * _MUL_A
    x = x ^ _shr(x, 15)
    x = x * _MUL_B
    return x ^ _shr(x, 16)


def mix32_py(x: int) -> int:
    """`mix32` in Python integers, on x in [0, 2^32): the reference the tensor version is tested against."""
    x ^= x >> 16
    x = (x * _MUL_A) & _MASK32
    x ^= x >> 15
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


def row_keys(seeds_B: torch.Tensor, positions_B: torch.Tensor) -> torch.Tensor:
    """An int32 key per (seed, position): seeds_B (B, 2) int32 holds the two 32-bit halves of each seed."""
    k = mix32(positions_B.to(torch.int32) + _GOLDEN)
    k = mix32(k ^ seeds_B[:, 1])
    return mix32(k ^ seeds_B[:, 0])


def hash_uniform(keys_B: torch.Tensor, vocab_hash_V: torch.Tensor) -> torch.Tensor:
    """Uniforms (k + 1/2) / 2^23 in (0, 1), float32, one per (row key, index): 23 bits, so k + 1/2 stays exact.

    (With 24 bits the largest value would round to 1.0 in float32, and log(1) = 0 would break the race.)
    """
    return bits_to_uniform(mix32(keys_B[:, None] ^ vocab_hash_V[None, :]))


def bits_to_uniform(h: torch.Tensor) -> torch.Tensor:
    """The top 23 bits of 32-bit hashes (int32 tensor) as uniforms in (0, 1)."""
    return (_shr(h, 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def vocab_hash(vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """The per-index half of the noise hash, for every index a race over this vocabulary uses (computed once)."""
    n = max(_BLOCK, -(-vocab_size // _BLOCK))
    return mix32(torch.arange(n, dtype=torch.int32, device=device) * 2 + 1)


def _as_int32(v: int) -> int:
    return v - (1 << 32) if v >= (1 << 31) else v


def split_seed(seed: int) -> tuple[int, int]:
    """A Python int seed as its (low, high) 32-bit halves (modulo 2^64), as int32 bit patterns."""
    s = int(seed) % (1 << 64)
    return _as_int32(s & _MASK32), _as_int32(s >> 32)


@dataclass
class RowParams:
    """Per-row sampling parameters as device tensors, built once per batch composition."""

    inv_temp_B: torch.Tensor
    """1 / temperature (1 for greedy rows), float32."""
    greedy_B: torch.Tensor
    """True where temperature is 0."""
    top_k_B: torch.Tensor
    """k per row (int64); 0 keeps all."""
    top_p_B: torch.Tensor
    """top_p per row (float32); 1 keeps all."""
    seeds_B: torch.Tensor
    """(B, 2) int32: low and high 32-bit halves of each row's seed."""
    max_top_k: int
    """Largest k among rows that use top-k (0: none)."""
    any_top_p: bool
    """Whether any row has top_p < 1."""
    any_greedy: bool
    """Whether any row is greedy."""

    @staticmethod
    def build(params: Sequence[SamplingParams], seeds: Sequence[int], vocab_size: int,
              device: torch.device | str) -> RowParams:
        ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
        greedy = [p.temperature == 0 for p in params]
        return RowParams(
            inv_temp_B=torch.tensor([1.0 / p.temperature if p.temperature > 0 else 1.0 for p in params],
                                    dtype=torch.float32, device=device),
            greedy_B=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k_B=torch.tensor(ks, dtype=torch.int64, device=device),
            top_p_B=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            seeds_B=torch.tensor([split_seed(s) for s in seeds], dtype=torch.int32, device=device).view(-1, 2),
            max_top_k=max(ks, default=0), any_top_p=any(p.top_p < 1.0 for p in params), any_greedy=any(greedy),
        )

    def select(self, rows_B: torch.Tensor, params: Sequence[SamplingParams], vocab_size: int) -> RowParams:
        """The same parameters for a subset of rows (`params` are those rows' SamplingParams)."""
        ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
        return RowParams(self.inv_temp_B[rows_B], self.greedy_B[rows_B], self.top_k_B[rows_B],
                         self.top_p_B[rows_B], self.seeds_B[rows_B], max(ks, default=0),
                         any(p.top_p < 1.0 for p in params), any(p.temperature == 0 for p in params))

    @staticmethod
    def cat(parts: Sequence[RowParams]) -> RowParams:
        """Rows of several parameter sets, in order."""
        return RowParams(*(torch.cat([getattr(p, f) for p in parts]) for f in
                           ("inv_temp_B", "greedy_B", "top_k_B", "top_p_B", "seeds_B")),
                         max(p.max_top_k for p in parts), any(p.any_top_p for p in parts),
                         any(p.any_greedy for p in parts))


def row_sums(x_BV: torch.Tensor) -> torch.Tensor:
    """Each row's sum (B, 1), the same bits whatever the other rows and their number. ``x.sum(-1)`` is not: a
    single row of a 49k vocabulary is split between threads (another summation order than a row of a batch,
    half of 80 rows 1 ulp apart here). Summed in blocks of 256 and then over the blocks, every row is added
    up by one thread in one order."""
    return _blocks(x_BV).sum(-1).sum(-1, keepdim=True)


def _blocks(x_BV: torch.Tensor) -> torch.Tensor:
    """x_BV as (B, N, 256): the vocabulary in blocks of `_BLOCK`, the last one padded with zeros."""
    B, V = x_BV.shape
    N = -(-V // _BLOCK)
    if N * _BLOCK != V:
        x_BV = torch.nn.functional.pad(x_BV, (0, N * _BLOCK - V))
    return x_BV.view(B, N, _BLOCK)


def _top_k_keep(scaled_BV: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """Rows with k > 0 keep logits >= their k-th largest; other rows keep all."""
    top_BK = torch.topk(scaled_BV, rp.max_top_k, dim=-1).values
    kth_B = top_BK.gather(1, (rp.top_k_B.clamp(min=1) - 1)[:, None]).squeeze(1)
    kth_B = torch.where(rp.top_k_B > 0, kth_B, torch.full_like(kth_B, -float("inf")))
    return scaled_BV >= kth_B[:, None]


def _top_p_keep(p_BV: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """Nucleus: keep token i when the mass of the tokens ranked above it is < top_p (each row of p_BV sums to 1)."""
    V = p_BV.shape[-1]
    K = min(_TOP_P_CANDIDATES, V)
    while True:
        top_p_BK, top_i_BK = torch.topk(p_BV, K, dim=-1)  # sorted, descending
        if K == V or not bool((top_p_BK.sum(-1) < rp.top_p_B).any()):
            break  # every row's nucleus lies inside its top K
        K = min(16 * K, V)
    mass_before_BK = torch.cumsum(top_p_BK, -1) - top_p_BK
    keep_BK = mass_before_BK < rp.top_p_B[:, None]
    return torch.zeros_like(p_BV, dtype=torch.bool).scatter_(1, top_i_BK, keep_BK)


def _race(w_BN: torch.Tensor, keys_B: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The exponential race argmax_n w_n / E_n, E_n = -log u_n (as argmin of w_n / log u_n, log u_n < 0)."""
    log_u_BN = torch.log(hash_uniform(keys_B, table[: w_BN.shape[1]]))
    return (w_BN / log_u_BN).argmin(-1)


def _two_level_race(w_BV: torch.Tensor, keys_B: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Draw i with probability w_i / sum(w): a block by its mass, then a token inside the block."""
    B = w_BV.shape[0]
    w_BNC = _blocks(w_BV)
    block_B = _race(w_BNC.sum(-1), mix32(keys_B ^ _STAGE_BLOCK), table)
    inner_B = _race(w_BNC[torch.arange(B, device=w_BV.device), block_B], mix32(keys_B ^ _STAGE_TOKEN), table)
    return block_B * _BLOCK + inner_B


def truncated_weights(scaled_BV: torch.Tensor, e_BV: torch.Tensor, sum_B: torch.Tensor,
                      rp: RowParams) -> torch.Tensor:
    """The unnormalised weights w_i = exp(z_i / T - max) a row samples from: zero outside top-k, then zero
    outside the nucleus of the distribution renormalised after top-k, w / sum(w) (HF and vLLM order).

    `e_BV` = exp(scaled_BV - max) and `sum_B` its row sums (B, 1): what a row without top-k renormalises by.
    """
    weights_BV = e_BV
    if rp.max_top_k > 0:
        weights_BV = weights_BV * _top_k_keep(scaled_BV, rp)
    if rp.any_top_p:
        mass_B = row_sums(weights_BV) if rp.max_top_k > 0 else sum_B
        weights_BV = weights_BV * _top_p_keep(weights_BV / mass_B, rp)
    return weights_BV


def sample_rows(logits_BV: torch.Tensor, rp: RowParams, positions_B: torch.Tensor,
                vocab_hash_V: torch.Tensor, bitmask_BW: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row on the logits' device; return (ids_B int64, logprobs_B float32), both on device.

    `positions_B` is each row's index of the token being sampled within its response (0 for the first).
    `bitmask_BW` (int32, `drmas_graph.grammar`): the tokens each row's grammar allows; the others get logit -inf,
    so a row draws from, and records the logprob of, the renormalised distribution over the allowed tokens
    (every bit set: the row is unchanged).
    """
    scaled_BV = logits_BV.float() * rp.inv_temp_B[:, None]
    if bitmask_BW is not None:
        scaled_BV = mask_logits(scaled_BV, bitmask_BW)
    max_B = scaled_BV.amax(-1, keepdim=True)
    e_BV = torch.exp(scaled_BV - max_B)
    sum_B = row_sums(e_BV)
    weights_BV = truncated_weights(scaled_BV, e_BV, sum_B, rp)
    ids_B = _two_level_race(weights_BV, row_keys(rp.seeds_B, positions_B), vocab_hash_V)
    if rp.any_greedy:
        ids_B = torch.where(rp.greedy_B, scaled_BV.argmax(-1), ids_B)
    logp_B = scaled_BV.gather(1, ids_B[:, None]).squeeze(1) - max_B.squeeze(1) - sum_B.squeeze(1).log()
    return ids_B, logp_B


# --- the logprobs a sampler records, from logits (the trainer recomputes the same) --------------------------


def token_logprobs(logits_BTV: torch.Tensor, ids_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(z / temperature)[id]`` per token, in float32: the logprob a sampler at that
    temperature records for the token it drew. Computed as ``z_id / temp - logsumexp(z / temp)``.
    """
    if not temperature > 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    if ids_BT.shape != logits_BTV.shape[:-1]:
        raise ConfigError(
            f"ids_BT has shape {tuple(ids_BT.shape)} but logits_BTV has {tuple(logits_BTV.shape)}; "
            "expected ids of shape logits.shape[:-1]"
        )
    scaled_BTV = logits_BTV.float() / temperature
    picked_BT = scaled_BTV.gather(-1, ids_BT.long().unsqueeze(-1)).squeeze(-1)
    return picked_BT - torch.logsumexp(scaled_BTV, dim=-1)


def entropy_from_logits(logits_BTV: torch.Tensor, *, masked: bool = False) -> torch.Tensor:
    """Entropy of softmax(z) per position, in float32: ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``.

    The identity follows from ``log softmax(z)_v = z_v - logsumexp(z)``. z is first shifted by its max
    (H does not change), so large logits neither overflow nor cancel. Logits must be finite, unless `masked`:
    then -inf marks a token a grammar disallows (`drmas_graph.grammar.mask_logits`), which has probability 0
    and adds nothing (0 * -inf would be NaN).
    """
    z_BTV = logits_BTV.float()
    z_BTV = z_BTV - z_BTV.max(dim=-1, keepdim=True).values.detach()
    log_normalizer_BT = torch.logsumexp(z_BTV, dim=-1)
    probs_BTV = torch.exp(z_BTV - log_normalizer_BT.unsqueeze(-1))
    if masked:
        z_BTV = z_BTV.masked_fill(z_BTV == float("-inf"), 0.0)
    return log_normalizer_BT - (probs_BTV * z_BTV).sum(dim=-1)
