"""The warm start (issue 57 item 4): supervised fine-tuning of each agent on its demonstrations before RL.

Tiny real models throughout: demonstrations in OpenAI's fine-tuning JSONL format, or episodes recorded with the app's
own model in a trace store, tokenised as the policy renders its prompts and writes its replies; the loss falls and the
demonstrations' logprobs rise; LoRA adapters; the checkpoint, resume and restart; the KL reference of the RL; the
command line; config errors.
"""

import json

import pytest
import torch
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from drmas_graph import SamplingParams, Task, TraceStore, instrument
from drmas_graph._chat import parse_mistral
from drmas_graph._structured import apply_spec
from drmas_graph.cli import main
from drmas_graph.config import merge_overrides
from drmas_graph.errors import ConfigError
from drmas_graph.grammar import allowed_tokens
from drmas_graph.testing import tiny_policy
from drmas_graph.train.loop._demonstrations import disallowed, read_jsonl, read_traces, reply_text, tokenise
from drmas_graph.train.loop.trainer import Trainer, train_graph
from drmas_graph.train.loop.warm_start import warm_start
from drmas_graph.train.optim._logprobs import collate
from tests import _graphs
from tests._envs import ParityEnv
from tests.test_instrument import Unreachable

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate an expression.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}, "precision": {"type": "integer"}},
    "required": ["expression", "precision"]}}}]


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def demo_records(n=6, agents=("solver", "verifier")):
    """Demonstrations of solver_verifier's two agents, as its nodes prompt them (ParityEnv's training questions)."""
    out = []
    for i in range(n):
        question, answer = f"What is {i} + {i}?", f"The answer is {2 * i}."
        if "solver" in agents:
            out.append({"agent": "solver", "messages": [{"role": "system", "content": "Solve it."},
                                                        {"role": "user", "content": question},
                                                        {"role": "assistant", "content": answer}]})
        if "verifier" in agents:
            out.append({"agent": "verifier", "messages": [{"role": "system", "content": "Check it."},
                                                          {"role": "user", "content": f"{question} -> {answer}"},
                                                          {"role": "assistant", "content": "yes"}]})
    return out


def config(tmp_path, warm=None, **kw):
    base = dict(run_dir=str(tmp_path / "run"), steps=1, tasks_per_step=2, group_size=2,
                update={"lr": 1e-3, "backend": "torch"}, eval={"k": 1, "n_tasks": 1, "before_training": False},
                logging={"progress": False, "tensorboard": False},
                warm_start={"demonstrations": str(write_jsonl(tmp_path / "demos.jsonl", demo_records())),
                            "epochs": 3, "lr": 3e-3, "batch_size": 4, "eval_tasks": 2, **(warm or {})})
    base.update(kw)
    return merge_overrides(None, base)


def graph():
    return _graphs.solver_verifier(Unreachable()).compile()


def shared_policy(**kw):
    return tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=6), **kw)


def metric_lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---- tokenisation ------------------------------------------------------------------------------------------


def test_a_demonstration_is_the_policys_rendered_prompt_and_its_reply_with_the_end_of_turn_token(tmp_path):
    policy = shared_policy()
    records = [{"messages": [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "2 + 2?"},
                             {"role": "assistant", "content": "4", "weight": 0},
                             {"role": "user", "content": "And 3 + 3?"},
                             {"role": "assistant", "content": "The answer is 6."}]}]
    demos = read_jsonl(write_jsonl(tmp_path / "d.jsonl", records), agent="solver", agents=["solver"], key="k")
    assert len(demos) == 1  # the assistant message of weight 0 is context, not a demonstration
    example = tokenise(demos[0], policy, constrain=True)
    messages = [SystemMessage("Solve it."), HumanMessage("2 + 2?"), AIMessage("4"), HumanMessage("And 3 + 3?")]
    assert list(example.prompt_ids) == policy.render(messages)
    decode = policy.tokenizer.decode
    assert decode(list(example.prompt_ids)) == ("<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\n2 + 2?"
                                                "<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n"
                                                "And 3 + 3?<|im_end|>\n<|im_start|>assistant\n")
    eos = policy.tokenizer.eos_token_id
    assert list(example.response_ids) == policy.tokenizer.encode("The answer is 6.", add_special_tokens=False) + [eos]
    assert decode(list(example.response_ids)) == "The answer is 6.<|im_end|>"
    assert example.grammar is None  # free text: no grammar
    # the loss is on the reply's tokens only: the batch's mask covers them, predicted from the positions before
    P, R = len(example.prompt_ids), len(example.response_ids)
    batch = collate([example.sample(0)], pad_id=0, device=torch.device("cpu"))
    assert batch.inputs["input_ids"][0].tolist() == list(example.prompt_ids + example.response_ids)
    assert batch.mask_BT.tolist() == [[True] * R]
    assert batch.logit_index_BT[0].tolist() == list(range(P - 1, P + R - 1))
    assert batch.response_ids_BT[0].tolist() == list(example.response_ids)


def test_tool_calls_are_written_in_the_policys_syntax_and_read_back_by_its_parser(tmp_path):
    call = {"id": "call_1", "type": "function", "function": {"name": "calc",
                                                           "arguments": '{"precision": 2, "expression": "2+2"}'}}
    records = [{"agent": "worker", "tools": TOOLS, "messages": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
        {"role": "assistant", "content": "It is 4."}]}]
    demos = read_jsonl(write_jsonl(tmp_path / "d.jsonl", records), agent=None, agents=["worker"], key="k")
    hermes = shared_policy()
    text = reply_text(demos[0], "hermes")  # the arguments in the schema's order: what the grammar makes it write
    assert text == 'Let me compute.\n<tool_call>{"name": "calc", "arguments": {"expression": "2+2", "precision": 2}}</tool_call>'
    parsed = hermes.parse(text)
    assert parsed.content == "Let me compute."
    assert [(c["name"], c["args"]) for c in parsed.tool_calls] == [("calc", {"expression": "2+2", "precision": 2})]
    mistral_text = reply_text(demos[0], "mistral")
    assert mistral_text == 'Let me compute. [TOOL_CALLS] [{"name": "calc", "arguments": {"expression": "2+2", "precision": 2}}]'
    back = parse_mistral(mistral_text)
    assert back.content == "Let me compute." and [(c["name"], c["args"]) for c in back.tool_calls] == [
        ("calc", {"expression": "2+2", "precision": 2})]
    # tokenised: the tools rendered in the prompt, the call under the grammar of an offered tool (tool_choice auto)
    example = tokenise(demos[0], hermes, constrain=True)
    assert list(example.prompt_ids) == hermes.render([HumanMessage("What is 2+2?")], TOOLS)
    assert hermes.tokenizer.decode(list(example.response_ids)) == text + "<|im_end|>"
    assert example.grammar == hermes.grammar_for(None, TOOLS, {}) and disallowed(example, hermes) is None
    demo_order = text.replace('"expression": "2+2", "precision": 2', '"precision": 2, "expression": "2+2"')
    ids = hermes.tokenizer.encode(demo_order, add_special_tokens=False) + [hermes.tokenizer.eos_token_id]
    with pytest.raises(Exception, match="not allowed by its grammar"):  # the demonstration's own key order is not
        hermes.grammars.masks(example.grammar, ids)
    # the second reply's prompt: the conversation as the demonstration has it, rendered by the template
    second = tokenise(demos[1], hermes, constrain=True)
    assert hermes.tokenizer.decode(list(second.prompt_ids)).endswith(
        '<|im_start|>assistant\nLet me compute.<tool_call>{"name": "calc", "arguments": {"precision": 2, '
        '"expression": "2+2"}}</tool_call><|im_end|>\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n')
    assert hermes.tokenizer.decode(list(second.response_ids)) == "It is 4.<|im_end|>"


def test_structured_output_replies_are_written_as_the_grammar_allows_and_the_others_are_reported(tmp_path):
    policy = shared_policy()
    schema = {"type": "object", "properties": {"verdict": {"type": "string"}, "reason": {"type": "string"}},
              "required": ["verdict", "reason"]}
    forced = {"type": "function", "function": {"name": "calc"}}
    call = {"id": "c", "type": "function", "function": {"name": "calc", "arguments": '{"precision": 1, "expression": "1"}'}}
    records = [
        {"agent": "critic", "response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}},
         "messages": [{"role": "user", "content": "ok?"},
                      {"role": "assistant", "content": '{"reason": "fine", "verdict": "yes"}'}]},
        {"agent": "critic", "response_format": {"type": "json_object"},
         "messages": [{"role": "user", "content": "ok?"}, {"role": "assistant", "content": "No."}]},
        {"agent": "worker", "tools": TOOLS, "tool_choice": forced,
         "messages": [{"role": "user", "content": "1?"}, {"role": "assistant", "tool_calls": [call]}]},
    ]
    demos = read_jsonl(write_jsonl(tmp_path / "d.jsonl", records), agent=None, agents=["critic", "worker"], key="k")
    schema_ex, prose_ex, forced_ex = (tokenise(d, policy, constrain=True) for d in demos)
    assert policy.tokenizer.decode(list(schema_ex.response_ids)) == '{"verdict": "yes", "reason": "fine"}<|im_end|>'
    assert list(schema_ex.prompt_ids) == policy.render([HumanMessage("ok?")], None, demos[0].response_format)
    assert disallowed(schema_ex, policy) is None
    first = policy.tokenizer.encode("No.", add_special_tokens=False)[0]  # 'N': a JSON object starts with '{'
    assert disallowed(prose_ex, policy) == (f"token {first} at position 0 of the response is not allowed by its "
                                            "grammar: the response was not decoded under it")
    # a forced tool: its arguments as one JSON object, which the app's structured-output path reads back as the call
    text = reply_text(demos[2], "hermes")
    assert text == '{"expression": "1", "precision": 1}' and disallowed(forced_ex, policy) is None
    parts, _ = apply_spec(demos[2].response_format, None, text, policy.parse, "worker")
    assert [(c["name"], c["args"]) for c in parts.tool_calls] == [("calc", {"expression": "1", "precision": 1})]
    # constrain off (agents.<a>.constrain: false): no grammar, nothing refused
    assert tokenise(demos[1], policy, constrain=False).grammar is None


def test_the_supervised_logprobs_are_those_of_the_masked_distribution(tmp_path):
    from drmas_graph.train.engines import LossSettings, UpdateSettings
    from drmas_graph.train.optim import SupervisedUpdater

    policy = shared_policy()
    schema = {"type": "object", "properties": {"verdict": {"type": "string"}}, "required": ["verdict"]}
    records = [{"agent": "critic", "response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}},
                "messages": [{"role": "user", "content": "ok?"}, {"role": "assistant", "content": '{"verdict": "no"}'}]}]
    demo = read_jsonl(write_jsonl(tmp_path / "d.jsonl", records), agent=None, agents=["critic"], key="k")[0]
    masked, free = tokenise(demo, policy, constrain=True), tokenise(demo, policy, constrain=False)
    assert masked.response_ids == free.response_ids and masked.grammar is not None and free.grammar is None
    from drmas_graph.config import AgentConfig
    sup = SupervisedUpdater(policy.model, name="m", settings=UpdateSettings(backend="torch"), lr=1e-3,
                            agent_settings={"critic": LossSettings()}, agent_cfgs={"critic": AgentConfig(model="m")},
                            grammars=policy.grammars)
    try:
        lp_masked, lp_free = sup.logprobs([masked.sample(0), free.sample(1)])
    finally:
        sup.close()
    n_allowed = allowed_tokens(policy.grammars.masks(masked.grammar, masked.response_ids), policy.vocab_size).sum(-1)
    forced = n_allowed == 1  # e.g. the key `verdict`: the only one the schema allows
    assert forced.sum() >= 3
    assert torch.all(lp_masked[forced] == 0.0) and torch.all(lp_free[forced] < -1.0)
    assert torch.all(lp_masked >= lp_free - 1e-5)  # renormalised over the allowed tokens


# ---- the warm start ---------------------------------------------------------------------------------------


def test_the_loss_falls_the_demonstrations_logprobs_rise_and_everything_is_logged_and_saved(tmp_path, capsys):
    from safetensors.torch import load_file

    from drmas_graph.train.loop._metric_reference import is_documented
    from drmas_graph.ui._data import Run
    from drmas_graph.ui._pages import ChartOptions, chart_series

    policy = shared_policy()
    cfg = config(tmp_path, logging={"progress": True, "tensorboard": False})
    result = warm_start(graph(), ParityEnv(), cfg, policies={"solver": policy, "verifier": policy})
    assert result.examples == {"solver": 6, "verifier": 6} and result.left_out == {}
    for agent in ("solver", "verifier"):
        losses = result.losses[agent]
        assert len(losses) == 3 and losses[0] > 5.0 and losses[2] < losses[1] < losses[0] and losses[2] < losses[0] - 1.2
        assert result.after[f"{agent}/logprob"] > result.before[f"{agent}/logprob"] + 1.5
        assert 0.0 <= result.before[f"{agent}/format_score"] <= 1.0 and f"{agent}/reward" in result.after
    # the logged logprob is the policy's own: recomputed here from its module
    demos = read_jsonl(tmp_path / "demos.jsonl", agent=None, agents=["solver", "verifier"], key="k")
    examples = [tokenise(d, policy, constrain=True) for d in demos if d.agent == "solver"]
    total = n = 0.0
    with torch.no_grad():
        for x in examples:
            ids = torch.tensor([list(x.prompt_ids + x.response_ids)])
            logits = policy.model(input_ids=ids).logits[0, len(x.prompt_ids) - 1:-1].float()
            total += float(torch.log_softmax(logits, -1).gather(1, torch.tensor(x.response_ids)[:, None]).sum())
            n += len(x.response_ids)
    assert result.after["solver/logprob"] == pytest.approx(total / n, abs=1e-4)
    # progress: a line per epoch where no live bar can be drawn
    out = capsys.readouterr().out
    assert [line.split("  ")[0] for line in out.splitlines() if line.startswith("warm start epoch")] == [
        "warm start epoch 0 (1/3)", "warm start epoch 1 (2/3)", "warm start epoch 2 (3/3)"]
    # metrics.jsonl: the scores before at step -4, epochs at -3..-1, the scores after at -1; documented, charted
    run_dir = tmp_path / "run"
    lines = metric_lines(run_dir)
    assert [r["step"] for r in lines] == [-4, -3, -2, -1, -1]
    assert [r["agent/solver/warm_start_loss"] for r in lines[1:4]] == result.losses["solver"]
    assert lines[0]["agent/solver/warm_start_logprob"] == result.before["solver/logprob"]
    assert lines[-1]["agent/verifier/warm_start_examples"] == 6 and lines[-1]["agent/verifier/warm_start_left_out"] == 0
    assert all(is_documented(k) for r in lines for k in r if k not in ("step", "time")), lines
    charts = chart_series([Run("r", run_dir)], {"r": 0}, ChartOptions())
    assert sorted(s.label for s in charts["agent/*/warm_start_loss"]) == ["r / solver", "r / verifier"]
    assert [p[0] for p in charts["agent/*/warm_start_format_score"][0].points] == [-4.0, -1.0]
    # the checkpoint holds the warm-started weights
    saved = load_file(run_dir / "checkpoints" / "warm_start" / policy.name / "model" / "model.safetensors")
    state = policy.model.state_dict()
    assert saved.keys() <= state.keys() and all(torch.equal(saved[k], state[k]) for k in saved)
    assert json.loads((run_dir / "checkpoints" / "warm_start" / "warm_start.json").read_text())["losses"] == result.losses
    assert "loss solver" in result.summary() and "format_score verifier" in result.summary()


def test_episodes_recorded_with_the_apps_own_model_are_demonstrations_when_their_reward_passes(tmp_path):
    class AdditionEnv:
        def tasks(self, split):
            return [Task(id=f"{split}-{i}", input={"question": f"What is {i} + {i}?"}, answer=str(2 * i))
                    for i in range(4)]

        def reward(self, task, episode):
            return float(episode.final_state["answer"] == f"The answer is {task.answer}.")

    env = AdditionEnv()
    replies = []
    for i in range(4):  # right, wrong, right, wrong
        replies += [f"The answer is {2 * i if i % 2 == 0 else 99}.", "yes"]
    app_model = FakeListChatModel(responses=replies + ["The answer is 0.", "yes"])
    store_path = tmp_path / "recorded.db"
    with TraceStore(store_path) as store:  # the app's own model answers every agent: no policy
        app = instrument(_graphs.solver_verifier(app_model).compile(), policies={}, strict=False, store=store)
        for task in env.tasks("train") + env.tasks("test")[:1]:  # a held-out task's episode too
            app.rollout(task.input, task_id=task.id)
        episodes = [store.load_episode(s.id) for s in store.episodes()]
    assert all(not t.trainable for ep in episodes for t in ep.turns)

    from drmas_graph.config import RolloutConfig

    demos, counts = read_traces(store_path, env, agents=["solver", "verifier"], min_reward=1.0, reward="env",
                                held_out={t.id for t in env.tasks("test")}, rollout=RolloutConfig(),
                                invalid_penalty=0.0)
    assert counts == {"episodes": 5, "kept": 2, "below_min_reward": 2, "failed": 0, "held_out": 1, "no_reward": 0,
                      "no_task": 0, "turns_left_out": 0}
    assert [(d.agent, d.content) for d in demos] == [("solver", "The answer is 0."), ("verifier", "yes"),
                                                     ("solver", "The answer is 4."), ("verifier", "yes")]
    policy = shared_policy()
    turn = episodes[0].turns[0]
    example = tokenise(demos[0], policy, constrain=True)
    assert list(example.prompt_ids) == policy.render(turn.messages, turn.tools, turn.response_format)
    assert list(example.response_ids) == policy.tokenizer.encode(turn.response_text, add_special_tokens=False) + [
        policy.tokenizer.eos_token_id]
    # stored rewards instead of the environment's: every training episode was stored with reward 1
    with TraceStore(store_path) as store:
        store.record_training(None, [type(ep)(**{**ep.__dict__, "rewards": {"solver": 1.0, "verifier": 1.0}})
                                     for ep in episodes if ep.task_id.startswith("train")])
    stored, counts = read_traces(store_path, env, agents=["solver"], min_reward=1.0, reward="stored",
                                 held_out={"test-0"}, rollout=RolloutConfig(), invalid_penalty=0.0)
    assert counts["kept"] == 4 and counts["held_out"] == 1 and len(stored) == 4
    # the warm start from the trace store
    cfg = config(tmp_path, warm={"demonstrations": None, "traces": str(store_path), "eval_tasks": 0, "epochs": 2})
    result = warm_start(_graphs.solver_verifier(Unreachable()).compile(), env, cfg,
                        policies={"solver": policy, "verifier": policy})
    assert result.examples == {"solver": 2, "verifier": 2} and result.traces["kept"] == 2
    assert result.losses["solver"][1] < result.losses["solver"][0]
    assert set(result.before) == {"solver/logprob", "verifier/logprob"}  # eval_tasks 0: no held-out scores


def test_lora_adapters_are_warm_started_per_agent_and_the_base_stays(tmp_path):
    from drmas_graph.engine import load_adapter_weights

    cfg = config(tmp_path, models={"m": {"tiny": {"seed": 0}, "lora": {"r": 4, "alpha": 8}}},
                 agents={a: {"model": "m", "sampling": {"max_new_tokens": 6}} for a in ("solver", "verifier")},
                 warm={"agents": ["solver"], "eval_tasks": 0, "lr": 5e-2})
    probe = cfg.model_copy(update={"run_dir": str(tmp_path / "probe"), "warm_start": None})
    trainer = Trainer(graph(), ParityEnv(), probe, train=False)  # the same model, built from the config, untouched
    try:
        before = {k: v.clone() for k, v in trainer.state.models["m"].trained.state_dict().items()}
    finally:
        trainer.close()
    result = warm_start(graph(), ParityEnv(), cfg)
    assert result.examples == {"solver": 6} and result.not_chosen == {"verifier": 6}
    # (an adapter cannot reach the tiny model's frozen head and final norm: its loss falls less than a full model's)
    losses = result.losses["solver"]
    assert losses[2] < losses[1] < losses[0] and losses[2] < losses[0] - 0.25, losses
    assert result.after["solver/logprob"] > result.before["solver/logprob"] + 0.25
    ckpt = tmp_path / "run" / "checkpoints" / "warm_start" / "m" / "model"
    assert (ckpt / "solver" / "adapter_model.safetensors").exists()
    # loaded into a fresh build of the run (what `train` does): the solver's adapter moved, nothing else
    trainer = Trainer(graph(), ParityEnv(), probe, train=False)
    try:
        model = trainer.state.models["m"].trained
        load_adapter_weights(model, ckpt)
        after = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        trainer.close()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert any("lora_A.solver." in k for k in moved) and any("lora_B.solver." in k for k in moved)
    assert all(".solver." in k for k in moved)  # the base and the verifier's adapter are as they were


@pytest.mark.parametrize("reference", ["warm", "base"])
def test_the_kl_reference_of_the_rl_is_the_warm_started_policy_unless_the_config_says_otherwise(tmp_path, reference):
    lora = {"m": {"tiny": {"seed": 0}, "lora": {"r": 4, "alpha": 8}}}
    agents = {a: {"model": "m", "sampling": {"max_new_tokens": 6}} for a in ("solver", "verifier")}
    cfg = config(tmp_path, models=lora, agents=agents, update={"lr": 1e-3, "backend": "torch", "kl_coef": 0.1},
                 warm={"eval_tasks": 0, "lr": 1e-2, "kl_reference": reference, "agents": ["solver"]})
    result = train_graph(graph(), ParityEnv(), cfg)
    first = result.history[0]  # measured on the first mini-batch, before the RL's first optimizer step
    if reference == "warm":
        assert first["agent/solver/kl_ref"] < 1e-6
    else:  # the base: the warm start moved the solver's adapter away from it
        assert first["agent/solver/kl_ref"] > 1e-3
    assert first["agent/verifier/kl_ref"] < 1e-6  # not warm-started: its adapter is the base's


def test_full_model_kl_reference_base_is_the_weights_before_the_warm_start(tmp_path):
    def first_kl(run, reference):
        policy = shared_policy()
        cfg = config(tmp_path / run, update={"lr": 1e-3, "backend": "torch", "kl_coef": 0.1},
                     warm={"eval_tasks": 0, "kl_reference": reference})
        result = train_graph(graph(), ParityEnv(), cfg, policies={"solver": policy, "verifier": policy})
        return result.history[0]["agent/solver/kl_ref"]

    assert first_kl("warm", "warm") < 1e-6 and first_kl("base", "base") > 1e-3


# ---- checkpoint, resume, restart ----------------------------------------------------------------------------


def test_a_finished_warm_start_is_loaded_never_redone_and_shown_in_the_summary(tmp_path):
    from safetensors.torch import load_file

    cfg = config(tmp_path, warm={"eval_tasks": 0}, checkpoint_every=1)
    first = warm_start(graph(), ParityEnv(), cfg, policies={"solver": (p := shared_policy()), "verifier": p})
    ckpt = tmp_path / "run" / "checkpoints" / "warm_start"
    written = (ckpt / "warm_start.json").stat().st_mtime_ns
    fresh = shared_policy()  # a new process: the base weights
    result = train_graph(graph(), ParityEnv(), cfg, policies={"solver": fresh, "verifier": fresh})
    assert result.warm_start.losses == first.losses and "warm start: 3 epoch(s) on 12 demonstrations" in result.summary()
    lines = metric_lines(tmp_path / "run")
    assert [r["step"] for r in lines if "warm_start/epoch" in r] == [-3, -2, -1]  # once
    assert [r["step"] for r in lines if "reward/team_mean" in r] == [0]
    # resumed with more steps: the warm start is neither redone nor loaded over the step's weights
    again = shared_policy()
    resumed = train_graph(graph(), ParityEnv(), cfg.model_copy(update={"resume": True, "steps": 2}),
                          policies={"solver": again, "verifier": again})
    assert [r["step"] for r in resumed.history] == [1] and resumed.warm_start.losses == first.losses
    assert (ckpt / "warm_start.json").stat().st_mtime_ns == written
    assert [r["step"] for r in metric_lines(tmp_path / "run") if "warm_start/epoch" in r] == [-3, -2, -1]
    step_1 = load_file(tmp_path / "run" / "checkpoints" / "step_000001" / fresh.name / "model" / "model.safetensors")
    warm = load_file(ckpt / fresh.name / "model" / "model.safetensors")
    assert any(not torch.equal(step_1[k], warm[k]) for k in warm)  # the RL step trained on from the warm weights


def test_the_rl_starts_from_the_warm_started_weights(tmp_path):
    from safetensors.torch import load_file

    cfg = config(tmp_path, warm={"eval_tasks": 0})
    warm_start(graph(), ParityEnv(), cfg, policies={"solver": (p := shared_policy()), "verifier": p})
    fresh = shared_policy()
    trainer = Trainer(graph(), ParityEnv(), cfg, policies={"solver": fresh, "verifier": fresh})
    try:
        saved = load_file(tmp_path / "run" / "checkpoints" / "warm_start" / fresh.name / "model" / "model.safetensors")
        state = fresh.model.state_dict()
        assert all(torch.equal(saved[k], state[k]) for k in saved) and fresh.version == 1
    finally:
        trainer.close()


class _KilledEnv(ParityEnv):
    """Ctrl-C arrives while the held-out tasks are scored after the warm start (its `after`-th reward)."""

    def __init__(self, after, **kw):
        super().__init__(**kw)
        self.after, self.calls = after, 0

    def reward(self, task, episode):
        self.calls += 1
        if self.calls > self.after:
            raise KeyboardInterrupt
        return super().reward(task, episode)


def test_a_killed_warm_start_starts_over_cleanly_with_the_numbers_of_an_uninterrupted_one(tmp_path):
    cfg = config(tmp_path, warm={"eval_tasks": 2})  # before: 2 tasks x k 1 = 2 rewards
    killed = shared_policy()
    with pytest.raises(KeyboardInterrupt):
        warm_start(graph(), _KilledEnv(after=2), cfg, policies={"solver": killed, "verifier": killed})
    run_dir = tmp_path / "run"
    assert not (run_dir / "checkpoints" / "warm_start").exists() and not (run_dir / "checkpoints" / ".tmp_warm_start").exists()
    assert [r["step"] for r in metric_lines(run_dir)] == [-4, -3, -2, -1]  # what it did, logged
    again = shared_policy()  # the next process: the base weights
    result = warm_start(graph(), ParityEnv(), cfg, policies={"solver": again, "verifier": again})
    assert [r["step"] for r in metric_lines(run_dir)] == [-4, -3, -2, -1, -1]  # the killed one's lines replaced
    clean_cfg = config(tmp_path / "clean", warm={"eval_tasks": 2})
    clean = warm_start(graph(), ParityEnv(), clean_cfg, policies={"solver": (c := shared_policy()), "verifier": c})
    assert result.losses == clean.losses and result.after == clean.after


# ---- the command line and the config --------------------------------------------------------------------


def write_cli_config(tmp_path, **extra):
    from tests.test_cli_train import write_config

    demos = write_jsonl(tmp_path / "demos.jsonl", demo_records(n=4))
    return write_config(tmp_path, warm_start={"demonstrations": str(demos), "epochs": 2, "lr": 3e-3, "batch_size": 4,
                                              "eval_tasks": 1}, **extra)


def test_drmas_graph_warm_start_alone_then_train_starts_from_it(tmp_path, capsys):
    path = write_cli_config(tmp_path)
    assert main(["warm-start", str(path)]) == 0
    out = capsys.readouterr().out
    assert "warm start: 2 epoch(s) on 8 demonstrations (solver 4, verifier 4)" in out
    assert f"next: drmas-graph train {path}" in out
    summary = tmp_path / "run" / "checkpoints" / "warm_start" / "warm_start.json"
    assert (summary.parent / "tiny" / "model" / "model.safetensors").exists()
    written = summary.stat().st_mtime_ns
    assert main(["warm-start", str(path)]) == 0  # done: reported, not redone
    assert main(["train", str(path)]) == 0
    assert summary.stat().st_mtime_ns == written
    out = capsys.readouterr().out
    assert "loss solver" in out and "evaluation on test" in out
    lines = metric_lines(tmp_path / "run")
    assert [r["step"] for r in lines if "warm_start/epoch" in r] == [-2, -1]
    # the warm start's checkpoint evaluates as any checkpoint does
    assert main(["eval", str(path), "--checkpoint", str(summary.parent), "--k", "1"]) == 0
    assert "avg@1" in capsys.readouterr().out


def test_drmas_graph_train_runs_the_warm_start_first(tmp_path, capsys):
    path = write_cli_config(tmp_path)
    assert main(["train", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.index("warm start: 2 epoch(s)") < out.index("evaluation on test")
    steps = [r["step"] for r in metric_lines(tmp_path / "run")]
    assert steps[:4] == [-3, -2, -1, -1] and steps[4:] == [0, 0, 1]  # then the RL's evaluation, step, evaluation


def test_config_errors_name_the_key_and_the_fix(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"\n  warm_start: Value error, give `demonstrations` .*and/or `traces`"):
        merge_overrides(None, {"warm_start": {"epochs": 2}})
    path = write_cli_config(tmp_path)
    assert main(["warm-start", str(path), "--set", "warm_start=null"]) == 2
    assert "has no `warm_start` section" in capsys.readouterr().err

    def fails(records=None, warm=None, **kw):
        if records is not None:
            write_jsonl(tmp_path / "bad.jsonl", records)
        cfg = config(tmp_path, warm={"demonstrations": str(tmp_path / "bad.jsonl"), **(warm or {})}, **kw)
        policy = shared_policy()
        with pytest.raises(ConfigError) as info:
            warm_start(graph(), ParityEnv(), cfg, policies={"solver": policy, "verifier": policy})
        return str(info.value)

    ok = demo_records(n=1, agents=("solver",))
    assert fails([{**ok[0], "agent": "planner"}]) == ("warm_start.demonstrations: bad.jsonl line 1 is for agent "
                                                      "'planner', which is no agent of the run; agents: ['solver', "
                                                      "'verifier']")
    missing_agent = {k: v for k, v in ok[0].items() if k != "agent"}
    assert "has no \"agent\" key: give each record one of ['solver', 'verifier'], or map a file to each agent" in fails(
        [missing_agent])
    assert fails(warm={"demonstrations": {"critic": str(tmp_path / "bad.jsonl")}}).startswith(
        "warm_start.demonstrations: 'critic' is no agent of the run; agents: ['solver', 'verifier']")
    assert "warm_start.demonstrations: demonstrations file" in fails(warm={"demonstrations": str(tmp_path / "no.jsonl")})
    bad_args = json.loads(json.dumps(ok[0]))
    bad_args["messages"][2]["tool_calls"] = [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{"}}]
    assert "bad.jsonl line 1, message 2, tool call 0: function.arguments is not a JSON string" in fails([bad_args])
    weighted = json.loads(json.dumps(ok[0]))
    weighted["messages"][1]["weight"] = 1
    assert "message 1: \"weight\" is 0 or 1, on assistant messages only" in fails([weighted])
    assert "agent(s) ['verifier'] are not trained (frozen" in fails(
        demo_records(n=1), agents={"verifier": {"model": "tiny-llama-v512-s0", "frozen": True}})
    assert "warm_start.agents: 'planner' is no agent of the run" in fails(ok, warm={"agents": ["planner"]})


@pytest.mark.skipif(__import__("importlib").util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_on_deepspeed_the_rl_after_the_warm_start_trains_as_from_its_checkpoint(tmp_path):
    """On DeepSpeed, the RL that follows a warm start in the same process (the warm start's engine, then the RL's, on
    one module) gives the weights of an RL that started, in a fresh policy, from the warm start's checkpoint."""
    def run(folder, alone):
        cfg = config(tmp_path / folder, update={"lr": 1e-3, "backend": "deepspeed", "zero_stage": 2},
                     warm={"eval_tasks": 0, "epochs": 2})
        policy = shared_policy()
        if alone:
            warm_start(graph(), ParityEnv(), cfg, policies={"solver": policy, "verifier": policy})
            policy = shared_policy()  # the next process's: base weights, the checkpoint loaded into them
        result = train_graph(graph(), ParityEnv(), cfg, policies={"solver": policy, "verifier": policy})
        return result, {k: v.clone() for k, v in policy.model.state_dict().items()}

    together, weights = run("together", alone=False)
    apart, weights_apart = run("apart", alone=True)
    assert together.warm_start.losses == apart.warm_start.losses
    assert together.warm_start.losses["solver"][1] < together.warm_start.losses["solver"][0]
    assert together.history[0][f"model/tiny-llama-v512-s0/grad_norm"] > 0
    assert all(torch.equal(weights[k], weights_apart[k]) for k in weights)


def test_asynchronous_training_starts_from_a_warm_start_done_in_its_own_process(tmp_path):
    """The asynchronous pipeline numbers the rollout weights from 0: the RL's policies are built from the config and
    load the warm start's checkpoint before they generate (a warm start in the same process is refused)."""
    models = {"m": {"tiny": {"seed": 0}}}
    agents = {a: {"model": "m", "sampling": {"max_new_tokens": 6}} for a in ("solver", "verifier")}
    cfg = config(tmp_path, models=models, agents=agents, steps=2, warm={"eval_tasks": 0},
                 **{"async": {"max_staleness": 1}})
    with pytest.raises(ConfigError, match=r"warm_start before asynchronous training .* `drmas-graph warm-start CONFIG` "
                                          "first"):
        train_graph(graph(), ParityEnv(), cfg)
    warm_start(graph(), ParityEnv(), cfg)
    result = train_graph(graph(), ParityEnv(), cfg)
    assert [r["step"] for r in result.history] == [0, 1]
    assert [r["async/staleness_mean"] for r in result.history] == [0.0, 1.0]  # one step off, from version 0
