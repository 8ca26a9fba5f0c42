"""Public tree verification API: drafts that form a tree (:mod:`spec_decode.tree`), verified in one call, on Triton
kernels (CUDA, :mod:`.tree_kernels`) or torch (CPU, :mod:`.tree_torch`).

A row's n drafts are nodes: ``draft_token_ids[b, i]`` (-1: a padding node, ignored wherever it sits) and
``draft_parents[b, i]`` in [-1, i) (-1: a child of the last committed token), siblings with distinct tokens; row 0
of ``target_probs`` follows the last committed token and row i + 1 follows node i. :func:`tree_rejection_sample` is
SpecInfer's multi-step speculative sampling (Miao et al. 2024, "SpecInfer: Accelerating Large Language Model Serving
with Tree-based Speculative Inference and Verification") with siblings drawn without replacement as in Recursive
Speculative Decoding (Jeon et al. 2024, "Recursive Speculative Decoding: Accelerating LLM Inference via Sampling
Without Replacement"): lossless. :func:`tree_typical_sample` is Medusa's tree with typical acceptance (Cai et al.
2024): NOT lossless. On a chain (parents [-1, 0, 1, ...]) both give exactly what :func:`~.rejection.rejection_sample`
and :func:`~.rejection.typical_acceptance_sample` give for the same seeds, on either backend.
"""

from __future__ import annotations

import torch

from .rejection import (
    TYPICAL_ALPHA,
    TYPICAL_EPSILON,
    _resolve_backend,
    _row_flags,
    _torch_noise,
    check_typical_parameters,
    validate_inputs,
)
from .tree_torch import tree_rejection_torch, tree_typical_torch


def _rows(mask: torch.Tensor) -> list[int]:
    return torch.nonzero(mask).reshape(-1).tolist()


def validate_tree(draft_token_ids: torch.Tensor, draft_parents: torch.Tensor) -> None:
    """Check ``draft_parents`` against ``draft_token_ids`` (already checked by
    :func:`~.rejection.validate_inputs`): an int64 [B, n] tensor on the same device; each real node's (id >= 0)
    parent in [-1, i) and a real node; siblings (real nodes of one parent) with distinct tokens. Padding nodes' parents
    are not read. One host sync.

    Raises:
        ValueError: naming ``draft_parents`` and what is allowed.
    """
    if not isinstance(draft_parents, torch.Tensor):
        raise ValueError(f"draft_parents must be a [B, n] int64 tensor, got {type(draft_parents).__name__}")
    if tuple(draft_parents.shape) != tuple(draft_token_ids.shape):
        raise ValueError(f"draft_parents must be [B, n] = {list(draft_token_ids.shape)}, "
                         f"got shape {tuple(draft_parents.shape)}")
    if draft_parents.dtype != torch.int64:
        raise ValueError(f"draft_parents dtype must be int64, got {draft_parents.dtype}")
    if draft_parents.device != draft_token_ids.device:
        raise ValueError(f"draft_parents is on {draft_parents.device}, draft_token_ids on {draft_token_ids.device}")
    b, n = draft_token_ids.shape
    if not n:
        return
    real = draft_token_ids >= 0
    node = torch.arange(n, device=draft_parents.device)[None, :]
    par = draft_parents
    in_range = (par >= -1) & (par < node)
    parent_real = torch.where(par >= 0, real.gather(1, par.clamp(0, n - 1)), True)
    # siblings: real nodes with equal (parent, token) keys; padding nodes get distinct negative keys
    v = int(draft_token_ids.max()) + 1
    keys = torch.where(real & in_range, (par + 1) * v + draft_token_ids, -1 - node.expand(b, n))
    keys = keys.sort(-1).values
    repeated = ((keys[:, 1:] == keys[:, :-1]) & (keys[:, 1:] >= 0)).any(-1)
    bad_range = (real & ~in_range).any(-1)
    bad_parent = (real & in_range & ~parent_real).any(-1)
    if bool((bad_range | bad_parent | repeated).any()):
        if bool(bad_range.any()):
            raise ValueError(f"draft_parents: each real node i's parent must lie in [-1, i) (parents come first); "
                             f"batch rows {_rows(bad_range)}")
        if bool(bad_parent.any()):
            raise ValueError(f"draft_parents: a real node's parent must be a real node (draft id >= 0), not a "
                             f"padding node; batch rows {_rows(bad_parent)}")
        raise ValueError(f"draft_parents: siblings (real nodes of one parent) must carry distinct tokens; "
                         f"batch rows {_rows(repeated)}")


def _tree_noise(seeds: torch.Tensor, greedy: torch.Tensor, draft_token_ids: torch.Tensor,
                v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row noise keyed by (row seed, purpose), as :func:`~.rejection._torch_noise`: uniform [B, n] (a row draws
    one per node up to its last real node, so a row padded with -1 nodes at its end draws what it draws alone, and a
    chain draws what the chain sampler draws), exponential [B, V] (CPU). Greedy rows get zeros and ones (unused)."""
    n = draft_token_ids.shape[1]
    real = (draft_token_ids >= 0).cpu()
    last = torch.where(real, torch.arange(1, n + 1), 0).amax(-1).tolist() if n else [0] * len(real)
    return _torch_noise(seeds, greedy, draft_token_ids, v, last)


def tree_rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_parents: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    seeds: torch.Tensor | None = None,
    is_greedy: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a tree of drafts by multi-step speculative sampling (lossless; SpecInfer, RSD).

    Walking down from the root, the children of the current node are tested in index order against the current
    residual; the first accepted child becomes the current node; when none is accepted, the recovered token is drawn
    from the residual left by the rejected children (the bonus token from the node's own distribution when it has no
    real child). The rules, and the boundary rules shared with the chain, are those of
    :func:`~.tree_torch.tree_rejection_torch` and :func:`~.rejection.rejection_sample` (q(x) = 0 rejects; p(x) = 0 is
    never accepted nor emitted; an empty residual falls back to p; greedy rows follow the argmax down the tree).

    The output follows the target's law when each node's real children are distinct draws without replacement from
    ``draft_probs`` at those children (all siblings carry their shared draft distribution), or are fixed tokens when
    ``draft_probs`` is None (q one-hot: n-gram and suffix trees).

    Args:
        target_probs: [B, n+1, V] float32 (bfloat16/float16 accepted): row 0 follows the last committed token, row
            i + 1 follows node i.
        draft_token_ids: [B, n] int64 in [0, V), or -1 for a padding node (ignored).
        draft_parents: [B, n] int64: node i's parent in [-1, i) (-1: the root), a real node; siblings distinct.
        draft_probs: [B, n, V] like ``target_probs``, or None (q one-hot at each node's token).
        seeds: None or int64 [B]; a row with seed >= 0 draws its noise from (seed, purpose) only: reproducible,
            independent of the rest of the batch and of padding nodes after its last real node; -1 = unseeded.
        is_greedy: None or bool [B]: greedy rows accept a child iff it is the argmax, then emit the argmax.
        backend: "auto" (Triton for CUDA tensors, torch for CPU), "triton" (on CPU only under TRITON_INTERPRET=1)
            or "torch". The Triton path draws Philox noise keyed as the chain kernels' (node i: offset i).

    Returns:
        (out [B, n+1] int64: the accepted path's tokens, then the recovered or bonus token, then -1;
        path [B, n] int64: the accepted node indices in order, then -1), on the input device.

    Raises:
        ValueError: as :func:`~.rejection.rejection_sample` (shapes, dtypes, devices, ids, backend, invalid or
            all-zero probabilities), and ``draft_parents`` that is not a valid tree (:func:`validate_tree`).
    """
    validate_inputs(target_probs, draft_token_ids, draft_probs)
    validate_tree(draft_token_ids, draft_parents)
    b, _, v = target_probs.shape
    which = _resolve_backend(backend, target_probs.device)
    seeds, greedy = _row_flags(b, seeds, is_greedy, target_probs.device)
    if which == "triton":
        from .tree_kernels import tree_rejection_triton

        return tree_rejection_triton(target_probs, draft_token_ids, draft_parents, draft_probs, seeds, greedy)
    u, e = _tree_noise(seeds, greedy, draft_token_ids, v)
    dev = target_probs.device
    return tree_rejection_torch(target_probs, draft_token_ids, draft_parents, draft_probs, u.to(dev), e.to(dev),
                                greedy)


def tree_typical_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_parents: torch.Tensor,
    *,
    posterior_threshold: float = TYPICAL_EPSILON,
    posterior_alpha: float = TYPICAL_ALPHA,
    seeds: torch.Tensor | None = None,
    is_greedy: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Typical acceptance on a tree (Medusa, Cai et al. 2024; NOT lossless): every node is tested against its
    parent's distribution with :func:`~.rejection.typical_acceptance_sample`'s rule (and its boundary rules); the
    accepted path ends at the deepest node whose whole path passes (ties: the lowest index); then argmax p(end) if
    the end node has a real child, else a bonus token drawn from p(end) (argmax for greedy rows). See
    :func:`~.tree_torch.tree_typical_torch`.

    Args:
        target_probs, draft_token_ids, draft_parents, seeds, is_greedy, backend: as :func:`tree_rejection_sample`.
        posterior_threshold: epsilon >= 0. posterior_alpha: alpha >= 0.

    Returns:
        (out [B, n+1] int64, path [B, n] int64) as :func:`tree_rejection_sample`.

    Raises:
        ValueError: as :func:`tree_rejection_sample`, and epsilon or alpha outside finite float32 values >= 0.
    """
    check_typical_parameters(posterior_threshold, posterior_alpha)
    validate_inputs(target_probs, draft_token_ids, None)
    validate_tree(draft_token_ids, draft_parents)
    b, _, v = target_probs.shape
    which = _resolve_backend(backend, target_probs.device)
    seeds, greedy = _row_flags(b, seeds, is_greedy, target_probs.device)
    if which == "triton":
        from .tree_kernels import tree_typical_triton

        return tree_typical_triton(target_probs, draft_token_ids, draft_parents, posterior_threshold,
                                   posterior_alpha, seeds, greedy)
    _, e = _tree_noise(seeds, greedy, draft_token_ids[:, :0], v)
    return tree_typical_torch(target_probs, draft_token_ids, draft_parents, posterior_threshold, posterior_alpha,
                              e.to(target_probs.device), greedy)


__all__ = ["tree_rejection_sample", "tree_typical_sample", "validate_tree"]
