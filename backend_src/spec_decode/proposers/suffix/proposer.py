"""The suffix decoding proposer (``speculative_method=suffix``; Arctic Inference's suffix decoding in vLLM).

No draft probabilities: the verifier treats q as one-hot. Each proposal carries its score (the expected number of
accepted tokens), by which hybrid chooses between it and another proposer's draft. A request with ``tree`` set gets
suffix decoding's speculation tree (Oliaro et al., "SuffixDecoding", arXiv 2411.04975; Arctic Inference's
``use_tree_spec``): the continuations of the best match expanded best-first by running probability, at most k nodes,
the most probable chain first; its score is the sum of the nodes' probabilities.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ...sequences import SequenceLRU
from ...settings import ConfigSettings, InvalidInputError, in_range
from ..base import Proposal, ProposalRequest, Proposer
from .cache import BACKENDS, SuffixDraft, make_cache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SuffixSettings(ConfigSettings):
    """Suffix decoding's config parameters (``suffix_*``).

    Attributes:
        max_tree_depth: longest stored substring, >= 1.
        max_cached_requests: responses kept in the global tree (FIFO), >= 0; 0 disables it.
        max_cached_tokens: tokens kept in the global tree (FIFO by whole responses; a longer response keeps its last
            ones), >= 0; 0 = no token bound. It bounds the global tree's memory (bytes per token: docs/benchmarks.md).
        max_spec_factor, max_spec_offset: a match of m tokens proposes at most floor(m * factor + offset) tokens.
        min_token_prob: stop drafting below this running probability, in [0, 1].
        backend: ``auto`` (Arctic's C++ tree when installed, else the Python trie), ``arctic`` or ``python``
            (:mod:`.cache`).
    """

    PREFIX = "suffix_"
    max_tree_depth: int = 64
    max_cached_requests: int = 10000
    max_cached_tokens: int = 1000000
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    backend: str = "auto"

    def check(self) -> None:
        """Each field in its range (see Attributes); backend one of :data:`~.cache.BACKENDS`."""
        in_range("max_tree_depth", self.max_tree_depth, 1)
        in_range("max_cached_requests", self.max_cached_requests, 0)
        in_range("max_cached_tokens", self.max_cached_tokens, 0)
        in_range("max_spec_factor", self.max_spec_factor, 0.0)
        if not math.isfinite(self.max_spec_offset):
            raise InvalidInputError("max_spec_offset", f"must be a finite number, got {self.max_spec_offset}")
        in_range("min_token_prob", self.min_token_prob, 0.0, 1.0)
        self._choice("backend", BACKENDS)


class SuffixProposer(Proposer):
    """Suffix-decoding proposer (``speculative_method=suffix``): a tree per active request plus a global tree of
    earlier responses.

    The step protocol sends a sequence's committed ids every step; the proposer feeds the cache only what is new
    (the first call for a sequence starts it with those ids as its prompt).

    Args:
        settings: the trees' and the drafts' bounds (default :class:`SuffixSettings`).
        max_active: request trees kept at once (least recently used stopped first).

    Raises:
        ValueError: the ``arctic`` backend asked for but not built (run scripts/build_suffix_tree.sh).
    """

    name = "suffix"
    Settings = SuffixSettings
    GAUGES = {
        "spec_decode_suffix_active_requests": "Requests with a suffix tree of their own (suffix, hybrid)",
        "spec_decode_suffix_cached_responses": "Responses in the suffix decoding global tree",
        "spec_decode_suffix_cached_tokens": "Tokens in the suffix decoding global tree",
        "spec_decode_suffix_max_cached_tokens": "Token budget of the suffix decoding global tree (0 = none)",
    }

    def __init__(self, settings: SuffixSettings | None = None, max_active: int = 256):
        s = settings or SuffixSettings()
        self.settings = s
        self.cache = make_cache(s.backend, s.max_tree_depth, s.max_cached_requests, s.max_cached_tokens)
        self.backend = self.cache.engine.name
        # seq_id -> the ids the cache has seen; an evicted sequence's tree is stopped (its response joins the global)
        self._ids: SequenceLRU[list[int]] = SequenceLRU(max_active, self._evicted)  # held weakly: no cycle
        if self.backend == "python" and s.max_cached_requests > 256:
            logger.warning("suffix decoding uses the pure-Python trie (Arctic's C++ tree is not built: run "
                           "scripts/build_suffix_tree.sh); suffix_max_cached_requests=%d with suffix_max_cached_tokens="
                           "%d may need many GB of memory", s.max_cached_requests, s.max_cached_tokens)


    def _evicted(self, seq_id: int, _ids: list[int]) -> None:
        """An evicted sequence's tree is stopped (its response joins the global tree)."""
        self.cache.stop_request(seq_id)
    def _sync(self, seq_id: int, token_ids: list[int]) -> None:
        known = self._ids.peek(seq_id)
        if known is not None and token_ids[: len(known)] == known:
            if len(token_ids) > len(known):
                new = token_ids[len(known) :]
                self.cache.add_active_response(seq_id, new)
                known.extend(new)
            self._ids.put(seq_id, known)  # most recently used
            return
        if known is not None:  # the ids diverged from what the cache saw: start the sequence over
            self.release(seq_id)
        self.cache.start_request(seq_id, token_ids)
        self._ids.put(seq_id, list(token_ids))

    def speculate(self, seq_id: int, token_ids: list[int], k: int, use_global: bool = True,
                  tree: bool = False) -> SuffixDraft:
        """Best draft of the request's tree and the global tree for the end of ``token_ids`` (at most ``k`` tokens),
        after feeding the cache the ids it has not seen.

        Args:
            seq_id: the sequence (uint64).
            token_ids: its committed ids (prompt + output so far).
            k: most tokens to draft.
            use_global: also match earlier responses (False: the request's own tree only).
            tree: draft a token tree of at most ``k`` nodes (``parents``; :meth:`~.cache.SuffixCache.speculate`'s
                ``use_tree_spec``), else a chain.
        """
        s = self.settings
        token_ids = [int(t) for t in token_ids]
        self._sync(seq_id, token_ids)
        return self.cache.speculate(seq_id, token_ids, k, s.max_spec_factor, s.max_spec_offset, s.min_token_prob,
                                    use_global, tree)

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """Per request, up to ``k`` draft tokens from suffix matching, without draft probabilities, with their score
        (the expected number of accepted tokens; 0 when nothing matched): a chain, or for a request with ``tree`` set
        a tree of at most ``k`` nodes (``draft_parents``; None when the tree is a chain)."""
        out = []
        for r in requests:
            draft = self.speculate(r.seq_id, r.token_ids, r.k, tree=r.tree)
            out.append(Proposal.of(draft.token_ids, draft.score, draft.parents if r.tree else None))
        return out

    def release(self, seq_id: int, final_token_ids: list[int] | None = None) -> None:
        """End of a sequence: its tree is freed and its response (up to ``final_token_ids`` when given) joins the
        global tree (FIFO-bounded in responses and tokens: :class:`~.cache.SuffixCache`)."""
        if final_token_ids is not None and seq_id in self._ids:
            self._sync(seq_id, [int(t) for t in final_token_ids])
        if self._ids.pop(seq_id) is not None:
            self.cache.stop_request(seq_id)

    def active_requests(self) -> int:
        """Request trees currently held."""
        return len(self._ids)

    def gauges(self) -> dict[str, float]:
        """Per-request trees held, the responses and tokens in the global tree, and its token budget (0 = none)."""
        return {"spec_decode_suffix_active_requests": len(self._ids),
                "spec_decode_suffix_cached_responses": self.cache.cached_requests,
                "spec_decode_suffix_cached_tokens": self.cache.cached_tokens(),
                "spec_decode_suffix_max_cached_tokens": self.cache.max_cached_tokens}
