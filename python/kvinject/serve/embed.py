"""The gateway's embedder: texts to normalized float32 vectors.

- :class:`LocalEmbedder`: a sentence-transformers directory (e.g.
  all-MiniLM-L6-v2) run with transformers and torch, without the
  sentence-transformers package: ``modules.json`` lists the pipeline,
  a Transformer (the directory or its ``path``; ``sentence_bert_config.json``'s
  ``max_seq_length``), then Pooling (``1_Pooling/config.json``: mean, CLS,
  max or mean-sqrt-len tokens) and Normalize when listed.
- :class:`HTTPEmbedder`: an OpenAI-compatible ``/v1/embeddings`` endpoint.

Either way the gateway normalizes the vectors again, so that a search is an
inner product (cosine similarity).
"""
from __future__ import annotations

import json
import os
from typing import List, Sequence

import numpy as np


def _normalize(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float32)
    n = np.linalg.norm(m, axis=1, keepdims=True)
    return m / np.maximum(n, 1e-12)


class LocalEmbedder:
    """A sentence-transformers directory, loaded with transformers (AutoModel,
    AutoTokenizer) and run on the CPU."""

    def __init__(self, path: str, threads: int = 0, batch: int = 32):
        import torch
        from transformers import AutoModel, AutoTokenizer
        self.torch = torch
        if threads:
            torch.set_num_threads(threads)
        with open(os.path.join(path, "modules.json")) as f:
            modules = json.load(f)
        kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
        if not kinds or kinds[0] != "Transformer":
            raise ValueError("%s: the first module is %s, not a Transformer" % (path, kinds[:1]))
        unknown = set(kinds) - {"Transformer", "Pooling", "Normalize"}
        if unknown:
            raise ValueError("%s: modules %s are not supported (Transformer, Pooling, Normalize)"
                             % (path, sorted(unknown)))
        tdir = os.path.join(path, modules[0].get("path") or "")
        self.max_len = 512
        sb = os.path.join(tdir, "sentence_bert_config.json")
        if os.path.exists(sb):
            with open(sb) as f:
                self.max_len = int(json.load(f).get("max_seq_length", 512))
        self.pooling = "cls"
        for m in modules:
            if m["type"].endswith("Pooling"):
                with open(os.path.join(path, m.get("path") or "", "config.json")) as f:
                    pc = json.load(f)
                modes = [k for k in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")
                         if pc.get("pooling_mode_" + k)]
                if len(modes) != 1:
                    raise ValueError("%s: pooling modes %s (one of cls, mean, max, mean_sqrt_len)" % (path, modes))
                self.pooling = modes[0]
        self.normalize = "Normalize" in kinds
        self.tokenizer = AutoTokenizer.from_pretrained(tdir)
        self.model = AutoModel.from_pretrained(tdir, dtype=torch.float32)
        self.model.eval()
        self.batch = batch
        self.dim = int(self.model.config.hidden_size)
        self.name = os.path.basename(os.path.normpath(path))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        torch = self.torch
        out: List[np.ndarray] = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch):
                enc = self.tokenizer(list(texts[i:i + self.batch]), padding=True, truncation=True,
                                     max_length=self.max_len, return_tensors="pt")
                h = self.model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
                if self.pooling == "cls_token":
                    v = h[:, 0]
                elif self.pooling == "max_tokens":
                    v = h.masked_fill(mask == 0, -1e9).max(dim=1).values
                else:
                    s = (h * mask).sum(dim=1)
                    n = mask.sum(dim=1).clamp(min=1e-9)
                    v = s / (n.sqrt() if self.pooling == "mean_sqrt_len_tokens" else n)
                if self.normalize:
                    v = torch.nn.functional.normalize(v, p=2, dim=1)
                out.append(v.numpy().astype(np.float32))
        return _normalize(np.concatenate(out) if out else np.zeros((0, self.dim), np.float32))


class HTTPEmbedder:
    """An OpenAI-compatible embeddings endpoint (``<url>/v1/embeddings``; a URL
    ending in /embeddings is used as it is)."""

    def __init__(self, url: str, model: str = "", timeout: float = 60.0):
        self.url = url.rstrip("/")
        if not self.url.endswith("/embeddings"):
            self.url += "/embeddings" if self.url.endswith("/v1") else "/v1/embeddings"
        self.model = model
        self.timeout = timeout
        self.dim = 0
        self.name = model or self.url

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import httpx
        body = {"input": list(texts)}
        if self.model:
            body["model"] = self.model
        r = httpx.post(self.url, json=body, timeout=self.timeout)
        r.raise_for_status()
        data = sorted(r.json()["data"], key=lambda d: d["index"])
        m = _normalize(np.array([d["embedding"] for d in data], dtype=np.float32))
        self.dim = m.shape[1] if len(m) else self.dim
        return m


def load(spec: str, model: str = "", timeout: float = 60.0):
    """A URL gives an HTTPEmbedder, a directory a LocalEmbedder."""
    if spec.startswith(("http://", "https://")):
        return HTTPEmbedder(spec, model, timeout)
    return LocalEmbedder(spec)
