"""Issue 47 item 5: the tools an agent was given are shown where its calls are read: `drmas-graph traces show`
and the UI's episode page (in a real browser). The episode is recorded by an instrumented run whose node
binds two tools through the OpenAI SDK."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from drmas_graph import TraceStore, instrument
from drmas_graph.cli import main
from drmas_graph.testing import scripted_policy
from tests.test_instrument_clients import MESSAGES, fake_keys  # noqa: F401 - a fixture
from tests.test_instrument_clients_sdks import CALL, one_node

TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two <b>numbers</b>", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}},
]


@pytest.fixture
def tool_run(tmp_path: Path) -> tuple[Path, str]:
    """A run folder whose one episode has a call given TOOLS (answered with a call of `add`) and one without."""
    import openai

    client = openai.OpenAI(max_retries=0)

    def writer(state):
        first = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS)
        second = client.chat.completions.create(model="m", messages=MESSAGES)
        return {"out": [first.choices[0].finish_reason, second.choices[0].message.content]}

    folder = tmp_path / "tool-run"
    folder.mkdir()
    policy = scripted_policy([CALL, "Done."])
    with TraceStore(folder / "traces.db") as store:
        episode = instrument(one_node(writer), {"writer": policy}, strict=True, store=store).rollout({"q": "x"})
    policy.close()
    assert episode.final_state["out"] == ["tool_calls", "Done."]
    assert [len(t.tools) for t in episode.turns] == [2, 0]
    return folder, episode.id


def test_traces_show_lists_the_tools_each_call_was_given(tool_run, capsys):
    folder, episode_id = tool_run
    assert main(["traces", "show", str(folder / "traces.db"), episode_id]) == 0
    out = capsys.readouterr().out
    assert out.count("tools    ") == 1  # the second call was given no tools
    assert "│ tools    add(a: integer, b: integer), lookup(city?: string)" in out
    assert '│ calls    1 tool call, all parsed: add({"a": 2, "b": 3})' in out
    assert out.index("tools    add(") < out.index("response <tool_call>") < out.index("calls    1 tool call")
    assert main(["traces", "show", str(folder / "traces.db"), episode_id, "--full"]) == 0
    full = capsys.readouterr().out
    assert "│ tool     add(a: integer, b: integer): Add two <b>numbers</b>" in full
    assert "│ tool     lookup(city?: string): -" in full and "tools    " not in full


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def ui_url(tool_run) -> Iterator[tuple[str, str]]:
    from drmas_graph.ui._app import UiApp, make_server

    folder, episode_id = tool_run
    app = UiApp([folder])
    server = make_server(app, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/runs/tool-run/episodes/{episode_id}", episode_id
    server.shutdown()
    server.server_close()
    app.close()


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed: apt-get install -y chromium (.ci/run does)")
def test_the_episode_page_shows_the_tools_each_call_was_given(ui_url):
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
    url, _ = ui_url
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 860})
        page.goto(url)
        tools = page.locator("#tools-0")
        assert tools.locator("summary").inner_text() == ("tools given (2): add(a: integer, b: integer), "
                                                         "lookup(city?: string)")
        assert page.locator("#tools-1").count() == 0  # the second call was given none
        assert not tools.locator("pre").first.is_visible()  # folded until clicked
        tools.locator("summary").click()
        assert tools.locator(".role.sig").all_inner_texts() == ["add(a: integer, b: integer)", "lookup(city?: string)"]
        assert tools.locator("p").all_inner_texts() == ["Add two <b>numbers</b>"]  # stored text, not markup
        assert tools.locator("b").count() == 0
        schema = tools.locator("pre").first.inner_text()
        assert '"required": [\n        "a",\n        "b"\n      ]' in schema and '"name": "add"' in schema
        assert page.evaluate("document.documentElement.scrollWidth") <= 1280
        shots = Path(__file__).parent / "artifacts" / "ui"
        shots.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shots / "episode-tools.png"))
        browser.close()
