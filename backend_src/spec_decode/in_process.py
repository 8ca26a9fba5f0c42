"""The in-process transport: one speculative step with the proposer, scorer and verifier objects called directly.

gpt-fast's ``speculative_decode`` and vLLM's ``SpecDecodeWorker`` step: draft k tokens, one target forward over k+1
positions, verify. Tests and benchmarks drive a :class:`~spec_decode.generation.Generation` with it
(:func:`run_local`); the server runs the same objects behind its models (:mod:`spec_decode.serving`).
"""

from __future__ import annotations

import time

import torch

from .auto import AutoController
from .chunked_prefill import plan_round, round_results
from .engine.scorer import TargetScorer
from .generation import Chunk, Generation
from .processors import step_logprobs
from .proposers import Proposal, Proposer
from .protocol import AUTO, StepInputs, StepResult
from .verifier import Verifier


def run_step(inp: StepInputs, proposers: dict[str, Proposer], scorer: TargetScorer,
             verifier: Verifier) -> StepResult:
    """Run one speculative step of one sequence in process.

    Args:
        inp: the step's inputs (k = ``inp.num_draft_tokens``).
        proposers: method name -> proposer (only consulted when ``inp.drafts``).
        scorer: the target scorer. verifier: the verifier.

    Returns:
        1..k'+1 output ids with their target log-probs, the k' drafts proposed, and [n, H] float32 hidden states.

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
                                        inp.processors)
    else:
        proposal = Proposal.empty()
    drafts = proposal.draft_token_ids
    (scores,) = scorer.score_batch([(inp.seq_id, inp.token_ids, drafts.tolist(), inp.params, inp.processors)])
    ids, lps = verifier.verify(scores.probs, drafts, proposal.draft_probs, inp.params.seed, inp.step,
                               inp.params.is_greedy, inp.acceptance_method, len(inp.token_ids), inp.params.seeded)
    spec = inp.processors
    asked = step_logprobs(scores.probs, scores.log_probs, ids, spec.top_logprobs) if spec and spec.logprobs else None
    return StepResult(ids, int(drafts.numel()), asked.log_probs if asked else lps,
                      scores.hidden[: len(ids)].float().cpu().numpy(), asked, scores.prompt)


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

    Args:
        gen: the generation.
        step: runs one step (:class:`LocalStep`).
        max_num_batched_tokens: each step's budget of new target positions; a prompt longer than it is prefilled in
            chunks first (:func:`~spec_decode.chunked_prefill.plan_round`, as generate's rounds do; 0: in one piece).
        controller: plans each step of a ``speculative_method=auto`` request and learns from its time
            (:class:`~spec_decode.auto.AutoController`, as generate's rounds do).

    The step's caches are released at the end, with the sequence's final ids, even when a step raises.

    Raises:
        ValueError: an ``auto`` request without a controller.
    """
    if gen.request.speculative_method == AUTO and controller is None:
        raise ValueError("speculative_method=auto needs an AutoController")
    chunks = []
    try:
        while not gen.finished:
            inp = gen.next_step()
            if controller is not None:
                controller.plan([inp])
            (planned,) = plan_round([inp], max_num_batched_tokens)
            assert planned is not None  # the only step of a round always gets a chunk
            start = time.perf_counter()
            (result,) = round_results([inp], [planned], [step(planned)])
            assert not isinstance(result, BaseException)  # round_results passes exceptions on; step raised none
            if controller is not None:
                controller.observe([inp], [result], time.perf_counter() - start)
            chunks.append(gen.commit(result, inp))
    finally:
        step.release(gen.seq_id, gen.token_ids)
        if controller is not None:
            controller.release(gen.seq_id)
    return chunks
