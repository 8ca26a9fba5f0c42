"""The host side of the paged KV pool: which page holds what (vLLM's block manager, ``vllm/v1/core/kv_cache_manager.py``
and ``block_pool.py``, in its simplest form).

Vocabulary: the pool's memory is cut into **pages** of ``page_size`` positions (16, vLLM's block size). Page 0 is the
**trash page**: padded rows of a round write their keys and values there and nothing real reads it. A sequence holds a
**page list** (its block table): position p of the sequence lives in slot ``pages[p // page_size] * page_size + p %
page_size`` of every layer's pool. Pages are **reference counted**: prefix caching shares a full page between the
sequences whose leading tokens are the same. A full page is **registered** under its block key, (the key of the page
before it, its ``page_size`` token ids): a chain over the token ids from the sequence's start, as vLLM's prefix hash,
compared exactly (a dict key, not a hash alone). A page whose last reference goes stays registered and **cached**
(least recently used first out) until the pool needs it, so a later request with the same prefix reuses it; a page
that is written again is first unregistered (or, when shared, copied: **copy-on-write**). A sequence's pages are kept
in order where they can be (its next page follows its last when free; a new run starts in the middle of the roomiest
free run), so one row's keys are a view of the pool. Host-side only, no torch: the device side is :mod:`.kv_pool`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .blocks import PrefixCacheStats

TRASH_PAGE = 0
ROOT_KEY = (-1, -1)  # the parent of a sequence's first block


class OutOfPages(RuntimeError):
    """The pool has no free or cached page left (:meth:`BlockManager.allocate`)."""


@dataclass
class PagedSequence:
    """One sequence's pages.

    Attributes:
        ids: the token ids whose keys and values the pages hold (positions 0..len-1).
        pages: its page list (block table), ``ceil(len(ids) / page_size)`` pages once a round is prepared.
        registered: how many leading pages were offered to the prefix index (full pages only).
        tree: after a round that scored a draft tree: (the slot of its first node, the nodes' tokens, their parents),
            held in the slots after ``ids`` until the next round keeps the accepted path (:mod:`.tree_slots`); else
            None.
    """

    ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    registered: int = 0
    tree: tuple[int, list[int], list[int]] | None = None


class BlockManager:
    """Pages of one pool: a free list, reference counts, the prefix index of full pages and the cached (unreferenced
    but registered) pages.

    Args:
        num_pages: pages in the pool, the trash page included (>= 2).
        page_size: positions per page (>= 1).

    Raises:
        ValueError: ``num_pages`` < 2 or ``page_size`` < 1.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (one is the trash page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.ref = [0] * num_pages
        self.generation = [0] * num_pages  # bumped at every reallocation: a key naming an old page never matches
        self._is_free = np.ones(num_pages, dtype=bool)
        self._is_free[TRASH_PAGE] = False
        self._n_free = num_pages - 1
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref 0, registered: evictable, least recently used first
        self._index: dict[tuple, int] = {}  # block key -> page
        self._key: dict[int, tuple] = {}  # page -> its block key (registered pages)

    # -- accounting ----------------------------------------------------------------------------------------------

    def free_pages(self) -> int:
        """Pages that :meth:`allocate` can hand out now without evicting a sequence (free and cached)."""
        return self._n_free + len(self._cached)

    def used_pages(self) -> int:
        """Pages referenced by a sequence or cached for prefix reuse (what a token budget bounds)."""
        return self.num_pages - 1 - self._n_free

    def cached_pages(self) -> int:
        """Registered pages no sequence references (kept for prefix reuse)."""
        return len(self._cached)

    # -- pages ---------------------------------------------------------------------------------------------------

    def add_pages(self, n: int) -> None:
        """Pages ``num_pages .. num_pages + n - 1`` join the pool, free (the device pool grew to match)."""
        self.ref += [0] * n
        self.generation += [0] * n
        self._is_free = np.concatenate([self._is_free, np.ones(n, dtype=bool)])
        self._n_free += n
        self.num_pages += n

    def allocate(self, after: int | None = None) -> int:
        """A page for one sequence to write (reference count 1): page ``after + 1`` when it is free (a sequence's
        pages then follow each other, and one row's keys are read as a view of the pool, :class:`~.kv_pool.
        PagedCache`), else the free page with the most room around it (:meth:`_roomiest`), else the least recently
        used cached one (unregistered first).

        Raises:
            OutOfPages: none is free or cached.
        """
        page = -1
        if after is not None and after + 1 < self.num_pages and self._is_free[after + 1]:
            page = after + 1
        elif self._n_free:
            page = self._roomiest()
        if page >= 0:
            self._is_free[page] = False
            self._n_free -= 1
        elif self._cached:
            page, _ = self._cached.popitem(last=False)
            self._unregister(page)
        else:
            raise OutOfPages("no free KV page")
        self.ref[page] = 1
        self.generation[page] += 1
        return page

    def _roomiest(self) -> int:
        """The free page that starts a new run of a sequence's pages with the most room on both sides: the middle of
        the longest run of free pages (the sequence before the run keeps growing into its first half, the new one into
        its second). A scan of the pool, made only when a sequence cannot follow on from its last page; at least one
        page must be free."""
        edges = np.diff(np.concatenate([[False], self._is_free[1:], [False]]).astype(np.int8))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)  # run i: pages starts[i]+1 .. ends[i]
        i = int(np.argmax(ends - starts))
        return int(starts[i] + 1 + (ends[i] - starts[i]) // 2)

    def incref(self, page: int) -> None:
        """One more sequence holds ``page`` (a cached page is taken out of the evictable set)."""
        if self.ref[page] == 0:
            self._cached.pop(page, None)
        self.ref[page] += 1

    def decref(self, page: int) -> None:
        """One sequence fewer holds ``page``; unreferenced, it is cached when registered, else free."""
        self.ref[page] -= 1
        if self.ref[page] > 0:
            return
        if page in self._key:
            self._cached[page] = None
        else:
            self._is_free[page] = True
            self._n_free += 1

    def release(self, seq: PagedSequence) -> None:
        """Drop every page of ``seq``."""
        for page in reversed(seq.pages):
            self.decref(page)
        seq.pages.clear()
        seq.ids.clear()
        seq.registered = 0

    def truncate(self, seq: PagedSequence, keep: int) -> None:
        """Keep the first ``keep`` positions of ``seq`` (a rollback is a length change): pages wholly beyond go back
        (decref), and the page holding position ``keep`` becomes writable: copied on write when shared (the copy is
        the caller's, :meth:`writable` returns the pair to copy), unregistered when this sequence alone holds it."""
        n = -(-keep // self.page_size)
        for page in reversed(seq.pages[n:]):
            self.decref(page)
        del seq.pages[n:]
        del seq.ids[keep:]
        seq.registered = min(seq.registered, keep // self.page_size)

    def writable(self, seq: PagedSequence) -> tuple[int, int] | None:
        """Make the page that position ``len(seq.ids)`` falls in (when it holds earlier positions too) writable by
        ``seq`` alone. Returns (source page, new page) when it had to be copied (shared): the caller copies the keys
        and values of its first ``len(seq.ids) % page_size`` positions; None when nothing is to copy.

        Raises:
            OutOfPages: a copy was needed and no page is left.
        """
        at = len(seq.ids) % self.page_size
        if at == 0 or not seq.pages:
            return None
        j = len(seq.ids) // self.page_size
        page = seq.pages[j]
        if self.ref[page] > 1:
            new = self.allocate(after=seq.pages[j - 1] if j else None)
            self.decref(page)
            seq.pages[j] = new
            return page, new
        self._unregister(page)  # alone: written in place, so its old block key no longer describes it,
        self.generation[page] += 1  # nor does it parent the blocks registered after it any more
        return None

    def grow(self, seq: PagedSequence, length: int) -> None:
        """Give ``seq`` pages for positions up to ``length`` - 1 (fresh pages; callers free space first).

        Raises:
            OutOfPages: no page left (the pages taken so far stay with ``seq``).
        """
        while len(seq.pages) * self.page_size < length:
            seq.pages.append(self.allocate(after=seq.pages[-1] if seq.pages else None))

    # -- prefix index ----------------------------------------------------------------------------------------------

    def block_key(self, seq: PagedSequence, j: int) -> tuple | None:
        """The registered key of ``seq``'s page j (j = -1: the root), or None when that page is not registered."""
        if j < 0:
            return ROOT_KEY
        page = seq.pages[j]
        key = self._key.get(page)
        return None if key is None else (page, self.generation[page])

    def lookup(self, parent: tuple, ids: tuple[int, ...]) -> int | None:
        """The registered page holding block ``ids`` after the block keyed ``parent`` (a :meth:`block_key`), or
        None."""
        return self._index.get((parent, ids))

    def cached_run(self, parent: tuple | None, ids: Sequence[int], first: int, limit: int) -> list[int]:
        """The registered pages holding blocks ``first``, ``first + 1``, ... of ``ids`` (full blocks within
        ``ids[:limit]``) that follow the block keyed ``parent`` (a :meth:`block_key`; None: none), as far as the chain
        goes. Read only: what a sequence may share (prefix caching), and how much of it."""
        ps = self.page_size
        pages: list[int] = []
        j = first
        while parent is not None and (j + 1) * ps <= limit:
            page = self.lookup(parent, tuple(ids[j * ps : (j + 1) * ps]))
            if page is None:
                break
            pages.append(page)
            parent = (page, self.generation[page])
            j += 1
        return pages

    def reuse_prefix(self, seq: PagedSequence, ids: Sequence[int], keep: int, limit: int,
                     stats: PrefixCacheStats) -> int:
        """Share the registered pages of the full blocks of ``ids[:limit]`` that follow ``seq``'s first ``keep``
        positions (prefix caching), counting the lookup in ``stats``; returns the positions ``seq`` now holds."""
        ps = self.page_size
        stats.queries += 1
        first = keep // ps
        found = self.cached_run(self.block_key(seq, first - 1), ids, first, limit)
        for j, page in enumerate(found, start=first):
            if j < len(seq.pages):  # the partial page it held (same tokens so far): replaced by the full one
                if seq.pages[j] != page:
                    self.incref(page)
                    self.decref(seq.pages[j])
                    seq.pages[j] = page
            else:
                self.incref(page)
                seq.pages.append(page)
        if not found:
            return keep
        held = (first + len(found)) * ps
        stats.hits += 1
        stats.reused_tokens += held - keep
        seq.ids = list(ids[:held])
        return held

    def register(self, seq: PagedSequence) -> None:
        """Offer ``seq``'s full pages not yet offered to the prefix index (after a forward wrote them). A block
        already registered under another page keeps that page; the chain then stops for this sequence's later
        pages (they would not be reachable)."""
        ps = self.page_size
        full = len(seq.ids) // ps
        while seq.registered < full:
            j = seq.registered
            parent = self.block_key(seq, j - 1)
            page = seq.pages[j]
            if page in self._key:  # adopted from the index (a prefix hit): registered already
                seq.registered = j + 1
                continue
            if parent is None:
                break
            key = (parent, tuple(seq.ids[j * ps : (j + 1) * ps]))
            if key in self._index:
                break
            self._index[key] = page
            self._key[page] = key
            seq.registered = j + 1

    def _unregister(self, page: int) -> None:
        key = self._key.pop(page, None)
        if key is not None and self._index.get(key) == page:
            del self._index[key]


__all__ = ["TRASH_PAGE", "BlockManager", "OutOfPages", "PagedSequence"]
