"""An independent recomputation of recorded logprobs, for tests: log_softmax(logits / T) at the response ids
from one plain forward pass over prompt + response (T = 0 is greedy, scored at T = 1)."""

import torch


def recompute_logprobs(model_or_path, prompt_ids, response_ids, temperature) -> list[float]:
    """`model_or_path`: an nn.Module, or a folder loaded with transformers in float32."""
    model = model_or_path
    if not isinstance(model, torch.nn.Module):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_or_path, dtype=torch.float32).eval()
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1: -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return logp.gather(1, torch.tensor(list(response_ids)).view(-1, 1)).view(-1).tolist()
