"""Greedy verification from the target's argmax alone: what the rejection sampler does for a temperature-0 row.

A greedy row needs none of the target's [k+1, V] distributions: a draft is accepted while it is its position's argmax
(the lowest index on ties, as :func:`~spec_decode.verifier.rejection_sample`), and the first mismatch, or the end of
the drafts, emits that position's argmax (vLLM's greedy rejection path, ``rejection_greedy_sample_kernel`` in
``vllm/v1/sample/rejection_sampler.py``, computes the same). The verifier model walks rows target_model sent as their
argmax (``target_argmax``); generate walks a round without drafts itself (:mod:`spec_decode.serving.triton_step`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..processors import ProcessorSpec
    from ..sampling import SamplingParams


def argmax_suffices(params: SamplingParams, spec: ProcessorSpec | None) -> bool:
    """Whether a row's verification needs only the target's argmax: greedy (temperature 0) and no log-probs asked.
    target_model then sends ``target_argmax`` instead of the [k+1, V] distributions, and generate may skip the
    verifier (:mod:`spec_decode.serving.triton_step`): both read this one rule."""
    return params.is_greedy and (spec is None or not spec.logprobs)


def argmax_walk(best: list[int], best_probs: torch.Tensor, drafts: list[int]) -> tuple[list[int], list[float]]:
    """Greedy verification of one row from its argmax ids.

    Args:
        best: the k+1 argmax ids of the row's distributions (k = the drafts the target scored).
        best_probs: [>= k+1] float32, the probabilities of those ids (only the first k+1 are read).
        drafts: the row's draft ids (only the first k are read; fewer end the walk early).

    Returns:
        (output ids, their log-probabilities): 1..k+1 ids, the accepted drafts then the first mismatch's or the bonus
        position's argmax, and float32 logs of their probabilities as Python floats. A draft whose position's argmax
        has probability 0 (a position the row's processors masked entirely) is not accepted.

    Raises:
        IndexError: ``best`` is empty.
    """
    if not best:
        raise IndexError("argmax_walk needs at least one argmax id")
    k = len(best) - 1
    n = 0
    while n < k and n < len(drafts) and drafts[n] == best[n] and float(best_probs[n]) > 0:
        n += 1
    return best[: n + 1], torch.log(best_probs[: n + 1].float().clamp_min(1e-38)).tolist()
