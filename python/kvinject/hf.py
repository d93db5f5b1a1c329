"""Hugging Face (transformers) helpers.

- Configurations mapped to libkvinject: the model's KV geometry and its RoPE
  as kvi_rope_spec fields (:func:`kvi_rope_fields`, :func:`kvi_model_for`).
  Works on transformers 5.x configs (rope_parameters) and the 4.x spellings
  (rope_theta, rope_scaling, rotary_pct, partial_rotary_factor), and on any
  object with those attributes (vLLM's ``model_config.hf_config`` is a
  transformers config); families: Llama (llama3 scaling), Qwen2, Mistral and
  the other NeoX-paired models (linear, YaRN scaling, partial rotary as
  GPT-NeoX), GPT-J (interleaved pairs), and configs with a RoPE per layer type
  (Gemma 3: sliding and full attention layers, :func:`kvi_rope_fields_per_layer`).
- Caches: :func:`cache_tensors` (a cache's per-layer tensors),
  :class:`StaticCacheInjector` (injects a store's facts into a StaticCache:
  appends them at the cache's length, checks they fit, sets the cache's
  length after them, and re-reads the layout when the cache's tensors move).
  ``CacheLayout.hf(cache)`` makes a layout that refuses to be used once the
  cache replaced its tensors.

transformers and torch are never imported here (objects are read through
their attributes). The mappings are what python/harness/hf_parity.py proves
against the models themselves, and python/tests/test_hf.py against a tiny
Llama and SmolLM2-135M.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from ._types import IntArrayLike, StreamLike
from .cache import CacheLayout
from .enums import RopeScaling, RopeStyle
from .errors import StaleLayoutError
from .model import Model
from .store import Store


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


# ----------------------------------------------------------------------- caches

def is_hf_cache(obj) -> bool:
    """Whether obj looks like a transformers cache (5.x ``layers`` with keys and
    values, or 4.x ``key_cache`` / ``value_cache`` lists)."""
    layers = getattr(obj, "layers", None)
    if layers is not None and not isinstance(obj, (list, tuple)):
        return all(hasattr(l, "keys") and hasattr(l, "values") for l in layers)
    return hasattr(obj, "key_cache") and hasattr(obj, "value_cache")


def cache_tensors(cache) -> Tuple[List[Any], List[Any]]:
    """The per-layer key and value tensors [batch, heads, seq, head_dim] of a
    transformers cache, as lists. RuntimeError while the layers are not
    allocated (transformers allocates them at the first forward through the
    cache; :class:`StaticCacheInjector` can allocate them first)."""
    if not is_hf_cache(cache):
        raise TypeError("expected a transformers cache (DynamicCache, StaticCache), got %s" % type(cache).__name__)
    layers = getattr(cache, "layers", None)
    if layers is not None:
        keys = [l.keys for l in layers]
        values = [l.values for l in layers]
    else:  # 4.x
        keys, values = list(cache.key_cache), list(cache.value_cache)
    if not keys or any(getattr(t, "dim", None) is None or t.dim() != 4 for t in keys + values):
        raise RuntimeError("the %s's layers are not allocated (run a forward through it first)"
                           % type(cache).__name__)
    return keys, values


def _as_int(n) -> int:
    return int(n.item()) if hasattr(n, "item") else int(n)


def set_cache_length(cache, n: int) -> None:
    """Tells a transformers 5.x StaticCache (allocated) that its first n slots hold
    valid KV: every layer's length is set to n, so the next forward writes at
    slot n, takes positions n, n+1, ... and attends to slots 0..n-1. Checked
    against get_seq_length: a transformers version that keeps the length
    elsewhere raises RuntimeError instead of running on a wrong length.
    :class:`StaticCacheInjector` calls it after every injection."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError("set_cache_length: %s has no cache layer objects (transformers 5.x)" % type(cache).__name__)
    for i, l in enumerate(layers):
        cl = getattr(l, "cumulative_length", None)
        if hasattr(cl, "fill_"):  # a tensor: in place (its address may be captured by a graph)
            cl.fill_(n)
        elif isinstance(cl, int):
            l.cumulative_length = n
        else:
            raise RuntimeError("set_cache_length: layer %d (%s) keeps no cumulative_length: unsupported "
                               "transformers version" % (i, type(l).__name__))
    got = _as_int(cache.get_seq_length())
    if got != n:
        raise RuntimeError("set_cache_length(%d) left get_seq_length() at %d: unsupported transformers version"
                           % (n, got))


class StaticCacheInjector:
    """Injects a :class:`kvinject.Store`'s facts into a transformers (5.x)
    ``StaticCache``, whose tensors are preallocated for ``max_cache_len`` slots.

    ``StaticCacheInjector(store, cache, *, dtype=None, device=None, batch_size=1,
    **transfer_options)``. :meth:`inject` writes facts at the cache's current
    length (its next free slot, position = slot unless ``start_position`` is
    given), after checking that they fit, and then sets the cache's length past
    them, so the next forward through the cache attends to them and continues
    at the right slot and position. :meth:`set_length` moves the length by hand
    (e.g. back to a prefilled header, to inject other facts behind it).

    The injector (:attr:`injector`) and its layout are made on first use and
    made again whenever the cache's tensors have moved (layers allocated
    again, moved to another device): every call sees the cache's current
    tensors. Layers not yet allocated (no forward has run) are allocated with
    ``early_initialization`` from ``batch_size``, ``dtype`` and ``device`` and
    the store's geometry; without dtype and device that is a ValueError.

    A DynamicCache is refused (TypeError): its tensors hold exactly its length,
    with no slot to inject into, and every forward reallocates them; sliding
    window layers too (NotImplementedError): their slots are a ring.
    ``transfer_options``: as :class:`kvinject.Injector`. Keep this object (it
    keeps the injectors) until the stream has passed the work. An injector of
    moved tensors is freed when they move (a CUDA store's after synchronizing the
    stream of the last injection, where it is an object with ``synchronize()``,
    such as a torch.cuda.Stream; with a raw handle or the default stream it is
    kept until :meth:`close`).
    """

    def __init__(self, store: Store, cache: Any, *, dtype: Any = None, device: Any = None, batch_size: int = 1,
                 **transfer_options: Optional[int]):
        layers = getattr(cache, "layers", None)
        if layers is None or not is_hf_cache(cache):
            raise TypeError("cache: expected a transformers 5.x StaticCache (cache layer objects), got %s"
                            % type(cache).__name__)
        for i, l in enumerate(layers):
            if getattr(l, "max_cache_len", None) is None or not hasattr(l, "cumulative_length"):
                raise TypeError("cache: layer %d is a %s, not a static layer: a %s holds exactly its length "
                                "(no slot to inject into) and reallocates its tensors at every forward; use a "
                                "StaticCache" % (i, type(l).__name__, type(cache).__name__))
            if getattr(l, "is_sliding", False):
                raise NotImplementedError("cache: layer %d is a sliding-window layer (%s), whose slots are a ring; "
                                          "injection needs full-attention static layers" % (i, type(l).__name__))
        if len(layers) != store.num_layers:
            raise ValueError("cache: %d layers, the store's model has %d" % (len(layers), store.num_layers))
        self.store = store
        self.cache = cache
        self._alloc = (batch_size, dtype, device)
        self._options = transfer_options
        self._injector = None
        self._retired: List[Any] = []  # injectors of moved tensors whose work may still be in flight
        self._last_stream = None

    # -------------------------------------------------------------- geometry
    @property
    def capacity(self) -> int:
        """Slots per sequence: the cache's max_cache_len."""
        return int(self.cache.layers[0].max_cache_len)

    @property
    def allocated(self) -> bool:
        return all(getattr(l, "is_initialized", True) for l in self.cache.layers) and \
            all(getattr(l, "keys", None) is not None for l in self.cache.layers)

    @property
    def batch_size(self) -> int:
        self._allocate()
        return int(self.cache.layers[0].keys.shape[0])

    @property
    def length(self) -> int:
        """The cache's length (get_seq_length): slots holding valid KV, the next free slot."""
        return _as_int(self.cache.get_seq_length()) if self.allocated else 0

    def set_length(self, n: int) -> None:
        """Sets the cache's length to n (0..capacity): :func:`set_cache_length`."""
        import operator
        n = operator.index(n)
        if not 0 <= n <= self.capacity:
            raise ValueError("set_length: n = %d, expected 0..%d (the cache's max_cache_len)" % (n, self.capacity))
        self._allocate()
        set_cache_length(self.cache, n)

    def _allocate(self) -> None:
        if self.allocated:
            return
        batch_size, dtype, device = self._alloc
        if dtype is None or device is None:
            raise ValueError("the StaticCache's layers are not allocated yet (transformers allocates them at the "
                             "first forward): run a forward through the cache first, or pass dtype= and device= "
                             "to StaticCacheInjector")
        self.cache.early_initialization(batch_size, self.store.num_heads, self.store.head_size, dtype, device)

    # -------------------------------------------------------------- injector
    @property
    def injector(self):
        """The :class:`kvinject.Injector` on the cache's current tensors (made again
        when they moved)."""
        from .transfer import Injector
        self._allocate()
        if self._injector is not None:
            try:
                self._injector.layout.check()
                return self._injector
            except StaleLayoutError:
                self._retire(self._injector)
                self._injector = None
        self._injector = Injector(self.store, CacheLayout.hf(self.cache), **self._options)
        return self._injector

    def _retire(self, inj) -> None:
        """An injector of tensors the cache no longer holds: freed now when its work is
        complete (a CPU store works synchronously; else the stream of the last
        injection is synchronized, when it can be), else kept until :meth:`close`
        (it also keeps the old tensors alive)."""
        from .enums import Backend
        stream = self._last_stream
        if self.store.backend != Backend.CPU:
            if not hasattr(stream, "synchronize"):
                self._retired.append(inj)
                return
            stream.synchronize()
        inj.close()

    @property
    def layout(self) -> CacheLayout:
        """The current layout (see :attr:`injector`)."""
        return self.injector.layout

    def plan(self, tenant: int, fact_ids: IntArrayLike) -> int:
        """Tokens the facts take (kvi_inject_plan)."""
        return self.injector.plan(tenant, fact_ids)

    def inject(self, tenant: int, fact_ids: IntArrayLike, *, rows: Optional[Sequence[int]] = None,
               start_position: Optional[int] = None, positions: Optional[IntArrayLike] = None,
               stream: StreamLike = None) -> int:
        """Writes the facts, in order, into each batch row of ``rows`` (None: every
        row) from the cache's length on, then sets the length past them. Returns
        the tokens injected. start_position: RoPE position of the first token
        (default: its slot, as a prefill would have it); positions: one per token
        instead. A forward after an injection at other positions than the slots
        must pass its own position_ids. Nothing is written, and the length is
        unchanged, when the facts do not fit or a call fails."""
        rows = list(range(self.batch_size)) if rows is None else list(rows)
        return self.inject_rows(tenant, [fact_ids] * len(rows), rows=rows, start_position=start_position,
                                positions=positions, stream=stream)

    def inject_rows(self, tenant: int, fact_ids_per_row: Sequence[IntArrayLike], *, rows: Optional[Sequence[int]] = None,
                    start_position: Optional[int] = None, positions: Optional[IntArrayLike] = None,
                    stream: StreamLike = None) -> int:
        """As :meth:`inject`, each row its own facts: ``fact_ids_per_row[i]`` into batch
        row ``rows[i]`` (rows default 0, 1, ...). The cache has one length for all
        rows, so every row's facts must have the same number of tokens."""
        from .transfer import InjectRequest
        inj = self.injector
        per_row = [list(ids) if not hasattr(ids, "data_ptr") else ids for ids in fact_ids_per_row]
        rows = list(range(len(per_row))) if rows is None else list(rows)
        if len(rows) != len(per_row):
            raise ValueError("inject_rows: %d rows for %d fact lists" % (len(rows), len(per_row)))
        B = self.batch_size
        for r in rows:
            if not 0 <= r < B:
                raise ValueError("rows: row %d, the cache has batch rows 0..%d" % (r, B - 1))
        if len(set(rows)) != len(rows):
            raise ValueError("rows: %s names a row twice" % (rows,))
        tokens = [inj.plan(tenant, ids) for ids in per_row]
        if len(set(tokens)) > 1:
            raise ValueError("inject_rows: the rows' facts have %s tokens; the cache has one length for every "
                             "row, so they must be equal" % tokens)
        n = tokens[0] if tokens else 0
        start = self.length
        if start + n > self.capacity:
            raise ValueError("inject: %d tokens from slot %d pass the cache's max_cache_len %d"
                             % (n, start, self.capacity))
        if n == 0:
            return 0
        pos0 = start if start_position is None and positions is None else (start_position or 0)
        inj.inject([InjectRequest(tenant, ids, block_table=[r], first_slot=start, start_position=pos0,
                                  positions=positions) for r, ids in zip(rows, per_row)], stream=stream)
        self._last_stream = stream
        self.set_length(start + n)
        return n

    def close(self) -> None:
        """Frees the injectors (their work on a stream must be complete)."""
        for inj in self._retired + ([self._injector] if self._injector is not None else []):
            inj.close()
        self._retired, self._injector = [], None
