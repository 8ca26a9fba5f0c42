"""Prefix caching's counters (:class:`PrefixCacheStats`), shared by the target's and the draft LM's KV pools
(:mod:`.kv_cache`; the prefix index itself is :mod:`.pages`'). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass


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
