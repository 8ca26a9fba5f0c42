"""The verifier of a round: one sampler call per kind of row (one kernel launch on CUDA), rows of different k padded.

What the ``verifier`` model runs (:mod:`spec_decode.serving.verifier_model`) and the in-process transport calls: the
configured acceptance method (:class:`VerifierSettings`) over :func:`.rejection_sample` and
:func:`.typical_acceptance_sample`, with each row's noise keyed by its own seed and step, and for seeded sampled rows
under rejection sampling :func:`.coupled_sample`, keyed by the seed and the absolute token position only (Daliri et
al. 2024: the output does not depend on the drafts, k or the load). As vLLM's rejection sampler, which takes a whole
batch per call.

Rows whose drafts are a tree (``VerifierRow.draft_parents``, :mod:`spec_decode.tree`) are verified by
:func:`.tree_rejection_sample` / :func:`.tree_typical_sample` (SpecInfer's tree verification, Miao et al. 2024; with
draft probabilities, Recursive Speculative Decoding, Jeon et al. 2024), one call per kind of row; a seeded sampled
tree row under rejection sampling walks the coupled race down its tree (:meth:`Verifier.coupled_tree`), so its tokens
are those of a chain or of no drafts at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import tree
from ..sampling import coupled_seed, mix_seed
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
from .tree_sampler import tree_rejection_sample, tree_typical_sample


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
        target_probs: [k+1, V] float target distributions after the sampling transforms (any device); row 0 follows
            the last committed token, row i+1 draft i (for a tree: draft i's path, :mod:`spec_decode.tree`).
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
        draft_parents: [k] integer, each draft's parent among the drafts (-1: the last committed token;
            :func:`spec_decode.tree.check_tree`), or None: a chain. A chain given explicitly is verified as None is.
        tree_parents: (derived) the checked parents as ints when they are not a chain, else None.

    Raises:
        InvalidInputError: (construction) target_probs that is not [k+1, V] for the k drafts; a negative position;
            draft_parents that is not [k], or not a tree of the drafts (``draft_parents`` named).
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
    draft_parents: torch.Tensor | None = None
    tree_parents: list[int] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        tp, drafts = self.target_probs, self.draft_token_ids
        if tp.dim() != 2 or drafts.dim() != 1 or tp.shape[0] != drafts.shape[0] + 1:
            raise InvalidInputError("target_probs", f"must be [k+1, V] for the k = {drafts.shape[0]} drafts, got "
                                                    f"shape {tuple(tp.shape)}")
        if self.position < 0:
            raise InvalidInputError("token_ids", f"a row's position must be >= 0, got {self.position}")
        parents = self.draft_parents
        if parents is not None:
            if parents.dim() != 1 or parents.dtype.is_floating_point or parents.dtype == torch.bool:
                raise InvalidInputError("draft_parents", f"must be [k] integers, got {parents.dtype} "
                                                         f"{tuple(parents.shape)}")
            checked = tree.check_tree(drafts.tolist(), parents.tolist(), "draft_parents")
            if not tree.is_chain(checked):
                object.__setattr__(self, "tree_parents", checked)

    @property
    def k(self) -> int:
        """The row's draft count."""
        return self.draft_token_ids.shape[0]


def _padded(group: list[VerifierRow], is_tree: bool, with_dp: bool, dev, dtype, v: int):
    """A group's rows as one batch padded to its largest k: (target_probs [G, k+1, V], drafts [G, k] int64 (-1 pad),
    parents [G, k] int64 (-1 pad) or None for chains, draft_probs [G, k, V] or None (zero pad)). One row: its own
    tensors, no padded copy."""
    k = max(row.k for row in group)
    g = len(group)
    par: torch.Tensor | None = None
    if is_tree:
        par = torch.full((g, k), -1, dtype=torch.int64)
        for r, row in enumerate(group):
            assert row.tree_parents is not None  # is_tree: every row of the group is a tree
            par[r, : row.k] = torch.tensor(row.tree_parents, dtype=torch.int64)
        par = par.to(dev)
    dp: torch.Tensor | None = None
    if g == 1:
        (row,) = group
        tp, ids = row.target_probs[None], row.draft_token_ids.to(device=dev, dtype=torch.int64)[None]
        if with_dp:
            assert row.draft_probs is not None  # with_dp: it has draft probabilities
            dp = row.draft_probs.to(device=dev, dtype=dtype)[None]
        return tp, ids, par, dp
    tp = torch.zeros((g, k + 1, v), dtype=dtype, device=dev)
    ids = torch.full((g, k), -1, dtype=torch.int64, device=dev)
    dp = torch.zeros((g, k, v), dtype=dtype, device=dev) if with_dp else None
    for r, row in enumerate(group):
        tp[r, : row.k + 1] = row.target_probs
        ids[r, : row.k] = row.draft_token_ids.to(device=dev, dtype=torch.int64)
        if with_dp:
            assert dp is not None and row.draft_probs is not None  # with_dp: both exist
            dp[r, : row.k] = row.draft_probs.to(device=dev, dtype=dtype)
    return tp, ids, par, dp


def _emitted(tp: torch.Tensor, out: torch.Tensor, rows: torch.Tensor) -> list[tuple[list[int], list[float]]]:
    """Per row of a sampler's output ``out`` [G, n+1] (-1 padded), its ids and their log-probabilities, read from
    ``tp`` [G, n+1, V] at the target rows ``rows`` [G, n+1] that predicted them (gathered on the device; the ids and
    their float32 log-probabilities come to the host in one copy)."""
    g = tp.shape[0]
    lp = torch.log(tp[torch.arange(g, device=tp.device)[:, None], rows, out.clamp_min(0)].float()
                   .clamp_min(1e-38))
    # one copy to the host: ids (exact in float64) beside their log-probabilities
    host = torch.cat([out.double(), lp.double()], dim=1).cpu().tolist()
    n1 = out.shape[1]
    res = []
    for r in range(g):
        ids = [int(x) for x in host[r][:n1] if x >= 0]
        res.append((ids, host[r][n1: n1 + len(ids)]))  # float32 values, exactly
    return res


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
        draft_parents: torch.Tensor | None = None,
    ) -> tuple[list[int], list[float]]:
        """Verify one sequence's drafts (:meth:`verify_batch` of one row; arguments as :class:`VerifierRow`).

        Returns:
            (output_ids, log_probs): 1..k+1 emitted token ids (for a tree, the accepted path's drafts,
            :func:`spec_decode.tree.accepted_nodes`, then one more) and the target log-probability of each.

        Raises:
            ValueError: inconsistent shapes or parents (:class:`VerifierRow`) or invalid probabilities (the sampler).
        """
        return self.verify_batch([VerifierRow(target_probs, draft_token_ids, draft_probs, seed, step, greedy,
                                              method, position, seeded, draft_parents)])[0]

    def is_coupled(self, row: VerifierRow) -> bool:
        """Whether ``row`` is verified by the coupled race (:func:`.coupled_sample`): seeded, sampled (not greedy)
        and under rejection sampling (its own method, or the verifier's default). Typical acceptance, which is not
        lossless, and greedy rows (the argmax walk) keep their paths; unseeded rows keep rejection sampling, which
        accepts more drafts that come with probabilities."""
        return row.seeded and not row.greedy and (row.method or self.settings.acceptance_method) == "rejection"

    def verify_batch(self, rows: list[VerifierRow]) -> list[tuple[list[int], list[float]]]:
        """Verify a round of sequences: one sampler call (one kernel launch on CUDA) per kind of row.

        Rows are grouped by what the sampler call needs in common (chain or tree; rejection sampling with draft
        probabilities, without them, typical acceptance, or the coupled race of seeded sampled rows under rejection
        sampling, :meth:`is_coupled`; device, dtype, V); a group's rows are padded to its largest k with -1 drafts (a
        -1 ends a row's drafts and its position gets the bonus token, drawn from the row's own last distribution),
        -1 parents and zero probabilities, so each row's tokens are those it gets alone (its noise is keyed by its own
        seed and step: :func:`spec_decode.verifier.rejection_sample`; a coupled row's by its seed and absolute
        position only: :func:`spec_decode.verifier.rejection.coupled_sample`, one sampler call per position). Chain
        rows (no ``draft_parents``, or a chain's) go to :func:`.rejection_sample` / :func:`.typical_acceptance_sample`,
        tree rows to :func:`.tree_rejection_sample` / :func:`.tree_typical_sample` (SpecInfer, Miao et al. 2024;
        Recursive Speculative Decoding, Jeon et al. 2024), coupled tree rows to :meth:`coupled_tree`. As vLLM's
        rejection sampler, which takes a whole batch per call.

        Args:
            rows: per sequence, a :class:`VerifierRow`; k may differ between rows.

        Returns:
            per row, (output_ids, log_probs) as :meth:`verify`: a tree row's log-probs come from the target rows of
            its accepted path (:func:`spec_decode.tree.rows_of`), which :func:`spec_decode.tree.accepted_nodes`
            recovers from the ids.

        Raises:
            ValueError: invalid probabilities (the sampler's error fails the whole call).
        """
        results: list = [None] * len(rows)
        groups: dict[tuple, list[int]] = {}  # what a sampler call needs in common -> row indices
        s = self.settings
        for i, row in enumerate(rows):
            tp, is_tree = row.target_probs, row.tree_parents is not None
            if self.is_coupled(row):  # the coupled race ignores draft probabilities
                groups.setdefault((is_tree, "coupled", False, tp.device, tp.dtype, tp.shape[-1]), []).append(i)
                continue
            typical = (row.method or s.acceptance_method) == "typical" and not row.greedy  # greedy: the argmax walk
            with_dp = not typical and row.draft_probs is not None and row.draft_probs.numel() > 0
            groups.setdefault((is_tree, "typical" if typical else "rejection", with_dp, tp.device, tp.dtype,
                               tp.shape[-1]), []).append(i)
        for (is_tree, kind, with_dp, dev, dtype, v), idx in groups.items():
            group = [rows[i] for i in idx]
            if is_tree and kind == "coupled":
                done = self.coupled_tree(group)
            else:
                done = self._sample(group, is_tree, kind, with_dp, dev, dtype, v)
            for i, res in zip(idx, done):
                results[i] = res
        return results

    def _sample(self, group: list[VerifierRow], is_tree: bool, kind: str, with_dp: bool, dev, dtype,
                v: int) -> list[tuple[list[int], list[float]]]:
        """One group of :meth:`verify_batch` (all chains or all trees, one kind) in one sampler call."""
        s = self.settings
        tp, ids, par, dp = _padded(group, is_tree, with_dp, dev, dtype, v)
        is_greedy = torch.tensor([bool(row.greedy) for row in group])
        seeds = torch.tensor([mix_seed(row.seed, row.step) for row in group], dtype=torch.int64)
        k1 = tp.shape[1]
        rows = torch.arange(k1, device=dev)[None].expand(len(group), -1)  # a chain's: rows 0..n
        if kind == "coupled":  # keyed by the request's seed and the absolute position only
            out = coupled_sample(tp, ids, seeds=torch.tensor([row.seed for row in group], dtype=torch.int64),
                                 positions=torch.tensor([row.position for row in group], dtype=torch.int64),
                                 backend=s.backend)
        elif is_tree:
            assert par is not None  # is_tree: _padded gave the parents
            if kind == "typical":
                out, path = tree_typical_sample(tp, ids, par, posterior_threshold=s.typical_epsilon,
                                                posterior_alpha=s.typical_alpha, seeds=seeds, is_greedy=is_greedy,
                                                backend=s.backend)
            else:
                out, path = tree_rejection_sample(tp, ids, par, dp, seeds=seeds, is_greedy=is_greedy,
                                                  backend=s.backend)
            # the accepted path's rows (tree.rows_of): row 0, then node + 1; a -1 pad reads row 0, never used
            rows = torch.cat([torch.zeros_like(path[:, :1]), path + 1], 1).to(dev)
        elif kind == "typical":
            out = typical_acceptance_sample(tp, ids, posterior_threshold=s.typical_epsilon,
                                            posterior_alpha=s.typical_alpha, seeds=seeds, is_greedy=is_greedy,
                                            backend=s.backend)
        else:
            out = rejection_sample(tp, ids, dp, seeds=seeds, is_greedy=is_greedy, backend=s.backend)
        return _emitted(tp, out, rows)

    def coupled_tree(self, group: list[VerifierRow]) -> list[tuple[list[int], list[float]]]:
        """Coupled tree rows (seeded, sampled, rejection; Daliri et al. 2024): walk down each row's tree with the
        coupled race. At depth d (0-based) the target's token is t_d, the race of the current node's row keyed by
        (seed, position + d) exactly as :func:`.coupled_sample` keys draft position d (:func:`.rejection_sample`
        with k = 0 and :func:`spec_decode.sampling.coupled_seed`, one call per depth for the rows still walking);
        the walk descends to the child whose token is t_d, else emits t_d and stops. A seeded row's tokens are hence
        those of a chain, or of no drafts, whatever its tree.

        Args:
            group: tree rows on one device, of one dtype and V.

        Returns:
            per row, (ids, log-probs) as :meth:`verify_batch`.

        Raises:
            ValueError: as :func:`.rejection_sample` (invalid probabilities, a zero row raced).
        """
        kids = [tree.children(tree.chain_parents(row.k) if row.tree_parents is None else row.tree_parents)
                for row in group]
        drafts = [row.draft_token_ids.tolist() for row in group]
        out: list[tuple[list[int], list[float]]] = [([], []) for _ in group]
        cur = [tree.ROOT] * len(group)  # each row's current node (its last accepted draft)
        live, depth = list(range(len(group))), 0
        while live:
            tp = torch.stack([group[r].target_probs[cur[r] + 1] for r in live])[:, None]  # [m, 1, V]
            seeds = torch.tensor([coupled_seed(group[r].seed, group[r].position + depth) for r in live],
                                 dtype=torch.int64)
            tokens = rejection_sample(tp, torch.empty((len(live), 0), dtype=torch.int64, device=tp.device), None,
                                      seeds=seeds, backend=self.settings.backend)[:, 0]
            lps = torch.log(tp[torch.arange(len(live), device=tp.device), 0, tokens].float().clamp_min(1e-38))
            nxt = []
            for r, t, lp in zip(live, tokens.cpu().tolist(), lps.cpu().tolist()):
                out[r][0].append(t)
                out[r][1].append(lp)
                child = next((c for c in kids[r][cur[r] + 1] if drafts[r][c] == t), None)
                if child is not None:
                    cur[r] = child
                    nxt.append(r)
            live, depth = nxt, depth + 1
        return out
