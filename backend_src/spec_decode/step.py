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
            raise ValueError(
                f"acceptance_method={self.acceptance_method!r}: allowed values are {', '.join(ACCEPTANCE_METHODS)}"
            )
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
        """Verify one sequence's drafts (:meth:`verify_batch` of one row).

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
        return self.verify_batch([(target_probs, draft_token_ids, draft_probs, seed, step, greedy, method)])[0]

    def verify_batch(self, rows: list[tuple]) -> list[tuple[list[int], list[float]]]:
        """Verify a round of sequences: one sampler call (one kernel launch on CUDA) per kind of row.

        Rows are grouped by what the sampler call needs in common (rejection sampling with draft probabilities,
        without them, or typical acceptance; device, dtype, V); a group's rows are padded to its largest k with -1
        drafts (a -1 ends a row's drafts and its position gets the bonus token, drawn from the row's own last
        distribution) and zero probabilities, so each row's tokens are those it gets alone (its noise is keyed by its
        own seed and step: :func:`spec_decode.verifier.rejection_sample`). As vLLM's rejection sampler, which takes a
        whole batch per call.

        Args:
            rows: per sequence, (target_probs [k+1, V], draft_token_ids [k], draft_probs [k, V] or None or empty,
                seed, step, greedy, method) as the arguments of :meth:`verify`; k may differ between rows.

        Returns:
            per row, (output_ids, log_probs) as :meth:`verify`.

        Raises:
            ValueError: an unknown method in any row, inconsistent shapes or invalid probabilities (the sampler's
                error fails the whole call).
        """
        results: list = [None] * len(rows)
        groups: dict[tuple, list[int]] = {}
        for i, (tp, drafts, dp, _, _, greedy, method) in enumerate(rows):
            method = method or self.acceptance_method
            if method not in ACCEPTANCE_METHODS:
                raise ValueError(f"acceptance_method={method!r}: allowed values are {', '.join(ACCEPTANCE_METHODS)}")
            if tp.dim() != 2 or tuple(drafts.shape) != (tp.shape[0] - 1,):
                raise ValueError(f"target_probs [k+1, V] and draft_token_ids [k] disagree: {tuple(tp.shape)} and "
                                 f"{tuple(drafts.shape)}")
            typical = method == "typical" and not greedy  # at temperature 0 both methods are the exact argmax walk
            with_dp = not typical and dp is not None and dp.numel() > 0
            groups.setdefault((typical, with_dp, tp.device, tp.dtype, tp.shape[-1]), []).append(i)
        for (typical, with_dp, dev, dtype, v), idx in groups.items():
            k = max(rows[i][1].shape[0] for i in idx)
            if len(idx) == 1:  # one sequence: its own tensors, no padded copy
                t, d, q = rows[idx[0]][:3]
                tp, ids = t[None], d.to(device=dev, dtype=torch.int64)[None]
                dp = q.to(device=dev, dtype=dtype)[None] if with_dp else None
            else:
                tp = torch.zeros((len(idx), k + 1, v), dtype=dtype, device=dev)
                ids = torch.full((len(idx), k), -1, dtype=torch.int64, device=dev)
                dp = torch.zeros((len(idx), k, v), dtype=dtype, device=dev) if with_dp else None
                for r, i in enumerate(idx):
                    t, d, q = rows[i][:3]
                    tp[r, : t.shape[0]] = t
                    ids[r, : d.shape[0]] = d.to(device=dev, dtype=torch.int64)
                    if with_dp:
                        dp[r, : q.shape[0]] = q.to(device=dev, dtype=dtype)
            seeds = torch.tensor([mix_seed(rows[i][3], rows[i][4]) for i in idx], dtype=torch.int64)
            is_greedy = torch.tensor([bool(rows[i][5]) for i in idx])
            if typical:
                out = typical_acceptance_sample(tp, ids, posterior_threshold=self.typical_epsilon,
                                                posterior_alpha=self.typical_alpha, seeds=seeds, is_greedy=is_greedy,
                                                backend=self.backend)
            else:
                out = rejection_sample(tp, ids, dp, seeds=seeds, is_greedy=is_greedy, backend=self.backend)
            # The emitted tokens' probabilities are gathered on the device; [G, k+1] floats come to the host.
            pos = torch.arange(k + 1, device=dev)[None].expand(len(idx), -1)
            lp = torch.log(tp[torch.arange(len(idx), device=dev)[:, None], pos, out.clamp_min(0)].float()
                           .clamp_min(1e-38)).cpu()
            out = out.cpu()
            for r, i in enumerate(idx):
                n = int((out[r] >= 0).sum())
                results[i] = (out[r, :n].tolist(), lp[r, :n].tolist())
        return results


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
