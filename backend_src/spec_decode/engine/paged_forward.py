"""One round's forward over the paged KV pool at static shapes: the function a CUDA graph captures (:mod:`.cuda_graphs`)
and the CPU runs eagerly, on the same buffers and masks.

A round is B rows (sequences) of Q query positions each, padded: row r's ``n_r`` new tokens sit in columns
``0 .. n_r - 1`` at positions ``c_r .. c_r + n_r - 1`` (``c_r`` positions already cached); padded columns and padded
rows hold token 0 at position 0 and write into the trash page. Keys run over L = P x page_size positions read through
each row's block table (P pages). The mask is built on the device from the positions and lengths: query (r, q) sees
key position j when j <= its position and j < the row's length (and key 0 always, so a padded query's softmax is never
empty). Only O output rows per row go through the LM head, chosen by ``out_index``.

Glossary of the shapes (vLLM's ``CommonAttentionMetadata`` carries the same): B padded batch, Q padded query length
(1 for plain decoding, k+1 for verification), O output rows per row (<= Q), P block-table width in pages, L = P x
page_size key positions, V vocabulary, H hidden size (x (1 + aux layers) for EAGLE-3's hidden states).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .aux_states import AuxHiddenStates
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

    def sizes(self) -> dict[str, tuple[int, ...]]:
        """Each input's shape (:data:`FIELDS`)."""
        b, q = self.batch, self.query
        return {"input_ids": (b, q), "positions": (b, q), "write_slots": (b * q,), "block_table": (b, self.pages),
                "seq_lens": (b,), "out_index": (b, self.outputs)}

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
    """

    pages: list[int]
    cached: int
    new_ids: list[int]
    n_logits: int


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
    if shape.batch != 1 or len(rows) != 1:
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
    for name in FIELDS:
        n = int(np.prod(sizes[name]))
        views[name] = out[at : at + n].reshape(sizes[name])
        at += n
    q = shape.query
    for r, row in enumerate(rows):
        n, c = len(row.new_ids), row.cached
        if n > q or row.n_logits > shape.outputs or len(row.pages) > shape.pages:
            raise ValueError(f"row {r} ({n} new tokens, {row.n_logits} outputs, {len(row.pages)} pages) does not fit "
                             f"{shape}")
        pos = np.arange(c, c + n)
        pages = np.asarray(row.pages, dtype=np.int64)
        views["input_ids"][r, :n] = row.new_ids
        views["positions"][r, :n] = pos
        views["write_slots"][r * q : r * q + n] = pages[pos // page_size] * page_size + pos % page_size
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
                 span: tuple[int, int, int] | None = None):
        """The forward (class docstring). ``span`` (eager rounds only): (first slot, length, new tokens) of a single
        row whose slots are consecutive, read as a view of the pool over exactly its length
        (:class:`~.kv_pool.PagedCache`)."""
        if span is None:
            read = read_slots(block_table, seq_lens, self.page_size)  # [B, L]; past a row's length slot 0, masked below
            kpos = torch.arange(read.shape[1], device=read.device)
        else:
            read, kpos = None, torch.arange(span[1], device=block_table.device)
        inside = kpos[None, :] < seq_lens[:, None]  # [B, L]
        allowed = (kpos[None, None, :] <= positions[:, :, None]) & inside[:, None, :]
        allowed = allowed | (kpos == 0)
        mask = torch.where(allowed, 0.0, torch.finfo(self.dtype).min).to(self.dtype)[:, None]  # [B, 1, Q, L]
        cache = PagedCache(self.pool, write_slots, read, span)
        out = self.decoder(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                           **{self.cache_kw: cache})
        h = out.last_hidden_state
        index = out_index[:, :, None].expand(-1, -1, h.shape[-1])
        hidden = h.gather(1, index)  # [B, O, H]
        logits = self.head(hidden)
        if self.aux is not None and self.aux.layers:
            hidden = self.aux.gather(hidden, out_index)
        return logits, hidden

    def run(self, inputs: dict[str, torch.Tensor], span: tuple[int, int, int] | None = None):
        """The call on a round's inputs by field name (:func:`unpack_round`)."""
        return self(inputs["input_ids"], inputs["positions"], inputs["write_slots"], inputs["block_table"],
                    inputs["seq_lens"], inputs["out_index"], span=span)


__all__ = ["BATCH_BUCKETS", "FIELDS", "QUERY_BUCKETS", "PagedForward", "RoundRow", "RoundShape", "bucket",
           "pack_round", "span_of", "split_by_padding", "unpack_round"]
