"""Hugging Face (transformers) helpers.

- :mod:`kvinject.hf.config`: configurations mapped to libkvinject, the model's
  KV geometry and its RoPE as kvi_rope_spec fields (:func:`kvi_rope_fields`,
  :func:`kvi_model_for`). Works on transformers 5.x configs (rope_parameters)
  and the 4.x spellings (rope_theta, rope_scaling, rotary_pct,
  partial_rotary_factor), and on any object with those attributes (vLLM's
  ``model_config.hf_config`` is a transformers config); families: Llama
  (llama3 scaling), Qwen2, Mistral and the other NeoX-paired models (linear,
  YaRN scaling, partial rotary as GPT-NeoX), GPT-J (interleaved pairs), and
  configs with a RoPE per layer type (Gemma 3: sliding and full attention
  layers, :func:`kvi_rope_fields_per_layer`).
- :mod:`kvinject.hf.cache`: a cache's per-layer tensors (:func:`cache_tensors`)
  and a StaticCache's length (:func:`set_cache_length`).
- :mod:`kvinject.hf.static_cache`: :class:`StaticCacheInjector` (injects a
  store's facts into a StaticCache: appends them at the cache's length, checks
  they fit, sets the cache's length after them, and re-reads the layout when
  the cache's tensors move). ``CacheLayout.hf(cache)`` makes a layout that
  refuses to be used once the cache replaced its tensors.
- :mod:`kvinject.hf.recompute`: selective recompute of injected facts in
  transformers' Llama-family decoders (:func:`kvinject.hf.recompute.recompute`).
- :mod:`kvinject.hf.testing`: what the tests and the benchmarks (kvinject_bench)
  share: random-weight models of each RoPE family, the check of a config's
  mapping against the model's own cos/sin, selective recompute cases.

transformers and torch are never imported at import (objects are read through
their attributes; kvinject.hf.recompute imports them when called). The
mappings are what kvinject_bench.hf_parity proves against the models
themselves, and python/tests/test_hf.py against a tiny Llama and SmolLM2-135M.
"""
from __future__ import annotations

from .cache import cache_tensors, is_hf_cache, set_cache_length
from .config import (head_dim_of, kv_heads_of, kvi_model_for, kvi_rope_fields, kvi_rope_fields_per_layer,
                     rope_parameters)
from .static_cache import StaticCacheInjector
