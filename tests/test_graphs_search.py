"""The search example app (graphs/search): the generated corpus, BM25 retrieval, the router/searcher/answerer
graph with scripted chat models, the parsers, and the environment's splits, reward and format check."""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from pydantic import Field

from graphs.search.corpus import Corpus, generate_corpus
from graphs.search.env import SearchEnv, normalize_answer
from graphs.search.graph import (ANSWERER_PROMPT, ROUTER_PROMPT, SEARCHER_PROMPT, build_graph, parse_answer,
                                 parse_decision, parse_query)
from graphs.search.retriever import Retriever
from graphs.task import Task


@pytest.fixture(scope="module")
def env() -> SearchEnv:
    return SearchEnv(seed=0)


@pytest.fixture(scope="module")
def corpus(env) -> Corpus:
    return env.corpus


@pytest.fixture(scope="module")
def retriever(env) -> Retriever:
    return env.retriever


class ScriptedChat(BaseChatModel):
    """A chat model whose reply is ``respond(agent, user_text)``; the agent is read off the system prompt."""

    respond: Callable[[str, str], str]
    calls: list[tuple[str, str]] = Field(default_factory=list)
    """(agent, user message) of every call, in order."""

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        assert isinstance(messages[0], SystemMessage) and len(messages) == 2
        prompts = {ROUTER_PROMPT: "router", SEARCHER_PROMPT: "searcher", ANSWERER_PROMPT: "answerer"}
        agent = prompts[messages[0].content]
        self.calls.append((agent, messages[1].content))
        reply = self.respond(agent, messages[1].content)
        return ChatResult(generations=[ChatGeneration(message=AIMessage(reply))])


def scripted(**scripts: list[str]) -> ScriptedChat:
    """Replies taken in order from per-agent scripts: ``scripted(router=[...], searcher=[...], ...)``."""
    queues = {agent: iter(replies) for agent, replies in scripts.items()}
    return ScriptedChat(respond=lambda agent, _user: next(queues[agent]))


def agents(state: dict) -> list[str]:
    return [turn["agent"] for turn in state["transcript"]]


def ids(docs: list) -> list[str]:
    return [d["id"] if isinstance(d, dict) else d.id for d in docs]


# --- corpus -----------------------------------------------------------------------------------------


def test_corpus_is_deterministic_per_seed(corpus):
    assert generate_corpus(0) == corpus
    other = generate_corpus(1)
    assert [d.text for d in other.docs] != [d.text for d in corpus.docs]
    assert [q.question for q in other.questions] != [q.question for q in corpus.questions]


def test_corpus_ids_unique_and_names_unique(corpus):
    assert len({d.id for d in corpus.docs}) == len(corpus.docs) == 20 + 60 + 40 + 30
    assert len({d.title for d in corpus.docs}) == len(corpus.docs)
    assert len({q.question for q in corpus.questions}) == len(corpus.questions)
    assert corpus.doc("person-3").id == "person-3"
    with pytest.raises(KeyError, match="nope"):
        corpus.doc("nope")


def test_every_question_follows_its_gold_chain(corpus):
    """Hop i+1's document is named in hop i's text; the last hop's text holds the answer."""
    for q in corpus.questions:
        chain = [corpus.doc(i) for i in q.gold_doc_ids]
        assert len(chain) == q.hops
        assert chain[0].title in q.question, q
        for prev, nxt in zip(chain, chain[1:]):
            assert nxt.title in prev.text, q
        assert q.answer in chain[-1].text, q


def test_question_kinds_and_hops(corpus):
    hops = {q.kind: q.hops for q in corpus.questions}
    assert hops == {"birthplace": 1, "river": 1, "founder": 1, "company_year": 1, "inventor": 1,
                    "person_river": 2, "founder_birthplace": 2, "inventor_birthplace": 2,
                    "founder_river": 3, "inventor_river": 3}
    q = next(q for q in corpus.questions if q.kind == "founder_river")
    assert re.fullmatch(r"Which river flows through the birthplace of the founder of .+\?", q.question)
    assert q.aliases == (f"{q.answer} river", f"river {q.answer}")


# --- retriever --------------------------------------------------------------------------------------


def test_querying_an_entity_name_ranks_its_document_first(corpus, retriever):
    for doc in corpus.docs:
        assert retriever.search(doc.title, k=3)[0].id == doc.id, doc


def test_multi_hop_gold_documents_are_reachable(corpus, retriever):
    """The question finds hop 1 in the top 3; each next hop is top-1 for a name read in the previous doc."""
    for q in (q for q in corpus.questions if q.hops > 1):
        assert q.gold_doc_ids[0] in ids(retriever.search(q.question, k=3)), q
        for nxt in q.gold_doc_ids[1:]:
            assert retriever.search(corpus.doc(nxt).title, k=3)[0].id == nxt


def test_search_returns_at_most_k_matching_docs(corpus, retriever):
    town = corpus.docs[0]
    hits = retriever.search(town.title, k=5)
    assert 1 < len(hits) <= 5 and all(town.title in d.text for d in hits)
    assert retriever.search("zzyzx qwerty") == [] and retriever.search("the of and") == []
    with pytest.raises(ValueError, match="k must be"):
        retriever.search("x", k=0)


def test_search_tool(corpus, retriever):
    search = retriever.as_tool()
    doc = corpus.doc("company-2")
    results = search.invoke({"query": doc.title})
    assert search.name == "search" and len(results) == 3
    assert results[0] == {"id": doc.id, "title": doc.title, "text": doc.text}


def test_retriever_rejects_duplicate_ids(corpus):
    with pytest.raises(ValueError, match="repeated: \\['town-0'\\]"):
        Retriever([corpus.docs[0], corpus.docs[0]])


# --- graph ------------------------------------------------------------------------------------------


def test_nodes(retriever):
    graph = build_graph(scripted(), retriever)
    assert set(graph.nodes) - {"__start__"} == {"router", "searcher", "answerer"}


def test_router_searcher_router_answerer(corpus, retriever):
    company = corpus.doc("company-0")
    llm = scripted(router=["search", "answer"], searcher=[f"Query: {company.title}"],
                   answerer=["Answer: someone"])
    state = build_graph(llm, retriever).invoke({"question": "Who founded it?"})
    assert agents(state) == ["router", "searcher", "router", "answerer"]
    assert state["queries"] == [company.title] and state["searches"] == 1
    assert ids(state["evidence"]) == ids(retriever.search(company.title, k=3))
    assert state["evidence"][0]["text"] == company.text
    assert state["answer"] == "someone" and state["decision"] == "answer"
    # The second router turn and the answerer see the evidence; the first router turn saw none.
    assert llm.calls[0] == ("router", "Question: Who founded it?\nFacts:\n(none yet)")
    assert f"\n- {company.text}" in llm.calls[2][1] and f"\n- {company.text}" in llm.calls[3][1]


def test_three_hop_question_solved_end_to_end(env, corpus):
    """A scripted policy that queries the right names reaches all gold docs and earns reward 1."""
    task = next(t for t in env.tasks("train") if t.meta["kind"] == "founder_river")
    titles = [corpus.doc(i).title for i in task.meta["gold_doc_ids"]]
    llm = scripted(router=["No.", "No, not yet", "No", "Yes, they do."], searcher=titles,
                   answerer=[f"The answer is the {task.answer} River. It flows north."])
    state = build_graph(llm, env.retriever).invoke(task.input)
    assert agents(state) == ["router", "searcher"] * 3 + ["router", "answerer"]
    assert set(task.meta["gold_doc_ids"]) <= set(ids(state["evidence"]))
    assert "Queries so far: " + "; ".join(titles[:2]) in llm.calls[-3][1]  # the third searcher prompt
    assert env.score(task, state) == 1.0


def test_max_steps_caps_searches_then_answers(corpus, retriever):
    llm = scripted(router=["search"] * 10, searcher=[f"Query: {d.title}" for d in corpus.docs[:10]],
                   answerer=["Answer: x"])
    state = build_graph(llm, retriever, max_steps=3).invoke({"question": "q"})
    assert agents(state) == ["router", "searcher"] * 3 + ["answerer"]
    assert state["searches"] == 3 and len(state["queries"]) == 3 and state["answer"] == "x"


def test_evidence_keeps_each_document_once(corpus, retriever):
    title = corpus.docs[5].title
    llm = scripted(router=["search", "search", "answer"], searcher=[f"Query: {title}"] * 2,
                   answerer=["Answer: x"])
    state = build_graph(llm, retriever).invoke({"question": "q"})
    assert state["queries"] == [title, title]
    assert ids(state["evidence"]) == ids(retriever.search(title, k=3))


def test_unreadable_router_searches_and_unreadable_query_uses_the_question(corpus, retriever):
    question = f"In which town was {corpus.doc('person-4').title} born?"
    ramble = "To find where this person was born,\nwe should look at the records."
    llm = scripted(router=["hmm, not sure", "answer"], searcher=[ramble], answerer=["no idea"])
    state = build_graph(llm, retriever).invoke({"question": question})
    assert agents(state) == ["router", "searcher", "router", "answerer"]
    assert state["queries"] == [question] and ids(state["evidence"])[0] == "person-4"
    assert state["answer"] is None


def test_any_chat_model_works_generic_fake(corpus, retriever):
    replies = ["answer", "Answer: Nowhere"]
    llm = GenericFakeChatModel(messages=iter([AIMessage(r) for r in replies]))
    state = build_graph(llm, retriever).invoke({"question": "q"})
    assert state["answer"] == "Nowhere" and state.get("evidence", []) == []


def test_any_search_tool_works():
    @tool("search")
    def fake_search(query: str) -> list[dict]:
        """Return one made-up document echoing the query."""
        return [{"id": f"doc-{query}", "title": query, "text": f"All about {query}."}]

    llm = scripted(router=["search", "answer"], searcher=["Query: kettles"], answerer=["Answer: y"])
    state = build_graph(llm, fake_search).invoke({"question": "q"})
    assert state["evidence"] == [{"id": "doc-kettles", "title": "kettles", "text": "All about kettles."}]


def test_model_calls_carry_the_node_name_in_run_metadata(corpus, retriever):
    class Nodes(BaseCallbackHandler):
        def __init__(self) -> None:
            self.seen: list[str] = []

        def on_chat_model_start(self, serialized, messages, *, metadata=None, **kwargs):
            self.seen.append(metadata["langgraph_node"])

    handler = Nodes()
    llm = scripted(router=["search", "answer"], searcher=["Query: x"], answerer=["Answer: y"])
    build_graph(llm, retriever).invoke({"question": "q"}, {"callbacks": [handler]})
    assert handler.seen == ["router", "searcher", "router", "answerer"]


def test_bad_arguments_fail_at_build_time(retriever):
    with pytest.raises(ValueError, match="max_steps"):
        build_graph(scripted(), retriever, max_steps=0)

    @tool("lookup")
    def lookup(query: str) -> list[dict]:
        """Wrongly named."""
        return []

    with pytest.raises(ValueError, match="named 'search', got 'lookup'"):
        build_graph(scripted(), lookup)


# --- parsers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("Yes.", "answer"), ("No, the facts do not say.", "search"), ("**No**", "search"),
    ("search", "search"), ("Answer.", "answer"), ("Decision: answer", "answer"), ("answer: Velmora", "answer"),
    ("I would search", None), ("searching", None), ("Not sure", None), ("Nope", None), ("", None),
])
def test_parse_decision(text, expected):
    assert parse_decision(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("Drelwick Works founder", "Drelwick Works founder"), (" Orin Calvetta \n", "Orin Calvetta"),
    ("In which town was Orin Calvetta born?", "In which town was Orin Calvetta born?"),
    ("Query: Drelwick Works founder", "Drelwick Works founder"), ('query: "Velmora"', "Velmora"),
    ("**Query:** Orin Calvetta.", "Orin Calvetta"),
    ("Query:", None), ("", None), ("I need facts.\nQuery: Orin", None),
    ("one two three four five six seven eight nine ten eleven twelve thirteen", None),
])
def test_parse_query(text, expected):
    assert parse_query(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("The answer is Velmora.", "Velmora"), ("The answer is: Orin Calvetta, a weaver.", "Orin Calvetta"),
    ("The answer is Velmora. It lies on a river.", "Velmora"), ("the answer is 1902", "1902"),
    ("Answer: Velmora", "Velmora"), ("**Answer:** the Ostrel river.", "the Ostrel river"),
    ("From the facts...\nanswer: 1902", "1902"), ("Answer:", None), ("Velmora", None), ("", None),
    ("The answer to this question is Velmora", None),
])
def test_parse_answer(text, expected):
    assert parse_answer(text) == expected


# --- environment ------------------------------------------------------------------------------------


def test_tasks_deterministic_per_seed(env):
    again = SearchEnv(seed=0)
    assert again.tasks("train") == env.tasks("train") and again.tasks("test") == env.tasks("test")
    other = SearchEnv(seed=1)
    questions = {t.input["question"] for t in env.tasks("train")}
    assert {t.input["question"] for t in other.tasks("train")} != questions


def test_splits_disjoint_sized_and_mixed(env):
    train, test = env.tasks("train"), env.tasks("test")
    assert (len(train), len(test)) == (128, 32)
    assert not {t.input["question"] for t in train} & {t.input["question"] for t in test}
    assert len({t.id for t in train + test}) == 160
    levels = [t.meta["level"] for t in train]
    assert (levels.count(0), levels.count(1), levels.count(2)) == (64, 38, 26)  # 0.5/0.3/0.2 of 128
    assert all(t.meta["hops"] == t.meta["level"] + 1 == len(t.meta["gold_doc_ids"]) for t in train + test)
    by_question = {q.question: q for q in env.corpus.questions}
    assert all(by_question[t.input["question"]].answer == t.answer for t in train + test)


def test_too_many_tasks_for_a_level_fails_loudly():
    with pytest.raises(ValueError, match="level 2 \\(3-hop\\) has 70 questions"):
        SearchEnv(n_train=60, n_test=20, difficulty=(0, 0, 1))


@pytest.mark.parametrize("got, reward", [
    ("Ostrel", 1.0), ("ostrel", 1.0), ("The Ostrel.", 1.0), ("  the  OSTREL river ", 1.0),
    ("river Ostrel!", 1.0), ("Ostrel Creek", 0.0), ("Ostre", 0.0), ("", 0.0), (None, 0.0),
])
def test_reward_is_normalized_exact_match_with_aliases(env, got, reward):
    task = Task(id="t", input={"question": "Which river flows through Velmora?"}, answer="Ostrel",
                meta={"level": 0, "kind": "river", "aliases": ["Ostrel river", "river Ostrel"]})
    assert env.score(task, {"answer": got}) == reward
    assert env.score(task, {}) == 0.0


def test_normalize_answer():
    assert normalize_answer("  The Drelwick, Works! ") == "drelwick works"
    assert normalize_answer("An apple a day") == "apple day"


def test_turn_is_valid_and_penalty(env):
    assert env.invalid_penalty == 0.01 and env.agents == ("router", "searcher", "answerer")
    assert env.reply_is_valid("router", "No.") and env.reply_is_valid("router", "Answer")
    assert not env.reply_is_valid("router", "let me think")
    assert env.reply_is_valid("searcher", "Velmora river") and env.reply_is_valid("searcher", "Query: Velmora")
    assert not env.reply_is_valid("searcher", "Velmora is a town.\nIt has a river.")
    assert env.reply_is_valid("answerer", "The answer is 1902.") and env.reply_is_valid("answerer", "Answer: X")
    assert not env.reply_is_valid("answerer", "#$%^ garbage")
    with pytest.raises(ValueError, match="unknown agent 'verifier'"):
        env.reply_is_valid("verifier", "approve")


# --- optional: a real (tiny, random-weight) model behind the graph ----------------------------------


class PolicyChat(BaseChatModel):
    """Adapts a ``drmas_graph`` Policy to LangChain's chat-model interface (render -> generate -> decode)."""

    policy: Any

    @property
    def _llm_type(self) -> str:
        return "policy"

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        generation = self.policy.generate(self.policy.render(messages), self.policy.sampling)
        text = self.policy.decode(generation.token_ids)
        return ChatResult(generations=[ChatGeneration(message=AIMessage(text))])


@pytest.mark.slow
def test_graph_with_a_tiny_random_policy_stays_consistent(env):
    """Random-weight replies almost never follow the format; the graph must still end within max_steps
    and its state must agree with the parsers' fallbacks."""
    testing = pytest.importorskip("drmas_graph.testing")
    if not hasattr(testing, "tiny_policy"):
        pytest.skip("drmas_graph.testing.tiny_policy is not available")
    policy = testing.tiny_policy(0)
    try:
        task = env.tasks("train")[0]
        state = build_graph(PolicyChat(policy=policy), env.retriever, max_steps=2).invoke(task.input)
        turns = state["transcript"]
        assert turns[-1]["agent"] == "answerer" and state["answer"] == parse_answer(turns[-1]["text"])
        searcher_texts = [t["text"] for t in turns if t["agent"] == "searcher"]
        assert len(searcher_texts) == state.get("searches", 0) <= 2
        assert state.get("queries", []) == [parse_query(t) or task.input["question"] for t in searcher_texts]
        for turn in turns:
            assert isinstance(env.reply_is_valid(turn["agent"], turn["text"]), bool)
        assert env.score(task, state) in (0.0, 1.0)
    finally:
        policy.close()
