"""`TrainConfig`: everything a training run reads, as small nested pydantic models (YAML <-> pydantic).

Every field has one line of documentation (its `description`); `drmas-graph config-doc` prints them all
and the README's table is generated from the same source. Unknown keys are errors (typos never pass).

This module sits at the bottom of the package (it imports only `drmas_graph.errors` and
`drmas_graph.chat_templates`, whose `read_chat_template` resolves `models.<name>.chat_template`): the training code
reads it, never the other way round. Names chosen from registries (`estimator`, `loss_agg`) are checked
against the name tuples below; a test keeps them equal to the registries in `drmas_graph.train`.
"""

from __future__ import annotations

from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from drmas_graph.chat_templates import check_chat_template, read_chat_template  # re-exported here
from drmas_graph.errors import ConfigError

__all__ = [
    "TrainConfig", "ModelConfig", "ServeConfig", "AgentConfig", "SamplingConfig", "LossConfig", "UpdateConfig",
    "EvalConfig", "RolloutConfig", "LoggingConfig", "LoraConfig", "WeaveConfig", "AsyncConfig", "TaskFilesConfig",
    "RewardConfig", "JudgeConfig", "WarmStartConfig", "load_config",
    "apply_overrides", "config_reference", "check_chat_template", "read_chat_template", "ESTIMATORS", "LOSS_AGGREGATIONS", "CORRECTIONS", "BASE_ADAPTER", "check_adapter_name", "model_adapters", "resolve_adapters",
]

ESTIMATORS = ("episode_global", "step_global", "agent", "agent_turn")
"""Advantage estimators by name (each implemented in `drmas_graph.train.optim.advantages.ADVANTAGE_ESTIMATORS`)."""
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""Loss aggregations by name (each implemented in `drmas_graph.train.optim.losses.LOSS_AGGREGATIONS`)."""
CORRECTIONS = ("truncate", "mask", "none")
"""Off-policy corrections by name (each implemented in `drmas_graph.train.optim.offpolicy.CORRECTIONS`)."""
BASE_ADAPTER = "__base__"
"""peft's mixed-batch name for rows that use no LoRA adapter (so no adapter may be called that)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0, description="Sampling temperature during training rollouts (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, description="Keep only the k most likely tokens; 0 keeps all.")
    max_new_tokens: int = Field(256, ge=1, description="Most tokens one LLM call may generate.")


class LossConfig(_Strict):
    """How one agent's samples enter the loss (`drmas_graph.train.optim.update.LossSettings` is this model)."""

    clip_low: float = Field(0.2, ge=0, lt=1, description="PPO clip: ratio lower bound is 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0, description="PPO clip: ratio upper bound is 1 + clip_high.")
    dual_clip: float | None = Field(3.0, gt=1, description="Dual-clip constant c > 1 for negative advantages; null disables.")
    loss_weight: float = Field(1.0, ge=0, allow_inf_nan=False, description="Multiplies this agent's loss (0 = the agent is served but not trained).")
    micro_batch_size: int = Field(4, ge=1, description="Samples per forward/backward pass on padded rows; packed (update.pack_prefixes), a micro-batch holds at most the tokens and attention scores of this many of the agent's longest samples.")


class UpdateConfig(_Strict):
    """Optimizer and loss settings of one trainable model (`drmas_graph.train.optim.update.UpdateSettings` adds the seed)."""

    lr: float = Field(1e-6, ge=0, allow_inf_nan=False, description="AdamW learning rate (0 freezes the model).")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW moment decay rates, each in [0, 1).")
    grad_clip: float | None = Field(1.0, gt=0, description="Clip the global gradient norm to this value; null = no clipping.")
    n_minibatches: int = Field(1, ge=1, description="Optimizer steps per training step (the samples are split this many ways).")
    loss_agg: str = Field("token-mean", description="token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm.")
    norm_len: int | None = Field(None, ge=1, description="The constant length L_norm of seq-mean-token-sum-norm (e.g. the max response length); required there.")
    kl_coef: float = Field(0.0, ge=0, allow_inf_nan=False, description="Weight of the KL penalty to the frozen initial model (low-variance k3); 0 = off.")
    entropy_coef: float = Field(0.0, ge=0, allow_inf_nan=False, description="Weight of the entropy bonus; 0 = off.")
    backend: Literal["deepspeed", "torch"] = Field("deepspeed", description="deepspeed (ZeRO) or plain torch AdamW (same numbers).")
    zero_stage: Literal[0, 1, 2, 3] | None = Field(None, description="DeepSpeed ZeRO stage; 3 also shards the parameters (for served rollouts: weights are gathered to save and sync). null = 1 with deepspeed, 0 with torch.")
    logprob_chunk_tokens: int = Field(512, ge=0, description="The LM head runs on response tokens only, this many at a time (peak memory ~ this x vocab floats); 0 = the model's full logits.")
    offload_optimizer: bool = Field(False, description="Keep optimizer state and float32 master weights in CPU memory and step there (DeepSpeed ZeRO-Offload; needs zero_stage >= 1).")
    gradient_checkpointing: bool = Field(False, description="Recompute each layer's activations in the backward pass instead of keeping them (less memory, ~30% more compute).")
    attn_implementation: str | None = Field(None, description="Attention kernel of the trained model (eager, sdpa, flash_attention_2, ...); embedded policies generate with it too. null = the model's own.")
    max_tokens_per_micro_batch: int | None = Field(None, ge=1, description="Size micro-batches in tokens: samples sorted by length are packed while rows x longest prompt+response stays within this (packed trees: while nodes^2 <= this x longest); null = micro_batch_size samples.")
    kl_start_metric: bool = Field(False, description="Log agent/<a>/kl_start (KL of the sampling policy to the start weights, k3) without a KL loss: keeps a frozen copy of the initial weights where kl_reference says and runs one no-grad pass over the step's samples per update (with kl_coef > 0 it is logged anyway, from the KL reference).")
    kl_reference: Literal["offload", "device"] = Field("offload", description="Where the frozen KL reference copy lives (kl_coef > 0): offload = CPU memory, moved to the device for one pass per update; device = stays there.")
    pack_prefixes: bool = Field(True, description="Compute each distinct token once: a micro-batch's samples are packed into one sequence tree (a group's shared prompt, an agent's earlier turns inside its later prompts), with a tree attention mask (eager/sdpa; other models fall back to padded rows, logged); false = padded rows.")
    autocast: Literal["bf16"] | None = Field(None, description="bf16: the trainer's forward passes of a float32 model run under bfloat16 autocast (see the logprob_mismatch metric); null = off.")
    dropout: bool = Field(False, description="true: the update's forward passes run the model's dropout (and LoRA's lora.dropout); false: dropout off, as when the old, behaviour and proximal logprobs are computed, so PPO ratios and importance weights carry no dropout noise (ratio exactly 1 before the first step).")

    @field_validator("loss_agg")
    @classmethod
    def _known_agg(cls, value: str) -> str:
        return _known_name("loss_agg", value, LOSS_AGGREGATIONS)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError(f"betas must be two numbers in [0, 1), got {value}")
        return value

    def zero(self) -> int:
        """The ZeRO stage in effect: `zero_stage`, or 1 with deepspeed (float32 gradient accumulation for
        bfloat16 weights; on one process the memory of stage 0) and 0 with torch when it is null."""
        if self.zero_stage is not None:
            return self.zero_stage
        return 1 if self.backend == "deepspeed" else 0

    @model_validator(mode="after")
    def _consistent(self) -> UpdateConfig:
        if self.loss_agg == "seq-mean-token-sum-norm" and self.norm_len is None:
            raise ValueError("norm_len must be set for loss_agg='seq-mean-token-sum-norm' (a constant such as the "
                             "max response length)")
        if self.offload_optimizer and (self.backend != "deepspeed" or self.zero() == 0):
            raise ValueError("offload_optimizer needs backend='deepspeed' and zero_stage 1, 2 or 3 (ZeRO-Offload)")
        if self.backend != "deepspeed" and self.zero() != 0:
            raise ValueError(f"zero_stage={self.zero_stage} needs backend='deepspeed'; set zero_stage=0 for "
                             f"backend={self.backend!r}")
        return self


class ServeConfig(_Strict):
    engine: Literal["sglang", "vllm"] = Field(description="Inference server that serves the model's rollouts: sglang or vllm.")
    urls: list[str] = Field(default_factory=list, description="Attach to these running servers (they must start from `path`'s weights); several = scale-out.")
    launch: bool = Field(False, description="Launch one server from `path` on 127.0.0.1 (stopped when the run ends) instead of attaching to `urls`.")
    python: str | None = Field(None, description="Interpreter of the server's environment when launching; null = this one (sglang) or vllm_python() (vllm: $DRMAS_VLLM_PYTHON or ./.venv-vllm).")
    timeout_s: float = Field(300.0, gt=0, description="Per-request read timeout: a generation must finish within it.")
    max_concurrency: int = Field(64, ge=1, description="Most requests in flight to the server(s) of this model.")
    ready_timeout_s: float | None = Field(None, gt=0, description="With launch: the longest wait for the server to answer its health check (loading and compiling the model; SmolLM2 on a 2-core CPU took 102-120 s); past it the launch fails. null = 300 s for vllm, 600 s for sglang.")
    args: list[str] = Field(default_factory=list, description="With launch: more command-line arguments for the server, after the ones drmas-graph sets, e.g. [--enforce-eager] (vLLM: no compilation at start, ~20 s sooner ready on a 2-core CPU), [--max-model-len, '8192'], [--tensor-parallel-size, '2'] (vLLM) or [--mem-fraction-static, '0.8'] (SGLang). Not the flags drmas-graph sets from the rest of the config (model, host, port, dtype, logprobs mode, weight version, LoRA).")

    @model_validator(mode="after")
    def _one_target(self) -> ServeConfig:
        if bool(self.urls) == self.launch:
            raise ValueError("give exactly one of `urls` (attach to running servers) or `launch: true`")
        if self.args and not self.launch:
            raise ValueError(f"`args` {self.args} are for a server drmas-graph launches (`launch: true`); a server at "
                             "`urls` was started by you: give them to its command line")
        return self


class LoraConfig(_Strict):
    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input in the update's forward passes; only with update.dropout: true (off by default).")
    target_modules: list[str] | str = Field("all-linear", description="Module names (or a regex) that get adapters; 'all-linear' = every linear layer but the output head.")


class ModelConfig(_Strict):
    path: str | None = Field(None, description="Local folder of a Hugging Face model (or of a GGUF file); 'smollm2' = the bundled SmolLM2-135M-Instruct.")
    gguf_file: str | None = Field(None, description="GGUF file name inside `path`, loaded with transformers' GGUF support.")
    tiny: dict[str, Any] | None = Field(None, description="Build drmas_graph.testing.tiny_policy(**tiny) instead of loading a path (tests, wiring checks).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Weights dtype; auto = bfloat16 when `device` is a GPU (cuda), float32 elsewhere.")
    device: str = Field("cpu", description="Device of the embedded policy and its trainer (cpu, cuda, cuda:1).")
    trainable: bool = Field(True, description="False: the model only serves its agents (frozen).")
    update: UpdateConfig | None = Field(None, description="Optimizer and loss settings of this model; null = the top-level `update`.")
    max_batch_size: int = Field(32, ge=1, description="Dynamic batching: most requests generated together.")
    serve: ServeConfig | None = Field(None, description="Roll out through inference servers; the trainer trains a local copy loaded from `path` on `device` and pushes it to them after every update.")
    lora: LoraConfig | None = Field(None, description="Train one LoRA adapter per agent (`agents.<a>.adapter`) over this frozen model instead of the model itself; null = full fine-tuning.")
    chat_template: str | None = Field(None, description="A Jinja chat-template file (relative to the working directory), or a built-in template `builtin:<name>` (`builtin:smollm2-tools`: ChatML with tools in the Hermes syntax; drmas_graph.chat_templates), that renders this model's prompts instead of its tokenizer's own, e.g. one that renders `tools` (SmolLM2's drops them); served policies render with it too, and checkpoints save it with the tokenizer. Checked when the config loads.")
    constrain: bool = Field(True, description="Decode each call under the grammar of the format it asks for (JSON mode, a JSON schema, a forced or offered tool: valid calls), as the real APIs guarantee it; embedded, vLLM and SGLang alike (docs/guide/structured-output.md). false: free text, checked after it is generated (a reply that breaks the format is a model error).")

    def torch_dtype(self) -> str:
        """`dtype` with auto resolved for `device`: bfloat16 on CUDA, float32 elsewhere."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    @field_validator("chat_template")
    @classmethod
    def _template_file_parses(cls, value: str | None) -> str | None:
        if value is not None:
            read_chat_template(value)  # the error's location (models.<name>.chat_template) names the model
        return value

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("give exactly one of `path` or `tiny`")
        if self.serve is not None and (self.path is None or self.gguf_file is not None):
            raise ValueError("`serve` needs `path` to be a Hugging Face model folder (not `tiny`, not `gguf_file`): "
                             "the servers and the local trainer both load it")
        return self


class AgentConfig(_Strict):
    model: str = Field(description="Name of the entry in `models` that serves this agent (agents may share one).")
    frozen: bool = Field(False, description="Serve this agent but never train on its calls.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Rollout sampling of this agent's calls.")
    loss: LossConfig = Field(default_factory=LossConfig, description="Per-agent loss settings.")
    adapter: str | None = Field(None, description="LoRA adapter of this agent on a `lora` model (agents naming the same adapter share it); null = an adapter named after the agent.")
    lr: float | None = Field(None, ge=0, description="Learning rate of this agent's adapter (or of its model when no other agent shares it); null = the model's `update.lr`.")
    constrain: bool = Field(True, description="Decode this agent's calls under the grammar of the format they ask for (with its model's `constrain`); false: free text, checked afterwards.")


class EvalConfig(_Strict):
    every: int = Field(0, ge=0, description="Evaluate every N steps (and before the first and after the last); 0 = only at the end.")
    split: str = Field("test", description="Task split evaluated.")
    n_tasks: int | None = Field(None, ge=1, description="Evaluate the first N tasks of the split (at least 1); null = all.")
    k: int = Field(4, ge=1, description="Samples per task for avg@k and pass@k.")
    temperature: float = Field(0.6, ge=0, description="Evaluation sampling temperature (the paper: 0.6).")
    top_p: float = Field(0.95, gt=0, le=1, description="Evaluation nucleus mass (the paper: 0.95).")
    before_training: bool = Field(True, description="Also evaluate the initial policies (step 0).")


TruncationLimit = Literal["max_llm_calls", "timeout_s", "recursion_limit", "max_resumes"]
"""A limit that truncates an episode (`drmas_graph.instrumentation._limits.LIMITS`)."""


class RolloutConfig(_Strict):
    """How each episode runs, what bounds it, and what happens to episodes that do not finish."""

    recursion_limit: int | None = Field(None, ge=1, description="LangGraph recursion_limit of every episode (supersteps; reaching it truncates the episode); null = the graph's own (with_config), else LangGraph's default (10,007 in LangGraph 1.2).")
    max_llm_calls: int | None = Field(50, ge=1, description="Stop an episode at its next LLM call once it made this many: it is truncated (kept, rewarded, trained on); null = no cap.")
    timeout_s: float | None = Field(1800.0, gt=0, description="Stop an episode at its next LLM call once it ran this many seconds (truncated); one that starts no call for 1 s longer is cancelled: inside a generation it is truncated, between calls (a stuck tool) it fails with StuckEpisodeError. A hang guard: truncation by time is not reproducible. null = no cap.")
    truncated_reward: float | None = Field(0.0, description="Team reward of a truncated episode (minus invalid-turn penalties): it did not finish its task; null = env.reward scores it (episode.truncated says why).")
    model_error_reward: float | None = Field(0.0, description="Team reward of an episode the policy's own output broke (model error; the turn that broke it is also invalid); null = env.reward scores it.")
    mask_truncated: bool | list[TruncationLimit] = Field(False, description="Drop truncated episodes instead of training on them (rLLM's mask_truncated_samples): true = all, or a list of the limits whose episodes are dropped.")
    configurable: dict[str, Any] = Field(default_factory=dict, description="`configurable` entries of every episode's config; each episode gets its own `thread_id` (graphs with a checkpointer).")
    max_resumes: int = Field(16, ge=0, description="Most runs of an episode's thread after its first: answers to `interrupt()` (env.resume) and a conversation's next inputs (env.next_input); at the bound an episode still paused at an interrupt fails (EpisodeInterruptedError), a conversation still going is truncated (truncated/max_resumes).")

    @field_validator("configurable")
    @classmethod
    def _no_thread_id(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "thread_id" in value:
            raise ValueError("thread_id is set per episode by the trainer (one thread per rollout); remove it")
        return value


class WeaveConfig(_Strict):
    project: str = Field(description="Weave project, 'entity/project' or 'project' (weave.init; needs the `weave` extra and a W&B login).")
    sample_per_step: int | None = Field(4, ge=0, description="Tasks exported per training step, each with all its G rollouts (a seeded choice); null = all.")
    evaluations: bool = Field(True, description="Also log every evaluation (avg@k, pass@k, per-agent reward) with weave.EvaluationLogger.")


class LoggingConfig(_Strict):
    progress: bool = Field(True, description="Show progress: a bar (step, reward per agent, ETA) on a terminal, "
                           "else one plain line per step (step, reward per agent, time); an evaluation's episodes "
                           "as they end (done / total, elapsed, ETA: on the bar, else a line at each tenth).")
    tensorboard: bool = Field(True, description="Write TensorBoard scalars under run_dir/tensorboard (needs the tensorboard package).")
    wandb: bool = Field(False, description="Log to Weights & Biases (needs wandb and a login).")
    weave: WeaveConfig | None = Field(None, description="Export episodes and LLM calls to W&B Weave (off a background thread); null = off.")

    @field_validator("weave", mode="before")
    @classmethod
    def _weave_section(cls, value: Any) -> Any:
        if value is False:
            return None
        if value is True:
            raise ValueError("logging.weave needs a project: `logging.weave: {project: my-project}`")
        return value


class AsyncConfig(_Strict):
    """Asynchronous training (`drmas_graph.train.loop._pipeline`): the next step's rollouts run during this step's update."""

    max_staleness: int = Field(0, ge=0, description="Most updates the weights that sampled a trained group may lag the trainer's; 0 = synchronous (rollout, update, next rollout); >= 1 = asynchronous, on `schedule`.")
    schedule: Literal["one_step_off", "free"] = Field("one_step_off", description="one_step_off: step s+1 rolls out on the weights before update s while update s trains (every group exactly 1 update stale, step 0's 0; reproducible to the last digit); free: step s starts once the rollout weights are at most max_staleness versions behind it and each update's weights reach the rollouts at once, with other steps' episodes in flight (their next LLM call uses them): staleness 0..max_staleness, not reproducible to the last digit.")
    correction: str = Field("truncate", description="Off-policy correction of stale samples, per token w = pi_prox / pi_behav on the PPO loss (decoupled PPO): truncate = min(w, is_cap) (verl's truncated IS); mask = tokens with w > is_cap leave the loss (AReaL); none = w = 1 (biased).")
    is_cap: float = Field(2.0, ge=1, allow_inf_nan=False, description="The cap C of `correction` on the importance weight pi_prox / pi_behav.")
    timeout_s: float = Field(3600.0, gt=0, description="Longest wait for a step's rollouts, a weight push or the other processes at a step boundary; past it the run stops with an error naming the step (and the server). Must exceed rollout.timeout_s.")

    @field_validator("correction")
    @classmethod
    def _known_correction(cls, value: str) -> str:
        return _known_name("async.correction", value, CORRECTIONS)


class JudgeConfig(_Strict):
    """A judge model's reward (`drmas_graph.rewards.Judge`): a chat model scores episodes against a rubric."""

    model: str | dict[str, Any] = Field(description="The judge's chat model: 'provider:model' (langchain's init_chat_model, an API model), {base_url, model} (an OpenAI-compatible server such as vLLM or SGLang), {import: 'module:attr'} (a chat model or a zero-argument factory) or {path: ...} (an embedded model, `models.<name>` fields, greedy).")
    rubric: str | None = Field(None, description="What a good episode is, in plain text (the judge also sees each task's reference answer when `answer` names a column); give this or rubric_file.")
    rubric_file: str | None = Field(None, description="A text file holding the rubric (relative to the working directory), instead of `rubric`.")
    mode: Literal["episode", "group", "agent"] = Field("group", description="episode: one call per episode, a score in [0, 1]; group: one call sees a task's whole GRPO group and scores the episodes relative to each other; agent: one call per episode scores each agent from its own turns ({agent: score}).")
    max_retries: int = Field(2, ge=0, description="Retries of a judge call whose reply is unparsable, out of range or failed; then the episode fails (judge_failed_episodes), never a silent 0.")
    timeout_s: float = Field(120.0, gt=0, description="Longest wait for one judge call (a timeout is a failed call, retried); a {base_url, model} judge without its own `timeout` also gets it as its request timeout.")
    max_concurrency: int = Field(4, ge=1, description="Most judge calls in flight at once, over all groups being scored.")
    temperature: float = Field(0.0, ge=0, description="The judge's sampling temperature (0 = greedy, reproducible).")
    seed: int | None = Field(0, description="Seed passed to judge models that take one; null = none.")
    max_tokens: int = Field(512, ge=1, description="Most tokens of one judge reply.")
    cache: str | None = Field("judge_cache.db", description="SQLite file caching judgements by (model, rubric, mode, trajectory), relative to run_dir (a resumed run pays nothing twice); null = no cache.")

    @model_validator(mode="after")
    def _one_rubric(self) -> JudgeConfig:
        if (self.rubric is None) == (self.rubric_file is None):
            raise ValueError("give exactly one of `rubric` (the text) or `rubric_file` (a file holding it)")
        return self


class RewardConfig(_Strict):
    """Where the rewards of tasks from files come from: a judge model or a Python function (exactly one)."""

    judge: JudgeConfig | None = Field(None, description="Score episodes with a judge model; null = use `python`.")
    python: str | None = Field(None, description="'module:attr' of a function (task, episode) -> float or {agent: float}; the task's `answer` is the reference answer.")

    @model_validator(mode="after")
    def _one_source(self) -> RewardConfig:
        if (self.judge is None) == (self.python is None):
            raise ValueError("give exactly one of `judge` (a judge model scores the episodes) or `python` "
                             "('module:attr' of a reward function)")
        return self


class TaskFilesConfig(_Strict):
    """An environment built from task files (`drmas_graph.task_files.TaskFileEnv`): no Python beyond the app."""

    tasks: str = Field(description="The training tasks: a .jsonl, .json (a list of objects), .csv or .parquet file, or a Hugging Face `datasets` folder (save_to_disk; a DatasetDict's 'train' split); relative to the working directory.")
    test: str | None = Field(None, description="The test tasks (evaluation), in the same formats (a DatasetDict's 'test' split); null = the 'test' split of a DatasetDict `tasks`, else the training tasks.")
    input: Any = Field(description="The graph input of a task: any YAML value whose strings are templates, '{column}' filled from the task's row (str.format: '{{' is a literal brace).")
    answer: str | None = Field(None, description="The column holding each task's reference answer (Task.answer: shown to the judge, passed to a python reward); null = none.")
    id: str | None = Field(None, description="The column holding each task's unique id; null = a stable hash of the row.")
    reward: RewardConfig = Field(description="The reward: `judge` or `python`.")


class WarmStartConfig(_Strict):
    """Supervised fine-tuning of each agent on demonstrations before RL (`drmas_graph.train.loop.warm_start`)."""

    demonstrations: str | dict[str, str] | None = Field(None, description="Demonstrations in OpenAI's fine-tuning JSONL format ({\"messages\": [...], \"tools\": [...]}, optional per-message \"weight\"): one file whose records each name their \"agent\", or {agent: file}; relative to the working directory.")
    traces: str | None = Field(None, description="A trace store (traces.db) of episodes recorded with the app's own models (agents without a policy, e.g. its API model): the warm-started agents' turns of the episodes whose team reward reaches min_reward.")
    min_reward: float = Field(1.0, description="Keep a recorded episode of `traces` when its team reward is at least this.")
    reward: Literal["env", "stored"] = Field("env", description="The reward of a recorded episode: env = env.reward on its task (by task id, from the 'train' split), stored = the one the trace store holds.")
    agents: list[str] | None = Field(None, description="Warm-start only these agents; null = every trained agent that has demonstrations.")
    epochs: int = Field(3, ge=1, description="Passes over the demonstrations (a seeded shuffle each).")
    lr: float = Field(1e-5, gt=0, allow_inf_nan=False, description="AdamW learning rate of the warm start (its own optimizer, discarded after it; the model's `update` settings otherwise).")
    batch_size: int = Field(8, ge=1, description="Demonstrations per optimizer step (per model; micro-batches of agents.<a>.loss.micro_batch_size).")
    eval_tasks: int = Field(4, ge=0, description="Held-out tasks (the first N of eval.split, eval.k episodes each, evaluation sampling) scored before and after: each agent's format score and reward, the team's avg@k; 0 = none.")
    kl_reference: Literal["warm", "base"] = Field("warm", description="The KL reference of the RL that follows (update.kl_coef > 0 or kl_start_metric): warm = the warm-started policy, base = the weights before the warm start.")

    @model_validator(mode="after")
    def _a_source(self) -> WarmStartConfig:
        if self.demonstrations is None and self.traces is None:
            raise ValueError("give `demonstrations` (an OpenAI fine-tuning JSONL file, or {agent: file}) and/or "
                             "`traces` (a traces.db recorded with the app's own models)")
        return self


def _env_kind(value: Any) -> str | None:
    if isinstance(value, (dict, TaskFilesConfig)):
        return _FILES_TAG
    return _IMPORT_TAG if isinstance(value, str) else None


_IMPORT_TAG, _FILES_TAG = "<env module:attr>", "<env tasks>"  # union members' tags; _validate drops them from locations
EnvSpec = Annotated[Annotated[str, Tag(_IMPORT_TAG)] | Annotated[TaskFilesConfig, Tag(_FILES_TAG)],
                    Discriminator(_env_kind, custom_error_type="env_spec", custom_error_message=(
                        "env must be 'module:attr' of an environment, or a mapping of task files (tasks, input, "
                        "reward)"))]
"""`TrainConfig.env`: 'module:attr' of an environment, or a `TaskFilesConfig` mapping."""


class TrainConfig(_Strict):
    """A training run. YAML keys mirror these fields; `--set a.b=v` overrides any of them."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)  # `async` (a Python keyword) is the field `async_`

    name: str = Field("run", description="Run name (the run folder is run_dir).")
    run_dir: str = Field("runs/run", description="Folder of the run: traces.db, metrics.jsonl, tensorboard/, checkpoints/.")
    seed: int = Field(0, description="Seeds task order, sampling and initialisation.")
    graph: str | None = Field(None, description="'module:attr' of the graph or of a factory building it (CLI only); a factory's `llm` parameter gets a stand-in chat model.")
    graph_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the graph factory.")
    env: EnvSpec | None = Field(None, description="The environment (CLI only): 'module:attr' of its class or factory, or a mapping of task files, input template and reward (drmas_graph.task_files; the fields below).")
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment factory ('module:attr' `env` only).")
    models: dict[str, ModelConfig] = Field(default_factory=dict, description="Models by name.")
    agents: dict[str, AgentConfig] = Field(default_factory=dict, description="Agents by name, each served by one model.")
    update: UpdateConfig = Field(default_factory=UpdateConfig, description="Optimizer and loss settings of every model without its own `update`.")
    node_agents: dict[str, str] = Field(default_factory=dict, description="Node-path glob -> agent (instrument's `agents`); default agent = node path.")
    strict: bool = Field(True, description="Error when a node calls an LLM for an agent without a policy.")
    steps: int = Field(10, ge=1, description="Training steps.")
    tasks_per_step: int = Field(4, ge=1, description="Tasks sampled per step (B).")
    group_size: int = Field(8, ge=1, description="Rollouts per task (G); they form one GRPO group.")
    max_concurrency: int = Field(32, ge=1, description="Episodes in flight at once (per process under torchrun), over every step rolling out: the free asynchronous schedule's steps share them, an earlier step's episodes first.")
    estimator: str = Field("agent", description="Advantage estimator: agent (Dr. MAS) | episode_global (vanilla GRPO) | step_global | agent_turn.")
    norm_by_std: bool = Field(True, description="Divide advantages by the pool's std (false = mean-only, Dr.GRPO style).")
    adv_eps: float = Field(1e-6, gt=0, description="eps in (R - mu) / (sigma + eps).")
    old_logprobs: Literal["auto", "rollout", "trainer"] = Field("auto", description="Logprobs in the PPO ratio's denominator: rollout = as the rollout backend returned them; trainer = the trainer's model's own (the update then does not depend on how requests were batched, so weights are identical at any max_concurrency): with update.n_minibatches 1 the update's own forward pass, detached (no extra pass), else recomputed in one forward pass per sample before the update; auto = trainer for embedded policies, rollout for served ones.")
    invalid_penalty: float | None = Field(None, description="Reward subtracted per invalid turn; null = the environment's `invalid_penalty` (0 if none).")
    success_threshold: float = Field(1.0, description="An episode succeeds (avg@k, pass@k) when its team reward is >= this.")
    checkpoint_every: int = Field(25, ge=0, description="Save a checkpoint every N steps (and at the end), so a crash loses at most N steps; 0 = only at the end. A checkpoint holds each trained model's weights and AdamW's two moments: ~12 bytes per parameter in float32 (1.6 GB for SmolLM2-135M), ~14 in bfloat16 (float32 master weights too).")
    keep_checkpoints: int = Field(2, ge=1, description="Most recent checkpoints kept: the older ones are deleted once the new one is whole (1 = only the latest; it is never removed before its successor is complete).")
    resume: bool = Field(False, description="Continue from the latest checkpoint in run_dir; an error when it holds none.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation settings.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Per-episode graph config and limits.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Logging settings.")
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async", description="Asynchronous training settings.")
    warm_start: WarmStartConfig | None = Field(None, description="Supervised fine-tuning of each agent on demonstrations before RL (`drmas-graph train` runs it first; `drmas-graph warm-start` alone); null = none.")

    @model_validator(mode="after")
    def _env_kwargs_need_a_factory(self) -> TrainConfig:
        if self.env_kwargs and isinstance(self.env, TaskFilesConfig):
            raise ValueError(f"env_kwargs {sorted(self.env_kwargs)} are keyword arguments of an environment factory, "
                             "but `env` is a mapping of task files; remove env_kwargs")
        return self

    @model_validator(mode="after")
    def _resolve_adapters(self) -> TrainConfig:
        resolve_adapters(self.models, self.agents)
        return self

    @model_validator(mode="after")
    def _async_consistent(self) -> TrainConfig:
        if self.async_.max_staleness == 0:
            if self.async_.schedule != "one_step_off":
                raise ValueError(f"async.schedule={self.async_.schedule} needs async.max_staleness >= 1 (0 trains "
                                 "synchronously); set it, e.g. `--set async.max_staleness=2`")
            return self
        if self.old_logprobs == "rollout":
            raise ValueError("async.max_staleness >= 1 needs the trainer's proximal logprobs (decoupled PPO): set "
                             "old_logprobs to auto or trainer, or async.max_staleness to 0")
        if self.rollout.timeout_s is not None and self.async_.timeout_s <= self.rollout.timeout_s:
            raise ValueError(f"async.timeout_s={self.async_.timeout_s:g} must exceed rollout.timeout_s="
                             f"{self.rollout.timeout_s:g} (a step's rollouts may take that long)")
        return self

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        return _known_name("estimator", value, ESTIMATORS)

    # ---- YAML ---------------------------------------------------------------------------------
    def to_yaml(self, path: str | Path | None = None) -> str:
        text = yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainConfig:
        return load_config(path)


def _validate(data: dict[str, Any], where: str) -> TrainConfig:
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"{where}: invalid training config"]
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"] if p not in (_IMPORT_TAG, _FILES_TAG)) or "<root>"
            lines.append(f"  {loc}: {err['msg']}")
        raise ConfigError("\n".join(lines)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config and apply `key.sub=value` overrides (values parsed as YAML)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config fields")
    return _validate(apply_overrides(data, overrides or []), str(path))


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`a.b.c=value` strings applied to nested dicts (a copy); value is parsed as YAML ('3' -> 3)."""
    import copy

    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a mapping")
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def merge_overrides(config: TrainConfig | None, overrides: dict[str, Any]) -> TrainConfig:
    """A config with keyword overrides applied (`steps=3`, `eval={'k': 2}`, dotted keys as `eval__k=2`)."""
    data = (config or TrainConfig()).model_dump()
    for key, value in overrides.items():
        node = data
        # a Python keyword field is written with a trailing underscore (`async_=`) but dumped by its alias (`async`)
        parts = [p[:-1] if p.endswith("_") and p[:-1] in _aliases() else p for p in key.split("__")]
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]] = {**node[parts[-1]], **value}
        else:
            node[parts[-1]] = value
    return _validate(data, "train_graph() arguments")


def _aliases() -> set[str]:
    """The aliases of the config's fields (`async` for `async_`), over every section."""
    out: set[str] = set()

    def walk(model: type[BaseModel]) -> None:
        for field in model.model_fields.values():
            if field.alias:
                out.add(field.alias)
            for sub in (a for a in (*_union_members(field.annotation), *getattr(field.annotation, "__args__", ()))
                        if _is_model(a)):
                walk(sub)

    walk(TrainConfig)
    return out


def config_reference() -> list[tuple[str, str, str]]:
    """(dotted field, default, description) for every config field, for docs and `drmas-graph config-doc`."""
    rows: list[tuple[str, str, str]] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for attr, field in model.model_fields.items():
            name = field.alias or attr  # `async_` is written `async`
            ann = field.annotation
            args = getattr(ann, "__args__", ())
            if getattr(ann, "__origin__", None) is dict and _is_model(args[-1]):
                walk(args[-1], f"{prefix}{name}.<name>.")
                continue
            sub = next((a for a in _union_members(ann) if _is_model(a)), None)
            if sub is not None:
                if not field.is_required() and field.get_default() is None:  # optional section: say what null means
                    rows.append((f"{prefix}{name}", "None", field.description or ""))
                walk(sub, f"{prefix}{name}.")
                continue
            default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
            rows.append((f"{prefix}{name}", default, field.description or ""))

    walk(TrainConfig, "")
    return rows


# ---- LoRA adapters per agent ---------------------------------------------------------------------------


def check_adapter_name(where: str, name: str) -> None:
    # peft warns (and may re-initialise weights on load) when an adapter name is part of its key prefix
    if not name or name == BASE_ADAPTER or name in "lora_" or "." in name:
        raise ConfigError(f"{where}: adapter name {name!r} is not usable: it must be non-empty, contain no '.', "
                          f"and be neither {BASE_ADAPTER!r} nor part of 'lora_'; rename it")


def resolve_adapters(models: dict[str, ModelConfig], agents: dict[str, AgentConfig]) -> None:
    """Give every agent of a `lora` model an adapter (default: the agent's name), in place; refuse an
    adapter on a model without `lora` and a `lora` model that no agent uses."""
    for agent, ac in agents.items():
        mc = models.get(ac.model)
        if mc is None:  # a policy given in Python (checked when the trainer resolves it)
            continue
        if mc.lora is None and ac.adapter is not None:
            raise ConfigError(f"agents.{agent}.adapter = {ac.adapter!r} but models.{ac.model} has no `lora`; "
                              f"add models.{ac.model}.lora or remove the adapter")
        if mc.lora is not None:
            if ac.adapter is None:
                ac.adapter = agent
            check_adapter_name(f"agents.{agent}.adapter", ac.adapter)
    for name, mc in models.items():
        if mc.lora is not None and not any(ac.model == name for ac in agents.values()):
            raise ConfigError(f"models.{name}.lora: no agent uses model {name!r}; add agents with `model: {name}`")


def model_adapters(model: str, agents: dict[str, AgentConfig]) -> list[str]:
    """The adapters of model `model`, in order of first use by `agents`."""
    return list(dict.fromkeys(ac.adapter for ac in agents.values() if ac.model == model and ac.adapter))


def _union_members(ann: Any) -> list[Any]:
    """The types a field's annotation admits: `A | B | None` -> [A, B, None], through `Annotated`."""
    origin = get_origin(ann)
    if origin is Annotated:
        return _union_members(get_args(ann)[0])
    if origin in (Union, UnionType):
        return [member for arg in get_args(ann) for member in _union_members(arg)]
    return [ann]


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)


def _known_name(field: str, value: str, registry: Any) -> str:
    """`value` if the registry has it, else the error that lists the valid names."""
    if value not in registry:
        raise ValueError(f"unknown {field} {value!r}; valid: {sorted(registry)}")
    return value
