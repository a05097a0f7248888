"""LoRA per agent (drmas_graph.train.optim.lora): each agent trains its own adapter over one frozen base model."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch

from drmas_graph.config import AgentConfig, LoraConfig, merge_overrides
from drmas_graph.errors import ConfigError, PolicyError
from drmas_graph.testing import tiny_model, tiny_tokenizer
from drmas_graph.engine.transformers_policy import TransformersPolicy
from drmas_graph.types import Sample, SamplingParams
from drmas_graph.train.loop._metric_reference import is_documented
from drmas_graph.train.optim.update import LossSettings, UpdateSettings

pytest.importorskip("peft")
from drmas_graph.train.optim.lora import LoraUpdater, attach_adapters, base_forward, build_updater  # noqa: E402
from tests.test_trainer_served import ckpt  # noqa: E402,F401  (fixture: the base model servers start from)

pytestmark = [pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning"),
              # peft asks transformers' deprecated is_gradient_checkpointing (transformers 5.x)
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
BACKENDS = ["torch", pytest.param("deepspeed", marks=needs_deepspeed)]
AGENTS = ("solver", "verifier")
LORA = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def lora_model(adapters=AGENTS, seed=0):
    tokenizer = tiny_tokenizer()
    return attach_adapters(tiny_model(tokenizer, seed=seed), LORA, list(adapters)), tokenizer


def randomize(model, adapter, seed):
    """Give `adapter` non-zero B matrices (a fresh adapter equals the base model)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if f"lora_B.{adapter}." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def groups(model):
    """Parameters by owner: 'base' or the adapter name."""
    out = {}
    for name, p in model.named_parameters():
        owner = next((a for a in model.peft_config if f".{a}." in name and "lora_" in name), "base")
        out.setdefault(owner, {})[name] = p.detach().clone()
    return out


def moved(before, after):
    return {owner for owner in before if any(not torch.equal(before[owner][k], after[owner][k]) for k in before[owner])}


def samples_of(model, tokenizer, agents, n=2):
    """Real rollouts of `model` with each agent's adapter; advantages alternate +1/-1."""
    policy = TransformersPolicy(model, tokenizer, name="m")
    out = []
    try:
        for i in range(n):
            for agent in agents:
                prompt = tokenizer.encode(f"What is {i} + 2? Answer:", add_special_tokens=False)
                gen = policy.generate(prompt, SamplingParams(max_new_tokens=5, seed=i, adapter=agent))
                out.append(Sample(prompt_ids=tuple(prompt), response_ids=gen.token_ids, old_logprobs=gen.logprobs,
                                  advantage=1.0 if i % 2 == 0 else -1.0, agent=agent))
    finally:
        policy.close()
    return out


def updater(model, backend="torch", lrs=None, **settings):
    cfgs = {a: AgentConfig(model="m", adapter=a, lr=(lrs or {}).get(a)) for a in AGENTS}
    return build_updater(model, name="m", settings=UpdateSettings(lr=1e-2, backend=backend, **settings),
                         agent_settings={a: LossSettings() for a in AGENTS}, agent_cfgs=cfgs)


# --- training ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_the_acting_agents_adapter_moves_and_the_base_is_bit_identical(backend):
    model, tokenizer = lora_model()
    up = updater(model, backend)
    assert isinstance(up, LoraUpdater)
    samples = samples_of(model, tokenizer, ["solver"])
    before = groups(model)
    metrics = up.update(samples).to_dict()
    after = groups(model)
    assert moved(before, after) == {"solver"}
    assert metrics["model/m/solver/n_minibatches"] == 1 and metrics["model/m/verifier/n_minibatches"] == 0
    assert metrics["agent/solver/logprob_mismatch"] < 1e-5  # rollout with the adapter == trainer's recompute
    # a second update on both agents moves both adapters, never the base
    up.update(samples + samples_of(model, tokenizer, ["verifier"]))
    assert moved(after, groups(model)) == {"solver", "verifier"}
    assert all(torch.equal(before["base"][k], v) for k, v in groups(model)["base"].items())


def test_per_agent_learning_rate_scales_the_step_and_zero_does_not_move():
    model, tokenizer = lora_model()
    randomize(model, "verifier", 3)  # the adapters differ: each sample is scored under its agent's own
    samples = samples_of(model, tokenizer, AGENTS)
    for s, logprobs in zip(samples, updater(copy.deepcopy(model)).compute_logprobs(samples)):
        torch.testing.assert_close(logprobs, torch.tensor(s.old_logprobs), atol=1e-5, rtol=0)
    deltas = {}
    for lr in (1e-3, 2e-3):
        trial = copy.deepcopy(model)
        before = groups(trial)
        updater(trial, lrs={"solver": lr, "verifier": 0.0}).update(samples)
        after = groups(trial)
        assert moved(before, after) == {"solver"}  # the lr-0 agent's adapter is unchanged
        deltas[lr] = torch.cat([(after["solver"][k] - before["solver"][k]).flatten() for k in before["solver"]])
    # AdamW's first step (decay included) is linear in the learning rate
    torch.testing.assert_close(deltas[2e-3], 2 * deltas[1e-3], atol=1e-7, rtol=1e-4)
    assert deltas[1e-3].abs().max() > 1e-4


def test_agents_sharing_an_adapter_must_agree_on_lr():
    model, _ = lora_model(adapters=["shared"])
    cfgs = {"solver": AgentConfig(model="m", adapter="shared", lr=1e-3),
            "verifier": AgentConfig(model="m", adapter="shared", lr=2e-3)}
    with pytest.raises(ConfigError, match=r"adapter 'shared' of model 'm'.*different learning rates"):
        build_updater(model, name="m", settings=UpdateSettings(backend="torch"),
                      agent_settings={a: LossSettings() for a in cfgs}, agent_cfgs=cfgs)


def test_kl_reference_is_the_base_with_adapters_disabled_not_a_copy():
    model, tokenizer = lora_model()
    base = copy.deepcopy(model.get_base_model())  # injected LoRA layers, B = 0
    up = updater(model, kl_coef=0.5)
    ref = up.updaters["solver"]._reference
    assert isinstance(ref, base_forward) and ref.model is model
    samples = samples_of(model, tokenizer, ["solver"])
    first = up.update(samples).to_dict()
    assert first["agent/solver/kl_ref"] == pytest.approx(0.0, abs=1e-7)  # adapters start as the base
    second = up.update(samples).to_dict()
    assert second["agent/solver/kl_ref"] > 1e-6
    ids = torch.tensor([list(samples[0].prompt_ids)])
    torch.testing.assert_close(ref(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_load_resumes_every_adapter_exactly(tmp_path, backend):
    model, tokenizer = lora_model()
    samples = samples_of(model, tokenizer, AGENTS)
    straight = updater(model, backend)
    straight.update(samples)
    straight.save(tmp_path / "ckpt")
    # every adapter is stored once, in peft format under model/ (was N + 1 copies: one per updater too)
    stored = sorted(str(p.relative_to(tmp_path / "ckpt")) for p in (tmp_path / "ckpt").rglob("adapter_model.*"))
    assert stored == ["model/solver/adapter_model.safetensors", "model/verifier/adapter_model.safetensors"]
    straight.update(samples)
    expected = groups(model)

    fresh, _ = lora_model()
    resumed = updater(fresh, backend)
    resumed.load(tmp_path / "ckpt")
    assert resumed.n_updates == 1
    resumed.update(samples)
    got = groups(fresh)
    for owner in expected:
        for k, v in expected[owner].items():
            torch.testing.assert_close(got[owner][k], v, atol=1e-6, rtol=0)


# --- generation --------------------------------------------------------------------------------------------


def test_mixed_batch_generation_equals_a_plain_model_with_the_adapter_merged():
    model, tokenizer = lora_model()
    randomize(model, "solver", 1)
    randomize(model, "verifier", 2)
    policy = TransformersPolicy(model, tokenizer, name="m", batch_wait_s=0.3, max_batch_wait_s=1.0)
    prompt = tokenizer.encode("What is 3 + 4? Answer:", add_special_tokens=False)
    requests = [("solver", 0), ("verifier", 0), (None, 0), ("solver", 1)]
    futures = [policy.submit(prompt, SamplingParams(max_new_tokens=8, seed=seed, adapter=a)) for a, seed in requests]
    got = [f.result() for f in futures]
    policy.close()
    assert policy.stats.max_batch == 4  # one batch, three adapters (base included)
    # the adapters differ (same seed: the near-uniform tiny model may still pick the same tokens)
    assert max(abs(a - b) for a, b in zip(got[0].logprobs, got[1].logprobs)) > 1e-2
    for (adapter, seed), gen in zip(requests, got):
        plain = copy.deepcopy(model)
        if adapter is None:
            merged = plain.unload()
        else:
            plain.set_adapter(adapter)
            merged = plain.merge_and_unload(adapter_names=[adapter])
        assert type(merged).__name__ == "LlamaForCausalLM"
        ref = TransformersPolicy(merged, tokenizer, name="plain")
        expected = ref.generate(prompt, SamplingParams(max_new_tokens=8, seed=seed))
        ref.close()
        assert gen.token_ids == expected.token_ids, adapter
        torch.testing.assert_close(torch.tensor(gen.logprobs), torch.tensor(expected.logprobs), atol=1e-4, rtol=0)


def test_unknown_adapter_and_adapter_on_a_plain_model_are_errors():
    model, tokenizer = lora_model()
    policy = TransformersPolicy(model, tokenizer, name="m")
    with pytest.raises(PolicyError, match=r"unknown LoRA adapter\(s\) \['judge'\].*\['solver', 'verifier'\]"):
        policy.generate([5, 6], SamplingParams(max_new_tokens=2, adapter="judge"))
    policy.close()
    plain = TransformersPolicy(tiny_model(tokenizer), tokenizer, name="plain")
    with pytest.raises(PolicyError, match=r"policy 'plain'.*adapter\(s\) \['solver'\].*models.<name>.lora"):
        plain.generate([5, 6], SamplingParams(max_new_tokens=2, adapter="solver"))
    plain.close()


# --- configuration and the trainer -------------------------------------------------------------------------


def config(tmp_path, **kw):
    base = dict(run_dir=str(tmp_path / "run"), steps=2, tasks_per_step=2, group_size=4,
                update={"lr": 1e-2, "backend": "torch"}, eval={"k": 1, "n_tasks": 1, "before_training": False},
                logging={"progress": False, "tensorboard": False},
                models={"m": {"tiny": {"seed": 0}, "lora": {"r": 4, "alpha": 8}}},
                agents={a: {"model": "m", "sampling": {"max_new_tokens": 6}} for a in AGENTS})
    base.update(kw)
    return merge_overrides(None, base)  # as train_graph() and load_config() validate: ConfigError on errors


def test_config_gives_each_agent_its_own_adapter_and_checks_them(tmp_path):
    cfg = config(tmp_path)
    assert {a: c.adapter for a, c in cfg.agents.items()} == {"solver": "solver", "verifier": "verifier"}
    with pytest.raises(ConfigError, match=r"agents.solver.adapter = 'x' but models.plain has no `lora`"):
        config(tmp_path, models={"plain": {"tiny": {}}}, agents={"solver": {"model": "plain", "adapter": "x"}})
    with pytest.raises(ConfigError, match=r"models.m.lora: no agent uses model 'm'"):
        config(tmp_path, models={"m": {"tiny": {}, "lora": {}}, "p": {"tiny": {}}}, agents={"solver": {"model": "p"}})
    with pytest.raises(ConfigError, match=r"agents.solver.adapter.*'ra'.*part of 'lora_'"):
        config(tmp_path, agents={"solver": {"model": "m", "adapter": "ra"}})


def test_train_graph_trains_one_adapter_per_agent_over_a_frozen_base(tmp_path):
    from drmas_graph.train.loop.trainer import Trainer
    from tests import _graphs
    from tests._envs import ParityEnv
    from tests.test_instrument import Unreachable

    cfg = config(tmp_path, agents={"solver": {"model": "m", "sampling": {"max_new_tokens": 6}},
                                   "verifier": {"model": "m", "lr": 2e-2, "sampling": {"max_new_tokens": 6}}})
    trainer = Trainer(_graphs.solver_verifier(Unreachable()).compile(), ParityEnv(), cfg)
    try:
        model = trainer.state.models["m"].trained
        assert trainer.state.models["m"].policy.model is model  # the embedded policy generates with the adapters
        before = groups(model)
        result = trainer.run()
    finally:
        trainer.close()
    after = groups(model)
    assert moved(before, after) == {"solver", "verifier"}
    assert all(torch.equal(before["base"][k], v) for k, v in after["base"].items())
    diff = [not torch.equal(after["solver"][k], after["verifier"][k.replace(".solver.", ".verifier.")])
            for k in after["solver"]]
    assert any(diff)  # the two agents' adapters differ after training
    last = result.history[-1]
    assert last["model/m/solver/lr"] == 1e-2 and last["model/m/verifier/lr"] == 2e-2
    # step 1 rolls out with the adapters step 0 trained (they differ by then): each agent's rollout logprobs
    # equal the trainer's recompute under its own adapter only if generation used that adapter
    assert last["agent/solver/logprob_mismatch"] < 1e-4 and last["agent/verifier/logprob_mismatch"] < 1e-4
    # docs/reference/metrics.md lists every key a LoRA run logs: its updates' as model/<model>/<adapter>/...
    logged = {k for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)}
    assert {"model/m/solver/grad_norm", "model/m/verifier/n_samples"} <= logged and "model/m/grad_norm" not in logged
    assert [k for k in sorted(logged) if not is_documented(k)] == []
    from drmas_graph.traces.store import TraceStore

    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        episode = store.load_episode(store.episodes(step=1)[0].id)
        assert {t.agent: t.sampling.adapter for t in episode.turns} == {"solver": "solver", "verifier": "verifier"}


def test_a_resumed_lora_run_gives_the_weights_of_the_uninterrupted_run(tmp_path):
    """`resume: true` of a LoRA run (it crashed: the resume check read `settings`, which LoraUpdater lacked)."""
    from drmas_graph.train.loop.trainer import Trainer
    from tests import _graphs
    from tests._envs import ParityEnv
    from tests.test_instrument import Unreachable

    def run(run_dir, steps, resume=False):
        cfg = config(tmp_path, run_dir=str(tmp_path / run_dir), steps=steps, resume=resume, checkpoint_every=1)
        trainer = Trainer(_graphs.solver_verifier(Unreachable()).compile(), ParityEnv(), cfg)
        try:
            return trainer.run(), groups(trainer.state.models["m"].trained)
        finally:
            trainer.close()

    _, want = run("straight", 2)
    run("killed", 1)
    resumed, got = run("killed", 2, resume=True)
    assert [r["step"] for r in resumed.history] == [1]
    assert moved(want, got) == set()  # bit for bit, every adapter and the base


# --- served policies ---------------------------------------------------------------------------------------


def served_config(tmp_path, ckpt, serve, adapters):
    return config(tmp_path, models={"m": {"path": ckpt, "serve": serve, "lora": {"r": 4, "alpha": 8}}},
                  agents={a: {"model": "m", "adapter": adapters[a], "sampling": {"max_new_tokens": 6}} for a in AGENTS})


def test_sglang_serves_the_base_with_the_adapter_merged(tmp_path, ckpt):
    from transformers import AutoModelForCausalLM

    from drmas_graph.train.loop.trainer import Trainer
    from tests import _graphs
    from tests._envs import ParityEnv
    from tests.sglang_double import SGLangDouble
    from tests.test_instrument import Unreachable

    double = SGLangDouble(ckpt, weight_version="0").start()
    cfg = served_config(tmp_path, ckpt, {"engine": "sglang", "urls": [double.url]}, {a: "shared" for a in AGENTS})
    trainer = Trainer(_graphs.solver_verifier(Unreachable()).compile(), ParityEnv(), cfg)
    try:
        local = trainer.state.models["m"].trained
        assert trainer.state.models["m"].policy.lora_merged == "shared"
        result = trainer.run()
    finally:
        trainer.close()
        double.stop()
    base = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    assert all(torch.equal(base[k.replace(".base_layer.", ".")], v)
               for k, v in local.get_base_model().state_dict().items() if ".lora_" not in k)  # the base is frozen
    served, merged = double.model.state_dict(), copy.deepcopy(local).merge_and_unload().state_dict()
    assert sum(not torch.equal(v, base[k]) for k, v in served.items()) > 0  # the server got new weights ...
    assert all(torch.allclose(v, served[k], atol=1e-6) for k, v in merged.items())  # ... base + adapter merged
    # step 1 sampled from the merged weights pushed after step 0: they equal the trainer's adapter model
    assert result.history[1]["agent/solver/logprob_mismatch"] < 1e-4
    assert [b["weight_version"] for p, b in double.requests if p == "POST /update_weights_from_disk"] == ["1", "2"]


def test_sglang_with_two_adapters_and_a_served_request_for_another_adapter_are_errors(tmp_path, ckpt):
    from drmas_graph.served._lora import served_adapter
    from drmas_graph.served import SGLangPolicy
    from drmas_graph.train.loop.trainer import Trainer
    from tests._envs import ParityEnv

    cfg = served_config(tmp_path, ckpt, {"engine": "sglang", "urls": ["http://127.0.0.1:9"]},
                        {a: a for a in AGENTS})
    with pytest.raises(ConfigError, match=r"models.m: serve.engine='sglang' serves merged weights.*\['solver', "
                                          r"'verifier'\].*engine='vllm'"):
        Trainer(None, ParityEnv(), cfg)
    policy = SGLangPolicy("http://127.0.0.1:9", tiny_tokenizer(), name="m")
    policy.lora_merged = "solver"
    assert served_adapter(policy, SamplingParams(adapter="solver")) is None
    with pytest.raises(PolicyError, match=r"adapter 'verifier', but its servers hold adapters \['solver'\]"):
        served_adapter(policy, SamplingParams(adapter="verifier"))
    policy.lora_merged, policy.lora_by_name = None, ("solver", "verifier")
    assert served_adapter(policy, SamplingParams(adapter="verifier")) == "verifier"
    assert served_adapter(policy, SamplingParams()) is None  # the base model
    policy.close()


def test_cli_eval_of_a_checkpoint_loads_the_trained_adapters(tmp_path, capsys):
    from drmas_graph.cli import main
    from drmas_graph.config import load_config
    from drmas_graph.train.loop._checkpoints import load_checkpoint_adapters
    from drmas_graph.train.loop.trainer import Trainer
    from tests import _graphs
    from tests._envs import ParityEnv
    from tests.test_cli_train import write_config
    from tests.test_instrument import Unreachable

    path = write_config(tmp_path, models={"tiny": {"tiny": {"seed": 0}, "lora": {"r": 4, "alpha": 8}}})
    assert main(["train", str(path), "--set", "eval.before_training=false"]) == 0
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    assert (ckpt / "tiny" / "model" / "solver" / "adapter_model.safetensors").exists()
    assert main(["eval", str(path), "--checkpoint", str(ckpt), "--k", "1"]) == 0
    assert "avg@1" in capsys.readouterr().out

    from safetensors.torch import load_file

    saved = load_file(ckpt / "tiny" / "model" / "verifier" / "adapter_model.safetensors")
    cfg = load_config(path, [f"run_dir={tmp_path / 'eval'}"])
    trainer = Trainer(_graphs.solver_verifier(Unreachable()).compile(), ParityEnv(), cfg, train=False)
    try:
        model = trainer.state.models["tiny"].trained
        fresh = groups(model)["verifier"]
        load_checkpoint_adapters(trainer, ckpt)
        loaded = groups(model)["verifier"]
    finally:
        trainer.close()
    assert len(saved) == len(loaded) and any(not torch.equal(fresh[k], loaded[k]) for k in loaded)
    for key, value in saved.items():  # peft drops the adapter name from the saved keys
        name = key.replace(".lora_A.weight", ".lora_A.verifier.weight").replace(".lora_B.weight", ".lora_B.verifier.weight")
        assert torch.equal(loaded[name], value)
