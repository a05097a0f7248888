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
