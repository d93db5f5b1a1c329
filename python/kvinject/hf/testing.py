"""What the tests (python/tests) and the benchmarks (python/kvinject_bench) of
kvinject.hf share, on torch and transformers (imported when a function is
called, never at import):

- random-weight models of each RoPE family the mapping covers, built from
  configs (:func:`tiny_configs`, :func:`build_model`: nothing is downloaded);
- the model's own rotation as a kvi cos/sin table (:func:`engine_rope_table`)
  and how far the config's mapping is from it (:func:`rope_mapping_error`);
- an empty StaticCache (:func:`static_cache`) and the library's dtype, backend
  and stream for a torch dtype or device (:func:`kvi_dtype`, :func:`kvi_backend`,
  :func:`kvi_stream`, :func:`sync`);
- selective recompute cases on a real instruct model (:func:`make_cases`,
  :class:`RecomputeHarness`, :func:`kl`).
"""
from __future__ import annotations

import random

from .cache import cache_tensors, set_cache_length
from .config import head_dim_of, kvi_model_for
from .recompute import recompute

TENANT = 1  # the facts of RecomputeHarness

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


def fix_legacy_config(cls, kw):
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
    config = cls(**fix_legacy_config(cls, kw))
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


# ---------------------------------------------------- devices, dtypes, caches

def kvi_dtype(torch_dtype):
    """The kvinject DType of a torch dtype (fp32, bf16, fp16)."""
    import torch
    import kvinject as kvi
    return {torch.float32: kvi.DType.FP32, torch.bfloat16: kvi.DType.BF16,
            torch.float16: kvi.DType.FP16}[torch_dtype]


def kvi_backend(device):
    """The store backend for a torch device: CUDA for cuda devices (RuntimeError when
    the library was built without CUDA), else the CPU."""
    import kvinject as kvi
    if str(device).startswith("cuda"):
        if not kvi.features() & kvi.FEATURE_CUDA:
            raise RuntimeError("%s was built without CUDA; a cuda run needs a CUDA build of libkvinject"
                               % kvi.library_path())
        return kvi.Backend.CUDA
    return kvi.Backend.CPU


def kvi_stream(device):
    """What kvinject calls take as stream: torch's current stream on CUDA (so the
    library's work is ordered with the model's), None on the CPU."""
    import torch
    return torch.cuda.current_stream() if str(device).startswith("cuda") else None


def sync(device):
    """Waits for the device's work (cuda)."""
    import torch
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def static_cache(model, max_cache_len):
    """An empty transformers StaticCache for the model (its layers allocate on the
    first forward)."""
    from transformers import StaticCache
    try:
        return StaticCache(config=model.config, max_cache_len=max_cache_len)
    except TypeError:  # 4.x signatures
        return StaticCache(config=model.config, max_batch_size=1, max_cache_len=max_cache_len,
                           device=model.device, dtype=model.dtype)


# ----------------------------------------------------------- recompute cases

NAMES = ["Avery", "Blake", "Casey", "Devon", "Emery", "Finley", "Gray", "Harper", "Indy", "Jordan", "Kai", "Logan",
         "Morgan", "Noel", "Oakley", "Parker", "Quinn", "Reese", "Sage", "Tatum", "Umber", "Vale", "Wren", "Yael"]
CITIES = ["Lisbon", "Oslo", "Quito", "Hanoi", "Perth", "Accra", "Lima", "Riga", "Dakar", "Seoul", "Cusco", "Minsk",
          "Tunis", "Porto", "Turin", "Cairo", "Delhi", "Kyiv", "Baku", "Doha", "Nice", "Bern", "Fez", "Goa"]
OBJECTS = ["violin", "kayak", "telescope", "bonsai", "chessboard", "drone", "lantern", "compass", "typewriter",
           "harp", "microscope", "sundial"]


def make_cases(tok, k, n, seed=0):
    """n cases of k facts about made-up people (a chat header, the facts, a question
    about one of them), as token ids of ``tok``."""
    rng = random.Random(seed)
    cases = []
    for c in range(n):
        people = rng.sample(NAMES, k) if k <= len(NAMES) else [NAMES[i % len(NAMES)] + str(i) for i in range(k)]
        facts = ["%s lives in %s and owns a %s. " % (p, rng.choice(CITIES), rng.choice(OBJECTS)) for p in people]
        target = rng.randrange(k)
        header = "<|im_start|>system\nYou answer from the notes below.<|im_end|>\n<|im_start|>user\nNotes: "
        question = "\nIn which city does %s live?<|im_end|>\n<|im_start|>assistant\n%s lives in" % (
            people[target], people[target])
        cases.append(dict(header=tok(header)["input_ids"],
                          facts=[tok(f, add_special_tokens=False)["input_ids"] for f in facts],
                          question=tok(question, add_special_tokens=False)["input_ids"]))
    return cases


class RecomputeHarness:
    """A model directory's model and tokenizer, a store of facts each encoded alone
    (prefilled at positions 0.., captured pre-RoPE), and the first answer token's
    logits of a case (:func:`make_cases`) after a re-prefill of everything
    (:meth:`reprefill`) or after the header's prefill, the facts' injection, a
    selective recompute and the question's prefill (:meth:`injected`)."""

    def __init__(self, model_dir, device, dtype, kvi, torch):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.torch, self.kvi, self.device = torch, kvi, device
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
        self.model = self.model.to(device).eval()
        self.config = self.model.config
        self.stream = kvi_stream(device)
        km = kvi_model_for(self.config)
        self.store = kvi.Store(km, 256 << 20, backend=kvi_backend(device), dtype=kvi_dtype(self.model.dtype))
        self.next_id = 1
        self.ids = {}

    def fact_id(self, toks):
        """Encodes a fact alone (once per distinct token sequence); its id."""
        key = tuple(toks)
        if key in self.ids:
            return self.ids[key]
        torch, kvi = self.torch, self.kvi
        ids = torch.tensor([toks], device=self.device)
        out = self.model(ids, use_cache=True)
        keys, values = cache_tensors(out.past_key_values)
        enc = kvi.Encoder(self.store, kvi.CacheLayout.hf(keys, values))
        fid = self.next_id
        self.next_id += 1
        enc.encode(kvi.Capture(TENANT, fid, block_table=[0], num_tokens=len(toks), start_position=0),
                   stream=self.stream)
        sync(self.device)
        self.ids[key] = fid
        return fid

    def reprefill(self, case):
        """Logits of the first answer token after a prefill of everything."""
        torch = self.torch
        allf = [t for f in case["facts"] for t in f]
        ids = torch.tensor([case["header"] + allf + case["question"]], device=self.device)
        return self.model(ids, use_cache=False).logits[0, -1].double().cpu()

    def injected(self, case, layer, frac, boundary, per_fact=False):
        """Logits after header prefill, injection, recompute (layer -1 and no boundary:
        none) and the question's prefill; and the plan."""
        torch, kvi = self.torch, self.kvi
        hdr, q = case["header"], case["question"]
        fids = [self.fact_id(f) for f in case["facts"]]
        allf = [t for f in case["facts"] for t in f]
        n = len(hdr) + len(allf) + len(q)
        cache = static_cache(self.model, n)
        self.model(torch.tensor([hdr], device=self.device), past_key_values=cache, use_cache=True)
        keys, values = cache_tensors(cache)
        inj = kvi.Injector(self.store, kvi.CacheLayout.hf(keys, values))
        req = kvi.InjectRequest(TENANT, fids, block_table=[0], first_slot=len(hdr), start_position=len(hdr))
        inj.inject(req, stream=self.stream)
        plan = None
        if layer >= 0 or boundary > 0:
            plan = recompute(self.model, cache, inj, req, allf, score_layer=layer, fraction=frac,
                             boundary=boundary, per_fact=per_fact, fact_tokens=[len(f) for f in case["facts"]],
                             stream=self.stream)
        set_cache_length(cache, len(hdr) + len(allf))
        out = self.model(torch.tensor([q], device=self.device), past_key_values=cache, use_cache=True)
        sync(self.device)
        return out.logits[0, -1].double().cpu(), plan, len(allf)


def kl(p_logits, q_logits):
    """KL(p || q) of two logit vectors."""
    import torch
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return float((lp.exp() * (lp - lq)).sum())
