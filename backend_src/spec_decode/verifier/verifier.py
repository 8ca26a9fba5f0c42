"""The verifier of a round: one sampler call per kind of row (one kernel launch on CUDA), rows of different k padded.

What the ``verifier`` model runs (:mod:`spec_decode.serving.verifier_model`) and the in-process transport calls: the
configured acceptance method (:class:`VerifierSettings`) over :func:`.rejection_sample` and
:func:`.typical_acceptance_sample`, with each row's noise keyed by its own seed and step, and for seeded sampled rows
under rejection sampling :func:`.coupled_sample`, keyed by the seed and the absolute token position only (Daliri et
al. 2024: the output does not depend on the drafts, k or the load). As vLLM's rejection sampler, which takes a whole
batch per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import mix_seed
from ..settings import ConfigSettings, InvalidInputError, check_acceptance_method, in_range
from .rejection import (
    TYPICAL_ALPHA,
    TYPICAL_EPSILON,
    VERIFIER_BACKENDS,
    check_typical_parameters,
    coupled_sample,
    rejection_sample,
    typical_acceptance_sample,
)


@dataclass(frozen=True)
class VerifierSettings(ConfigSettings):
    """The verifier's settings.

    Attributes:
        acceptance_method: the default when a request names none: ``rejection`` (lossless) or ``typical`` (Medusa's
            typical acceptance: accepts more drafts, NOT lossless).
        typical_epsilon: typical acceptance's posterior threshold (epsilon), finite, in [0, float32 max].
        typical_alpha: typical acceptance's posterior alpha (delta), finite, in [0, float32 max].
        backend: ``auto`` (Triton kernels for CUDA tensors, torch on CPU), ``triton``, ``torch``.
        num_threads: torch CPU threads of the verifier process (0 = torch's default; its CPU work is small, so more
            threads only spin against the target's forward on a small machine).
    """

    acceptance_method: str = "rejection"
    typical_epsilon: float = TYPICAL_EPSILON
    typical_alpha: float = TYPICAL_ALPHA
    backend: str = "auto"
    num_threads: int = 1

    def check(self) -> None:
        """acceptance_method and backend among their values, epsilon and alpha finite in [0, float32 max],
        num_threads >= 0."""
        object.__setattr__(self, "acceptance_method", check_acceptance_method("acceptance_method",
                                                                              self.acceptance_method))
        check_typical_parameters(self.typical_epsilon, self.typical_alpha, ("typical_epsilon", "typical_alpha"))
        self._choice("backend", VERIFIER_BACKENDS)
        in_range("num_threads", self.num_threads, 0)


@dataclass(frozen=True)
class VerifierRow:
    """One sequence's share of a round (:meth:`Verifier.verify_batch`), checked at construction.

    Attributes:
        target_probs: [k+1, V] float target distributions after the sampling transforms (any device).
        draft_token_ids: [k] int64.
        draft_probs: [k, V] or None/empty (drafts without probabilities).
        seed: request seed (>= 0); the step's noise is keyed by (seed, step, position).
        step: step counter.
        greedy: temperature 0 (argmax walk, whatever the method).
        method: "rejection", "typical" or "" (the verifier's default), as checked by
            :func:`spec_decode.settings.check_acceptance_method`.
        position: the absolute position of the row's first draft: the number of the sequence's committed token ids
            (>= 0). Keys a seeded row's coupled race.
        seeded: the seed came from the client (:attr:`spec_decode.sampling.SamplingParams.seeded`): a sampled row under
            rejection sampling is then verified by the coupled race (:func:`.coupled_sample`), whose output does not
            depend on the drafts, k or the step (:meth:`Verifier.is_coupled`).

    Raises:
        InvalidInputError: (construction) target_probs that is not [k+1, V] for the k drafts.
    """

    target_probs: torch.Tensor
    draft_token_ids: torch.Tensor
    draft_probs: torch.Tensor | None
    seed: int
    step: int
    greedy: bool
    method: str = ""
    position: int = 0
    seeded: bool = False

    def __post_init__(self):
        tp, drafts = self.target_probs, self.draft_token_ids
        if tp.dim() != 2 or drafts.dim() != 1 or tp.shape[0] != drafts.shape[0] + 1:
            raise InvalidInputError("target_probs", f"must be [k+1, V] for the k = {drafts.shape[0]} drafts, got "
                                                    f"shape {tuple(tp.shape)}")
        if self.position < 0:
            raise InvalidInputError("token_ids", f"a row's position must be >= 0, got {self.position}")

    @property
    def k(self) -> int:
        """The row's draft count."""
        return self.draft_token_ids.shape[0]


class Verifier:
    """Verifies sequences' drafts with the configured acceptance method.

    Args:
        settings: the default acceptance method, typical acceptance's epsilon and alpha, the backend (checked when
            the settings were built).
    """

    def __init__(self, settings: VerifierSettings | None = None):
        self.settings = settings or VerifierSettings()

    def verify(
        self,
        target_probs: torch.Tensor,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        seed: int,
        step: int,
        greedy: bool,
        method: str = "",
        position: int = 0,
        seeded: bool = False,
    ) -> tuple[list[int], list[float]]:
        """Verify one sequence's drafts (:meth:`verify_batch` of one row; arguments as :class:`VerifierRow`).

        Returns:
            (output_ids, log_probs): 1..k+1 emitted token ids and the target log-probability of each.

        Raises:
            ValueError: inconsistent shapes (:class:`VerifierRow`) or invalid probabilities (from the sampler).
        """
        return self.verify_batch([VerifierRow(target_probs, draft_token_ids, draft_probs, seed, step, greedy,
                                              method, position, seeded)])[0]

    def is_coupled(self, row: VerifierRow) -> bool:
        """Whether ``row`` is verified by the coupled race (:func:`.coupled_sample`): seeded, sampled (not greedy)
        and under rejection sampling (its own method, or the verifier's default). Typical acceptance, which is not
        lossless, and greedy rows (the argmax walk) keep their paths; unseeded rows keep rejection sampling, which
        accepts more drafts that come with probabilities."""
        return row.seeded and not row.greedy and (row.method or self.settings.acceptance_method) == "rejection"

    def verify_batch(self, rows: list[VerifierRow]) -> list[tuple[list[int], list[float]]]:
        """Verify a round of sequences: one sampler call (one kernel launch on CUDA) per kind of row.

        Rows are grouped by what the sampler call needs in common (rejection sampling with draft probabilities,
        without them, typical acceptance, or the coupled race of seeded sampled rows under rejection sampling,
        :meth:`is_coupled`; device, dtype, V); a group's rows are padded to its largest k with -1 drafts (a -1 ends a
        row's drafts and its position gets the bonus token, drawn from the row's own last distribution) and zero
        probabilities, so each row's tokens are those it gets alone (its noise is keyed by its own seed and step:
        :func:`spec_decode.verifier.rejection_sample`; a coupled row's by its seed and absolute position only:
        :func:`spec_decode.verifier.rejection.coupled_sample`, one sampler call per position). As vLLM's rejection
        sampler, which takes a whole batch per call.

        Args:
            rows: per sequence, a :class:`VerifierRow`; k may differ between rows.

        Returns:
            per row, (output_ids, log_probs) as :meth:`verify`.

        Raises:
            ValueError: invalid probabilities (the sampler's error fails the whole call).
        """
        results: list = [None] * len(rows)
        groups: dict[tuple, list[int]] = {}  # what a sampler call needs in common -> row indices
        s = self.settings
        for i, row in enumerate(rows):
            tp = row.target_probs
            if self.is_coupled(row):  # the coupled race ignores draft probabilities
                groups.setdefault(("coupled", False, tp.device, tp.dtype, tp.shape[-1]), []).append(i)
                continue
            typical = (row.method or s.acceptance_method) == "typical" and not row.greedy  # greedy: the argmax walk
            with_dp = not typical and row.draft_probs is not None and row.draft_probs.numel() > 0
            groups.setdefault(("typical" if typical else "rejection", with_dp, tp.device, tp.dtype, tp.shape[-1]),
                              []).append(i)
        for (kind, with_dp, dev, dtype, v), idx in groups.items():
            group = [rows[i] for i in idx]
            k = max(row.k for row in group)
            dp: torch.Tensor | None = None
            if len(group) == 1:  # one sequence: its own tensors, no padded copy
                (row,) = group
                tp, ids = row.target_probs[None], row.draft_token_ids.to(device=dev, dtype=torch.int64)[None]
                if with_dp:
                    assert row.draft_probs is not None  # with_dp: it has draft probabilities
                    dp = row.draft_probs.to(device=dev, dtype=dtype)[None]
            else:
                tp = torch.zeros((len(group), k + 1, v), dtype=dtype, device=dev)
                ids = torch.full((len(group), k), -1, dtype=torch.int64, device=dev)
                dp = torch.zeros((len(group), k, v), dtype=dtype, device=dev) if with_dp else None
                for r, row in enumerate(group):
                    tp[r, : row.k + 1] = row.target_probs
                    ids[r, : row.k] = row.draft_token_ids.to(device=dev, dtype=torch.int64)
                    if with_dp:
                        assert dp is not None and row.draft_probs is not None  # with_dp: both exist
                        dp[r, : row.k] = row.draft_probs.to(device=dev, dtype=dtype)
            is_greedy = torch.tensor([bool(row.greedy) for row in group])
            seeds = torch.tensor([mix_seed(row.seed, row.step) for row in group], dtype=torch.int64)
            if kind == "coupled":  # keyed by the request's seed and the absolute position only
                out = coupled_sample(tp, ids, seeds=torch.tensor([row.seed for row in group], dtype=torch.int64),
                                     positions=torch.tensor([row.position for row in group], dtype=torch.int64),
                                     backend=s.backend)
            elif kind == "typical":
                out = typical_acceptance_sample(tp, ids, posterior_threshold=s.typical_epsilon,
                                                posterior_alpha=s.typical_alpha, seeds=seeds, is_greedy=is_greedy,
                                                backend=s.backend)
            else:
                out = rejection_sample(tp, ids, dp, seeds=seeds, is_greedy=is_greedy, backend=s.backend)
            # The emitted tokens' probabilities are gathered on the device; [G, k+1] floats come to the host.
            pos = torch.arange(k + 1, device=dev)[None].expand(len(group), -1)
            lp = torch.log(tp[torch.arange(len(group), device=dev)[:, None], pos, out.clamp_min(0)].float()
                           .clamp_min(1e-38)).cpu()
            out = out.cpu()
            for r, i in enumerate(idx):
                n = int((out[r] >= 0).sum())
                results[i] = (out[r, :n].tolist(), lp[r, :n].tolist())
        return results
