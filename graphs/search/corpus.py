"""A generated knowledge base of fictional towns, people, companies and inventions, with questions.

Every name is built from invented syllables by a seeded ``random.Random`` and every fact is drawn at
random, so no model can answer from memory: it has to retrieve. Each entity has one short document whose
title is its name; its name appears twice there (title and text) and once in each document that refers
to it, so querying a name ranks its own document first.

Questions (``Question.hops`` = documents needed; ``Question.kind`` names the template):
    1 hop: "In which town was <person> born?", "Which river flows through <town>?",
           "Who founded <company>?", "In which year was <company> founded?", "Who invented the <invention>?"
    2 hops: "In which town was the founder of <company> born?", "... the inventor of the <invention> born?",
            "Which river flows through the birthplace of <person>?"
    3 hops: "Which river flows through the birthplace of the founder of <company>?" (and of the inventor)
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Corpus", "Doc", "Question", "generate_corpus"]

_SYLLABLES = ("ka", "lo", "mir", "ven", "tal", "dor", "sel", "bri", "tha", "os", "rel", "quen", "zar",
              "mel", "vor", "ith", "ul", "nar", "pes", "gil", "fen", "dra", "wick", "ob", "yan", "tor",
              "ciel", "mun", "hal", "esk", "rav", "ond", "lis", "pra", "gor", "sith")
_OCCUPATIONS = ("painter", "engineer", "chemist", "sailor", "teacher", "architect", "weaver", "clockmaker")
_PRODUCTS = ("lanterns", "rope", "glassware", "clocks", "paper", "bicycles", "ink", "bells")
_COMPANY_SUFFIXES = ("Works", "Company", "Foundry", "Guild", "Mills")
_DEVICES = ("lamp", "loom", "pump", "press", "compass", "kettle", "engine", "lens")


@dataclass(frozen=True)
class Doc:
    """One document of the knowledge base."""

    id: str
    """Unique id, ``"<kind>-<index>"``, e.g. ``"person-3"``."""
    title: str
    """The entity's name."""
    text: str
    """One or two sentences that state the entity's facts and mention its name."""


@dataclass(frozen=True)
class Question:
    """A question about the knowledge base with its gold answer and the documents that support it."""

    question: str
    """The question text."""
    answer: str
    """The gold answer."""
    aliases: tuple[str, ...]
    """Other accepted spellings of the answer (e.g. ``"Ostrel river"`` for ``"Ostrel"``)."""
    gold_doc_ids: tuple[str, ...]
    """Ids of the documents needed, in the order a reader would follow them."""
    hops: int
    """How many documents must be read (1, 2 or 3)."""
    kind: str
    """The question template's name, e.g. ``"founder_river"``."""


@dataclass(frozen=True)
class Corpus:
    """The generated documents and every question they support."""

    docs: tuple[Doc, ...]
    """All documents, towns first, then people, companies and inventions."""
    questions: tuple[Question, ...]
    """Every question the templates can ask about ``docs``, in a fixed order."""

    def doc(self, doc_id: str) -> Doc:
        """The document with id ``doc_id`` (``KeyError`` naming the id if there is none)."""
        for doc in self.docs:
            if doc.id == doc_id:
                return doc
        raise KeyError(f"no document with id {doc_id!r} in the corpus")


class _Names:
    """Invented words, each used once in the whole corpus (so a name's tokens identify one entity)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._used: set[str] = set()

    def word(self, syllables: int) -> str:
        while True:
            word = "".join(self._rng.choice(_SYLLABLES) for _ in range(syllables))
            if word not in self._used and len(word) >= 4:
                self._used.add(word)
                return word.capitalize()


def generate_corpus(seed: int = 0, *, n_towns: int = 20, n_people: int = 60, n_companies: int = 40,
                    n_inventions: int = 30) -> Corpus:
    """Generate the knowledge base and its questions; the same arguments give an identical corpus."""
    if min(n_towns, n_people, n_companies, n_inventions) < 1:
        raise ValueError("every entity count must be >= 1, got "
                         f"{n_towns=}, {n_people=}, {n_companies=}, {n_inventions=}")
    rng = random.Random(f"search-corpus-{seed}")
    names = _Names(rng)
    rivers = [names.word(2) for _ in range(max(2, n_towns // 2))]

    towns = [{"id": f"town-{i}", "name": names.word(rng.choice((2, 3))), "river": rng.choice(rivers),
              "year": rng.randint(1200, 1800)} for i in range(n_towns)]
    people = []
    for i in range(n_people):
        people.append({"id": f"person-{i}", "name": f"{names.word(2)} {names.word(3)}",
                       "town": rng.choice(towns), "year": rng.randint(1800, 1950),
                       "job": rng.choice(_OCCUPATIONS)})
    companies = []
    for i in range(n_companies):
        founder = rng.choice(people)
        companies.append({"id": f"company-{i}",
                          "name": f"{names.word(rng.choice((2, 3)))} {rng.choice(_COMPANY_SUFFIXES)}",
                          "founder": founder, "year": founder["year"] + rng.randint(20, 60),
                          "product": rng.choice(_PRODUCTS)})
    inventions = []
    for i in range(n_inventions):
        inventor = rng.choice(people)
        inventions.append({"id": f"invention-{i}",
                           "name": f"{names.word(2).lower()} {rng.choice(_DEVICES)}",
                           "inventor": inventor, "year": inventor["year"] + rng.randint(20, 60)})

    docs = [Doc(t["id"], t["name"], f"{t['name']} is a town on the river {t['river']}. "
                                    f"It was founded in {t['year']}.") for t in towns]
    docs += [Doc(p["id"], p["name"], f"{p['name']} is {_article(p['job'])} {p['job']} who was born in "
                                     f"{p['town']['name']} in {p['year']}.") for p in people]
    docs += [Doc(c["id"], c["name"], f"{c['name']} is a company founded by {c['founder']['name']} in "
                                     f"{c['year']}. It makes {c['product']}.") for c in companies]
    docs += [Doc(v["id"], v["name"], f"The {v['name']} is a device invented by {v['inventor']['name']} "
                                     f"in {v['year']}.") for v in inventions]
    return Corpus(docs=tuple(docs), questions=tuple(_questions(towns, people, companies, inventions)))


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _river(town: dict) -> tuple[str, tuple[str, ...]]:
    river = town["river"]
    return river, (f"{river} river", f"river {river}")


def _questions(towns: list[dict], people: list[dict], companies: list[dict],
               inventions: list[dict]) -> list[Question]:
    qs: list[Question] = []
    for p in people:
        t = p["town"]
        qs.append(Question(f"In which town was {p['name']} born?", t["name"], (), (p["id"],), 1, "birthplace"))
        qs.append(Question(f"Which river flows through the birthplace of {p['name']}?", *_river(t),
                           (p["id"], t["id"]), 2, "person_river"))
    for t in towns:
        qs.append(Question(f"Which river flows through {t['name']}?", *_river(t), (t["id"],), 1, "river"))
    for c in companies:
        f, t = c["founder"], c["founder"]["town"]
        qs.append(Question(f"Who founded {c['name']}?", f["name"], (), (c["id"],), 1, "founder"))
        qs.append(Question(f"In which year was {c['name']} founded?", str(c["year"]), (), (c["id"],), 1,
                           "company_year"))
        qs.append(Question(f"In which town was the founder of {c['name']} born?", t["name"], (),
                           (c["id"], f["id"]), 2, "founder_birthplace"))
        qs.append(Question(f"Which river flows through the birthplace of the founder of {c['name']}?",
                           *_river(t), (c["id"], f["id"], t["id"]), 3, "founder_river"))
    for v in inventions:
        f, t = v["inventor"], v["inventor"]["town"]
        qs.append(Question(f"Who invented the {v['name']}?", f["name"], (), (v["id"],), 1, "inventor"))
        qs.append(Question(f"In which town was the inventor of the {v['name']} born?", t["name"], (),
                           (v["id"], f["id"]), 2, "inventor_birthplace"))
        qs.append(Question(f"Which river flows through the birthplace of the inventor of the {v['name']}?",
                           *_river(t), (v["id"], f["id"], t["id"]), 3, "inventor_river"))
    return qs
