"""drmas-graph ui in a real browser (the system's headless Chromium, driven by Playwright) over a run made by a
real tiny-model training run: every page opened, filters and a replay clicked through, what is on the page
asserted, a screenshot of every page saved ($UI_SCREENSHOTS, else tests/artifacts/ui/)."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

import pytest
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langgraph.graph import END, START, StateGraph

from drmas_graph import Task, train_graph
from drmas_graph.testing import tiny_policy
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
    assert captions[:3] == ["reward/team_mean", "agent per series: reward_mean", "gradient norm"]
    assert "tiny-run / solve" in page.locator("#charts").inner_text()
    assert "tiny-run / check" in page.locator("#charts").inner_text()
    assert page.locator("table.evals").first.locator("tr").count() == 3  # header + evaluations at steps 0 and 2
    page.screenshot(path=str(SHOTS / "runs.png"))
    page.uncheck("input[value='xss-run']")
    page.click("text=Overlay")
    assert page.url.endswith("/?run=tiny-run")


def test_episodes_filters_group_episode_and_replay(server, page):
    page.goto(server[0] + "/runs/tiny-run/episodes")
    assert page.locator("#count").inner_text().startswith("32 episodes")  # training 2 steps x 2 tasks x 4, eval 2 x 2 tasks x k=4
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
    page.screenshot(path=str(SHOTS / "group.png"))

    page.click(".member h3 a >> nth=0")
    assert page.locator("#tree").inner_text().count("#") == 2  # two turns: solve then check
    first = page.locator("#turn-0 .tokens .t").first
    assert first.get_attribute("title").startswith("id ")
    assert "logprob -" in first.get_attribute("title")
    assert "No tokenizer" not in page.content()  # decoded with the checkpoint's tokenizer
    assert "Answer with a number." in page.locator("#turn-0 .messages").inner_text()
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
