#!/usr/bin/env python3
"""Runs a script of this directory (or any script, given by its path) in the
vLLM virtual environment that .ci/install-vllm builds, or exits 77 (Meson's
"skipped") when it is absent.

    python3 launch.py SCRIPT [ARGS...]

The environment: KVI_VLLM_CACHE (default /var/cache/kvinject/vllm) holds
venv/ (its kvi-env file: LD_LIBRARY_PATH for its torch) and
model/SmolLM2-135M-Instruct/. The script gets PYTHONPATH at this repository's
python/ (KVINJECT_LIBRARY as Meson sets it), HF_HUB_OFFLINE=1 and
VLLM_CPU_KVCACHE_SPACE=1 unless set, and KVI_VLLM_MODEL.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(os.path.dirname(HERE))


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    cache = os.environ.get("KVI_VLLM_CACHE", "/var/cache/kvinject/vllm")
    venv = os.path.join(cache, "venv")
    model = os.path.join(cache, "model", "SmolLM2-135M-Instruct")
    missing = [p for p in (os.path.join(venv, ".kvi-installed"), os.path.join(model, ".kvi-converted"))
               if not os.path.exists(p)]
    if missing:
        print("skipped: no vLLM environment (%s missing; .ci/install-vllm builds it)" % ", ".join(missing))
        return 77
    env = dict(os.environ)
    with open(os.path.join(venv, "kvi-env")) as f:
        for line in f:
            k, _, v = line.strip().partition("=")
            if k:
                env[k] = v
    env["PYTHONPATH"] = PYTHON_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["KVI_VLLM_MODEL"] = model
    py = os.path.join(venv, "bin", "python")
    script = os.path.join(HERE, argv[1])
    sys.stdout.flush()
    os.execve(py, [py, script] + argv[2:], env)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
