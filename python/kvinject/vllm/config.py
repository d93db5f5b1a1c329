"""The connector's settings, resolved once for both roles by kvinject.settings
(section ``connector``): vLLM's ``kv_connector_extra_config`` (the explicit
layer) over ``KVINJECT_CONNECTOR_<KEY>`` variables over the ``connector:``
section of the YAML file ``KVINJECT_CONFIG_FILE`` names, over the defaults
below. Every value is checked (type, range, choices) and an unknown key is
refused, so a misspelt setting never goes unnoticed. No vLLM import here.

vLLM 0.32 constructs both of the connector's roles after the model's weights
are loaded (the worker's in ``initialize_from_config``, the scheduler's after
the KV cache is sized); the settings are checked there, before the KV cache
is allocated and before the server listens. With CUDA graphs of full mode,
vLLM asks the connector class earlier, while it builds its configuration
(``requires_piecewise_for_cudagraph``): the settings are checked then too.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from ..settings import Field, resolve

#: the settings, in kv_connector_extra_config, KVINJECT_CONNECTOR_<KEY> and the file's connector: section
FIELDS = (
    Field("store_budget_mb", int, 256, lo=1, hi=1 << 20, doc="memory the store reserves, per worker (MiB)"),
    Field("store_dtype", str, "fp32", choices=("fp32", "bf16", "fp16", "fp8_e4m3", "q4"),
          doc="how facts are kept"),
    Field("page_tokens", int, 16, lo=1, hi=4096, doc="store page size (tokens)"),
    Field("embedding_dim", int, 0, lo=0, hi=65536, doc="embedding values kept with each captured fact"),
    Field("store_path", str, None, doc="store file: loaded at start, kept as the journal"),
    Field("layerwise", bool, False, doc="inject layer by layer (wait_for_layer_load)"),
    Field("time_device", bool, False, doc="time each injecting step on the GPU (events file)"),
    Field("events_path", str, None, doc="JSON-lines event files' prefix"),
    Field("rope", dict, None, doc="kvi_rope_spec fields overriding the model config's"),
    # the disk tier (kvinject/store.h, "Disk tier") and hybrid serving
    Field("disk_dir", str, None, doc="directory of the store's disk tier: one file per tenant, may be shared "
          "by replicas; memory (store_budget_mb) becomes a cache of it"),
    Field("disk_budget_bytes", int, 0, lo=0, hi=(1 << 63) - 1, doc="bytes of tenant files the store may hold "
          "in disk_dir (0: no limit but the file system's)"),
    Field("disk_owner", str, None, doc="this replica's name in the tenants' leases (default <hostname>:<pid>)"),
    Field("disk_lease_ms", int, 30000, lo=1, hi=(1 << 31) - 1, doc="length of a tenant's ownership lease (ms)"),
    Field("hybrid", bool, True, doc="with disk_dir: prefill a fact that is only on disk as text (and prefetch "
          "it) when reading it back is predicted slower than prefilling it"),
    Field("disk_read_mb_s", float, 0.0, lo=0.0, hi=1e7, doc="predicted disk read rate (MB/s) of the hybrid "
          "policy; 0: measured from the injections' reads (1000 until measured)"),
    Field("prefill_tokens_s", float, 5000.0, lo=1.0, hi=1e9, doc="predicted prefill rate (tokens/s) of the "
          "hybrid policy"),
)
KNOWN = tuple(f.name for f in FIELDS)
SECTION = "connector"
SOURCE = "kv_connector_extra_config"


@dataclass(frozen=True)
class KVInjectConfig:
    """The settings of one connector (defaults: FIELDS)."""

    block_size: int                        # vLLM's (cache_config.block_size), not a setting
    store_budget_mb: int = 256
    store_dtype: str = "fp32"              # a key of kvinject.hf.config.STORE_DTYPES
    page_tokens: int = 16
    embedding_dim: int = 0
    store_path: Optional[str] = None
    layerwise: bool = False
    time_device: bool = False
    events_path: Optional[str] = None
    rope: Optional[Mapping[str, Any]] = None
    disk_dir: Optional[str] = None
    disk_budget_bytes: int = 0
    disk_owner: Optional[str] = None
    disk_lease_ms: int = 30000
    hybrid: bool = True
    disk_read_mb_s: float = 0.0
    prefill_tokens_s: float = 5000.0

    def __post_init__(self):
        if self.disk_dir is not None and self.store_path is not None:
            raise ValueError("kvinject settings: store_path and disk_dir are both set; a store with a disk tier "
                             "keeps its facts in disk_dir (one file per tenant) and takes no store file")

    @property
    def hybrid_serving(self) -> bool:
        """Whether the scheduler plans each fact by its tier (a disk tier and ``hybrid``)."""
        return self.disk_dir is not None and self.hybrid

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]], block_size: int,
                   environ: Mapping[str, str] = os.environ) -> "KVInjectConfig":
        """The settings of a kv_connector_extra_config (None: none given) over the
        environment's and the file's. Raises ValueError naming a bad or unknown
        key and where it came from."""
        return cls(block_size=block_size, **resolve_settings(extra, environ))

    @classmethod
    def from_vllm_config(cls, vllm_config, environ: Mapping[str, str] = os.environ) -> "KVInjectConfig":
        """The settings of vLLM's kv_transfer_config, with vLLM's block size."""
        return cls.from_extra(extra_config(vllm_config), vllm_config.cache_config.block_size, environ)


def resolve_settings(extra: Optional[Mapping[str, Any]], environ: Mapping[str, str] = os.environ) -> Dict[str, Any]:
    """{key: value} of every setting (kvinject.settings.resolve, section connector)."""
    return resolve(SECTION, FIELDS, extra, environ=environ, explicit_source=SOURCE)


def extra_config(vllm_config) -> Dict[str, Any]:
    """vLLM's kv_connector_extra_config (a copy; empty when unset)."""
    ktc = vllm_config.kv_transfer_config
    return dict(getattr(ktc, "kv_connector_extra_config", None) or {})


def requires_piecewise(extra: Optional[Mapping[str, Any]], environ: Mapping[str, str] = os.environ) -> bool:
    """Whether these settings need vLLM's piecewise CUDA graphs (``layerwise``).
    Resolves and checks every setting (vLLM calls this while it builds its
    configuration, before any model is loaded): a bad one raises ValueError."""
    return bool(resolve_settings(extra, environ)["layerwise"])
