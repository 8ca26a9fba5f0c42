"""Rejection sampling for speculative decoding (torch path).

Follows Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding"), Chen et al. 2023 and vLLM's
``RejectionSampler``: draft token x_i is accepted when u_i < min(1, p(x_i) / q(x_i)); at the first rejection a
recovered token is drawn from normalize(max(0, p_i - q_i)); when all k drafts are accepted a bonus token is drawn from
the target distribution at position k. The output distribution equals the target's exactly.
"""

from __future__ import annotations

import torch

from ..sampling import generator_for

# Purposes mixed into the noise seed, so the accept test and the token draws use independent streams.
_UNIFORM, _RACE = 1, 2


def validate_inputs(
    target_probs: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, check_values: bool
) -> None:
    """Check shapes, dtypes, devices, token-id range and (optionally) NaN/negative probabilities.

    Raises:
        ValueError: naming the offending argument and what is allowed.
    """
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, k+1, V], got shape {tuple(target_probs.shape)}")
    if target_probs.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"target_probs dtype must be float32, float16 or bfloat16, got {target_probs.dtype}")
    b, k1, v = target_probs.shape
    if draft_token_ids.dim() != 2 or tuple(draft_token_ids.shape) != (b, k1 - 1):
        raise ValueError(f"draft_token_ids must be [B, k] = [{b}, {k1 - 1}], got shape {tuple(draft_token_ids.shape)}")
    if draft_token_ids.dtype != torch.int64:
        raise ValueError(f"draft_token_ids dtype must be int64, got {draft_token_ids.dtype}")
    if draft_token_ids.numel() and (
        int(draft_token_ids.max()) >= v or int(draft_token_ids.min()) < -1
    ):
        raise ValueError(f"draft_token_ids must lie in [0, {v}) (or -1 for a placeholder)")
    if draft_probs is not None:
        if tuple(draft_probs.shape) != (b, k1 - 1, v):
            raise ValueError(f"draft_probs must be [B, k, V] = [{b}, {k1 - 1}, {v}], got {tuple(draft_probs.shape)}")
        if draft_probs.dtype != target_probs.dtype:
            raise ValueError(f"draft_probs dtype {draft_probs.dtype} differs from target_probs {target_probs.dtype}")
        if draft_probs.device != target_probs.device:
            raise ValueError("draft_probs and target_probs must be on the same device")
    if check_values:
        for name, t in (("target_probs", target_probs), ("draft_probs", draft_probs)):
            if t is not None and t.numel() and bool(((t < 0) | torch.isnan(t)).any()):
                raise ValueError(f"{name} contains NaN or negative probabilities")


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    seeds: torch.Tensor | None = None,
    is_greedy: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Verify draft tokens against the target distribution.

    Args:
        target_probs: [B, k+1, V] float32 (bfloat16/float16 accepted); row k is the bonus position.
        draft_token_ids: [B, k] int64; -1 is a placeholder that is always rejected.
        draft_probs: [B, k, V] like ``target_probs``, or None for drafts without probabilities (n-gram): q is then
            one-hot at the draft token, so x_i is accepted with probability p(x_i) and the recovered distribution is p
            with p(x_i) set to zero.
        seeds: None or int64 [B]; a row with seed >= 0 draws its noise from (seed, position) only, so it is
            reproducible and independent of the rest of the batch; -1 uses the global torch generator.
        is_greedy: None or bool [B]; greedy rows accept while the draft equals argmax(target_probs[i]) and then emit
            the argmax (token for token the target's own greedy decoding).
        backend: "auto" or "torch" (the Triton-kernel backend is tracked separately).

    Returns:
        [B, k+1] int64: accepted drafts, then the recovered or bonus token, then -1 padding.

    Raises:
        ValueError: bad shapes, dtypes, devices, ids outside [0, V), NaN or negative probabilities, unknown backend.
    """
    if backend not in ("auto", "torch"):
        raise ValueError(f"backend={backend!r}: allowed values are 'auto', 'torch'")
    validate_inputs(target_probs, draft_token_ids, draft_probs, check_values=True)
    b, k1, v = target_probs.shape
    k = k1 - 1
    out = torch.full((b, k1), -1, dtype=torch.int64)
    tp = target_probs.float().cpu()
    dp = draft_probs.float().cpu() if draft_probs is not None else None
    ids = draft_token_ids.cpu()
    seeds_l = seeds.tolist() if seeds is not None else [-1] * b
    greedy_l = is_greedy.tolist() if is_greedy is not None else [False] * b
    for row in range(b):
        seed = int(seeds_l[row])

        def gen(purpose: int, pos: int) -> torch.Generator | None:
            return generator_for(seed, purpose, pos) if seed >= 0 else None

        n = 0
        while n < k:
            x = int(ids[row, n])
            if x < 0:
                break
            p = tp[row, n]
            if greedy_l[row]:
                ok = x == int(torch.argmax(p))
            else:
                px = float(p[x])
                qx = float(dp[row, n, x]) if dp is not None else 1.0
                u = float(torch.rand(1, generator=gen(_UNIFORM, n)))
                ok = qx <= 0.0 or u < min(1.0, px / qx)  # q(x) == 0 cannot have been sampled: accept
            if not ok:
                break
            out[row, n] = x
            n += 1
        p = tp[row, n]
        if greedy_l[row]:
            token = int(torch.argmax(p))
        else:
            if n < k:  # recovered token from normalize(max(0, p - q))
                x = int(ids[row, n])
                if dp is not None:
                    dist = torch.clamp(p - dp[row, n], min=0.0)
                else:
                    dist = p.clone()
                    if x >= 0:
                        dist[x] = 0.0
                if float(dist.sum()) <= 0.0:  # p == q: the residual is empty; fall back to p (never NaN)
                    dist = p
            else:  # bonus token
                dist = p
            e = torch.empty(v, dtype=torch.float32).exponential_(1.0, generator=gen(_RACE, n))
            token = int(torch.argmax(dist / e))
        out[row, n] = token
    return out.to(target_probs.device)
