#!/usr/bin/env python3
"""Checks for vLLM on the GPU machine (tests/gpu/vllm_gpu.sh).

    vllm_deps.py WHEEL...        (here) every Requires-Dist of the wheels (no
                                 extras; markers for CPython 3.12 on Linux x86_64)
                                 names a distribution on the GPU image (IMAGE)
                                 or one of the wheels; exit 1 naming the others
    vllm_deps.py --versions      (there) versions of what vLLM leans on
    vllm_deps.py --import-check  (there) imports vLLM's offline engine path and
                                 reports each module that fails and why (the
                                 missing module's name); exit 1 if any fails
    vllm_deps.py --import-check serve
                                 (there) imports `vllm serve`'s and `vllm bench
                                 serve`'s modules, standing a placeholder in for
                                 each missing module so that one run names them
                                 all; exit 1 if any is missing
"""
import re
import sys
import zipfile

# the distributions of the GPU machine's image (its package list, 2026-11)
IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split()

# vLLM's offline path: LLM(...).generate with a Llama model on CUDA, FlashAttention
# 3, torch.compile and CUDA graphs, the engine core in its own process, a KV connector
ENGINE_MODULES = [
    "vllm", "vllm.entrypoints.llm", "vllm.platforms.cuda", "vllm.v1.engine.core", "vllm.v1.engine.core_client",
    "vllm.v1.engine.llm_engine", "vllm.v1.core.sched.scheduler", "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner", "vllm.v1.attention.backends.flash_attn", "vllm.model_executor.models.llama",
    "vllm.model_executor.model_loader.default_loader", "vllm.model_executor.model_loader.dummy_loader",
    "vllm.compilation.backends", "vllm.v1.sample.sampler", "vllm.v1.structured_output",
    "vllm.distributed.kv_transfer.kv_connector.v1.base", "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.tokenizers", "vllm._C", "vllm.vllm_flash_attn.flash_attn_interface",
]

# `vllm serve`, `vllm bench serve` and the memory gateway in front of them
# (tests/gpu/serve_bench.sh), beyond the engine's
SERVE_MODULES = ["vllm.entrypoints.cli.main", "vllm.entrypoints.cli.serve", "vllm.entrypoints.openai.api_server",
                 "vllm.benchmarks.serve", "vllm.benchmarks.lib.endpoint_request_func",
                 "kvinject.serve.app", "uvicorn", "httpx", "transformers"]


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower().strip()


def marker_applies(marker):
    """Evaluates a Requires-Dist marker for CPython 3.12 on Linux x86_64 (no extras)."""
    if not marker:
        return True
    if "extra" in marker:
        return False
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
           "sys_platform": "linux", "platform_system": "Linux", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix"}
    try:
        from packaging.markers import Marker
        return Marker(marker).evaluate(env)
    except ImportError:  # crude, but what these wheels use
        m = marker.replace("python_version", "'3.12'")
        return "emscripten" not in m and "pypy" not in m and "< '3.12'" not in m and '< "3.12"' not in m


def check_wheels(paths):
    have, reqs = {}, {}
    for p in paths:
        z = zipfile.ZipFile(p)
        meta = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(meta[0]).decode()
        name = norm(re.search(r"^Name: *(.*)$", text, re.M).group(1))
        if name in have:
            print("vllm_deps.py: %s twice (%s, %s)" % (name, have[name], p))
            return 1
        have[name] = p
        reqs[name] = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]
    image = {norm(n) for n in IMAGE}
    missing = []
    for name, rs in sorted(reqs.items()):
        for r in rs:
            spec, _, marker = r.partition(";")
            if not marker_applies(marker.strip()):
                continue
            dep = norm(re.match(r"[A-Za-z0-9_.\-]+", spec.strip()).group(0))
            if dep not in have and dep not in image:
                missing.append("%s needs %s" % (name, r))
    vllm_missing = [m for m in missing if m.startswith("vllm needs")]
    other = [m for m in missing if not m.startswith("vllm needs")]
    print("vllm_deps.py: %d wheels; vllm's Requires-Dist not on the image and not carried (not imported by "
          "its offline engine path, see vllm_gpu.requirements): %s"
          % (len(paths), ", ".join(sorted({m.split(" needs ")[1].split(";")[0].split("[")[0].split("=")[0]
                                           .split("<")[0].split(">")[0].split("!")[0].strip()
                                           for m in vllm_missing})) or "none"))
    for m in other:
        print("vllm_deps.py: MISSING: " + m)
    return 1 if other else 0


def versions():
    import importlib.metadata as md

    def has(n):
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            return "MISSING"

    names = ["torch", "triton", "transformers", "tokenizers", "typing_extensions", "numpy", "safetensors",
             "huggingface_hub", "httpx", "anyio", "protobuf", "pillow", "numba", "setuptools", "psutil", "meson"]
    print("python %s; %s" % (sys.version.split()[0], ", ".join("%s %s" % (n, has(n)) for n in names)))
    return 0


def import_check():
    import importlib
    import time
    t0 = time.time()
    bad = 0
    for m in ENGINE_MODULES:
        try:
            importlib.import_module(m)
        except BaseException as e:  # report every one
            bad += 1
            missing = getattr(e, "name", None) if isinstance(e, ImportError) else None
            print("vllm_deps.py: FAIL import %s: %s: %s%s" % (m, type(e).__name__, str(e)[:300],
                                                             " (missing module %s)" % missing if missing else ""))
    if not bad:
        import vllm
        from vllm.platforms import current_platform
        from vllm.vllm_flash_attn import flash_attn_interface as fa
        print("vllm_deps.py: vllm %s from %s; platform %s, capability %s; FA2 %s, FA3 %s (%s)" % (
            vllm.__version__, vllm.__file__, type(current_platform).__name__,
            current_platform.get_device_capability(), fa.FA2_AVAILABLE, fa.FA3_AVAILABLE,
            fa.FA3_UNAVAILABLE_REASON or "ok"))
    print("vllm_deps.py: %d of %d modules imported in %.0f s" % (len(ENGINE_MODULES) - bad, len(ENGINE_MODULES),
                                                                  time.time() - t0))
    return 1 if bad else 0


def serve_import_check():
    """Imports SERVE_MODULES; each module that is not there is noted and replaced
    by a placeholder (any attribute a class), and the import tried again, so one
    run names every missing module rather than the first."""
    import importlib
    import importlib.abc
    import importlib.machinery
    import types

    missing = []

    class Placeholder(types.ModuleType):
        def __getattr__(self, k):
            if k.startswith("__"):
                raise AttributeError(k)
            return type(k, (object,), {})

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        """Placeholders for the submodules of a missing package."""
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in {m.split(".")[0] for m in missing}:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            mod = Placeholder(spec.name)
            mod.__path__ = []
            return mod

        def exec_module(self, module):
            return None

    sys.meta_path.append(Finder())
    bad = 0
    for m in SERVE_MODULES:
        for _ in range(50):
            try:
                importlib.import_module(m)
                break
            except ModuleNotFoundError as e:
                if not e.name or e.name in missing:
                    print("vllm_deps.py: FAIL import %s: %s" % (m, e))
                    bad += 1
                    break
                missing.append(e.name)
                print("vllm_deps.py: missing module %s (imported under %s)" % (e.name, m))
            except BaseException as e:  # report every one
                print("vllm_deps.py: FAIL import %s: %s: %s" % (m, type(e).__name__, str(e)[:300]))
                bad += 1
                break
    print("vllm_deps.py: vLLM's server modules: %s" % (
        "all imported" if not missing and not bad else "missing %s" % (", ".join(missing) or "none")))
    return 1 if missing or bad else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--versions"]:
        sys.exit(versions())
    if sys.argv[1:] == ["--import-check"]:
        sys.exit(import_check())
    if sys.argv[1:] == ["--import-check", "serve"]:
        sys.exit(serve_import_check())
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    sys.exit(check_wheels(sys.argv[1:]))
