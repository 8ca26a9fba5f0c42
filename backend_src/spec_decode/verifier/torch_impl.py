"""The verifier's maths in torch (CPU path, and the reference the Triton kernels are tested against).

Both samplers take their randomness as explicit noise tensors, so the kernels (which draw the same kind of noise from
Philox in-kernel, or read it from tensors in tests) can be checked for exact agreement:

- ``uniform`` [B, k] float32 in [0, 1): draft i is accepted with probability min(1, p / q), tested without a
  division as ``q > 0 and (p >= q or u[b, i] * q < p)`` (so p == q accepts for every u < 1, bit for bit on every
  device).
- ``exponential`` [B, V] float32 > 0: a token is drawn from a distribution d by the exponential race
  ``argmax(d / E)`` (equivalent to sampling from normalize(d); gpt-fast, vLLM). One race per row suffices, since only
  one position of a row is ever sampled and the noise is independent of the accept decisions.

Every comparison is done in float32, as in the kernels.
"""

from __future__ import annotations

import torch

from .checks import check_probabilities, check_sampled_rows

# Typical acceptance decides p(x) > threshold in float32 unless p(x) lies within NEAR_TIE (relative) of it, far above
# the float32 threshold's rounding error (different summation orders on the two paths); there it recomputes H and the
# threshold in float64, where a p(x) above the threshold by less than TIE of it counts as a tie and is rejected: below
# float32's resolution, so only exact ties (a uniform target with alpha = 1) are affected, and both paths decide alike.
NEAR_TIE = 2.0**-10
TIE = 2.0**-28


def as_float32(x: float) -> float:
    """x rounded to float32: how typical acceptance's epsilon and alpha are used on both paths (a compiled kernel
    receives a Python float as fp32; the interpreter would keep all 64 bits, so the launcher rounds first)."""
    return float(torch.tensor(x, dtype=torch.float32))


def _neg_entropy(p: torch.Tensor) -> torch.Tensor:
    """sum(p log p) over the last dimension (0 log 0 = 0), in p's dtype."""
    return torch.where(p > 0, p * torch.log(torch.where(p > 0, p, 1.0)), 0.0).sum(-1)


def _first_rejection(ok: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B] int64 number of leading True values (accepted drafts)."""
    return (torch.cumprod(ok.to(torch.int64), dim=-1).sum(-1) if ok.shape[-1]
            else ok.new_zeros(ok.shape[0], dtype=torch.int64))


def _assemble(draft_token_ids: torch.Tensor, n: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """[B, k+1] int64: drafts before n, ``token`` at n, -1 after."""
    b, k = draft_token_ids.shape
    pos = torch.arange(k + 1, device=n.device)[None, :]
    drafts = torch.cat([draft_token_ids, draft_token_ids.new_full((b, 1), -1)], dim=1)
    out = torch.where(pos < n[:, None], drafts, torch.full_like(drafts, -1))
    return torch.where(pos == n[:, None], token[:, None], out)


def _row_at(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, T, V], idx [B] -> x[b, idx[b]] as [B, V]."""
    return x[torch.arange(x.shape[0], device=x.device), idx]


def _greedy_accepts(p: torch.Tensor, ids: torch.Tensor, p_x: torch.Tensor) -> torch.Tensor:
    """[B, k] bool: x_i is the argmax of p_i [B, k, V] (lowest index on ties) and p(x_i) = p_x > 0."""
    return (ids == p.argmax(-1)) & (p_x > 0)


def _race(d: torch.Tensor, exponential: torch.Tensor) -> torch.Tensor:
    """[B] int64: a draw from normalize(d) for each row of d [B, V] >= 0 by the exponential race argmax(d / E).

    Entries with d == 0 rank below every other entry, so a zero-probability token never wins, even when every d / E
    of a row underflows to 0 (then that row is raced again with its zero entries at -1, as the kernels score them)."""
    score = d / exponential
    best, token = score.max(dim=-1)  # ties: the lowest index, as torch.argmax and the kernels
    if bool((best > 0).all()):  # each winner has d > 0
        return token
    return torch.argmax(torch.where(d > 0, score, torch.full_like(score, -1.0)), dim=-1)


def _draft_at(draft_token_ids: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """[B] int64: the draft id at position n of each row, -1 where n == k (the bonus position)."""
    k = draft_token_ids.shape[1]
    if k == 0:
        return torch.full_like(n, -1)
    x = draft_token_ids.gather(1, n.clamp(max=k - 1)[:, None])[:, 0]
    return torch.where(n < k, x, torch.full_like(n, -1))


def rejection_torch(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniform: torch.Tensor,
    exponential: torch.Tensor,
    is_greedy: torch.Tensor,
) -> torch.Tensor:
    """Rejection sampling with explicit noise (Leviathan et al. 2023; vLLM ``RejectionSampler``).

    The accept test and the recovered/bonus draw follow the boundary rules listed in
    :func:`spec_decode.verifier.rejection.rejection_sample` (q(x) = 0 rejects; ``u * q < p`` or ``p >= q`` accepts;
    a placeholder's token is a bonus token; an empty residual falls back to p; zero-probability tokens never win).

    Args:
        target_probs: [B, k+1, V] float. draft_token_ids: [B, k] int64 (-1 = placeholder, rejected).
        draft_probs: [B, k, V] or None (q one-hot at the draft token).
        uniform: [B, k] float32 in [0, 1). exponential: [B, V] float32 > 0. is_greedy: [B] bool.

    Returns:
        [B, k+1] int64: accepted drafts, the recovered or bonus token, -1 padding.

    Raises:
        ValueError: NaN, infinite or negative probabilities; a sampled target row that sums to zero
            (:mod:`spec_decode.verifier.checks`).
    """
    check_probabilities("target_probs", target_probs)
    check_probabilities("draft_probs", draft_probs)
    tp = target_probs.float()
    b, k1, v = tp.shape
    k = k1 - 1
    ids = draft_token_ids
    safe = ids.clamp_min(0)
    p_x = tp[:, :k].gather(-1, safe[..., None])[..., 0]  # [B, k]
    if draft_probs is not None:
        q_x = draft_probs.float().gather(-1, safe[..., None])[..., 0]
        # Accept with probability min(1, p/q); q = 0 rejects (vLLM); no division, so p == q accepts for every u < 1.
        ok_random = (q_x > 0) & ((p_x >= q_x) | (uniform * q_x < p_x))
    else:
        ok_random = uniform < p_x  # q one-hot at the draft token: accept with probability p(x)
    ok = (ids >= 0) & torch.where(is_greedy[:, None], _greedy_accepts(tp[:, :k], ids, p_x), ok_random)
    n = _first_rejection(ok)  # [B]

    p_n = _row_at(tp, n)  # [B, V]
    check_sampled_rows(p_n)
    if bool(is_greedy.all()):  # greedy rows emit the argmax: no residual, no race
        return _assemble(ids, n, p_n.argmax(-1))
    x_n = _draft_at(ids, n)  # the rejected draft, or -1 at the bonus position or a placeholder
    has_draft = x_n >= 0
    if draft_probs is not None and k:
        q_n = _row_at(draft_probs.float(), n.clamp(max=k - 1)) * has_draft[:, None]
        residual = torch.clamp(p_n - q_n, min=0.0)
    else:
        residual = p_n.masked_fill(torch.arange(v, device=tp.device)[None, :] == x_n[:, None], 0.0)
    # An empty residual (p <= q everywhere: rejection had probability zero) falls back to p itself: never NaN.
    empty = residual.sum(-1) <= 0
    if bool(empty.any()):
        residual = torch.where(empty[:, None], p_n, residual)
    token = _race(residual, exponential)
    token = torch.where(is_greedy, p_n.argmax(-1), token)
    return _assemble(ids, n, token)


def typical_torch(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    posterior_threshold: float,
    posterior_alpha: float,
    exponential: torch.Tensor,
    is_greedy: torch.Tensor,
) -> torch.Tensor:
    """Typical acceptance with explicit noise (Medusa, Cai et al. 2024; vLLM ``TypicalAcceptanceSampler``).

    Accept x_i when p(x_i) > min(epsilon, alpha * exp(-H(p_i))) (strict: p(x_i) = 0 is never accepted; decided in
    float64 near the threshold, exact ties rejected: :data:`NEAR_TIE`, :data:`TIE`); greedy rows accept while x_i is
    the argmax. At the first rejected draft emit argmax(p_i); at the bonus position (or a -1 placeholder, which ends
    the row's drafts) draw from p by the exponential race (argmax for greedy rows).

    Returns:
        [B, k+1] int64 like :func:`rejection_torch`.

    Raises:
        ValueError: NaN, infinite or negative probabilities; a sampled target row that sums to zero.
    """
    check_probabilities("target_probs", target_probs)
    tp = target_probs.float()
    b, k1, v = tp.shape
    k = k1 - 1
    ids = draft_token_ids
    safe = ids.clamp_min(0)
    p = tp[:, :k]
    eps, alpha = as_float32(posterior_threshold), as_float32(posterior_alpha)
    p_x = p.gather(-1, safe[..., None])[..., 0]
    threshold = torch.clamp(alpha * torch.exp(_neg_entropy(p)), max=eps)  # [B, k] float32
    above = p_x > threshold
    near = (p_x - threshold).abs() <= threshold * NEAR_TIE
    if bool(near.any()):  # rare: decide these in float64, where only exact ties remain (as the kernel does)
        t64 = torch.clamp(alpha * torch.exp(_neg_entropy(p[near].double())), max=eps)
        above[near] = (p_x[near].double() - t64) > t64 * TIE
    ok = (ids >= 0) & torch.where(is_greedy[:, None], _greedy_accepts(p, ids, p_x), above)
    n = _first_rejection(ok)
    p_n = _row_at(tp, n)
    check_sampled_rows(p_n)
    rejected_draft = _draft_at(ids, n) >= 0
    token = torch.where(rejected_draft | is_greedy, p_n.argmax(-1), _race(p_n, exponential))
    return _assemble(ids, n, token)
