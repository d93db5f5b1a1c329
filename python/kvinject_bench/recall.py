#!/usr/bin/env python3
"""Recall of personal facts on a real instruct model: re-prefilling facts as
text against injecting their KV with libkvinject.

Users, their multi-turn conversations and questions with gold answers come
from recall_data.py (seeded). For each question and each k (5, 10, 20, 50),
k facts of the question's user are selected, either by the oracle (the gold
facts and same-user distractors) or by the store's own search
(kvi_store_search over the model's mean hidden state as embedding, recall@k
reported), kept in the order they were said, and laid out as

    [header | fact_1 .. fact_k | question]   slot i = position i

(header: the system prompt up to the notes; question: the rest of the system
turn, the user's question and the assistant's header). Every configuration
(a Method, see below) fills the fact slots of its own cache row with the same
token ids at the same positions, so only the fact KV differs:

- reprefill: the facts prefilled as text after the header (the reference);
- exact-<store>: the facts captured (kvi_encode) from reprefill's own prefill
  into a store and injected back: a sanity check, KL ~ 0 in fp32;
- w<N>-<store>: Context-Window Encoding: each fact prefilled after the N
  tokens of its own conversation before it (w0: alone, at position 0; wall:
  after the whole preceding conversation), its span captured pre-RoPE into a
  store, injected (kvi_inject rotates the keys where they land);
- a<N>-<store>: as w<N>, each fact's window after the prompt's header;
- n<N>-<store>: notes encoding: each fact prefilled after the prompt's header
  and the user's N facts said before it, as notes (nall: after all of them,
  one prefill per user), as they would stand in a prompt;
- none: no memory (the header without the notes, then the question; run once
  per question).

Stores: fp32, bf16, fp8 (the library's e4m3 store with per-page scales).
Then every row is prefilled with [question + gold answer] in one batched
forward (teacher forcing: the gold answer's log-probability and the first
answer token's distribution, whose KL against reprefill is reported), and
generates greedily (max --max-new tokens) for accuracy: "contains" (the gold
answer as a whole word in the answer) and "exact" (the answer, normalized,
equals the gold). 95% intervals: Wilson for accuracies, paired bootstrap for
differences against reprefill.

Methods (the pluggable part). A method is an object with

    name: str
    setup(bench)               once, before any question (encode facts, ...)
    fill(bench, cell, cache)   writes the fact slots of one cache row

`cache` is a transformers StaticCache of batch 1 (a view of one row of the
batched cache, so writes land there) whose slots [0, cell.header_len) hold
the header's KV and whose length is cell.header_len. After fill, slots
[0, cell.question_start) must hold the KV the question is to attend to;
the harness then sets the length to cell.question_start (a method may
prefill through `cache` with bench.model itself: it is an ordinary cache).
`cell` (a Cell) has: ids (the prompt's token ids, a list), header_len,
question_start, question_len, facts (a list of FactSlot: tenant, fact_id,
slot, tokens; slot = position), user, question, reference (the reprefill
prefill: an HF cache of batch 1 over ids[:question_start]), reference_kv()
(its per-layer key and value tensors). `bench` (a Bench) has model, tok,
torch, kvi, device, stream, kvi_model, corpus (token ids of every fact and
conversation), store(dtype_name, ...) and window_stores(w) (the facts of every
user encoded with window w into one store per storage dtype), inject(store,
cell, cache) and capture(store, tenant, cell, kv). New methods are added to
METHODS (name prefix -> factory) or passed to run(...).

    python3 -m kvinject_bench.recall --model DIR|FILE.gguf [--device cuda]
    python3 -m kvinject_bench.recall --model DIR --users 2 --questions-per-user 3 --ks 5 --check

Retrieval: oracle, search, or prefix (the user's first k facts, said order:
there nall's context is exactly the prompt's, a check of the notes encoding).

--check (CI): exits 1 unless exact-fp32 has first-token KL < 1e-6 on every
cell and the same greedy answer as reprefill, a control (exact with its
positions shifted by 7) is caught (mean KL > 1e-4), and, where run, nall-fp32
has first-token KL < 1e-6 on every prefix cell. Exit 77 without torch.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from kvinject_bench import common
from kvinject_bench import recall_data

SYSTEM = ("You are a helpful assistant. Answer the user's question with only the answer "
          "(a name, a number, a place or a word), not a sentence.")
NOTES = " Notes from earlier conversations, in the user's words:"
EXACT_TENANT = 1 << 40  # per-cell captures of exact-context methods
STORE_DTYPES = ("fp32", "bf16", "fp8")
DEFAULT_EMBEDDER = "/var/cache/kvinject/vllm/model/all-MiniLM-L6-v2"  # .ci/install-vllm unpacks it there
T0 = time.time()


def log(msg):
    print("[recall %6.1fs] %s" % (time.time() - T0, msg), file=sys.stderr, flush=True)


# --------------------------------------------------------------------- corpus

class Corpus:
    """Token ids of every fact (" " + sentence, tokenized alone) and every
    conversation (pieces tokenized alone and concatenated, so a fact's ids are
    the same in its conversation and in a prompt), with each fact's span."""

    def __init__(self, tok, users: List[recall_data.User]):
        self.tok = tok
        self.users = {u.uid: u for u in users}
        enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
        self.enc = enc
        self.fact_ids: Dict[tuple, List[int]] = {}
        self.convs: Dict[int, List[List[int]]] = {}
        self.span: Dict[tuple, tuple] = {}  # (uid, fact) -> (conversation, start, end)
        for u in users:
            for f in u.facts:
                self.fact_ids[(u.uid, f.index)] = enc(" " + f.text)
            cl = []
            for ci, c in enumerate(u.conversations):
                ids = enc("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
                for role, sents in c.turns:
                    ids += enc("<|im_start|>%s\n" % role)
                    for s in sents:
                        if isinstance(s, int):
                            t = self.fact_ids[(u.uid, s)]
                            self.span[(u.uid, s)] = (ci, len(ids), len(ids) + len(t))
                            ids += t
                        else:
                            ids += enc(" " + s)
                    ids += enc("<|im_end|>\n")
                cl.append(ids)
            self.convs[u.uid] = cl
        self.header = enc("<|im_start|>system\n" + SYSTEM + NOTES)
        self.header_none = enc("<|im_start|>system\n" + SYSTEM)

    def question_ids(self, q: recall_data.Question) -> List[int]:
        return self.enc("<|im_end|>\n<|im_start|>user\n" + q.text + "<|im_end|>\n<|im_start|>assistant\n")

    def answer_ids(self, q: recall_data.Question) -> List[int]:
        return self.enc(q.answer)


@dataclass
class FactSlot:
    tenant: int
    fact_id: int
    slot: int
    tokens: int


@dataclass
class Cell:
    """One question with one selection of facts: the prompt layout."""
    ids: List[int]
    header_len: int
    question_start: int
    question_len: int
    facts: List[FactSlot]
    user: int
    question: recall_data.Question
    reference: object = None
    extra: dict = field(default_factory=dict)

    def reference_kv(self):
        return common.cache_tensors(self.reference)


# ---------------------------------------------------------------------- bench

class Bench:
    def __init__(self, args, torch, kvi, model, tok, corpus, device):
        self.args, self.torch, self.kvi, self.model, self.tok = args, torch, kvi, model, tok
        self.corpus, self.device = corpus, device
        self.stream = common.kvi_stream(device)
        self.backend = common.kvi_backend(device)
        self.kvi_model = common.kvi_model_for(model.config)
        self.store_dtypes = args.stores.split(",")
        self._windows = {}
        self._stores = []
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.eos = {t for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if t is not None}
        self.embed_center = None
        self.search_store = True  # the fp32 store of w0 holds the search embeddings
        self.embedder = None
        if args.embedder == "minilm":  # the gateway's own loader (kvinject.serve.embed)
            from kvinject.serve.embed import LocalEmbedder
            self.embedder = LocalEmbedder(args.embedder_path)
            self.embed_dim = self.embedder.dim
        else:
            self.embed_dim = model.config.hidden_size
        self.timing = {}

    # stores
    def kvi_dtype(self, name):
        D_ = self.kvi.DType
        return {"fp32": D_.FP32, "bf16": D_.BF16, "fp16": D_.FP16, "fp8": D_.FP8_E4M3, "q4": D_.Q4, "q4p64": D_.Q4}[name]

    def store(self, dtype_name, budget=None, **kw):
        # whole pages per fact (the store's default page of 16 tokens): short
        # facts fill a page each
        n_tok = sum(-(-len(v) // 16) * 16 for v in self.corpus.fact_ids.values())
        cfg = self.model.config
        per_tok = 2 * cfg.num_hidden_layers * common.kv_heads_of(cfg) * common.head_dim_of(cfg) * 4
        budget = budget or max(64 << 20, int(per_tok * n_tok * 1.25) + (64 << 20))
        if dtype_name == "q4p64":  # 4-bit with 64-token pages: 0.273x bf16's bytes per page token
            kw.setdefault("page_tokens", 64)
        s = self.kvi.Store(self.kvi_model, budget, backend=self.backend, dtype=self.kvi_dtype(dtype_name), **kw)
        self._stores.append(s)
        return s

    def close(self):
        for s in self._stores:
            s.close()
        self._stores = []

    def forward(self, ids, **kw):
        torch = self.torch
        t = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        if t.dim() == 1:
            t = t.unsqueeze(0)
        return self.model(t, **kw)

    def capture(self, store, tenant, cell, kv, shift=0):
        """Captures every fact slot of cell from the batch-1 cache tensors kv
        (keys, values) into store under tenant; positions = slots (+ shift)."""
        kvi = self.kvi
        enc = kvi.Encoder(store, kvi.CacheLayout.hf(*kv))
        enc.encode([kvi.Capture(tenant, f.fact_id, block_table=[0], num_tokens=f.tokens, first_slot=f.slot,
                                start_position=f.slot + shift, replace=True) for f in cell.facts],
                   stream=self.stream)
        common.sync(self.device)

    def inject(self, store, cell, cache, tenant=None, shift=0):
        """Injects the cell's facts (tenant: the user's, or the given one) from
        store into the batch-1 cache, behind the header, at their slots."""
        kvi = self.kvi
        if not cell.facts:
            return
        keys, values = common.cache_tensors(cache)
        inj = kvi.Injector(store, kvi.CacheLayout.hf(keys, values))
        ten = cell.facts[0].tenant if tenant is None else tenant
        inj.inject(kvi.InjectRequest(ten, [f.fact_id for f in cell.facts], block_table=[0],
                                     first_slot=cell.header_len, start_position=cell.header_len + shift),
                   stream=self.stream)
        common.sync(self.device)

    # encoding with a window
    def _batches(self, units, budget):
        """units: (token ids, captures); batches of similar length within budget tokens."""
        units = sorted(units, key=lambda u: len(u[0]))
        batch, longest = [], 0
        for u in units:
            n = len(u[0])
            if batch and max(longest, n) * (len(batch) + 1) > budget:
                yield batch
                batch, longest = [], 0
            batch.append(u)
            longest = max(longest, n)
        if batch:
            yield batch

    def _expanded(self, cache, rows):
        """A DynamicCache holding `cache`'s (batch 1) KV in each of `rows` rows:
        a shared prefix prefilled once (the units after it are prefilled from it,
        exactly as if each row had prefilled the prefix itself)."""
        from transformers import DynamicCache
        c = DynamicCache()
        for li, (k, v) in enumerate(zip(*common.cache_tensors(cache))):
            c.update(k.expand(rows, -1, -1, -1).contiguous(), v.expand(rows, -1, -1, -1).contiguous(), li)
        return c

    def _padded(self, rows):
        n = max(len(r) for r in rows)
        return [r + [self.pad] * (n - len(r)) for r in rows]

    def window_units(self, w, anchor=False):
        """(token ids, [(tenant, fact, slot, tokens)]) for window w (None = the whole
        preceding conversation: one unit per conversation, all its facts); with
        anchor, every unit starts with the prompt's header (the facts are encoded
        as if they followed the notes' header, as in the prompt); with anchor
        "notes", w counts facts: each fact is encoded after the header and the
        user's w facts said before it (None: all of them), laid out as in the
        prompt."""
        c = self.corpus
        pre = list(c.header) if anchor else []
        units = []
        for uid, u in c.users.items():
            if anchor == "notes":  # the library's layout (kvinject.vllm.notes_capture_prompts)
                from kvinject.vllm.prompt import Keep, notes_capture_prompts
                facts = [Keep(f.index, c.fact_ids[(uid, f.index)]) for f in sorted(u.facts, key=lambda f: f.index)]
                for p in notes_capture_prompts(uid, pre, facts, window=w):
                    units.append((p.prompt_token_ids, [(uid, cp["fact_id"], cp["start"], cp["length"])
                                                       for cp in p.params["capture"]]))
            elif w is None:
                by_conv = {}
                for f in u.facts:
                    ci, s, e = c.span[(uid, f.index)]
                    by_conv.setdefault(ci, []).append((uid, f.index, len(pre) + s, e - s))
                for ci, caps in by_conv.items():
                    end = max(s + t for _, _, s, t in caps) - len(pre)
                    units.append((pre + c.convs[uid][ci][:end], caps))
            else:
                for f in u.facts:
                    ci, s, e = c.span[(uid, f.index)]
                    a = max(0, s - w)
                    units.append((pre + c.convs[uid][ci][a:e], [(uid, f.index, len(pre) + s - a, e - s)]))
        return units

    def window_stores(self, w, anchor=False):
        """The facts of every user encoded with window w (int tokens, or None:
        the whole preceding conversation; anchor: after the prompt's header, see
        window_units), one store per storage dtype, captured from the same
        prefills. The fp32 store of unanchored w = 0 also holds embeddings."""
        key = (w, anchor)
        if key in self._windows:
            return self._windows[key]
        t0 = time.time()
        kvi = self.kvi
        stores = {}
        for dn in self.store_dtypes:
            kw = {}
            if key == (0, False) and dn == "fp32" and self.search_store:
                kw = dict(embedding_dim=self.embed_dim, metric=kvi.Metric.COSINE)
            stores[dn] = self.store(dn, **kw)
        emb = self.fact_embeddings() if key == (0, False) and self.search_store else None
        self.encode_units(stores, self.window_units(w, anchor), self.corpus.header if anchor else None, emb)
        self._windows[key] = stores
        self.timing["encode %s" % window_name(w, anchor)] = time.time() - t0
        return stores

    def encode_units(self, stores, units, header=None, emb=None):
        """Prefills units ((token ids, [(tenant, fact, slot, tokens)]), batched)
        and captures their facts into every store of `stores` (dtype name ->
        store); with `header`, every unit starts with it and it is prefilled
        once; emb: (tenant, fact) -> embedding, put with the fp32 captures."""
        kvi = self.kvi
        pre = len(header) if header else 0
        head = self.forward(header, use_cache=True).past_key_values if pre else None
        for batch in self._batches(units, self.args.batch_tokens):
            rows = self._padded([u[0][pre:] for u in batch])
            past = self._expanded(head, len(rows)) if pre else None
            out = self.forward(rows, past_key_values=past, use_cache=True, logits_to_keep=1)
            kv = common.cache_tensors(out.past_key_values)
            for dn, st in stores.items():
                enc = kvi.Encoder(st, kvi.CacheLayout.hf(*kv))
                caps = []
                for row, (_, cs) in enumerate(batch):
                    for uid, fid, slot, t in cs:
                        e = emb[(uid, fid)] if (emb is not None and dn == "fp32") else None
                        caps.append(kvi.Capture(uid, fid, block_table=[row], num_tokens=t, first_slot=slot,
                                                start_position=slot, embedding=e))
                enc.encode(caps, stream=self.stream)
            common.sync(self.device)
            del out, kv

    # embeddings: the model's mean hidden state (layer --embed-layer), centered on the facts' mean
    def embed(self, texts_ids):
        torch = self.torch
        layer = self.args.embed_layer
        out = []
        order = sorted(range(len(texts_ids)), key=lambda i: len(texts_ids[i]))
        res = [None] * len(texts_ids)
        for batch in self._batches([(texts_ids[i], i) for i in order], self.args.batch_tokens):
            o = self.forward(self._padded([b[0] for b in batch]), output_hidden_states=True, use_cache=False,
                             logits_to_keep=1)
            h = o.hidden_states[layer].float()
            for row, (ids, i) in enumerate(batch):
                res[i] = h[row, :len(ids)].mean(0)
        out = torch.stack(res)
        return out

    def sentence_embed(self, texts):
        """The sentence embedder's (normalized) vectors of texts, on the device."""
        return self.torch.from_numpy(self.embedder.embed(texts)).to(self.device).contiguous()

    def fact_embeddings(self):
        keys = list(self.corpus.fact_ids)
        if self.embedder is not None:
            u = self.corpus.users
            e = self.sentence_embed([u[uid].facts[fi].text for uid, fi in keys])
            return {k: e[i] for i, k in enumerate(keys)}
        e = self.embed([self.corpus.fact_ids[k] for k in keys])
        self.embed_center = e.mean(0)
        e = (e - self.embed_center).contiguous()
        return {k: e[i] for i, k in enumerate(keys)}

    def question_embeddings(self, questions):
        self.window_stores(0)  # the center comes from the facts
        if self.embedder is not None:
            return self.sentence_embed([q.text for q in questions])
        e = self.embed([self.corpus.enc(" " + q.text) for q in questions])
        return (e - self.embed_center).contiguous()


# -------------------------------------------------------------------- methods

class Reprefill:
    """The facts as text: the reference prefill's own KV copied into the row."""
    name = "reprefill"

    def setup(self, bench):
        pass

    def fill(self, bench, cell, cache):
        a, b = cell.header_len, cell.question_start
        rk, rv = cell.reference_kv()
        keys, values = common.cache_tensors(cache)
        for k, v, x, y in zip(keys, values, rk, rv):
            k[:, :, a:b].copy_(x[:, :, a:b])
            v[:, :, a:b].copy_(y[:, :, a:b])


class Exact:
    """Facts captured from reprefill's own prefill into a store and injected
    back at the same positions (shift: a control, injected at positions shifted
    by `shift` while staying in the same slots)."""

    def __init__(self, dtype, shift=0):
        self.dtype, self.shift = dtype, shift
        self.name = "exact-%s" % dtype + ("-shift%d" % shift if shift else "")
        self.sibling = "exact-fp32" if dtype != "fp32" and not shift else None

    def setup(self, bench):
        self.st = bench.store(self.dtype, budget=64 << 20)

    def fill(self, bench, cell, cache):
        bench.capture(self.st, EXACT_TENANT, cell, cell.reference_kv())
        bench.inject(self.st, cell, cache, tenant=EXACT_TENANT, shift=self.shift)
        for f in cell.facts:
            self.st.remove(EXACT_TENANT, f.fact_id)


def window_name(w, anchor=False):
    """w0, w32, wall; a0, a32, aall when anchored after the prompt's header;
    n2, n4 after the header and that many of the user's earlier facts."""
    return "%s%s" % ({False: "w", True: "a", "notes": "n"}[anchor], "all" if w is None else w)


def parse_window(spec):
    """'0', '32', 'all', 'a0', 'a32', 'aall', 'n4' -> (w, anchor)."""
    anchor = {"a": True, "n": "notes"}.get(spec[0], False) if spec != "all" else False
    rest = spec[1:] if anchor else spec
    return (None if rest == "all" else int(rest)), anchor


class Window:
    """Context-Window Encoding with window w (None: the whole preceding
    conversation), anchored after the prompt's header or not."""

    def __init__(self, w, dtype, anchor=False):
        self.w, self.dtype, self.anchor = w, dtype, anchor
        self.name = "%s-%s" % (window_name(w, anchor), dtype)
        self.sibling = "%s-fp32" % window_name(w, anchor) if dtype != "fp32" else None

    def setup(self, bench):
        self.st = bench.window_stores(self.w, self.anchor)[self.dtype]

    def fill(self, bench, cell, cache):
        bench.inject(self.st, cell, cache)


def make_methods(args):
    ms = [Reprefill()]
    stores = args.stores.split(",")
    for dn in stores:
        ms.append(Exact(dn))
    for spec in args.windows.split(","):
        w, anchor = parse_window(spec)
        for dn in stores:
            ms.append(Window(w, dn, anchor))
    if args.check:
        ms.append(Exact("fp32", shift=7))
    return ms


# ----------------------------------------------------------------- the cells

def row_cache(big, r, torch):
    """A batch-1 StaticCache whose layers are views of row r of `big`."""
    from transformers import StaticCache
    c = StaticCache(config=big._kvi_config, max_cache_len=big._kvi_len)
    for lb, l in zip(big.layers, c.layers):
        l.__dict__.update(lb.__dict__)  # what lazy_initialization set (dtype, device, head sizes, ...)
        l.batch_size = 1
        l.keys, l.values = lb.keys[r:r + 1], lb.values[r:r + 1]
        l.cumulative_length = torch.zeros((), dtype=lb.cumulative_length.dtype, device=lb.device)
    return c


def batched_cache(bench, rows, max_len, ref_kv, header_len):
    """A StaticCache of `rows` rows, each holding the reference's header KV."""
    torch = bench.torch
    from transformers import StaticCache
    cfg = bench.model.config
    c = StaticCache(config=cfg, max_cache_len=max_len)
    c._kvi_config, c._kvi_len = cfg, max_len
    rk, rv = ref_kv
    for l, k, v in zip(c.layers, rk, rv):
        l.lazy_initialization(k[:, :, :1].expand(rows, -1, -1, -1), v[:, :, :1].expand(rows, -1, -1, -1))
        l.keys[:, :, :header_len].copy_(k[:, :, :header_len].expand(rows, -1, -1, -1))
        l.values[:, :, :header_len].copy_(v[:, :, :header_len].expand(rows, -1, -1, -1))
    return c


def run_cell(bench, cell, methods):
    """Fills one row per method, then teacher-forces [question + answer] and
    generates greedily on all rows at once. Returns one record per method."""
    torch, a = bench.torch, bench.args
    gold = bench.corpus.answer_ids(cell.question)
    n0 = cell.question_start
    qids = cell.ids[n0:]
    B = len(methods)
    max_len = n0 + len(qids) + max(len(gold), a.max_new) + 1
    cell.reference = bench.forward(cell.ids[:n0], use_cache=True, logits_to_keep=1).past_key_values
    ref_kv = cell.reference_kv()
    big = batched_cache(bench, B, max_len, ref_kv, cell.header_len)
    for r, m in enumerate(methods):
        rc = row_cache(big, r, torch)
        common.set_cache_length(rc, cell.header_len)
        m.fill(bench, cell, rc)
    common.set_cache_length(big, n0)
    seq = torch.tensor([qids + gold], dtype=torch.long, device=bench.device).expand(B, -1)
    g = len(gold)
    # logits of the last g + 1 positions: the question's last token and the answer's
    lg = bench.model(seq, past_key_values=big, use_cache=True, logits_to_keep=g + 1).logits[:, :g].double()
    lp = torch.log_softmax(lg, -1)
    q = len(qids)
    first = lp[:, 0]                                      # the first answer token's distribution
    gold_t = torch.tensor(gold, device=bench.device)
    gold_lp = lp.gather(2, gold_t.view(1, -1, 1).expand(B, -1, 1)).sum((1, 2))
    kl = (first[0].exp() * (first[0] - first)).sum(-1)
    # greedy: continue from the question's end (the answer's slots are overwritten)
    common.set_cache_length(big, n0 + q)
    tok = first.argmax(-1)
    gen = [tok]
    done = torch.zeros(B, dtype=torch.bool, device=bench.device)
    eos = torch.tensor(sorted(bench.eos), device=bench.device)
    for _ in range(a.max_new - 1):
        done |= torch.isin(tok, eos)
        if bool(done.all()):
            break
        tok = bench.model(tok.view(B, 1), past_key_values=big, use_cache=True,
                          logits_to_keep=1).logits[:, -1].argmax(-1)
        gen.append(tok)
    gen = torch.stack(gen, 1).cpu().tolist()
    kl, gold_lp = kl.cpu().tolist(), gold_lp.cpu().tolist()
    firsts = first.cpu()
    recs = []
    for r, m in enumerate(methods):
        ids = []
        for t in gen[r]:
            if t in bench.eos:
                break
            ids.append(t)
        text = bench.tok.decode(ids, skip_special_tokens=True).strip()
        recs.append(dict(method=m.name, qid=cell.question.qid, answer=text, tokens=ids,
                         contains=contains(text, cell.question.answer), exact=exact(text, cell.question.answer),
                         gold_logprob=gold_lp[r], kl=max(0.0, kl[r]), _first=firsts[r]))
    names = {m.name: i for i, m in enumerate(methods)}
    for r, m in enumerate(methods):  # the storage's own cost: KL against the fp32 sibling
        s = getattr(m, "sibling", None)
        if s in names:
            p, qd = firsts[names[s]], firsts[r]
            recs[r]["kl_vs_fp32"] = max(0.0, float((p.exp() * (p - qd)).sum()))
    for rec in recs:
        del rec["_first"]
    cell.reference = None
    del big
    return recs


def norm(s):
    return re.sub(r"[^a-z0-9 ]", "", s.lower()).strip()


def contains(text, answer):
    return re.search(r"(?<![a-z0-9])%s(?![a-z0-9])" % re.escape(norm(answer)), norm(text)) is not None


def exact(text, answer):
    return norm(text) == norm(answer)


def make_cell(corpus, q, fact_list, none=False):
    header = corpus.header_none if none else corpus.header
    ids = list(header)
    facts = []
    for f in ([] if none else fact_list):
        t = corpus.fact_ids[(q.user, f)]
        facts.append(FactSlot(q.user, f, len(ids), len(t)))
        ids += t
    n0 = len(ids)
    qi = corpus.question_ids(q)
    return Cell(ids + qi, len(header), n0, len(qi), facts, q.user, q)


def oracle_selection(corpus, q, k, seed):
    u = corpus.users[q.user]
    rng = random.Random("%d/%d/%d" % (seed, q.qid, k))
    others = [f.index for f in u.facts if f.index not in q.gold]
    sel = set(q.gold) | set(rng.sample(others, max(0, min(k, len(u.facts)) - len(q.gold))))
    return sorted(sel)


# --------------------------------------------------------------- statistics

def wilson(x, n, z=1.96):
    if n == 0:
        return (float("nan"),) * 3
    p = x / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return p, max(0.0, c - h), min(1.0, c + h)


def paired_bootstrap(a, b, reps=2000, seed=0):
    """Mean of a - b and its 95% percentile interval over resampled questions
    (the same resampling for every pair of the same length and seed)."""
    import numpy as np
    n = len(a)
    if n == 0:
        return (float("nan"),) * 3
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, n, size=(reps, n))
    means = np.sort(d[idx].mean(1))
    return float(d.mean()), float(means[int(0.025 * reps)]), float(means[int(0.975 * reps) - 1])


def summarize(records, reps):
    """Rows per (retrieval, k, method): accuracy with Wilson CI, differences
    against reprefill with paired bootstrap CIs, gold log-prob, KL."""
    groups = {}
    for r in records:
        groups.setdefault((r["retrieval"], r["k"], r.get("order", "said")), {}).setdefault(r["method"], {})[r["qid"]] = r
    rows = []
    for (ret, k, order), by in sorted(groups.items(), key=lambda x: x[0]):
        ref = by.get("reprefill", {})
        for m, recs in by.items():
            qs = sorted(recs)
            n = len(qs)
            acc = wilson(sum(recs[q]["contains"] for q in qs), n)
            ex = wilson(sum(recs[q]["exact"] for q in qs), n)
            lp = sum(recs[q]["gold_logprob"] for q in qs) / n
            kls = [recs[q]["kl"] for q in qs if recs[q]["kl"] is not None]
            row = dict(retrieval=ret, k=k, order=order, method=m, n=n, contains=acc, exact=ex, gold_logprob=lp,
                       kl_mean=sum(kls) / len(kls) if kls else float("nan"),
                       kl_max=max(kls) if kls else float("nan"))
            sib = [recs[q]["kl_vs_fp32"] for q in qs if "kl_vs_fp32" in recs[q]]
            if sib:
                row["kl_vs_fp32_mean"], row["kl_vs_fp32_max"] = sum(sib) / len(sib), max(sib)
            paired = [q for q in qs if q in ref]
            if m != "reprefill" and paired:
                row["d_contains"] = paired_bootstrap([float(recs[q]["contains"]) for q in paired],
                                                     [float(ref[q]["contains"]) for q in paired], reps)
                row["d_logprob"] = paired_bootstrap([recs[q]["gold_logprob"] for q in paired],
                                                    [ref[q]["gold_logprob"] for q in paired], reps)
            base, _, dn = m.rpartition("-")
            twin = by.get(base + "-fp32") if dn in STORE_DTYPES and dn != "fp32" else None
            tq = [q for q in qs if twin and q in twin]
            if tq:  # the storage dtype's own cost: against the same configuration's fp32 store
                row["d_contains_vs_fp32"] = paired_bootstrap([float(recs[q]["contains"]) for q in tq],
                                                             [float(twin[q]["contains"]) for q in tq], reps)
                row["d_logprob_vs_fp32"] = paired_bootstrap([recs[q]["gold_logprob"] for q in tq],
                                                            [twin[q]["gold_logprob"] for q in tq], reps)
            rec = [recs[q].get("recall") for q in qs if recs[q].get("recall") is not None]
            if rec:
                row["recall"] = sum(rec) / len(rec)
            rows.append(row)
    return rows


def storage_markdown(rows):
    """Every bf16 / fp8 configuration against its fp32 store: paired
    differences of accuracy and gold log-prob, first-token KL."""
    rs = [r for r in rows if "d_contains_vs_fp32" in r]
    if not rs:
        return ""
    body = [[r["retrieval"], r["k"], r["order"], r["method"], r["n"],
             "%.1f%%" % (100 * r["contains"][0]),
             "%+.1f pp (%+.1f, %+.1f)" % tuple(100 * x for x in r["d_contains_vs_fp32"]),
             "%+.3f (%+.3f, %+.3f)" % r["d_logprob_vs_fp32"],
             "%s / %s" % (common.fmt(r.get("kl_vs_fp32_mean"), ".2e"), common.fmt(r.get("kl_vs_fp32_max"), ".2e"))]
            for r in rs]
    return ("\n### Storage dtypes against the fp32 store (same configuration, paired per question, 95% bootstrap "
            "CIs)\n\n" + common.table(["retrieval", "k", "order", "method", "n", "contains",
                                          "Δ contains vs fp32 store", "Δ gold log-prob vs fp32 store",
                                          "first-token KL vs fp32 store mean / max"], body) + "\n")


def order_rows(records, reps):
    """Where a cell ran in both orders: per (retrieval, k, method), the
    accuracy in rank and said order and the paired differences (same
    questions) of said − rank for the method itself, of the method in said
    order − reprefill in rank order, and of the method − reprefill in each
    order."""
    by = {}
    for r in records:
        by.setdefault((r["retrieval"], r["k"], r["method"]), {}).setdefault(r.get("order", "said"), {})[r["qid"]] = r
    rows = []
    for (ret, k, m), od in sorted(by.items()):
        if m == "none" or "rank" not in od or "said" not in od:
            continue
        refs = by.get((ret, k, "reprefill"), {})
        qs = sorted(set(od["rank"]) & set(od["said"]) & set(refs.get("rank", {})) & set(refs.get("said", {})))
        if not qs:
            continue
        c = lambda d: [float(d[q]["contains"]) for q in qs]  # noqa: E731
        row = dict(retrieval=ret, k=k, method=m, n=len(qs),
                   rank=sum(c(od["rank"])) / len(qs), said=sum(c(od["said"])) / len(qs),
                   d_said_rank=paired_bootstrap(c(od["said"]), c(od["rank"]), reps),
                   d_said_vs_ref_rank=paired_bootstrap(c(od["said"]), c(refs["rank"]), reps))
        if m != "reprefill":
            row["d_vs_ref_rank"] = paired_bootstrap(c(od["rank"]), c(refs["rank"]), reps)
            row["d_vs_ref_said"] = paired_bootstrap(c(od["said"]), c(refs["said"]), reps)
        rows.append(row)
    return rows


def order_markdown(rows):
    if not rows:
        return ""
    pp = lambda d: "%+.1f pp (%+.1f, %+.1f)" % tuple(100 * x for x in d) if d else "–"  # noqa: E731
    body = [[r["retrieval"], r["k"], r["method"], r["n"], "%.1f%%" % (100 * r["rank"]), "%.1f%%" % (100 * r["said"]),
             pp(r["d_said_rank"]), pp(r.get("d_vs_ref_rank")), pp(r.get("d_vs_ref_said")),
             pp(r["d_said_vs_ref_rank"])] for r in rows]
    return ("\n### Order: facts in rank order against the order they were said (contains, paired per question, "
            "95% bootstrap CIs)\n\n" +
            common.table(["retrieval", "k", "method", "n", "rank", "said", "Δ said − rank",
                          "Δ vs reprefill, rank", "Δ vs reprefill, said", "Δ said − reprefill rank"], body) + "\n")


def markdown(rows, title_lines):
    out = list(title_lines)
    for ret in sorted({r["retrieval"] for r in rows}):
        out.append("\n### Retrieval: %s\n" % ret)
        hdr = ["k", "order", "method", "n", "contains (95% CI)", "exact (95% CI)", "Δ contains vs reprefill (95% CI)",
               "gold log-prob", "Δ log-prob (95% CI)", "KL vs reprefill mean / max", "KL vs fp32 store mean / max"]
        if ret == "search":
            hdr.insert(4, "recall@k")
        body = []
        for r in [r for r in rows if r["retrieval"] == ret]:
            pct = lambda t: "%.1f%% (%.1f–%.1f)" % (100 * t[0], 100 * t[1], 100 * t[2])  # noqa: E731
            d = r.get("d_contains")
            dl = r.get("d_logprob")
            line = [r["k"], r["order"], r["method"], r["n"], pct(r["contains"]), pct(r["exact"]),
                    "%+.1f pp (%+.1f, %+.1f)" % tuple(100 * x for x in d) if d else "–",
                    "%.3f" % r["gold_logprob"],
                    "%+.3f (%+.3f, %+.3f)" % dl if dl else "–",
                    "%s / %s" % (common.fmt(r["kl_mean"], ".2e"), common.fmt(r["kl_max"], ".2e")),
                    "%s / %s" % (common.fmt(r["kl_vs_fp32_mean"], ".2e"), common.fmt(r["kl_vs_fp32_max"], ".2e"))
                    if "kl_vs_fp32_mean" in r else "–"]
            if ret == "search":
                line.insert(4, common.fmt(r.get("recall"), ".3f") if r.get("recall") is not None else "–")
            body.append(line)
        out.append(common.table(hdr, body))
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------- main

def load_model(path, dtype, device, attn, torch):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    kw = {}
    d = path
    if path.endswith(".gguf"):
        d, f = os.path.split(os.path.abspath(path))
        kw = dict(gguf_file=f)
    tok = AutoTokenizer.from_pretrained(d, **kw)
    last = None
    for impl in [attn, "eager"]:
        try:
            model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation=impl, **kw)
            break
        except (ValueError, ImportError) as e:
            last = e
    else:
        raise last
    model = model.to(device).eval()
    common.check_rope_buffers(model)
    return model, tok


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("KVI_VLLM_MODEL"),
                    help="a model directory or a .gguf file (transformers dequantizes); default $KVI_VLLM_MODEL "
                         "(tests/vllm/launch.py sets it)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--users", type=int, default=50)
    ap.add_argument("--questions-per-user", type=int, default=10)
    ap.add_argument("--ks", default="5,10,20,50")
    ap.add_argument("--retrieval", default="oracle,search")
    ap.add_argument("--embedder", default="mean", choices=["mean", "minilm"],
                    help="search's embeddings: mean (the model's mean hidden state, --embed-layer) or minilm (a "
                         "sentence-transformers directory, --embedder-path, through the gateway's loader)")
    ap.add_argument("--embedder-path", default=os.environ.get("KVI_EMBEDDER", DEFAULT_EMBEDDER),
                    help="the sentence embedder's directory (default $KVI_EMBEDDER or %s)" % DEFAULT_EMBEDDER)
    ap.add_argument("--order", default="said",
                    help="fact layouts, comma-separated: said (the order the user said them) and/or rank (search: "
                         "best first; oracle: shuffled); each cell is run in each order, paired per question")
    ap.add_argument("--windows", default="0,32,128,all")
    ap.add_argument("--stores", default="fp32,bf16,fp8",
                    help="storage dtypes, comma-separated: fp32, bf16, fp16, fp8, q4 (4-bit, 16-token pages), "
                    "q4p64 (4-bit, 64-token pages)")
    ap.add_argument("--no-none", dest="none", action="store_false", help="leave out the no-memory rows")
    ap.add_argument("--max-new", type=int, default=10)
    ap.add_argument("--embed-layer", type=int, default=0, help="hidden state layer of the embedding "
                    "(default 0: the input embeddings, which rank best on these facts)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="tokens per encoding batch "
                    "(default 16384 on cuda, 2048 on cpu)")
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--resume", action="store_true", help="with --json: keep the records of an earlier run of the "
                    "same configuration written there, run only the questions it has not done, write all")
    ap.add_argument("--md", default=None)
    ap.add_argument("--label", default="")
    ap.add_argument("--check", action="store_true", help="CI assertions (see the docstring)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds from the start after which no new question is started")
    return ap.parse_args(argv)


def run(args, methods=None):
    torch, transformers = common.need_torch_transformers()
    kvi = common.need_kvinject()
    device = common.pick_device(args.device, torch, kvi)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.set_grad_enabled(False)
    if args.batch_tokens is None:
        args.batch_tokens = 16384 if device.startswith("cuda") else 2048
    t_start = time.time()
    model, tok = load_model(args.model, getattr(torch, args.dtype), device, args.attn, torch)
    t_load = time.time() - t_start
    users = recall_data.generate(args.seed, args.users)
    corpus = Corpus(tok, users)
    questions = recall_data.questions_of(users, args.questions_per_user)
    n_questions = len(questions)
    prior, done_before = resume_records(args)
    questions = [q for q in questions if q.qid not in done_before]
    if done_before:
        log("resuming %s: %d questions done, %d to go" % (args.json, len(done_before), len(questions)))
    bench = Bench(args, torch, kvi, model, tok, corpus, device)
    methods = methods if methods is not None else make_methods(args)
    t0 = time.time()
    log("model loaded (%.1fs): %d users, %d questions, %d facts" % (t_load, len(users), len(questions),
                                                                     len(corpus.fact_ids)))
    for m in methods:
        m.setup(bench)
        log("setup %s" % m.name)
    t_setup = time.time() - t0
    ks = [int(x) for x in args.ks.split(",")]
    rets = args.retrieval.split(",")
    orders = args.order.split(",")
    if set(orders) - {"rank", "said"}:
        raise SystemExit("--order: rank and/or said, got %r" % args.order)
    records = []
    t0 = time.time()
    if args.none:
        none = [type("NoMemory", (Reprefill,), {"name": "none"})()]
        for q in questions:
            for rec in run_cell(bench, make_cell(corpus, q, [], none=True), none):
                rec["kl"] = None  # its own reference: no KL against reprefill
                for ret in rets:
                    for k in ks:
                        for order in orders:
                            records.append(dict(rec, retrieval=ret, k=k, order=order))
    t_none = time.time() - t0
    log("no-memory rows: %.1fs" % t_none)
    search_hits = {}
    if "search" in rets:
        qe = bench.question_embeddings(questions)
        st = bench.window_stores(0)["fp32"]
        res = st.search(qe.to(device), [q.user for q in questions], max(ks))
        for i, q in enumerate(questions):
            search_hits[q.qid] = [f for f, _ in res[i]]
    t0 = time.time()
    cells, asked = 0, 0
    for q in questions:  # questions outermost: a time limit leaves whole questions
        if args.time_limit and time.time() - T0 > args.time_limit:
            log("time limit (%ds): stopped after %d of %d questions" % (args.time_limit, asked, len(questions)))
            break
        for ret in rets:
            for k in ks:
                if ret == "oracle":
                    ranked = oracle_selection(corpus, q, k, args.seed)
                    random.Random("%d/%d/%d/rank" % (args.seed, q.qid, k)).shuffle(ranked)  # no ranker: shuffled
                    rec_k = None
                elif ret == "prefix":  # the user's first k facts: nall's context is the prompt's own
                    ranked = list(range(min(k, len(corpus.users[q.user].facts))))
                    rec_k = None
                else:
                    ranked = search_hits[q.qid][:k]
                    rec_k = float(all(g in ranked for g in q.gold))
                for order in orders:
                    if order == "rank" and ret == "prefix":
                        continue  # its rank is the said order
                    sel = ranked if order == "rank" else sorted(ranked)
                    for rec in run_cell(bench, make_cell(corpus, q, sel), methods):
                        records.append(dict(rec, retrieval=ret, k=k, recall=rec_k, order=order))
                    cells += 1
        asked += 1
        if asked % 10 == 0:
            log("%d questions, %d cells" % (asked, cells))
            if args.json and args.resume:  # a checkpoint: a run killed later resumes from here
                d = {x.qid for x in questions[:asked]}
                write_json(args.json, dict(args=vars(args), records=prior + [
                    {k: v for k, v in r.items() if k != "tokens"} for r in records if r["qid"] in d]))
    t_cells = time.time() - t0
    done = {q.qid for q in questions[:asked]}
    records = [r for r in records if r["qid"] in done]  # no-memory rows of questions not reached go too
    records = prior + records
    done |= done_before
    asked_qs = [q for q in recall_data.questions_of(users, args.questions_per_user) if q.qid in done]
    rows = summarize(records, args.bootstrap)
    dev = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU (%d threads)" % torch.get_num_threads()
    times = dict(load=t_load, setup=t_setup, none=t_none, cells=t_cells, cells_n=cells,
                 per_cell=t_cells / max(cells, 1), total=time.time() - t_start, **bench.timing)
    title = ["## Recall on %s%s" % (os.path.basename(args.model.rstrip("/")), " (%s)" % args.label if args.label else ""),
             "",
             "- device: %s; torch %s, transformers %s; libkvinject %s; model %s, %s attention" % (
                 dev, torch.__version__, transformers.__version__, kvi.version(), args.dtype,
                 model.config._attn_implementation),
             "- %d users (seed %d), %d questions (%d referring to an earlier fact), k = %s, retrieval %s "
             "(search embedder: %s), orders %s, max %d new tokens"
             % (args.users, args.seed, len(asked_qs), sum(q.referring for q in asked_qs), args.ks, args.retrieval,
                bench.embedder.name if bench.embedder is not None else "mean of layer %d" % args.embed_layer,
                args.order, args.max_new),
             "- times (s): " + ", ".join("%s %.1f" % (k, v) if isinstance(v, float) else "%s %d" % (k, v)
                                         for k, v in times.items())]
    for dn in bench.store_dtypes:
        if dn == "fp32":
            continue
        ex = [r["kl"] for r in records if r["method"] == "exact-%s" % dn]
        sib = [r["kl_vs_fp32"] for r in records if r["method"].endswith("-" + dn) and "kl_vs_fp32" in r]
        if ex:
            title.append("- %s storage cost: first-token KL of exact-%s vs reprefill mean %.2e, max %.2e (%d cells); "
                         "of every %s store vs its fp32 twin mean %.2e, max %.2e (%d rows)"
                         % (dn, dn, sum(ex) / len(ex), max(ex), len(ex), dn, sum(sib) / max(len(sib), 1),
                            max(sib) if sib else float("nan"), len(sib)))
    title.append("- questions done: %d of %d (%s)" % (len(done), n_questions,
                                                     "complete" if len(done) == n_questions else "incomplete: "
                                                     "run again with --resume to go on"))
    md = markdown(rows, title)
    orows = order_rows(records, args.bootstrap)
    md += order_markdown(orows) + storage_markdown(rows)
    ok = True
    if args.check:
        ok, lines = check(records)
        md += "\n" + "\n".join("- " + x for x in lines) + "\n"
    print(md, flush=True)
    if args.json:
        write_json(args.json, dict(args=vars(args), times=times, rows=rows, order_rows=orows, device=dev,
                                   records=[{k: v for k, v in r.items() if k != "tokens"} for r in records]))
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    bench.close()
    return ok


def write_json(path, obj):
    """Writes obj to path through a temporary file renamed when whole (--resume reads it)."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


RESUME_KEYS = ("model", "dtype", "seed", "users", "questions_per_user", "ks", "retrieval", "windows", "stores",
               "none", "max_new", "embed_layer", "embedder", "order")


def resume_records(args):
    """With --resume and an existing --json of the same configuration: its
    records and the questions they cover (which this run leaves out)."""
    if not (args.resume and args.json and os.path.exists(args.json)):
        return [], set()
    with open(args.json) as f:
        prior = json.load(f)
    pa = prior.get("args", {})
    diff = [k for k in RESUME_KEYS if pa.get(k) != getattr(args, k, None)]
    if diff:
        raise SystemExit("--resume: %s was written with other %s" % (args.json, ", ".join(
            "%s (%r, now %r)" % (k, pa.get(k), getattr(args, k, None)) for k in diff)))
    recs = prior.get("records", [])
    return recs, {r["qid"] for r in recs}


def check(records):
    by = {}
    for r in records:
        by.setdefault((r["retrieval"], r["k"], r["qid"], r.get("order", "said")), {})[r["method"]] = r
    worst, diff, ctrl = 0.0, [], []
    for key, ms in by.items():
        e, ref = ms.get("exact-fp32"), ms.get("reprefill")
        if e is None or ref is None:
            continue
        worst = max(worst, e["kl"])
        if e.get("tokens") is not None and ref.get("tokens") is not None and e["tokens"] != ref["tokens"]:
            diff.append((key, e["answer"], ref["answer"]))
        c = ms.get("exact-fp32-shift7")
        if c is not None:
            ctrl.append(c["kl"])
    ok = True
    lines = ["check: %d cells; exact-fp32 max first-token KL vs reprefill %.3e (must be < 1e-6)" % (len(by), worst)]
    pre = [ms["nall-fp32"] for (ret, _, _, _), ms in by.items() if ret == "prefix" and "nall-fp32" in ms]
    if pre:  # the notes encoding over the user's first k facts is the prompt's own prefill
        w = max(r["kl"] for r in pre)
        lines.append("check: nall-fp32 on the user's first k facts (retrieval prefix): %d cells, max first-token "
                     "KL vs reprefill %.3e (must be < 1e-6)" % (len(pre), w))
        ok &= w < 1e-6
    ok &= worst < 1e-6 and len(by) > 0
    lines.append("check: exact-fp32 greedy answers differing from reprefill: %d %s" % (len(diff), diff[:3]))
    ok &= not diff
    if ctrl:
        mean = sum(ctrl) / len(ctrl)
        lines.append("check: control (exact positions shifted by 7): mean KL %.3e (must be > 1e-4), min %.3e"
                     % (mean, min(ctrl)))
        ok &= mean > 1e-4
    lines.append("check: %s" % ("PASS" if ok else "FAIL"))
    return ok, lines


def main(argv=None):
    args = parse_args(argv)
    if not args.model:
        print("error: no --model (and no KVI_VLLM_MODEL)", file=sys.stderr)
        return 2
    return 0 if run(args) else 1


if __name__ == "__main__":
    sys.exit(main())
