"""One speculative step: draft -> target -> verifier (gpt-fast ``speculative_decode``, vLLM ``SpecDecodeWorker``).

:func:`verify_step` is what the ``verifier`` Triton model runs; :func:`run_step` composes the three roles in process.
"""

from __future__ import annotations

import torch

from .loop import StepInputs, StepResult
from .proposers import Proposal
from .sampling import mix_seed


def verify_step(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    seed: int,
    step: int,
    greedy: bool,
    verify=None,
) -> tuple[list[int], list[float]]:
    """Verify one sequence's drafts.

    Args:
        target_probs: [k+1, V] float target distributions after the sampling transforms.
        draft_token_ids: [k] int64.
        draft_probs: [k, V] or None (drafts without probabilities).
        seed: request seed (>= 0); the step's noise is keyed by (seed, step, position).
        step: step counter.
        greedy: temperature 0.
        verify: the batched sampler, default :func:`spec_decode.verifier.rejection_sample`.

    Returns:
        (output_ids, log_probs): 1..k+1 emitted token ids and the target log-probability of each.

    Raises:
        ValueError: inconsistent shapes or invalid probabilities (from the sampler).
    """
    if verify is None:
        from .verifier import rejection_sample as verify
    k = int(draft_token_ids.shape[0])
    dp = None if draft_probs is None or draft_probs.numel() == 0 else draft_probs.to(target_probs)[None]
    out = verify(
        target_probs[None],
        draft_token_ids.to(torch.int64).reshape(1, k).to(target_probs.device),
        dp,
        seeds=torch.tensor([mix_seed(seed, step)], dtype=torch.int64),
        is_greedy=torch.tensor([greedy]),
    )[0].cpu()
    n = int((out >= 0).sum())
    ids = out[:n]
    # Gather the n emitted tokens' probabilities on the device; only n floats come to the host.
    rows = torch.arange(n, device=target_probs.device)
    lp = torch.log(target_probs[rows, ids.to(target_probs.device)].float().clamp_min(1e-38)).cpu()
    return ids.tolist(), lp.tolist()


def run_step(inp: StepInputs, proposers: dict, scorer, verify=None) -> StepResult:
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
    ids, lps = verify_step(probs, drafts, proposal.draft_probs, inp.params.seed, inp.step, inp.params.is_greedy, verify)
    return StepResult(ids, int(drafts.numel()), lps)
