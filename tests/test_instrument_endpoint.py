"""Issue 47 item 2: the run-scoped local endpoint. A node starts a subprocess (another program) with its
endpoint URL; the subprocess's OpenAI and Anthropic requests become turns of the right episode and agent,
with the seeds, limits and recording of in-process calls."""

import json
import subprocess
import sys
import urllib.error
import urllib.request
from typing import TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

from drmas_graph import instrument, llm_base_url, llm_env
from drmas_graph.errors import ConfigError
from drmas_graph.testing import scripted_policy

CHILD = r"""
import json, os, sys, urllib.request
base = os.environ["OPENAI_BASE_URL"]
def post(url, body, headers={}):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())
chat = post(base + "/chat/completions", {"model": "m", "messages": [{"role": "user", "content": sys.argv[1]}]})
critic = post(base + "/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "judge it"}]},
              {"X-Drmas-Agent": "critic"})
claude = post(os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages",
              {"model": "c", "max_tokens": 9, "messages": [{"role": "user", "content": "again"}]})
print(json.dumps([chat["choices"][0]["message"]["content"], critic["choices"][0]["message"]["content"],
                  claude["content"][0]["text"], chat["usage"]["completion_tokens"]]))
"""


class S(TypedDict, total=False):
    q: str
    out: object


def subprocess_graph(seen_urls):
    def worker(state):
        env = llm_env()
        seen_urls.append(env["OPENAI_BASE_URL"])
        done = subprocess.run([sys.executable, "-c", CHILD, state["q"]], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return {"out": json.loads(done.stdout)}

    g = StateGraph(S)
    g.add_node("worker", worker)
    g.add_edge(START, "worker")
    g.add_edge("worker", END)
    return g.compile()


def test_a_subprocess_calls_become_turns_of_the_episode_and_agent():
    urls = []
    worker, critic = scripted_policy(["first", "third"], name="w"), scripted_policy(["second"], name="c", seed=1)
    app = instrument(subprocess_graph(urls), {"worker": worker, "critic": critic}, strict=True)
    episode = app.rollout({"q": "hello"}, metadata={"seed": 3})
    answer = episode.final_state["out"]
    assert answer[:3] == ["first", "second", "third"]
    assert [(t.agent, t.node, t.policy, t.trainable) for t in episode.turns] == [
        ("worker", "worker", "w", True), ("critic", "worker", "c", True), ("worker", "worker", "w", True)]
    first = episode.turns[0]
    assert answer[3] == len(first.response_ids) and len(first.response_logprobs) == len(first.response_ids)
    assert worker.tokenizer.decode(list(first.prompt_ids)).count("hello") == 1
    assert episode.turns[2].sampling.max_new_tokens == 9
    assert first.sampling.seed is not None  # seeded from the episode's seed like an in-process call
    # the URL stands for that episode only: afterwards it is gone
    request = urllib.request.Request(urls[0] + "/chat/completions", data=json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "late"}]}).encode(),
        headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 410 and "its episode ended" in json.loads(info.value.read())["error"]["message"]
    worker.close()
    critic.close()


def test_each_episode_gets_its_own_url_and_the_same_seeds_as_in_process():
    urls = []
    policy = scripted_policy(["a", "b", "c"])
    app = instrument(subprocess_graph(urls), {"worker": policy, "critic": policy})
    one = app.rollout({"q": "x"}, metadata={"seed": 5})
    two = app.rollout({"q": "x"}, metadata={"seed": 5})
    assert urls[0] != urls[1]
    assert [t.sampling.seed for t in one.turns] == [t.sampling.seed for t in two.turns]
    assert len(set(t.sampling.seed for t in one.turns)) == 3
    policy.close()


def test_outside_a_run_there_is_no_url():
    with pytest.raises(ConfigError, match=r"llm_base_url\(\) was called outside an instrumented run"):
        llm_base_url()
