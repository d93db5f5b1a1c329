"""Selective recompute of injected facts in Hugging Face transformers
(kvinject/recompute.h): after facts are injected into a StaticCache, their
tokens are computed fresh over layers 0..``score_layer`` (every fact token,
attending to the whole injected context), scored there against the store with
:meth:`kvinject.Injector.deviation`, and the tokens :func:`kvinject.recompute_select`
chooses are run through the remaining layers at their slots, attending to every
slot at a position up to their own; their new K and V replace the injected ones.

For Llama-family decoders (Llama, Qwen2, Mistral, SmolLM2: ``model.model.layers[i]``
with ``input_layernorm``, ``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``,
``mlp``; rotary embedding ``model.model.rotary_emb``; full attention, no sliding
window) with a transformers 5.x StaticCache of batch 1. torch and transformers are
imported when a function is called, never at import.

Cost, as a share of a re-prefill of the facts: (score_layer + 1) / L for the fresh
layers plus r * (L - score_layer - 1) / L for the r share of tokens chosen.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

from ..transfer import recompute_select


@dataclasses.dataclass
class RecomputePlan:
    """What one :func:`recompute` call did: ``scores`` (one per fact token, at
    score_layer; empty when nothing was scored), ``chosen`` (token indices into the
    injected span, ascending), ``tokens`` (injected tokens)."""

    scores: List[float]
    chosen: List[int]
    tokens: int


def _layers(model):
    inner = getattr(model, "model", model)
    return inner, list(inner.layers)


def _rotary(inner, hidden, positions):
    return inner.rotary_emb(hidden, positions.unsqueeze(0))


def _layer_step(layer, hidden, cos, sin, layer_keys, layer_values, slots, positions, slot_positions, valid):
    """One decoder layer for `hidden` [1, n, hidden] at `positions` (ints [n]):
    computes their K and V, writes them into the layer's cache tensors
    [1, H, S, D] at `slots`, attends over the cache slots [0, valid) whose
    position (slot_positions [valid]) is at most each query's own, and returns
    the layer's output hidden states."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    attn = layer.self_attn
    hd = attn.head_dim
    n = hidden.shape[1]
    x = layer.input_layernorm(hidden)
    q = attn.q_proj(x).view(1, n, -1, hd).transpose(1, 2)
    k = attn.k_proj(x).view(1, n, -1, hd).transpose(1, 2)
    v = attn.v_proj(x).view(1, n, -1, hd).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    layer_keys[:, :, slots] = k.to(layer_keys.dtype)
    layer_values[:, :, slots] = v.to(layer_values.dtype)
    keys, values = layer_keys[:, :, :valid], layer_values[:, :, :valid]
    groups = q.shape[1] // keys.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    allowed = slot_positions.unsqueeze(0) <= positions.unsqueeze(1)  # [n, valid]
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype),
                                                           attn_mask=mask, scale=attn.scaling)
    out = out.transpose(1, 2).reshape(1, n, -1)
    hidden = hidden + attn.o_proj(out)
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _embed(inner, ids):
    return inner.embed_tokens(ids)


def run_tokens(model, cache, ids, slots, positions, slot_positions, valid, layer_begin=0, layer_end=None,
               hidden=None):
    """Runs tokens `ids` (LongTensor [n]) at cache `slots` and `positions` through
    layers [layer_begin, layer_end) of a Llama-family model, writing their K and V
    into `cache` (a StaticCache) and attending over slots [0, valid) by
    slot_positions. hidden: the input of layer_begin (default: the embeddings,
    layer_begin 0). Returns the output hidden states of layer_end - 1."""
    import torch
    inner, layers = _layers(model)
    layer_end = len(layers) if layer_end is None else layer_end
    dev = next(model.parameters()).device
    slots = torch.as_tensor(slots, dtype=torch.long, device=dev)
    positions = torch.as_tensor(positions, dtype=torch.long, device=dev)
    slot_positions = torch.as_tensor(slot_positions, dtype=torch.long, device=dev)
    if hidden is None:
        if layer_begin != 0:
            raise ValueError("hidden states are needed to start at layer %d" % layer_begin)
        hidden = _embed(inner, torch.as_tensor(ids, device=dev).view(1, -1))
    cos, sin = _rotary(inner, hidden, positions)
    for li in range(layer_begin, layer_end):
        cl = cache.layers[li]
        hidden = _layer_step(layers[li], hidden, cos, sin, cl.keys, cl.values, slots, positions, slot_positions, valid)
    return hidden


def recompute(model, cache, injector, request, fact_token_ids, *, score_layer: int = 1, fraction: float = 0.0,
              per_fact: bool = False, boundary: int = 0, fact_tokens: Optional[Sequence[int]] = None,
              prefix_positions=None, stream=None) -> RecomputePlan:
    """Repairs injected facts in `cache` (a StaticCache the injector writes,
    batch row 0): `request` (a kvinject.InjectRequest with block_table [0]) was
    injected already; fact_token_ids: the token ids of its facts, in order
    (LongTensor or ints, one per injected token). The cache's slots before
    request.first_slot hold what precedes (a header, prefilled), at positions
    prefix_positions (default: the slot indices).

    1. layers 0..score_layer of every fact token, fresh (exactly a prefill's
       KV of those layers);
    2. deviation scores at score_layer (library);
    3. the plan: every fact's first `boundary` tokens plus the best-scored
       `fraction` (of all tokens, or of each fact with per_fact) (library);
    4. the chosen tokens through layers score_layer+1.. from their fresh
       hidden states.
    fraction 0 and boundary 0 with score_layer -1: nothing is done (plain
    injection). fact_tokens: the facts' token counts (for boundary and per_fact;
    default from the store). Returns the plan. The caller then sets the cache
    length (kvinject.hf.set_cache_length) and prefills what follows."""
    import torch
    inner, layers = _layers(model)
    L = len(layers)
    dev = next(model.parameters()).device
    ids = torch.as_tensor(fact_token_ids, device=dev).view(-1)
    T = ids.numel()
    s0 = request.first_slot
    if request.positions is not None:
        pos = [int(p) for p in request.positions]
    else:
        pos = list(range(request.start_position, request.start_position + T))
    if prefix_positions is None:
        prefix_positions = list(range(s0))
    slot_positions = list(prefix_positions) + pos
    valid = s0 + T
    slots = list(range(s0, s0 + T))
    if fact_tokens is None:
        fact_tokens = [injector.store.fact_tokens(request.tenant, f) for f in request.fact_ids]
    if sum(fact_tokens) != T:
        raise ValueError("%d fact token ids for %d injected tokens" % (T, sum(fact_tokens)))
    if score_layer < 0:
        chosen = recompute_select([0.0] * T, fact_tokens, fraction=0.0, boundary=boundary)
        if chosen:
            run_tokens(model, cache, ids[chosen], [slots[i] for i in chosen], [pos[i] for i in chosen],
                       slot_positions, valid)
        return RecomputePlan([], chosen, T)
    hidden = run_tokens(model, cache, ids, slots, pos, slot_positions, valid, 0, score_layer + 1)
    if stream is None and dev.type == "cuda":
        stream = torch.cuda.current_stream()
    scores = injector.deviation(request, score_layer, stream=stream)
    chosen = recompute_select(scores, fact_tokens, fraction=fraction, per_fact=per_fact, boundary=boundary)
    if chosen and score_layer + 1 < L:
        sel = torch.as_tensor(chosen, dtype=torch.long, device=dev)
        run_tokens(model, cache, ids[sel], [slots[i] for i in chosen], [pos[i] for i in chosen], slot_positions,
                   valid, score_layer + 1, L, hidden=hidden[:, sel])
    return RecomputePlan(scores, chosen, T)
