"""n-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM ``NGramWorker``).

Match the last n tokens of the sequence (n from ``ngram_max`` down to ``ngram_min``) against earlier positions of the
same sequence and propose the k tokens that followed the most recent match. No draft probabilities; stateless, so there
is nothing to cache or free per sequence.

A request with ``tree`` set gets a token tree of at most k nodes (:mod:`spec_decode.tree`) from the matches of the
longest n that matches at all: each of the most recent :data:`MAX_MATCHES` matches, most recent first, offers the k
tokens that followed it, and the paths are merged by shared prefix (:func:`~spec_decode.tree.merge_paths`). A node
offered by more matches is kept first (as suffix decoding's counts rank continuations: Oliaro et al., arXiv
2411.04975), then by the order of the matches, then by depth: so the chain drafted today is the first path, and the
whole of the tree when one match, or matches that agree, make it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from ..settings import ConfigSettings, InvalidInputError, in_range
from ..tree import merge_paths
from .base import Proposal, ProposalRequest, Proposer

MAX_MATCHES = 16  # the most recent matches a tree is built from


@dataclass(frozen=True)
class NgramSettings(ConfigSettings):
    """Config parameters ``ngram_min`` and ``ngram_max``: the n-gram lengths matched, 1 <= min <= max."""

    PREFIX = "ngram_"
    min: int = 1
    max: int = 4

    def check(self) -> None:
        """min >= 1 and max >= min."""
        in_range("min", self.min, 1)
        if self.max < self.min:
            raise InvalidInputError("max", f"must be >= ngram_min={self.min}, got {self.max}")


def branch_paths(paths: list[list[int]], max_nodes: int) -> list[list[int]]:
    """``paths`` cut so that, merged by shared prefix, they make at most ``max_nodes`` nodes: the prefixes offered by
    the most paths are kept first, then those of earlier paths, then shallower ones (a prefix is never kept without
    its own prefixes: each is offered by at least as many paths, the same ones first, and is shallower).

    Args:
        paths: candidate continuations, the preferred first.
        max_nodes: the node budget (>= 0).
    """
    support: Counter[tuple[int, ...]] = Counter()
    first: dict[tuple[int, ...], tuple[int, int]] = {}  # prefix -> (first path offering it, depth)
    for j, path in enumerate(paths):
        for d in range(1, len(path) + 1):
            key = tuple(path[:d])
            support[key] += 1
            first.setdefault(key, (j, d))
    kept = set(sorted(support, key=lambda key: (-support[key], first[key]))[:max_nodes])
    out = []
    for path in paths:
        d = 0
        while d < len(path) and tuple(path[: d + 1]) in kept:
            d += 1
        out.append(list(path[:d]))
    return out


class NgramProposer(Proposer):
    """Prompt-lookup proposer (``speculative_method=ngram``): a chain from the most recent match, or a tree of several
    matches' continuations for a request with ``tree`` set (module docstring).

    Args:
        settings: the n-gram lengths (default 1..4).
    """

    name = "ngram"
    Settings = NgramSettings

    def __init__(self, settings: NgramSettings | None = None):
        settings = settings or NgramSettings()
        self.min_n, self.max_n = settings.min, settings.max

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """Per request, up to ``k`` tokens copied from after the most recent earlier match of the sequence's tail
        (k' may be below k near the end of the sequence, or 0), without draft probabilities; with ``tree`` set, at
        most ``k`` nodes merged from the continuations of several matches (``draft_parents``; None for a chain)."""
        return [self._one(r.token_ids, r.k, r.tree) for r in requests]

    def _one(self, token_ids: list[int], k: int, tree: bool = False) -> Proposal:
        ids = np.asarray(token_ids, dtype=np.int64)
        n_tok = len(ids)
        if n_tok < 2:
            return Proposal.empty()
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            tail = ids[n_tok - n :]
            # windows[i] = ids[i : i + n] for every start i whose window ends before the tail itself starts.
            windows = np.lib.stride_tricks.sliding_window_view(ids[: n_tok - 1], n)
            hits = np.nonzero((windows == tail).all(axis=1))[0]
            if len(hits):
                if tree:
                    paths = [ids[h + n : h + n + k].tolist() for h in hits[::-1][:MAX_MATCHES]]
                    tokens, parents = merge_paths(branch_paths(paths, k), k)
                    return Proposal.of(tokens, None, parents)
                start = int(hits[-1]) + n
                draft = ids[start : start + k]
                if len(draft):
                    return Proposal(torch.from_numpy(draft.copy()), None)
        return Proposal.empty()
