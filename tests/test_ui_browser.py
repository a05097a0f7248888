"""drmas-graph ui in a real browser (the system's headless Chromium, driven by Playwright) over a run made by a
real tiny-model training run: every page opened, filters, charts, the answers view and a replay clicked through,
what is on the page asserted (and that it fits the window), error pages, a screenshot of every page saved
($UI_SCREENSHOTS, else tests/artifacts/ui/)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

import pytest
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langgraph.graph import END, START, StateGraph
from tokenizers import Tokenizer

from drmas_graph import Task, train_graph
from drmas_graph.testing import tiny_policy
from drmas_graph.traces.store import TraceStore
from drmas_graph.ui._app import UiApp, make_server
from tests.test_ui import XSS_REPLY, write_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium installed: apt-get install -y chromium (.ci/run does) to run the browser tests")

SHOTS = Path(os.environ.get("UI_SCREENSHOTS") or Path(__file__).parent / "artifacts" / "ui")
llm = FakeListChatModel(responses=["unused"])


class State(TypedDict, total=False):
    question: str
    answer: str
    verdict: str


def build(prompt: str = "Answer with a number."):
    def solve(state: State) -> State:
        return {"answer": llm.invoke(f"{prompt} {state['question']}").content}

    def check(state: State) -> State:
        return {"verdict": llm.invoke(f"Is {state['answer']!r} right for {state['question']}? yes or no").content}

    return (StateGraph(State).add_node("solve", solve).add_node("check", check).add_edge(START, "solve")
            .add_edge("solve", "check").add_edge("check", END).compile())


class Env:
    def tasks(self, split):
        return [Task(id=f"{split}-{i}", input={"question": f"{i} + {i}?"}, answer=str(2 * i)) for i in range(8)]

    def reward(self, task, episode):  # varies within a group, so advantages are not all zero
        return float(len(episode.final_state["answer"]) % 2)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("ui")
    run_dir = root / "tiny-run"
    train_graph(build(), Env(), policies={"solve": tiny_policy(), "check": tiny_policy(seed=1)}, steps=2,
                tasks_per_step=2, group_size=4, run_dir=str(run_dir), update={"backend": "torch"}, eval={"n_tasks": 2},
                logging={"tensorboard": False})
    (root / "xss-run").mkdir()
    write_run(root / "xss-run", n_plain=2)
    apps = [UiApp([run_dir, root / "xss-run"], graph=build(), graph_spec="tests.test_ui_browser:graph"),
            UiApp({"tiny-run": UiApp([run_dir]).runs["tiny-run"]}, graph=build("Reply with one number.")),]
    servers = [make_server(app, "127.0.0.1", 0) for app in apps]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{s.server_port}" for s in servers]
    for s, app in zip(servers, apps, strict=True):
        s.shutdown()
        s.server_close()
        app.close()


@pytest.fixture(scope="module")
def page(server) -> Iterator[object]:
    SHOTS.mkdir(parents=True, exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 860})
        dialogs: list[str] = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.dialogs = dialogs
        yield page
        browser.close()


def test_runs_page_shows_curves_and_evaluations(server, page):
    page.goto(server[0] + "/")
    assert page.locator("#charts figure").count() >= 8
    captions = page.locator("#charts figcaption").all_inner_texts()
    assert captions[:3] == ["reward/team_mean", "reward_mean per agent", "gradient norm per model"]
    assert "tiny-run / solve" in page.locator("#charts").inner_text()
    assert "tiny-run / check" in page.locator("#charts").inner_text()
    assert page.locator("table.evals").first.locator("tr").count() == 3  # header + evaluations at steps 0 and 2
    # the evaluations' most frequent replies are tables, and nothing makes the page wider than the window
    assert page.locator("table.top").count() == 4  # 2 evaluations x 2 agents
    assert "[{" not in page.locator("main").inner_text()
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    page.screenshot(path=str(SHOTS / "runs.png"))
    page.uncheck("input[value='xss-run']")
    page.click("#redraw")
    assert "/?run=tiny-run&smooth=0" in page.url and "xss-run" not in page.locator("#charts").inner_text()


def test_episodes_filters_group_episode_and_replay(server, page):
    page.goto(server[0] + "/runs/tiny-run/episodes")
    assert page.locator("#count").inner_text().startswith("16 train episodes")  # 2 steps x 2 tasks x 4 (eval: 16 more)
    assert page.locator("#episodes td.replies .reply").count() == 32  # each episode's last reply per agent
    page.select_option("select[name=phase]", "all")
    page.click("#apply")
    assert page.locator("#count").inner_text().startswith("32 episodes")
    page.select_option("select[name=step]", "1")
    page.select_option("select[name=outcome]", "finished")
    page.click("#apply")
    assert "step=1" in page.url and "outcome=finished" in page.url
    assert page.locator("#count").inner_text().startswith("8 episodes")
    page.click("#episodes th >> text=reward")
    rewards = [float(r) for r in page.locator("#episodes tr td:nth-child(8)").all_inner_texts()]
    assert rewards == sorted(rewards)
    page.screenshot(path=str(SHOTS / "episodes.png"))

    page.click("#episodes tr:nth-child(2) td:nth-child(3) a")  # its group
    assert page.locator(".member").count() == 4
    advantages = page.locator(".member .adv").all_inner_texts()
    assert len(advantages) == 8 and any(a != "0" for a in advantages)
    assert page.locator(".member .turn-reward").count() == 8
    assert page.locator("#group-stats tr").count() == 3  # header, solve, check
    positions = [int(p.strip("#")) for p in page.locator(".member .position").all_inner_texts()]
    assert positions == [0, 1, 2, 3]  # in the order of the group (the order a judge sees it)
    right_edges = [page.locator(".member").nth(i).bounding_box() for i in range(4)]
    assert all(box["x"] + box["width"] <= 1280 for box in right_edges)  # no card cut off on the right
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    page.screenshot(path=str(SHOTS / "group.png"), full_page=True)

    page.click(".member h3 a >> nth=0")
    assert page.locator("#tree").inner_text().count("#") == 2  # two turns: solve then check
    first = page.locator("#turn-0 .tokens .t").first
    assert first.get_attribute("title").startswith("id ")
    assert "logprob -" in first.get_attribute("title")
    assert "No tokenizer" not in page.content()  # decoded with the checkpoint's tokenizer
    # the exact prompt: the recorded ids decoded with the run's tokenizer, the node's messages folded under it
    store_path, episode_id = page.locator("p.cli code").inner_text().split()[-2:]  # traces show STORE ID
    with TraceStore(store_path, readonly=True) as store:
        recorded = store.load_episode(episode_id).turns[0]
    checkpoint = sorted((Path(store_path).parent / "checkpoints").glob("step_*"))[-1]
    tokenizer = Tokenizer.from_file(str(checkpoint / recorded.policy / "model" / "tokenizer.json"))
    assert page.locator("#turn-0 .prompt-text").text_content() == tokenizer.decode(
        list(recorded.prompt_ids), skip_special_tokens=False)
    assert "Answer with a number." in page.locator("#turn-0 .prompt-text").inner_text()
    assert page.locator("#turn-0 .prompt-note").inner_text().startswith(
        f"exactly what the policy saw: the {len(recorded.prompt_ids)} prompt token ids decoded with checkpoints/")
    assert page.locator("#turn-0 details.messages").inner_text() == "the same prompt as the node's 1 message (before the chat template)"
    assert '"question"' in page.locator("#final-state").inner_text()
    page.screenshot(path=str(SHOTS / "episode.png"), full_page=True)
    episode_path = page.url.split("/", 3)[3]

    page.click("#replay")
    assert page.locator("#verdict").inner_text().startswith("Replay matched all 2 calls")
    page.screenshot(path=str(SHOTS / "replay.png"))

    page.goto(f"{server[1]}/{episode_path}/replay")  # the same episode into a graph whose prompt changed
    assert "1 divergence" in page.locator("#verdict").inner_text()
    assert page.locator(".divergence .kind").inner_text() == "prompt_changed"
    assert page.locator(".divergence .del").filter(has_text="Answer with a number.").count() == 1
    assert page.locator(".divergence .add").filter(has_text="Reply with one number.").count() == 1
    page.screenshot(path=str(SHOTS / "replay-divergence.png"), full_page=True)


def test_stored_html_shows_as_text_and_runs_nothing(server, page):
    page.goto(server[0] + "/runs/xss-run/episodes/xss")
    assert XSS_REPLY in page.locator("#turn-0 .response-text").text_content()
    assert page.locator("main script, main img").count() == 0
    assert page.dialogs == []
    page.screenshot(path=str(SHOTS / "xss.png"))


def test_answers_view_shows_each_agents_replies_and_finds_their_episodes(server, page):
    page.goto(server[0] + "/runs/tiny-run/answers")
    agents = page.locator(".agent-answers").evaluate_all("els => els.map(e => e.dataset.agent)")
    assert agents == ["check", "solve"]
    assert "train · step 1 · 8 calls" in page.locator(".agent-answers").first.inner_text()  # 2 tasks x 4, one call each
    counts = [int(c) for c in page.locator(".agent-answers").first.locator("td.count").all_inner_texts()]
    assert sum(counts) <= 8 and counts == sorted(counts, reverse=True)
    assert page.locator("#answer-charts figcaption").all_inner_texts() == ["distinct replies per step",
                                                                           "reply entropy (bits) per step"]
    page.screenshot(path=str(SHOTS / "answers.png"), full_page=True)
    page.select_option("select[name=phase]", "eval")
    page.click("#show")
    assert "phase=eval" in page.url and "eval · step 2" in page.locator(".agent-answers").first.inner_text()
    first_count = int(page.locator(".agent-answers").first.locator("td.count").first.inner_text())
    page.locator(".agent-answers").first.locator("a.find").first.click()  # the episodes that gave this reply
    assert "reply=" in page.url and "phase=eval" in page.url
    assert page.locator("#count").inner_text().startswith(f"{first_count} eval episode")


def test_charts_smooth_range_and_enlarge(server, page):
    page.goto(server[0] + "/?run=tiny-run")
    page.select_option("select[name=smooth]", "0.6")
    page.fill("input[name=from_step]", "1")
    page.click("#redraw")
    assert "smooth=0.6" in page.url and "from_step=1" in page.url
    first = page.locator("#charts figure").first
    assert first.locator("polyline.raw").count() == 1 and first.locator("line.grid").count() >= 4
    titles = first.locator("circle title").all_text_contents()
    assert titles and all("smoothed" in t and "step 0" not in t for t in titles)
    page.screenshot(path=str(SHOTS / "runs-smoothed.png"))
    first.locator("a.enlarge").click()
    assert "/chart?metric=reward%2Fteam_mean" in page.url
    box = page.locator("svg.chart.large").bounding_box()
    assert box["width"] > 900
    page.screenshot(path=str(SHOTS / "chart.png"))
    page.click("#back")
    assert "smooth=0.6" in page.url


def test_a_steps_time_by_phase_is_one_chart_and_each_agents_engine_time_its_own(server, page):
    """The tiny run's steps logged their phases (the embedded engine's prefill and decode among them): one chart
    draws them, a colour per phase, before the other time charts; per agent, its prefill, decode and call time."""
    page.goto(server[0] + "/?run=tiny-run")
    captions = page.locator("#charts figcaption").all_inner_texts()
    at = captions.index("seconds per step, by phase")
    assert captions[at + 1] == "time/step_s"
    for chart in ("rollout_prefill_s per agent", "rollout_decode_s per agent", "llm_call_s per agent"):
        assert chart in captions
    figure = page.locator("#charts figure", has=page.locator("figcaption", has_text="seconds per step, by phase"))
    labels = figure.locator(".legend .key").all_inner_texts()
    assert labels == ["rollout", "prefill", "decode", "score", "old logprobs", "update", "sync"]  # no checkpoint
    strokes = figure.locator("polyline.line").evaluate_all("lines => lines.map(l => getComputedStyle(l).stroke)")
    assert len(strokes) == 7 and len(set(strokes)) == 7
    hover = figure.locator("circle title").all_text_contents()
    assert any(t.startswith("prefill: step 1, ") for t in hover)
    figure.screenshot(path=str(SHOTS / "time-by-phase.png"))
    figure.locator("a.enlarge").click()
    assert "/chart?metric=time%2F%2A" in page.url or "/chart?metric=time/*" in page.url
    assert page.locator("svg.chart.large polyline.line").count() == 7


def test_error_pages_are_styled(server, page):
    for path, status in (("/runs/tiny-run/group?id=nonexistent", 404), ("/runs/tiny-run/episodes?page=99999999999999999999", 400),
                         ("/runs/tiny-run/episodes?sort=id;drop", 400), ("/nowhere", 404)):
        response = page.goto(server[0] + path)
        assert response.status == status, path
        assert page.locator("h1").inner_text().startswith(str(status))
        assert page.evaluate("document.styleSheets.length") == 1  # the stylesheet loaded
        assert "Traceback" not in page.content()
    page.screenshot(path=str(SHOTS / "error.png"))


def test_overlaid_runs_are_drawn_in_distinct_colours_and_styles(tmp_path, page):
    """What the browser draws (computed stroke and dash of each line): nine runs given, the first and the ninth
    overlaid (the same colour before: place among every run % 8), the ninth with seven agents (the dash styles,
    numbered over every agent and model, wrapped past six)."""
    folders = []
    for i in range(9):
        folders.append(tmp_path / f"r{i}")
        folders[-1].mkdir()
        agents = [f"agent{j}" for j in range(7)] if i == 8 else ["solver"]
        with (folders[-1] / "metrics.jsonl").open("w") as f:
            for step in range(2):
                record = {"step": step, "model/m1/grad_norm": 1.0, "model/m2/grad_norm": 2.0}
                record.update({f"agent/{a}/reward_mean": step / (j + 2) for j, a in enumerate(agents)})
                f.write(json.dumps(record) + "\n")
    app = UiApp(folders)
    server = make_server(app, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        page.goto(f"http://127.0.0.1:{server.server_port}/?run=r8&run=r0")
        figure = page.locator("#charts figure", has=page.locator("figcaption", has_text="reward_mean per agent"))
        drawn = figure.locator("polyline.line").evaluate_all(
            "lines => lines.map(l => [getComputedStyle(l).stroke, getComputedStyle(l).strokeDasharray])")
        page.screenshot(path=str(SHOTS / "overlaid.png"))
    finally:
        server.shutdown()
        server.server_close()
        app.close()
    assert len(drawn) == 8 and len({tuple(d) for d in drawn}) == 8, drawn
    assert {stroke for stroke, _ in drawn} == {"rgb(31, 119, 180)", "rgb(214, 39, 40)"}
