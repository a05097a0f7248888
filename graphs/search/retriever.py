"""BM25 retrieval over the generated corpus (the ``bm25s`` library), also exposed as a LangChain tool."""

from __future__ import annotations

from typing import Sequence

import bm25s
import numpy as np
from langchain_core.tools import BaseTool, StructuredTool

from graphs.search.corpus import Doc

__all__ = ["Retriever"]


class Retriever:
    """A BM25 index (Lucene scoring, English stopwords, no stemming) over each document's title and text.

    Args:
        docs: the documents to index; ids must be unique.
        k1, b: the BM25 parameters.
    """

    def __init__(self, docs: Sequence[Doc], *, k1: float = 1.5, b: float = 0.75) -> None:
        if not docs:
            raise ValueError("Retriever needs at least one document to index")
        ids = [d.id for d in docs]
        if len(set(ids)) != len(ids):
            dupes = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"document ids must be unique; repeated: {dupes}")
        self.docs: tuple[Doc, ...] = tuple(docs)
        self._bm25 = bm25s.BM25(k1=k1, b=b)
        tokens = bm25s.tokenize([f"{d.title}. {d.text}" for d in self.docs], stopwords="en",
                                show_progress=False)
        self._bm25.index(tokens, show_progress=False)

    def search(self, query: str, k: int = 3) -> list[Doc]:
        """The top-``k`` documents for ``query``, best first; only documents sharing a term with it.

        Ties keep corpus order. A query with no indexed term returns ``[]``.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        [query_tokens] = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        query_tokens = [t for t in query_tokens if t in self._bm25.vocab_dict]
        if not query_tokens:
            return []
        scores_D = self._bm25.get_scores(query_tokens)
        order = np.argsort(-scores_D, kind="stable")[:k]
        return [self.docs[i] for i in order if scores_D[i] > 0]

    def as_tool(self, k: int = 3) -> BaseTool:
        """A LangChain tool named ``search``: ``{"query": str}`` -> the top-``k`` docs as dicts.

        Each dict has ``id``, ``title`` and ``text``: the form ``graphs.search.graph`` expects.
        """

        def search(query: str) -> list[dict[str, str]]:
            return [{"id": d.id, "title": d.title, "text": d.text} for d in self.search(query, k)]

        return StructuredTool.from_function(
            func=search, name="search",
            description=f"Search the knowledge base; returns the {k} best matching documents.")
