"""Tiny models for tests: random weights built from a config and a tokenizer trained locally (no downloads).

`tiny_policy()` gives a real `TransformersPolicy` whose answers are gibberish but whose token ids,
logprobs, batching and weight updates are all real, so users can test their graph's wiring in seconds.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from drmas_graph.engine._sampling import token_logprobs
from drmas_graph.engine.transformers_policy import TransformersPolicy
from drmas_graph.errors import GrammarError
from drmas_graph.grammar import mask_logits
from drmas_graph.types import Generation, SamplingParams

__all__ = ["tiny_policy", "tiny_tokenizer", "tiny_model", "scripted_policy", "ScriptedPolicy", "CHAT_TEMPLATE"]

# ChatML with Hermes-style tool calls; our own template, written for the tiny tokenizer.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "Tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}{% if not (loop.first and m.role == 'system') %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for tc in m.tool_calls %}"
    '<tool_call>{{ {"name": tc.function.name, "arguments": tc.function.arguments} | tojson }}</tool_call>'
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus() -> list[str]:
    words = ("the a solver verifier answer question approve reject reason search query router answerer "
             "tool call name arguments result number apples has buys how many more is what plus minus "
             "times town river born founder company year city person system user assistant reply just "
             "think step final correct wrong because").split()
    lines = []
    for i in range(400):
        a, b = i % 17, (i * 7) % 23
        w = " ".join(words[(i * k) % len(words)] for k in range(1, 9))
        lines.append(f"What is {a} + {b}? Answer: {a + b}. {w}.")
        lines.append(f'<tool_call>{{"name": "search", "arguments": {{"query": "{w}"}}}}</tool_call>')
    return lines


@functools.lru_cache(maxsize=8)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer trained in milliseconds on a built-in corpus, with a ChatML template.

    Different `vocab_size` values give different tokenizers (for heterogeneous-team tests).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.add_tokens(["<tool_call>", "</tool_call>"])  # ordinary tokens: kept when decoding
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model(tokenizer: Any, *, seed: int = 0, arch: str = "llama", hidden_size: int = 64,
               num_layers: int = 2) -> Any:
    """A randomly initialised causal LM (Llama or Qwen2 architecture) sized for the tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    configs = {"llama": LlamaConfig, "qwen2": Qwen2Config}
    if arch not in configs:
        raise ValueError(f"unknown tiny arch {arch!r}; valid: {sorted(configs)}")
    config = configs[arch](
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32768, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval()


def tiny_policy(seed: int = 0, *, arch: str = "llama", vocab_size: int = 512, hidden_size: int = 64,
                num_layers: int = 2, **kwargs: Any) -> TransformersPolicy:
    """A tiny random-weight chat policy (no downloads). Extra kwargs go to `TransformersPolicy`.

    Default sampling: temperature 1, at most 16 new tokens.
    """
    tokenizer = tiny_tokenizer(vocab_size)
    model = tiny_model(tokenizer, seed=seed, arch=arch, hidden_size=hidden_size, num_layers=num_layers)
    kwargs.setdefault("name", f"tiny-{arch}-v{vocab_size}-s{seed}")
    kwargs.setdefault("sampling", SamplingParams(max_new_tokens=16))
    kwargs.setdefault("seed", seed)
    return TransformersPolicy(model, tokenizer, **kwargs)


class ScriptedPolicy(TransformersPolicy):
    """A real tiny model that replies with scripted texts (teacher forcing), for wiring tests.

    `replies` is a list (used in order, cycling) or a function of the rendered prompt text. The reply is
    tokenized with the policy's tokenizer plus the end-of-turn token; the logprobs are the model's own
    log_softmax(logits / T) at those tokens, so ids, logprobs and decoding are all real.

    A scripted reply is sent as written: `constrain` is False by default (a test scripts replies that break a
    call's format on purpose). With `constrain=True` a call's grammar applies: the logprobs are those of the
    masked distribution, and a reply the grammar does not allow fails its request (`GrammarError`).
    """

    def __init__(self, replies: Any, model: Any, tokenizer: Any, **kwargs: Any) -> None:
        kwargs.setdefault("constrain", False)
        super().__init__(model, tokenizer, **kwargs)
        self._replies = replies
        self._reply_count = 0

    def _next_reply(self, prompt_ids: list[int]) -> str:
        if callable(self._replies):
            return self._replies(self.tokenizer.decode(prompt_ids))
        reply = self._replies[self._reply_count % len(self._replies)]
        self._reply_count += 1
        return reply

    def _engine_step(self, engine: Any, admit: list[Any]) -> list[tuple[Any, Generation]]:
        # whole replies at once: no row keeps decoding (a reply its grammar refuses failed its request: None)
        return [(r, gen) for r, gen in zip(admit, self._generate_batch(admit)) if gen is not None]

    @torch.inference_mode()
    def _generate_batch(self, reqs: list[Any]) -> list[Generation | None]:
        out: list[Generation | None] = []
        for r in reqs:
            self.stats.requests += 1
            ids = self.tokenizer.encode(self._next_reply(r.prompt_ids), add_special_tokens=False)
            ids = (ids + [self.tokenizer.eos_token_id])[: r.params.max_new_tokens]
            full = torch.tensor([r.prompt_ids + ids], device=self.device)
            logits = self.model(input_ids=full).logits[0, len(r.prompt_ids) - 1: -1].float()
            if r.params.grammar is not None:
                try:
                    logits = mask_logits(logits, self.grammars.masks(r.params.grammar, ids))
                except GrammarError as exc:
                    r.future.set_exception(exc)
                    out.append(None)
                    continue
            logp = token_logprobs(logits, torch.tensor(ids, device=self.device), r.params.temperature or 1.0)
            reason = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
            out.append(Generation(token_ids=ids, logprobs=logp.tolist(), finish_reason=reason,
                                  policy_version=self.version))
        self.stats.batches += 1
        return out


def scripted_policy(replies: Any, *, seed: int = 0, **kwargs: Any) -> ScriptedPolicy:
    """A `ScriptedPolicy` on the tiny tokenizer and a tiny random model (see `tiny_policy`)."""
    tokenizer = tiny_tokenizer(kwargs.pop("vocab_size", 512))
    model = tiny_model(tokenizer, seed=seed)
    kwargs.setdefault("name", f"scripted-s{seed}")
    kwargs.setdefault("sampling", SamplingParams(max_new_tokens=64))
    return ScriptedPolicy(replies, model, tokenizer, seed=seed, **kwargs)
