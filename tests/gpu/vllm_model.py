#!/usr/bin/env python3
"""Writes a Llama-shaped model with random weights, for timing vLLM on the GPU
machine: config.json (llama3 RoPE scaling with theta 500000, KV heads of 128),
bf16 safetensors shards with an index, and a tokenizer copied from a directory
(any tokenizer.json; its vocabulary sets the model's). Weights are N(0, 0.02)
drawn on the GPU (norms are ones). --shape:

  8b   Llama-3.1-8B: 32 layers, hidden 4096, 32 heads / 8 KV heads, MLP 14336;
       bf16 (14 GiB with SmolLM2's vocabulary);
  32b  Qwen2.5-32B's geometry in Llama's architecture (no QKV bias): 64 layers,
       hidden 5120, 40 heads / 8 KV heads, MLP 27648; bf16 (59 GiB); config only;
  70b  Llama-3.1-70B: 80 layers, hidden 8192, 64 heads / 8 KV heads, MLP 28672;
       fp8 linear layers (an fp8 checkpoint's quantization_config: quant_method
       fp8, per-tensor scales, dynamic activation scales; vLLM creates the
       weights in fp8 and load_format="dummy" fills them, never a bf16 copy),
       bf16 embeddings: 65 GiB; config only.

    python3 tests/gpu/vllm_model.py --tokenizer DIR --out DIR [--shape 8b] [--layers N] [--config-only]

--config-only (implied by 32b and 70b) writes the config and tokenizer alone
(for vLLM's load_format="dummy", which draws the weights itself). Prints the
parameter count, bytes and seconds taken.
"""
import argparse
import json
import os
import shutil
import time


# hidden, MLP, layers, heads, KV heads (of 128), fp8 linear layers
SHAPES = {"8b": (4096, 14336, 32, 32, 8, False), "32b": (5120, 27648, 64, 40, 8, False),
          "70b": (8192, 28672, 80, 64, 8, True)}


def config(shape, vocab, layers, bos, eos):
    H, I, _, nh, nkv, fp8 = SHAPES[shape]
    c = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": H, "intermediate_size": I, "num_hidden_layers": layers,
        "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": 128,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "vocab_size": vocab,
        "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "bfloat16", "dtype": "bfloat16",
        "initializer_range": 0.02, "use_cache": True,
    }
    if fp8:
        c["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="directory holding tokenizer.json (and tokenizer_config.json)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="default: the shape's")
    ap.add_argument("--layers-per-shard", type=int, default=8)
    ap.add_argument("--config-only", action="store_true")
    args = ap.parse_args()
    if args.layers is None:
        args.layers = SHAPES[args.shape][2]
    if args.shape != "8b":
        args.config_only = True   # 59 / 65 GiB of random weights: vLLM's dummy loader draws them instead
    t0 = time.time()
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    tcfg = {}
    p = os.path.join(args.tokenizer, "tokenizer_config.json")
    if os.path.exists(p):
        with open(p) as f:
            tcfg = json.load(f)

    def token_id(name, default):
        t = tcfg.get(name)
        if isinstance(t, dict):
            t = t.get("content")
        i = tok.token_to_id(t) if t else None
        return default if i is None else i

    bos, eos = token_id("bos_token", 1), token_id("eos_token", 2)
    os.makedirs(args.out, exist_ok=True)
    for f in os.listdir(args.tokenizer):
        if f.startswith("tokenizer") or f in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(os.path.join(args.tokenizer, f), os.path.join(args.out, f))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config(args.shape, vocab, args.layers, bos, eos), f, indent=1)
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos}, f)
    if args.config_only:
        print("vllm_model.py: %s: %s config and tokenizer only (vocab %d)" % (args.out, args.shape, vocab), flush=True)
        return

    H, I, KV = SHAPES["8b"][0], SHAPES["8b"][1], SHAPES["8b"][4] * 128
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_(0.0, 0.02, generator=gen).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    shards = []
    cur = {"model.embed_tokens.weight": rnd(vocab, H)}
    for i in range(args.layers):
        p = "model.layers.%d." % i
        cur.update({p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H),
                    p + "self_attn.q_proj.weight": rnd(H, H), p + "self_attn.k_proj.weight": rnd(KV, H),
                    p + "self_attn.v_proj.weight": rnd(KV, H), p + "self_attn.o_proj.weight": rnd(H, H),
                    p + "mlp.gate_proj.weight": rnd(I, H), p + "mlp.up_proj.weight": rnd(I, H),
                    p + "mlp.down_proj.weight": rnd(H, I)})
        if (i + 1) % args.layers_per_shard == 0 and i + 1 < args.layers:
            shards.append(cur)
            cur = {}
    cur.update({"model.norm.weight": ones(H), "lm_head.weight": rnd(vocab, H)})
    shards.append(cur)
    weight_map, total, nparams = {}, 0, 0
    for n, sd in enumerate(shards):
        name = "model-%05d-of-%05d.safetensors" % (n + 1, len(shards))
        save_file(sd, os.path.join(args.out, name), metadata={"format": "pt"})
        for k, v in sd.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
            nparams += v.numel()
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    print("vllm_model.py: %s: %.2f B parameters, %.1f GiB bf16 in %d shards, vocab %d (bos %s, eos %s), %.0f s"
          % (args.out, nparams / 1e9, total / 2**30, len(shards), vocab, bos, eos, time.time() - t0), flush=True)


if __name__ == "__main__":
    main()
