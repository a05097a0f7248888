"""`drmas-graph traces ...`: what each command prints, the files it writes, its exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from drmas_graph.cli import main
from drmas_graph.traces.store import TraceStore
from drmas_graph.types import Episode, SamplingParams, Turn


def make_turn(agent: str, node: str, index: int, n_prompt: int, n_response: int, **changes) -> Turn:
    fields = dict(
        agent=agent,
        node=node,
        step=index + 1,
        index=index,
        messages=(SystemMessage("system prompt"), HumanMessage(f"[bold]last message of {agent}[/bold]")),
        prompt_ids=tuple(range(n_prompt)),
        response_ids=tuple(range(n_response)),
        response_logprobs=(-0.5,) * n_response,
        response_text=f"response of {agent}",
        policy="qwen",
        policy_version=4,
        sampling=SamplingParams(),
    )
    fields.update(changes)
    return Turn(**fields)


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, Episode, Episode]:
    """A store with a trained two-agent episode and a failed one-agent episode."""
    trained = Episode(
        task_id="task-7",
        group_id="group-7",
        turns=[
            make_turn("planner", "plan", 0, 11, 5),
            make_turn("solver", "team/solve", 1, 23, 9, finish_reason="length"),
            make_turn("solver", "team/solve", 2, 30, 2, messages=(AIMessage("the very last message"),)),
        ],
        rewards={"planner": 1.0, "solver": 1.0},
        turn_rewards=[1.0, 1.0, 0.5],
        advantages=[0.75, -0.25, 1.5],
        timings={"wall_s": 2.5},
    )
    failed = Episode(
        task_id="task-8",
        group_id="group-8",
        turns=[make_turn("solver", "team/solve", 0, 7, 3, policy=None, policy_version=None, trainable=False)],
        error="TimeoutError: tool took too long",
    )
    path = tmp_path / "run.sqlite"
    with TraceStore(path) as store:
        store.write_episode(trained, step=3)
        store.write_episode(failed)
    return path, trained, failed


def test_list_prints_one_row_per_episode_and_filters(run, capsys):
    path, trained, failed = run
    assert main(["traces", "list", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 episodes in" in out
    assert trained.id in out and failed.id in out
    assert "planner, solver" in out and "64/16" in out and "7/3" in out  # agents; prompt/response tokens
    assert "task-7" in out and "group-8" in out and "TimeoutError" in out
    assert "\x1b[" not in out  # no terminal escapes when stdout is not a terminal

    assert main(["traces", "list", str(path), "--agent", "planner"]) == 0
    out = capsys.readouterr().out
    assert "1 episodes in" in out and trained.id in out and failed.id not in out
    assert main(["traces", "list", str(path), "--failed"]) == 0
    out = capsys.readouterr().out
    assert failed.id in out and trained.id not in out
    assert main(["traces", "list", str(path), "--step", "3", "--task", "task-8"]) == 0
    assert "0 episodes in" in capsys.readouterr().out


def test_show_prints_a_block_per_turn(run, capsys):
    path, trained, _ = run
    assert main(["traces", "show", str(path), trained.id]) == 0
    out = capsys.readouterr().out
    assert f"episode {trained.id}" in out
    assert "task task-7" in out and "group group-7" in out and "training step 3" in out
    assert "rewards planner=1, solver=1" in out and "error -" in out
    assert "#0  node plan  agent planner  step 1" in out
    assert "#1  node team/solve  agent solver  step 2" in out
    assert "#2  node team/solve  agent solver  step 3" in out
    assert "tokens prompt 11 / response 5" in out and "tokens prompt 23 / response 9" in out
    assert "finish length" in out and "policy qwen@4" in out
    assert "reward 0.5   advantage 1.5" in out and "advantage -0.25" in out
    assert "human: [bold]last message of planner[/bold]" in out  # user text is not taken as markup
    assert "system: system prompt" in out  # every message of the prompt, the system prompt too
    assert "ai: the very last message" in out
    assert "response of solver" in out


def test_show_marks_failed_runs_and_untrained_calls(run, capsys):
    path, _, failed = run
    assert main(["traces", "show", str(path), failed.id]) == 0
    out = capsys.readouterr().out
    assert "error TimeoutError: tool took too long" in out and "training step -" in out
    assert "policy app model (not trainable)" in out and "reward -   advantage -" in out


def test_stats_prints_counts(run, capsys):
    path, _, _ = run
    assert main(["traces", "stats", str(path)]) == 0
    out = capsys.readouterr().out
    for line in ("episodes", "failed episodes", "turns of planner", "turns of solver", "bytes per 1k tokens"):
        assert line in out
    assert "71" in out and "19" in out  # prompt and response tokens over both episodes


def test_export_writes_jsonl_and_parquet(run, capsys, tmp_path: Path):
    path, trained, failed = run
    assert main(["traces", "export", str(path), "--format", "jsonl"]) == 0
    default_out = path.with_suffix(".jsonl")
    assert f"wrote 4 turns to {default_out}" in capsys.readouterr().out
    rows = [json.loads(line) for line in default_out.read_text().splitlines()]
    assert [(r["episode_id"], r["agent"], len(r["prompt_ids"])) for r in rows] == [
        (trained.id, "planner", 11),
        (trained.id, "solver", 23),
        (trained.id, "solver", 30),
        (failed.id, "solver", 7),
    ]
    assert [r["advantage"] for r in rows] == [0.75, -0.25, 1.5, None]

    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "solver.parquet"
    assert (
        main(["traces", "export", str(path), "--format", "parquet", "--agent", "solver", "--out", str(out)])
        == 0
    )
    assert f"wrote 3 turns to {out}" in capsys.readouterr().out
    table = pq.read_table(out).to_pylist()
    assert [r["response_ids"] for r in table] == [list(range(9)), list(range(2)), list(range(3))]
    assert [r["train_step"] for r in table] == [3, 3, None]


def _assert_one_line_error(capsys, *needles: str) -> None:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("drmas-graph: error: ") and "Traceback" not in captured.err
    for needle in needles:
        assert needle in lines[0]
    assert captured.out == ""


def test_errors_print_one_line_and_exit_2(run, capsys, tmp_path: Path):
    path, _, _ = run
    missing = tmp_path / "nope.sqlite"
    assert main(["traces", "list", str(missing)]) == 2
    _assert_one_line_error(capsys, f"no trace store at {missing}")

    assert main(["traces", "show", str(path), "deadbeef"]) == 2
    _assert_one_line_error(capsys, "no episode 'deadbeef'", str(path))

    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_text("not a database\n" * 200)
    for command in (["list", str(corrupt)], ["show", str(corrupt), "x"], ["export", str(corrupt)]):
        assert main(["traces", *command]) == 2
        _assert_one_line_error(capsys, f"{corrupt} is not a readable trace store")


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["traces", "frobnicate"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["traces", "export", "x.sqlite", "--format", "csv"])
    assert info.value.code == 2
    assert "invalid choice: 'csv'" in capsys.readouterr().err




def test_list_keeps_episode_ids_on_one_line_in_a_narrow_terminal(run):
    """A 32-character id folded over two lines cannot be copied (issue 33): the id column never wraps."""
    import io

    from rich.console import Console

    from drmas_graph.cli import build_parser
    from drmas_graph.cli._traces import _cmd_list

    path, trained, failed = run
    out = io.StringIO()
    args = build_parser().parse_args(["traces", "list", str(path)])
    assert _cmd_list(args, Console(file=out, width=90, no_color=True)) == 0
    lines = out.getvalue().splitlines()
    assert any(trained.id in line for line in lines) and any(failed.id in line for line in lines)


def test_show_prints_every_prompt_message_folded_and_in_full_with_full(run, capsys, tmp_path: Path):
    path, trained, _ = run
    long_system = "You are the planner. " + "Follow the rules. " * 30
    episode = Episode(task_id="t", turns=[make_turn("planner", "plan", 0, 11, 5, messages=(
        SystemMessage(long_system), HumanMessage("plan the trip")))])
    with TraceStore(path) as store:
        store.write_episode(episode)
    assert main(["traces", "show", str(path), episode.id]) == 0
    out = capsys.readouterr().out
    assert "system: You are the planner. Follow the rules." in out and "human: plan the trip" in out
    assert long_system.strip() not in " ".join(out.split())  # folded: one line, cut with '…'
    assert main(["traces", "show", str(path), episode.id, "--full"]) == 0
    assert long_system.strip() in " ".join(capsys.readouterr().out.replace("│", " ").split())


def test_list_takes_the_filters_and_sorts_of_the_ui(tmp_path):
    """`traces list` shares `TraceStore.query` with the UI: the UI's "in a terminal" line prints the same list."""
    import io

    from rich.console import Console

    from drmas_graph.cli import build_parser
    from drmas_graph.cli._traces import _cmd_list

    path = tmp_path / "traces.db"
    with TraceStore(path) as store:
        for i in range(6):
            turn = Turn(agent="solver", node="solve", step=1, index=0, messages=(HumanMessage("q"),),
                        prompt_ids=(1,), response_ids=(2,), response_logprobs=(-0.5,), response_text=f"x = {i % 2}")
            store.write_episode(Episode(id=f"ep{i}", task_id="t", group_id=f"train:0:t{i // 3}", turns=[turn],
                                        metadata={"phase": "train" if i < 5 else "eval"}))
            store.update_training(f"ep{i}", step=None, rewards={"solver": i / 10})
    out = io.StringIO()
    args = build_parser().parse_args(["traces", "list", str(path), "--phase", "train", "--reply", "x = 0",
                                      "--min-reward", "0.1", "--sort", "reward", "--desc"])
    assert _cmd_list(args, Console(file=out, width=200, no_color=True)) == 0
    ids = [line.split()[1] for line in out.getvalue().splitlines() if line.startswith("│ ep")]
    assert ids == ["ep4", "ep2"]  # x = 0: ep0, ep2, ep4 (ep0 below the bound); ep5 is eval
