#!/usr/bin/env python3
"""Writes a random-weight GGUF shaped like Llama-3.2-1B (16 layers, hidden
2048, 32 query heads and 8 KV heads of 64, FFN 8192, vocabulary 128256, tied
embeddings, RoPE theta 500000) in F16, for timing llama.cpp: the weights are
noise and the vocabulary has no tokenizer (token ids are fed directly).

usage: make_llama_gguf.py OUT.gguf   (needs numpy and the gguf package)
"""
import sys

import numpy as np
import gguf

L, E, H, HKV, D, F, V = 16, 2048, 32, 8, 64, 8192, 128256


def main(out):
    rng = np.random.default_rng(0)

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    w = gguf.GGUFWriter(out, "llama")
    w.add_name("random Llama-3.2-1B-shaped")
    w.add_context_length(8192)
    w.add_embedding_length(E)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(D)
    w.add_vocab_size(V)
    w.add_file_type(1)  # mostly F16
    w.add_tokenizer_model("no_vocab")
    ones = np.ones(E, dtype=np.float32)
    w.add_tensor("token_embd.weight", mat(V, E))
    w.add_tensor("output_norm.weight", ones)
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "attn_q.weight", mat(H * D, E))
        w.add_tensor(p + "attn_k.weight", mat(HKV * D, E))
        w.add_tensor(p + "attn_v.weight", mat(HKV * D, E))
        w.add_tensor(p + "attn_output.weight", mat(E, H * D))
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", mat(F, E))
        w.add_tensor(p + "ffn_up.weight", mat(F, E))
        w.add_tensor(p + "ffn_down.weight", mat(E, F))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(sys.argv[1])
