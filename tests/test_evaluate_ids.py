"""evaluate() counts avg@k and pass@k per task id, so a split with one id twice is refused, naming it (rev5_i)."""

from types import SimpleNamespace

import pytest

from drmas_graph import Task
from drmas_graph.errors import ConfigError
from drmas_graph.train.loop.evaluate import evaluate


class Env:
    def tasks(self, split):
        return [Task(id="q", input={"question": "1 + 1?"}, answer="2"),
                Task(id="r", input={"question": "2 + 2?"}, answer="4"),
                Task(id="q", input={"question": "1 + 1?"}, answer="2")]


def test_a_split_with_a_repeated_task_id_is_refused_before_any_rollout():
    def no_rollouts(*args, **kwargs):
        raise AssertionError("refused before any rollout")

    state = SimpleNamespace(cfg=SimpleNamespace(eval=SimpleNamespace(split="test", n_tasks=None)), env=Env(),
                            roll_out=no_rollouts)
    with pytest.raises(ConfigError, match=r"task id 'q' more than once \(again at position 2\)"):
        evaluate(SimpleNamespace(state=state), step=0)  # a trainer: its run state
