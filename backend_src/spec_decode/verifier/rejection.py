"""Public verifier API: rejection sampling and typical acceptance, on Triton kernels (CUDA) or torch (CPU).

Rejection sampling follows Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding"), Chen et
al. 2023 and vLLM's ``RejectionSampler``: draft x_i is accepted when u_i < min(1, p(x_i) / q(x_i)); at the first
rejection a recovered token is drawn from normalize(max(0, p_i - q_i)); when all k drafts are accepted a bonus token is
drawn from target_probs[k]. The output distribution equals the target's exactly. Typical acceptance follows Medusa
(Cai et al. 2024) and vLLM's ``TypicalAcceptanceSampler``; it is faster and NOT lossless.
"""

from __future__ import annotations

import os

import torch

from ..sampling import generator_for
from .torch_impl import rejection_torch, typical_torch

_UNIFORM, _RACE = 1, 2  # noise purposes mixed into a seeded row's generator seed


def validate_inputs(
    target_probs: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, check_values: bool
) -> None:
    """Check shapes, dtypes, devices, token-id range and (optionally) NaN/negative probabilities.

    Raises:
        ValueError: naming the offending argument and what is allowed.
    """
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3:
        raise ValueError(f"target_probs must be a [B, k+1, V] tensor, got shape {tuple(getattr(target_probs, 'shape', ()))}")
    if target_probs.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"target_probs dtype must be float32, float16 or bfloat16, got {target_probs.dtype}")
    b, k1, v = target_probs.shape
    if k1 < 1 or v < 1:
        raise ValueError(f"target_probs must have k+1 >= 1 positions and V >= 1 tokens, got {tuple(target_probs.shape)}")
    if draft_token_ids.dim() != 2 or tuple(draft_token_ids.shape) != (b, k1 - 1):
        raise ValueError(f"draft_token_ids must be [B, k] = [{b}, {k1 - 1}], got shape {tuple(draft_token_ids.shape)}")
    if draft_token_ids.dtype != torch.int64:
        raise ValueError(f"draft_token_ids dtype must be int64, got {draft_token_ids.dtype}")
    if draft_token_ids.device != target_probs.device:
        raise ValueError(f"draft_token_ids is on {draft_token_ids.device}, target_probs on {target_probs.device}")
    if draft_token_ids.numel() and (int(draft_token_ids.max()) >= v or int(draft_token_ids.min()) < -1):
        raise ValueError(f"draft_token_ids must lie in [0, {v}) (or be -1 for a placeholder)")
    if draft_probs is not None:
        if tuple(draft_probs.shape) != (b, k1 - 1, v):
            raise ValueError(f"draft_probs must be [B, k, V] = [{b}, {k1 - 1}, {v}], got {tuple(draft_probs.shape)}")
        if draft_probs.dtype != target_probs.dtype:
            raise ValueError(f"draft_probs dtype {draft_probs.dtype} differs from target_probs {target_probs.dtype}")
        if draft_probs.device != target_probs.device:
            raise ValueError(f"draft_probs is on {draft_probs.device}, target_probs on {target_probs.device}")
    if check_values:
        for name, t in (("target_probs", target_probs), ("draft_probs", draft_probs)):
            # One reduction: the minimum is NaN when any entry is NaN, and NaN >= 0 is False.
            if t is not None and t.numel() and not bool(t.amin() >= 0):
                raise ValueError(f"{name} contains NaN or negative probabilities")


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend={backend!r}: allowed values are 'auto', 'triton', 'torch'")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 (set before importing triton)")
    return backend


def _row_flags(b: int, seeds, is_greedy, device) -> tuple[torch.Tensor, torch.Tensor]:
    """seeds [B] int64 (unseeded rows get a fresh random seed) and is_greedy [B] bool, on ``device``."""
    if seeds is None:
        seeds = torch.full((b,), -1, dtype=torch.int64)
    if seeds.shape != (b,) or seeds.dtype != torch.int64:
        raise ValueError(f"seeds must be an int64 tensor of shape [{b}], got {seeds.dtype} {tuple(seeds.shape)}")
    seeds = seeds.to(device)
    unseeded = seeds < 0
    if bool(unseeded.any()):
        seeds = torch.where(unseeded, torch.randint(0, 2**62, (b,), device=device), seeds)
    if is_greedy is None:
        is_greedy = torch.zeros(b, dtype=torch.bool)
    if is_greedy.shape != (b,):
        raise ValueError(f"is_greedy must be a bool tensor of shape [{b}], got {tuple(is_greedy.shape)}")
    return seeds, is_greedy.to(device=device, dtype=torch.bool)


def _torch_noise(seeds: torch.Tensor, greedy: torch.Tensor, k: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row noise from a generator keyed by (row seed, purpose): uniform [B, k], exponential [B, V] (CPU).

    Greedy rows use no noise (they get zeros and ones, which their argmax walk ignores)."""
    u = torch.zeros(len(seeds), k)
    e = torch.ones(len(seeds), v)
    for row, (s, g) in enumerate(zip(seeds.tolist(), greedy.tolist())):
        if not g:
            u[row] = torch.rand(k, generator=generator_for(s, _UNIFORM))
            e[row].exponential_(1.0, generator=generator_for(s, _RACE)).clamp_min_(1e-30)
    return u, e


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    seeds: torch.Tensor | None = None,
    is_greedy: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Verify draft tokens against the target distribution by rejection sampling (lossless).

    Args:
        target_probs: [B, k+1, V] float32 (bfloat16/float16 accepted); each row a distribution; row k is the bonus
            position.
        draft_token_ids: [B, k] int64; -1 is a placeholder that is rejected without indexing.
        draft_probs: [B, k, V] like ``target_probs``, or None for drafts without probabilities (n-gram, suffix): q is
            one-hot at the draft token, so x_i is accepted with probability p(x_i) and the recovered distribution is p
            with p(x_i) set to zero.
        seeds: None or int64 [B]; a row with seed >= 0 draws its noise from (seed, position) only, so it is
            reproducible and independent of the rest of the batch; -1 = unseeded (fresh randomness).
        is_greedy: None or bool [B]; greedy rows accept while the draft equals argmax(target_probs[i]) and then emit
            the argmax (token for token the target's own greedy decoding).
        backend: "auto" (Triton kernels for CUDA tensors, torch for CPU), "triton" (on CPU only under
            TRITON_INTERPRET=1) or "torch".

    Returns:
        [B, k+1] int64 on the input device: accepted drafts, then the recovered or bonus token, then -1 padding.

    Raises:
        ValueError: bad shapes, dtypes or devices, ids outside [0, V), unknown backend; on the torch path also NaN or
            negative probabilities.
    """
    b, k1, v = target_probs.shape if target_probs.dim() == 3 else (0, 0, 0)
    which = _resolve_backend(backend, target_probs.device)
    validate_inputs(target_probs, draft_token_ids, draft_probs, check_values=which == "torch")
    seeds, greedy = _row_flags(b, seeds, is_greedy, target_probs.device)
    if which == "triton":
        from .kernels import rejection_triton

        return rejection_triton(target_probs, draft_token_ids, draft_probs, seeds, greedy)
    u, e = _torch_noise(seeds, greedy, k1 - 1, v)
    dev = target_probs.device
    return rejection_torch(target_probs, draft_token_ids, draft_probs, u.to(dev), e.to(dev), greedy)


def typical_acceptance_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    *,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    seeds: torch.Tensor | None = None,
    is_greedy: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Typical acceptance (Medusa; vLLM ``TypicalAcceptanceSampler``): fast, deterministic acceptance, NOT lossless.

    Draft x_i is accepted when p(x_i) > min(posterior_threshold, posterior_alpha * exp(-H(p_i))), H the entropy of
    target_probs[i]. At the first rejection the argmax of target_probs[i] is emitted; if all k pass, the bonus token
    is drawn from target_probs[k] (seeded like :func:`rejection_sample`; argmax for greedy rows).

    Args:
        target_probs: [B, k+1, V] float32 (bfloat16/float16 accepted).
        draft_token_ids: [B, k] int64 (-1 placeholders are rejected).
        posterior_threshold: epsilon >= 0. posterior_alpha: delta >= 0.
        seeds, is_greedy, backend: as in :func:`rejection_sample`.

    Returns:
        [B, k+1] int64: accepted drafts, the replacement or bonus token, -1 padding.

    Raises:
        ValueError: as :func:`rejection_sample`, and negative epsilon or alpha.
    """
    if posterior_threshold < 0 or posterior_alpha < 0:
        raise ValueError(f"posterior_threshold and posterior_alpha must be >= 0, got {posterior_threshold}, {posterior_alpha}")
    b, k1, v = target_probs.shape if target_probs.dim() == 3 else (0, 0, 0)
    which = _resolve_backend(backend, target_probs.device)
    validate_inputs(target_probs, draft_token_ids, None, check_values=which == "torch")
    seeds, greedy = _row_flags(b, seeds, is_greedy, target_probs.device)
    if which == "triton":
        from .kernels import typical_triton

        return typical_triton(target_probs, draft_token_ids, posterior_threshold, posterior_alpha, seeds, greedy)
    _, e = _torch_noise(seeds, greedy, 0, v)
    return typical_torch(target_probs, draft_token_ids, posterior_threshold, posterior_alpha,
                         e.to(target_probs.device), greedy)
