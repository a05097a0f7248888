"""drmas-graph train / eval / config-doc from a YAML config (tiny models, one step)."""

import json
import re

import yaml

from drmas_graph.cli import main


def write_config(tmp_path, **extra):
    cfg = {
        "name": "cli", "run_dir": str(tmp_path / "run"), "graph": "tests._graphs:solver_verifier",
        "graph_kwargs": {}, "env": "tests._envs:ParityEnv", "env_kwargs": {"n_train": 4, "n_test": 2},
        "models": {"tiny": {"tiny": {"seed": 0}}},
        "agents": {"solver": {"model": "tiny", "sampling": {"max_new_tokens": 4}},
                   "verifier": {"model": "tiny", "sampling": {"max_new_tokens": 4}}},
        "update": {"lr": 1e-3, "backend": "torch"}, "steps": 1, "tasks_per_step": 2, "group_size": 2,
        "eval": {"k": 2, "n_tasks": 2}, "logging": {"progress": False, "tensorboard": False}, **extra,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_train_then_eval_a_checkpoint(tmp_path, capsys):
    cfg = write_config(tmp_path)
    assert main(["train", str(cfg), "--set", "steps=2", "--set", "eval.k=1"]) == 0
    out = capsys.readouterr().out
    assert "evaluation on test" in out and "avg@1" in out and str(tmp_path / "run") in out
    assert f"look at it: drmas-graph ui {tmp_path / 'run'}   (episodes: drmas-graph traces list " in out
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "reward/team_mean" in x] == [0, 1]
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    assert (ckpt / "tiny" / "model" / "model.safetensors").exists()
    assert main(["eval", str(cfg), "--checkpoint", str(ckpt), "--k", "2"]) == 0
    out = capsys.readouterr().out
    assert "avg@2" in out and "pass@2" in out and "solver/calls_per_episode" in out
    shown = re.findall(r"^evaluation on test: (\d+)/(\d+) episodes  elapsed \d+\.\d s", out, flags=re.M)
    assert shown == [("1", "4"), ("2", "4"), ("3", "4"), ("4", "4")]  # 2 tasks x k 2, a line at each tenth


def test_bad_config_and_missing_checkpoint_are_one_line_errors(tmp_path, capsys):
    cfg = write_config(tmp_path, estimator="nope")
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "estimator" in err and "Traceback" not in err
    assert main(["eval", str(write_config(tmp_path)), "--checkpoint", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_config_doc_lists_every_field(capsys):
    assert main(["config-doc"]) == 0
    out = capsys.readouterr().out
    for field in ("estimator", "group_size", "agents.<name>.loss.clip_high", "models.<name>.serve.engine"):
        assert field in out


def test_eval_twice_in_one_run_folder_gets_a_folder_each(tmp_path, capsys):
    from drmas_graph.traces.store import TraceStore

    cfg = write_config(tmp_path)
    assert main(["eval", str(cfg), "--k", "1", "--n-tasks", "1"]) == 0
    assert main(["eval", str(cfg), "--k", "2", "--n-tasks", "1"]) == 0  # rev_c: refused before (store config)
    assert main(["eval", str(cfg), "--k", "2", "--n-tasks", "1"]) == 0
    out = capsys.readouterr().out
    folders = sorted(p.name for p in (tmp_path / "run" / "eval").iterdir())
    assert folders == ["base-test-k1", "base-test-k2", "base-test-k2-2"]
    for name, k in (("base-test-k1", 1), ("base-test-k2", 2), ("base-test-k2-2", 2)):
        assert str(tmp_path / "run" / "eval" / name) in out
        with TraceStore(tmp_path / "run" / "eval" / name / "traces.db", readonly=True) as store:
            assert len(store.episodes()) == k
            assert store.config["eval"]["k"] == k
        assert yaml.safe_load((tmp_path / "run" / "eval" / name / "config.yaml").read_text())["eval"]["k"] == k


def test_eval_of_a_checkpoint_on_attached_servers_pushes_its_weights_first(tmp_path, capsys):
    """rev3_b: servers attached by `serve.urls` hold whatever they held; `eval --checkpoint` loads the
    checkpoint's weights into them before evaluating, and says so."""
    import torch
    from safetensors.torch import load_file

    from drmas_graph.testing import tiny_model, tiny_tokenizer
    from tests.sglang_double import SGLangDouble

    tok = tiny_tokenizer()
    base = tmp_path / "base"
    tiny_model(tok, seed=0).save_pretrained(base)
    tok.save_pretrained(base)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000005"
    trained = tiny_model(tok, seed=0)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.05)  # stands in for training
    trained.save_pretrained(ckpt / "m" / "model")
    tok.save_pretrained(ckpt / "m" / "model")
    server = SGLangDouble(str(base), weight_version="0").start()
    try:
        served = {"path": str(base), "serve": {"engine": "sglang", "urls": [server.url]}}
        cfg = write_config(tmp_path, models={"m": served},
                           agents={"solver": {"model": "m", "sampling": {"max_new_tokens": 3}},
                                   "verifier": {"model": "m", "sampling": {"max_new_tokens": 3}}})
        assert main(["eval", str(cfg), "--checkpoint", str(ckpt), "--k", "1"]) == 0
        updates, served_path = server.updates, server.model_path
    finally:
        server.stop()
    out = capsys.readouterr().out
    assert updates == 1 and "model m: loaded" in out and server.url in out
    pushed, want = load_file(f"{served_path}/model.safetensors"), load_file(ckpt / "m" / "model" / "model.safetensors")
    assert set(pushed) == set(want) and all(torch.equal(pushed[k], want[k]) for k in want)
