"""The library lookup order (kvinject/_lib.py, LOOKUP_ORDER): each rule on its
own and against the rules after it, in a fresh interpreter whose package is a
copy of kvinject outside the repository (or in a fake repository), with
KVINJECT_LIBRARY, KVINJECT_BUILD, LD_LIBRARY_PATH and pkg-config's paths under
the test's control. The library is the build's (KVINJECT_LIBRARY as Meson sets
it), copied where each rule looks."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

import kvi_testutil  # noqa: F401  (finds the package)
import kvinject as kvi

PKG = os.path.dirname(os.path.abspath(kvi.__file__))
SONAME = "libkvinject.so.0"
PROBE = "import json, kvinject; print(json.dumps([kvinject.library_path(), kvinject.library_found_by()]))"


class TestLookupOrder:
    @pytest.fixture(autouse=True, scope="class")
    def _tree(self, request):
        cls = request.cls
        cls.tmp = tempfile.mkdtemp(prefix="kvi-lookup-")
        cls.lib = os.path.realpath(kvi.library_path())
        if not os.path.isfile(cls.lib):
            pytest.skip("the loaded library %s is not a file path" % kvi.library_path())
        t = cls.tmp
        # a copy of the package, outside any repository
        cls.plain = cls._package(os.path.join(t, "plain"))
        # the same with a bundled library, as a bundling wheel installs it
        cls.bundled = cls._package(os.path.join(t, "bundled"))
        os.makedirs(os.path.join(cls.bundled, "kvinject", "_libs"))
        shutil.copy(cls.lib, os.path.join(cls.bundled, "kvinject", "_libs", SONAME))
        # a fake repository: meson.build, python/kvinject, build/lib
        cls.repo = os.path.join(t, "repo")
        cls._package(os.path.join(cls.repo, "python"))
        open(os.path.join(cls.repo, "meson.build"), "w").close()
        cls.repo_lib = cls._libdir(os.path.join(cls.repo, "build", "lib"))
        # a build directory given by environment variable
        cls.build = os.path.join(t, "build-x")
        cls.build_lib = cls._libdir(os.path.join(cls.build, "lib"))
        # an "installed" library with its kvinject.pc
        cls.prefix = os.path.join(t, "prefix")
        cls.inst_lib = cls._libdir(os.path.join(cls.prefix, "lib"))
        cls.pc_dir = os.path.join(cls.prefix, "lib", "pkgconfig")
        os.makedirs(cls.pc_dir)
        with open(os.path.join(cls.pc_dir, "kvinject.pc"), "w") as f:
            f.write("prefix=%s\nlibdir=${prefix}/lib\nName: kvinject\nDescription: test\nVersion: %s\n"
                    "Libs: -L${libdir} -lkvinject\n" % (cls.prefix, kvi.version()))
        cls.empty = os.path.join(t, "empty")
        os.makedirs(cls.empty)
        yield
        shutil.rmtree(cls.tmp, ignore_errors=True)

    @classmethod
    def _package(cls, root):
        shutil.copytree(PKG, os.path.join(root, "kvinject"), ignore=shutil.ignore_patterns("__pycache__", "_libs"))
        return root

    @classmethod
    def _libdir(cls, d):
        os.makedirs(d)
        shutil.copy(cls.lib, os.path.join(d, SONAME))
        return os.path.join(d, SONAME)

    def load(self, pythonpath, pkg_config=False, **env_vars):
        """(path, found_by, stderr) of a fresh interpreter importing kvinject from
        pythonpath; pkg-config sees only the fake prefix's .pc when pkg_config."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("KVINJECT_LIBRARY", "KVINJECT_BUILD", "LD_LIBRARY_PATH", "PKG_CONFIG_PATH",
                            "PYTHONPATH")}
        env["PKG_CONFIG_LIBDIR"] = self.pc_dir if pkg_config else self.empty
        env["PYTHONPATH"] = pythonpath
        env.update(env_vars)
        r = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=self.empty, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, universal_newlines=True, timeout=120)
        if r.returncode != 0:
            return None, None, r.stderr
        path, how = json.loads(r.stdout)
        return path, how, r.stderr

    def assert_found(self, got, path, how):
        assert got[:2] == (path, how), got[2]

    def test_library_variable_takes_a_file(self):
        self.assert_found(self.load(self.plain, KVINJECT_LIBRARY=self.build_lib), self.build_lib, "KVINJECT_LIBRARY")

    def test_library_variable_takes_a_build_directory(self):
        self.assert_found(self.load(self.plain, KVINJECT_LIBRARY=self.build), self.build_lib, "KVINJECT_LIBRARY")

    def test_library_variable_comes_first_and_is_final(self):
        self.assert_found(self.load(self.bundled, pkg_config=True, KVINJECT_LIBRARY=self.build,
                                   KVINJECT_BUILD=self.repo), self.build_lib, "KVINJECT_LIBRARY")
        # set but not loadable: the import fails, even with a bundled library there
        path, how, err = self.load(self.bundled, KVINJECT_LIBRARY=os.path.join(self.empty, "nothing"))
        assert path is None
        assert "KVINJECT_LIBRARY" in err
        assert os.path.join(self.empty, "nothing") in err
        tried = err.split("Tried: ", 1)[1]
        assert "(the wheel's bundled library)" not in tried
        assert "; " not in tried

    def test_build_variable_is_deprecated_but_works(self):
        got = self.load(self.bundled, KVINJECT_BUILD=self.build)
        self.assert_found(got, self.build_lib, "KVINJECT_BUILD")
        assert "FutureWarning" in got[2]
        assert "KVINJECT_BUILD is deprecated" in got[2]

    def test_bundled_before_pkg_config_and_loader(self):
        bundled = os.path.join(self.bundled, "kvinject", "_libs", SONAME)
        self.assert_found(self.load(self.bundled, pkg_config=True, LD_LIBRARY_PATH=os.path.dirname(self.inst_lib)),
                         bundled, "the wheel's bundled library")

    def test_repository_build_tree_before_pkg_config(self):
        self.assert_found(self.load(os.path.join(self.repo, "python"), pkg_config=True), self.repo_lib,
                         "the repository's build tree")

    def test_pkg_config(self):
        if shutil.which("pkg-config") is None:
            pytest.skip("no pkg-config")
        self.assert_found(self.load(self.plain, pkg_config=True), self.inst_lib, "pkg-config")

    def test_loader_last(self):
        path, how, err = self.load(self.plain, LD_LIBRARY_PATH=os.path.dirname(self.inst_lib))
        assert how in ('ctypes.util.find_library("kvinject")', "the dynamic loader"), err
        assert os.path.basename(path) == SONAME

    def test_module_main_says_which(self):
        env = {k: v for k, v in os.environ.items() if k not in ("KVINJECT_BUILD", "PYTHONPATH")}
        env.update(PYTHONPATH=self.plain, KVINJECT_LIBRARY=self.build)
        r = subprocess.run([sys.executable, "-m", "kvinject"], env=env, cwd=self.empty, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, universal_newlines=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "libkvinject %s: %s (found by KVINJECT_LIBRARY)" % (kvi.version(), self.build_lib) in r.stdout

    def test_nothing_found_names_every_rule_tried(self):
        path, how, err = self.load(self.plain)
        if path is not None:
            pytest.skip("a libkvinject is installed on this machine (%s, by %s)" % (path, how))
        assert "ImportError" in err
        assert "the dynamic loader" in err
        assert "KVINJECT_LIBRARY" in err


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))
