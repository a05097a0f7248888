"""Search environment: questions over the generated fictional corpus, exact-match reward, format checks.

Plain Python with the same duck-typed interface as ``MathEnv`` (``tasks``, ``reward``, ``turn_is_valid``,
``invalid_penalty``, ``agents``); it does not import ``drmas_graph``. Difficulty level = hops - 1.
"""

from __future__ import annotations

import random
import re
import string
from typing import Any, Mapping

from graphs.search.corpus import Corpus, generate_corpus
from graphs.search.graph import parse_answer, parse_decision, parse_query
from graphs.search.retriever import Retriever
from graphs.task import Task, split_counts, stable_id

__all__ = ["SearchEnv", "normalize_answer"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD-style: lowercase, drop punctuation and the articles a/an/the, collapse whitespace."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())


class SearchEnv:
    """Seeded questions about a generated knowledge base, with disjoint train/test splits.

    Args:
        seed: seeds both the corpus and the question split; the same seed gives identical tasks.
        n_train: tasks in the ``"train"`` split.
        n_test: tasks in the ``"test"`` split (no question text appears in both splits).
        difficulty: weights of 1-, 2- and 3-hop questions (levels 0, 1, 2) in both splits.
    """

    agents: tuple[str, ...] = ("router", "searcher", "answerer")
    """The graph's node names that call a model, i.e. the agents to train."""
    invalid_penalty: float = 0.01
    """The paper's c for search: a turn that breaks its reply format gets ``R_episode - c``."""

    def __init__(self, *, seed: int = 0, n_train: int = 128, n_test: int = 32,
                 difficulty: tuple[float, ...] = (0.5, 0.3, 0.2)) -> None:
        if len(difficulty) > 3:
            raise ValueError(f"difficulty has {len(difficulty)} weights but questions have 1 to 3 hops "
                             "(levels 0..2)")
        self.seed = seed
        self.difficulty = tuple(difficulty)
        self.corpus: Corpus = generate_corpus(seed)
        """The knowledge base the questions are about."""
        self.retriever = Retriever(self.corpus.docs)
        """A BM25 index over ``corpus.docs``; pass it to ``graphs.search.graph.build_graph``."""
        test_n = split_counts(n_test, self.difficulty)
        train_n = split_counts(n_train, self.difficulty)
        splits: dict[str, list[Task]] = {"train": [], "test": []}
        for level, (n_te, n_tr) in enumerate(zip(test_n, train_n)):
            pool = [q for q in self.corpus.questions if q.hops == level + 1]
            if n_te + n_tr > len(pool):
                raise ValueError(f"level {level} ({level + 1}-hop) has {len(pool)} questions but n_train + "
                                 f"n_test asks for {n_te + n_tr}; lower n_train/n_test or that level's weight")
            random.Random(f"{seed}-hops-{level + 1}").shuffle(pool)
            for split, chunk in (("test", pool[:n_te]), ("train", pool[n_te:n_te + n_tr])):
                splits[split].extend(
                    Task(id=stable_id(f"search-L{level}", q.question), input={"question": q.question},
                         answer=q.answer,
                         meta={"level": level, "kind": q.kind, "split": split, "hops": q.hops,
                               "aliases": list(q.aliases), "gold_doc_ids": list(q.gold_doc_ids)})
                    for q in chunk)
        for split, tasks in splits.items():
            random.Random(f"{seed}-{split}-order").shuffle(tasks)
        self._splits = splits

    def tasks(self, split: str) -> list[Task]:
        """The tasks of ``split`` (``"train"`` or ``"test"``), in a fixed seeded order."""
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}; valid splits: {sorted(self._splits)}")
        return list(self._splits[split])

    def score(self, task: Task, final_state: Mapping[str, Any]) -> float:
        """1.0 if the final ``answer`` matches the gold answer or an alias after ``normalize_answer``."""
        got = final_state.get("answer")
        if got is None:
            return 0.0
        gold = {normalize_answer(a) for a in (task.answer, *task.meta.get("aliases", ()))}
        return 1.0 if normalize_answer(str(got)) in gold else 0.0

    def reply_is_valid(self, agent: str, text: str) -> bool:
        """Format check of one reply with the graph's parsers (router: Yes/No, searcher: a one-line query,
        answerer: "The answer is X"); True if the parser reads it."""
        checks = {"router": parse_decision, "searcher": parse_query, "answerer": parse_answer}
        if agent not in checks:
            raise ValueError(f"unknown agent {agent!r}; the search graph's agents are {list(self.agents)}")
        return checks[agent](text) is not None

    # -- the trainer's Env protocol (duck-typed: this module does not import drmas_graph) ------------------
    def reward(self, task: Task, episode: Any) -> float:
        """Team reward of a finished episode: `score` of its final state."""
        return self.score(task, episode.final_state)

    def turn_is_valid(self, task: Task, turn: Any) -> bool:
        """Format check of one recorded LLM call (the trainer subtracts `invalid_penalty` when False)."""
        return self.reply_is_valid(turn.agent, turn.response_text)
