"""Rewards for apps without a reward function: a judge model scores episodes against a rubric.

`Judge(model, rubric, mode=...)` implements the environment's reward protocol (`reward`, `reward_group`,
`reward_metrics`); `JudgedEnv(env, judge)` gives an environment the judge's rewards; `judge_model(spec)` builds
the judge's chat model from a config spec. Every judged episode keeps the judge's prompt, raw replies, scores
and reasons in `Episode.judgement`.

May import: the shared modules, `instrumentation` (judge calls run outside every instrumented run; an embedded
judge answers through `PolicyChatModel`) and `engine` (an embedded judge's policy is built from a ModelConfig
by `build_policy`, as training builds one). The trainer never imports this package: it calls the environment protocol.
"""

from drmas_graph.errors import JudgeError
from drmas_graph.rewards._judge import METRIC_KEYS, Judge, JudgedEnv, Judgement, JudgementRecord
from drmas_graph.rewards._models import judge_model
from drmas_graph.rewards._schema import ReplyError

__all__ = ["Judge", "Judgement", "JudgementRecord", "JudgeError", "JudgedEnv", "judge_model", "METRIC_KEYS",
           "ReplyError"]
