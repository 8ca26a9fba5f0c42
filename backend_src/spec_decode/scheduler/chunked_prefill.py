"""Chunked prefill: a round's token budget shared by the running sequences' steps and the prompts being prefilled.

A round of steps (:mod:`spec_decode.serving.rounds`) runs one step of every sequence in the generation loop. Without a
budget, a new sequence's first step computes its whole prompt inside the round, and every other sequence waits for it
(a 1,540-token prompt stopped four running streams for 5 s on a 2-core CPU). With ``max_num_batched_tokens`` (vLLM's
name for the same budget), :func:`plan_round` gives each round at most that many new target positions: first the
running sequences' steps (k + 1 positions each: vLLM schedules decodes first), then the prompts in arrival order, each
with its share of what is left (``num_scheduled_tokens``).

The share is spent where the cache is known, in the target (:meth:`~spec_decode.engine.scorer.TargetScorer.chunk_end`):
a prompt whose tokens past its prefix-cache hit fit its share runs its first step whole (its first token comes in this
round, as vLLM budgets a request by its tokens past its cache hit); a longer one computes a chunk of its share and
scores nothing. The chunk's keys stay in the target's cache, so the next round's share goes on from there; its sampled
token is discarded (Arctic Inference's model runner does the same with a partial prefill), so the output is the same
as with one-piece prefill. Chunk steps are not steps of the sequence (its step counter, and so its noise, does not
move). The result of a chunk says how many tokens the target reused (``cached_tokens``); generate keeps no guess of the
target's cache, which would be wrong with several target instances or after an eviction: at worst a round's share is
spent on tokens a later round finds cached again.

Not chunked: a sequence that asks for its prompt's log-probs (its first step scores every prompt position), a step
with drafts (a share too small for the drafts and the prompt sends none), and the draft LM's own prefill (it runs at
the sequence's first drafting step, in its own, smaller, model). A running sequence whose target cache was evicted
recomputes its tokens inside its step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..protocol import StepInputs, StepResult


def new_positions(inp: StepInputs) -> int:
    """Target positions ``inp``'s step computes: the tokens after what the sequence's cache holds (``cached_len``)
    plus its k drafts."""
    return len(inp.token_ids) - inp.cached_len + inp.num_draft_tokens


def _prefilling(inp: StepInputs) -> bool:
    """A step that may still have prompt tokens to prefill (more than its last token not known to be cached) and may
    be cut."""
    if len(inp.token_ids) - inp.cached_len <= 1:
        return False
    return inp.processors is None or not inp.processors.prompt_logprobs_at(len(inp.token_ids))


def plan_round(inps: Sequence[StepInputs], max_num_batched_tokens: int) -> list[StepInputs | None]:
    """What each step of a round runs within the round's token budget.

    Steps of running sequences run whole (k + 1 positions each). The budget left goes to steps with prompt tokens to
    prefill, in order, as their ``num_scheduled_tokens``: a step whose tokens not known to be cached and drafts fit
    it keeps its drafts; one whose tokens fit but not all its drafts keeps the drafts that fit; one whose tokens do
    not fit sends no drafts (the target then prefills a chunk unless its cache holds enough of the prompt). Once
    nothing is left, the others wait for a later round (None). The first prefilling step of a round always gets at
    least a quarter of the budget, so prompts progress even when the running sequences' steps fill it.

    Args:
        inps: the round's steps, in arrival order.
        max_num_batched_tokens: the round's budget of new target positions (<= 0: no budget, every step runs whole).

    Returns:
        per step: the step itself, or a copy with its share (and possibly fewer drafts), or None (not run in this
        round).
    """
    if max_num_batched_tokens <= 0:
        return list(inps)
    left = max_num_batched_tokens - sum(new_positions(i) for i in inps if not _prefilling(i))
    floor = max(1, max_num_batched_tokens // 4)
    out: list[StepInputs | None] = []
    first = True
    for inp in inps:
        if not _prefilling(inp):
            out.append(inp)
            continue
        allot = max(left, floor) if first else left
        first = False
        uncached = len(inp.token_ids) - inp.cached_len
        if allot <= 0:
            out.append(None)
        else:
            k = min(inp.num_draft_tokens, max(0, allot - uncached))
            out.append(replace(inp, num_draft_tokens=k, num_scheduled_tokens=allot))
        left -= max(allot, 0)
    return out


def round_results(inps: Sequence[StepInputs], plan: Sequence[StepInputs | None],
                  results: Sequence[StepResult | BaseException]) -> list[StepResult | BaseException]:
    """Each step's result from the results of the steps :func:`plan_round` ran (``results``: one per non-None entry
    of ``plan``, in order): a step that ran gets its own, except a prompt chunk (no token back from a step with a
    share), which gets ``prefilled`` = the tokens its sequence's cache now holds (those the target reused plus its
    share); a step that waited gets ``prefilled`` = its ``cached_len`` (no progress).

    Raises:
        ValueError: ``results`` does not hold one result per step run.
    """
    ran = iter(results)
    out: list[StepResult | BaseException] = []
    n_run = sum(p is not None for p in plan)
    if len(results) != n_run:
        raise ValueError(f"{len(results)} results for the {n_run} steps run")
    for inp, p in zip(inps, plan):
        if p is None:
            out.append(StepResult([], 0, prefilled=inp.cached_len))
            continue
        r = next(ran)
        if isinstance(r, BaseException) or r.output_ids or not p.num_scheduled_tokens:
            out.append(r)
        else:
            held = (r.cached_tokens or 0) + p.num_scheduled_tokens
            out.append(replace(r, prefilled=min(held, len(p.token_ids) - 1)))
    return out


__all__ = ["new_positions", "plan_round", "round_results"]
