"""Rewards for apps without a reward function: a judge model scores episodes against a rubric.

`Judge(model, rubric, mode=...)` implements the environment's reward protocol (`reward`, `reward_group`,
`reward_metrics`); `JudgedEnv(env, judge)` gives an environment the judge's rewards; `judge_model(spec)` builds
the judge's chat model from a config spec. Every judged episode keeps the judge's prompt, raw replies, scores
and reasons in `Episode.judgement`.
"""

from drmas_graph.errors import JudgeError
from drmas_graph.rewards._judge import METRIC_KEYS, Judge, JudgedEnv, Judgement
from drmas_graph.rewards._models import judge_model

__all__ = ["Judge", "Judgement", "JudgeError", "JudgedEnv", "judge_model", "METRIC_KEYS"]
