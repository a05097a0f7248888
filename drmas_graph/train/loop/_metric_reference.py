"""Every metric a training run logs (run_dir/metrics.jsonl, TensorBoard, W&B) and what it means: the single
source of docs/reference/metrics.md (`scripts/gen_reference.py`) and of the test that every logged key is
documented. `<agent>`, `<model>`, `<adapter>` and `<limit>` stand for names; the update's metrics come from the
field docstrings of `UpdateMetrics` and `AgentUpdateMetrics` (a LoRA model logs its `UpdateMetrics` once per
adapter, `model/<model>/<adapter>/...`: `optim.lora.LoraUpdateMetrics`).
"""

from __future__ import annotations

import ast
import inspect
import re

from drmas_graph.train.loop._warm import WARM_START_METRICS
from drmas_graph.train.optim import AgentUpdateMetrics, UpdateMetrics

__all__ = ["metrics_reference", "is_documented", "TIME_NOTE"]

TIME_NOTE = (
    "Where a step's time goes: `time/rollout_s`, `time/score_s` (of it `time/judge_s`), `time/old_logprobs_s`, "
    "`time/update_s` and `time/sync_s` add up to about `time/step_s`; `time/checkpoint_s` follows the step, "
    "`eval/time_s` is an evaluation's. The embedded engine (`TransformersPolicy`) times its prefill and decode "
    "passes and gives each call its share: a decode step's seconds split equally among the rows it decoded (one "
    "token each); a prefill pass's among its requests by token share (a prompt's prefilled tokens split among the "
    "requests that share it, plus one token per request for its first sample); the rest of an engine step (the "
    "device-to-host copy, stop checks, merging KV caches) counts as decode, split among the step's rows. The shares "
    "add up to the engine's own totals (`policy.stats.prefill_s`, `decode_s`); each episode keeps its agents' sums "
    "in `timings['engine']` (in traces.db), and a step's are `time/rollout_prefill_s`, `time/rollout_decode_s` and "
    "`agent/<agent>/rollout_prefill_s`, `..._decode_s`. A served policy (vLLM, SGLang) batches on its server, "
    "out of the trainer's sight: its agents have `agent/<agent>/llm_call_s` (the wall time of their calls, which "
    "overlap when calls run concurrently) and no prefill/decode split. `TrainResult.summary()` (printed at the end "
    "of `drmas-graph train`) has a line with each phase's mean seconds per step."
)
"""The paragraph on step times of docs/reference/metrics.md."""

STEP = [
    ("step", "The training step (0 = the first); an evaluation's line has the number of steps done before it."),
    ("time", "Unix time the line was written."),
    ("episodes", "Episodes scored and trained on."),
    ("failed_episodes", "Episodes that raised in the graph (dropped from their group; the error is in traces.db)."),
    ("interrupted_episodes", "Of the failed ones, those left paused at an `interrupt()` no answer resumed."),
    ("no_llm_call_episodes", "Episodes that made no LLM call (dropped)."),
    ("bad_reward_episodes", "Episodes whose reward was unusable (None, NaN, a missing agent) or whose env raised "
                            "(also: an exception item of `env.reward_group` other than a JudgeError, a "
                            "`reward_group` list of the wrong length)."),
    ("judge_failed_episodes", "Episodes the judge gave no score (a `JudgeError` item of `env.reward_group`, after its "
                              "retries): not trained on; `episode.error` and the stored judgement say why."),
    ("masked_truncated_episodes", "Truncated episodes `rollout.mask_truncated` dropped."),
    ("truncated_episodes", "Episodes a limit stopped (trained on with `rollout.truncated_reward`)."),
    ("truncated/<limit>", "Of those, the ones `<limit>` stopped (max_llm_calls, recursion_limit, timeout_s)."),
    ("model_error_episodes", "Episodes the policy's output broke (trained on with `rollout.model_error_reward`)."),
    ("time/rollout_s", "Seconds of the step's rollouts (wall time)."),
    ("time/rollout_prefill_s", "Engine seconds prefilling the prompts of the step's scored episodes, summed over "
                               "their calls (embedded policies only: each call's share of the prefill passes it "
                               "took part in, by prompt tokens prefilled; see the embedded engine's docs). Several "
                               "models, or several processes under a launcher, generating at once can sum past "
                               "time/rollout_s."),
    ("time/rollout_decode_s", "Engine seconds decoding the responses of the step's scored episodes, summed over "
                              "their calls (embedded policies only: each decode step split equally among its "
                              "rows). time/rollout_s minus prefill and decode is the graph's own time, rendering, "
                              "tools and waiting."),
    ("time/score_s", "Seconds of scoring and advantages."),
    ("time/judge_s", "Of time/score_s, the seconds waiting for the environment's rewards when it has "
                     "`reward_group` (a judge's calls); summed over processes under a launcher."),
    ("time/old_logprobs_s", "Seconds of separate old-logprob passes before the updates (`old_logprobs: trainer` "
                            "with more than one minibatch; 0 when the update's own first pass gives them)."),
    ("time/update_s", "Seconds of the updates (weight syncs and old-logprob passes excluded)."),
    ("time/sync_s", "Seconds pushing weights to inference servers."),
    ("time/checkpoint_s", "Seconds writing the checkpoint after this step (on the lines of steps a "
                          "`checkpoint_every` checkpoint followed; the final checkpoint is not timed here)."),
    ("time/step_s", "Seconds of the whole step (without its checkpoint)."),
    ("rollout/tokens_per_s", "Response tokens sampled per second of rollout."),
    ("reward/team_mean", "Mean team reward of the scored episodes (a per-agent reward dict counts as its mean)."),
    ("adv/pools", "Advantage pools the estimator formed (e.g. group x agent for `agent`)."),
    ("adv/zero_variance_pools", "Pools of two or more members with equal rewards: advantage 0, no learning signal "
                                "(a warning names 3 steps in a row where they are most pools)."),
    ("samples/truncated_share", "Share of the step's samples (policy-served turns) from truncated episodes."),
    ("samples/model_error_share", "Share of the step's samples from model-error episodes."),
    ("agent/<agent>/reward_mean", "Mean of the agent's episode rewards."),
    ("agent/<agent>/reward_std", "Unbiased std of the agent's episode rewards."),
    ("agent/<agent>/advantage_mean", "Mean advantage of the agent's samples (its policy-served turns), trained or "
                                     "frozen."),
    ("agent/<agent>/advantage_std", "Population std (over n) of the advantages of the agent's samples."),
    ("agent/<agent>/advantage_sq_mean", "E[A^2]: mean squared advantage over the agent's samples of the step (trained "
                                        "or frozen; 0 with none). Dr. MAS's argument: the agent's squared gradient "
                                        "norm scales with it, (sigma_k^2 + (mu_k - mu)^2) / sigma^2 when its rewards "
                                        "are normalized with pooled statistics (mu, sigma); under `agent` a pool of "
                                        "n samples has (n-1)/n by construction."),
    ("agent/<agent>/response_length", "Mean response length in tokens of the agent's samples."),
    ("agent/<agent>/calls", "LLM calls of the agent in the scored episodes."),
    ("agent/<agent>/constrained_rate", "Share of the agent's calls decoded under the grammar of the format the call "
                                       "asked for (JSON mode, a JSON schema, tools: `Turn.sampling.grammar` set; "
                                       "docs/guide/structured-output.md); 0 where constrain is off; absent when it "
                                       "made no call."),
    ("agent/<agent>/invalid_rate", "Share of the agent's turns that were invalid (each costs invalid_penalty)."),
    ("agent/<agent>/tool_calls_per_turn", "Mean tool calls per turn of the agent, over its turns with tools bound "
                                          "(the calls that parsed, `Turn.tool_calls`); absent when it had no such "
                                          "turn."),
    ("agent/<agent>/tool_calls_well_formed", "Share of the agent's turns with tools bound that attempted a tool call "
                                             "whose calls all parse: a turn with a `format_error` about its tool calls "
                                             "(they do not parse, or a forced tool call failed) is not; absent where no "
                                             "turn attempted a call."),
    ("agent/<agent>/llm_call_s", "Wall seconds of the agent's calls in the scored episodes, summed over its calls "
                                 "(concurrent calls overlap; any policy, served ones included)."),
    ("agent/<agent>/rollout_prefill_s", "The agent's part of time/rollout_prefill_s (embedded policies only)."),
    ("agent/<agent>/rollout_decode_s", "The agent's part of time/rollout_decode_s (embedded policies only)."),
    ("agent/<agent>/never_acted", "1 when the agent made no call in the step (absent otherwise)."),
    ("agent/<agent>/truncated_share", "Share of the agent's samples from truncated episodes."),
    ("agent/<agent>/model_error_share", "Share of the agent's samples from model-error episodes."),
    ("agent/<agent>/model_error_episodes", "Model-error episodes whose offending turn was the agent's."),
    ("model/<model>/sync_s", "Seconds pushing model `<model>`'s weights to its servers (served models)."),
    ("model/<model>/old_logprobs_s", "Seconds of model `<model>`'s separate old-logprob pass (when it has one: "
                                     "see time/old_logprobs_s)."),
]
ASYNC = [
    ("async/synchronous_fallback", "1 when a run configured as asynchronous trains synchronously (no room for a "
                                   "second copy of a model)."),
    ("async/wait_s", "Seconds the trainer waited for the step's rollouts."),
    ("async/install_s", "Seconds installing the trained weights into the rollouts at the step boundary."),
    ("async/steps_in_flight", "Steps rolling out while this one trained (free schedule)."),
    ("async/staleness_mean", "Mean number of updates the sampling weights lagged behind, over the samples."),
    ("async/staleness_max", "Largest lag."),
    ("async/dropped_groups", "Groups dropped as staler than async.max_staleness."),
    ("async/dropped_samples", "Samples of those groups."),
    ("agent/<agent>/staleness_mean", "Mean lag of the agent's samples."),
    ("agent/<agent>/staleness_max", "Largest lag of the agent's samples."),
    ("agent/<agent>/is_weight_mean", "Mean off-policy importance weight over the agent's tokens."),
    ("agent/<agent>/is_weight_max", "Largest importance weight (before the cap)."),
    ("agent/<agent>/is_capped_frac", "Share of the agent's tokens whose weight the cap clipped."),
]
JUDGE = [
    ("judge/calls", "Calls to the judge model since the previous record (group mode: one per group; retries "
                    "included; cache hits make none)."),
    ("judge/retries", "Of those, calls that repeated an unusable or failed one."),
    ("judge/failed_calls", "Calls that gave no usable reply (unparsable, out of range, an exception, a timeout)."),
    ("judge/cache_hits", "Judgements (a group in group mode, else an episode) answered from the judge's cache "
                         "instead of a call (a resumed run pays nothing twice)."),
    ("judge/input_tokens", "Prompt tokens of the judge's calls (the model's usage_metadata)."),
    ("judge/output_tokens", "Reply tokens of the judge's calls."),
    ("judge/seconds", "Seconds spent waiting for judge calls, summed over concurrent calls."),
]
"""The counters a `rewards.Judge` (or `JudgedEnv`) returns from `reward_metrics()`; any environment's
`reward_metrics()` keys join the step and evaluation records the same way (asynchronous training: the counters
since the previous call, which may include a neighbouring step's scoring under `async.schedule: free`)."""
EVAL = [
    ("eval/split", "The evaluation's task split."),
    ("eval/k", "Samples per task."),
    ("eval/tasks", "Tasks evaluated."),
    ("eval/avg@k", "Mean over tasks of the share of its judged episodes that succeeded (team reward >= "
                   "success_threshold, or env.is_success); episodes the judge gave no score are left out, and so "
                   "are tasks without any judged episode; not logged when no task has one (the judge scored "
                   "nothing, an empty split)."),
    ("eval/pass@k", "Share of tasks (with a judged episode) with at least one success among k; not logged when "
                    "no task has one."),
    ("eval/failed_episodes", "Episodes that failed or made no LLM call (they count as failures)."),
    ("eval/bad_reward_episodes", "Episodes whose reward was unusable (they count as failures)."),
    ("eval/judge_failed_episodes", "Episodes the judge gave no score (left out of avg@k and pass@k; each is "
                                   "logged and stored with its error)."),
    ("eval/unjudged_episodes", "Episodes left out of avg@k and pass@k because the judge gave them no score."),
    ("eval/<agent>/reward", "Mean turn reward of the agent (invalid-turn penalties included)."),
    ("eval/<agent>/invalid_rate", "Share of the agent's turns that were invalid."),
    ("eval/<agent>/calls_per_episode", "The agent's calls per scored episode."),
    ("eval/<agent>/response_length", "Mean response length in tokens of the agent's replies."),
    ("eval/time_s", "Seconds of the evaluation (rollouts and scoring)."),
    ("eval/<agent>/top_replies", "The agent's 5 most frequent replies (whitespace-normalized, cut to 80 "
                                 "characters): a list of {reply, count, reward (mean)}; not a scalar."),
] + [(f"eval/{key}", f"{meaning.rstrip('.')}, during the evaluation.") for key, meaning in JUDGE]


def _field_docs(cls: type) -> dict[str, str]:
    """A dataclass's field docstrings (the string under each field), by field name."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}


def metrics_reference() -> list[tuple[str, str, str]]:
    """(section, key, meaning) of every metric, in the order of the generated page."""
    update = [(f"model/<model>/{k}", d) for k, d in _field_docs(UpdateMetrics).items() if k not in ("model", "agents")]
    update += [(f"agent/<agent>/{k}", d) for k, d in _field_docs(AgentUpdateMetrics).items()]
    lora = [(f"model/<model>/<adapter>/{k}", f"`model/<model>/{k}` of adapter `<adapter>`'s own optimizer: {d[0].lower()}{d[1:]}")
            for k, d in _field_docs(UpdateMetrics).items() if k not in ("model", "agents")]
    sections = [("Training step", STEP), ("Update (per trainable model and agent)", update),
                ("LoRA update (per adapter: a LoRA model logs these in place of `model/<model>/...`; its agents' "
                 "`agent/<agent>/...` keys are those above)", lora),
                ("Asynchronous training", ASYNC),
                ("Judge rewards (an environment's `reward_metrics()`: a `rewards.Judge`'s counters)", JUDGE),
                ("Warm start (`warm_start:`; lines with negative steps, before the RL's step 0)", WARM_START_METRICS),
                ("Evaluation (lines with eval/ keys; `TrainResult.evals` and a `drmas-graph eval`'s eval.json hold "
                 "the same record without the prefix)", EVAL)]
    return [(section, key, meaning) for section, rows in sections for key, meaning in rows]


def is_documented(key: str) -> bool:
    """Whether a logged key matches a documented one (`<agent>`, `<model>`, `<limit>` match any name)."""
    return any(re.fullmatch(re.sub(r"<[a-z]+>", "[^/]+", re.escape(k).replace(r"\<", "<").replace(r"\>", ">")), key)
               for _, k, _ in metrics_reference())
