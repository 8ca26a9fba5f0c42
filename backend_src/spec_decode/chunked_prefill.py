"""Chunked prefill: a round's token budget shared by the running sequences' steps and chunks of new prompts.

A round of steps (:mod:`spec_decode.serving.rounds`) runs one step of every sequence in the generation loop. Without a
budget, a new sequence's first step computes its whole prompt inside the round, and every other sequence waits for it
(a 1,540-token prompt stopped four running streams for 5 s on a 2-core CPU). With ``max_num_batched_tokens`` (vLLM's
name for the same budget), :func:`plan_round` gives each round at most that many new target positions: first the
running sequences' steps (k + 1 positions each: vLLM schedules decodes first), then the prompts' remaining tokens in
arrival order. A prompt that does not fit is cut into a chunk: a step over the prompt's first tokens without drafts,
whose sampled token is discarded (Arctic Inference's model runner does the same with a partial prefill) and whose KV
stays in the target's cache, so the next chunk computes only what follows. The round of the last chunk is the
sequence's first real step: it gives the first token, so the output is the same as with one-piece prefill. Chunk
steps are not steps of the sequence (its step counter, and so its noise, does not move).

Prompt blocks the target already holds (prefix caching: :mod:`spec_decode.engine.kv_cache`) cost a copy, not a
computation: :class:`PrefixTracker` keeps the block keys of the sequences generate has run, so a new sequence starts
with ``cached_len`` = its leading blocks found there and only the rest is budgeted (vLLM's scheduler counts its prefix
cache hits the same way). Should the target have evicted them since, that step computes them in one piece: time,
never a wrong token.

Not chunked: a sequence that asks for its prompt's log-probs (its first step scores every prompt position) and the
draft LM's own prefill (it runs at the sequence's first drafting step, in its own, smaller, model). A running sequence
whose target cache was evicted recomputes its tokens inside its step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

from .engine.blocks import block_hashes
from .protocol import NO_SPECULATION, StepInputs, StepResult


class PrefixTracker:
    """The prompt blocks the target is expected to hold: the block keys
    (:func:`~spec_decode.engine.blocks.block_hashes`) of the token ids of sequences generate has run (their prompts
    after their first step, all their tokens when they end), the least recently seen out first beyond
    ``capacity_tokens``.

    Args:
        block_size: tokens per block, the target's (16).
        capacity_tokens: tokens' worth of blocks remembered (the target's ``kv_cache_max_tokens``); 0 turns the tracker
            off (the target has no prefix caching): :meth:`cached_len` is then always 0.
    """

    def __init__(self, block_size: int = 16, capacity_tokens: int = 65536):
        self.block_size = block_size
        self.capacity = capacity_tokens // block_size
        self._keys: OrderedDict[int, None] = OrderedDict()

    def add(self, token_ids: Sequence[int]) -> None:
        """Remember the full blocks of ``token_ids`` (a sequence the target has computed)."""
        if not self.capacity:
            return
        for h in block_hashes(token_ids, self.block_size):
            self._keys[h] = None
            self._keys.move_to_end(h)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def cached_len(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of ``token_ids`` in remembered blocks (whole blocks, at most all but the last token)."""
        if not self.capacity:
            return 0
        n = 0
        for h in block_hashes(token_ids[: len(token_ids) - 1], self.block_size):
            if h not in self._keys:
                break
            n += self.block_size
        return n


def new_positions(inp: StepInputs) -> int:
    """Target positions ``inp``'s step computes: the tokens after what the sequence's cache holds (``cached_len``)
    plus its k drafts."""
    return len(inp.token_ids) - inp.cached_len + inp.num_draft_tokens


def _chunkable(inp: StepInputs) -> bool:
    """A step that still has prompt tokens to prefill (more than its last token uncached) and may be cut."""
    if len(inp.token_ids) - inp.cached_len <= 1:
        return False
    return inp.processors is None or not inp.processors.prompt_logprobs_at(len(inp.token_ids))


def chunk_step(inp: StepInputs, end: int) -> StepInputs:
    """The step that prefills ``inp.token_ids[:end]`` (a chunk of its prompt): no drafts, no processors (its sampled
    token is discarded), the same sequence, seed and step counter."""
    return replace(inp, token_ids=inp.token_ids[:end], num_draft_tokens=0, method=NO_SPECULATION, processors=None,
                   hidden_states=None, acceptance_method="")


def plan_round(inps: list[StepInputs], max_num_batched_tokens: int) -> list[StepInputs | None]:
    """What each step of a round runs within the round's token budget.

    Steps of running sequences run whole (k + 1 positions each). The budget left goes to steps with prompt tokens to
    prefill, in order: a step that fits runs whole (its k reduced to what fits, when its prompt fits but not all its
    drafts); one that does not gets a chunk (:func:`chunk_step`) of what is left; once nothing is left, the others wait
    for a later round (None). The first prefilling step of a round always gets at least a quarter of the budget, so
    prompts progress even when the running sequences' steps fill it.

    Args:
        inps: the round's steps, in arrival order.
        max_num_batched_tokens: the round's budget of new target positions (<= 0: no budget, every step runs whole).

    Returns:
        per step: the step itself (run whole, possibly with fewer drafts: a copy), a chunk step, or None (not run in
        this round).
    """
    if max_num_batched_tokens <= 0:
        return list(inps)
    left = max_num_batched_tokens - sum(new_positions(i) for i in inps if not _chunkable(i))
    floor = max(1, max_num_batched_tokens // 4)
    out: list[StepInputs | None] = []
    first = True
    for inp in inps:
        if not _chunkable(inp):
            out.append(inp)
            continue
        allot = max(left, floor) if first else left
        first = False
        uncached = len(inp.token_ids) - inp.cached_len
        if allot <= 0:
            out.append(None)
        elif allot >= uncached + inp.num_draft_tokens:
            out.append(inp)
        elif allot >= uncached:
            out.append(replace(inp, num_draft_tokens=allot - uncached))
        else:
            out.append(chunk_step(inp, inp.cached_len + allot))
        left -= max(allot, 0)
    return out


def round_results(inps: list[StepInputs], plan: list[StepInputs | None],
                  results: list[StepResult | BaseException]) -> list[StepResult | BaseException]:
    """Each step's result from the results of the steps :func:`plan_round` ran (``results``: one per non-None entry
    of ``plan``, in order): a step run whole (or with fewer drafts) gets its own; a chunk gets a result with no token
    and ``prefilled`` = the tokens its sequence's cache now holds (its exception, if it failed); a step that waited
    gets ``prefilled`` = its ``cached_len`` (no progress).

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
        if isinstance(r, BaseException) or len(p.token_ids) == len(inp.token_ids):
            out.append(r)
        else:
            out.append(StepResult([], 0, prefilled=len(p.token_ids)))
    return out


__all__ = ["PrefixTracker", "chunk_step", "new_positions", "plan_round", "round_results"]
