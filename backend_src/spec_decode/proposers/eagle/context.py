"""The EAGLE head's contexts on a paged KV pool: each sequence's pairs' keys and values in pages of the engine's pool
(:mod:`spec_decode.engine.pages`, :mod:`spec_decode.engine.kv_pool`; one layer), cut back on a rollback by a length
change, and one batched attention over every row's pages per forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...engine.kv_pool import KVPool, read_slots
from ...engine.pages import TRASH_PAGE, BlockManager, OutOfPages, PagedSequence

PAGE_SIZE = 16


@dataclass
class EagleContext:
    """One sequence's pairs in the head.

    Attributes:
        ids: the committed ids the pairs were built from (pair j read x_{j+1}).
        start: the position of the first pair held (a context that lost pairs starts again later).
        length: pairs held: pair ``start + i`` is at index i of ``pages`` (slot ``pages[i // 16] x 16 + i % 16``).
        pages: its pages in the head's pool (:class:`HeadKV`).
    """

    ids: list[int] = field(default_factory=list)
    start: int = 0
    length: int = 0
    pages: PagedSequence = field(default_factory=PagedSequence)


class HeadKV:
    """The keys and values of one attention layer (an EAGLE head's) for every context, in pages of
    :data:`PAGE_SIZE` pairs. The pool starts at ``initial_pages`` and doubles when a context needs a page and none is
    free (every context keeps its pages: a head's context is small beside the target's).

    Args:
        kv_heads, head_dim: the head's attention shape.
        dtype, device: of the keys and values (the head's).
        initial_pages: pages at first, the trash page included (>= 2).
    """

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 initial_pages: int = 64):
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, device
        self.blocks = BlockManager(initial_pages, PAGE_SIZE)
        self.pool = KVPool(1, kv_heads, head_dim, initial_pages, PAGE_SIZE, dtype, device)

    def _double(self) -> None:
        old = self.pool
        self.pool = KVPool(1, self.kv_heads, self.head_dim, 2 * old.num_pages, PAGE_SIZE, self.dtype, self.device)
        self.pool.data[:, :, :, : old.slots()] = old.data
        self.blocks.add_pages(old.num_pages)

    def reserve(self, ctx: EagleContext, length: int) -> None:
        """Give ``ctx`` pages for pairs ``0 .. length - 1`` (growing the pool as needed)."""
        while True:
            try:
                self.blocks.grow(ctx.pages, length)
                return
            except OutOfPages:
                self._double()

    def cut(self, ctx: EagleContext, length: int) -> None:
        """Keep the first ``length`` pairs of ``ctx``: pages wholly beyond go back to the pool."""
        ctx.length = length
        self.blocks.truncate(ctx.pages, length)

    def release(self, ctx: EagleContext) -> None:
        """Return every page of ``ctx``."""
        self.blocks.release(ctx.pages)
        ctx.length = 0

    def slots(self, ctx: EagleContext, first: int, n: int) -> list[int]:
        """The slots of pairs ``first .. first + n - 1`` of ``ctx`` (pages reserved)."""
        pages = ctx.pages.pages
        return [pages[i // PAGE_SIZE] * PAGE_SIZE + i % PAGE_SIZE for i in range(first, first + n)]

    def attend_rows(self, attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    rows: list[tuple[EagleContext, int]], visible: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Write the new pairs' keys and values after each context's ``length`` pairs and run one attention for
        every row: row r's t_r queries (its new pairs, packed in ``rows`` order) over its ``length + t_r`` pairs,
        causally among the new ones, or where ``visible`` allows. ``length`` is left as it was.

        Args:
            attend: the head's ``attend(q [R, heads, T, D], keys [R, kv_heads, L, D], values, mask [R, 1, T, L])``
                -> [R, T, heads x D].
            q: [1, heads, N, D] the packed queries; k, v: [1, kv_heads, N, D] the packed new keys and values.
            rows: per row, (its context, t_r); sum t_r = N.
            visible: per row, [t_r, length + t_r] bool on the host: the pairs each new query attends to (a tree's
                mask: the committed pairs, its ancestors among the drafted ones and itself, :mod:`.tree`); None:
                causal.

        Returns:
            [N, heads x D] the attention outputs, packed as the queries.
        """
        dev = q.device
        n_rows, widest = len(rows), max(t for _, t in rows)
        longest = max(ctx.length + t for ctx, t in rows)
        width = -(-longest // PAGE_SIZE)
        table, write, lengths = [], [], []
        for ctx, t in rows:
            c = ctx.length
            self.reserve(ctx, c + t)
            pages = ctx.pages.pages
            table.append(pages[:width] + [TRASH_PAGE] * (width - len(pages[:width])))
            write += self.slots(ctx, c, t)
            lengths.append((c, t))
        keys, values = self.pool.keys[0], self.pool.values[0]
        write_t = torch.tensor(write, device=dev)
        KVPool.write(keys, write_t, k[0])
        KVPool.write(values, write_t, v[0])
        heads, d = q.shape[1], q.shape[3]
        if n_rows == 1 and table[0] == list(range(table[0][0], table[0][0] + width)):  # one row, pages in order:
            c, t = lengths[0]  # a view of the pool, no gather (the engine's span, kv_pool.PagedCache)
            first = table[0][0] * PAGE_SIZE
            kr, vr = (x[None, :, first : first + c + t] for x in (keys, values))
            mask = (torch.ones(t, c + t, dtype=torch.bool, device=dev).tril(c) if visible is None
                    else visible[0].to(dev))[None, None]
            return attend(q.view(1, heads, t, d), kr, vr, mask).reshape(t, -1)
        sizes = torch.tensor(lengths, device=dev)
        past, ends = sizes[:, 0], sizes.sum(1)
        read = read_slots(torch.tensor(table, device=dev), ends, PAGE_SIZE, longest)  # [R, L]
        kr, vr = KVPool.gather(keys, read), KVPool.gather(values, read)
        ragged = any(t != widest for _, t in rows)
        if ragged:  # pad each row's queries to the widest (padded ones read a zero row, their outputs are dropped)
            qidx: list[int] = []
            keep: list[int] = []
            at = 0
            for r, (_, t) in enumerate(rows):
                qidx += list(range(at, at + t)) + [q.shape[2]] * (widest - t)
                keep += range(r * widest, r * widest + t)
                at += t
            packed = torch.cat([q[0].transpose(0, 1), q.new_zeros((1, heads, d))])  # [N + 1, heads, D]
            qr = packed[torch.tensor(qidx, device=dev)].view(n_rows, widest, heads, d).transpose(1, 2)
        else:
            qr = q[0].view(heads, n_rows, widest, d).transpose(0, 1)
        if visible is None:
            query_pos = past[:, None] + torch.arange(widest, device=dev)[None]  # [R, T]
            cols = torch.arange(longest, device=dev)
            mask = (cols[None, None] <= query_pos[:, :, None]) & (cols[None, None] < ends[:, None, None])
        else:  # built on the host, one copy; a padded query reads pair 0 (its output is dropped)
            host = torch.zeros(n_rows, widest, longest, dtype=torch.bool)
            host[:, :, 0] = True
            for r, vis in enumerate(visible):
                host[r, : vis.shape[0], : vis.shape[1]] = vis
            mask = host.to(dev)
        att = attend(qr, kr, vr, mask[:, None])  # [R, T, heads x D]
        if not ragged:
            return att.reshape(n_rows * widest, -1)
        return att.reshape(n_rows * widest, -1)[torch.tensor(keep, device=dev)]
