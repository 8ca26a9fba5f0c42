"""One round's forward over the paged KV pool at static shapes: the function a CUDA graph captures (:mod:`.cuda_graphs`)
and the CPU runs eagerly, on the same buffers and masks.

A round is B rows (sequences) of Q query positions each, padded: row r's ``n_r`` new tokens sit in columns
``0 .. n_r - 1`` at positions ``c_r .. c_r + n_r - 1`` (``c_r`` positions already cached); padded columns and padded
rows hold token 0 at position 0 and write into the trash page. Keys run over L = P x page_size positions read through
each row's block table (P pages). The mask is built on the device from the positions and lengths: query (r, q) sees
key position j when j <= its position and j < the row's length (and key 0 always, so a padded query's softmax is never
empty). Only O output rows per row go through the LM head, chosen by ``out_index``.

A tree round (:attr:`RoundShape.tree`; a draft tree, :mod:`spec_decode.tree`) adds ``parents`` [B, Q]: each new
token's parent among the row's new tokens (-1 for the first; a chain's is ``q - 1``). New token q still writes slot
``c_r + q``, but sits at position ``c_r + depth(q)`` and sees the cached context and the slots of its own ancestors
only (SpecInfer's tree attention, Miao et al. 2024): the ancestor relation is built on the device from ``parents``
by doubling (``ceil(log2 Q)`` boolean matrix products), so a captured graph needs nothing else.

Glossary of the shapes (vLLM's ``CommonAttentionMetadata`` carries the same): B padded batch, Q padded query length
(1 for plain decoding, k+1 for verification), O output rows per row (<= Q), P block-table width in pages, L = P x
page_size key positions, V vocabulary, H hidden size (x (1 + aux layers) for EAGLE-3's hidden states).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..tree import chain_parents, path_of
from ..tree import depths as tree_depths
from .aux_states import AuxHiddenStates
from .invariant_attention import TreePaths
from .kv_pool import KVPool, PagedCache, cache_keyword, read_slots

QUERY_BUCKETS = (1, 2, 3, 5, 9, 17)  # k + 1 for k = 0, 1, 2, 4, 8, 16
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

# the int64 inputs of a round, in the order they are packed into one host buffer (one copy to the device per round)
FIELDS = ("input_ids", "positions", "write_slots", "block_table", "seq_lens", "out_index")


@dataclass(frozen=True)
class RoundShape:
    """A round's padded shape: B rows, Q query columns, O output rows, P pages of block table."""

    batch: int
    query: int
    outputs: int
    pages: int
    tree: bool = False  # rows carry draft trees: a ``parents`` input too

    def sizes(self) -> dict[str, tuple[int, ...]]:
        """Each input's shape (:data:`FIELDS`, then ``parents`` for a tree round)."""
        b, q = self.batch, self.query
        sizes = {"input_ids": (b, q), "positions": (b, q), "write_slots": (b * q,), "block_table": (b, self.pages),
                 "seq_lens": (b,), "out_index": (b, self.outputs)}
        if self.tree:
            sizes["parents"] = (b, q)
        return sizes

    def numel(self) -> int:
        """Int64 elements of all inputs together."""
        return sum(int(np.prod(s)) for s in self.sizes().values())


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest of ``sizes`` >= n, or n itself beyond the largest."""
    for s in sizes:
        if s >= n:
            return s
    return n


@dataclass
class RoundRow:
    """One sequence's part of a round (host side).

    Attributes:
        pages: its page list, covering positions ``0 .. cached + len(new_ids) - 1``.
        cached: positions already in the pool (c).
        new_ids: the tokens to compute (n >= 1), at positions c .. c + n - 1.
        n_logits: output rows wanted: those of its last ``n_logits`` new tokens (1 <= n_logits <= n).
        parents: each new token's parent among the new tokens (-1 for the first; topological), or None: a chain. A
            token sits at position ``cached + depth`` (depth 0 for the first) and sees its ancestors' slots.
    """

    pages: list[int]
    cached: int
    new_ids: list[int]
    n_logits: int
    parents: list[int] | None = None

    def depths(self) -> np.ndarray:
        """[n] int64 each new token's depth below the first (a chain: 0 .. n - 1; :func:`spec_decode.tree.depths`,
        whose root-level depth is 1)."""
        if self.parents is None:
            return np.arange(len(self.new_ids), dtype=np.int64)
        return np.asarray(tree_depths(self.parents), dtype=np.int64) - 1


def split_by_padding(rows: dict[int, RoundRow], max_padded_positions: int) -> list[list[int]]:
    """Split a batch where reading every row over the longest context would cost more than an extra forward.

    Rows (key -> row) are taken by context length (cached + new); a row joins the current group unless that would
    leave more than ``max_padded_positions`` padded (row x position) slots in it. Returns the groups of keys, shortest
    contexts first.
    """
    groups: list[list[int]] = []
    total = 0
    for i in sorted(rows, key=lambda j: rows[j].cached + len(rows[j].new_ids)):
        c = rows[i].cached + len(rows[i].new_ids)
        if groups and (len(groups[-1]) + 1) * c - (total + c) <= max_padded_positions:
            groups[-1].append(i)
            total += c
        else:
            groups.append([i])
            total = c
    return groups


def span_of(rows: list[RoundRow], shape: RoundShape, page_size: int) -> tuple[int, int, int] | None:
    """(first slot, length, new tokens) when an eager round is one row whose pages follow each other (its keys are then
    written and read as slices of the pool, :class:`~.kv_pool.PagedCache`), else None."""
    if shape.batch != 1 or len(rows) != 1 or shape.tree:
        return None
    pages = rows[0].pages
    if pages[-1] - pages[0] != len(pages) - 1 or any(b - a != 1 for a, b in zip(pages, pages[1:])):
        return None
    return pages[0] * page_size, rows[0].cached + len(rows[0].new_ids), len(rows[0].new_ids)


def pack_round(rows: list[RoundRow], shape: RoundShape, page_size: int) -> np.ndarray:
    """The round's inputs (:data:`FIELDS`, in :meth:`RoundShape.sizes`' shapes) packed into one int64 array.

    Raises:
        ValueError: a row does not fit the shape (more rows, new tokens, outputs or pages than it has).
    """
    if len(rows) > shape.batch:
        raise ValueError(f"{len(rows)} rows do not fit a round of {shape.batch}")
    sizes = shape.sizes()
    out = np.zeros(shape.numel(), dtype=np.int64)
    views, at = {}, 0
    for name in sizes:
        n = int(np.prod(sizes[name]))
        views[name] = out[at : at + n].reshape(sizes[name])
        at += n
    q = shape.query
    for r, row in enumerate(rows):
        n, c = len(row.new_ids), row.cached
        if n > q or row.n_logits > shape.outputs or len(row.pages) > shape.pages:
            raise ValueError(f"row {r} ({n} new tokens, {row.n_logits} outputs, {len(row.pages)} pages) does not fit "
                             f"{shape}")
        if row.parents is not None and not shape.tree:
            raise ValueError(f"row {r} carries a tree; the round's shape has no parents ({shape})")
        slot = np.arange(c, c + n)  # new token j writes slot c + j
        pages = np.asarray(row.pages, dtype=np.int64)
        views["input_ids"][r, :n] = row.new_ids
        views["positions"][r, :n] = c + row.depths()
        views["write_slots"][r * q : r * q + n] = pages[slot // page_size] * page_size + slot % page_size
        if shape.tree:
            views["parents"][r, :] = -1
            views["parents"][r, :n] = row.parents if row.parents is not None else chain_parents(n)
        views["block_table"][r, : len(pages)] = pages
        views["seq_lens"][r] = c + n
        views["out_index"][r, : row.n_logits] = np.arange(n - row.n_logits, n)
    return out


def unpack_round(flat: torch.Tensor, shape: RoundShape) -> dict[str, torch.Tensor]:
    """Views of a packed round (:func:`pack_round`) by field name, in their shapes."""
    views, at = {}, 0
    for name, size in shape.sizes().items():
        n = int(np.prod(size))
        views[name] = flat[at : at + n].view(size)
        at += n
    return views


def tree_paths(rows: list[RoundRow], shape: RoundShape, device: torch.device) -> TreePaths:
    """A tree round's root-to-leaf paths for the batch-invariant attention (:class:`~.invariant_attention.TreePaths`):
    per row, one path per leaf of its new tokens (a chain row: one), each the leaf's ancestors from column 0; a query
    is taken from the first path that holds it. Host-side (an eager round's: the batch-invariant forward runs on a
    CPU)."""
    row_of: list[int] = []
    cols: list[list[int]] = []
    context: list[int] = []
    first: dict[tuple[int, int], tuple[int, int]] = {}  # (row, column) -> (path, depth) of its first path
    for r, row in enumerate(rows):
        n = len(row.new_ids)
        parents = row.parents if row.parents is not None else chain_parents(n)
        has_child = set(parents)
        for leaf in (c for c in range(n) if c not in has_child):
            path = path_of(parents, leaf)
            for i, col in enumerate(path):
                first.setdefault((r, col), (len(cols), i))
            row_of.append(r)
            cols.append(path)
            context.append(row.cached)
    m = max(len(c) for c in cols)
    take = np.zeros((shape.batch, shape.query), dtype=np.int64)  # padded rows and columns: entry 0, never read
    for (r, col), (p, i) in first.items():
        take[r, col] = p * m + i
    keys = np.zeros((len(cols), max(c0 + len(p) for c0, p in zip(context, cols))), dtype=np.int64)
    padded = np.zeros((len(cols), m), dtype=np.int64)
    for p, (path, c0) in enumerate(zip(cols, context)):
        padded[p, : len(path)] = path
        padded[p, len(path):] = path[-1]
        keys[p, :c0] = np.arange(c0)
        keys[p, c0 : c0 + len(path)] = c0 + np.asarray(path)
    as_t = lambda x: torch.from_numpy(x).to(device)  # noqa: E731
    return TreePaths(as_t(np.asarray(row_of, dtype=np.int64)), as_t(padded), as_t(keys),
                     as_t(np.asarray(context, dtype=np.int64)), as_t(take))


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[B, Q, Q] bool: ``out[b, q, j]`` when new token j is q itself or an ancestor of q, from ``parents`` [B, Q] int64
    (-1: none). Built by doubling: ``ceil(log2 Q)`` boolean matrix products, no host synchronisation."""
    b, q = parents.shape
    cols = torch.arange(q, device=parents.device)
    rel = (parents[:, :, None] == cols) | (cols[:, None] == cols)[None]  # parent or self
    hops = 1
    while hops < q:
        step = rel.to(torch.float32)
        rel = rel | (torch.bmm(step, step) > 0)
        hops *= 2
    return rel


def tree_visibility(parents: torch.Tensor, first: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """[B, Q, L] bool: a tree round's query q sees key slot j when j precedes the row's first new token (slot
    ``first[b]``, the cached context) or j holds q itself or one of its ancestors (:func:`ancestors`).

    Args:
        parents: [B, Q] int64 each new token's parent (-1: none). first: [B] int64 the row's first new slot (c).
        kpos: [L] int64 key slots.
    """
    q = parents.shape[1]
    rel = kpos[None, :] - first[:, None]  # [B, L] the key's column among the new tokens
    anc = ancestors(parents)  # [B, Q, Q]
    col = rel.clamp(0, q - 1)[:, None, :].expand(-1, q, -1)
    own = anc.gather(2, col) & ((rel >= 0) & (rel < q))[:, None, :]
    return own | (rel < 0)[:, None, :]


class PagedForward:
    """A transformers causal LM's forward over a :class:`~.kv_pool.KVPool` at a round's static shape.

    Args:
        model: a transformers ``*ForCausalLM`` (full attention; its decoder takes a cache object and a 4D mask).
        pool: the KV pool its layers write and read.
        aux: the auxiliary hidden states to append to the hidden states (EAGLE-3), or None.

    The call takes the round's device tensors (:func:`unpack_round`) and returns (logits [B, O, V] in the model's
    dtype, hidden states [B, O, H x (1 + aux layers)]): the rows of ``out_index``. It makes no host synchronisation
    and allocates nothing whose shape depends on the data (checked in the tests by ``torch.compile(fullgraph=True)``).
    """

    def __init__(self, model, pool: KVPool, aux: AuxHiddenStates | None = None):
        self.decoder, self.head = model.get_decoder(), model.get_output_embeddings()
        self.cache_kw = cache_keyword(self.decoder)
        self.pool, self.aux = pool, aux
        self.page_size = pool.page_size
        first = next(model.parameters())
        self.dtype = first.dtype

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, out_index: torch.Tensor,
                 span: tuple[int, int, int] | None = None, parents: torch.Tensor | None = None,
                 paths: TreePaths | None = None):
        """The forward (class docstring). ``span`` (eager rounds only): (first slot, length, new tokens) of a single
        row whose slots are consecutive, read as a view of the pool over exactly its length
        (:class:`~.kv_pool.PagedCache`). ``parents`` [B, Q] int64: a tree round's (module docstring); ``paths``: its
        root-to-leaf paths for the batch-invariant attention (:func:`tree_paths`; eager rounds only)."""
        if span is None:
            read = read_slots(block_table, seq_lens, self.page_size)  # [B, L]; past a row's length slot 0, masked below
            kpos = torch.arange(read.shape[1], device=read.device)
        else:
            read, kpos = None, torch.arange(span[1], device=block_table.device)
        inside = kpos[None, :] < seq_lens[:, None]  # [B, L]
        if parents is None:
            allowed = (kpos[None, None, :] <= positions[:, :, None]) & inside[:, None, :]
        else:
            allowed = tree_visibility(parents, positions[:, 0], kpos) & inside[:, None, :]
        allowed = allowed | (kpos == 0)
        mask = torch.where(allowed, 0.0, torch.finfo(self.dtype).min).to(self.dtype)[:, None]  # [B, 1, Q, L]
        cache = PagedCache(self.pool, write_slots, read, span)
        extra = {} if paths is None else {"tree_paths": paths}
        out = self.decoder(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                           **{self.cache_kw: cache}, **extra)
        h = out.last_hidden_state
        index = out_index[:, :, None].expand(-1, -1, h.shape[-1])
        hidden = h.gather(1, index)  # [B, O, H]
        logits = self.head(hidden)
        if self.aux is not None and self.aux.layers:
            hidden = self.aux.gather(hidden, out_index)
        return logits, hidden

    def run(self, inputs: dict[str, torch.Tensor], span: tuple[int, int, int] | None = None,
            paths: TreePaths | None = None):
        """The call on a round's inputs by field name (:func:`unpack_round`)."""
        return self(inputs["input_ids"], inputs["positions"], inputs["write_slots"], inputs["block_table"],
                    inputs["seq_lens"], inputs["out_index"], span=span, parents=inputs.get("parents"), paths=paths)


__all__ = ["BATCH_BUCKETS", "FIELDS", "QUERY_BUCKETS", "PagedForward", "RoundRow", "RoundShape", "ancestors", "bucket",
           "pack_round", "span_of", "split_by_padding", "tree_paths", "tree_visibility", "unpack_round"]
