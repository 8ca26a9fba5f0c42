"""The verifier's maths in torch (CPU path, and the reference the Triton kernels are tested against).

Both samplers take their randomness as explicit noise tensors, so the kernels (which draw the same kind of noise from
Philox in-kernel, or read it from tensors in tests) can be checked for exact agreement:

- ``uniform`` [B, k] float32 in [0, 1): the accept test of draft i is ``u[b, i] < min(1, p / q)``.
- ``exponential`` [B, V] float32 > 0: a token is drawn from a distribution d by the exponential race
  ``argmax(d / E)`` (equivalent to sampling from normalize(d); gpt-fast, vLLM). One race per row suffices, since only
  one position of a row is ever sampled and the noise is independent of the accept decisions.

Every comparison is done in float32, as in the kernels.
"""

from __future__ import annotations

import torch


def _first_rejection(ok: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B] int64 number of leading True values (accepted drafts)."""
    return torch.cumprod(ok.to(torch.int64), dim=-1).sum(-1) if ok.shape[-1] else ok.new_zeros(ok.shape[0], dtype=torch.int64)


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


def rejection_torch(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniform: torch.Tensor,
    exponential: torch.Tensor,
    is_greedy: torch.Tensor,
) -> torch.Tensor:
    """Rejection sampling with explicit noise (Leviathan et al. 2023; vLLM ``RejectionSampler``).

    Args:
        target_probs: [B, k+1, V] float. draft_token_ids: [B, k] int64 (-1 = placeholder, rejected).
        draft_probs: [B, k, V] or None (q one-hot at the draft token).
        uniform: [B, k] float32. exponential: [B, V] float32 > 0. is_greedy: [B] bool.

    Returns:
        [B, k+1] int64: accepted drafts, the recovered or bonus token, -1 padding.
    """
    tp = target_probs.float()
    b, k1, v = tp.shape
    k = k1 - 1
    ids = draft_token_ids
    safe = ids.clamp_min(0)
    p_x = tp[:, :k].gather(-1, safe[..., None])[..., 0]  # [B, k]
    if draft_probs is not None:
        q_x = draft_probs.float().gather(-1, safe[..., None])[..., 0]
    else:
        q_x = torch.ones_like(p_x)
    ok_random = (q_x <= 0) | (uniform < torch.clamp(p_x / q_x, max=1.0))
    ok_greedy = ids == tp[:, :k].argmax(-1)
    ok = (ids >= 0) & torch.where(is_greedy[:, None], ok_greedy, ok_random)
    n = _first_rejection(ok)  # [B]

    p_n = _row_at(tp, n)  # [B, V]
    has_draft = n < k
    last = n.clamp(max=max(k - 1, 0))
    if draft_probs is not None and k:
        q_n = _row_at(draft_probs.float(), last) * has_draft[:, None]
        residual = torch.clamp(p_n - q_n, min=0.0)
    else:
        residual = p_n.clone()
        if k:
            x_n = torch.where(has_draft, ids.gather(1, last[:, None])[:, 0], torch.full_like(n, -1))
            zero = (torch.arange(v, device=tp.device)[None, :] == x_n[:, None])
            residual = residual.masked_fill(zero, 0.0)
    token_residual = torch.argmax(residual / exponential, dim=-1)
    token_target = torch.argmax(p_n / exponential, dim=-1)  # p == q: the residual is empty, sample p (never NaN)
    token = torch.where(residual.sum(-1) > 0, token_residual, token_target)
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

    Accept x_i when p(x_i) > min(epsilon, alpha * exp(-H(p_i))); at the first rejection emit argmax(p_i); if all pass,
    the bonus token is drawn from target_probs[k] by the exponential race (argmax for greedy rows).

    Returns:
        [B, k+1] int64 like :func:`rejection_torch`.
    """
    tp = target_probs.float()
    b, k1, v = tp.shape
    k = k1 - 1
    ids = draft_token_ids
    safe = ids.clamp_min(0)
    p = tp[:, :k]
    entropy = -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum(-1)  # [B, k]
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
    p_x = p.gather(-1, safe[..., None])[..., 0]
    ok = (ids >= 0) & (p_x > threshold)
    n = _first_rejection(ok)
    p_n = _row_at(tp, n)
    sampled = torch.argmax(p_n / exponential, dim=-1)
    token = torch.where((n < k) | is_greedy, p_n.argmax(-1), sampled)
    return _assemble(ids, n, token)
