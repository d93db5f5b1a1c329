"""The connector's event file: JSON lines (per-step timing, captures, errors),
written where ``events_path`` asks for them, or nowhere."""
from __future__ import annotations

import atexit
import json
import os
import queue
import threading
import time
import weakref
from typing import Optional

_LIVE: "weakref.WeakSet[Events]" = weakref.WeakSet()


@atexit.register
def _flush_all() -> None:
    """Every open event file's queued lines written."""
    for ev in list(_LIVE):
        ev.flush()


def _after_fork_in_child() -> None:
    """A forked child may find a parent's lock taken (by a thread it does not have):
    each event file starts over, its lines queued in the parent left to the parent."""
    for ev in list(_LIVE):
        ev._reset()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Events:
    """JSON lines to a file (or nothing), each stamped with its time ``t`` when
    ``write`` is called. ``write`` only queues the record, so an engine step that
    records something pays a queue put before its forward, not ``json.dumps``
    and a file write; ``flush`` serializes and appends every record queued
    before it, in the order they were written, in the calling thread. The
    connector flushes at the end of each step's work (the worker after the
    forward is queued, the scheduler when the step's output comes back), so a
    reader of the file sees a step's records once vLLM has the step's output.
    ``close`` flushes and closes; records still queued at exit are flushed then.
    Records must not be changed after ``write`` (the connector's are fresh dicts
    of numbers and strings). From several threads."""

    def __init__(self, path: Optional[str]):
        self.f = open(path, "a", buffering=1) if path else None
        self._reset()
        if self.f is not None:
            _LIVE.add(self)

    def _reset(self) -> None:
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._io = threading.Lock()   # taking records off the queue and writing them: one flush at a time

    @property
    def enabled(self) -> bool:
        """Whether lines go anywhere (a record not written need not be built)."""
        return self.f is not None

    def write(self, **rec) -> None:
        if self.f is None:
            return
        rec["t"] = time.time()
        self._q.put(rec)

    def flush(self) -> None:
        """Writes every record queued before this call (and any queued meanwhile)."""
        if self.f is None:
            return
        with self._io:
            recs = []
            while True:
                try:
                    recs.append(self._q.get_nowait())
                except queue.Empty:
                    break
            if not recs or self.f is None:
                return
            try:
                self.f.write("".join(json.dumps(r, default=str) + "\n" for r in recs))
            except (OSError, ValueError):   # a full disk or a closed file: the lines are lost, not the engine
                pass

    def close(self) -> None:
        """Flushes and closes the file (later writes go nowhere)."""
        f = self.f
        if f is None:
            return
        self.flush()
        with self._io:
            self.f = None
        _LIVE.discard(self)
        f.close()
