"""The connector's settings: ``kv_connector_extra_config`` parsed and checked
once, for both roles (the keys are listed in kvinject.vllm.connector's
docstring). An unknown key is refused, so a misspelt setting never goes
unnoticed. No vLLM import here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

KNOWN = ("store_budget_mb", "store_dtype", "page_tokens", "embedding_dim", "layerwise", "events_path", "rope",
         "store_path", "time_device")


@dataclass(frozen=True)
class KVInjectConfig:
    """The settings of one connector (defaults as documented in kvinject.vllm.connector)."""

    block_size: int                        # vLLM's (cache_config.block_size), not a setting
    store_budget_mb: int = 256
    store_dtype: str = "fp32"              # a key of kvinject.vllm.retrieval.STORE_DTYPES
    page_tokens: int = 16
    embedding_dim: int = 0
    store_path: Optional[str] = None
    layerwise: bool = False
    time_device: bool = False
    events_path: Optional[str] = None
    rope: Optional[Mapping[str, Any]] = None

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]], block_size: int) -> "KVInjectConfig":
        """Parses a kv_connector_extra_config (None: every default). Raises
        ValueError naming unknown keys."""
        extra = dict(extra or {})
        unknown = set(extra) - set(KNOWN)
        if unknown:
            raise ValueError("kvinject connector: unknown kv_connector_extra_config keys %s (known: %s)"
                             % (sorted(unknown), ", ".join(sorted(KNOWN))))
        return cls(block_size=block_size,
                   store_budget_mb=int(extra.get("store_budget_mb", 256)),
                   store_dtype=extra.get("store_dtype", "fp32"),
                   page_tokens=int(extra.get("page_tokens", 16)),
                   embedding_dim=int(extra.get("embedding_dim", 0)),
                   store_path=extra.get("store_path"),
                   layerwise=bool(extra.get("layerwise", False)),
                   time_device=bool(extra.get("time_device", False)),
                   events_path=extra.get("events_path"),
                   rope=extra.get("rope"))

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "KVInjectConfig":
        """The settings of vLLM's kv_transfer_config, with vLLM's block size."""
        return cls.from_extra(extra_config(vllm_config), vllm_config.cache_config.block_size)


def extra_config(vllm_config) -> Dict[str, Any]:
    """vLLM's kv_connector_extra_config (a copy; empty when unset)."""
    ktc = vllm_config.kv_transfer_config
    return dict(getattr(ktc, "kv_connector_extra_config", None) or {})


def requires_piecewise(extra: Optional[Mapping[str, Any]]) -> bool:
    """Whether these settings need vLLM's piecewise CUDA graphs (``layerwise``)."""
    return bool((extra or {}).get("layerwise", False))
