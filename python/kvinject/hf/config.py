"""Hugging Face (transformers) configurations mapped to libkvinject: the
model's KV geometry and its RoPE as kvi_rope_spec fields (:func:`kvi_rope_fields`,
:func:`kvi_model_for`).

Works on transformers 5.x configs (rope_parameters) and the 4.x spellings
(rope_theta, rope_scaling, rotary_pct, partial_rotary_factor), and on any
object with those attributes (vLLM's ``model_config.hf_config`` is a
transformers config); families: Llama (llama3 scaling), Qwen2, Mistral and
the other NeoX-paired models (linear, YaRN scaling, partial rotary as
GPT-NeoX), GPT-J (interleaved pairs), and configs with a RoPE per layer type
(Gemma 3: sliding and full attention layers, :func:`kvi_rope_fields_per_layer`).

The model of the vLLM connector's stores (:func:`store_model`, with the
connector's ``rope`` overrides: :func:`store_rope_fields`) and the names of its
``store_dtype`` setting (``STORE_DTYPES``) are built here from the served
model's config; kvinject.vllm.retrieval gives them too.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from ..enums import DType, RopeScaling, RopeStyle
from ..model import Model


def head_dim_of(config) -> int:
    """The attention head size: ``head_dim``, else hidden_size / heads."""
    hd = getattr(config, "head_dim", None)
    return hd or config.hidden_size // config.num_attention_heads


def kv_heads_of(config) -> int:
    """KV heads: ``num_key_value_heads``, else the attention heads (no GQA)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _per_type(rp) -> bool:
    return isinstance(rp, dict) and bool(rp) and all(isinstance(v, dict) for v in rp.values())


def rope_parameters(config, layer_type: Optional[str] = None) -> dict:
    """The config's RoPE parameters as one dict (transformers 5 rope_parameters;
    4.x rope_theta + rope_scaling folded in). Configs with a RoPE per layer type
    (rope_parameters keyed by ``config.layer_types``' names, e.g. Gemma 3's
    sliding_attention / full_attention): ``layer_type``'s, by default
    full_attention's."""
    rp = getattr(config, "rope_parameters", None)
    if _per_type(rp):
        t = layer_type or ("full_attention" if "full_attention" in rp else None)
        if t not in rp:
            raise KeyError("rope_parameters has layer types %s; %r is not one" % (sorted(rp), layer_type))
        return dict(rp[t])
    if isinstance(rp, dict) and rp:
        return dict(rp)
    out = dict(getattr(config, "rope_scaling", None) or {})
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out.pop("type")
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = getattr(config, "rotary_emb_base", 10000.0)
    out.setdefault("rope_theta", theta)
    if getattr(config, "rotary_pct", None) is not None:
        out.setdefault("partial_rotary_factor", config.rotary_pct)
    if getattr(config, "partial_rotary_factor", None) is not None:
        out.setdefault("partial_rotary_factor", config.partial_rotary_factor)
    return out


def kvi_rope_fields(config, layer_type: Optional[str] = None) -> dict:
    """The kvi_rope_spec fields (keyword arguments of :meth:`kvinject.Model.set_rope`)
    that reproduce the RoPE of a transformers config: pairing (NeoX half split vs
    GPT-J interleaved), rotary_dim (partial rotary), theta and the scaling fields
    (``layer_type``: see :func:`rope_parameters`; :func:`kvi_rope_fields_per_layer`
    gives every layer its own). Raises NotImplementedError for RoPE kinds without a
    fixed rotation (dynamic NTK) or without a mapping here; the result always
    names a style, so the RoPE is set explicitly."""
    mt = getattr(config, "model_type", None)
    hd = head_dim_of(config)
    rp = rope_parameters(config, layer_type)
    if mt == "gptj":
        # GPT-J: sin/cos table of rotary_dim dims, base 10000 hard-coded, pairs
        # (x_2i, x_2i+1) (rotate_every_two)
        rot = config.rotary_dim or hd
        return dict(style=RopeStyle.GPTJ, rotary_dim=rot, theta=10000.0)
    f = dict(style=RopeStyle.NEOX)  # rotate_half: pairs (x_i, x_i+rot/2)
    prf = float(rp.get("partial_rotary_factor", 1.0) or 1.0)
    rot = int(hd * prf)
    f["rotary_dim"] = rot
    f["theta"] = float(rp.get("rope_theta", 10000.0))
    rtype = rp.get("rope_type", "default")
    if rtype == "default":
        pass
    elif rtype == "linear":
        f.update(scaling=RopeScaling.LINEAR, factor=float(rp["factor"]))
    elif rtype == "llama3":
        f.update(scaling=RopeScaling.LLAMA3, factor=float(rp["factor"]),
                 low_freq_factor=float(rp["low_freq_factor"]), high_freq_factor=float(rp["high_freq_factor"]),
                 original_max_position=int(rp["original_max_position_embeddings"]))
    elif rtype == "yarn":
        omp = rp.get("original_max_position_embeddings") or config.max_position_embeddings
        f.update(scaling=RopeScaling.YARN, factor=float(rp["factor"]), original_max_position=int(omp),
                 beta_fast=float(rp.get("beta_fast") or 32.0), beta_slow=float(rp.get("beta_slow") or 1.0),
                 yarn_truncate=1 if rp.get("truncate", True) else 0)
        if rp.get("attention_factor") is not None:
            f["attention_factor"] = float(rp["attention_factor"])
        elif rp.get("mscale") or rp.get("mscale_all_dim"):
            raise NotImplementedError("yarn with mscale/mscale_all_dim: pass attention_factor explicitly")
    else:
        # dynamic NTK changes frequencies with the sequence length: no fixed
        # rotation to store keys against
        raise NotImplementedError("rope_type %r has no kvi_rope_spec mapping here" % rtype)
    return f


def kvi_rope_fields_per_layer(config) -> List[dict]:
    """kvi_rope_fields of each layer: one dict per layer, each its layer type's RoPE
    where the config has a RoPE per layer type (``layer_types`` and rope_parameters
    keyed by them), else the same for every layer."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if _per_type(getattr(config, "rope_parameters", None)) and types:
        if len(types) != n:
            raise ValueError("config.layer_types has %d entries for %d layers" % (len(types), n))
        by_type = {t: kvi_rope_fields(config, t) for t in set(types)}
        return [dict(by_type[t]) for t in types]
    f = kvi_rope_fields(config)
    return [dict(f) for _ in range(n)]


def kvi_model_for(config, rope_fields=None, *, tp_rank: int = 0, tp_size: int = 1) -> Model:
    """A :class:`kvinject.Model` with the geometry and RoPE of a transformers config,
    RoPE set explicitly on every layer: ``rope_fields`` on all of them, else each
    layer's :func:`kvi_rope_fields_per_layer`."""
    m = Model(num_layers=config.num_hidden_layers, num_kv_heads=kv_heads_of(config),
              head_size=head_dim_of(config), tp_rank=tp_rank, tp_size=tp_size)
    if rope_fields is not None:
        m.set_rope(**rope_fields)
        return m
    per_layer = kvi_rope_fields_per_layer(config)
    if all(f == per_layer[0] for f in per_layer):
        m.set_rope(**per_layer[0])
    else:
        for i, f in enumerate(per_layer):
            m.set_rope(layer=i, **f)
    return m


# --------------------------------------------------- the vLLM connector's stores

STORE_DTYPES = {"fp32": DType.FP32, "bf16": DType.BF16, "fp16": DType.FP16, "fp8_e4m3": DType.FP8_E4M3,
                "q4": DType.Q4}


def store_rope_fields(hf_config, overrides: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The kvi_rope_spec fields the connector sets on every layer: those of the
    model's config (kvinject.hf.kvi_rope_fields) updated with the connector's
    ``rope`` setting (enum fields may be given by name)."""
    rope = kvi_rope_fields(hf_config)
    for k, v in (overrides or {}).items():
        if k == "style" and isinstance(v, str):
            v = RopeStyle[v]
        elif k == "scaling" and isinstance(v, str):
            v = RopeScaling[v]
        rope[k] = v
    return rope


def store_model(hf_config, overrides: Optional[Mapping[str, Any]] = None, *, num_layers: Optional[int] = None,
                tp_rank: int = 0, tp_size: int = 1) -> Model:
    """The kvinject Model of the connector's stores for a transformers config:
    geometry, tensor-parallel slice and RoPE (explicit on every layer)."""
    rope = store_rope_fields(hf_config, overrides)
    if num_layers is None or num_layers == hf_config.num_hidden_layers:
        return kvi_model_for(hf_config, rope, tp_rank=tp_rank, tp_size=tp_size)
    m = Model(num_layers=num_layers, num_kv_heads=kv_heads_of(hf_config), head_size=head_dim_of(hf_config),
              tp_rank=tp_rank, tp_size=tp_size)
    m.set_rope(**rope)
    return m
