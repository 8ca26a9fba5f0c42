"""The key of prefix caching: a hash chain over full blocks of token ids (vLLM's automatic prefix caching).

The target's and the draft LM's KV caches index their blocks by it (:mod:`.kv_cache`), and generate's chunked prefill
uses it to know which prompt blocks the target already holds (:class:`spec_decode.chunked_prefill.PrefixTracker`).
Also prefix caching's counters (:class:`PrefixCacheStats`). No torch here:
generate imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def block_hashes(token_ids: Sequence[int], block_size: int, start: int = 0, prev: list[int] | None = None) -> list[int]:
    """The hash chain of ``token_ids``' full blocks (vLLM's prefix-caching key): block i's key is
    ``hash((key of block i-1, ids of block i))`` (block 0: ``hash((None, ids))``), a pure function of the tokens from
    the start of the sequence to the block's end (Python hashes ints and tuples of them the same in every process).

    Args:
        token_ids: the sequence's token ids.
        block_size: tokens per block (>= 1).
        start: the number of blocks already hashed in ``prev`` (only blocks from ``start`` on are hashed).
        prev: the keys of blocks 0..start-1, extended in place and returned (None: a new list).

    Returns:
        one key per full block of ``token_ids``.
    """
    out = prev if prev is not None else []
    del out[start:]
    h = out[-1] if out else None
    for b in range(start, len(token_ids) // block_size):
        h = hash((h, tuple(token_ids[b * block_size : (b + 1) * block_size])))
        out.append(h)
    return out


@dataclass
class PrefixCacheStats:
    """Prefix caching's counters since start (exported as ``spec_decode_*_prefix_cache_*`` counters).

    Attributes:
        queries: computations of at least one full block that looked for a cached prefix.
        hits: those that found one (and copied at least one block).
        reused_tokens: tokens whose keys and values were copied instead of computed.
    """

    queries: int = 0
    hits: int = 0
    reused_tokens: int = 0
