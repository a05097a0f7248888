"""Prefix-shared packing (drmas_graph.train.optim._packing) and the on-policy update without a logprob pass: the
packed update takes the padded update's step (loss, grad norm, every gradient coordinate: rel 1e-5 in
float32) for every estimator, loss aggregation, micro-batching, ZeRO stage and LoRA, computing each distinct
token once; a model that cannot take the tree mask trains on padded rows, with the reason logged."""

from __future__ import annotations

import importlib.util
import logging
import random

import pytest
import torch

from drmas_graph.errors import ConfigError
from drmas_graph.testing import tiny_model, tiny_tokenizer
from drmas_graph.train.optim._old_logprobs import with_trainer_logprobs
from drmas_graph.train.optim._packing import (PROBE_NODES_DEFAULT, PROBE_NODES_MIN, PackingProbes, build_tree, check_packing,
                                        pack_rows, row_nodes, sequences_of, tree_inputs)
from drmas_graph.train.optim.advantages import list_estimators, compute_advantages
from drmas_graph.train.optim.losses import list_loss_aggregations
from drmas_graph.train.optim.update import LossSettings, ModelUpdater, UpdateSettings
from drmas_graph.types import Sample

pytestmark = [pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
AGENTS = {"solver": LossSettings(micro_batch_size=4), "verifier": LossSettings(micro_batch_size=2, clip_high=0.05)}
LR = 1e-3
WEIGHT_DECAY = UpdateSettings().weight_decay


def build_model(seed: int = 3) -> torch.nn.Module:
    return tiny_model(tiny_tokenizer(), seed=seed)


def draft_samples(estimator: str = "agent") -> list[Sample]:
    """Three GRPO groups of 4 (two of the solver, one of the verifier) and a 4-turn solver chain whose turn k
    prompt holds turns 1..k-1 (prompt, response, a tool result). In each group, response 1 starts with
    response 0's first two tokens and response 3 repeats response 2. Advantages by `estimator` from seeded
    rewards; old logprobs 0 (set by `with_old_logprobs`)."""
    rng = random.Random(5)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    rows = []  # (prompt, response, agent, group, episode, turn)
    for g, agent in enumerate(["solver", "solver", "verifier"]):
        prompt = tokens(6 + 3 * g)
        responses = [tokens(5), None, tokens(4 + g), None]
        responses[1] = responses[0][:2] + tokens(3)
        responses[3] = list(responses[2])
        rows += [(prompt, r, agent, f"g{g}", f"g{g}e{j}", 0) for j, r in enumerate(responses)]
    prompt = tokens(5)
    for turn in range(4):
        response = tokens(3 + turn)
        rows.append((list(prompt), response, "solver", "chain", "chain", turn))
        prompt = prompt + response + tokens(2)  # the next turn's prompt: this turn, then the tool's answer
    rewards = [rng.choice([0.0, 1.0, 0.5]) - (0.1 if i % 5 == 0 else 0.0) for i in range(len(rows))]
    adv = compute_advantages(rewards, group_ids=[r[3] for r in rows], agent_ids=[r[2] for r in rows],
                             episode_ids=[r[4] for r in rows], turn_ids=[r[5] for r in rows], estimator=estimator)
    return [Sample(tuple(p), tuple(r), (0.0,) * len(r), advantage=float(a), agent=agent,
                   temperature=0.7 if agent == "solver" else 1.0, episode_id=ep, turn_index=turn)
            for (p, r, agent, _, ep, turn), a in zip(rows, adv.tolist())]


def with_old_logprobs(samples: list[Sample], model: torch.nn.Module) -> list[Sample]:
    """Old logprobs = the model's own (padded rows) plus seeded noise, so that some ratios leave the clip range."""
    probe = ModelUpdater(model, name="probe", settings=UpdateSettings(backend="torch", pack_prefixes=False))
    gen = torch.Generator().manual_seed(7)
    noisy = [lp + 0.3 * torch.randn(lp.shape, generator=gen) for lp in probe.compute_logprobs(samples)]
    return with_trainer_logprobs(samples, noisy)[0]


@pytest.fixture(scope="module")
def samples() -> list[Sample]:
    return with_old_logprobs(draft_samples(), build_model())


def run(samples: list[Sample], *, model=None, agent_settings=AGENTS, old_logprobs="given", **changes):
    """One update: (metrics, the accumulated gradient of every parameter before the step, parameters after)."""
    model = model if model is not None else build_model()
    grads: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.detach().clone()))
    settings = UpdateSettings(**{"lr": LR, "backend": "torch", "grad_clip": None, **changes})
    updater = ModelUpdater(model, name="m", settings=settings, agent_settings=agent_settings)
    metrics = updater.update(samples, old_logprobs=old_logprobs)
    with updater.full_weights():
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return metrics, grads, params


def assert_same_step(a, b, start: dict | None = None, *, grads: bool = True, grad_rtol: float = 1e-5) -> None:
    """Two updates took the same step: loss and grad norm rel 1e-5; each gradient tensor rel `grad_rtol` (1e-5)
    of its largest entry. Parameters after the first AdamW step, p = w0 (1 - lr wd) - lr u with u = g / (|g| + eps):
    where |u| > 0.9999 on both sides (|g| > 1e-4 = 1e4 eps) u agrees to 1e-5 beyond the float32 resolution
    of p (2 ulp(w0) / lr: 2.4e-4 for a norm weight of 1 at lr 1e-3); near |g| ~ eps = 1e-8 the ratio
    amplifies the float roundoff of any other summation order (as a different micro-batch size does), so
    there u only agrees within 0.5 (a wrongly signed or weighted sample flips steps: differences ~2)."""
    (ma, ga, pa), (mb, gb, pb) = a, b
    assert mb.loss == pytest.approx(ma.loss, rel=1e-5, abs=1e-7)
    assert mb.grad_norm == pytest.approx(ma.grad_norm, rel=1e-5)
    if grads:
        assert set(ga) == set(gb) and ga
        for k in ga:
            torch.testing.assert_close(gb[k], ga[k], rtol=0, atol=grad_rtol * ga[k].abs().max().item() + 1e-12, msg=k)
    if start is not None:
        n_full = n_all = 0
        for k, w0 in start.items():
            decayed = w0 * (1 - LR * WEIGHT_DECAY)
            ua, ub = (decayed - pa[k]) / LR, (decayed - pb[k]) / LR
            full = (ua.abs() > 0.9999) & (ub.abs() > 0.9999)
            n_full, n_all = n_full + int(full.sum()), n_all + full.numel()
            resolution = 2 * torch.finfo(torch.float32).eps * (w0.abs() + LR) / LR  # of u read back from float32 p
            excess = ((ua - ub).abs() - resolution)[full]
            assert excess.max().item() <= 1e-5 if full.any() else True, (k, excess.max().item())
            assert (ua - ub).abs().max().item() < 0.5, k
        assert n_full > 0.3 * n_all  # most coordinates took a full step: the check has teeth


def initial_params(model=None) -> dict[str, torch.Tensor]:
    model = model if model is not None else build_model()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


# --- the tree ----------------------------------------------------------------------------------------------


def test_tree_of_hand_written_sequences_and_its_mask():
    tree = build_tree([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7], [9]])
    # depth-first, children by token: 1 2 3 4 | 6 7 | 5 | 9
    assert tree.tokens_N == [1, 2, 3, 4, 6, 7, 5, 9]
    assert tree.depth_N == [0, 1, 2, 3, 3, 4, 2, 0]
    assert tree.end_N == [7, 7, 6, 4, 6, 6, 7, 8]
    assert tree.paths == [[0, 1, 2, 3], [0, 1, 6], [0, 1, 2, 4, 5], [7]]
    inputs = tree_inputs(tree, mask_kind="bool", dtype=torch.float32, device=torch.device("cpu"))
    allowed = inputs["attention_mask"][0, 0]
    want = torch.zeros(8, 8, dtype=torch.bool)
    for path in tree.paths:  # node path[k] sees path[0..k]
        for k, node in enumerate(path):
            want[node, path[: k + 1]] = True
    assert torch.equal(allowed, want)
    assert inputs["position_ids"].tolist() == [tree.depth_N]
    additive = tree_inputs(tree, mask_kind="additive", dtype=torch.float32, device=torch.device("cpu"))
    mask = additive["attention_mask"][0, 0]
    assert torch.equal(mask == 0, want) and mask.min().item() == torch.finfo(torch.float32).min


def test_pack_rows_puts_shared_prefixes_together_within_the_node_limit():
    sequences = [[5, 1, 2], [1, 2, 3], [5, 1, 9], [1, 2, 4, 4]]
    # sorted: [1,2,3] [1,2,4,4] [5,1,2] [5,1,9]; nodes: 3, +2 = 5 | 3, +1 = 4
    assert pack_rows([10, 11, 12, 13], sequences, 5) == [[11, 13], [10, 12]]
    assert pack_rows([10, 11, 12, 13], sequences, 9) == [[11, 13, 10, 12]]
    assert pack_rows([10, 11, 12, 13], sequences, 2) == [[11], [13], [10], [12]]  # too long: alone


def test_packed_logprobs_equal_the_padded_ones(samples):
    for attn in ("sdpa", "eager"):
        padded = ModelUpdater(build_model(), name="m", settings=UpdateSettings(backend="torch", pack_prefixes=False,
                                                                               attn_implementation=attn))
        packed = ModelUpdater(build_model(), name="m", settings=UpdateSettings(backend="torch", attn_implementation=attn))
        assert packed._mask_kind == {"sdpa": "bool", "eager": "additive"}[attn] and padded._mask_kind is None
        for a, b in zip(padded.compute_logprobs(samples), packed.compute_logprobs(samples)):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


# --- the packed update takes the padded step -------------------------------------------------------------


@pytest.mark.parametrize("agg", list_loss_aggregations())
@pytest.mark.parametrize("estimator", list_estimators())
def test_packed_update_takes_the_padded_step(estimator, agg):
    model = build_model()
    samples = with_old_logprobs(draft_samples(estimator), model)
    extra = {"norm_len": 8} if agg == "seq-mean-token-sum-norm" else {}
    padded = run(samples, pack_prefixes=False, loss_agg=agg, **extra)
    packed = run(samples, loss_agg=agg, **extra)
    assert_same_step(padded, packed, initial_params())
    assert packed[0].packed and not padded[0].packed
    # each distinct token once: the trie of each micro-batch (here: of each agent's samples, all fitting)
    by_agent = {a: [s for s in samples if s.agent == a and s.advantage != 0] for a in AGENTS}
    distinct = sum(len(build_tree(sequences_of(rows)).tokens_N) for rows in by_agent.values())
    assert packed[0].forward_tokens <= distinct + 2 * len(AGENTS) * 3  # cut into at most 3 packs per agent
    assert packed[0].forward_tokens < 0.6 * padded[0].forward_tokens


@pytest.mark.parametrize("changes", [{"kl_coef": 0.5, "entropy_coef": 0.1}, {"logprob_chunk_tokens": 0},
                                     {"logprob_chunk_tokens": 3, "entropy_coef": 0.1}, {"attn_implementation": "eager"},
                                     {"gradient_checkpointing": True}, {"max_tokens_per_micro_batch": 30},
                                     {"n_minibatches": 2}])
def test_packed_update_takes_the_padded_step_with(samples, changes):
    first_step = "n_minibatches" not in changes  # two AdamW steps: u is no longer g / (|g| + eps)
    # With two mini-batches the gradients compared are the second one's, taken at weights after a first AdamW
    # step, where u = g / (|g| + eps) amplified the packed/padded summation roundoff (see assert_same_step):
    # measured 1.09e-5 of the largest entry on an AMD EPYC machine (the test failed there at 1e-5), 1e-4 allowed.
    assert_same_step(run(samples, pack_prefixes=False, **changes), run(samples, **changes),
                     initial_params() if first_step else None, grad_rtol=1e-5 if first_step else 1e-4)


@pytest.mark.parametrize("micro", [1, 2, 16])
def test_packed_micro_batches_take_the_padded_step(samples, micro):
    sizes = {a: LossSettings(micro_batch_size=micro, clip_high=s.clip_high) for a, s in AGENTS.items()}
    padded = run(samples, pack_prefixes=False, agent_settings=sizes)
    packed = run(samples, agent_settings=sizes)
    assert_same_step(padded, packed, initial_params())


def test_packed_multi_turn_chain_costs_its_last_turn():
    """Turn k's prompt holds turns 1..k-1: packed, the chain costs its longest sequence's tokens (plus the last
    response), not the sum over turns."""
    model = build_model()
    chain = with_old_logprobs([s for s in draft_samples() if s.episode_id == "chain"], model)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in chain]
    big = {"solver": LossSettings(micro_batch_size=8)}
    padded = run(chain, agent_settings=big, pack_prefixes=False)
    packed = run(chain, agent_settings=big)
    assert_same_step(padded, packed, initial_params())
    assert padded[0].forward_tokens == len(chain) * max(lengths)  # 4 padded rows
    # the trie: turn k's nodes are a prefix of turn k+1's except its own response's last... all shared
    assert packed[0].forward_tokens == len(build_tree(sequences_of(chain)).tokens_N) == max(lengths)


@needs_deepspeed
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_packed_update_on_deepspeed(samples, stage):
    ds = {"backend": "deepspeed", "zero_stage": stage}
    padded = run(samples, pack_prefixes=False, **ds)
    packed = run(samples, **ds)
    assert_same_step(padded, packed, initial_params(), grads=False)  # ZeRO moves gradients into its own buffers
    assert packed[0].packed


def test_packed_lora_update_takes_the_padded_step(samples):
    pytest.importorskip("peft")
    from drmas_graph.config import AgentConfig, LoraConfig
    from drmas_graph.train.optim.lora import attach_adapters, build_updater

    def lora_run(pack: bool):
        model = attach_adapters(build_model(), LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]),
                                ["solver", "verifier"])
        with torch.no_grad():  # adapters that differ from the base (B = 0 would give zero A gradients)
            gen = torch.Generator().manual_seed(1)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        start = initial_params(model)
        updater = build_updater(model, name="m", settings=UpdateSettings(lr=LR, backend="torch", pack_prefixes=pack),
                                agent_settings=AGENTS, agent_cfgs={a: AgentConfig(model="m", adapter=a) for a in AGENTS})
        metrics = updater.update(samples)
        return metrics.adapters, {k: v.detach().clone() for k, v in model.named_parameters()}, start

    (padded, p_padded, start), (packed, p_packed, _) = lora_run(False), lora_run(True)
    for adapter in ("solver", "verifier"):
        assert packed[adapter].packed
        assert packed[adapter].loss == pytest.approx(padded[adapter].loss, rel=1e-5)
        assert packed[adapter].grad_norm == pytest.approx(padded[adapter].grad_norm, rel=1e-5)
    solver = {k: v for k, v in start.items() if ".solver." in k}  # the solver's adapter (the rest is frozen)
    assert_same_step((padded["solver"], {}, p_padded), (packed["solver"], {}, p_packed), solver, grads=False)
    assert all(torch.equal(p_packed[k], v) for k, v in start.items() if "lora_" not in k)  # the base never moves


# --- models that cannot take the mask --------------------------------------------------------------------


class WithoutPositions(torch.nn.Module):
    """A causal LM that drops position ids (as a model computing its own positions would)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config

    def forward(self, **kwargs):
        kwargs.pop("position_ids", None)
        return self.inner(**kwargs)

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()


def test_a_model_that_cannot_take_the_tree_falls_back_to_padded_rows(samples, caplog):
    model = build_model()
    config = model.config
    impl = config._attn_implementation
    config._attn_implementation = "flash_attention_2"
    found = check_packing(model)
    assert found.mask_kind is None and found.kernel == "flash_attention_2"
    assert found.reason == ("its attention implementation is 'flash_attention_2'; a tree mask needs one of ['eager', "
                            "'sdpa'] (update.attn_implementation)")
    config._attn_implementation = impl
    found = check_packing(WithoutPositions(build_model()))
    assert found.mask_kind is None and "ignores the 4D attention mask or the position ids" in found.reason
    with caplog.at_level(logging.WARNING, logger="drmas_graph.train.optim._packing"):
        fallback = run(samples, model=WithoutPositions(build_model()))
    warned = [r.getMessage() for r in caplog.records if "prefix-shared packing is off" in r.getMessage()]
    assert len(warned) == 1 and "model 'm'" in warned[0] and "position ids" in warned[0]
    assert not fallback[0].packed and fallback[0].to_dict()["model/m/packed"] == 0.0
    grads = {f"inner.{k}": v for k, v in run(samples, pack_prefixes=False)[1].items()}
    padded = run(samples, pack_prefixes=False)
    assert_same_step((padded[0], grads, {}), fallback)


def own_logprobs(model: torch.nn.Module, samples: list[Sample]) -> list[torch.Tensor]:
    """Each sample alone through the model (no packing, no padding), log_softmax(logits / T): the numbers packing
    must reproduce."""
    out = []
    with torch.no_grad():
        for s in samples:
            logits = model(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0].float() / s.temperature
            P = len(s.prompt_ids)
            out.append(torch.log_softmax(logits[P - 1:-1], -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0])
    return out


def gpt_neo(window: int, *, named: bool = True) -> torch.nn.Module:
    """A tiny GPT-Neo with a global and a local layer: the local one attends to the previous `window` row
    positions, a window it builds into its own mask buffer. named=False: the config no longer says so."""
    from transformers import AutoModelForCausalLM, GPTNeoConfig

    config = GPTNeoConfig(vocab_size=300, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                          attention_types=[[["global", "local"], 1]], window_size=window, max_position_embeddings=1024,
                          bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if not named:
        model.config.attention_types, model.config.attention_layers = [[["global", "global"], 1]], ["global"] * 2
        model.config.window_size = 0  # (an int field)
    return model


def prompt_and_two_responses(long: int, short: int = 8) -> list[Sample]:
    """One prompt, a long response and a short one that sorts after it: packed, the short sample's tokens sit
    `long` row positions to the right of their prompt."""
    g = torch.Generator().manual_seed(0)
    prompt = tuple(torch.randint(3, 100, (8,), generator=g).tolist())
    responses = [(100,) + tuple(torch.randint(3, 300, (long - 1,), generator=g).tolist()),
                 (200,) + tuple(torch.randint(3, 300, (short - 1,), generator=g).tolist())]
    return [Sample(prompt, r, (0.0,) * len(r), advantage=1.0, agent="a") for r in responses]


def test_local_attention_layers_named_in_the_config_train_on_padded_rows(caplog):
    """GPT-Neo's local layers (attention_layers / window_size, not layer_types / sliding_window) are refused by
    name: packed, the short sample would lose its prompt behind the long one (window 256 < 300 row positions)."""
    model = gpt_neo(256)
    found = check_packing(model)
    assert found.mask_kind is None and found.max_nodes == 0
    assert found.reason == ("it has local (windowed) attention layers (attention_types has ['local'], window_size=256, "
                            "attention_layers has ['local']), whose window a packed row would move or replace")
    samples = prompt_and_two_responses(300)
    with caplog.at_level(logging.WARNING, logger="drmas_graph.train.optim._packing"):
        updater = ModelUpdater(model, name="neo", settings=UpdateSettings(backend="torch"))
    assert updater._mask_kind is None
    assert [r.getMessage() for r in caplog.records if "packing is off" in r.getMessage()] == [
        f"model 'neo': prefix-shared packing is off because {found.reason}; training on padded rows "
        "(update.pack_prefixes: false silences this)"]
    for got, want in zip(updater.compute_logprobs(samples), own_logprobs(model, samples)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_window_the_config_does_not_name_is_found_by_the_probe():
    """The probe's row is PROBE_NODES_DEFAULT (on CPU) long, at most the model's positions (1024 here), its short
    branch at the far end from the shared prefix: a window of row positions shorter than that (16 here) hides the
    prefix, whatever the config says."""
    model = gpt_neo(16, named=False)
    found = check_packing(model)
    assert found.mask_kind is None and found.kernel == model.config._attn_implementation
    assert found.reason.startswith("its logits on a packed probe of 1024 nodes differ from the "
                                   "unpacked ones by ")
    assert "an attention window of row positions" in found.reason


def test_packed_rows_hold_at_most_the_nodes_the_probe_proved():
    """A window the probe did not find is longer than its row (at most PROBE_NODES_DEFAULT - 6 = 2042 nodes proven
    on CPU): rows of several samples stay within it, a longer sample is computed alone on a plain row. The start-up
    probe is the shortest (PROBE_NODES_MIN); samples that need longer rows probe again, up to the device's length."""
    model = build_model()
    updater = ModelUpdater(model, name="m", settings=UpdateSettings(backend="torch"),
                           agent_settings={"a": LossSettings(micro_batch_size=16)})
    assert (updater._packing.max_nodes, updater._packing.most_nodes) == (PROBE_NODES_MIN - 6, 2042) == (250, 2042)
    rng = random.Random(0)
    prompt = tuple(rng.randrange(3, 500) for _ in range(1000))
    samples = [Sample(prompt, tuple(rng.randrange(3, 500) for _ in range(500)), (0.0,) * 500, advantage=1.0,
                      agent="a") for _ in range(3)]
    long_prompt = tuple(rng.randrange(3, 500) for _ in range(2100))
    samples.append(Sample(long_prompt, (7, 8, 9), (0.0,) * 3, advantage=1.0, agent="a"))
    assert updater._packing_of(model, samples).max_nodes == PROBE_NODES_DEFAULT - 6 == 2042 == updater._packing.max_nodes
    groups = updater._micro_batches(list(range(4)), samples, packing=updater._packing)
    # without the cap: 16 x 2103 tokens allow sqrt(16 x 2103 x 2103) = 8412 nodes, one row of 1000 + 3 x 500 + 2103
    assert sorted(map(sorted, groups)) == [[0, 1], [2], [3]]  # 1000 + 500 + 500 = 2000 <= 2042; + 500 > 2042
    assert updater._collate([samples[3]], updater._packing).inputs["attention_mask"].shape == (1, 2103)  # plain row
    for got, want in zip(updater.compute_logprobs(samples), own_logprobs(model, samples)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_probe_grows_with_the_rows_and_finds_a_window_longer_than_its_first_row(caplog):
    """One process probes only as long a row as the samples' packed rows can need (`row_nodes`: at most
    max_nodes(L, budget) and the trie of the agent's samples), from 256 nodes, doubling: a window of 300 row
    positions (not named in the config) hides nothing in the first probe (249 positions), and is found by the probe
    of 512 that rows of ~400 nodes need; from then on the model trains on padded rows, with exact logprobs."""
    model = gpt_neo(300, named=False)
    with caplog.at_level(logging.WARNING, logger="drmas_graph.train.optim._packing"):
        updater = ModelUpdater(model, name="neo", settings=UpdateSettings(backend="torch"),
                               agent_settings={"a": LossSettings(micro_batch_size=8)})
        assert (updater._mask_kind, updater._packing.max_nodes, updater._packing.most_nodes) == ("additive", 250, 1018)
        short = prompt_and_two_responses(100)  # a trie of 8 + 100 + 8 = 116 nodes: the first probe suffices
        assert row_nodes(short, updater._budget) == 116 and updater._packing_of(model, short).max_nodes == 250
        assert not caplog.records
        samples = prompt_and_two_responses(400)  # 8 + 400 + 8 = 416 nodes: a probe of 512
        assert row_nodes(samples, updater._budget) == 416
        found = updater._packing_of(model, samples)
    assert found.mask_kind is None and found.reason.startswith("its logits on a packed probe of 512 nodes differ")
    assert [r.getMessage() for r in caplog.records if "packing is off" in r.getMessage()] == [
        f"model 'neo': prefix-shared packing is off because {found.reason}; training on padded rows "
        "(update.pack_prefixes: false silences this)"]
    for got, want in zip(updater.compute_logprobs(samples), own_logprobs(model, samples)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # several processes: the longest probe at once (a ZeRO-3 forward is collective; it must not follow one rank's data)
    assert PackingProbes("neo", grow=False).of(gpt_neo(300, named=False), 0).max_nodes == 0
    assert PackingProbes("m", grow=False).of(build_model(), 0).max_nodes == 2042


def test_lora_packing_is_probed_with_the_kernel_it_trains_with(samples):
    """update.attn_implementation is applied before the probe: a LoRA model loaded with sdpa and trained with eager
    gets eager's additive mask (a boolean one would be added to its scores), and one trained with a kernel that takes
    no tree mask trains on padded rows."""
    pytest.importorskip("peft")
    from drmas_graph.config import LoraConfig
    from drmas_graph.train.optim.lora import LoraUpdater, attach_adapters

    def lora(attn: str):
        model = attach_adapters(build_model(), LoraConfig(), ["solver", "verifier"])  # loaded with sdpa
        assert model.config._attn_implementation == "sdpa"
        return model, LoraUpdater(model, name="m", settings=UpdateSettings(backend="torch", attn_implementation=attn),
                                  agent_settings=AGENTS, agent_adapters={a: a for a in AGENTS})

    model, updater = lora("eager")
    assert {a: u._mask_kind for a, u in updater.updaters.items()} == {"solver": "additive", "verifier": "additive"}
    solver = [s for s in samples if s.agent == "solver"]
    model.set_adapter("solver")
    for got, want in zip(updater.compute_logprobs(solver), own_logprobs(model, solver)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is not None:
        _, updater = lora("flex_attention")
        assert {u._mask_kind for u in updater.updaters.values()} == {None}


def test_a_probe_belongs_to_the_module_it_is_used_on(samples):
    """compute_logprobs(module=...) packs another module (a policy's, a copy) with the mask format of that module's
    own kernel, not the trained model's."""
    import copy

    model = build_model()
    updater = ModelUpdater(model, name="m", settings=UpdateSettings(backend="torch", attn_implementation="sdpa"))
    other = copy.deepcopy(model)
    other.set_attn_implementation("eager")
    for got, want in zip(updater.compute_logprobs(samples, module=other), own_logprobs(other, samples)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert updater._probes.of(other).mask_kind == "additive" and updater._mask_kind == "bool"


# --- on-policy: the old logprobs are the update's own --------------------------------------------------------


@pytest.mark.parametrize("changes", [{}, {"kl_coef": 0.5, "entropy_coef": 0.1}, {"pack_prefixes": False}])
def test_current_old_logprobs_take_the_step_of_recomputed_ones(samples, changes):
    """update(old_logprobs="current") = the update with the trainer's recomputed old logprobs, without the
    pass: the ratio is exactly 1 (approx KL 0, no clipping) and its gradient the policy gradient."""
    model = build_model()
    recomputed, gaps = with_trainer_logprobs(samples, ModelUpdater(model, name="p", settings=UpdateSettings(
        backend="torch", **changes)).compute_logprobs(samples))
    given = run(recomputed, **changes)
    current = run(samples, old_logprobs="current", **changes)
    assert_same_step(given, current, initial_params())
    for agent, m in current[0].agents.items():
        assert m.approx_kl == 0.0 and m.clip_frac == 0.0 and m.dual_clip_frac == 0.0 and m.ratio_max == 1.0
        # the samples' recorded old logprobs (here: noisy) against the trainer's: the trainer's rollout gap
        assert m.rollout_logprob_gap == m.logprob_mismatch == pytest.approx(gaps[f"agent/{agent}/rollout_logprob_gap"],
                                                                            rel=1e-5)
        assert given[0].agents[agent].rollout_logprob_gap is None
        if "kl_coef" in changes:
            assert m.kl_ref == pytest.approx(given[0].agents[agent].kl_ref, rel=1e-5)
            assert m.entropy == pytest.approx(given[0].agents[agent].entropy, rel=1e-5)


def test_current_old_logprobs_need_one_optimizer_step(samples):
    with pytest.raises(ConfigError, match=r"old_logprobs='current' needs n_minibatches 1"):
        run(samples, old_logprobs="current", n_minibatches=2)
    with pytest.raises(ConfigError, match=r"valid values are given, current"):
        run(samples, old_logprobs="trainer")


# --- CUDA: the same code path (runs where a GPU is available) ----------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_update_on_cuda_takes_the_padded_step(samples, attn):
    """The mask is built on the model's device; SDPA and eager take it on CUDA as on CPU (float32 here)."""
    def cuda_run(pack: bool):
        return run(samples, model=build_model().cuda(), pack_prefixes=pack, attn_implementation=attn)

    padded, packed = cuda_run(False), cuda_run(True)
    assert packed[0].packed
    cpu = lambda r: (r[0], {k: v.cpu() for k, v in r[1].items()}, {k: v.cpu() for k, v in r[2].items()})  # noqa: E731
    assert_same_step(cpu(padded), cpu(packed), initial_params())
