"""Shared pieces of the Hugging Face parity and speed harnesses (hf_parity.py,
hf_speed.py): finding the binding, models with random weights built from
configs, the mapping of a transformers config's RoPE to kvi_rope_spec, the
preallocated HF cache the injector writes into, timing, and markdown output.

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

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)  # python/: the kvinject package sits there
if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)

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

# Tiny members of each RoPE family, for parity. hidden 256, 4 heads of 64,
# GQA where the family has it. Each entry: config class, config kwargs, and a
# note on what its RoPE exercises.
def tiny_configs(layers=2, vocab=2048):
    import transformers as tf
    common_pos = 4096
    return {
        "llama": (tf.LlamaConfig, dict(
            vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=common_pos,
            # llama3 scaling with a short original context so that most frequencies are
            # scaled or in the smooth band at the positions the test uses
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 512}),
            "NeoX pairs, llama3 scaling, GQA 4:2"),
        "qwen2": (tf.Qwen2Config, dict(
            vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=common_pos,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
            "NeoX pairs, theta 1e6, GQA 4:1, qkv bias"),
        "gpt_neox": (tf.GPTNeoXConfig, dict(
            vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
            num_attention_heads=4, max_position_embeddings=common_pos,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
            "NeoX pairs, partial rotary 16 of 64"),
        "gptj": (tf.GPTJConfig, dict(
            vocab_size=vocab, n_embd=256, n_inner=512, n_layer=layers, n_head=4, rotary_dim=16,
            n_positions=common_pos, bos_token_id=0, eos_token_id=0),
            "GPT-J interleaved pairs, partial rotary 16 of 64"),
    }


def _fix_legacy_config(cls, kw):
    """transformers 4.x has rope_theta/rope_scaling/rotary_pct instead of rope_parameters."""
    import transformers as tf
    major = int(tf.__version__.split(".")[0])
    if major >= 5 or "rope_parameters" not in kw:
        return kw
    kw = dict(kw)
    rp = dict(kw.pop("rope_parameters"))
    kw["rope_theta"] = rp.pop("rope_theta")
    if cls is tf.GPTNeoXConfig:
        kw["rotary_emb_base"] = kw.pop("rope_theta")
        kw["rotary_pct"] = rp.pop("partial_rotary_factor", 1.0)
    if rp.get("rope_type", "default") != "default":
        kw["rope_scaling"] = rp
    return kw


def build_model(cls, kw, dtype, device, attn="sdpa", seed=0):
    """A causal LM with random weights from a config (no download), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM
    config = cls(**_fix_legacy_config(cls, kw))
    torch.manual_seed(seed)
    last = None
    for impl in ([attn, "eager"] if attn != "eager" else ["eager"]):
        try:
            # the dtype at construction, as from_pretrained does: parameters in
            # `dtype`, RoPE buffers (inv_freq, GPT-J's sin/cos table) in fp32. A
            # model.to(dtype) afterwards would round those buffers to bf16 and
            # shift every rotation angle (by ~0.1 rad at position 100).
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=impl)
            break
        except (ValueError, ImportError) as e:  # e.g. GPT-J has no SDPA path
            last = e
    else:
        raise last
    model = model.to(device=device).eval()
    check_rope_buffers(model)
    return model


def check_rope_buffers(model):
    """RoPE frequency buffers must be fp32, as in a model from from_pretrained."""
    import torch
    for name, b in model.named_buffers():
        if ("inv_freq" in name or "embed_positions" in name) and b.dtype != torch.float32:
            raise RuntimeError("%s is %s: the model's rotary frequencies were rounded (built with .to(dtype)?)"
                               % (name, b.dtype))


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
    """The model's own rotation as a kvi cos/sin table: fp32 [positions, rot],
    each row rot/2 cosines then rot/2 sines (what kvi_rope_spec.cos_sin_table
    takes). From GPT-J's embed_positions buffer ([sin | cos] rows) or from the
    model's rotary module (NeoX halves: the first rot/2 of its cos/sin)."""
    import torch
    for name, b in model.named_buffers():
        if name.endswith("embed_positions"):  # GPT-J: one table per layer, all equal
            half = b.shape[1] // 2
            t = b[:positions].float().cpu()
            return torch.cat([t[:, half:], t[:, :half]], 1).contiguous()
    rot = None
    for name, m in model.named_modules():
        if name.endswith("rotary_emb"):
            rot = m
            break
    if rot is None:
        raise RuntimeError("no rotary module or table found in %s" % type(model).__name__)
    hd = head_dim_of(model.config)
    pos = torch.arange(positions, device=model.device).unsqueeze(0)
    cos, sin = rot(torch.zeros((1, positions, hd), dtype=torch.float32, device=model.device), pos)
    half = cos.shape[-1] // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], 1).float().cpu().contiguous()


def rope_mapping_error(model, kvi_model, positions=512, layer=0):
    """max |cos/sin of the library's spec - the model's own| over positions and
    pairs: how well kvi_rope_fields(config) reproduces what the model computes."""
    t = engine_rope_table(model, positions)
    half = t.shape[1] // 2
    spec = kvi_model.get_rope(layer)
    if spec.rotary_dim != 2 * half:
        return float("inf")
    worst = 0.0
    for p in range(0, positions, max(1, positions // 64)):
        for i in range(half):
            c, s = kvi_model.rope_cos_sin(layer, p, i)
            worst = max(worst, abs(c - float(t[p, i])), abs(s - float(t[p, half + i])))
    return worst


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
    import torch
    import kvinject as kvi
    return {torch.float32: kvi.DType.FP32, torch.bfloat16: kvi.DType.BF16,
            torch.float16: kvi.DType.FP16}[torch_dtype]


def kvi_backend(device):
    import kvinject as kvi
    if str(device).startswith("cuda"):
        if not kvi.features() & kvi.FEATURE_CUDA:
            print("error: %s was built without CUDA; a cuda run needs a CUDA build of libkvinject"
                  % kvi.library_path())
            sys.exit(2)
        return kvi.Backend.CUDA
    return kvi.Backend.CPU


def kvi_stream(device):
    """What kvinject calls take as stream: torch's current stream on CUDA (so the
    library's work is ordered with the model's), None on the CPU."""
    import torch
    return torch.cuda.current_stream() if str(device).startswith("cuda") else None


# ---------------------------------------------------------------------- cache

def static_cache(model, max_cache_len):
    """An empty transformers StaticCache for the model (its layers allocate on the
    first forward)."""
    from transformers import StaticCache
    try:
        return StaticCache(config=model.config, max_cache_len=max_cache_len)
    except TypeError:  # 4.x signatures
        return StaticCache(config=model.config, max_batch_size=1, max_cache_len=max_cache_len,
                           device=model.device, dtype=model.dtype)


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
    import torch
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


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
