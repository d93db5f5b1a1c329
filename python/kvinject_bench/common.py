"""Shared pieces of the benchmarks (hf_parity, hf_speed, recall,
recompute_eval): finding the binding, models with random weights built from
configs, the mapping of a transformers config's RoPE to kvi_rope_spec, the
preallocated HF cache the injector writes into, timing, and markdown output.
The models, the RoPE checks, the cache and the device helpers are
kvinject.hf.testing's (the tests use them too); kvinject is imported when one
is first called, after need_kvinject() has found the library.

Written against transformers 5.x (rope_parameters, cache layer objects with
.keys/.values, StaticLayer.cumulative_length), with fallbacks for the 4.x
spellings where they are cheap. What the harness relies on is checked at run
time (see set_cache_length), so an unsupported version fails loudly rather
than measuring the wrong thing.
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import sys
import time

SKIP = 77  # Meson's "skipped"


def need_torch_transformers():
    """Imports torch and transformers, or exits 77 (skipped) naming what is missing."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print("skipped: %s (the harness needs torch and transformers)" % e)
        sys.exit(SKIP)
    import torch
    import transformers
    return torch, transformers


def need_kvinject():
    """Imports the binding, which finds the library itself: KVINJECT_LIBRARY (the
    library file or a build directory), else the repository's build/ tree, else
    an installed one (see python/README.md, "Installing")."""
    try:
        import kvinject
    except ImportError as e:
        print("error: cannot import kvinject: %s" % e)
        sys.exit(2)
    return kvinject


# --------------------------------------------------------------------- models

def _testing():
    from kvinject.hf import testing
    return testing


def tiny_configs(layers=2, vocab=2048):
    """Tiny members of each RoPE family (kvinject.hf.testing.tiny_configs)."""
    return _testing().tiny_configs(layers=layers, vocab=vocab)


def fix_legacy_config(cls, kw):
    """A config's keywords in transformers 4.x spellings where needed
    (kvinject.hf.testing)."""
    return _testing().fix_legacy_config(cls, kw)


def build_model(cls, kw, dtype, device, attn="sdpa", seed=0):
    """A causal LM with random weights from a config (kvinject.hf.testing.build_model)."""
    return _testing().build_model(cls, kw, dtype, device, attn=attn, seed=seed)


def check_rope_buffers(model):
    """RoPE frequency buffers must be fp32 (kvinject.hf.testing.check_rope_buffers)."""
    return _testing().check_rope_buffers(model)


def model_config(model):
    return model.config


# The config-to-kvi_rope_spec mapping lives in the package (kvinject.hf, which
# the vLLM connector uses too). Imported when first called: importing kvinject
# loads the library, which need_kvinject() chooses first.
def head_dim_of(config):
    from kvinject.hf import head_dim_of as f
    return f(config)


def kv_heads_of(config):
    from kvinject.hf import kv_heads_of as f
    return f(config)


def rope_parameters(config):
    from kvinject.hf import rope_parameters as f
    return f(config)


def kvi_rope_fields(config):
    from kvinject.hf import kvi_rope_fields as f
    return f(config)


def kvi_model_for(config, rope_fields=None):
    from kvinject.hf import kvi_model_for as f
    return f(config, rope_fields)


def engine_rope_table(model, positions):
    """The model's own rotation as a kvi cos/sin table (kvinject.hf.testing)."""
    return _testing().engine_rope_table(model, positions)


def rope_mapping_error(model, kvi_model, positions=512, layer=0):
    """How far kvi_rope_fields(config) is from the model's own cos/sin
    (kvinject.hf.testing.rope_mapping_error)."""
    return _testing().rope_mapping_error(model, kvi_model, positions=positions, layer=layer)


def pick_device(requested, torch, kvi):
    """--device as given (a cuda run then needs a CUDA build of the library and a
    device), or by default cuda where torch has a device and the library was
    built with CUDA, cpu otherwise."""
    if requested:
        if requested.startswith("cuda") and not torch.cuda.is_available():
            print("error: --device %s but torch sees no CUDA device" % requested)
            sys.exit(2)
        return requested
    if torch.cuda.is_available() and kvi.features() & kvi.FEATURE_CUDA and kvi.cuda_device_count() > 0:
        return "cuda"
    return "cpu"


def kvi_dtype(torch_dtype):
    return _testing().kvi_dtype(torch_dtype)


def kvi_backend(device):
    """The store backend for a device; exits 2 for a cuda run of a library built
    without CUDA."""
    try:
        return _testing().kvi_backend(device)
    except RuntimeError as e:
        print("error: %s" % e)
        sys.exit(2)


def kvi_stream(device):
    """What kvinject calls take as stream: torch's current stream on CUDA (so the
    library's work is ordered with the model's), None on the CPU."""
    return _testing().kvi_stream(device)


# ---------------------------------------------------------------------- cache

def static_cache(model, max_cache_len):
    """An empty transformers StaticCache for the model (kvinject.hf.testing)."""
    return _testing().static_cache(model, max_cache_len)


def cache_tensors(cache):
    """Per-layer key and value tensors [batch, heads, seq, head_dim] of a cache
    (kvinject.hf.cache_tensors)."""
    from kvinject.hf import cache_tensors as f
    return f(cache)


def set_cache_length(cache, n):
    """The StaticCache's length set to n (kvinject.hf.set_cache_length, checked)."""
    from kvinject.hf import set_cache_length as f
    return f(cache, n)


# --------------------------------------------------------------------- timing

class Timer:
    """Marks on a timeline: CUDA events on a GPU (the time the device reaches each
    mark, so host overhead between launches shows up as it does in TTFT), host
    clock on the CPU. marks() returns ms from the first mark, after a sync."""

    def __init__(self, device):
        import torch
        self.cuda = str(device).startswith("cuda")
        self.torch = torch
        self.events = []

    def mark(self):
        if self.cuda:
            e = self.torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append(e)
        else:
            self.events.append(time.perf_counter())

    def marks(self):
        if self.cuda:
            self.torch.cuda.synchronize()
            return [self.events[0].elapsed_time(e) for e in self.events]
        return [(t - self.events[0]) * 1e3 for t in self.events]


def sync(device):
    return _testing().sync(device)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def slope(xs, ys):
    """Least-squares slope of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else float("nan")


# --------------------------------------------------------------------- output

def banner(title, device, args=None):
    import torch
    import transformers
    import kvinject as kvi
    if str(device).startswith("cuda"):
        dev = torch.cuda.get_device_name(torch.device(device))
    else:
        dev = "CPU (%s, %d threads)" % (platform.processor() or platform.machine(), torch.get_num_threads())
    lines = ["## %s" % title, "",
             "- date: %s" % datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "- device: %s" % dev,
             "- torch %s, transformers %s, Python %s" % (torch.__version__, transformers.__version__,
                                                        platform.python_version()),
             "- libkvinject %s (%s)" % (kvi.version(), kvi.library_path())]
    if args is not None:
        lines.append("- command: `%s`" % " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]))
    print("\n".join(lines) + "\n", flush=True)


def table(header, rows):
    """A markdown table as a string."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out)


def fmt(x, spec=".3g"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, spec)
