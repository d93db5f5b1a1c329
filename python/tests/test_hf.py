#!/usr/bin/env python3
"""kvinject.hf against Hugging Face transformers (5.x) on the CPU, fp32:

- StaticCacheInjector: facts captured from a full prefill (their exact
  context) into a store, injected into a StaticCache behind a prefilled
  prefix (and, with dtype/device, into a cache no forward has allocated), then
  a prefill of only the question: its logits equal the full prefill's
  (relative error <= 1e-4), and the cache's length is right after injection;
  on a random-weight tiny Llama (llama3 RoPE scaling, GQA) and on the real
  SmolLM2-135M-Instruct (a real prompt; the greedy next token is the same).
  A negative control injects at the wrong positions and must differ.
- Stale layouts: a layout of a DynamicCache made before a forward is refused
  (StaleLayoutError) by encoder and injector calls, and nothing is written;
  the injector refreshes its layout when a StaticCache's tensors move, and an
  injector of the old tensors is refused; a DynamicCache, too-many tokens,
  rows of unequal length are refused with the cache unchanged.
- kvi_rope_fields for every family the harness maps (Llama llama3, Qwen2,
  GPT-NeoX partial rotary, GPT-J interleaved) against the model's own cos/sin,
  and a RoPE per layer type (Gemma 3) against each layer type's frequencies.
- The examples of python/README.md marked ``<!-- tested: test_hf -->`` run.

Runs in the environment .ci/install-vllm builds (torch, transformers, the
model): ``python3 python/tests/vllm/launch.py ../test_hf.py``; skips (77)
without torch and transformers; the SmolLM2 test skips without the model
(KVI_VLLM_MODEL).
"""
from __future__ import annotations

import math
import os
import re
import sys

import pytest

try:
    import torch
    import transformers
except ImportError as e:  # pragma: no cover
    if __name__ == "__main__":
        print("skipped: %s (test_hf needs torch and transformers)" % e)
        sys.exit(77)
    pytest.skip("test_hf needs torch and transformers: %s" % e, allow_module_level=True)

import kvi_testutil  # noqa: E402
from kvi_testutil import case  # noqa: E402
import kvinject as kvi  # noqa: E402
from kvinject import hf as khf  # noqa: E402

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TENANT = 3
torch.set_num_threads(min(2, torch.get_num_threads()))


def tiny_llama(layers=2):
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                         attn_implementation="sdpa").eval()


def rel_err(got, ref):
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


class Parity:
    """Capture facts from a full prefill, inject them into a StaticCache, compare."""

    @pytest.fixture(autouse=True)
    def _closing(self, closing):
        self.closing = closing

    def setup_model(self, model):
        self.model = model
        self.km = khf.kvi_model_for(model.config)
        self.closing.append(self.km)

    def new_store(self):
        s = kvi.Store(self.km, 64 << 20, backend=kvi.Backend.CPU, dtype=kvi.DType.FP32)
        self.closing.append(s)
        return s

    def capture(self, store, ids, spans):
        """Prefills ids (DynamicCache) and captures each (first, tokens) span as fact
        100 + i; returns the full prefill's logits."""
        with torch.no_grad():
            out = self.model(ids, use_cache=True)
        enc = kvi.Encoder(store, kvi.CacheLayout.hf(out.past_key_values))
        enc.encode([kvi.Capture(TENANT, 100 + i, block_table=[0], num_tokens=t, first_slot=a, start_position=a)
                    for i, (a, t) in enumerate(spans)])
        return out.logits[0]

    def injected(self, store, ids, prefix, n_facts, question, extra=0, **adapter_kw):
        """The question's logits over a StaticCache: prefix prefilled, facts injected."""
        cache = transformers.StaticCache(config=self.model.config, max_cache_len=ids.shape[1] + extra)
        if prefix:
            with torch.no_grad():
                self.model(ids[:, :prefix], past_key_values=cache, use_cache=True)
        inj = khf.StaticCacheInjector(store, cache, **adapter_kw)
        self.closing.append(inj)
        n = inj.inject(TENANT, [100 + i for i in range(n_facts)])
        assert n == ids.shape[1] - prefix - question
        assert inj.length == prefix + n
        assert int(cache.get_seq_length()) == prefix + n
        with torch.no_grad():
            out = self.model(ids[:, prefix + n:], past_key_values=cache, use_cache=True)
        assert inj.length == ids.shape[1]
        return out.logits[0], cache, inj


class TestStaticCacheTiny(Parity):
    @pytest.fixture(autouse=True)
    def _setup(self, _closing):
        self.setup_model(tiny_llama())
        g = torch.Generator().manual_seed(1)
        self.prefix, self.lens, self.question = 7, [9, 5, 12], 6
        self.total = self.prefix + sum(self.lens) + self.question
        self.ids = torch.randint(0, 512, (1, self.total), generator=g)
        self.spans, a = [], self.prefix
        for t in self.lens:
            self.spans.append((a, t))
            a += t

    def test_logits_match_full_prefill(self):
        store = self.new_store()
        ref = self.capture(store, self.ids, self.spans)[-self.question:]
        got, _, _ = self.injected(store, self.ids, self.prefix, len(self.lens), self.question, extra=5)
        assert rel_err(got, ref) < 1e-4

    def test_into_unallocated_cache(self):
        # no prefix: the adapter allocates the layers (early_initialization)
        ids = self.ids[:, self.prefix:]
        spans = [(a - self.prefix, t) for a, t in self.spans]
        store = self.new_store()
        ref = self.capture(store, ids, spans)[-self.question:]
        cache = transformers.StaticCache(config=self.model.config, max_cache_len=ids.shape[1])
        with pytest.raises(ValueError, match="not allocated yet"):
            khf.StaticCacheInjector(store, cache).inject(TENANT, [100])
        got, _, _ = self.injected(store, ids, 0, len(self.lens), self.question, dtype=torch.float32, device="cpu")
        assert rel_err(got, ref) < 1e-4

    def test_wrong_positions_differ(self):
        # negative control: the same facts rotated 3 positions off
        store = self.new_store()
        ref = self.capture(store, self.ids, self.spans)[-self.question:]
        cache = transformers.StaticCache(config=self.model.config, max_cache_len=self.total)
        with torch.no_grad():
            self.model(self.ids[:, :self.prefix], past_key_values=cache, use_cache=True)
        inj = khf.StaticCacheInjector(store, cache)
        n = inj.inject(TENANT, [100, 101, 102], start_position=self.prefix + 3)
        with torch.no_grad():
            out = self.model(self.ids[:, self.prefix + n:], past_key_values=cache, use_cache=True)
        assert rel_err(out.logits[0], ref) > 1e-3

    def test_length_and_refusals(self):
        store = self.new_store()
        self.capture(store, self.ids, self.spans)
        cache = transformers.StaticCache(config=self.model.config, max_cache_len=self.prefix + 14)
        with torch.no_grad():
            self.model(self.ids[:, :self.prefix], past_key_values=cache, use_cache=True)
        inj = khf.StaticCacheInjector(store, cache)
        self.closing.append(inj)
        assert (inj.length, inj.capacity, inj.batch_size) == (self.prefix, self.prefix + 14, 1)
        assert inj.inject(TENANT, [100, 101]) == 14  # 9 + 5 tokens: fills the cache exactly
        assert inj.length == self.prefix + 14
        before = [(l.keys.clone(), l.values.clone()) for l in cache.layers]
        with pytest.raises(ValueError, match="pass the cache's max_cache_len"):
            inj.inject(TENANT, [102])
        assert inj.length == self.prefix + 14
        inj.set_length(self.prefix)
        with pytest.raises(ValueError, match="pass the cache's max_cache_len"):
            inj.inject(TENANT, [100, 101, 102])
        with pytest.raises(kvi.NotFoundError):
            inj.inject(TENANT, [100, 999])
        with pytest.raises(ValueError, match="rows"):
            inj.inject(TENANT, [100], rows=[1])
        with pytest.raises(ValueError, match="set_length"):
            inj.set_length(self.prefix + 15)
        assert inj.length == self.prefix
        for (k, v), l in zip(before, cache.layers):  # the failed calls wrote nothing
            assert torch.equal(k, l.keys) and torch.equal(v, l.values)
        with pytest.raises(TypeError, match="DynamicCache"):
            khf.StaticCacheInjector(store, transformers.DynamicCache(config=self.model.config))

    def test_rows_of_unequal_length_are_refused(self):
        store = self.new_store()
        self.capture(store, self.ids, self.spans)
        cache = transformers.StaticCache(config=self.model.config, max_cache_len=40)
        inj = khf.StaticCacheInjector(store, cache, dtype=torch.float32, device="cpu", batch_size=2)
        self.closing.append(inj)
        with pytest.raises(ValueError, match="must be equal"):
            inj.inject_rows(TENANT, [[100], [101]])
        assert inj.length == 0
        assert inj.inject_rows(TENANT, [[100, 101], [101, 100]]) == 14
        # V is stored as is: row 0 starts with fact 100's values, row 1 with fact 101's
        # (store order [layers, tokens, heads, head_size]; layer 1, token 0, head 0)
        H, D = 2, 32
        for row, fid, tokens in ((0, 100, 9), (1, 101, 5)):
            _, v = store.read(TENANT, fid)
            want = torch.tensor(list(v[tokens * H * D:tokens * H * D + D]))
            assert torch.equal(cache.layers[1].values[row, 0, 0], want)

    def test_stale_dynamic_cache_layout_is_refused(self):
        store = self.new_store()
        with torch.no_grad():
            out = self.model(self.ids[:, :20], use_cache=True)
        cache = out.past_key_values
        layout = kvi.CacheLayout.hf(cache)
        enc = kvi.Encoder(store, layout)
        inj = kvi.Injector(store, layout)
        assert not layout.stale
        with torch.no_grad():
            self.model(self.ids[:, 20:24], past_key_values=cache, use_cache=True)  # reallocates every layer
        assert layout.stale
        with pytest.raises(kvi.StaleLayoutError) as cm:
            enc.encode(kvi.Capture(TENANT, 1, block_table=[0], num_tokens=4, first_slot=0))
        assert "DynamicCache" in str(cm.value)
        assert isinstance(cm.value, ValueError)
        assert store.count(TENANT) == 0
        with pytest.raises(kvi.StaleLayoutError):
            inj.inject(kvi.InjectRequest(TENANT, [1], block_table=[0]))
        # a layout made now works
        kvi.Encoder(store, kvi.CacheLayout.hf(cache)).encode(
            kvi.Capture(TENANT, 1, block_table=[0], num_tokens=4, first_slot=20, start_position=20))
        assert store.count(TENANT) == 1
        # tensors given one by one are not tracked (the caller keeps them current)
        assert not kvi.CacheLayout.hf(*khf.cache_tensors(cache)).stale

    def test_moved_static_cache_is_refreshed(self):
        store = self.new_store()
        ref = self.capture(store, self.ids, self.spans)[-self.question:]
        cache = transformers.StaticCache(config=self.model.config, max_cache_len=self.total)
        with torch.no_grad():
            self.model(self.ids[:, :self.prefix], past_key_values=cache, use_cache=True)
        inj = khf.StaticCacheInjector(store, cache)
        self.closing.append(inj)
        old = inj.injector
        for l in cache.layers:  # the layers' tensors move (as a device move or offload would)
            l.keys, l.values = l.keys.clone(), l.values.clone()
        assert old.layout.stale
        with pytest.raises(kvi.StaleLayoutError):
            old.inject(kvi.InjectRequest(TENANT, [100], block_table=[0], first_slot=self.prefix,
                                         start_position=self.prefix))
        n = inj.inject(TENANT, [100, 101, 102])
        assert inj.injector is not old
        with pytest.raises(ValueError, match="closed"):  # a CPU store's old injector is freed at once
            old.handle
        assert inj._retired == []
        with torch.no_grad():
            out = self.model(self.ids[:, self.prefix + n:], past_key_values=cache, use_cache=True)
        assert rel_err(out.logits[0], ref) < 1e-4


class TestSmolLM2(Parity):
    @pytest.fixture(autouse=True)
    def _setup(self, _closing):
        path = os.environ.get("KVI_VLLM_MODEL", "/var/cache/kvinject/vllm/model/SmolLM2-135M-Instruct")
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            pytest.skip("no SmolLM2-135M-Instruct at %s (.ci/install-vllm converts it)" % path)
        self.tok = transformers.AutoTokenizer.from_pretrained(path)
        self.setup_model(transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa").eval())

    def test_real_prompt(self):
        parts = ["Notes for the trip.", " The ferry to the island leaves at 7:40 from pier 3.",
                 " Anna's flat is the blue door on Harbour Street, number 12.",
                 " The museum is closed on Mondays.", " Question: where does the ferry leave from? Answer: from"]
        pieces = [self.tok(p, add_special_tokens=False)["input_ids"] for p in parts]
        ids = torch.tensor([sum(pieces, [])])
        prefix, question = len(pieces[0]), len(pieces[-1])
        spans, a = [], prefix
        for p in pieces[1:-1]:
            spans.append((a, len(p)))
            a += len(p)
        store = self.new_store()
        ref = self.capture(store, ids, spans)[-question:]
        got, _, _ = self.injected(store, ids, prefix, len(spans), question)
        assert rel_err(got, ref) < 1e-4
        assert int(got[-1].argmax()) == int(ref[-1].argmax())


class TestRopeFields:
    def test_every_family_of_the_harness(self, closing):
        from kvinject.hf import testing
        for name, (cls, kw, _) in testing.tiny_configs(layers=1).items():
            with case(family=name):
                model = testing.build_model(cls, kw, torch.float32, "cpu")
                km = khf.kvi_model_for(model.config)
                closing.append(km)
                assert testing.rope_mapping_error(model, km, positions=256) < 1e-4  # the harness criterion

    def test_rope_per_layer_type(self, closing):
        # Gemma 3: sliding layers theta 1e4, full layers theta 1e6 with linear scaling;
        # each layer against the model's own inverse frequencies of its layer type
        types = ["sliding_attention", "full_attention", "sliding_attention"]
        cfg = transformers.Gemma3TextConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, layer_types=types, sliding_window=16,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        rot = next(m for _, m in model.named_modules() if hasattr(m, "layer_types") and hasattr(m, "rope_type"))
        km = khf.kvi_model_for(model.config)
        closing.append(km)
        worst = 0.0
        for layer, t in enumerate(types):
            inv = getattr(rot, t + "_inv_freq").double()
            assert getattr(rot, t + "_attention_scaling") == 1.0
            for p in (0, 1, 17, 100, 255):
                for j in range(inv.numel()):
                    c, s = km.rope_cos_sin(layer, p, j)
                    a = p * float(inv[j])
                    worst = max(worst, abs(c - math.cos(a)), abs(s - math.sin(a)))
        assert worst < 1e-5
        # the two types differ, so one RoPE for every layer would fail the check above
        assert km.get_rope(0).theta != km.get_rope(1).theta


class TestReadmeExamples:
    def test_examples_run(self):
        with open(os.path.join(PYTHON_DIR, "README.md"), encoding="utf-8") as f:
            text = f.read()
        blocks = re.findall(r"<!-- tested: test_hf -->\s*```python\n(.*?)```", text, re.S)
        assert len(blocks) >= 1, "no tested example in python/README.md"
        for i, code in enumerate(blocks):
            with case(example=i):
                exec(compile(code, "python/README.md example %d" % i, "exec"), {"__name__": "__readme__"})


if __name__ == "__main__":
    # arguments: tests of this module (e.g. TestSmolLM2, TestStaticCacheTiny.test_logits_match_full_prefill);
    # none: all
    sys.exit(kvi_testutil.run_pytest(__file__, sys.argv[1:]))
