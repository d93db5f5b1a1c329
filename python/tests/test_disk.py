"""The disk tier through the binding (kvinject/store.h, "Disk tier"): facts round
trip through the tenant files of a store whose memory holds only a few pages,
Store.fact_tier follows the drops and read-backs, a second store on the directory
loads the tenant with prefetch, and two processes sharing a directory respect each
other's ownership leases (LeasedError, a takeover once the lease ran out,
tenant_release freeing it at once)."""
from __future__ import annotations

import array
import os
import subprocess
import sys
import time

import pytest

import kvinject as kvi
from kvinject import DType, Tier

L, H, D, PT = 2, 2, 8, 4
PAGE = 2 * L * PT * H * D * 4  # bytes of one fp32 page: K and V, every layer and head


def fact(tag: int, tokens: int = 3):
    """Values that depend on the tag only, exact in fp32 (both processes make the same)."""
    n = L * tokens * H * D
    k = array.array("f", [((tag * 131 + i * 7) % 251 - 125) / 8.0 for i in range(n)])
    v = array.array("f", [((tag * 17 + i * 13) % 241 - 120) / 16.0 for i in range(n)])
    return k, v


def make_model():
    m = kvi.Model(L, H, D)
    m.set_rope(theta=10000.0)
    return m


def make_store(model, pages: int, disk_dir=None, **kw):
    return kvi.Store(model, pages * PAGE, backend=kvi.Backend.CPU, dtype=DType.FP32, page_tokens=PT,
                     disk_dir=disk_dir, **kw)


# A second replica in its own process: one command a line on stdin, one answer a line on stdout.
CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
import test_disk as t
import kvinject as kvi
m = t.make_model()
s = t.make_store(m, 3, sys.argv[2], disk_owner=sys.argv[3], disk_lease_ms=int(sys.argv[4]))
for line in sys.stdin:
    w = line.split()
    try:
        if w[0] == "put":
            k, v = t.fact(int(w[3]))
            s.put(int(w[1]), int(w[2]), k, v, replace=True)
            out = "ok"
        elif w[0] == "release":
            s.tenant_release(int(w[1]))
            out = "ok"
        elif w[0] == "load":
            s.prefetch(int(w[1]))
            out = " ".join(map(str, s.list(int(w[1]))))
        elif w[0] == "quit":
            s.close()
            print("bye", flush=True)
            break
    except kvi.KviError as e:
        out = type(e).__name__ + ": " + str(e)
    print(out, flush=True)
"""


class Replica:
    def __init__(self, disk_dir: str, owner: str, lease_ms: int):
        here = os.path.dirname(os.path.abspath(__file__))
        self.p = subprocess.Popen([sys.executable, "-c", CHILD, here, disk_dir, owner, str(lease_ms)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, universal_newlines=True)

    def __call__(self, cmd: str) -> str:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, "the replica process died (exit status %s)" % self.p.poll()
        return line.strip()

    def quit(self) -> None:
        if self.p.poll() is None:
            assert self("quit") == "bye"
            assert self.p.wait(30) == 0

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


@pytest.fixture
def replica(tmp_path):
    made = []

    def start(owner: str, lease_ms: int) -> Replica:
        r = Replica(str(tmp_path), owner, lease_ms)
        made.append(r)
        return r
    yield start
    for r in made:
        r.kill()


def reads_as(s, tenant, fact_id, tag) -> bool:
    """Whether the store's fact reads back as fact(tag), value for value."""
    k, v = s.read(tenant, fact_id)
    ek, ev = fact(tag)
    return list(k) == list(ek) and list(v) == list(ev)


def until(cond, timeout=10.0):
    """Waits for cond() (prefetch reads the disk on the store's I/O thread); asserts it came."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "not within %.0f s" % timeout
        time.sleep(0.01)


def tiers(s, tenant, ids):
    return [s.fact_tier(tenant, i) for i in ids]


class TestDiskTier:
    @pytest.fixture(autouse=True)
    def _setup(self, tmp_path, closing):
        self.closing = closing
        self.dir = str(tmp_path)
        self.model = make_model()
        closing.append(self.model)

    def store(self, pages, disk_dir=None, **kw):
        s = make_store(self.model, pages, disk_dir, **kw)
        self.closing.append(s)
        return s

    def test_round_trip_through_the_disk(self):
        s = self.store(3, self.dir)  # 3 pages of memory, 12 one-page facts
        for i in range(12):
            k, v = fact(i)
            s.put(5, i, k, v)
        assert os.path.exists(os.path.join(self.dir, "%016x.kvi" % 5))
        st = s.stats()
        assert st.facts == 12
        assert st.facts_on_disk_only == 9
        assert st.drops_to_disk >= 9
        assert st.disk_writes >= 12 and st.disk_write_bytes >= 12 * PAGE // 2 and st.disk_bytes > 0
        assert st.disk_reads == 0
        assert tiers(s, 5, range(12)).count(Tier.DISK) == 9
        for i in range(12):  # each read brings the fact back, byte for byte
            assert reads_as(s, 5, i, i), i
            assert s.fact_tier(5, i) == Tier.HOST
        st = s.stats()
        assert st.disk_reads >= 9 and st.disk_read_bytes > 0
        assert st.facts_on_disk_only == 9  # memory still holds three of them
        s.close()
        # a new store on the directory: the tenant is in its file, loaded by prefetch
        t = self.store(3, self.dir)
        assert t.count(5) == 0
        t.prefetch(5)  # indexes the tenant from its file, then reads back what fits in the background
        assert t.list(5) == list(range(12))
        until(lambda: tiers(t, 5, range(12)).count(Tier.HOST) == 3)
        for i in range(12):
            assert reads_as(t, 5, i, i), i

    def test_fact_tier_follows_drops_and_reads(self):
        s = self.store(2, self.dir)  # room for two one-page facts
        for i in range(2):
            s.put(1, i, *fact(i))
        assert tiers(s, 1, [0, 1]) == [Tier.HOST, Tier.HOST]
        assert s.stats().facts_on_disk_only == 0
        s.put(1, 2, *fact(2))  # the least recently used one goes down
        assert tiers(s, 1, [0, 1, 2]) == [Tier.DISK, Tier.HOST, Tier.HOST]
        st = s.stats()
        assert (st.facts_on_disk_only, st.drops_to_disk) == (1, 1)
        s.read(1, 0)  # back up; 1 is now the least recently used
        assert tiers(s, 1, [0, 1, 2]) == [Tier.HOST, Tier.DISK, Tier.HOST]
        assert s.stats().drops_to_disk == 2
        s.prefetch(1, [1])  # read back in the background; prefetch_wait: until published
        s.prefetch_wait()
        assert s.fact_tier(1, 1) == Tier.HOST
        assert tiers(s, 1, [0, 1, 2]).count(Tier.DISK) == 1 == s.stats().facts_on_disk_only
        # list_on_disk: what fact_tier says of each, in one call
        assert s.list_on_disk(1) == [i for i in s.list(1) if s.fact_tier(1, i) == Tier.DISK]
        assert len(s.list_on_disk(1)) == 1 and s.list_on_disk(9) == []
        s.remove(1, 1)
        with pytest.raises(kvi.NotFoundError):
            s.fact_tier(1, 1)
        # without a disk tier: a CPU store's facts are HOST, the disk counters zero
        m = self.store(4)
        m.put(1, 0, *fact(0))
        assert m.fact_tier(1, 0) == Tier.HOST and m.list_on_disk(1) == []
        st = m.stats()
        assert (st.facts_on_disk_only, st.disk_bytes, st.disk_writes, st.drops_to_disk) == (0, 0, 0, 0)
        m.tenant_release(1)  # no disk tier: nothing to do

    def test_disk_changes_lists_the_tenants_whose_disk_facts_changed(self):
        s = self.store(2, self.dir)
        assert s.disk_changes() == []
        s.put(1, 0, *fact(0))
        s.put(2, 0, *fact(1))
        assert s.disk_changes() == []  # nothing on disk yet
        s.put(3, 0, *fact(2))  # tenant 1's fact goes down
        assert s.disk_changes() == [1]
        assert s.disk_changes() == []  # taken
        s.read(1, 0)  # back up, tenant 2's goes down
        assert sorted(s.disk_changes()) == [1, 2]
        for t in range(10, 300):  # more than one call's worth (256)
            s.put(t, 0, *fact(t))
        changed = s.disk_changes()
        assert len(changed) == len(set(changed)) >= 288 and set(range(10, 298)) <= set(changed)
        assert self.store(2).disk_changes() == []  # no disk tier

    def test_options_reach_the_library(self, tmp_path):
        with pytest.raises(kvi.IOError_, match="missing"):
            self.store(2, os.path.join(self.dir, "missing"))
        with pytest.raises(kvi.InvalidArgumentError):
            self.store(2, self.dir, disk_owner="two\nlines")
        with pytest.raises(kvi.InvalidArgumentError):
            self.store(2, self.dir, disk_lease_ms=-1)
        with pytest.raises(ValueError):
            self.store(2, self.dir, disk_owner="nul\0")
        # disk_budget_bytes: the tenant files may not grow past it
        s = self.store(2, str(tmp_path), disk_budget_bytes=3 * PAGE)
        with pytest.raises(kvi.KviError, match="disk_budget_bytes"):
            for i in range(16):
                s.put(1, i, *fact(i))
        assert s.stats().disk_bytes <= 3 * PAGE

    def test_lease_between_two_processes(self, replica):
        b = replica("replica-b", 300)
        for i in range(5):
            assert b("put 7 %d %d" % (i, i)) == "ok"
        a = self.store(3, self.dir, disk_owner="replica-a", disk_lease_ms=300)
        with pytest.raises(kvi.LeasedError) as e:
            a.put(7, 40, *fact(40))
        assert e.value.status == kvi.Status.ERR_LEASED
        assert "replica-b" in str(e.value)
        assert a.count(7) == 0  # nothing written
        a.prefetch(7)  # reading needs no lease
        assert a.list(7) == list(range(5))
        a.put(8, 1, *fact(1))  # another tenant is free
        time.sleep(0.4)  # B's lease runs out: A takes the tenant over
        a.put(7, 40, *fact(40))
        assert a.list(7) == [0, 1, 2, 3, 4, 40]
        answer = b("put 7 50 50")
        assert answer.startswith("LeasedError") and "replica-a" in answer
        b.quit()

    def test_release_lets_the_other_write_at_once(self, replica):
        b = replica("replica-b", 60000)
        for i in range(3):
            assert b("put 9 %d %d" % (i, 10 + i)) == "ok"
        a = self.store(3, self.dir, disk_owner="replica-a", disk_lease_ms=60000)
        with pytest.raises(kvi.LeasedError):
            a.put(9, 100, *fact(100))
        assert b("release 9") == "ok"
        a.put(9, 100, *fact(100))  # at once, though B's lease had a minute left
        assert a.list(9) == [0, 1, 2, 100]
        for i in range(3):  # B's facts, read from the shared file
            assert reads_as(a, 9, i, 10 + i), i
        assert b("put 9 5 5").startswith("LeasedError")  # A holds it now
        a.tenant_release(9)
        assert b("put 9 5 5") == "ok"
        assert b("load 9") == "0 1 2 5 100"  # B sees A's fact too
        b.quit()  # closing gives B's lease up
        a.put(9, 6, *fact(6))
        assert a.list(9) == [0, 1, 2, 5, 6, 100]
