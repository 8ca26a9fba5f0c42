"""Greedy verification from the target's argmax alone: what the rejection sampler does for a temperature-0 row.

A greedy row needs none of the target's [k+1, V] distributions: a draft is accepted while it is its position's argmax
(the lowest index on ties, as :func:`~spec_decode.verifier.rejection_sample`), and the first mismatch, or the end of
the drafts, emits that position's argmax (vLLM's greedy rejection path, ``rejection_greedy_sample_kernel`` in
``vllm/v1/sample/rejection_sampler.py``, computes the same). The verifier model walks rows target_model sent as their
argmax (``target_argmax``); generate walks a round without drafts itself (:mod:`spec_decode.serving.triton_step`).
A tree of drafts (:mod:`spec_decode.tree`) is walked down from row 0, descending to the child that is the argmax
(SpecInfer's greedy tree verification, Miao et al. 2024).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..tree import children, rows_of

if TYPE_CHECKING:
    from ..processors import ProcessorSpec
    from ..sampling import SamplingParams


def argmax_suffices(params: SamplingParams, spec: ProcessorSpec | None) -> bool:
    """Whether a row's verification needs only the target's argmax: greedy (temperature 0) and no log-probs asked.
    target_model then sends ``target_argmax`` instead of the [k+1, V] distributions, and generate may skip the
    verifier (:mod:`spec_decode.serving.triton_step`): both read this one rule."""
    return params.is_greedy and (spec is None or not spec.logprobs)


def argmax_walk(best: list[int], best_probs: torch.Tensor, drafts: list[int],
                parents: Sequence[int] | None = None) -> tuple[list[int], list[float]]:
    """Greedy verification of one row from its argmax ids.

    Args:
        best: the k+1 argmax ids of the row's distributions (k = the drafts the target scored): row 0 follows the
            last committed token, row i+1 draft i.
        best_probs: [>= k+1] float32, the probabilities of those ids (only the first k+1 are read).
        drafts: the row's draft ids (only the first k are read; fewer end the walk early).
        parents: None (a chain), or each draft's parent among the drafts as :func:`spec_decode.tree.check_tree`
            gives them (only the first min(k, len(drafts)) are read). The walk starts at row 0: at node ``cur``
            (-1 before any), y = best[cur + 1]; it descends to cur's child whose token is y when
            best_probs[cur + 1] > 0, else stops.

    Returns:
        (output ids, their log-probabilities): 1..k+1 ids, the accepted drafts (a chain's first ones; a tree's path)
        then the argmax of the row after the last of them (the first mismatch's or the bonus position's), and float32
        logs of their probabilities as Python floats (those of the path's rows, :func:`spec_decode.tree.rows_of`). A
        draft whose position's argmax has probability 0 (a position the row's processors masked entirely) is not
        accepted.

    Raises:
        IndexError: ``best`` is empty, or fewer parents than the drafts read.
    """
    if not best:
        raise IndexError("argmax_walk needs at least one argmax id")
    k = len(best) - 1
    if parents is None:
        n = 0
        while n < k and n < len(drafts) and drafts[n] == best[n] and float(best_probs[n]) > 0:
            n += 1
        return best[: n + 1], torch.log(best_probs[: n + 1].float().clamp_min(1e-38)).tolist()
    m = min(k, len(drafts))
    if len(parents) < m:
        raise IndexError(f"argmax_walk: {len(parents)} parents for {m} drafts")
    kids = children([int(p) for p in parents[:m]])
    path: list[int] = []
    cur = -1
    while float(best_probs[cur + 1]) > 0:
        nxt = next((c for c in kids[cur + 1] if drafts[c] == best[cur + 1]), None)
        if nxt is None:
            break
        path.append(nxt)
        cur = nxt
    rows = rows_of(path)
    return ([drafts[c] for c in path] + [best[cur + 1]],
            torch.log(best_probs[rows].float().clamp_min(1e-38)).tolist())
