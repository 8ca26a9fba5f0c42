"""Suffix decoding: the suffix trees, their cache and the proposer (Oliaro et al., arXiv 2411.04975; Snowflake Arctic
Inference's ``SuffixDecodingCache``).

Each active request has a suffix tree over its prompt and response so far; one global tree holds earlier responses
(FIFO eviction past ``max_cached_requests`` responses or ``max_cached_tokens`` tokens). A draft continues a match of
the context's end in either tree, following the most frequent continuation while its running probability stays at or
above ``min_token_prob``; the match whose draft has the best score (expected accepted tokens) wins. A request that
allows a tree (``ProposalRequest.tree``) gets suffix decoding's speculation tree instead: the match's continuations
expanded best-first by running probability, at most k nodes, the most probable chain first.

- :mod:`.tree`: the pure-Python suffix trie and the speculation over it (the reference semantics).
- :mod:`.cache`: :class:`SuffixCache`, the per-request trees and the global tree, on Arctic's C++ tree or the trie.
- :mod:`.proposer`: :class:`SuffixProposer`, the proposer draft_model serves.
"""

from .cache import BACKENDS, SuffixCache, arctic_available, make_cache
from .proposer import SuffixProposer, SuffixSettings
from .tree import SuffixDraft, SuffixTree, chain_first, speculate

__all__ = ["BACKENDS", "SuffixCache", "SuffixDraft", "SuffixProposer", "SuffixSettings", "SuffixTree",
           "arctic_available", "chain_first", "make_cache", "speculate"]
