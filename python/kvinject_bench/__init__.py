"""The benchmarks of libkvinject with torch and transformers (5.x), run as
modules with python/ on the import path (the directory itself, or
PYTHONPATH=python from the repository root):

    python3 -m kvinject_bench.hf_parity --device cpu --quick   # parity with a full prefill
    python3 -m kvinject_bench.hf_speed --device cuda           # TTFT and throughput
    python3 -m kvinject_bench.recall --model DIR ...           # recall on a real instruct model
    python3 -m kvinject_bench.recall_recompute ...             # recall.py with selective recompute
    python3 -m kvinject_bench.recall_change --model DIR ...    # facts superseded or deleted: leaks
    python3 -m kvinject_bench.recall_cost --model DIR ...      # encoding cost per fact and per add
    python3 -m kvinject_bench.recompute_eval MODEL_DIR ...     # selective recompute, KL and TTFT
    python3 -m kvinject_bench.gguf_to_safetensors MODEL.gguf OUT_DIR
    python3 -m kvinject_bench.capacity --markdown              # users per node, break-even (no torch)

common holds what they share (the models, the RoPE checks and the device
helpers come from kvinject.hf.testing, which the tests use too). Not part of
the kvinject wheel; one test imports it: test_capacity (capacity's arithmetic).
"""
