"""Tasks from files (`drmas_graph.task_files`): every format, the input template, every error, the `env` mapping
of the config, and `drmas-graph train cfg.yaml` with a python reward and with a scripted judge."""

import csv
import json
import sys

import pytest
import yaml

from drmas_graph.config import TaskFilesConfig, TrainConfig, _validate, config_reference, load_config
from drmas_graph.env import Task
from drmas_graph.errors import ConfigError
from drmas_graph.task_files import (TaskFileEnv, fill_template, load_rows, load_tasks, tasks_from_config,
                                    template_keys)

ROWS = [
    {"id": "a1", "question": "What is 2 + 3?", "answer": "5"},
    {"id": "a2", "question": "What is 4 + 4?", "answer": "8"},
]
INPUT = {"messages": [{"role": "user", "content": "Q: {question}"}]}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_csv(path, rows):
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


WRITERS = {
    "jsonl": write_jsonl,
    "json": lambda path, rows: path.write_text(json.dumps(rows)) and path,
    "csv": write_csv,
    "parquet": write_parquet,
}


# ---- formats -------------------------------------------------------------------------------------


@pytest.mark.parametrize("ext", list(WRITERS))
def test_every_file_format_gives_the_same_tasks(tmp_path, ext):
    path = WRITERS[ext](tmp_path / f"tasks.{ext}", ROWS)
    assert load_rows(path) == ROWS
    tasks = load_tasks(path, INPUT, answer="answer", id="id")
    assert tasks == [
        Task(id="a1", input={"messages": [{"role": "user", "content": "Q: What is 2 + 3?"}]}, answer="5", meta=ROWS[0]),
        Task(id="a2", input={"messages": [{"role": "user", "content": "Q: What is 4 + 4?"}]}, answer="8", meta=ROWS[1]),
    ]


def test_jsonl_skips_blank_lines_and_keeps_value_types(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"q": "x", "n": 3, "tags": ["a"]}\n\n{"q": "y", "n": 4, "tags": []}\n')
    assert load_rows(path) == [{"q": "x", "n": 3, "tags": ["a"]}, {"q": "y", "n": 4, "tags": []}]
    tasks = load_tasks(path, {"question": "{q} ({n:02d})"}, answer="n")
    assert [t.input for t in tasks] == [{"question": "x (03)"}, {"question": "y (04)"}]
    assert [t.answer for t in tasks] == [3, 4]  # the answer column's value as the file holds it


def test_a_saved_hugging_face_dataset_and_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "flat"))
    assert load_rows(tmp_path / "flat") == ROWS
    test_rows = [{"id": "b1", "question": "What is 1 + 1?", "answer": "2"}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(test_rows)}).save_to_disk(str(tmp_path / "dict"))
    assert load_rows(tmp_path / "dict", split="test") == test_rows
    cfg = _validate({"env": {"tasks": str(tmp_path / "dict"), "input": {"question": "{question}"}, "id": "id",
                             "answer": "answer", "reward": {"python": "tests.test_task_files:exact_match"}}}, "t")
    assert [t.id for t in tasks_from_config(cfg)] == ["a1", "a2", "b1"]  # no `test`: the DatasetDict's test split
    with pytest.raises(ConfigError) as err:
        load_rows(tmp_path / "dict", split="validation")
    assert str(err.value) == (f"task file {str(tmp_path / 'dict')!r}: the dataset has splits ['test', 'train'], not "
                              "'validation'; save the split as its own dataset and name its folder")


def test_a_dataset_folder_without_the_datasets_package_names_the_install(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(ConfigError) as err:
        load_rows(tmp_path / "ds")
    assert str(err.value) == (f"task file {str(tmp_path / 'ds')!r} is a folder, read as a Hugging Face `datasets` "
                              "dataset (save_to_disk), which needs the datasets package: pip install datasets")


# ---- ids and templates ---------------------------------------------------------------------------


def test_without_an_id_column_the_id_is_a_stable_hash_of_the_row(tmp_path):
    tasks = load_tasks(write_jsonl(tmp_path / "t.jsonl", [{"q": "x"}, {"q": "y"}]), {"question": "{q}"})
    # sha1('{"q": "x"}')[:12] and sha1('{"q": "y"}')[:12]: the same on every machine and run
    assert [t.id for t in tasks] == ["row-7daa0ba6f598", "row-178a0221b1eb"]
    assert [t.answer for t in tasks] == [None, None] and tasks[0].meta == {"q": "x"}


def test_fill_template_fills_every_string_of_the_nested_structure():
    row = {"question": "Why?", "n": 7, "who": "Ana"}
    template = {"messages": [{"role": "user", "content": "{who} asks: {question}"}, ("{n}", 3, None)],
                "{literal key}": "{{not a field}} {n:>3}", "flag": True}
    assert fill_template(template, row) == {"messages": [{"role": "user", "content": "Ana asks: Why?"}, ("7", 3, None)],
                                            "{literal key}": "{not a field}   7", "flag": True}
    assert fill_template("{question}", row) == "Why?"
    assert template_keys(template) == ["who", "question", "n"]
    assert template_keys({"a": "{x[0]} {y.real} {{z}}"}) == ["x", "y"]


# ---- errors ------------------------------------------------------------------------------------


def test_missing_file_unknown_extension_and_empty_files(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_rows(tmp_path / "nope.jsonl")
    assert str(err.value) == f"task file {str(tmp_path / 'nope.jsonl')!r} does not exist"
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(ConfigError) as err:
        load_rows(tmp_path / "t.txt")
    assert str(err.value) == (f"task file {str(tmp_path / 't.txt')!r}: unknown extension '.txt'; use one of .jsonl, "
                              ".json, .csv, .parquet or a Hugging Face `datasets` folder (save_to_disk)")
    empties = {"e.jsonl": "\n\n", "e.json": "[]", "e.csv": "question,answer\n", "f.json": ""}
    for name, text in empties.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as err:
            load_rows(tmp_path / name)
        assert str(err.value) == f"task file {str(tmp_path / name)!r} has no rows; add one task per row"


def test_unreadable_rows_name_the_line_or_row(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"q": 1}\n{"q": 2,}\n')
    with pytest.raises(ConfigError) as err:
        load_rows(tmp_path / "bad.jsonl")
    assert str(err.value) == (f"task file {str(tmp_path / 'bad.jsonl')!r}, line 2: not valid JSON (Expecting "
                              "property name enclosed in double quotes)")
    (tmp_path / "list.jsonl").write_text('{"q": 1}\n[1, 2]\n')
    with pytest.raises(ConfigError) as err:
        load_rows(tmp_path / "list.jsonl")
    assert str(err.value) == (f"task file {str(tmp_path / 'list.jsonl')!r}, line 2: a row must be a JSON object of "
                              "columns, got list")
    (tmp_path / "obj.json").write_text('{"q": 1}')
    with pytest.raises(ConfigError) as err:
        load_rows(tmp_path / "obj.json")
    assert str(err.value) == (f"task file {str(tmp_path / 'obj.json')!r}: must hold a JSON list of objects (one per "
                              "task), got dict; for one object per line use .jsonl")
    (tmp_path / "wide.csv").write_text("q,a\nx,1\ny,2,3\n")
    with pytest.raises(ConfigError) as err:
        load_rows(tmp_path / "wide.csv")
    assert str(err.value) == (f"task file {str(tmp_path / 'wide.csv')!r}, row 2: more values than the header has "
                              "columns ('q', 'a'); quote values that hold commas")


def test_a_template_key_no_row_has_names_the_key_the_file_and_the_columns(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(ConfigError) as err:
        load_tasks(path, {"messages": [{"role": "user", "content": "{prompt}"}]})
    assert str(err.value) == (f"env.input uses '{{prompt}}', but no row of {str(path)!r} has a column 'prompt' (row 1 "
                              "has columns: 'id', 'question', 'answer'); fix the template or the file")


def test_a_row_without_a_template_key_is_named_by_its_number(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [ROWS[0], {"id": "a2", "answer": "8"}])
    with pytest.raises(ConfigError) as err:
        load_tasks(path, INPUT)
    assert str(err.value) == (f"row 2 of {str(path)!r} has no column 'question' that env.input uses (its columns: "
                              "'id', 'answer'); add it or fix the template")


def test_bad_templates(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(ConfigError) as err:
        load_tasks(path, "{question")
    assert str(err.value) == ("input template '{question': expected '}' before end of string (write '{{' and '}}' "
                              "for literal braces)")
    with pytest.raises(ConfigError) as err:
        load_tasks(path, "{} and {0}")
    assert str(err.value) == "input template '{} and {0}': '{}' is positional; name a column, e.g. '{question}'"
    with pytest.raises(ConfigError) as err:
        load_tasks(path, "{question:d}")
    assert str(err.value) == (f"row 1 of {str(path)!r}: env.input cannot be filled from it (ValueError: Unknown format "
                              "code 'd' for object of type 'str'); its columns: 'id', 'question', 'answer'")


def test_answer_and_id_columns_must_exist(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(ConfigError) as err:
        load_tasks(path, INPUT, answer="gold")
    assert str(err.value) == (f"env.answer = 'gold', but no row of {str(path)!r} has that column (row 1 has columns: "
                              "'id', 'question', 'answer'); name one of them or remove env.answer")
    with pytest.raises(ConfigError) as err:
        load_tasks(path, INPUT, id="key")
    assert str(err.value) == (f"env.id = 'key', but no row of {str(path)!r} has that column (row 1 has columns: "
                              "'id', 'question', 'answer'); name one of them or remove env.id")
    partial = write_jsonl(tmp_path / "p.jsonl", [ROWS[0], {"question": "x", "answer": "1"}])
    with pytest.raises(ConfigError) as err:
        load_tasks(partial, INPUT, id="id")
    assert str(err.value) == f"row 2 of {str(partial)!r} has no id column 'id' (its columns: 'question', 'answer')"


def test_duplicate_ids_name_both_rows(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [ROWS[0], ROWS[1], {**ROWS[0], "question": "again"}])
    with pytest.raises(ConfigError) as err:
        load_tasks(path, INPUT, id="id")
    assert str(err.value) == f"rows 1 and 3 of {str(path)!r} have the same 'id' 'a1'; task ids must be unique"
    same = write_jsonl(tmp_path / "s.jsonl", [ROWS[0], ROWS[1], ROWS[1]])
    with pytest.raises(ConfigError) as err:
        load_tasks(same, INPUT)
    assert str(err.value) == (f"rows 2 and 3 of {str(same)!r} have the same content (its id is a hash of the row): "
                              "remove the duplicate or add an id column; task ids must be unique")


# ---- the config's `env` mapping and the environment ---------------------------------------------------


def _env(**extra):
    return {"tasks": "t.jsonl", "input": INPUT, "reward": {"python": "tests.test_task_files:exact_match"}, **extra}


def test_the_env_mapping_validates_and_round_trips_through_yaml(tmp_path):
    cfg = _validate({"env": _env(answer="answer", reward={"judge": {"model": {"path": "smollm2"}, "rubric": "R"}})}, "c")
    assert isinstance(cfg.env, TaskFilesConfig) and cfg.env.reward.judge.mode == "group"
    assert cfg.env.reward.judge.cache == "judge_cache.db" and cfg.env.reward.judge.temperature == 0.0
    again = TrainConfig.model_validate(yaml.safe_load(cfg.to_yaml()))
    assert again.env == cfg.env
    assert _validate({"env": "tests._envs:ParityEnv"}, "c").env == "tests._envs:ParityEnv"  # 'module:attr' still works
    fields = {f for f, _, _ in config_reference()}
    assert {"env", "env.tasks", "env.input", "env.reward.python", "env.reward.judge.mode",
            "env.reward.judge.rubric_file", "env.reward.judge.cache"} <= fields


@pytest.mark.parametrize("env, message", [
    (_env(reward={}), "env.reward: Value error, give exactly one of `judge` (a judge model scores the episodes) or "
                      "`python` ('module:attr' of a reward function)"),
    (_env(reward={"python": "m:f", "judge": {"model": "a:b", "rubric": "R"}}),
     "env.reward: Value error, give exactly one of `judge` (a judge model scores the episodes) or `python` "
     "('module:attr' of a reward function)"),
    (_env(reward={"judge": {"model": "a:b"}}),
     "env.reward.judge: Value error, give exactly one of `rubric` (the text) or `rubric_file` (a file holding it)"),
    (_env(reward={"judge": {"model": "a:b", "rubric": "R", "mode": "team"}}),
     "env.reward.judge.mode: Input should be 'episode', 'group' or 'agent'"),
    (_env(templates="x"), "env.templates: Extra inputs are not permitted"),
    ({"input": INPUT, "reward": {"python": "m:f"}}, "env.tasks: Field required"),
    (3, "env: env must be 'module:attr' of an environment, or a mapping of task files (tasks, input, reward)"),
])
def test_env_mapping_errors(env, message):
    with pytest.raises(ConfigError) as err:
        _validate({"env": env}, "cfg.yaml")
    assert str(err.value) == f"cfg.yaml: invalid training config\n  {message}"


def test_env_kwargs_need_a_factory():
    with pytest.raises(ConfigError) as err:
        _validate({"env": _env(), "env_kwargs": {"n": 1}}, "cfg.yaml")
    assert str(err.value) == ("cfg.yaml: invalid training config\n  <root>: Value error, env_kwargs ['n'] are keyword "
                              "arguments of an environment factory, but `env` is a mapping of task files; remove "
                              "env_kwargs")


def exact_match(task, episode):
    """A python reward for the tests: 1.0 when the verifier's reply contains the reference answer, else 0.25."""
    return 1.0 if str(task.answer) in str(episode.final_state.get("verdict", "")) else 0.25


def test_task_file_env_splits_and_python_reward(tmp_path, monkeypatch):
    from drmas_graph.task_files import env_from_config

    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "t.jsonl", ROWS)
    write_jsonl(tmp_path / "e.jsonl", [{"id": "b1", "question": "What is 1 + 1?", "answer": "2"}])
    cfg = _validate({"env": _env(test="e.jsonl", answer="answer", id="id")}, "c")
    env = env_from_config(cfg.env, run_dir=tmp_path / "run")
    assert [t.id for t in env.tasks("train")] == ["a1", "a2"] and [t.id for t in env.tasks("test")] == ["b1"]
    with pytest.raises(ConfigError) as err:
        env.tasks("validation")
    assert str(err.value) == ("tasks from files have the splits 'train' (env.tasks) and 'test' (env.test), not "
                              "'validation'; set eval.split to one of them")

    class Ep:
        final_state = {"verdict": "it is 5"}

    assert env.reward(env.tasks("train")[0], Ep()) == 1.0 and env.reward(env.tasks("train")[1], Ep()) == 0.25
    assert [t.id for t in tasks_from_config(cfg)] == ["a1", "a2", "b1"]
    no_test = env_from_config(_validate({"env": _env(id="id")}, "c").env, run_dir=tmp_path / "run")
    assert no_test.tasks("test") == no_test.tasks("train")  # default: the training tasks
    with pytest.raises(ConfigError) as err:
        env_from_config(_validate({"env": _env(reward={"python": "tests.test_task_files:nope"})}, "c").env,
                        run_dir=tmp_path)
    assert str(err.value) == "env.reward.python 'tests.test_task_files:nope': 'tests.test_task_files' has no attribute 'nope'"
    with pytest.raises(ConfigError) as err:
        TaskFileEnv(env.tasks("train")).reward(env.tasks("train")[0], Ep())
    assert str(err.value) == ("this TaskFileEnv has no reward function: pass reward=... or wrap it in "
                              "drmas_graph.rewards.JudgedEnv(env, judge)")


# ---- drmas-graph train cfg.yaml -----------------------------------------------------------------


def write_train_config(tmp_path, env):
    cfg = {
        "name": "files", "run_dir": str(tmp_path / "run"), "graph": "tests._graphs:solver_verifier", "env": env,
        "models": {"tiny": {"tiny": {"seed": 0}}},
        "agents": {"solver": {"model": "tiny", "sampling": {"max_new_tokens": 4}},
                   "verifier": {"model": "tiny", "sampling": {"max_new_tokens": 4}}},
        "update": {"lr": 1e-3, "backend": "torch"}, "steps": 1, "tasks_per_step": 2, "group_size": 2,
        "eval": {"k": 1, "n_tasks": 1, "before_training": False}, "logging": {"progress": False, "tensorboard": False},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_train_from_task_files_with_a_python_reward(tmp_path, monkeypatch):
    from drmas_graph.cli import main
    from drmas_graph.traces.store import TraceStore

    write_jsonl(tmp_path / "t.jsonl", ROWS)
    env = {"tasks": str(tmp_path / "t.jsonl"), "input": {"question": "{question}"}, "answer": "answer", "id": "id",
           "reward": {"python": "tests.test_task_files:exact_match"}}
    assert main(["train", str(write_train_config(tmp_path, env))]) == 0
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        episodes = [store.load_episode(s.id) for s in store.episodes() if s.step == 0]
    assert len(episodes) == 4 and {e.task_id for e in episodes} == {"a1", "a2"}
    answers = {r["id"]: r["answer"] for r in ROWS}
    want = [1.0 if answers[e.task_id] in e.final_state["verdict"] else 0.25 for e in episodes]
    assert [e.rewards for e in episodes] == [{"solver": r, "verifier": r} for r in want]
    assert all(e.input == {"question": next(r["question"] for r in ROWS if r["id"] == e.task_id)} for e in episodes)


def test_train_from_task_files_with_a_judge(tmp_path):
    """`drmas-graph train cfg.yaml` with `env.reward.judge` (a scripted judge): every trained episode's reward is
    the judge's score of it in its group (attempt i: 0.25 * i), its judgement is stored, and metrics.jsonl
    counts the judge's calls, the one retry and its tokens."""
    from drmas_graph.cli import main
    from drmas_graph.traces.store import TraceStore
    from tests._judge_models import UNUSABLE

    write_jsonl(tmp_path / "t.jsonl", ROWS)
    env = {"tasks": str(tmp_path / "t.jsonl"), "input": {"question": "{question}"}, "answer": "answer", "id": "id",
           "reward": {"judge": {"model": {"import": "tests._judge_models:ranking_judge"}, "mode": "group",
                                "rubric": "The verifier must agree with the reference answer."}}}
    assert main(["train", str(write_train_config(tmp_path, env))]) == 0
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        episodes = [store.load_episode(s.id) for s in store.episodes() if s.step == 0]
    assert len(episodes) == 4
    groups: dict[str, list[int]] = {}
    for e in episodes:
        j = e.judgement
        score = 0.25 * (j["index"] + 1)
        assert e.rewards == {"solver": score, "verifier": score}
        assert j["scores"] == score and j["reasons"] == f"attempt {j['index'] + 1} ranks {j['index'] + 1}"
        assert j["mode"] == "group" and j["group_size"] == 2 and j["model"] == "RankingJudge" and j["error"] is None
        assert j["prompt"][1]["content"].startswith(f"Task:\nquestion: {e.input['question']}\nReference answer: ")
        groups.setdefault(e.group_id, []).append(j["index"])
    assert sorted(sorted(v) for v in groups.values()) == [[0, 1], [0, 1]]
    retried = [e.judgement for e in episodes if e.judgement["attempts"] == 2]  # the group whose first reply failed
    assert len(retried) == 2 and all(j["replies"][0] == UNUSABLE for j in retried)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if "reward/team_mean" in r and r["step"] == 0)
    assert {k: step[k] for k in step if k.startswith("judge")} == {
        "judge/calls": 3.0, "judge/retries": 1.0, "judge/failed_calls": 1.0, "judge/cache_hits": 0.0,
        "judge/input_tokens": 300.0, "judge/output_tokens": 60.0, "judge/seconds": step["judge/seconds"],
        "judge_failed_episodes": 0}
    assert step["reward/team_mean"] == 0.375 and (tmp_path / "run" / "judge_cache.db").is_file()

    # traces rescore --judge CONFIG.yaml: the config's judge and tasks; the run's cache answers every group again
    out = tmp_path / "rescored.db"
    assert main(["traces", "rescore", str(tmp_path / "run" / "traces.db"), "--judge",
                 str(tmp_path / "cfg.yaml"), "--out", str(out)]) == 0
    with TraceStore(out, readonly=True) as store:
        again = {e.id: e for e in (store.load_episode(s.id) for s in store.episodes())}
    assert {e.id: e.rewards for e in episodes} == {i: e.rewards for i, e in again.items()}
    assert all(e.judgement["cached"] and e.judgement["scores"] == e.rewards["solver"] for e in again.values())


def test_the_helpdesk_example_config_tasks_and_graph():
    """graphs/helpdesk/train.yaml validates, its task files load (24 train, 8 test, unique ids), and the graph
    turns a filled input into the reviewer's reply."""
    from pathlib import Path

    from langchain_core.language_models.fake_chat_models import FakeListChatModel

    from graphs.helpdesk.graph import build_graph

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "graphs" / "helpdesk" / "train.yaml")
    assert cfg.env.reward.judge.model == {"path": "smollm2", "max_batch_size": 8}
    assert cfg.env.reward.judge.mode == "group" and cfg.env.reward.judge.temperature == 0.0
    assert set(cfg.agents) == {"drafter", "reviewer"}
    env_cfg = cfg.env.model_copy(update={"tasks": str(root / cfg.env.tasks), "test": str(root / cfg.env.test)})
    train = load_tasks(env_cfg.tasks, env_cfg.input, answer=env_cfg.answer, id=env_cfg.id)
    test = load_tasks(env_cfg.test, env_cfg.input, answer=env_cfg.answer, id=env_cfg.id)
    assert (len(train), len(test)) == (24, 8) and train[0].id == "t01" and test[-1].id == "e08"
    assert train[19].input == {"messages": [{"role": "user", "content": "Do gift cards expire?"}]}
    assert train[19].answer == "No, gift cards never expire."
    graph = build_graph(FakeListChatModel(responses=["Gift cards never expire, ever!", "No, they never expire."]))
    state = graph.invoke(train[19].input)
    assert state["draft"] == "Gift cards never expire, ever!" and state["reply"] == "No, they never expire."
    assert [m.type for m in state["messages"]] == ["human", "ai"]


def test_the_helpdesk_vllm_judge_config_differs_from_train_yaml_only_in_the_judge():
    """graphs/helpdesk/train_vllm_judge.yaml is train.yaml with the judge served by serve_judge.sh (its port and
    --served-model-name), room for long guided replies, and its own run folder: nothing else drifts."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "graphs" / "helpdesk"
    base = load_config(root / "train.yaml").model_dump()
    served = load_config(root / "train_vllm_judge.yaml").model_dump()
    judge, base_judge = served["env"]["reward"].pop("judge"), base["env"]["reward"].pop("judge")
    assert judge["model"] == {"base_url": "http://127.0.0.1:8008/v1", "model": "smollm2-judge", "timeout": 300}
    assert (judge["max_tokens"], judge["timeout_s"]) == (3000, 300.0)
    assert {k: v for k, v in judge.items() if k not in ("model", "max_tokens", "timeout_s")} == \
           {k: v for k, v in base_judge.items() if k not in ("model", "max_tokens", "timeout_s")}
    assert (served.pop("name"), served.pop("run_dir")) == ("helpdesk-vllm-judge", "runs/helpdesk_vllm_judge")
    base.pop("name"), base.pop("run_dir")
    assert served == base
    script = (root / "serve_judge.sh").read_text()
    assert "--served-model-name smollm2-judge" in script and 'PORT="${PORT:-8008}"' in script
    assert """'{"backend": "xgrammar", "disable_any_whitespace": true}'""" in script


def test_a_served_judge_from_a_config_times_its_requests_out_with_timeout_s():
    """An abandoned judge call (past timeout_s) holds its concurrency slot until the request ends: a served judge
    built from a config gets timeout_s as its request timeout, unless its spec names one."""
    from drmas_graph.config import JudgeConfig
    from drmas_graph.task_files import build_judge

    served = {"base_url": "http://127.0.0.1:9/v1", "model": "m"}
    judge = build_judge(JudgeConfig(model=served, rubric="A right answer scores 1.", timeout_s=7), run_dir=None)
    assert judge.model.request_timeout == 7 and judge.timeout_s == 7
    own = JudgeConfig(model={**served, "timeout": 300}, rubric="A right answer scores 1.", timeout_s=7)
    assert build_judge(own, run_dir=None).model.request_timeout == 300


def test_judge_from_config_reads_the_rubric_file_and_caches_in_the_run_folder(tmp_path, monkeypatch):
    from drmas_graph.task_files import judge_from_config

    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "t.jsonl", ROWS)
    (tmp_path / "rubric.txt").write_text("Agree with the reference answer.\n")
    judge = {"model": {"import": "tests._judge_models:ranking_judge"}, "rubric_file": "rubric.txt", "mode": "agent",
             "max_retries": 5}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "env": _env(reward={"judge": judge})}))
    built = judge_from_config(path)  # a config file, as `traces rescore --judge CONFIG.yaml` passes it
    assert (built.rubric, built.mode, built.max_retries) == ("Agree with the reference answer.\n", "agent", 5)
    assert built._cache.path == tmp_path / "run" / "judge_cache.db"
    elsewhere = judge_from_config(load_config(path), run_dir=tmp_path / "other")
    assert elsewhere._cache.path == tmp_path / "other" / "judge_cache.db"
    no_cache = judge_from_config(_validate({"env": _env(reward={"judge": {**judge, "cache": None}})}, "c"))
    assert no_cache._cache.path is None
    with pytest.raises(ConfigError) as err:
        judge_from_config(_validate({"env": _env(reward={"judge": {**judge, "rubric_file": "nope.txt"}})}, "c"))
    assert str(err.value) == "env.reward.judge.rubric_file 'nope.txt' does not exist"
    with pytest.raises(ConfigError) as err:
        judge_from_config(_validate({"env": _env()}, "c"))
    assert str(err.value) == "the config has no judge: its `env` must be a mapping with `reward: {judge: ...}`"
