"""The step protocol's types: what one speculative step of one sequence takes and returns.

Stateless on the wire (docs/architecture.md, "The step protocol"): every step carries the sequence's committed token
ids, k, the method, the sampling parameters with the seed and the step counter, so any instance of a step model can
serve it and caches are only an optimisation. :class:`~spec_decode.generation.Generation` makes :class:`StepInputs`
and commits :class:`StepResult`; a transport runs the step (in process: :mod:`spec_decode.in_process`; over Triton:
:mod:`spec_decode.serving.triton_step`, with the tensors named in :mod:`spec_decode.serving.wire`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .sampling import SamplingParams
from .tree import accepted_nodes, depths, rows_of

if TYPE_CHECKING:  # the step's types name them; the contract itself imports no subpackage
    from .processors import ProcessorSpec, TokenLogprobs

NO_SPECULATION = "none"  # the speculative_method of plain decoding: no proposer, k = 0
AUTO = "auto"  # the method that lets the server choose the proposer and k per step (spec_decode.scheduler.auto)


@dataclass(frozen=True)
class StepInputs:
    """What one speculative step needs. Frozen: the round's plan runs copies with its choices
    (:class:`~spec_decode.scheduler.plan.Scheduler`), never an edited original.

    Attributes:
        seq_id: sequence id (uint64), unique per request.
        token_ids: committed ids (prompt + accepted output), length >= 1.
        num_draft_tokens: k for this step (0 = plain decoding), clamped so the sequence stays within max_model_len
            (not by max_tokens: :meth:`~spec_decode.generation.Generation.next_step`).
        method: the speculative method, one of :data:`spec_decode.proposers.METHODS`.
        params: sampling parameters (with the request seed).
        step: step counter (0-based), mixed into the noise seed.
        acceptance_method: "rejection", "typical", or "" for the verifier's default.
        hidden_states: [m, H] float32, the target's last hidden states at the m positions before the last committed
            token (``token_ids[-1-m:-1]``: what the previous step accepted), for a hidden-state speculator; None when
            there are none (the first step, or after a step that scored nothing).
        processors: the request's logits processors and log-prob requests (the same at every step), or None.
        cached_len: how many leading ``token_ids`` the target's cache of this sequence is expected to hold (0 for a
            new sequence; the end of the last prompt chunk while its prompt is prefilled in chunks; all but the last
            committed token after a step): what chunked prefill budgets by
            (:mod:`spec_decode.scheduler.chunked_prefill`); the target itself knows better (its prefix cache), and
            says so in the result (:attr:`StepResult.cached_tokens`).
        auto: the request asked for ``auto``: as submitted, ``method`` is ``auto`` and ``num_draft_tokens`` the cap;
            the round's plan (:class:`~spec_decode.scheduler.plan.Scheduler`) runs a copy with the choice of its
            :class:`~spec_decode.scheduler.auto.AutoController`.
        num_scheduled_tokens: the step's share of its round's token budget (chunked prefill): new positions the
            target may compute for it; a step without drafts whose uncached prompt is longer prefills a chunk of it
            and scores nothing (:meth:`~spec_decode.engine.scorer.TargetScorer.chunk_end`). 0: no bound.
        draft_tree: the proposer may draft a tree of at most ``num_draft_tokens`` nodes (:mod:`spec_decode.tree`);
            else a chain.
        tree_top_k: that tree's children per expanded node, or 0: draft_model's configured width.
        tree_depth: that tree's levels at most, or 0: draft_model's configured depth.
    """

    seq_id: int
    token_ids: list[int]
    num_draft_tokens: int
    method: str
    params: SamplingParams
    step: int
    acceptance_method: str = ""
    hidden_states: np.ndarray | None = None
    processors: ProcessorSpec | None = None
    cached_len: int = 0
    auto: bool = False
    num_scheduled_tokens: int = 0
    draft_tree: bool = False
    tree_top_k: int = 0
    tree_depth: int = 0

    @property
    def drafts(self) -> bool:
        """Whether the step asks for drafts (k > 0 and a method other than none): else it skips draft_model."""
        return self.num_draft_tokens > 0 and self.method != NO_SPECULATION

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the step returns the prompt's log-probs: a first step whose processors ask for them
        (:meth:`~spec_decode.processors.ProcessorSpec.prompt_logprobs_at`). Such a step drafts a chain."""
        return self.processors is not None and self.processors.prompt_logprobs_at(len(self.token_ids))


@dataclass
class StepResult:
    """What one speculative step returns.

    Attributes:
        output_ids: 1..k+1 token ids: accepted drafts then the recovered or bonus token.
        num_draft_tokens: how many draft tokens the proposer actually proposed (k' <= k; a tree's nodes).
        log_probs: target log-probability of each output id (same length), or None.
        hidden_states: [n, H] float32, the target's last hidden states at the positions that predicted the n output
            ids (the last committed token's and the accepted drafts'), or None when the transport has none.
        logprobs: the output ids' log-probs, ranks and top-N alternatives when the step's processors ask for them
            (``log_probs`` then holds the same log-probs), else None.
        prompt: the prompt tokens' log-probs (1..P-1) on a first step that asks for them, else None.
        prefilled: for a chunk of a prompt (:mod:`spec_decode.scheduler.chunked_prefill`), the tokens the sequence's
            cache now holds; then ``output_ids`` is empty and the step is not committed. None for a step.
        cached_tokens: leading ``token_ids`` the target reused from its cache instead of computing them (vLLM's
            ``num_cached_tokens``), or None when the transport did not say.
        forward_seconds: seconds of the target's forward that scored the step (shared by the rows batched with it),
            or None when the transport did not say.
        draft_depth: the deepest path of the step's drafts (k' for a chain, less for a tree), or None when the
            transport did not say (the metrics count a tree's acceptance per depth).
    """

    output_ids: list[int]
    num_draft_tokens: int
    log_probs: list[float] | None = None
    hidden_states: np.ndarray | None = None
    logprobs: TokenLogprobs | None = None
    prompt: TokenLogprobs | None = None
    prefilled: int | None = None
    cached_tokens: int | None = None
    forward_seconds: float | None = None
    draft_depth: int | None = None


def step_result(inp: StepInputs, output_ids: list[int], log_probs: list[float] | None, drafts: Sequence[int],
                parents: Sequence[int] | None, hidden: np.ndarray | None = None, logprobs: TokenLogprobs | None = None,
                prompt: TokenLogprobs | None = None, cached: int | None = None,
                forward: float | None = None) -> StepResult:
    """A step's :class:`StepResult` from what its transport decoded: the one builder of the three transports
    (:mod:`spec_decode.in_process`, :mod:`spec_decode.serving.triton_step`, :mod:`spec_decode.serving.local_ensemble`).

    Args:
        inp: the step's inputs. output_ids: its emitted ids (1..depth+1; empty for a prompt chunk).
        log_probs: their log-probs (same length), or None.
        drafts: the k' drafts the target scored. parents: their parents (a tree, :mod:`spec_decode.tree`), or None.
        hidden: [k'+1, H] float32, the target's hidden states at every scored row, or None; the result keeps those
            of the rows that predicted ``output_ids`` (:func:`~spec_decode.tree.rows_of` of the accepted path).
        logprobs: the emitted ids' ranks and alternatives, when asked for. prompt: the prompt's log-probs, kept on a
            step that asks for them (:attr:`StepInputs.wants_prompt_logprobs`). cached, forward: what the target
            measured.

    Raises:
        ValueError: ``output_ids`` do not follow the drafts (:func:`~spec_decode.tree.accepted_nodes`).
    """
    rows = rows_of(accepted_nodes(drafts, parents, output_ids)) if output_ids else []
    depth = max(depths(parents), default=0) if parents is not None else len(drafts)
    return StepResult(list(output_ids), len(drafts), log_probs, None if hidden is None else hidden[rows], logprobs,
                      prompt if inp.wants_prompt_logprobs else None, cached_tokens=cached, forward_seconds=forward,
                      draft_depth=depth)
