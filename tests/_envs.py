"""A toy environment for trainer tests: the reward depends on the sampled tokens, so groups have variance."""

from drmas_graph.env import Task


class ParityEnv:
    """Team reward 1 when the solver's first response token id is even; per-turn validity: verifier
    responses must be shorter than 8 tokens. Tasks whose id is in `bad_reward` get NaN; `raise_on` inputs
    make the graph raise (see tests._graphs.solver_verifier + `boom` questions)."""

    invalid_penalty = 0.1

    def __init__(self, n_train=6, n_test=4, bad_reward=(), per_agent=False):
        self.train = [Task(id=f"train-{i}", input={"question": f"What is {i} + {i}?"}) for i in range(n_train)]
        self.test = [Task(id=f"test-{i}", input={"question": f"What is {i} * 2?"}) for i in range(n_test)]
        self.bad_reward = set(bad_reward)
        self.per_agent = per_agent

    def tasks(self, split):
        return {"train": self.train, "test": self.test}[split]

    def reward(self, task, episode):
        if task.id in self.bad_reward:
            return float("nan")
        solver = next(t for t in episode.turns if t.agent == "solver")
        team = 1.0 if solver.response_ids[0] % 2 == 0 else 0.0
        if self.per_agent:
            return {a: team if a == "solver" else 1.0 - team for a in episode.agents}
        return team

    def turn_is_valid(self, task, turn):
        return turn.agent != "verifier" or len(turn.response_ids) < 8


class JudgeError(RuntimeError):
    """Stands in for `drmas_graph.rewards.JudgeError` (the trainer recognises a JudgeError by its class)."""


def solver_chars(episode):
    """Characters of the solver's reply: what `RankingEnv` ranks by."""
    return len(next(t for t in episode.turns if t.agent == "solver").response_text)


class RankingEnv(ParityEnv):
    """A group reward, as a judge that compares a group's trajectories gives: `reward_group` scores each episode
    by the share of the other episodes of its group whose solver reply is shorter (characters), and records
    every call (task id, episodes, thread name). The episode at `fail_index` of a group whose task is in
    `fail_tasks` gets a `JudgeError` item; a task in `wrong_length` gets one item too few; `raise_on` tasks make
    the call raise `raises`. `reward` is never called. `reward_metrics`: judge/calls and judge/input_tokens (the
    solver reply characters it read) since the last call."""

    def __init__(self, fail_tasks=(), fail_index=1, wrong_length=(), raise_on=(), raises="ValueError", **kw):
        import threading

        super().__init__(**kw)
        self.fail_tasks, self.fail_index = set(fail_tasks), fail_index
        self.wrong_length, self.raise_on, self.raises = set(wrong_length), set(raise_on), raises
        self.calls = []
        self._lock = threading.Lock()
        self._counters = {"judge/calls": 0, "judge/input_tokens": 0}

    def reward(self, task, episode):
        raise AssertionError("reward_group replaces reward")

    def reward_group(self, task, episodes):
        import threading

        chars = [solver_chars(ep) for ep in episodes]
        with self._lock:
            self.calls.append((task.id, list(episodes), threading.current_thread().name))
            self._counters["judge/calls"] += 1
            self._counters["judge/input_tokens"] += sum(chars)
        if task.id in self.raise_on:
            raise {"ValueError": ValueError, "JudgeError": JudgeError}[self.raises](f"the judge broke on {task.id}")
        out = []
        for i, episode in enumerate(episodes):
            episode.judgement = {"mode": "group", "index": i, "chars": chars}
            if task.id in self.fail_tasks and i == self.fail_index:
                out.append(JudgeError(f"no usable score for episode {i} after 3 attempts (last reply: 'maybe')"))
            else:
                out.append(sum(c < chars[i] for c in chars) / max(len(chars) - 1, 1))
        return out[:-1] if task.id in self.wrong_length else out

    def reward_metrics(self):
        with self._lock:
            out, self._counters = self._counters, {"judge/calls": 0, "judge/input_tokens": 0}
        return out
