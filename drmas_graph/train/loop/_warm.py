"""The warm start: supervised fine-tuning of each agent on its demonstrations, before RL (`warm_start:`).

`prepare(run)` is what building a training run does between its policies and its updaters (`_setup.build_run`):

- the folder holds the warm start's checkpoint (`run_dir/checkpoints/warm_start`, complete or absent: written to
  `.tmp_warm_start`, then renamed): its weights are loaded into every model it trained (a resumed run, or training
  after `drmas-graph warm-start`), never trained again;
- else it runs now: the demonstrations (`_demonstrations`: a fine-tuning JSONL file, a trace store of episodes
  recorded with the app's own models) in each agent's policy's ids, those its grammar does not allow reported and
  left out; held-out tasks scored (`evaluate` on the first `eval_tasks` of `eval.split`: per agent the share of
  replies that satisfy their call's format and its reward, the team's avg@k); `epochs` seeded passes of
  `batch_size` demonstrations per optimizer step of each model (`optim.SupervisedUpdater`: its own optimizer with
  `lr`, the logprobs of the RL's update, under the grammar masks), with a progress bar; the weights saved; the
  held-out tasks scored again. A warm start killed midway starts again from the base weights.

It returns the KL references of the RL that follows where the updaters' default is not the one asked
(`warm_start.kl_reference`): `base` for a full model (a frozen copy taken before the warm start), `warm` for a LoRA
adapter (its warm-started weights; a LoRA updater's default is the base).

Metrics (metrics.jsonl, TensorBoard) have negative steps, before the RL's step 0: with E epochs, the scores before
at step -E-1, epoch e (from 0) at step e - E, the scores after at step -1 (`WARM_START_METRICS`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from drmas_graph.config import TrainConfig
from drmas_graph.engine import is_peft_model, load_adapter_weights
from drmas_graph.errors import ConfigError
from drmas_graph.train.engines import LossSettings, UpdateSettings, distributed
from drmas_graph.train.loop._build import is_served, model_update
from drmas_graph.train.loop._checkpoints import has_checkpoint, push_weights
from drmas_graph.train.loop._demonstrations import Example, disallowed, read_jsonl, read_traces, tokenise
from drmas_graph.train.loop._state import ModelSlot, RunState, on_model_thread
from drmas_graph.train.loop.evaluate import evaluate
from drmas_graph.train.loop.metrics import EpisodeProgress, RunLogger
from drmas_graph.train.optim import SupervisedUpdater

__all__ = ["WarmStartResult", "prepare", "holds_only_warm_start", "warm_start_done", "warm_checkpoint",
           "WARM_START_METRICS"]

_SHOWN = 3
"""Demonstrations left out by their grammar named in the summary (all are counted)."""

WARM_START_METRICS = [
    ("agent/<agent>/warm_start_loss", "Warm start: mean negative log-likelihood per response token of the agent's "
                                      "demonstrations over the epoch (at each step's forward pass)."),
    ("agent/<agent>/warm_start_tokens", "Warm start: the agent's response tokens trained on in the epoch."),
    ("model/<model>/warm_start_grad_norm", "Warm start: mean pre-clip gradient norm of the epoch's steps."),
    ("model/<model>/<adapter>/warm_start_grad_norm", "Warm start: the same per LoRA adapter."),
    ("warm_start/epoch", "Warm start: the epoch (from 0) of the line."),
    ("agent/<agent>/warm_start_logprob", "Warm start, before and after: mean log-probability of the response tokens "
                                         "of the agent's demonstrations (no gradient)."),
    ("agent/<agent>/warm_start_format_score", "Warm start, before and after, on held-out tasks: share of the agent's "
                                              "replies that satisfy their call's format (no format error, not the "
                                              "reply that broke the app)."),
    ("agent/<agent>/warm_start_reward", "Warm start, before and after, on held-out tasks: the agent's mean turn "
                                        "reward (`eval/<agent>/reward`)."),
    ("agent/<agent>/warm_start_examples", "Warm start (after): the agent's demonstrations trained on."),
    ("agent/<agent>/warm_start_left_out", "Warm start (after): the agent's demonstrations its grammar does not "
                                          "allow, left out."),
    ("warm_start/avg@k", "Warm start, before and after: avg@k of the held-out tasks."),
]
"""(key, meaning) of every warm-start metric (`_metric_reference`: docs/reference/metrics.md)."""


# ---- the run folder ---------------------------------------------------------------------------------------


def warm_checkpoint(run_dir: Path) -> Path:
    """run_dir/checkpoints/warm_start: `<model>/model` per trained model and `warm_start.json`, when complete."""
    return run_dir / "checkpoints" / "warm_start"


def _tmp(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / ".tmp_warm_start"


def _warm_lines(path: Path) -> tuple[list[str], list[str], bool]:
    """(the lines of metrics.jsonl, the warm start's among them, whether one is a line of the RL: step >= 0)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []
    records = [json.loads(ln) for ln in lines]
    warm = [ln for ln, r in zip(lines, records) if any("warm_start" in k for k in r)]
    return lines, warm, any(r.get("step", 0) >= 0 for r in records)


def warm_start_done(run_dir: Path) -> bool:
    """The run folder holds a complete warm start (its checkpoint with warm_start.json)."""
    return (warm_checkpoint(run_dir) / "warm_start.json").is_file()


def holds_only_warm_start(run_dir: Path) -> bool:
    """The run folder holds a warm start (complete or begun) and nothing of the RL that follows it (no checkpoint
    step_N, no metrics line of a training step or an evaluation): a training run with `warm_start` starts there."""
    _, warm, rl = _warm_lines(run_dir / "metrics.jsonl")
    began = warm_checkpoint(run_dir).is_dir() or _tmp(run_dir).is_dir() or bool(warm)
    return began and not rl and not has_checkpoint(run_dir)


# ---- the result ---------------------------------------------------------------------------------------------


@dataclass
class WarmStartResult:
    """What a warm start did: per agent its demonstrations, loss per epoch and scores before and after."""

    run_dir: Path
    """The run folder (metrics.jsonl holds the warm start's lines, negative steps)."""
    checkpoint: Path
    """run_dir/checkpoints/warm_start: the warm-started weights (`<model>/model`), where the RL starts from."""
    epochs: int
    """Passes over the demonstrations."""
    examples: dict[str, int] = field(default_factory=dict)
    """Agent -> demonstrations trained on."""
    losses: dict[str, list[float]] = field(default_factory=dict)
    """Agent -> mean negative log-likelihood per response token, per epoch."""
    before: dict[str, float] = field(default_factory=dict)
    """Scores before: `<agent>/logprob` (its demonstrations), `<agent>/format_score`, `<agent>/reward`, `avg@k`
    (held-out tasks)."""
    after: dict[str, float] = field(default_factory=dict)
    """The same scores after the warm start."""
    left_out: dict[str, int] = field(default_factory=dict)
    """Agent -> demonstrations its grammar does not allow (left out)."""
    left_out_examples: list[str] = field(default_factory=list)
    """The first few of them: 'source (agent): why'."""
    traces: dict[str, int] | None = None
    """What was read from `warm_start.traces`: episodes, kept, and why the others were left out."""
    not_chosen: dict[str, int] = field(default_factory=dict)
    """Agent -> its demonstrations not trained on because `warm_start.agents` leaves it out."""

    def lines(self) -> list[str]:
        """The summary's lines: one row per agent and score, before and after ('-' where not measured)."""

        def row(label: str, *cells: Any) -> str:
            return f"{label:<28}" + "".join(f"{c:>12.3f}" if isinstance(c, float) else f" {c!s:>11}" for c in cells)

        total = sum(self.examples.values())
        shares = ", ".join(f"{a} {n}" for a, n in self.examples.items())
        out = [f"warm start: {self.epochs} epoch(s) on {total} demonstrations ({shares}); {self.checkpoint}",
               row("warm start", "before", "after")]
        for agent in self.examples:
            losses = self.losses.get(agent) or []
            out.append(row(f"  loss {agent}", *(losses[:1] + losses[-1:] if len(losses) > 1 else ["-", *losses])))
            for name in ("logprob", "format_score", "reward"):
                key = f"{agent}/{name}"
                if key in self.before or key in self.after:
                    out.append(row(f"  {name} {agent}", self.before.get(key, "-"), self.after.get(key, "-")))
        if "avg@k" in self.before or "avg@k" in self.after:
            out.append(row("  avg@k (held-out)", self.before.get("avg@k", "-"), self.after.get("avg@k", "-")))
        if any(self.left_out.values()):
            counts = ", ".join(f"{a} {n}" for a, n in self.left_out.items() if n)
            out.append(f"  left out, not allowed by their call's grammar: {sum(self.left_out.values())} ({counts}); "
                       + "; ".join(self.left_out_examples))
        if self.not_chosen:
            out.append("  not in warm_start.agents, not trained on: "
                       + ", ".join(f"{a} {n}" for a, n in self.not_chosen.items()))
        if self.traces:
            read = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in self.traces.items())
            out.append(f"  recorded episodes: {read}")
        return out

    def summary(self) -> str:
        """The lines as one text (what `drmas-graph warm-start` prints)."""
        return "\n".join(self.lines())

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "run_dir": str(self.run_dir),
                           "checkpoint": str(self.checkpoint)}, indent=1)

    @staticmethod
    def read(checkpoint: Path) -> WarmStartResult:
        data = json.loads((checkpoint / "warm_start.json").read_text())
        return WarmStartResult(**{**data, "run_dir": Path(data["run_dir"]), "checkpoint": Path(data["checkpoint"])})


# ---- before the RL's updaters ---------------------------------------------------------------------------------


def prepare(run: RunState, *, warm_only: bool = False) -> tuple[dict[str, Any], WarmStartResult | None]:
    """(the KL references by model where not the updaters' default, the warm start's result): the warm start run
    now, or its checkpoint's weights loaded (module docstring). `warm_only`: no RL follows (`warm_start()` alone):
    a complete warm start is only reported."""
    ws = run.cfg.warm_start
    if ws is None:
        return {}, None
    final = warm_checkpoint(run.run_dir)
    done = warm_start_done(run.run_dir)
    resumed = has_checkpoint(run.run_dir)
    if resumed and not done:
        raise ConfigError(f"warm_start: run folder {run.run_dir} holds RL checkpoints trained without a warm start "
                          f"({final} is missing); remove `warm_start` to continue that run, or train into a new "
                          "run_dir")
    if done and warm_only:
        return {}, WarmStartResult.read(final)
    slots = [m for m in run.models.values() if _trains(run, m)]
    kl = {m.name: model_update(run.cfg, m.name) for m in slots}
    kl = {n: s for n, s in kl.items() if s.kl_coef > 0 or s.kl_start_metric}
    # asynchronous training numbers the rollout weights from 0: an embedded policy must start it at version 0
    fresh = {m.name for m in slots if is_served(m.policy) or any(p is m.policy for p in run.built)}
    load = done and (not resumed or bool(kl))  # a resumed run loads its step's weights: these only make the KL ref
    if not warm_only and run.cfg.async_.max_staleness > 0 and (not done or (load and len(fresh) < len(slots))):
        raise ConfigError("warm_start before asynchronous training (async.max_staleness >= 1) runs in a process of its "
                          "own, and the RL's policies are built from the config (`models`, not policies=): run "
                          "`drmas-graph warm-start CONFIG` first, then `drmas-graph train CONFIG` starts from its "
                          "checkpoint")
    references: dict[str, Any] = {}
    if ws.kl_reference == "base":  # taken now, before the warm start changes the weights
        frozen = SupervisedUpdater.frozen_reference
        references = {m.name: on_model_thread(m, functools.partial(frozen, m.trained, kl[m.name].kl_reference))
                      for m in slots if m.name in kl and not is_peft_model(m.trained)}
    if done:
        result = WarmStartResult.read(final)
        if load:
            _load(run, final, slots, fresh)
    else:
        result = _run(run, slots)
    if ws.kl_reference == "warm":  # a LoRA updater's default reference is the base: the adapters as warm-started
        for m in slots:
            if m.name in kl and is_peft_model(m.trained):
                adapters = sorted({run.agent_cfgs[a].adapter for a in m.agents if run.agent_cfgs[a].adapter})
                snapshot = functools.partial(SupervisedUpdater.adapter_references, m.trained, adapters)
                references[m.name] = on_model_thread(m, snapshot)
    return references, result


def _trains(run: RunState, slot: ModelSlot) -> bool:
    """Whether the warm start can train the model: a local module, trainable, with an agent that is not frozen."""
    mc = run.cfg.models.get(slot.name)
    return (slot.trained is not None and (mc is None or mc.trainable)
            and any(not run.agent_cfgs[a].frozen for a in slot.agents))


def _load(run: RunState, checkpoint: Path, slots: Sequence[ModelSlot], fresh: set[str]) -> None:
    """The warm-started weights into every model the checkpoint holds, in place (`fresh`: the models whose policy was
    built for this run and has not generated yet, or is served; another policy gets a new version, so nothing it
    cached of the old weights is used), pushed to the servers of served ones."""
    for m in slots:
        folder = checkpoint / m.name / "model"
        if not folder.is_dir():
            continue
        with contextlib.nullcontext() if m.name in fresh else m.policy.updating_weights():
            on_model_thread(m, functools.partial(_load_weights, m.trained, folder))
        if is_served(m.policy):
            push_weights(run.run_dir, m.name, m.trained, m.policy, None, version=0)


def _load_weights(module: Any, folder: Path) -> None:
    if is_peft_model(module):  # save_pretrained wrote the adapters
        return load_adapter_weights(module, folder)
    loaded = type(module).from_pretrained(folder, dtype=next(module.parameters()).dtype)
    with torch.no_grad():
        module.load_state_dict(loaded.state_dict())


# ---- the warm start itself --------------------------------------------------------------------------------


def _run(run: RunState, slots: Sequence[ModelSlot]) -> WarmStartResult:
    ws, run_dir = run.cfg.warm_start, run.run_dir
    examples, left_out, traces, not_chosen = _examples(run, slots)
    E = ws.epochs
    tmp, final = _tmp(run_dir), warm_checkpoint(run_dir)
    logger = _logger(run)
    updaters: dict[str, SupervisedUpdater] = {}
    try:
        if distributed.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        result = WarmStartResult(run_dir, final, E, examples={a: len(x) for a, x in examples.items()},
                                 left_out={a: len(x) for a, x in left_out.items()},
                                 left_out_examples=[why for xs in left_out.values() for why in xs][:_SHOWN],
                                 traces=traces, not_chosen=not_chosen)
        for m in slots:
            if any(a in examples for a in m.agents):
                updaters[m.name] = on_model_thread(m, functools.partial(_updater, run, m))
        result.before = {**_logprobs(run, updaters, examples), **_scores(run, list(examples), -E - 1, "before")}
        logger.log({"step": -E - 1, **_score_keys(result.before)})
        _train(run, updaters, examples, result, logger)
        for name, sup in updaters.items():
            on_model_thread(run.models[name], functools.partial(sup.save, tmp / name))
            if distributed.is_main():
                run.models[name].policy.tokenizer.save_pretrained(tmp / name / "model")
            policy = run.models[name].policy
            if is_served(policy):  # the held-out tasks after, and the RL, roll out on the warm-started weights
                push_weights(run_dir, name, run.models[name].trained, policy, sup.updater, version=0)
        result.after = {**_logprobs(run, updaters, examples), **_scores(run, list(examples), -1, "after")}
        logger.log({"step": -1, **_score_keys(result.after),
                    **{f"agent/{a}/warm_start_examples": n for a, n in result.examples.items()},
                    **{f"agent/{a}/warm_start_left_out": result.left_out.get(a, 0) for a in result.examples}})
        if distributed.is_main():
            (tmp / "warm_start.json").write_text(result.to_json())
            (tmp / "trainer_state.json").write_text(json.dumps({"step": 0, "warm_start": True}))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)  # complete or absent
        distributed.barrier()
        distributed.merge_traces(run_dir)
        return result
    finally:
        for name, sup in updaters.items():
            on_model_thread(run.models[name], sup.close)
        logger.close()
        if distributed.is_main():
            shutil.rmtree(tmp, ignore_errors=True)


def _examples(run: RunState, slots: Sequence[ModelSlot]) -> tuple[
        dict[str, list[Example]], dict[str, list[str]], dict[str, int] | None, dict[str, int]]:
    """The warm-started agents' examples, in their policies' ids (those their grammar allows), the reasons the
    others were left out, what was read of the trace store, and the demonstrations of agents not chosen."""
    ws, cfg = run.cfg.warm_start, run.cfg
    trainable = [a for m in slots for a in m.agents if not run.agent_cfgs[a].frozen]
    for a in ws.agents or ():
        if a not in run.agent_policies:
            raise ConfigError(f"warm_start.agents: {a!r} is no agent of the run; agents: {sorted(run.agent_policies)}")
        if a not in trainable:
            raise ConfigError(f"warm_start.agents: agent {a!r} is not trained (frozen, or its model is not "
                              "trainable); remove it from warm_start.agents, or let RL train it")
    chosen = [a for a in trainable if ws.agents is None or a in ws.agents]
    demos = []
    if isinstance(ws.demonstrations, str):
        demos += read_jsonl(ws.demonstrations, agent=None, agents=run.agent_policies, key="warm_start.demonstrations")
    for agent, path in (ws.demonstrations or {}).items() if isinstance(ws.demonstrations, dict) else ():
        if agent not in run.agent_policies:
            raise ConfigError(f"warm_start.demonstrations: {agent!r} is no agent of the run; agents: "
                              f"{sorted(run.agent_policies)}")
        demos += read_jsonl(path, agent=agent, agents=run.agent_policies, key=f"warm_start.demonstrations.{agent}")
    untrained = sorted({d.agent for d in demos} - set(trainable))
    if untrained:
        raise ConfigError(f"warm_start.demonstrations: agent(s) {untrained} are not trained (frozen, or their model is "
                          f"not trainable), so their demonstrations teach nothing; remove them (trained: {trainable})")
    traces = None
    if ws.traces is not None:
        held_out = {t.id for t in run.env.tasks(cfg.eval.split)}
        recorded, traces = read_traces(ws.traces, run.env, agents=chosen, min_reward=ws.min_reward, reward=ws.reward,
                                       held_out=held_out, rollout=cfg.rollout, invalid_penalty=run.invalid_penalty)
        demos += recorded
    examples: dict[str, list[Example]] = {}
    left_out: dict[str, list[str]] = {}
    not_chosen: dict[str, int] = {}
    for demo in demos:
        if demo.agent not in chosen:
            not_chosen[demo.agent] = not_chosen.get(demo.agent, 0) + 1
            continue
        policy = run.agent_policies[demo.agent]
        example = tokenise(demo, policy, constrain=run.app.sampling.get(demo.agent, policy.sampling).constrain)
        why = disallowed(example, policy)
        if why is None:
            examples.setdefault(demo.agent, []).append(example)
        else:
            left_out.setdefault(demo.agent, []).append(f"{demo.source} ({demo.agent}): {why}")
    if not examples:
        raise ConfigError(f"warm_start: no demonstration to learn from for agents {chosen} (sources: demonstrations="
                          f"{ws.demonstrations!r}, traces={ws.traces!r}; recorded episodes: {traces}; left out by "
                          f"their grammar: {sum(map(len, left_out.values()))})")
    return examples, left_out, traces, not_chosen


def _updater(run: RunState, slot: ModelSlot) -> SupervisedUpdater:
    settings = model_update(run.cfg, slot.name)
    if settings.zero() == 3:
        raise ConfigError(f"warm_start: model {slot.name!r} trains with update.zero_stage 3, which the warm start does "
                          "not support yet (the RL's updater would wrap parameters already sharded); use zero_stage 2")
    agents = [a for a in slot.agents if not run.agent_cfgs[a].frozen]
    return SupervisedUpdater(slot.trained, name=slot.name, lr=run.cfg.warm_start.lr,
                             settings=UpdateSettings(**settings.model_dump(), seed=run.cfg.seed),
                             agent_settings={a: LossSettings(**run.agent_cfgs[a].loss.model_dump()) for a in agents},
                             agent_cfgs={a: run.agent_cfgs[a] for a in agents}, grammars=slot.policy.grammars)


def _batches(run: RunState, agents: Sequence[str], examples: dict[str, list[Example]], epoch: int) -> list[list[Any]]:
    """One model's batches of an epoch: a seeded shuffle of its agents' examples (the same on every process), cut
    into `batch_size` ones; this process's share of each (a contiguous block)."""
    samples = [x.sample(i) for a in agents for i, x in enumerate(examples.get(a, ()))]
    random.Random(f"{run.cfg.seed}:warm_start:{epoch}").shuffle(samples)
    size = run.cfg.warm_start.batch_size
    return [[s for _, s in distributed.owned(samples[k:k + size])] for k in range(0, len(samples), size)]


def _train(run: RunState, updaters: dict[str, SupervisedUpdater], examples: dict[str, list[Example]],
           result: WarmStartResult, logger: Any) -> None:
    """`epochs` passes: per model a step per batch, inside `policy.updating_weights()` for an embedded policy."""
    E = run.cfg.warm_start.epochs
    plan = {name: [_batches(run, run.models[name].agents, examples, e) for e in range(E)] for name in updaters}
    progress = _Progress(sum(len(batches) for epochs in plan.values() for batches in epochs), run.cfg.logging.progress)
    try:
        with contextlib.ExitStack() as held:
            for policy in {id(run.models[n].policy): run.models[n].policy for n in updaters}.values():
                if not is_served(policy):  # the policy serves the module the warm start trains
                    held.enter_context(policy.updating_weights())
            for e in range(E):
                nll: dict[str, float] = {}
                tokens: dict[str, int] = {}
                norms: dict[str, list[float]] = {}
                for name, sup in updaters.items():
                    for batch in plan[name][e]:
                        step = on_model_thread(run.models[name], functools.partial(sup.step, batch))
                        for part in distributed.gather(step):
                            for a, v in part.nll.items():
                                nll[a], tokens[a] = nll.get(a, 0.0) + v, tokens.get(a, 0) + part.tokens[a]
                        for key, values in step.grad_norms.items():
                            norms.setdefault(key, []).extend(values)
                        progress.advance(e, {a: nll[a] / max(tokens[a], 1) for a in nll})
                for a in nll:
                    result.losses.setdefault(a, []).append(nll[a] / max(tokens[a], 1))
                logger.log({"step": e - E, "warm_start/epoch": e,
                            **{f"agent/{a}/warm_start_loss": nll[a] / max(tokens[a], 1) for a in nll},
                            **{f"agent/{a}/warm_start_tokens": tokens[a] for a in tokens},
                            **{f"model/{k}/warm_start_grad_norm": sum(v) / len(v) for k, v in norms.items()}})
                progress.epoch_done(e, E, {a: nll[a] / max(tokens[a], 1) for a in nll})
    finally:
        progress.close()


def _logprobs(run: RunState, updaters: dict[str, SupervisedUpdater], examples: dict[str, list[Example]]
              ) -> dict[str, float]:
    """Per agent the mean logprob of its demonstrations' response tokens under the current weights."""
    sums: dict[str, list[float]] = {}
    for name, sup in updaters.items():
        agents = run.models[name].agents
        samples = [s for _, s in distributed.owned([x.sample(i) for a in agents
                                                    for i, x in enumerate(examples.get(a, ()))])]
        logprobs = on_model_thread(run.models[name], functools.partial(sup.logprobs, samples))
        for part in distributed.gather([(s.agent, float(lp.sum()), len(lp)) for s, lp in zip(samples, logprobs)]):
            for agent, total, n in part:
                sums.setdefault(agent, [0.0, 0.0])
                sums[agent][0] += total
                sums[agent][1] += n
    return {f"{a}/logprob": total / max(n, 1) for a, (total, n) in sums.items()}


def _scores(run: RunState, agents: Sequence[str], step: int, when: str) -> dict[str, float]:
    """The held-out tasks' scores (`when`: before or after): per warm-started agent its format score and reward, the
    team's avg@k; nothing with `eval_tasks: 0`."""
    n = run.cfg.warm_start.eval_tasks
    if n == 0:
        return {}
    cfg: TrainConfig = run.cfg.model_copy(update={"eval": run.cfg.eval.model_copy(update={"n_tasks": n})})
    progress = EpisodeProgress(f"warm start, held-out tasks {when}") if distributed.is_main() and cfg.logging.progress \
        else None
    started = time.time()
    record = evaluate(dataclasses.replace(run, cfg=cfg), step=step, progress=progress)
    good: dict[str, list[int]] = {}  # this process's episodes (its own store), summed over the processes below
    for summary in run.store.episodes(group_prefix=f"eval:{step}:"):
        if summary.created < started:  # an earlier, killed warm start's
            continue
        episode = run.store.load_episode(summary.id)
        for i, turn in enumerate(episode.turns):
            counts = good.setdefault(turn.agent, [0, 0])
            counts[0] += int(not turn.format_error and i != episode.model_error_turn)
            counts[1] += 1
    totals: dict[str, list[int]] = {}
    for part in distributed.gather(good):
        for agent, (ok, total) in part.items():
            totals.setdefault(agent, [0, 0])
            totals[agent][0] += ok
            totals[agent][1] += total
    out = {f"{a}/format_score": ok / total for a, (ok, total) in totals.items() if a in agents and total}
    out.update({f"{a}/reward": float(record[f"{a}/reward"]) for a in agents if f"{a}/reward" in record})
    if "avg@k" in record:
        out["avg@k"] = float(record["avg@k"])
    return out


def _score_keys(scores: dict[str, float]) -> dict[str, float]:
    """Scores as metric keys: '<agent>/format_score' -> 'agent/<agent>/warm_start_format_score'."""
    out = {}
    for key, value in scores.items():
        agent, _, name = key.rpartition("/")
        out[f"agent/{agent}/warm_start_{name}" if agent else f"warm_start/{name}"] = value
    return out


def _logger(run: RunState) -> Any:
    """metrics.jsonl (and TensorBoard) for the warm start's lines, the lines of an earlier, killed warm start
    removed first (rank 0; a null logger elsewhere). W&B gets no line (its steps start at 0)."""
    if not distributed.is_main():
        return distributed.NullLogger()
    path = run.run_dir / "metrics.jsonl"
    lines, warm, _ = _warm_lines(path)
    if warm:
        path.write_text("".join(ln + "\n" for ln in lines if ln not in warm))
    cfg = run.cfg
    return RunLogger(run.run_dir, tensorboard=cfg.logging.tensorboard, wandb=False, progress=False, total_steps=0,
                     start_step=0, agents=list(run.agent_policies), run_name=cfg.name, config={})


class _Progress:
    """The warm start's progress: a rich bar (optimizer steps done of all, each agent's running loss, ETA) where
    rich can draw one live, else one plain line per epoch; nothing with `logging.progress: false` (or on ranks
    other than 0)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled = enabled and distributed.is_main()
        self._bar: Any = None
        self._started = time.perf_counter()
        if self.enabled:
            from rich import get_console

            console = get_console()
            if console.is_interactive or console.is_jupyter:
                from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

                self._bar = Progress(TextColumn("[bold]warm start {task.completed}/{task.total} steps"), BarColumn(),
                                     TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                     TimeRemainingColumn(), console=console)
                self._task = self._bar.add_task("warm start", total=total, status="")
                self._bar.start()

    def advance(self, epoch: int, losses: dict[str, float]) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=1, status=f"epoch {epoch}  {_loss_text(losses)}")

    def epoch_done(self, epoch: int, epochs: int, losses: dict[str, float]) -> None:
        if self.enabled and self._bar is None:
            print(f"warm start epoch {epoch} ({epoch + 1}/{epochs})  {_loss_text(losses)}  "
                  f"elapsed {time.perf_counter() - self._started:.1f} s", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _loss_text(losses: dict[str, float]) -> str:
    return "loss " + " ".join(f"{a}={v:.3f}" for a, v in losses.items() if math.isfinite(v))

