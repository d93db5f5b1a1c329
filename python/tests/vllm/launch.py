#!/usr/bin/env python3
"""Runs a test module (a file named test_*.py: with pytest) or any other script
(given by its path) in the vLLM virtual environment that .ci/install-vllm
builds, or exits 77 (Meson's "skipped") when it is absent.

    python3 launch.py TEST_MODULE.py [PYTEST ARGS...]   # e.g. test_connector.py --layerwise
    python3 launch.py SCRIPT [ARGS...]
    PYTHON launch.py --pytest-here TEST_MODULE.py [PYTEST ARGS...]

A test module's exit status, as Meson reads it: 0 when its tests pass, 1 when
one fails (or errors, or none ran), 77 when every test skipped. Paths are
relative to this directory. --pytest-here runs the module with pytest in the
interpreter that runs launch.py (an environment of one's own, e.g. on the GPU
machine: tests/gpu/run_vllm_layouts.sh), the path relative to the current
directory, and gives the same exit status.

The environment: KVI_VLLM_CACHE (default /var/cache/kvinject/vllm) holds
venv/ (its kvi-env file: LD_LIBRARY_PATH for its torch) and
model/SmolLM2-135M-Instruct/. The script gets PYTHONPATH at this repository's
python/ (KVINJECT_LIBRARY as Meson sets it), HF_HUB_OFFLINE=1 and
VLLM_CPU_KVCACHE_SPACE=1 unless set, and KVI_VLLM_MODEL.
"""
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(os.path.dirname(HERE))
PYTEST_MODE = "--pytest-here"  # pytest in this interpreter (how launch.py runs inside the venv)


def is_test_module(path):
    name = os.path.basename(path)
    return name.startswith("test_") and name.endswith(".py")


class _Outcomes:
    """A pytest plugin counting what ran: pytest's own status cannot tell "all
    skipped" from "passed"."""

    def __init__(self):
        self.passed = self.failed = self.skipped = 0

    def pytest_collectreport(self, report):
        if report.failed:
            self.failed += 1
        elif report.skipped:
            self.skipped += 1

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed += 1
        elif report.skipped and report.when in ("setup", "call"):
            self.skipped += 1
        elif report.passed and report.when == "call":
            self.passed += 1


def run_pytest(module, args):
    """pytest on one module (in this interpreter); Meson's exit status."""
    import pytest
    counts = _Outcomes()
    # -s: the engines' logs and the tests' reports (KL, agreement) go to Meson's log as they come
    rc = pytest.main(["-v", "-s", "-rfEs", "-p", "no:cacheprovider", module] + list(args), plugins=[counts])
    if rc not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED) or counts.failed:
        return 1
    if counts.passed == 0:
        if counts.skipped:
            return 77
        print("launch.py: no test ran", file=sys.stderr)
        return 1
    return 0


def main(argv):
    if len(argv) >= 3 and argv[1] == PYTEST_MODE:
        return run_pytest(argv[2], argv[3:])
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
    script = os.path.join(HERE, argv[1])
    test = is_test_module(script)
    if test and not glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "pytest")):
        print("skipped: the vLLM environment %s has no pytest (built by an older .ci/install-vllm: run it "
              "again)" % venv)
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
    cmd = [py, os.path.abspath(__file__), PYTEST_MODE, script] if test else [py, script]
    sys.stdout.flush()
    os.execve(py, cmd + argv[2:], env)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
