"""drmas-graph: train an existing LangGraph multi-agent app with agent-wise GRPO (Dr. MAS).

    app = instrument(build_my_graph(), policies={"solver": policy, "verifier": policy})
    episode = app.rollout({"question": "2+3?"})
"""

from drmas_graph.errors import (
    ConfigError,
    DrmasError,
    NoLLMCallError,
    PolicyError,
    RolloutError,
    StrictModeError,
    UnknownAgentError,
)
from drmas_graph.instrumented import InstrumentedGraph, instrument
from drmas_graph.policy import Policy
from drmas_graph.transformers_policy import TransformersPolicy
from drmas_graph.types import Episode, Generation, SamplingParams, Turn

__all__ = [
    "instrument",
    "InstrumentedGraph",
    "Policy",
    "TransformersPolicy",
    "Episode",
    "Turn",
    "Generation",
    "SamplingParams",
    "DrmasError",
    "ConfigError",
    "UnknownAgentError",
    "StrictModeError",
    "PolicyError",
    "RolloutError",
    "NoLLMCallError",
]

__version__ = "0.1.0"
