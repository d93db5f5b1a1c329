"""The connector's event file: JSON lines (per-step timing, captures, errors),
written where ``events_path`` asks for them, or nowhere."""
from __future__ import annotations

import json
import threading
import time
from typing import Optional


class Events:
    """JSON lines to a file (or nothing), each stamped with its time ``t``; from
    several threads (a line at a time)."""

    def __init__(self, path: Optional[str]):
        self.f = open(path, "a", buffering=1) if path else None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether lines go anywhere (a record not written need not be built)."""
        return self.f is not None

    def write(self, **rec) -> None:
        if self.f is not None:
            rec["t"] = time.time()
            line = json.dumps(rec) + "\n"
            with self._lock:
                self.f.write(line)
