"""PageAllocator: refcounts, allocation, prefix-cache snapshots, LRU eviction (pure Python, fast)."""

import random
from collections import OrderedDict

import pytest

from kimiserve.cache import allocator as allocator_mod
from kimiserve.cache.allocator import PageAllocator, PrefixHit

pytestmark = pytest.mark.fixed_threads  # no torch: page bookkeeping: OMP_NUM_THREADS changes nothing

BS = 8


def take_seq(a, ids, nstate=1):
    """Allocate a fresh sequence holding ceil(len/bs) attention pages and nstate state pages."""
    pages = a.allocate(-(-len(ids) // a.block_size) + nstate)
    assert pages is not None
    return pages[: len(pages) - nstate], pages[len(pages) - nstate:]


def test_allocate_free_refcounts():
    a = PageAllocator(6, BS, 1)
    assert (a.num_free, a.num_used, a.num_cached) == (6, 0, 0)
    p = a.allocate(3)
    assert p == [0, 1, 2] and [a.refcount(x) for x in range(6)] == [1, 1, 1, 0, 0, 0]
    assert a.allocate(0) == []
    a.incref([1, 1, 2])
    assert [a.refcount(x) for x in p] == [1, 3, 2]
    a.decref([0, 1])
    assert a.refcount(0) == 0 and a.num_free == 4 and a.num_used == 2
    assert a.allocate(3) == [3, 4, 5]  # FIFO: freed page 0 goes to the back of the free list
    assert a.allocate(1) == [0]
    with pytest.raises(ValueError, match="page 0 is already free"):
        a.decref([0, 0])
    assert a.refcount(0) == 1  # a failed decref changes nothing
    with pytest.raises(ValueError, match="is free"):
        PageAllocator(2, BS, 0).incref([1])
    for bad in [lambda: PageAllocator(0, BS, 1), lambda: PageAllocator(4, 0, 1), lambda: a.allocate(-1),
                lambda: a.refcount(6), lambda: a.decref([99])]:
        with pytest.raises(ValueError):
            bad()


def test_allocate_impossible_changes_nothing_and_can_allocate_agrees():
    a = PageAllocator(8, BS, 1)
    held = a.allocate(3)
    bt, st = take_seq(a, list(range(10)))  # 2 + 1 pages
    assert a.snapshot(list(range(10)), bt, st)
    a.decref(bt + st)  # now only the snapshot holds them: 3 cached pages
    assert (a.num_free, a.num_cached) == (2, 3)
    before = ([a.refcount(x) for x in range(8)], a.stats())
    for n in range(8):
        assert a.can_allocate(n) == (n <= 5)
    assert a.allocate(6) is None
    assert ([a.refcount(x) for x in range(8)], a.stats()) == before
    assert a.lookup(list(range(12)), 11).num_tokens == 10  # snapshot not evicted by the failed call
    got = a.allocate(5)
    assert got is not None and len(set(got)) == 5 and a.num_free == 0 and a.stats()["snapshots"] == 0
    a.decref(got + held)
    a.check_idle()


def test_snapshot_lookup_exact_longest_partial_and_cap():
    a = PageAllocator(64, BS, 2)
    ids = list(range(100, 150))
    tables = {}
    for p in (5, 16, 37):
        bt, st = take_seq(a, ids[:p], 2)
        assert a.snapshot(ids[:p], bt + [bt[-1]], st)  # extra table entries are ignored
        tables[p] = (bt, st)
        a.decref(bt + st)
    a.check_idle()
    assert a.stats()["snapshots"] == 3 and a.num_cached == sum(len(b) + 2 for b, _ in tables.values())
    for max_tokens, want in [(50, 37), (37, 37), (36, 16), (17, 16), (16, 16), (15, 5), (5, 5), (4, None), (0, None)]:
        hit = a.lookup(ids, max_tokens)
        if want is None:
            assert hit is None
        else:
            assert hit == PrefixHit(want, tables[want][0], tables[want][1])
            assert len(hit.block_table) == -(-want // BS)
    assert a.lookup(ids[:37], 36).num_tokens == 16  # full-prompt hit must leave one token
    assert a.lookup(ids[:38], 37).num_tokens == 37
    assert a.lookup(ids[:20], 100).num_tokens == 16  # query shorter than a snapshot
    assert a.lookup(ids[:5], 5).num_tokens == 5
    assert a.lookup([7] + ids[1:], 50) is None
    # re-registering an equal snapshot takes no pages and returns False
    bt, st = take_seq(a, ids[:16], 2)
    assert not a.snapshot(ids[:16], bt, st)
    assert a.refcount(bt[0]) == 1 and a.lookup(ids, 20).block_table == tables[16][0]
    a.decref(bt + st)
    with pytest.raises(ValueError):
        a.snapshot(ids[:17], tables[16][0], tables[16][1])  # 17 tokens need 3 pages
    assert not a.snapshot([], [], [])


def test_mismatch_in_full_or_partial_page_misses_that_snapshot():
    a = PageAllocator(32, BS, 1)
    ids = list(range(1, 30))
    for p in (3, 13, 21):
        bt, st = take_seq(a, ids[:p])
        a.snapshot(ids[:p], bt, st)
        a.decref(bt + st)
    for pos, want in [(20, 13), (15, 13), (12, 3), (10, 3), (8, 3), (7, 3), (2, None), (0, None)]:
        q = list(ids)
        q[pos] = -1
        hit = a.lookup(q, len(q))
        assert (hit.num_tokens if hit else None) == want, pos
    # a mismatch after the partial tail of a snapshot does not matter
    assert a.lookup(ids[:21] + [999], 22).num_tokens == 21


@pytest.mark.parametrize("collide", [False, True])
def test_hash_collisions_never_give_a_wrong_hit(monkeypatch, collide):
    if collide:
        monkeypatch.setattr(allocator_mod, "page_hash", lambda prev, tokens: 42)
    a = PageAllocator(64, 4, 1)
    seqs = [[0, 0, 0, 0, 1, 1, 1, 1, 2], [1, 1, 1, 1, 0, 0, 0, 0, 2], [0, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 1, 1, 2, 2], [2, 2, 2, 2]]
    for s in seqs:
        bt, st = take_seq(a, s)
        assert a.snapshot(s, bt, st)
        a.decref(bt + st)
    queries = seqs + [[0, 0, 0, 0, 1, 1, 1, 1, 3], [1, 1, 1, 1, 0, 0, 0, 0, 3], [0, 0, 0, 1], [2, 2, 2, 2, 0],
                      [1, 1, 1, 1, 1, 1, 1, 1, 2, 3], [0, 0, 0, 0, 0, 0, 0, 1]]
    for q in queries:
        hit = a.lookup(q + [9], len(q))
        cands = [s for s in seqs if len(s) <= len(q) and q[: len(s)] == s]
        if not cands:
            assert hit is None, q
        else:
            assert hit is not None and q[: hit.num_tokens] == max(cands, key=len), q
    a.evict_all()
    assert a.num_free == 64 and not a._index


def test_lru_eviction_order_and_lookup_refreshes():
    a = PageAllocator(9, BS, 1)
    prompts = [[i] * 10 for i in range(3)]  # each snapshot: 2 attention + 1 state page
    for s in prompts:
        bt, st = take_seq(a, s)
        a.snapshot(s, bt, st)
        a.decref(bt + st)
    assert (a.num_free, a.num_cached) == (0, 9)
    assert a.lookup(prompts[0] + [5], 10).num_tokens == 10  # 0 is now the most recent
    got = a.allocate(2)  # evicts 1 (the oldest unused), frees 3
    assert a.num_free == 1 and a.stats()["snapshots"] == 2
    assert a.lookup(prompts[1] + [5], 10) is None
    assert a.lookup(prompts[2] + [5], 10) is not None and a.lookup(prompts[0] + [5], 10) is not None
    bt, st = take_seq(a, prompts[2])  # needs 3 pages, 1 free: evicts 2 (looked up before 0)
    assert a.lookup(prompts[2] + [5], 10) is None and a.lookup(prompts[0] + [5], 10) is not None
    a.decref(got + bt + st)
    a.check_idle()


def test_shared_pages_survive_eviction_until_holder_releases():
    a = PageAllocator(6, BS, 1)
    ids = list(range(12))
    bt, st = take_seq(a, ids)  # pages 0, 1 | 2
    a.snapshot(ids, bt, st)
    hit = a.lookup(ids + [0], 12)
    a.acquire(hit)  # a second sequence shares them
    assert [a.refcount(p) for p in bt + st] == [3, 3, 3] and a.num_cached == 0
    a.decref(bt + st)  # the first sequence finishes
    assert not a.can_allocate(4) and a.allocate(4) is None
    a.evict_all()
    assert [a.refcount(p) for p in bt + st] == [1, 1, 1] and a.num_free == 3
    with pytest.raises(RuntimeError, match=r"page 0 \(refcount 1"):
        a.check_idle()
    a.decref(hit.block_table + hit.state_pages)
    a.check_idle()
    assert a.num_free == 6


def test_copy_on_write():
    a = PageAllocator(4, BS, 0)
    [p] = a.allocate(1)
    assert a.copy_on_write(p) == p  # sole holder writes in place
    a.snapshot([1, 2, 3], [p], [])
    new = a.copy_on_write(p)
    assert new != p and a.refcount(new) == 1 and a.refcount(p) == 1 and a.lookup([1, 2, 3, 4], 3).block_table == [p]
    a.decref([new])
    hit = a.lookup([1, 2, 3, 4], 3)
    a.acquire(hit)
    a.allocate(2)  # 3 of 4 pages held, one free
    assert a.copy_on_write(p) not in (None, p)
    a.evict_all()
    a.allocate(1)  # all 4 pages held, none cached
    a.incref([2])
    assert a.copy_on_write(2) is None and a.refcount(2) == 2  # no page left: nothing changes


def test_copy_on_write_when_allocation_evicts_the_sharer():
    a = PageAllocator(2, BS, 0)
    p, q = a.allocate(2)
    a.snapshot([1], [p], [])  # p: holder + snapshot (the older one)
    a.snapshot([2], [q], [])
    a.decref([q])  # q: cached only
    assert a.copy_on_write(p) == p  # evicting both snapshots made p exclusive: write in place
    assert (a.refcount(p), a.num_free, a.stats()["snapshots"]) == (1, 1, 0)


def test_snapshot_refuses_free_or_missing_pages_and_decref_cannot_steal_snapshot_refs():
    a = PageAllocator(8, BS, 1)
    bt, st = take_seq(a, [1] * 9)
    with pytest.raises(ValueError, match="is free"):
        a.snapshot([1] * 9, bt, [7])
    with pytest.raises(ValueError, match="state pages"):
        a.snapshot([1] * 9, bt, [])
    assert a.stats()["snapshots"] == 0 and a.num_used == 3
    a.snapshot([1] * 9, bt, st)
    a.decref(bt)
    with pytest.raises(ValueError, match="snapshots"):
        a.decref(bt)


def test_stats_hit_rate_check_idle_and_disabled():
    a = PageAllocator(16, 4, 1)
    assert a.stats()["hit_rate"] == 0
    bt, st = take_seq(a, [1] * 6)
    a.snapshot([1] * 6, bt, st)
    a.lookup([1] * 10, 9)  # hit 6 of 10
    a.lookup([2] * 10, 9)  # miss
    s = a.stats()
    assert (s["prefix_queries"], s["prefix_query_tokens"], s["prefix_hit_tokens"]) == (2, 20, 6)
    assert s["hit_rate"] == pytest.approx(0.3) and s["snapshots"] == 1 and s["pages_total"] == 16
    assert (s["pages_used"], s["pages_free"], s["pages_cached"]) == (3, 13, 0)
    with pytest.raises(RuntimeError, match="page 0"):
        a.check_idle()
    a.decref(bt + st)
    a.check_idle()  # only the snapshot holds pages
    assert a.stats()["pages_cached"] == 3
    d = PageAllocator(16, 4, 1, enable_prefix_caching=False)
    bt, st = take_seq(d, [1] * 6)
    assert not d.snapshot([1] * 6, bt, st) and d.lookup([1] * 10, 9) is None
    assert d.refcount(bt[0]) == 1 and d.stats()["snapshots"] == 0


class Model:
    """Reference model: plain refcounts and a list-based LRU of snapshots."""

    def __init__(self, n, bs):
        self.ref, self.bs, self.snaps = [0] * n, bs, OrderedDict()  # ids tuple -> pages

    def free(self):
        return self.ref.count(0)

    def cached(self):
        held = [0] * len(self.ref)
        for pages in self.snaps.values():
            for p in pages:
                held[p] += 1
        return sum(1 for p, r in enumerate(self.ref) if r and r == held[p])

    def allocate(self, n):
        if n > self.free() + self.cached():
            return None
        while self.free() < n:
            for p in self.snaps.popitem(last=False)[1]:
                self.ref[p] -= 1
        return n

    def lookup(self, ids, limit):
        best = max((k for k in self.snaps if 1 <= len(k) <= limit and tuple(ids[: len(k)]) == k), key=len, default=None)
        if best is not None:
            self.snaps.move_to_end(best)
        return best


@pytest.mark.parametrize("seed,collide", [(0, False), (1, False), (2, True)])
def test_random_stress_against_model(monkeypatch, seed, collide):
    if collide:
        monkeypatch.setattr(allocator_mod, "page_hash", lambda prev, tokens: 7)
    rng = random.Random(seed)
    n, bs, ns = 40, 4, 2
    a, m = PageAllocator(n, bs, ns), Model(n, bs)
    holders = []  # (ids, block_table, state_pages)
    for _ in range(400):
        op = rng.choice(["seq", "seq", "hit", "snap", "snap", "dup", "drop", "drop", "cow", "raw", "evict"])
        ids = [rng.randrange(3) for _ in range(rng.randrange(1, 15))]
        if op == "seq":
            got, want = a.allocate(-(-len(ids) // bs) + ns), m.allocate(-(-len(ids) // bs) + ns)
            assert (got is None) == (want is None)
            if got:
                assert all(m.ref[p] == 0 for p in got)
                for p in got:
                    m.ref[p] = 1
                holders.append((ids, got[:-ns], got[-ns:]))
        elif op == "hit":
            hit, key = a.lookup(ids, len(ids) - 1), m.lookup(ids, len(ids) - 1)
            assert (hit and tuple(ids[: hit.num_tokens])) == key
            if hit:
                assert hit.block_table + hit.state_pages == m.snaps[key]
                a.acquire(hit)
                for p in m.snaps[key]:
                    m.ref[p] += 1
                holders.append((ids[: hit.num_tokens], hit.block_table, hit.state_pages))
        elif op == "snap" and holders:
            hids, bt, st = rng.choice(holders)
            key = tuple(hids[: rng.randrange(0, len(hids) + 1)])
            added = a.snapshot(key, bt, st)
            assert added == (len(key) > 0 and key not in m.snaps)
            if key in m.snaps:
                m.snaps.move_to_end(key)
            elif added:
                m.snaps[key] = bt[: -(-len(key) // bs)] + st
                for p in m.snaps[key]:
                    m.ref[p] += 1
        elif op == "dup" and holders:
            h = rng.choice(holders)
            a.incref(h[1] + h[2])
            for p in h[1] + h[2]:
                m.ref[p] += 1
            holders.append(h)
        elif op == "drop" and holders:
            h = holders.pop(rng.randrange(len(holders)))
            a.decref(h[1] + h[2])
            for p in h[1] + h[2]:
                m.ref[p] -= 1
        elif op == "cow" and holders:
            i = rng.randrange(len(holders))
            hids, bt, st = holders[i]
            pages = bt + st
            j = rng.randrange(len(pages))
            old, sole = pages[j], m.ref[pages[j]] == 1
            new = a.copy_on_write(old)
            if sole:
                assert new == old
            elif m.allocate(1) is None:
                assert new is None
            elif m.ref[old] == 1:  # eviction made it exclusive
                assert new == old
            else:
                assert new not in (None, old) and m.ref[new] == 0
                m.ref[old] -= 1
                m.ref[new] = 1
                pages[j] = new
                holders[i] = (hids, pages[: len(bt)], pages[len(bt):])
        elif op == "raw":
            free = [p for p in range(n) if m.ref[p] == 0]
            if free:
                with pytest.raises(ValueError, match=f"page {free[0]} is already free"):
                    a.decref([free[0]])
        elif op == "evict" and rng.random() < 0.2:
            a.evict_all()
            for pages in m.snaps.values():
                for p in pages:
                    m.ref[p] -= 1
            m.snaps.clear()
        assert [a.refcount(p) for p in range(n)] == m.ref
        assert (a.num_free, a.num_cached, a.stats()["snapshots"]) == (m.free(), m.cached(), len(m.snaps))
    for h in holders:
        a.decref(h[1] + h[2])
    a.check_idle()
    a.evict_all()
    assert a.num_free == n and not a._index and a.stats()["snapshots"] == 0
