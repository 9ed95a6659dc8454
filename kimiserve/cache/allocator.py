"""Page allocator with prefix caching for the packed block cache (DESIGN.md section 2).

Pure bookkeeping of page ids: no tensors; the caller moves the bytes. One pool of `num_pages`
equal pages, each reference counted. A page may be held by several sequences and by
prefix-cache snapshots; a page whose refcount drops to 0 returns to the free list.

Allocation order is FIFO: the free list starts as 0, 1, ..., num_pages - 1 and freed pages are
appended at its end, so a fresh allocator hands out the lowest ids first and a freed page is
reused as late as possible. Everything is deterministic.

Writes are copy-on-write, done by the caller: a holder that wants to write into a page with
refcount > 1 calls `copy_on_write(page)` (or does `allocate(1)` + copy + `decref` itself).

Prefix caching. KDA state is not per token, so a prefix is reusable only at a position p where
a snapshot was kept. A snapshot at p holds references to the ceil(p / block_size) attention
pages covering [0, p) (the last one possibly partial: only its first p % block_size slots are
valid, which is safe to share because sequences only append and writers copy-on-write) and to
the KDA state pages as of p. Full pages form a trie: node j is found in an index keyed by the
chain hash h_j = page_hash(h_{j-1}, ids of page j-1), h_0 = HASH_SEED, and is accepted only if
its stored ids and parent match, so a hash collision can never give a wrong hit. A snapshot
lives in the node of its floor(p / block_size) full pages, keyed by its partial-page ids.
Snapshots are evicted LRU (recency refreshed by lookup hits and by re-registering); evicting
one decrefs its pages. Every operation costs O(pages touched).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

HASH_SEED = 0x4B494D49
"""h_0 of the page hash chain."""


def page_hash(prev: int, tokens: tuple[int, ...]) -> int:
    """Chain hash of one full page: h_j = page_hash(h_{j-1}, ids of page j-1). Python does not
    randomise hashes of ints and tuples, so this is stable across processes. Hits never rely on
    it alone (ids are compared); tests monkeypatch it to force collisions."""
    return hash((prev, tokens))


@dataclass
class PrefixHit:
    """A reusable prefix found by `PageAllocator.lookup`; the pages are not yet referenced."""

    num_tokens: int
    """p: tokens [0, p) are cached; the caller recomputes from p on."""
    block_table: list[int]
    """ceil(p / block_size) attention pages; the last one may be partial (copy-on-write it)."""
    state_pages: list[int]
    """num_state_pages_per_seq KDA state pages as of position p (copy-on-write them)."""


@dataclass(eq=False)
class _Node:
    """One full page of cached prefixes: a node of the prefix trie."""

    hash: int
    tokens: tuple[int, ...]
    parent: _Node | None
    depth: int  # number of full pages from the root to this node
    children: int = 0
    snaps: dict[tuple[int, ...], _Snapshot] = field(default_factory=dict)  # partial-page ids -> snapshot


@dataclass(eq=False)
class _Snapshot:
    num_tokens: int
    node: _Node
    partial: tuple[int, ...]
    pages: list[int]
    state_pages: list[int]


class PageAllocator:
    """Reference-counted pages plus an LRU prefix cache of KDA-state snapshots."""

    def __init__(self, num_pages: int, block_size: int, num_state_pages_per_seq: int,
                 enable_prefix_caching: bool = True):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_state_pages_per_seq < 0:
            raise ValueError(f"num_state_pages_per_seq must be >= 0, got {num_state_pages_per_seq}")
        self.num_pages = num_pages
        self.block_size = block_size
        self.num_state_pages_per_seq = num_state_pages_per_seq
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_pages  # all holders
        self._snap_ref = [0] * num_pages  # the snapshots among them
        self._free: deque[int] = deque(range(num_pages))
        self._num_cached = 0  # pages with refcount > 0 held only by snapshots
        self._roots: dict[int, _Node] = {0: _Node(HASH_SEED, (), None, 0)}  # salt -> trie root
        self._index: dict[int, list[_Node]] = {}  # chain hash -> nodes (a list: collisions)
        self._lru: OrderedDict[_Snapshot, None] = OrderedDict()  # oldest first
        self._queries = self._query_tokens = self._hit_tokens = 0

    # ---- pages -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages with refcount 0: allocatable now without eviction."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages whose only holders are snapshots: what evicting every snapshot would free."""
        return self._num_cached

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        self._check_range(page)
        return self._ref[page]

    def shared(self, pages: list[int]) -> list[int]:
        """Indices into `pages` (pages this allocator handed out) of those with more than one reference."""
        ref = self._ref
        for p in pages:  # a plain scan first: pages are rarely shared (this runs per request per step)
            if ref[p] > 1:
                return [i for i, q in enumerate(pages) if ref[q] > 1]
        return []

    def can_allocate(self, n: int) -> bool:
        """Whether `allocate(n)` would succeed (possibly by evicting snapshots)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        return n <= len(self._free) + self._num_cached

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages with refcount 1, evicting LRU snapshots while the free list is short.
        None, with nothing allocated and nothing evicted, if even evicting all cannot give n."""
        if not self.can_allocate(n):
            return None
        while len(self._free) < n:
            self._evict_lru()
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._ref[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """One more reference to each page (repeats count); every page must be held already."""
        counts = self._counts(pages)
        for p in counts:
            if self._ref[p] == 0:
                raise ValueError(f"page {p} is free; incref needs a held page")
        for p, c in counts.items():
            self._adjust(p, c, 0)

    def decref(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page (repeats count); pages reaching 0 are freed. Checked
        first, so a ValueError changes nothing."""
        counts = self._counts(pages)
        for p, c in counts.items():
            if self._ref[p] < c:
                extra = f" after {self._ref[p]} of {c} decrefs" if self._ref[p] else ""
                raise ValueError(f"page {p} is already free{extra}")
            if self._ref[p] - c < self._snap_ref[p]:
                raise ValueError(f"page {p}: decref x{c} of refcount {self._ref[p]} would drop "
                                 f"{self._snap_ref[p]} reference(s) held by prefix-cache snapshots")
        for p, c in counts.items():
            self._adjust(p, -c, 0)

    def copy_on_write(self, page: int) -> int | None:
        """Make `page` writable for a holder of one reference to it. Returns `page` itself if
        that holder is its only holder. Otherwise returns a fresh page (refcount 1) and drops the
        holder's reference to `page`; the caller must copy page -> new page before its next
        allocate (until then `page` cannot be reused). None, nothing changed, if no page is left."""
        self._check_range(page)
        if self._ref[page] == 0:
            raise ValueError(f"page {page} is free; copy_on_write needs a held page")
        if self._ref[page] == 1:
            return page
        new = self.allocate(1)
        if new is None:
            return None
        if self._ref[page] == 1:  # the allocation evicted the snapshots that shared it
            self.decref(new)
            return page
        self.decref([page])
        return new[0]

    # ---- prefix cache ------------------------------------------------------------------------

    def _root(self, salt: int) -> _Node:
        """The trie of prefixes computed under `salt` (0: the base model; else a LoRA adapter's id)."""
        if salt not in self._roots:
            self._roots[salt] = _Node(page_hash(HASH_SEED, ("salt", salt)), (), None, 0)
        return self._roots[salt]

    def lookup(self, token_ids: Sequence[int], max_tokens: int, salt: int = 0) -> PrefixHit | None:
        """The longest snapshot at p, 1 <= p <= max_tokens, whose ids equal token_ids[:p] (each
        page verified), among those registered with the same `salt`. Takes no references (call
        `acquire` before the next allocate, which may evict it); marks the snapshot recently used.
        Query tokens count len(token_ids)."""
        self._queries += 1
        self._query_tokens += len(token_ids)
        limit = min(max_tokens, len(token_ids))
        if not self.enable_prefix_caching or limit < 1 or not self._lru:
            return None
        bs = self.block_size
        path = [self._root(salt)]
        while len(path) * bs <= limit:  # a deeper node only holds snapshots at p >= its depth * bs
            k = len(path) - 1
            child = self._child(path[-1], tuple(map(int, token_ids[k * bs:(k + 1) * bs])), create=False)
            if child is None:
                break
            path.append(child)
        for node in reversed(path):
            if not node.snaps:
                continue
            base = node.depth * bs
            tail = tuple(map(int, token_ids[base:min(limit, base + bs - 1)]))
            best = None
            for partial, snap in node.snaps.items():
                n = len(partial)
                if n <= len(tail) and (best is None or n > len(best.partial)) and tail[:n] == partial:
                    best = snap
            if best is not None:
                self._lru.move_to_end(best)
                self._hit_tokens += best.num_tokens
                return PrefixHit(best.num_tokens, list(best.pages), list(best.state_pages))
        return None

    def acquire(self, hit: PrefixHit) -> None:
        """Take one reference to every page of `hit` for a new holder (the sequence)."""
        self.incref([*hit.block_table, *hit.state_pages])

    def snapshot(self, token_ids: Sequence[int], block_table: Sequence[int], state_pages: Sequence[int],
                 salt: int = 0) -> bool:
        """Register a snapshot at p = len(token_ids), the whole prefix [0, p), referencing
        block_table[:ceil(p / block_size)] and state_pages (increfed). Returns True if it was
        added; False if disabled, p == 0, or an equal snapshot exists (its LRU spot is refreshed,
        the given pages are not taken)."""
        p = len(token_ids)
        if not self.enable_prefix_caching or p == 0:
            return False
        bs = self.block_size
        num_blocks = -(-p // bs)
        if len(block_table) < num_blocks:
            raise ValueError(f"snapshot of {p} tokens needs {num_blocks} pages, block table has {len(block_table)}")
        if len(state_pages) != self.num_state_pages_per_seq:
            raise ValueError(f"snapshot needs {self.num_state_pages_per_seq} state pages, got {len(state_pages)}")
        pages, state = [int(x) for x in block_table[:num_blocks]], [int(x) for x in state_pages]
        for q in self._counts(pages + state):
            if self._ref[q] == 0:
                raise ValueError(f"page {q} is free; a snapshot can only reference held pages")
        ids = [int(t) for t in token_ids]
        node = self._root(salt)
        for k in range(p // bs):
            node = self._child(node, tuple(ids[k * bs:(k + 1) * bs]), create=True)
        partial = tuple(ids[(p // bs) * bs:])
        if partial in node.snaps:
            self._lru.move_to_end(node.snaps[partial])
            return False
        snap = _Snapshot(p, node, partial, pages, state)
        node.snaps[partial] = snap
        self._lru[snap] = None
        for q in pages + state:
            self._adjust(q, 1, 1)
        return True

    def evict_all(self) -> None:
        """Drop every snapshot."""
        while self._lru:
            self._evict_lru()

    # ---- reporting ---------------------------------------------------------------------------

    def stats(self) -> dict:
        return {
            "pages_total": self.num_pages, "pages_free": self.num_free, "pages_used": self.num_used,
            "pages_cached": self.num_cached, "snapshots": len(self._lru),
            "prefix_queries": self._queries, "prefix_query_tokens": self._query_tokens,
            "prefix_hit_tokens": self._hit_tokens,
            "hit_rate": self._hit_tokens / self._query_tokens if self._query_tokens else 0.0,
        }

    def check_idle(self) -> None:
        """RuntimeError naming the pages held by anything other than the prefix cache."""
        leaked = [(p, r, s) for p, (r, s) in enumerate(zip(self._ref, self._snap_ref)) if r != s]
        if leaked:
            shown = ", ".join(f"page {p} (refcount {r}, snapshot refs {s})" for p, r, s in leaked[:16])
            more = f" and {len(leaked) - 16} more" if len(leaked) > 16 else ""
            raise RuntimeError(f"{len(leaked)} page(s) still held outside the prefix cache: {shown}{more}")
        if len(self._free) != self._ref.count(0):
            raise RuntimeError(f"free list has {len(self._free)} pages, {self._ref.count(0)} have refcount 0")

    # ---- internals ---------------------------------------------------------------------------

    def _check_range(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} out of range [0, {self.num_pages})")

    def _counts(self, pages: Iterable[int]) -> Counter:
        counts = Counter(pages)
        for p in counts:
            self._check_range(p)
        return counts

    def _adjust(self, page: int, delta: int, snap_delta: int) -> None:
        """Change a page's refcount (and its snapshot share), keeping num_cached and the free list."""
        ref, snap = self._ref[page], self._snap_ref[page]
        was_cached = ref > 0 and ref == snap
        ref += delta
        snap += snap_delta
        self._ref[page], self._snap_ref[page] = ref, snap
        self._num_cached += (ref > 0 and ref == snap) - was_cached
        if ref == 0:
            self._free.append(page)

    def _child(self, node: _Node, tokens: tuple[int, ...], create: bool) -> _Node | None:
        """The trie child of `node` for one full page of ids, verified by ids and parent."""
        h = page_hash(node.hash, tokens)
        for c in self._index.get(h, ()):
            if c.parent is node and c.tokens == tokens:
                return c
        if not create:
            return None
        c = _Node(h, tokens, node, node.depth + 1)
        self._index.setdefault(h, []).append(c)
        node.children += 1
        return c

    def _evict_lru(self) -> None:
        snap, _ = self._lru.popitem(last=False)
        node = snap.node
        del node.snaps[snap.partial]
        while node.parent is not None and not node.snaps and node.children == 0:  # prune empty branch
            bucket = self._index[node.hash]
            bucket.remove(node)
            if not bucket:
                del self._index[node.hash]
            node.parent.children -= 1
            node = node.parent
        for q in snap.pages + snap.state_pages:
            self._adjust(q, -1, -1)
