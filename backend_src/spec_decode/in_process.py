"""The in-process transport: one speculative step with the proposer, scorer and verifier objects called directly.

gpt-fast's ``speculative_decode`` and vLLM's ``SpecDecodeWorker`` step: draft k tokens, one target forward over k+1
positions, verify. Tests and benchmarks drive a :class:`~spec_decode.generation.Generation` with it
(:func:`run_local`); the server runs the same objects behind its models (:mod:`spec_decode.serving`).
"""

from __future__ import annotations

import time

import torch

from .engine.scorer import TargetScorer
from .generation import Chunk, Generation
from .processors import step_logprobs
from .proposers import Proposal, Proposer
from .protocol import AUTO, StepInputs, StepResult, step_result
from .scheduler.auto import AutoController
from .scheduler.plan import Scheduler, run_sync
from .tree import accepted_nodes, rows_of
from .verifier import Verifier, VerifierRow


def run_step(inp: StepInputs, proposers: dict[str, Proposer], scorer: TargetScorer,
             verifier: Verifier) -> StepResult:
    """Run one speculative step of one sequence in process.

    Args:
        inp: the step's inputs (k = ``inp.num_draft_tokens``).
        proposers: method name -> proposer (only consulted when ``inp.drafts``).
        scorer: the target scorer. verifier: the verifier.

    Returns:
        1..k'+1 output ids with their target log-probs, the k' drafts proposed, and [n, H] float32 hidden states,
        with the positions the target reused and its forward's seconds; for a prompt chunk (a step whose uncached
        prompt exceeds its ``num_scheduled_tokens``: :meth:`~spec_decode.engine.scorer.TargetScorer.chunk_end`), no
        token.

    Raises:
        KeyError: no proposer for ``inp.method``.
        ValueError: from the scorer or the verifier (token ids out of range, invalid probabilities).
    """
    if inp.drafts:
        proposer = proposers[inp.method]
        hidden = None
        if proposer.needs_hidden_states and inp.hidden_states is not None and len(inp.hidden_states):
            hidden = torch.as_tensor(inp.hidden_states, dtype=torch.float32)
        proposal = proposer.propose_one(inp.seq_id, inp.token_ids, inp.num_draft_tokens, inp.params, inp.step, hidden,
                                        inp.processors, inp.draft_tree, inp.tree_top_k, inp.tree_depth)
    else:
        proposal = Proposal.empty()
    drafts = proposal.draft_token_ids
    parents = None if proposal.draft_parents is None else proposal.draft_parents.tolist()
    end = scorer.chunk_end(inp.seq_id, inp.token_ids, int(drafts.numel()), inp.processors, inp.num_scheduled_tokens)
    start = time.perf_counter()
    if end is not None:  # a prompt chunk: its keys stay cached, its token is discarded
        (scores,) = scorer.score_batch([(inp.seq_id, inp.token_ids[:end], [], inp.params)])
        return StepResult([], 0, cached_tokens=scores.cached, forward_seconds=time.perf_counter() - start)
    (scores,) = scorer.score_batch([(inp.seq_id, inp.token_ids, drafts.tolist(), inp.params, inp.processors,
                                     parents)])
    forward = time.perf_counter() - start
    row = VerifierRow(scores.probs, drafts, proposal.draft_probs, inp.params.seed, inp.step, inp.params.is_greedy,
                      inp.acceptance_method, len(inp.token_ids), inp.params.seeded, proposal.draft_parents)
    ((ids, lps),) = verifier.verify_batch([row])
    spec = inp.processors
    asked = None
    if spec and spec.logprobs:
        rows = rows_of(accepted_nodes(drafts.tolist(), parents, ids))
        asked = step_logprobs(scores.probs, scores.log_probs, ids, spec.top_logprobs, rows)
    return step_result(inp, ids, asked.log_probs if asked else lps, drafts.tolist(), parents,
                       scores.hidden.float().cpu().numpy(), asked, scores.prompt, scores.cached, forward)


class LocalStep:
    """A step callable for :func:`run_local`: :func:`run_step` over fixed objects.

    Args:
        proposers: method name -> proposer (``none`` needs no entry).
        scorer: the target scorer.
        verifier: the verifier (default: rejection sampling, :class:`~spec_decode.verifier.VerifierSettings`).
    """

    def __init__(self, proposers: dict[str, Proposer], scorer: TargetScorer, verifier: Verifier | None = None):
        self.proposers = dict(proposers)
        self.scorer = scorer
        self.verifier = verifier or Verifier()

    def __call__(self, inp: StepInputs) -> StepResult:
        """Run draft -> target -> verifier for one sequence."""
        return run_step(inp, self.proposers, self.scorer, self.verifier)

    def release(self, seq_id: int, final_token_ids: list[int] | None = None) -> None:
        """Free every per-sequence cache of ``seq_id`` (its final ids join suffix decoding's cache)."""
        for p in self.proposers.values():
            p.release(seq_id, final_token_ids)
        self.scorer.release(seq_id)


def run_local(gen: Generation, step: LocalStep, max_num_batched_tokens: int = 0,
              controller: AutoController | None = None) -> list[Chunk]:
    """Drive ``gen`` to completion with a synchronous step callable; returns every chunk.

    Each step is a round of one sequence through the same loop as generate's rounds
    (:meth:`~spec_decode.scheduler.plan.Scheduler.run_round`: plan, run, observe).

    Args:
        gen: the generation.
        step: runs one step (:class:`LocalStep`).
        max_num_batched_tokens: each step's budget of new target positions; a prompt whose uncached tokens exceed it
            is prefilled in chunks first (:mod:`spec_decode.scheduler.chunked_prefill`; 0: in one piece).
        controller: plans each step of a ``speculative_method=auto`` request and learns from its time
            (:class:`~spec_decode.scheduler.auto.AutoController`).

    The step's caches are released at the end, with the sequence's final ids, even when a step raises.

    Raises:
        ValueError: an ``auto`` request without a controller.
    """
    if gen.request.speculative_method == AUTO and controller is None:
        raise ValueError("speculative_method=auto needs an AutoController")
    scheduler = Scheduler(max_num_batched_tokens, auto=controller)
    chunks = []

    def execute(steps: list[StepInputs]) -> list[StepResult]:
        return [step(s) for s in steps]

    try:
        while not gen.finished:
            plan, (result,) = run_sync(scheduler.run_round([gen.next_step()], execute))
            if isinstance(result, BaseException):
                raise result
            chunks.append(gen.commit(result, plan.as_run(0)))
    finally:
        step.release(gen.seq_id, gen.token_ids)
        scheduler.release(gen.seq_id)
    return chunks
