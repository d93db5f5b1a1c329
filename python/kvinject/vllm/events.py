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
    """Every open event file's queued lines written (the writer threads are daemons)."""
    for ev in list(_LIVE):
        ev.flush(timeout=5.0)


def _after_fork_in_child() -> None:
    """A forked child has no writer thread (nor may the parent's locks be free):
    each event file starts over, its lines queued in the parent left to the parent."""
    for ev in list(_LIVE):
        ev._reset()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Events:
    """JSON lines to a file (or nothing), each stamped with its time ``t`` when
    ``write`` is called. ``write`` only queues the record: a writer thread
    serializes and appends it, so an engine step that records something pays a
    queue put, not ``json.dumps`` and a file write, before its forward (the
    thread runs while the step waits for the GPU). ``flush`` returns once every
    record queued before it is in the file: the connector flushes at the end of
    each step's work (after the forward), so a reader of the file sees a step's
    records once vLLM has the step's output. ``close`` flushes and closes.
    Records must not be changed after ``write`` (the connector's are fresh dicts
    of numbers and strings). From several threads."""

    def __init__(self, path: Optional[str]):
        self.f = open(path, "a", buffering=1) if path else None
        self._reset()
        if self.f is not None:
            _LIVE.add(self)

    def _reset(self) -> None:
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._queued = 0   # records queued so far; counted and queued under _lock: the queue's order
        self._lock = threading.Lock()
        self._written = 0
        self._done = threading.Condition()
        self._thread: Optional[threading.Thread] = None   # started by the first write

    @property
    def enabled(self) -> bool:
        """Whether lines go anywhere (a record not written need not be built)."""
        return self.f is not None

    def write(self, **rec) -> None:
        if self.f is None:
            return
        rec["t"] = time.time()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvinject-events", daemon=True)
                self._thread.start()
            self._queued += 1
            self._q.put(rec)

    def _run(self) -> None:
        f = self.f
        while True:
            recs = [self._q.get()]
            while True:   # what else is queued goes out in the same write
                try:
                    recs.append(self._q.get_nowait())
                except queue.Empty:
                    break
            stop = recs[-1] is None
            lines = [json.dumps(r, default=str) + "\n" for r in recs if r is not None]
            try:
                if lines:
                    f.write("".join(lines))
            except (OSError, ValueError):   # a full disk or a closed file: the lines are lost, not the engine
                pass
            with self._done:
                self._written += len(lines)
                self._done.notify_all()
            if stop:
                return

    def flush(self, timeout: Optional[float] = 10.0) -> bool:
        """Waits until the records queued before this call are in the file; False if
        ``timeout`` seconds passed first."""
        if self._thread is None:
            return True
        with self._lock:
            target = self._queued
        with self._done:
            return self._done.wait_for(lambda: self._written >= target, timeout)

    def close(self) -> None:
        """Flushes, stops the writer and closes the file (later writes go nowhere)."""
        f = self.f
        if f is None:
            return
        self.flush()
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=10.0)
            self._thread = None
        self.f = None
        _LIVE.discard(self)
        f.close()
