"""drmas-graph ui without a browser: filters, sorting and pages of the episode list, escaping, what can be read,
where it binds, a run that is still training, the command line. (tests/test_ui_browser.py drives real pages.)"""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import shlex
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from langchain_core.messages import HumanMessage, SystemMessage

from drmas_graph.cli import build_parser
from drmas_graph.errors import ConfigError
from drmas_graph.traces.store import TraceStore
from drmas_graph.types import Episode, Turn
from drmas_graph.ui._app import UiApp, is_loopback, make_server
from drmas_graph.ui._data import EpisodeQuery

XSS_REPLY = '<script>alert("reply")</script><img src=x onerror=alert("img")>'
XSS_PROMPT = "</pre><script>alert('prompt')</script>"


def make_turn(agent: str, index: int, text: str = "4", prompt: str = "2 + 2?") -> Turn:
    return Turn(agent=agent, node=f"{agent}_node", step=index + 1, index=index,
                messages=(SystemMessage(f"you are {agent}"), HumanMessage(prompt)),
                prompt_ids=(1, 2, 3), response_ids=(7, 8), response_logprobs=(-0.01, -5.0), response_text=text,
                policy="tiny", policy_version=1, call_key=f"{agent}_node")


def write_run(folder: Path, n_plain: int = 30) -> dict[str, str]:
    """A run folder with `n_plain` finished episodes (task t{i % 3}, group g{i // 4}, step i // 10, reward i / 100)
    plus one truncated, one interrupted and one whose reply and prompt are HTML. Returns ids by role."""
    ids = {}
    with TraceStore(folder / "traces.db") as store:
        for i in range(n_plain):
            episode = Episode(id=f"plain{i:03d}", task_id=f"t{i % 3}", group_id=f"g{i // 4}",
                              turns=[make_turn("solver", 0), make_turn("checker", 1)], final_state={"answer": "4"})
            store.write_episode(episode)
            store.update_training(episode.id, step=i // 10, rewards={"solver": i / 100, "checker": 1.0},
                                  advantages=[0.5, -0.5])
        store.write_episode(Episode(id="trunc", task_id="t0", turns=[make_turn("solver", 0)],
                                    truncated="max_llm_calls: 1 call"))
        store.write_episode(Episode(id="paused", task_id="t0", error="EpisodeInterruptedError: nobody answered"))
        store.write_episode(Episode(id="xss", task_id="t<b>", group_id="g<i>x",
                                    turns=[make_turn("solver", 0, text=XSS_REPLY, prompt=XSS_PROMPT)],
                                    final_state={"answer": XSS_REPLY}))
        ids.update(trunc="trunc", paused="paused", xss="xss")
    with (folder / "metrics.jsonl").open("w") as f:
        for step in range(3):
            f.write(json.dumps({"step": step, "reward/team_mean": step / 10, "agent/solver/reward_mean": step / 5,
                                "model/tiny/grad_norm": 1.5 - step}) + "\n")
        f.write(json.dumps({"step": 2, "eval/avg@k": 0.25, "eval/pass@k": 0.5, "eval/solver/reward": 0.3}) + "\n")
    return ids


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "myrun"
    folder.mkdir()
    write_run(folder)
    return folder


@pytest.fixture()
def app(run_dir: Path) -> Iterator[UiApp]:
    app = UiApp([run_dir])
    yield app
    app.close()


def get(app: UiApp, url: str) -> tuple[int, str]:
    parts = urllib.parse.urlsplit(url)
    response = app.handle(parts.path, urllib.parse.parse_qs(parts.query))
    return response.status, response.body.decode()


def listed(body: str) -> list[str]:
    return re.findall(r'class="ep" href="/runs/myrun/episodes/([^"]+)"', body)


def test_episode_list_filters(app):
    status, body = get(app, "/runs/myrun/episodes?step=1")
    assert status == 200 and listed(body) == [f"plain{i:03d}" for i in range(10, 20)]
    assert listed(get(app, "/runs/myrun/episodes?outcome=truncated")[1]) == ["trunc"]
    assert listed(get(app, "/runs/myrun/episodes?outcome=interrupted")[1]) == ["paused"]
    assert listed(get(app, "/runs/myrun/episodes?group=g2")[1]) == ["plain008", "plain009", "plain010", "plain011"]
    assert listed(get(app, "/runs/myrun/episodes?task=t1&step=0")[1]) == ["plain001", "plain004", "plain007"]
    # reward bounds on the mean reward, or on the agent's own reward with agent=
    assert listed(get(app, "/runs/myrun/episodes?min_reward=0.64&max_reward=0.65")[1]) == ["plain028", "plain029"]
    assert listed(get(app, "/runs/myrun/episodes?agent=solver&min_reward=0.28&max_reward=0.29")[1]) == \
        ["plain028", "plain029"]
    assert listed(get(app, "/runs/myrun/episodes?agent=checker&step=2")[1]) == [f"plain{i:03d}" for i in range(20, 30)]


def link(body: str, name: str) -> str | None:
    found = re.search(rf'id="{name}" href="([^"]+)"', body)
    return None if found is None else found.group(1).replace("&amp;", "&")


def test_episode_list_sorts_and_pages(app):
    body = get(app, "/runs/myrun/episodes?sort=reward&desc=1&per_page=25")[1]
    assert listed(body)[:3] == ["plain029", "plain028", "plain027"]
    assert '<p id="count">33 episodes' in body  # no trainer phases in this store: every episode
    assert link(body, "prev") is None
    # keyset pages: the next-page link keeps the filters and sort (a shareable URL) and names the last row: plain005, mean reward (0.05 + 1) / 2, rowid 6
    assert link(body, "next") == "/runs/myrun/episodes?sort=reward&desc=1&after=%5B0.525%2C6%5D&per_page=25"
    second = get(app, link(body, "next"))[1]
    assert listed(second) == ["plain004", "plain003", "plain002", "plain001", "plain000", "xss", "paused", "trunc"]  # no reward: last
    assert link(second, "next") is None
    back = get(app, link(second, "prev"))[1]
    assert listed(back) == listed(body) and link(back, "prev") is None
    assert get(app, "/runs/myrun/episodes?sort=reward&after=[1,2,3]")[0] == 400  # not a cursor of this sort


def test_bad_parameters_are_400_naming_them(app):
    status, body = get(app, "/runs/myrun/episodes?outcome=lost")
    assert status == 400 and "outcome=&#39;lost&#39;" in body and "interrupted" in body
    status, body = get(app, "/runs/myrun/episodes?step=two")
    assert status == 400 and "step=&#39;two&#39; is not an integer" in body
    assert get(app, "/runs/myrun/episodes?sort=id;drop")[0] == 400
    assert get(app, "/runs/myrun/episodes?min_reward=nan")[0] == 400


def test_filtered_and_sorted_by_an_agents_reward_the_reward_column_is_that_agents(app):
    """solver's reward i / 100, checker's 1.0: the team mean of plain028 is 0.64; the column showed it."""
    body = get(app, "/runs/myrun/episodes?agent=solver&sort=reward&desc=1&min_reward=0.27&max_reward=0.29")[1]
    assert listed(body) == ["plain029", "plain028", "plain027"]
    assert re.findall(r'<td class="reward">([^<]*)</td>', body) == ["0.29", "0.28", "0.27"]
    assert "solver&#39;s reward ▼</a>" in body
    body = get(app, "/runs/myrun/episodes?sort=reward&desc=1&min_reward=0.64&max_reward=0.642")[1]
    assert re.findall(r'<td class="reward">([^<]*)</td>', body) == ["0.64"] and ">reward ▼</a>" in body


def test_the_final_states_messages_show_as_role_content_and_tool_calls(app, run_dir):
    """A final state holding LangChain messages (a ToolNode app's): the page showed their Python reprs
    (content='...' additional_kwargs={} ...)."""
    from langchain_core.messages import AIMessage, ToolMessage

    call = {"name": "lookup", "args": {"sku": "T-1"}, "id": "call_a1", "type": "tool_call"}
    state = {"messages": [HumanMessage("Price of T-1?"), AIMessage("", tool_calls=[call]),
                          ToolMessage("4 EUR", tool_call_id="call_a1", name="lookup"), AIMessage("It costs 4 EUR.")]}
    with TraceStore(run_dir / "traces.db") as store:
        store.write_episode(Episode(id="tools", task_id="t0", turns=[make_turn("solver", 0)], final_state=state))
    body = get(app, "/runs/myrun/episodes/tools")[1]
    shown = json.loads(re.search(r'<pre class="json" id="final-state">(.*?)</pre>', body, re.S).group(1)
                       .replace("&#34;", '"').replace("&quot;", '"').replace("&#39;", "'"))
    assert shown == {"messages": [
        {"role": "user", "content": "Price of T-1?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "lookup", "args": {"sku": "T-1"},
                                                             "id": "call_a1"}]},
        {"role": "tool", "name": "lookup", "content": "4 EUR", "tool_call_id": "call_a1"},
        {"role": "assistant", "content": "It costs 4 EUR."}]}
    assert "additional_kwargs" not in body


def test_zero_page_size_and_top_and_a_reversed_step_range_are_a_styled_400(app):
    """per_page=0 and top=0 fell back to 50 and 10 silently; from_step > to_step said 'no metrics logged yet'."""
    status, body = get(app, "/runs/myrun/episodes?per_page=0")
    assert status == 400 and styled(body) and "parameter per_page=0: valid page sizes are" in body
    status, body = get(app, "/runs/myrun/answers?top=0")
    assert status == 400 and styled(body) and "parameter top=0: valid values are" in body
    status, body = get(app, "/?from_step=5&to_step=2")
    assert status == 400 and styled(body) and "from_step=5 and to_step=2: no step is in that range" in body
    assert "No metrics logged yet" not in body
    status, body = get(app, "/?from_step=7")  # a range past every logged step says so
    assert status == 200 and "No metric logged at steps 7..: widen the step range." in body


def test_overlaid_runs_never_share_a_colour_and_agents_never_share_a_style(tmp_path):
    """Nine runs given, the first and the ninth overlaid: each had colour (place among every run) % 8 = 0. One
    run with seven agents and two models: the line styles, numbered over every part, wrapped past six."""
    folders = []
    for i in range(9):
        folder = tmp_path / f"r{i}"
        folder.mkdir()
        agents = [f"agent{j}" for j in range(7)] if i == 8 else ["solver"]
        with (folder / "metrics.jsonl").open("w") as f:
            for step in range(2):
                record = {"step": step, "model/m1/grad_norm": 1.0, "model/m2/grad_norm": 2.0}
                record.update({f"agent/{a}/reward_mean": step / (j + 2) for j, a in enumerate(agents)})
                f.write(json.dumps(record) + "\n")
        folders.append(folder)
    app = UiApp(folders)
    for url in ("/?run=r0&run=r8", "/chart?metric=agent/*/reward_mean&run=r8&run=r0"):
        status, body = get(app, url)
        drawn = chart(body, "reward_mean per agent")
        lines = re.findall(r'<polyline class="line" points="[^"]+" fill="none" stroke="(#\w+)"'
                           r'(?: stroke-dasharray="([^"]+)")?', drawn)
        assert status == 200 and len(lines) == 8 and len(set(lines)) == 8, lines
        assert {colour for colour, _ in lines} == {"#1f77b4", "#d62728"}  # r0 blue, r8 red, in either URL order


def test_group_and_episode_pages_show_the_stored_values(app):
    status, body = get(app, "/runs/myrun/group?id=g0")
    assert status == 200 and body.count('class="card member"') == 4
    assert re.findall(r'class="adv">([^<]+)<', body) == ["0.5", "-0.5"] * 4
    status, body = get(app, "/runs/myrun/episodes/plain005")
    assert status == 200
    assert 'title="id 7 · logprob -0.0100"' in body and 'title="id 8 · logprob -5.0000"' in body
    assert '<span class="t t9"' in body and '<span class="t t2"' in body  # coloured by logprob
    assert "⟨7⟩" in body  # no tokenizer in this run: ids shown
    legend = re.findall(r'<span class="t t(\d)">([^<]+)</span>', body.split('id="token-legend"')[1].split("</p>")[0])
    assert legend[0] == ("0", "&lt; -8") and legend[2] == ("2", "-6 … -4") and legend[-1] == ("9", "-0.05 … 0")
    assert "drmas-graph traces show" in body and "plain005" in body


def test_stored_html_is_escaped_text(app):
    status, body = get(app, "/runs/myrun/episodes/xss")
    assert status == 200
    assert "<script>" not in body and "<img" not in body
    assert "&lt;script&gt;alert(&#34;reply&#34;)&lt;/script&gt;&lt;img src=x onerror=alert(&#34;img&#34;)&gt;" in body
    assert "&lt;/pre&gt;&lt;script&gt;alert(&#39;prompt&#39;)&lt;/script&gt;" in body
    assert "t&lt;b&gt;" in body and "g&lt;i&gt;x" in body
    body = get(app, "/runs/myrun/episodes?task=t<b>")[1]
    assert listed(body) == ["xss"] and "<b>" not in body.split('id="episodes"')[1]


def test_episode_page_shows_the_judges_verdict_escaped(app, run_dir):
    record = {"mode": "agent", "model": "judge<7b>", "rubric_sha": "3f2a9c0d1e4b",
              "prompt": [{"role": "system", "content": "Rubric: " + XSS_PROMPT},
                         {"role": "user", "content": "#0 solver"}],
              "replies": ["not json", '{"scores": {"solver": 0.75, "checker": 0.0}}' + XSS_REPLY],
              "scores": {"solver": 0.75, "checker": 0.0}, "reasons": {"solver": XSS_REPLY, "checker": "no <check>"},
              "attempts": 2, "input_tokens": 812, "output_tokens": 64, "cached": True, "seconds": 1.25, "error": None}
    with TraceStore(run_dir / "traces.db") as store:
        store.write_episode(Episode(id="judged", task_id="t0", turns=[make_turn("solver", 0), make_turn("checker", 1)],
                                    judgement=record))
        store.write_episode(Episode(id="misjudged", task_id="t0", turns=[make_turn("solver", 0)], judgement={
            "mode": "group", "model": "judge", "prompt": [], "replies": [], "scores": None, "reasons": None,
            "attempts": 3, "group_size": 4, "index": 2, "error": "JudgeError: no usable <score> after 3 attempts"}))
    status, body = get(app, "/runs/myrun/episodes/judged")
    assert status == 200 and "<script>" not in body and "<img" not in body and "<check>" not in body
    section = body.split('id="judgement"')[1].split("</section>")[0]
    assert "agent mode" in section and "judge&lt;7b&gt;" in section and ">cached<" in section
    rows = re.findall(r'<tr><th>([^<]+)</th><td class="score">([^<]+)</td><td class="reason">([^<]+)</td></tr>',
                      section)
    assert rows == [("solver", "0.75", "&lt;script&gt;alert(&#34;reply&#34;)&lt;/script&gt;&lt;img src=x "
                                       "onerror=alert(&#34;img&#34;)&gt;"), ("checker", "0", "no &lt;check&gt;")]
    reply = re.search(r'<pre id="judge-reply">([^<]*)</pre>', section).group(1)
    assert reply.startswith("{&#34;scores&#34;: {&#34;solver&#34;: 0.75") and reply.endswith("alert(&#34;img&#34;)&gt;")
    assert "the last of 2" in section and "<pre>not json</pre>" in section  # every attempt's reply, folded away
    assert "Rubric: &lt;/pre&gt;&lt;script&gt;alert(&#39;prompt&#39;)&lt;/script&gt;" in section
    assert "the judge's prompt (2 messages)" in section and "<td>812 / 64</td>" in section
    section = get(app, "/runs/myrun/episodes/misjudged")[1].split('id="judgement"')[1].split("</section>")[0]
    assert '<p class="error" id="judge-error">JudgeError: no usable &lt;score&gt; after 3 attempts</p>' in section
    assert "attempt_3 of the 4 judged together" in section and "<th>judge calls</th><td>3</td>" in section and '<pre id="judge-reply">–</pre>' in section
    assert 'id="judgement"' not in get(app, "/runs/myrun/episodes/plain005")[1]  # no judge, no section


def test_nothing_outside_the_run_folders_is_served(app, run_dir):
    (run_dir.parent / "secret.txt").write_text("top secret")
    for path in ("/static/../secret.txt", "/static/%2e%2e/secret.txt", "/runs/myrun/../secret.txt",
                 "/runs/%2e%2e/episodes", "/runs/myrun/episodes/..%2f..%2fsecret.txt", "/runs/myrun/traces.db",
                 "/runs/myrun/metrics.jsonl", "/static/__init__.py", "/etc/passwd"):
        status, body = get(app, path)
        assert status == 404, path
        assert "top secret" not in body
    assert get(app, "/runs/myrun/episodes/nope")[0] == 404


def test_the_store_is_opened_read_only_and_never_changed(app, run_dir):
    before = hashlib.sha256((run_dir / "traces.db").read_bytes()).hexdigest()
    for path in ("/", "/runs/myrun/episodes", "/runs/myrun/episodes/xss", "/runs/myrun/group?id=g0"):
        assert get(app, path)[0] == 200
    assert app.runs["myrun"].store().readonly
    assert hashlib.sha256((run_dir / "traces.db").read_bytes()).hexdigest() == before


def test_runs_page_reads_metrics_appended_while_training(app, run_dir):
    body = get(app, "/")[1]
    assert "myrun / solver: step 2, 0.4</title>" in body
    assert "myrun / tiny: step 0, 1.5</title>" in body  # gradient norm per model
    assert re.search(r"<td>2</td><td>0.25</td><td>0.5</td><td>0.3</td>", body)  # evaluation row
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "agent/solver/reward_mean": 0.8}) + "\n")
        f.write('{"step": 4, "agent/solver/rew')  # a line being written: read once it is whole
    body = get(app, "/")[1]
    assert "myrun / solver: step 3, 0.8</title>" in body and "step 4" not in body


def test_several_runs_overlay_and_get_unique_names(tmp_path):
    for name in ("a/seed", "b/seed"):
        (tmp_path / name).mkdir(parents=True)
        write_run(tmp_path / name, n_plain=2)
    app = UiApp([tmp_path / "a/seed", tmp_path / "b/seed"])
    assert list(app.runs) == ["seed", "seed-2"]
    body = get(app, "/")[1]
    assert "seed / solver: step 1" in body and "seed-2 / solver: step 1" in body
    body = get(app, "/?run=seed-2")[1]
    assert "seed-2 / solver" in body and "seed / solver" not in body
    app.close()


def test_a_folder_that_is_not_a_run_is_refused_naming_what_it_lacks_and_the_fix(tmp_path):
    (tmp_path / "project" / "src").mkdir(parents=True)
    (tmp_path / "project" / "README.md").write_text("a project")
    with pytest.raises(ConfigError) as caught:
        UiApp([tmp_path / "project"])
    assert str(caught.value) == (
        f"{tmp_path / 'project'} is not a run folder: it has neither traces.db nor metrics.jsonl (what training "
        "writes into its run_dir) and holds other things (README.md, src/): give the run_dir of a training run (an "
        "empty folder is waited for: a run that has not written anything yet)")
    for name in ("seed0", "seed1"):  # the folder of the runs, not a run
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError) as caught:
        UiApp([tmp_path / "runs"])
    assert str(caught.value) == (
        f"{tmp_path / 'runs'} is not a run folder but holds 2 (it has no traces.db or metrics.jsonl itself): give "
        f"those, e.g. drmas-graph ui {tmp_path / 'runs' / 'seed0'} {tmp_path / 'runs' / 'seed1'}")
    with pytest.raises(ConfigError, match="does not exist"):
        UiApp([tmp_path / "missing"])


def test_a_run_that_has_not_written_anything_yet_is_waited_for_and_shown_once_it_has(tmp_path):
    """A run folder training has just created (it loads its models: no traces.db, no metrics.jsonl yet) is served:
    its pages say so and reload themselves; once the run writes, they show it (`drmas-graph ui` exited before)."""
    folder = tmp_path / "starting"
    folder.mkdir()
    (folder / "train.log").write_text("loading models\n")  # what a user may tee there
    app = UiApp([folder])
    refresh = '<meta http-equiv="refresh" content="5">'
    status, body = get(app, "/")
    assert status == 200 and refresh in body
    assert (f"run &#39;starting&#39; has not written anything yet: neither traces.db nor metrics.jsonl in {folder}. "
            "Training creates its trace store") in body
    for page in ("/runs/starting/episodes", "/runs/starting/answers", "/runs/starting/episodes/plain001"):
        status, body = get(app, page)
        assert status == 200 and refresh in body and 'id="waiting"' in body, page
    (folder / "metrics.jsonl").write_text('{"step": 0, "reward/team_mean": 0.5}\n')  # metrics, no episode
    status, body = get(app, "/")
    assert status == 200 and refresh not in body and "reward/team_mean" in body
    status, body = get(app, "/runs/starting/episodes")
    assert status == 200 and refresh not in body and (
        f"run &#39;starting&#39; has no episodes: no traces.db in {folder} (its metrics are on the Runs page).") in body
    write_run(folder)  # the run writes its store and its first metrics
    status, body = get(app, "/")
    assert status == 200 and refresh not in body and "has not written anything yet" not in body
    assert "starting / solver: step 2, 0.4</title>" in body
    status, body = get(app, "/runs/starting/episodes?step=1")
    assert status == 200 and refresh not in body
    assert re.findall(r'class="ep" href="/runs/starting/episodes/([^"]+)"', body) == [
        f"plain{i:03d}" for i in range(10, 20)]
    app.close()


def test_the_command_line_waits_for_a_run_that_has_not_written_anything_yet(tmp_path):
    import subprocess
    import sys

    folder = tmp_path / "starting"
    folder.mkdir()
    server = subprocess.Popen([sys.executable, "-m", "drmas_graph.cli", "ui", str(folder), "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    guard = threading.Timer(60, server.kill)  # a server that never prints: the read ends, the test fails
    guard.start()
    try:
        lines = [server.stdout.readline() for _ in range(2)]
    finally:
        guard.cancel()
        server.terminate()
        server.wait(timeout=30)
    assert lines[0].startswith("drmas-graph ui: 1 run(s) (starting) at http://127.0.0.1:")
    assert lines[1].strip() == (f"drmas-graph ui: run 'starting' has not written anything yet: neither traces.db nor "
                                f"metrics.jsonl in {folder}. Training creates its trace store once its models are "
                                "loaded; its first episodes and metrics show when its first step ends. Its pages "
                                "show it as it trains.")
    (folder / "notes.txt").write_text("not a run")
    done = subprocess.run([sys.executable, "-m", "drmas_graph.cli", "ui", str(folder), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith(f"drmas-graph: error: {folder} is not a run folder: ")


def test_binds_loopback_by_default_and_warns_for_another_host(app, capsys):
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2")
    args = build_parser().parse_args(["ui", "runs/x"])
    assert (args.host, args.port, args.graph, args.run_dirs) == ("127.0.0.1", 8000, None, ["runs/x"])
    server = make_server(app, "0.0.0.0", 0)
    server.server_close()
    assert "WARNING: serving on 0.0.0.0" in capsys.readouterr().err


def test_http_headers_forbid_scripts_and_other_hosts(app):
    server = make_server(app, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=10)
        conn.request("GET", "/runs/myrun/episodes/xss")
        response = conn.getresponse()
        assert response.status == 200
        assert "script-src" not in response.headers["Content-Security-Policy"]  # default-src 'none': no script
        assert response.headers["Content-Security-Policy"].startswith("default-src 'none'")
        response.read()
        conn.request("GET", "/", headers={"Host": "evil.example:80"})  # DNS rebinding
        response = conn.getresponse()
        assert response.status == 400
        response.read()
    finally:
        server.shutdown()
        server.server_close()


def test_query_round_trips_through_its_url():
    query = EpisodeQuery(step=2, agent="solver", outcome="truncated", min_reward=0.5, sort="reward", desc=True,
                         after="[0.5,3]", phase="eval", reply="the answer")
    assert EpisodeQuery.from_params(query.params()) == query
    assert EpisodeQuery().params() == {}


@pytest.mark.parametrize("command", [["drmas_graph.cli", "ui"], ["drmas_graph.ui"]])
def test_both_command_lines_refuse_a_missing_run_folder_in_one_line(command, tmp_path):
    """`drmas-graph ui` and `python -m drmas_graph.ui` share one command line (`cli/_ui.py`): exit 2, one line."""
    import subprocess
    import sys

    missing = tmp_path / "no-run"
    done = subprocess.run([sys.executable, "-m", *command, str(missing), "--port", "0"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip() == f"drmas-graph: error: run folder {missing} does not exist"


# -- the edges: every bad input a styled 4xx, every fault a styled 5xx ------------------------------------------


def styled(body: str) -> bool:
    return '<link rel="stylesheet" href="/static/ui.css">' in body and "Traceback" not in body


@pytest.mark.parametrize("query", ["page=99999999999999999999", "step=99999999999999999999",
                                   "step=-99999999999999999999", "per_page=99999999999999999999"])
def test_oversized_numbers_are_a_styled_400(app, query):
    status, body = get(app, f"/runs/myrun/episodes?{query}")
    assert status == 400 and styled(body) and "out of range" in body


def test_malformed_metrics_lines_are_skipped_and_counted(app, run_dir):
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "agent/solver/reward_mean": 0.9\n')  # cut short
        f.write("[1, 2]\n")  # JSON but not a record
        f.write('\xff\xfe not utf-8\n')
        f.write(json.dumps({"step": 6, "agent/solver/reward_mean": 0.95}) + "\n")
    status, body = get(app, "/")
    assert status == 200
    assert "myrun: 3 lines of metrics.jsonl are not JSON (skipped)." in body
    assert "myrun / solver: step 6, 0.95</title>" in body  # the lines after the bad ones still count


def test_a_corrupt_store_is_a_styled_500_without_traceback(app, run_dir):
    (run_dir / "traces.db").write_bytes(b"this is not a database" * 200)
    for path in ("/runs/myrun/episodes", "/runs/myrun/episodes/plain001", "/runs/myrun/group?id=g0"):
        status, body = get(app, path)
        assert status == 500 and styled(body) and "is not a readable trace store" in body, path


def serving(app: UiApp):
    server = make_server(app, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def fetch(server, path: str, host: str | None = None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=10)
    conn.request("GET", path, headers={"Host": host} if host else {})
    response = conn.getresponse()
    return response.status, response.read().decode()


def test_every_fault_over_http_is_a_styled_page(app, run_dir, monkeypatch):
    server = serving(app)
    try:
        status, body = fetch(server, "/runs/myrun/episodes?page=99999999999999999999")
        assert status == 400 and styled(body)
        status, body = fetch(server, "/", host="evil.example")
        assert status == 400 and styled(body) and "Host header" in body
        status, body = fetch(server, "/no/such/page")
        assert status == 404 and styled(body)
        conn = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=10)
        conn.request("POST", "/runs/myrun/episodes", body=b"x=1")
        response = conn.getresponse()
        assert response.status == 405 and styled(response.read().decode())
        monkeypatch.setattr(type(app.runs["myrun"]), "metrics", lambda self: 1 / 0)  # a bug in the UI itself
        status, body = fetch(server, "/")
        assert status == 500 and styled(body) and "ZeroDivisionError" in body
    finally:
        server.shutdown()
        server.server_close()


def test_unknown_group_is_404_and_ids_match_exactly(app):
    status, body = get(app, "/runs/myrun/group?id=nonexistent")
    assert status == 404 and styled(body) and "no group &#39;nonexistent&#39;" in body
    assert get(app, "/runs/myrun/group?id=g")[0] == 404  # a prefix of g0..g7 matches none of them
    assert get(app, "/runs/myrun/group")[0] == 400
    status, body = get(app, "/runs/myrun/group?id=g1")
    assert status == 200 and body.count('class="card member"') == 4
    assert get(app, "/runs/myrun/episodes/plain")[0] == 404  # episode ids too


def test_port_in_use_is_one_line_with_the_fix(run_dir):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "drmas_graph.cli", "ui", str(run_dir), "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"drmas-graph: error: port {port} on 127.0.0.1 is in use (another drmas-graph "
                                   "ui?): choose another with --port PORT, or --port 0 for any free port")


def test_a_tokenizer_saved_after_the_ui_started_is_picked_up(app, run_dir):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    assert "⟨7⟩" in get(app, "/runs/myrun/episodes/plain005")[1]  # no checkpoint yet: ids
    folder = run_dir / "checkpoints" / "step_000001" / "tiny" / "model"
    folder.mkdir(parents=True)
    vocab = {"one": 1, "two": 2, "three": 3, "seven": 7, "eight": 8}  # every id of the turn (prompt, response)
    Tokenizer(WordLevel(vocab, unk_token="seven")).save(str(folder / "tokenizer.json"))
    body = get(app, "/runs/myrun/episodes/plain005")[1]
    assert "⟨7⟩" not in body and '<span class="t t9" title="id 7 · logprob -0.0100">seven</span>' in body


def test_every_metric_the_runs_page_asks_for_is_in_the_metric_reference():
    from drmas_graph.train.loop._metric_reference import is_documented
    from drmas_graph.ui._pages import FIRST_CHARTS

    unknown = [p for p in FIRST_CHARTS if not is_documented(p.replace("*", "someagent"))]
    assert [p for p in unknown if p not in METRICS_PENDING] == []


METRICS_PENDING = {"agent/*/tool_calls_per_turn", "agent/*/tool_calls_well_formed"}
"""Charts of metrics that another branch of issue 58 logs and documents (the metric reference, in train/): drop
them here once it is merged."""


# -- the answers view, charts, exports --------------------------------------------------------------------------


def write_answers_run(folder: Path) -> None:
    """Training step 0: solver replies '4' x3 (reward 1) and ' 5\\n' x1 (reward 0); step 1: '4' x4 (reward 1);
    evaluation at step 1: '4' x2 (reward 1), '6' x2 (reward 0)."""
    plan = [("train", 0, "4", 1.0)] * 3 + [("train", 0, " 5\n", 0.0)] + [("train", 1, "4", 1.0)] * 4 \
        + [("eval", 1, "4", 1.0)] * 2 + [("eval", 1, "6", 0.0)] * 2
    with TraceStore(folder / "traces.db") as store:
        for i, (phase, step, text, reward) in enumerate(plan):
            episode = Episode(id=f"a{i:02d}", task_id="t0", group_id=f"{phase}:{step}:t0",
                              turns=[make_turn("solver", 0, text=text)],
                              metadata={"phase": phase, "step": step, "group_index": i % 4})
            store.write_episode(episode)
            store.update_training(episode.id, step=step if phase == "train" else None, rewards={"solver": reward})


def test_answers_view_counts_replies_per_step_and_phase(tmp_path):
    write_answers_run(tmp_path)
    app = UiApp({"r": __import__("drmas_graph.ui._data", fromlist=["Run"]).Run("r", tmp_path)})
    rows = re.compile(r'<td class="reply-text">([^<]*)</td><td class="count">(\d+)</td>\s*<td>(\d+)%</td>'
                      r'<td class="reward">([^<]*)</td>')
    status, body = get(app, "/runs/r/answers")  # default: training, its latest step
    assert status == 200 and rows.findall(body) == [("4", "4", "100", "1")]
    assert 'data-agent="solver"' in body and "train · step 1 · 4 calls" in body
    body = get(app, "/runs/r/answers?step=0")[1]
    assert rows.findall(body) == [("4", "3", "75", "1"), ("5", "1", "25", "0")]  # ' 5\n' normalized
    assert 'href="/runs/r/episodes?phase=train&amp;agent=solver&amp;reply=5&amp;step=0"' in body
    body = get(app, "/runs/r/answers?phase=eval")[1]
    assert rows.findall(body) == [("4", "2", "50", "1"), ("6", "2", "50", "0")]
    # over steps: distinct replies 2 then 1 (a collapse), entropy H(3/4, 1/4) = 0.8113 bits then 0
    assert "train / solver: step 0, 2</title>" in body and "train / solver: step 1, 1</title>" in body
    assert "train / solver: step 0, 0.81128</title>" in body and "train / solver: step 1, 0</title>" in body
    assert "eval / solver: step 1, 1</title>" in body  # entropy of two equal replies: 1 bit
    assert get(app, "/runs/r/answers?step=7")[0] == 400 and get(app, "/runs/r/answers?phase=x")[0] == 400
    # the link finds those episodes
    listed_ids = re.findall(r'class="ep" href="/runs/r/episodes/([^"]+)"',
                            get(app, "/runs/r/episodes?phase=train&agent=solver&reply=5&step=0")[1])
    assert listed_ids == ["a03"]
    app.close()


def test_episode_list_defaults_to_training_and_searches_replies(tmp_path, app):
    write_answers_run(tmp_path)
    answers = UiApp([tmp_path])
    name = tmp_path.name
    body = get(answers, f"/runs/{name}/episodes")[1]
    assert f'<p id="count">8 train episodes' in body and "a08" not in body  # evaluation episodes: phase=eval or all
    assert '<option value="train" selected>' in body
    assert "12 episodes" in get(answers, f"/runs/{name}/episodes?phase=all")[1]
    assert "--phase train" in body  # the terminal line lists the same
    answers.close()
    assert listed(get(app, "/runs/myrun/episodes?reply=alert img")[1]) == ["xss"]
    assert 'class="who">solver</span> 4</div>' in get(app, "/runs/myrun/episodes?step=0")[1]  # the reply column


def chart(body: str, title: str) -> str:
    return body.split(f"<figcaption>{title}</figcaption>")[1].split("</figure>")[0]


def test_charts_colour_runs_style_agents_and_smooth(tmp_path):
    for name in ("a/seed", "b/seed"):
        (tmp_path / name).mkdir(parents=True)
        write_run(tmp_path / name, n_plain=2)
        with (tmp_path / name / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": 3, "agent/checker/reward_mean": 0.1}) + "\n")
    app = UiApp([tmp_path / "a/seed", tmp_path / "b/seed"])
    body = get(app, "/?run=seed-2&run=seed")[1]
    drawn = chart(body, "reward_mean per agent")
    lines = re.findall(r'<polyline class="line" points="[^"]+" fill="none" stroke="(#\w+)"( stroke-dasharray="[^"]+")?',
                       drawn)
    # a run keeps its colour whatever the order asked (seed: blue, seed-2: red); checker solid, solver dashed
    assert sorted(lines) == sorted([("#1f77b4", ' stroke-dasharray="6 3"'), ("#1f77b4", ""),
                                    ("#d62728", ' stroke-dasharray="6 3"'), ("#d62728", "")])
    assert drawn.count('class="grid"') >= 6  # gridlines at the ticks of both axes
    assert re.findall(r'class="tick x" text-anchor="middle">([^<]+)<', drawn) == ["0", "1", "2", "3"]
    # smoothing: TensorBoard's debiased EMA; solver's 0, 0.2, 0.4 at weight 0.6 -> 0, 0.08 / 0.64 = 0.125, (0.6 * 0.08 + 0.16) / (1 - 0.6 ** 3) = 0.26531
    body = get(app, "/?run=seed&smooth=0.6")[1]
    assert "seed / solver: step 1, 0.2 (smoothed 0.125)</title>" in body
    assert "seed / solver: step 2, 0.4 (smoothed 0.26531)</title>" in body
    assert 'class="raw"' in body
    # a step range, then the enlarged chart keeps it
    body = get(app, "/?run=seed&from_step=1&to_step=1")[1]
    assert "seed / solver: step 1, 0.2</title>" in body and "seed / solver: step 0" not in body
    href = re.search(r'<a class="enlarge" href="([^"]+)"', chart(body, "reward_mean per agent")).group(1)
    assert href == "/chart?metric=agent%2F%2A%2Freward_mean&amp;run=seed&amp;from_step=1&amp;to_step=1"
    status, big = get(app, href.replace("&amp;", "&"))
    assert status == 200 and 'class="chart large"' in big and "seed / solver: step 1, 0.2</title>" in big
    assert get(app, "/chart?metric=nope")[0] == 404 and get(app, "/?smooth=1.5")[0] == 400
    app.close()


def test_agents_whose_name_holds_a_slash_are_lines_of_the_per_agent_charts(tmp_path):
    """rev6_c: 'agent/team/solve/reward_mean' got a chart of its own; the run's agents (from its trace store) say
    'team/solve' is one agent, a line in 'reward_mean per agent' next to 'team'."""
    from drmas_graph.ui._data import Run
    from drmas_graph.ui._pages import ChartOptions, chart_series

    folder = tmp_path / "sub"
    folder.mkdir()
    with TraceStore(folder / "traces.db") as store:
        store.write_episode(Episode(id="e", task_id="t", turns=[make_turn("team/solve", 0), make_turn("team", 1)]))
    with (folder / "metrics.jsonl").open("w") as f:
        f.write(json.dumps({"step": 0, "agent/team/solve/reward_mean": 0.5, "agent/team/reward_mean": 0.25,
                            "eval/team/solve/reward": 1.0, "model/tiny/grad_norm": 2.0}) + "\n")
    charts = chart_series([Run("sub", folder)], {"sub": 0}, ChartOptions())
    assert sorted(charts) == ["agent/*/reward_mean", "eval/*/reward", "model/*/grad_norm"]
    assert sorted(s.label for s in charts["agent/*/reward_mean"]) == ["sub / team", "sub / team/solve"]
    assert [s.label for s in charts["eval/*/reward"]] == ["sub / team/solve"]


def test_exports_of_metrics_and_of_the_episode_list(app, run_dir):
    response = app.handle("/runs/myrun/export/metrics.json", {})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert response.status == 200 and json.loads(response.body) == records
    assert response.filename == "myrun-metrics.json"
    lines = app.handle("/runs/myrun/export/metrics.csv", {}).body.decode().splitlines()
    assert lines[0] == "step,reward/team_mean,agent/solver/reward_mean,model/tiny/grad_norm,eval/avg@k,eval/pass@k,eval/solver/reward"
    assert lines[2] == "1,0.1,0.2,0.5,,,"
    # the episode list's export: the same filters and sort, every page
    episodes = json.loads(app.handle("/runs/myrun/export/episodes.json", {"step": ["1"], "sort": ["reward"],
                                                                            "desc": ["1"]}).body)
    assert [e["id"] for e in episodes] == [f"plain{i:03d}" for i in range(19, 9, -1)]
    assert episodes[0]["replies"] == {"solver": "4", "checker": "4"} and episodes[0]["outcome"] == "finished"
    rows = app.handle("/runs/myrun/export/episodes.csv", {"task": ["t1"], "step": ["0"]}).body.decode().splitlines()
    assert [r.split(",")[0] for r in rows] == ["id", "plain001", "plain004", "plain007"]
    body = get(app, "/runs/myrun/episodes?task=t1&step=0")[1]
    assert 'id="export-csv" href="/runs/myrun/export/episodes.csv?step=0&amp;task=t1"' in body
    assert get(app, "/runs/myrun/export/traces.db")[0] == 404


def test_runs_page_shows_top_replies_as_a_table_and_links_tensorboard(app, run_dir):
    top = [{"reply": "4", "count": 3, "reward": 1.0}, {"reply": "<b>5</b>", "count": 1, "reward": 0.0}]
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "eval/avg@k": 0.5, "eval/solver/top_replies": top}) + "\n")
    (run_dir / "tensorboard").mkdir()
    body = get(app, "/")[1]
    assert "[{" not in body and "top_replies</th>" not in body  # no raw list, no column for it
    table = body.split('data-step="3" data-agent="solver">')[1].split("</table>")[0]
    assert re.findall(r'<td class="reply-text">([^<]*)</td><td>(\d+)</td><td>([^<]*)</td>', table) == \
        [("4", "3", "1"), ("&lt;b&gt;5&lt;/b&gt;", "1", "0")]
    # the command to run (a browser refuses a file:// link from an http:// page), shell-quoted
    assert "file://" not in body and "tensorboard/</a>" not in body
    assert f'<code class="tensorboard" title="run this in a terminal, then open the address it prints">' \
           f"tensorboard --logdir {shlex.quote(str(run_dir / 'tensorboard'))}</code>" in body


def test_group_page_shows_rewards_stats_and_the_judges_attempts_in_its_order(app, run_dir):
    """Written out of order (group_index 2, 0, 3, 1), judged in group mode: the page lists them as the judge saw
    them, with attempt_N and the reason, each turn's reward, and each agent's mean and std."""
    solver_rewards = {2: 1.0, 0: 0.0, 3: 1.0, 1: 0.0}
    with TraceStore(run_dir / "traces.db") as store:
        for place, reward in solver_rewards.items():
            episode = Episode(id=f"j{place}", task_id="t9", group_id="train:5:t9",
                              turns=[make_turn("solver", 0), make_turn("solver", 1), make_turn("checker", 2)],
                              metadata={"phase": "train", "step": 5, "group_index": place},
                              judgement={"mode": "group", "index": place, "group_size": 4, "scores": reward,
                                         "reasons": f"reason <{place}>", "replies": [], "prompt": []})
            store.write_episode(episode)
            penalty = 0.5 if place == 0 else 0.0  # episode 0's first solver call was invalid
            store.update_training(episode.id, step=5, rewards={"solver": reward, "checker": 1.0},
                                  turn_rewards=[reward - penalty, reward, 1.0], advantages=[0.1, 0.2, 0.0])
    status, body = get(app, "/runs/myrun/group?id=train:5:t9")
    assert status == 200
    assert re.findall(r'class="card member" data-id="(\w+)"', body) == ["j0", "j1", "j2", "j3"]
    assert re.findall(r'class="badge attempt">([^<]+)<', body) == ["attempt_1", "attempt_2", "attempt_3", "attempt_4"]
    assert re.findall(r'class="reason">([^<]+)<', body)[:2] == ["reason &lt;0&gt;", "reason &lt;1&gt;"]
    assert re.findall(r'class="turn-reward">([^<]+)<', body)[:6] == ["-0.5", "0", "1", "0", "0", "1"]
    stats = dict(re.findall(r'<tr data-agent="(\w+)">(.*?)</tr>', body, re.S))
    cells = lambda agent: re.findall(r"<td[^>]*>([^<]*)</td>", stats[agent])  # noqa: E731
    # solver: episode rewards 0, 0, 1, 1 -> mean 0.5, std sqrt(4 * 0.25 / 3) = 0.5774; its 8 calls' turn rewards
    # -0.5, 0, 0, 0, 1, 1, 1, 1 -> mean 0.4375, std 0.6232
    assert cells("solver") == ["solver", "4", "0.5", "0.5774", "8", "0.4375", "0.6232"]
    assert cells("checker") == ["checker", "4", "1", "0", "4", "1", "0"]
    assert "4 episodes of task t9, in the order the judge saw them (their place in the group):" in body


def test_the_group_page_names_a_judge_only_where_one_ran(app):
    """write_run's group g0 (no judge, no group_index) said 'in the order the judge saw them'."""
    body = get(app, "/runs/myrun/group?id=g0")[1]
    assert "4 episodes of task t0, in the order they were written:" in body and "judge" not in body
