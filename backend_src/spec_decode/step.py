"""One speculative step: draft -> target -> verifier (gpt-fast ``speculative_decode``, vLLM ``SpecDecodeWorker``).

:class:`Verifier` is what the ``verifier`` Triton model runs; :func:`run_step` composes the three roles in process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .loop import StepInputs, StepResult
from .proposers import Proposal
from .request import ACCEPTANCE_METHODS
from .sampling import mix_seed
from .verifier import check_typical_parameters, rejection_sample, typical_acceptance_sample


@dataclass
class Verifier:
    """Verifies one sequence's drafts with the configured acceptance method.

    Attributes:
        acceptance_method: default method, "rejection" (lossless) or "typical" (faster, not lossless).
        typical_epsilon: typical acceptance posterior_threshold (epsilon), >= 0.
        typical_alpha: typical acceptance posterior_alpha (delta), >= 0.
        backend: verifier backend ("auto": Triton kernels for CUDA tensors, torch on CPU).

    Raises:
        ValueError: (at construction) an unknown method, or typical parameters that are negative, NaN, infinite or
            beyond float32.
    """

    acceptance_method: str = "rejection"
    typical_epsilon: float = 0.09
    typical_alpha: float = 0.3
    backend: str = "auto"

    def __post_init__(self):
        if self.acceptance_method not in ACCEPTANCE_METHODS:
            raise ValueError(f"acceptance_method={self.acceptance_method!r}: allowed values are {', '.join(ACCEPTANCE_METHODS)}")
        check_typical_parameters(self.typical_epsilon, self.typical_alpha, ("typical_epsilon", "typical_alpha"))

    def verify(
        self,
        target_probs: torch.Tensor,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        seed: int,
        step: int,
        greedy: bool,
        method: str = "",
    ) -> tuple[list[int], list[float]]:
        """Verify one sequence's drafts.

        Args:
            target_probs: [k+1, V] float target distributions after the sampling transforms (any device).
            draft_token_ids: [k] int64.
            draft_probs: [k, V] or None/empty (drafts without probabilities).
            seed: request seed (>= 0); the step's noise is keyed by (seed, step, position).
            step: step counter.
            greedy: temperature 0 (argmax walk, whatever the method).
            method: "rejection", "typical" or "" (this verifier's default).

        Returns:
            (output_ids, log_probs): 1..k+1 emitted token ids and the target log-probability of each.

        Raises:
            ValueError: unknown method, inconsistent shapes or invalid probabilities (from the sampler).
        """
        method = method or self.acceptance_method
        if method not in ACCEPTANCE_METHODS:
            raise ValueError(f"acceptance_method={method!r}: allowed values are {', '.join(ACCEPTANCE_METHODS)}")
        dev = target_probs.device
        k = int(draft_token_ids.shape[0])
        ids = draft_token_ids.to(device=dev, dtype=torch.int64).reshape(1, k)
        seeds = torch.tensor([mix_seed(seed, step)], dtype=torch.int64)
        is_greedy = torch.tensor([greedy])
        if method == "typical" and not greedy:  # at temperature 0 both methods are the exact argmax walk
            out = typical_acceptance_sample(target_probs[None], ids, posterior_threshold=self.typical_epsilon,
                                            posterior_alpha=self.typical_alpha, seeds=seeds, is_greedy=is_greedy,
                                            backend=self.backend)
        else:
            dp = None if draft_probs is None or draft_probs.numel() == 0 else draft_probs.to(target_probs)[None]
            out = rejection_sample(target_probs[None], ids, dp, seeds=seeds, is_greedy=is_greedy, backend=self.backend)
        out = out[0]
        n = int((out >= 0).sum())
        emitted = out[:n]
        # Gather the n emitted tokens' probabilities on the device; only n floats come to the host.
        lp = torch.log(target_probs[torch.arange(n, device=dev), emitted].float().clamp_min(1e-38)).cpu()
        return emitted.cpu().tolist(), lp.tolist()


def run_step(inp: StepInputs, proposers: dict, scorer, verifier: Verifier) -> StepResult:
    """Run one speculative step in process.

    Raises:
        KeyError: no proposer for ``inp.method``.
    """
    if inp.num_draft_tokens > 0 and inp.method != "none":
        proposal = proposers[inp.method].propose(inp.seq_id, inp.token_ids, inp.num_draft_tokens, inp.params, inp.step)
    else:
        proposal = Proposal.empty()
    drafts = proposal.draft_token_ids
    probs = scorer.score(inp.seq_id, inp.token_ids, drafts.tolist(), inp.params)
    ids, lps = verifier.verify(probs, drafts, proposal.draft_probs, inp.params.seed, inp.step, inp.params.is_greedy,
                               inp.acceptance_method)
    return StepResult(ids, int(drafts.numel()), lps)
