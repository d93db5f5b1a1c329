"""Retrieval for the vLLM connector: which facts a request injects, found by a
query embedding and k on the store (kvi_store_search), where the prompt is made.

vLLM fixes a request's prompt when it is submitted, and the connector can claim
only the prompt's prefix as already computed, so the facts a request injects
(and their token counts) must be known before it is submitted. The connector's
stores live in vLLM's worker processes; :class:`MemoryIndex` opens the same
store file in the client's process (the connector's ``store_path``, which the
worker keeps as its journal: every captured fact is in it once its step has
ended) without taking its journal, searches it with the library's own search,
and builds the prompt and its ``inject`` spans (:func:`kvinject.vllm.memory_prompt`).
:meth:`MemoryIndex.refresh` reloads the file when it has changed, so facts
captured since are found. No vLLM import here.

The index holds a CPU copy of the file's facts (KV and embeddings): memory of
the order of the file's size.
"""
from __future__ import annotations

import os
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

from ..enums import Backend
from ..hf.config import STORE_DTYPES, store_model
from ..store import Store
from .prompt import MemoryPrompt, Tokens, memory_prompt

Retrieved = Tuple[int, int, float]  # (fact id, tokens, score)


class MemoryIndex:
    """A read-only view of the connector's store file, for retrieval.

    hf_config: the served model's transformers config (``AutoConfig`` of the
    model directory vLLM serves); store_path: the connector's ``store_path``
    (with tensor parallelism, any rank's file ``<store_path>.rank<r>``: every
    rank holds every fact and embedding). store_dtype, embedding_dim and rope:
    the connector's settings of the same names (they must match the file;
    embedding_dim > 0, or there is nothing to search). The file need not exist
    yet: until it does the index is empty.
    """

    def __init__(self, hf_config, store_path: str, *, embedding_dim: int, store_dtype: str = "fp32",
                 rope: Optional[Mapping[str, Any]] = None, tp_rank: int = 0, tp_size: int = 1):
        if not isinstance(embedding_dim, int) or embedding_dim <= 0:
            raise ValueError("embedding_dim must be a positive integer (the connector's embedding_dim), got %r"
                             % (embedding_dim,))
        if store_dtype not in STORE_DTYPES:
            raise ValueError("store_dtype %r is not one of %s" % (store_dtype, ", ".join(STORE_DTYPES)))
        self.path = os.fspath(store_path)
        self.embedding_dim = embedding_dim
        self._dtype = STORE_DTYPES[store_dtype]
        self._model = store_model(hf_config, rope, tp_rank=tp_rank, tp_size=tp_size)
        self._store: Optional[Store] = None
        self._stamp: Optional[Tuple[int, int, int]] = None
        self.refresh()

    def refresh(self) -> bool:
        """Reloads the file if it changed since the last load (size, mtime or
        inode); True when it did. A failed reload keeps the previous contents
        and raises (kvinject.errors)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return False
        budget = max(2 * st.st_size, 16 << 20)
        new = Store.load(self._model, self.path, budget, backend=Backend.CPU, dtype=self._dtype,
                         embedding_dim=self.embedding_dim)
        old, self._store, self._stamp = self._store, new, stamp
        if old is not None:
            old.close()
        return True

    @property
    def store(self) -> Optional[Store]:
        """The loaded CPU store (None before the file exists)."""
        return self._store

    def retrieve(self, tenant: int, query, k: int, *, exclude: Sequence[int] = ()) -> List[Retrieved]:
        """The best min(k, facts of tenant) facts for one query embedding
        (embedding_dim floats, or a host tensor/buffer), best first, as
        (fact id, tokens, score); fact ids in ``exclude`` (e.g. a header that
        every prompt injects) are never returned, nor stale facts (Store.stale:
        the connector refuses to inject them)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError("k must be a non-negative integer, got %r" % (k,))
        if self._store is None or k == 0:
            return []
        skip = {int(x) for x in exclude} | set(self._store.stale(tenant))
        res = self._store.search([query] if _is_vector(query) else query, tenant, k + len(skip))
        out: List[Retrieved] = []
        for fid, score in res[0]:
            if fid in skip:
                continue
            out.append((fid, self._store.fact_tokens(tenant, fid), score))
            if len(out) == k:
                break
        return out

    def memory_prompt(self, tenant: int, query, k: int, question: Tokens, *,
                      header: Optional[Tuple[int, Union[Tokens, int]]] = None,
                      tokens: Union[None, Mapping[int, Tokens], Callable[[int], Tokens]] = None,
                      filler_token: Optional[int] = None, order: str = "said") -> MemoryPrompt:
        """[header | retrieved facts | question] and its inject spans, for
        ``SamplingParams(extra_args=...)`` (see :class:`MemoryPrompt`).

        header: (fact id, token ids) of a fact every prompt starts with (a
        system prompt captured once), excluded from the search. tokens: the
        retrieved facts' own token ids (a mapping or function of the fact id);
        None: the ids the store keeps with each fact (the connector's captures
        keep them), else ``filler_token`` repeated for a fact stored without
        ids (the connector then refuses the request: its tokens are checked).
        order: "said" (the default; "id" is the same) lays the facts out in
        ascending fact id, the order they were said when ids are given as facts
        are said: the order the notes encoding captured them in, where injected
        facts come closest to re-prefilled ones (BENCHMARKS.md); "rank" best
        first. The retrieved facts, best first, are ``prompt.retrieved``
        ([(fact id, tokens, score)])."""
        if order not in ("said", "id", "rank"):
            raise ValueError("order must be 'said' (or 'id') or 'rank', got %r" % (order,))
        got = self.retrieve(tenant, query, k, exclude=[header[0]] if header is not None else ())
        if order != "rank":
            got.sort(key=lambda r: r[0])
        facts: List[Tuple[int, Union[Tokens, int]]] = [header] if header is not None else []
        for fid, n, _ in got:
            if tokens is None:
                stored, _ = self._store.fact_token_ids(tenant, fid)
                facts.append((fid, stored if stored else n))
            else:
                toks = tokens(fid) if callable(tokens) else tokens[fid]
                if len(toks) != n:
                    raise ValueError("tokens of fact %d: %d given, the store holds %d" % (fid, len(toks), n))
                facts.append((fid, toks))
        mp = memory_prompt(tenant, facts, question, filler_token=filler_token)
        mp.retrieved = got if order == "rank" else sorted(got, key=lambda r: -r[2])
        return mp

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._model is not None:
            self._model.close()
            self._model = None

    def __enter__(self) -> "MemoryIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_vector(q) -> bool:
    if isinstance(q, (list, tuple)):
        return not q or not isinstance(q[0], (list, tuple))
    shape = getattr(q, "shape", None)
    return shape is not None and len(shape) == 1
