"""kvinject.vllm: libkvinject inside vLLM (a KV connector, v1 API).

- :mod:`kvinject.vllm.connector`: ``KVInjectConnector``, loaded by vLLM through
  ``KVTransferConfig(kv_connector="KVInjectConnector",
  kv_connector_module_path="kvinject.vllm.connector", kv_role="kv_both",
  kv_connector_extra_config={...})``. Importing it imports vLLM.
- :mod:`kvinject.vllm.prompt`: the per-request parameters and the helpers that
  build prompts with them (:func:`memory_prompt`, :func:`capture_prompt`,
  :func:`remove_prompt`).
- :mod:`kvinject.vllm.layout`: the cache layout of vLLM's backends
  (:func:`derive_layout`).

The connector's parts, in the shape of vLLM's own connectors: ``scheduler``
(the scheduler role), ``worker`` (the worker role), ``metadata`` (what the
scheduler sends the workers each step), ``results`` (what the workers send
back, and each request's outcome), ``stats`` (statistics and Prometheus
metrics), ``config`` (the settings: kvinject.settings) and ``_compat``, the one
module that reads vLLM's internals.

This package imports neither vLLM nor torch; only the connector module does.
"""
from .layout import LayoutError, derive_layout
from .prompt import (PARAMS_KEY, RESULT_TOKENS, Keep, MemoryPrompt, capture_prompt, memory_prompt,
                     notes_capture_prompts, parse_params, prefetch_prompt, remove_prompt)
from .retrieval import MemoryIndex

CONNECTOR = "KVInjectConnector"
MODULE = "kvinject.vllm.connector"


def kv_transfer_config(**extra):
    """vllm.config.KVTransferConfig for this connector; keyword arguments are its
    kv_connector_extra_config (imports vLLM)."""
    from vllm.config import KVTransferConfig
    return KVTransferConfig(kv_connector=CONNECTOR, kv_connector_module_path=MODULE, kv_role="kv_both",
                            kv_connector_extra_config=dict(extra))


__all__ = ["CONNECTOR", "MODULE", "Keep", "LayoutError", "MemoryIndex", "MemoryPrompt", "PARAMS_KEY", "RESULT_TOKENS",
           "capture_prompt", "derive_layout", "kv_transfer_config", "memory_prompt", "notes_capture_prompts",
           "parse_params", "prefetch_prompt", "remove_prompt"]
