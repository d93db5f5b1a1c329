"""Hugging Face (transformers) configurations mapped to libkvinject: the model's
KV geometry and its RoPE as kvi_rope_spec fields.

Works on transformers 5.x configs (rope_parameters) and the 4.x spellings
(rope_theta, rope_scaling, rotary_pct, partial_rotary_factor), and on any
object with those attributes (vLLM's ``model_config.hf_config`` is a
transformers config). transformers is never imported here. The mapping is what
python/harness/hf_parity.py proves against the models themselves.
"""
from __future__ import annotations

from .enums import RopeScaling, RopeStyle
from .model import Model


def head_dim_of(config) -> int:
    """The attention head size: ``head_dim``, else hidden_size / heads."""
    hd = getattr(config, "head_dim", None)
    return hd or config.hidden_size // config.num_attention_heads


def kv_heads_of(config) -> int:
    """KV heads: ``num_key_value_heads``, else the attention heads (no GQA)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def rope_parameters(config) -> dict:
    """The config's RoPE parameters as one dict (transformers 5 rope_parameters;
    4.x rope_theta + rope_scaling folded in)."""
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and rp:
        if "full_attention" in rp and isinstance(rp["full_attention"], dict):  # per-layer-type form
            rp = rp["full_attention"]
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


def kvi_rope_fields(config) -> dict:
    """The kvi_rope_spec fields (keyword arguments of :meth:`kvinject.Model.set_rope`)
    that reproduce the RoPE of a transformers config: pairing (NeoX half split vs
    GPT-J interleaved), rotary_dim (partial rotary), theta and the scaling fields.
    Raises NotImplementedError for RoPE kinds without a fixed rotation (dynamic
    NTK) or without a mapping here; the result always names a style, so the
    RoPE is set explicitly."""
    mt = getattr(config, "model_type", None)
    hd = head_dim_of(config)
    rp = rope_parameters(config)
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


def kvi_model_for(config, rope_fields=None, *, tp_rank: int = 0, tp_size: int = 1) -> Model:
    """A :class:`kvinject.Model` with the geometry and RoPE of a transformers config
    (RoPE set explicitly on every layer: ``rope_fields``, else kvi_rope_fields)."""
    m = Model(num_layers=config.num_hidden_layers, num_kv_heads=kv_heads_of(config),
              head_size=head_dim_of(config), tp_rank=tp_rank, tp_size=tp_size)
    m.set_rope(**(rope_fields if rope_fields is not None else kvi_rope_fields(config)))
    return m
