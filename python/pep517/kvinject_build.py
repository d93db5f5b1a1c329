"""The build backend of the kvinject Python package (PEP 517 and PEP 660).

Standard library only, so that ``pip install ./python`` and ``pip wheel`` work
offline with no build dependency to fetch. It builds:

- a pure wheel (``kvinject-V-py3-none-any.whl``): the package, which finds an
  installed libkvinject at import (see kvinject/_lib.py for the order);
- a wheel that bundles the library, with the config setting ``bundle`` naming
  a built libkvinject.so (``pip wheel ./python --config-settings bundle=/abs/build/lib/libkvinject.so``):
  the file is stored as ``kvinject/_libs/libkvinject.so.0``, which the package
  loads before any installed one, and the wheel is tagged for this platform
  (``py3-none-linux_x86_64``: it holds machine code, but no Python extension);
- an sdist (``kvinject-V.tar.gz``): this directory's package, backend and
  README;
- an editable wheel (``pip install -e ./python``): a .pth file that puts this
  directory on sys.path, so the package imported is the source tree's.

The version is ``__version__`` of kvinject/__init__.py (the library's).
Console scripts are pyproject.toml's ``[project.scripts]`` table (``name =
"module:function"`` lines, read without a TOML parser: Python 3.9 has none),
written to every wheel's ``entry_points.txt``.
"""
from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import sysconfig
import tarfile
import zipfile

NAME = "kvinject"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # python/
PKG = os.path.join(ROOT, NAME)
BUNDLED = NAME + "/_libs/libkvinject.so.0"  # where the package looks (kvinject/_lib.py)


def _version() -> str:
    with open(os.path.join(PKG, "__init__.py"), encoding="utf-8") as f:
        m = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    if not m:
        raise RuntimeError("kvinject/__init__.py has no __version__ line")
    return m.group(1)


def _metadata() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    return ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n"
            "Summary: Python binding of libkvinject: inject precomputed per-fact KV caches into LLM engines\n"
            "License: Apache-2.0\nRequires-Python: >=3.9\n"
            "Classifier: Programming Language :: Python :: 3\nClassifier: Typing :: Typed\n"
            "Description-Content-Type: text/markdown\n\n%s" % (NAME, _version(), readme))


def _scripts():
    """[(name, "module:function")] of pyproject.toml's [project.scripts] table."""
    out = []
    section = None
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line.startswith("["):
                section = line.strip("[] ")
                continue
            if section != "project.scripts" or not line:
                continue
            m = re.match(r'^"?([A-Za-z0-9_.-]+)"?\s*=\s*"([A-Za-z0-9_.]+:[A-Za-z0-9_.]+)"$', line)
            if not m:
                raise ValueError("pyproject.toml [project.scripts]: cannot read %r (name = \"module:function\")"
                                 % line)
            out.append((m.group(1), m.group(2)))
    return out


def _entry_points() -> str:
    scripts = _scripts()
    if not scripts:
        return ""
    return "[console_scripts]\n" + "".join("%s = %s\n" % s for s in scripts)


def _package_files():
    """(archive name, path) of every file of the package: .py files and py.typed,
    never caches or a library left in kvinject/_libs."""
    out = []
    for d, dirs, files in os.walk(PKG):
        dirs[:] = sorted(x for x in dirs if x not in ("__pycache__", "_libs"))
        for f in sorted(files):
            if f.endswith(".py") or f == "py.typed":
                p = os.path.join(d, f)
                out.append((os.path.relpath(p, ROOT).replace(os.sep, "/"), p))
    return out


def _bundle_path(config_settings):
    lib = (config_settings or {}).get("bundle")
    if not lib:
        return None
    if isinstance(lib, list):
        raise ValueError("bundle: give one library, not %d" % len(lib))
    path = os.path.realpath(os.path.expanduser(lib))
    if not os.path.isfile(path):
        raise FileNotFoundError("bundle: %s is not a file (give the absolute path of a built "
                                "libkvinject.so, e.g. $PWD/build/lib/libkvinject.so)" % lib)
    with open(path, "rb") as f:
        if f.read(4) != b"\x7fELF":
            raise ValueError("bundle: %s is not a shared library (no ELF header)" % lib)
    return path


def _tag(bundled: bool) -> str:
    if not bundled:
        return "py3-none-any"
    return "py3-none-" + re.sub(r"[^A-Za-z0-9]", "_", sysconfig.get_platform())


class _Wheel:
    def __init__(self, directory: str, tag: str):
        self.dist_info = "%s-%s.dist-info" % (NAME, _version())
        self.name = "%s-%s-%s.whl" % (NAME, _version(), tag)
        self.tag = tag
        self.path = os.path.join(directory, self.name)
        self.zf = zipfile.ZipFile(self.path, "w", zipfile.ZIP_DEFLATED)
        self.records = []

    def add(self, arcname: str, data: bytes, mode: int = 0o644) -> None:
        info = zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0))
        info.external_attr = (0o100000 | mode) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        self.zf.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        self.records.append("%s,sha256=%s,%d" % (arcname, digest, len(data)))

    def add_file(self, arcname: str, path: str, mode: int = 0o644) -> None:
        with open(path, "rb") as f:
            self.add(arcname, f.read(), mode)

    def close(self) -> str:
        di = self.dist_info
        self.add(di + "/METADATA", _metadata().encode())
        ep = _entry_points()
        if ep:
            self.add(di + "/entry_points.txt", ep.encode())
        self.add(di + "/WHEEL", ("Wheel-Version: 1.0\nGenerator: kvinject_build\nRoot-Is-Purelib: %s\nTag: %s\n"
                                 % ("true" if self.tag.endswith("-any") else "false", self.tag)).encode())
        self.add(di + "/LICENSE", _license())
        self.records.append(di + "/RECORD,,")
        self.zf.writestr(zipfile.ZipInfo(di + "/RECORD", date_time=(1980, 1, 1, 0, 0, 0)),
                         "\n".join(self.records) + "\n")
        self.zf.close()
        return self.name


def _license() -> bytes:
    for p in (os.path.join(ROOT, "LICENSE"), os.path.join(os.path.dirname(ROOT), "LICENSE")):
        if os.path.isfile(p):
            with open(p, "rb") as f:
                return f.read()
    return b"Apache-2.0\n"


# ------------------------------------------------------------------ PEP 517

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    lib = _bundle_path(config_settings)
    w = _Wheel(wheel_directory, _tag(lib is not None))
    for arc, p in _package_files():
        w.add_file(arc, p)
    if lib is not None:
        w.add_file(BUNDLED, lib, 0o755)
    return w.close()


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    w = _Wheel(wheel_directory, _tag(False))
    w.add("_kvinject_editable.pth", (ROOT + "\n").encode())
    return w.close()


def build_sdist(sdist_directory, config_settings=None):
    base = "%s-%s" % (NAME, _version())
    name = base + ".tar.gz"
    files = [(arc, p) for arc, p in _package_files()]
    for rel in ("pyproject.toml", "README.md", "pep517/kvinject_build.py"):
        files.append((rel, os.path.join(ROOT, rel)))
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz", format=tarfile.PAX_FORMAT) as tf:
        for arc, p in files:
            ti = tf.gettarinfo(p, base + "/" + arc)
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            ti.mtime = 0
            with open(p, "rb") as f:
                tf.addfile(ti, f)
        pkg_info = _metadata().encode()
        ti = tarfile.TarInfo(base + "/PKG-INFO")
        ti.size = len(pkg_info)
        tf.addfile(ti, io.BytesIO(pkg_info))
        lic = _license()
        ti = tarfile.TarInfo(base + "/LICENSE")
        ti.size = len(lic)
        tf.addfile(ti, io.BytesIO(lic))
    return name
