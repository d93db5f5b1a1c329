"""Rendezvous (highest random weight) hashing: each user is owned by the live
replica whose hash with the user's id is highest. A replica that leaves moves
only its own users (each to its next-highest replica); when it comes back
they come back to it. Pure functions, no state.
"""
from __future__ import annotations

import hashlib
from typing import Iterable, List, Optional


def weight(replica: str, user: int) -> int:
    h = hashlib.sha256(("%s\0%d" % (replica, user)).encode()).digest()
    return int.from_bytes(h[:8], "big")


def ranked(replicas: Iterable[str], user: int) -> List[str]:
    """The replicas in the user's order of preference (owner first)."""
    return sorted(replicas, key=lambda r: (weight(r, user), r), reverse=True)


def owner(replicas: Iterable[str], user: int) -> Optional[str]:
    """The owner of ``user`` among ``replicas`` (None when there are none)."""
    r = ranked(replicas, user)
    return r[0] if r else None
