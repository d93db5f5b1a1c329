"""The gateway's SQLite file: users, their facts and where their memory is
placed. Everything a replica's memory is rebuilt from.

Tables:

- ``users(id, name, next_fact, version, created)``: ``id`` is the user's
  tenant on the replicas (AUTOINCREMENT: a deleted user's id is never given
  again, so a replica that still holds its facts can never serve them to
  anyone); ``next_fact`` the next fact id (ids are never reused: 0 is the
  memory header, facts start at 1); ``version`` grows on every change of the
  user's facts.
- ``facts(id, user, fid, text, tokens, embedding, created)``: ``id`` is the
  API's memory id (unique over all users), ``fid`` the fact id on the
  replicas (per user, in the order facts were said), ``tokens`` int32 token
  ids, ``embedding`` float32, normalized.
- ``placements(user, replica, state, version, epoch)``: the user's memory on a
  replica is exactly the user's facts at ``version`` when ``state`` is
  "clean" and the replica's epoch is still ``epoch``; anything else
  ("unknown", another version or epoch) means a full capture before use.
  A deleted user's placements become "deleted" until the replica has been
  told to remove its facts.
- ``meta(key, value)``: the prompt layout's hash (``layout``): a new system
  prompt, heading or tokenizer makes every placement stale.

One connection, used from the event loop's thread only (each call is short).
"""
from __future__ import annotations

import dataclasses
import sqlite3
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS users (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  name TEXT UNIQUE NOT NULL,
  next_fact INTEGER NOT NULL DEFAULT 1,
  version INTEGER NOT NULL DEFAULT 0,
  created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS facts (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  user INTEGER NOT NULL REFERENCES users(id) ON DELETE CASCADE,
  fid INTEGER NOT NULL,
  text TEXT NOT NULL,
  tokens BLOB NOT NULL,
  embedding BLOB NOT NULL,
  created REAL NOT NULL,
  UNIQUE (user, fid));
CREATE TABLE IF NOT EXISTS placements (
  user INTEGER NOT NULL,
  replica TEXT NOT NULL,
  state TEXT NOT NULL,
  version INTEGER NOT NULL DEFAULT -1,
  epoch TEXT NOT NULL DEFAULT '',
  PRIMARY KEY (user, replica));
"""


@dataclasses.dataclass
class User:
    id: int
    name: str
    next_fact: int
    version: int


@dataclasses.dataclass
class Fact:
    id: int          # the API's memory id
    user: int        # the tenant
    fid: int         # the fact id on the replicas
    text: str
    tokens: List[int]
    embedding: np.ndarray
    created: float

    def public(self, user_name: str) -> dict:
        return {"id": self.id, "user": user_name, "fact_id": self.fid, "text": self.text,
                "tokens": len(self.tokens), "created": self.created}


@dataclasses.dataclass
class Placement:
    user: int
    replica: str
    state: str
    version: int
    epoch: str


def _fact(row) -> Fact:
    return Fact(row[0], row[1], row[2], row[3], np.frombuffer(row[4], dtype=np.int32).tolist(),
                np.frombuffer(row[5], dtype=np.float32), row[6])


_FACT_COLS = "id, user, fid, text, tokens, embedding, created"


class Database:
    def __init__(self, path: str):
        self.path = path
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute("PRAGMA foreign_keys=ON")
        self.conn.executescript(SCHEMA)
        # per user: (fact ids, API ids, embeddings matrix), for search
        self._emb: Dict[int, Tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def close(self) -> None:
        self.conn.close()

    # ------------------------------------------------------------- meta

    def meta(self, key: str) -> Optional[str]:
        r = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return r[0] if r else None

    def set_meta(self, key: str, value: str) -> None:
        self.conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    # ------------------------------------------------------------ users

    def user(self, name: str) -> Optional[User]:
        r = self.conn.execute("SELECT id, name, next_fact, version FROM users WHERE name = ?", (name,)).fetchone()
        return User(*r) if r else None

    def user_by_id(self, uid: int) -> Optional[User]:
        r = self.conn.execute("SELECT id, name, next_fact, version FROM users WHERE id = ?", (uid,)).fetchone()
        return User(*r) if r else None

    def ensure_user(self, name: str) -> User:
        u = self.user(name)
        if u is None:
            self.conn.execute("INSERT INTO users (name, created) VALUES (?, ?)", (name, time.time()))
            u = self.user(name)
        return u

    def users(self) -> List[User]:
        return [User(*r) for r in self.conn.execute("SELECT id, name, next_fact, version FROM users ORDER BY id")]

    def delete_user(self, uid: int) -> None:
        """Deletes the user and its facts; its placements become 'deleted'
        (the replicas still have to be told)."""
        with self.conn:
            self.conn.execute("BEGIN")
            self.conn.execute("DELETE FROM facts WHERE user = ?", (uid,))
            self.conn.execute("DELETE FROM users WHERE id = ?", (uid,))
            self.conn.execute("UPDATE placements SET state = 'deleted' WHERE user = ?", (uid,))
        self._emb.pop(uid, None)

    # ------------------------------------------------------------ facts

    def add_facts(self, uid: int, items: List[Tuple[str, List[int], np.ndarray]]) -> List[Fact]:
        """Appends facts (text, token ids, embedding) to the user's, with the
        next fact ids; one transaction. Returns them."""
        now = time.time()
        with self.conn:
            self.conn.execute("BEGIN")
            nxt = self.conn.execute("SELECT next_fact FROM users WHERE id = ?", (uid,)).fetchone()[0]
            for i, (text, toks, emb) in enumerate(items):
                self.conn.execute("INSERT INTO facts (user, fid, text, tokens, embedding, created) "
                                  "VALUES (?, ?, ?, ?, ?, ?)",
                                  (uid, nxt + i, text, np.asarray(toks, dtype=np.int32).tobytes(),
                                   np.asarray(emb, dtype=np.float32).tobytes(), now))
            self.conn.execute("UPDATE users SET next_fact = ?, version = version + 1 WHERE id = ?",
                              (nxt + len(items), uid))
        self._emb.pop(uid, None)
        rows = self.conn.execute("SELECT %s FROM facts WHERE user = ? AND fid >= ? ORDER BY fid" % _FACT_COLS,
                                 (uid, nxt)).fetchall()
        return [_fact(r) for r in rows]

    def facts(self, uid: int) -> List[Fact]:
        """The user's facts in fact-id order (the order they were said)."""
        return [_fact(r) for r in self.conn.execute(
            "SELECT %s FROM facts WHERE user = ? ORDER BY fid" % _FACT_COLS, (uid,))]

    def fact(self, fact_id: int) -> Optional[Fact]:
        r = self.conn.execute("SELECT %s FROM facts WHERE id = ?" % _FACT_COLS, (fact_id,)).fetchone()
        return _fact(r) if r else None

    def facts_by_fid(self, uid: int, fids: List[int]) -> List[Fact]:
        out = []
        for fid in fids:
            r = self.conn.execute("SELECT %s FROM facts WHERE user = ? AND fid = ?" % _FACT_COLS,
                                  (uid, fid)).fetchone()
            if r:
                out.append(_fact(r))
        return out

    def delete_fact(self, fact_id: int) -> None:
        with self.conn:
            self.conn.execute("BEGIN")
            r = self.conn.execute("SELECT user FROM facts WHERE id = ?", (fact_id,)).fetchone()
            if r is None:
                return
            self.conn.execute("DELETE FROM facts WHERE id = ?", (fact_id,))
            self.conn.execute("UPDATE users SET version = version + 1 WHERE id = ?", (r[0],))
        self._emb.pop(r[0], None)

    def count_facts(self) -> int:
        return self.conn.execute("SELECT COUNT(*) FROM facts").fetchone()[0]

    def embeddings(self, uid: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(fact ids, API ids, [n, dim] float32 matrix) of the user's facts, cached."""
        got = self._emb.get(uid)
        if got is None:
            rows = self.conn.execute("SELECT fid, id, embedding FROM facts WHERE user = ? ORDER BY fid",
                                     (uid,)).fetchall()
            fids = np.array([r[0] for r in rows], dtype=np.int64)
            ids = np.array([r[1] for r in rows], dtype=np.int64)
            mat = (np.stack([np.frombuffer(r[2], dtype=np.float32) for r in rows]) if rows
                   else np.zeros((0, 0), dtype=np.float32))
            got = self._emb[uid] = (fids, ids, mat)
        return got

    # ------------------------------------------------------- placements

    def placement(self, uid: int, replica: str) -> Optional[Placement]:
        r = self.conn.execute("SELECT user, replica, state, version, epoch FROM placements "
                              "WHERE user = ? AND replica = ?", (uid, replica)).fetchone()
        return Placement(*r) if r else None

    def set_placement(self, uid: int, replica: str, state: str, version: int = -1, epoch: str = "") -> None:
        self.conn.execute("INSERT OR REPLACE INTO placements (user, replica, state, version, epoch) "
                          "VALUES (?, ?, ?, ?, ?)", (uid, replica, state, version, epoch))

    def drop_placement(self, uid: int, replica: str) -> None:
        self.conn.execute("DELETE FROM placements WHERE user = ? AND replica = ?", (uid, replica))

    def placements(self, replica: Optional[str] = None, state: Optional[str] = None,
                   user: Optional[int] = None) -> List[Placement]:
        q, a = "SELECT user, replica, state, version, epoch FROM placements WHERE 1", []
        if user is not None:
            q += " AND user = ?"
            a.append(user)
        if replica is not None:
            q += " AND replica = ?"
            a.append(replica)
        if state is not None:
            q += " AND state = ?"
            a.append(state)
        return [Placement(*r) for r in self.conn.execute(q, a)]

    def mark_all_unknown(self) -> None:
        self.conn.execute("UPDATE placements SET state = 'unknown' WHERE state = 'clean'")
