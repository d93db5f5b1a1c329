"""pytest's setup for the vLLM tests of this directory (run in the vLLM
environment by launch.py): the options the modules take and the fixtures
they share. An engine is a module's fixture: its start-up (~70 s on two
cores) is most of a module's time, so each module starts one (or none)."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest


def pytest_addoption(parser):
    g = parser.getgroup("kvinject-vllm")
    g.addoption("--device", default="cpu",
                help="test_layouts.py, test_recompute.py: cpu, or cuda (a CUDA build of libkvinject and a GPU)")
    g.addoption("--layerwise", action="store_true",
                help="test_connector.py: the connector injects layer by layer; only the plain, capture, exact and "
                     "tenants checks, and the layers' count")
    g.addoption("--keep", metavar="DIR", help="keep the work directory (baseline, events, store file) here")


@pytest.fixture(scope="module")
def work_dir(request):
    """A directory for a module's files (removed afterwards unless --keep names it)."""
    keep = request.config.getoption("--keep")
    path = keep or tempfile.mkdtemp(prefix="kvi-vllm-")
    os.makedirs(path, exist_ok=True)
    yield path
    if not keep:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    import common as C
    return AutoTokenizer.from_pretrained(C.MODEL)


@pytest.fixture(scope="module")
def scenario(tokenizer):
    import common as C
    return C.Scenario(tokenizer)
