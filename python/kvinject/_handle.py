"""The base of every Python object that owns a libkvinject handle."""
from __future__ import annotations

import ctypes

from ._lib import lib


class Handle:
    """A library handle, freed by the C function named ``_destroy`` on
    :meth:`close`, at the end of a ``with`` block, or when the object is
    collected. ``_what`` names it in the error for a closed handle (default:
    the class name in lower case)."""

    _destroy = ""
    _what = ""

    @property
    def handle(self) -> ctypes.c_void_p:
        """The C pointer (for calls through ctypes); ValueError once closed."""
        if not getattr(self, "_h", None):
            raise ValueError("the %s is closed" % (self._what or type(self).__name__.lower()))
        return self._h

    def close(self) -> None:
        """Frees the handle (idempotent). Work it enqueued must be complete."""
        if getattr(self, "_h", None):
            getattr(lib(), self._destroy)(self._h)
            self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # at interpreter exit the library may be gone already
            pass
