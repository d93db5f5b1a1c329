"""Facts computed without vLLM, for the connector's controls: pre-RoPE keys and
values of a prompt from Hugging Face transformers (the k_proj / v_proj outputs
of every layer: Llama keys before their rotation), and a store file holding

- HF_TENANT: those facts (another engine's KV: close to vLLM's, not equal),
- WRONG_ROPE_TENANT: the same with every key rotated WRONG_ROPE_SHIFT positions
  further (float64), so that injected keys carry the wrong rotation,
- ZERO_TENANT: zeros of the same sizes (and of the isolation prompt's facts).

The store is made with the model geometry and RoPE the connector derives from
the same config (kvinject.hf), fp32, so the connector can load it.
"""
from __future__ import annotations

import common as C


def prekv(model_dir, ids):
    """K, V of [layers, tokens, kv_heads, head_size] (fp32) for a prompt."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager")
    model.eval()
    cfg = model.config
    H, D = cfg.num_key_value_heads, cfg.head_dim
    ks, vs, hooks = {}, {}, []
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        hooks.append(a.k_proj.register_forward_hook(lambda m, inp, out, i=i: ks.__setitem__(i, out)))
        hooks.append(a.v_proj.register_forward_hook(lambda m, inp, out, i=i: vs.__setitem__(i, out)))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    L, T = len(model.model.layers), len(ids)
    K = torch.stack([ks[i][0].reshape(T, H, D) for i in range(L)]).float()
    V = torch.stack([vs[i][0].reshape(T, H, D) for i in range(L)]).float()
    return K, V, cfg


def rotate_keys(K, shift, theta):
    """NeoX rotation of pre-RoPE keys by `shift` positions, in float64."""
    import torch
    D = K.shape[-1]
    half = D // 2
    inv = theta ** (-torch.arange(0, half, dtype=torch.float64) * 2.0 / D)
    ang = shift * inv
    c, s = torch.cos(ang), torch.sin(ang)
    x = K.double()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, b * c + a * s], -1).float()


def make_store_file(path, sc):
    """Writes the control store file; returns {tenant: [(fact_id, tokens)]} of what it holds."""
    import torch
    import kvinject as kvi
    from kvinject.hf import kvi_model_for, rope_parameters
    segs = [sc.header] + sc.facts[1]
    ids = [t for s in segs for t in s]
    K, V, cfg = prekv(C.MODEL, ids + sc.questions[0])
    theta = float(rope_parameters(cfg)["rope_theta"])
    model = kvi_model_for(cfg)
    store = kvi.Store(model, 64 << 20, backend=kvi.Backend.CPU, dtype=kvi.DType.FP32)
    pos = 0
    for fid, seg in zip([C.HEADER_ID] + C.FACT_IDS, segs):
        k, v = K[:, pos:pos + len(seg)].contiguous(), V[:, pos:pos + len(seg)].contiguous()
        store.put(C.HF_TENANT, fid, k, v, token_ids=seg)
        store.put(C.WRONG_ROPE_TENANT, fid, rotate_keys(k, C.WRONG_ROPE_SHIFT, theta), v, token_ids=seg)
        store.put(C.ZERO_TENANT, fid, torch.zeros_like(k), torch.zeros_like(v), token_ids=seg)
        pos += len(seg)
    for fid, seg in zip(C.ISO_IDS, sc.iso_facts):
        z = torch.zeros(K.shape[0], len(seg), K.shape[2], K.shape[3])
        store.put(C.ZERO_TENANT, fid, z, z, token_ids=seg)
    store.save(path)
    store.close()
    model.close()
