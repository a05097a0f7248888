"""Replay of calls made through the run's local endpoint (found by the property suite's client dimension): where
the replay stops (the recording ends where `max_llm_calls` stopped it, or at a divergence in stop mode), the
endpoint answers the stop as an HTTP 500 and the app's client raises its own error; the replay must still
end as stopped, not report the client's error as a changed outcome."""

from typing import TypedDict

import openai
import pytest
from langgraph.graph import END, START, StateGraph

from drmas_graph import RolloutError, TraceStore, instrument, llm_base_url
from drmas_graph.testing import scripted_policy
from drmas_graph.traces.replay import replay


class S(TypedDict, total=False):
    q: str
    out: list


def endpoint_graph():
    def writer(state):
        sdk = openai.OpenAI(base_url=llm_base_url(), api_key="drmas-local", max_retries=0, timeout=30)
        out = []
        for k in range(2):
            reply = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": f"part {k}"}])
            out.append(reply.choices[0].message.content)
        return {"out": out}

    return StateGraph(S).add_node("writer", writer).add_edge(START, "writer").add_edge("writer", END).compile()


def test_a_capped_recording_of_endpoint_calls_replays_to_the_cap(tmp_path):
    policy = scripted_policy(["first", "second"])
    with TraceStore(tmp_path / "traces.db") as store:
        app = instrument(endpoint_graph(), {"writer": policy}, store=store)
        with pytest.raises(RolloutError) as stopped:  # a capped rollout raises, its episode kept and stored
            app.rollout({"q": "x"}, metadata={"max_llm_calls": 1})
        episode = stopped.value.episode
        assert (episode.outcome, episode.truncated_by, len(episode.turns)) == ("truncated", "max_llm_calls", 1)
        assert episode.turns[0].response_text == "first"
        result = replay(endpoint_graph(), store, episode.id)
    # before: outcome_changed at agent '' (InternalServerError: Error code: 500 - _StopReplay: the recording ends
    # here, where a limit stopped it), stopped False
    assert result.divergences == [] and result.stopped and result.state_matches, result
    policy.close()
