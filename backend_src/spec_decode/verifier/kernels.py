"""The verifier as Triton (triton-lang) GPU kernels: one launch per call, one program per sequence.

Same maths as :mod:`spec_decode.verifier.torch_impl` (tested for exact agreement under ``TRITON_INTERPRET=1`` when fed
the same noise). Each program walks its row's k drafts (accept test, greedy check, -1 placeholders rejected without
indexing), then runs one tiled pass over V at the first rejected position (or the bonus position k) that computes the
exponential race for the recovered distribution max(0, p - q) (or p without the draft token), the race for p itself
(used when the residual is empty, p == q), and the argmax (greedy rows, typical acceptance). Out-of-range lanes score
-1 and never win. Offsets are int64. Noise comes from Philox keyed by (row seed, offset): offsets 0..k-1 are the accept
uniforms, k + v the race's exponentials, so a seeded row does not depend on the rest of the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _argmax_tile_update(score, start, best_val, best_idx):
    """Fold one tile's max (tile starting at index ``start``) into the running (best value, best index).

    Strictly greater wins, and within a tile ties go left, so the lowest index wins ties (as torch.argmax)."""
    blk_val, blk_idx = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    better = blk_val > best_val
    best_idx = tl.where(better, start + blk_idx.to(tl.int64), best_idx)
    best_val = tl.maximum(best_val, blk_val)
    return best_val, best_idx


@triton.jit
def _row_argmax(row_ptr, V, BLOCK_V: tl.constexpr):
    best_val = -1.0
    best_idx = tl.zeros((), dtype=tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V).to(tl.int64)
        m = offs < V
        p = tl.load(row_ptr + offs, mask=m, other=0.0).to(tl.float32)
        best_val, best_idx = _argmax_tile_update(tl.where(m, p, -1.0), start, best_val, best_idx)
    return best_idx


@triton.jit
def _exponential(seed, e_row_ptr, offs, m, K, HAS_NOISE: tl.constexpr):
    if HAS_NOISE:
        e = tl.load(e_row_ptr + offs, mask=m, other=1.0)
    else:
        u = tl.rand(seed, (K + offs).to(tl.int32))
        e = tl.maximum(-tl.log(1.0 - u), 1e-30)
    return e


@triton.jit
def _write_output(out_row_ptr, ids_row_ptr, n, token, K):
    for i in range(0, K + 1):
        x = tl.load(ids_row_ptr + i, mask=i < K, other=-1)
        val = tl.where(i < n, x, tl.where(i == n, token, -1))
        tl.store(out_row_ptr + i, val)


@triton.jit
def rejection_kernel(
    tp_ptr, dp_ptr, ids_ptr, seeds_ptr, greedy_ptr, u_ptr, e_ptr, out_ptr,
    K, V,
    HAS_DRAFT_PROBS: tl.constexpr, HAS_NOISE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program per row b. tp [B, K+1, V], dp [B, K, V] (contiguous), ids [B, K] int64, seeds [B] int64,
    greedy [B] int8, u [B, K] and e [B, V] float32 (read only when HAS_NOISE), out [B, K+1] int64."""
    row = tl.program_id(0).to(tl.int64)
    Vl = V.to(tl.int64)
    tp_row = tp_ptr + row * (K + 1) * Vl
    dp_row = dp_ptr + row * K * Vl
    ids_row = ids_ptr + row * K
    seed = tl.load(seeds_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0

    n = tl.zeros((), dtype=tl.int64)
    accepting = tl.full((), 1, dtype=tl.int1)
    for i in range(0, K):
        x = tl.load(ids_row + i)
        valid = x >= 0
        xs = tl.where(valid, x, 0)
        pos_ptr = tp_row + i * Vl
        if greedy:
            ok = xs == _row_argmax(pos_ptr, V, BLOCK_V)
        else:
            p = tl.load(pos_ptr + xs).to(tl.float32)
            if HAS_NOISE:
                u = tl.load(u_ptr + row * K + i)
            else:
                u = tl.rand(seed, tl.full((), i, dtype=tl.int32))
            if HAS_DRAFT_PROBS:
                q = tl.load(dp_row + i * Vl + xs).to(tl.float32)
                ok = (q <= 0.0) | (u < tl.minimum(p / q, 1.0))
            else:
                ok = u < tl.minimum(p, 1.0)  # q one-hot at the draft: accept with probability p(x)
        accepting = accepting & valid & ok
        n += accepting.to(tl.int64)

    # One pass over V at position n: recovered (n < K) or bonus (n == K) token.
    has_draft = n < K
    x_n = tl.load(ids_row + n, mask=has_draft, other=-1)
    pos_ptr = tp_row + n * Vl
    e_row = e_ptr + row * Vl
    res_val = -1.0
    res_idx = tl.zeros((), dtype=tl.int64)
    p_val = -1.0
    p_idx = tl.zeros((), dtype=tl.int64)
    g_val = -1.0
    g_idx = tl.zeros((), dtype=tl.int64)
    res_sum = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V).to(tl.int64)
        m = offs < Vl
        p = tl.load(pos_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_DRAFT_PROBS:
            q = tl.load(dp_row + n * Vl + offs, mask=m & has_draft, other=0.0).to(tl.float32)
            residual = tl.maximum(p - q, 0.0)
        else:
            residual = tl.where(offs == x_n, 0.0, p)
        e = _exponential(seed, e_row, offs, m, K, HAS_NOISE)
        res_val, res_idx = _argmax_tile_update(tl.where(m, residual / e, -1.0), start, res_val, res_idx)
        p_val, p_idx = _argmax_tile_update(tl.where(m, p / e, -1.0), start, p_val, p_idx)
        g_val, g_idx = _argmax_tile_update(tl.where(m, p, -1.0), start, g_val, g_idx)
        res_sum += tl.sum(tl.where(m, residual, 0.0), axis=0)
    token = tl.where(res_sum > 0.0, res_idx, p_idx)
    token = tl.where(greedy, g_idx, token)
    _write_output(out_ptr + row * (K + 1), ids_row, n, token, K)


@triton.jit
def typical_kernel(
    tp_ptr, ids_ptr, seeds_ptr, greedy_ptr, e_ptr, out_ptr,
    K, V, posterior_threshold, posterior_alpha,
    HAS_NOISE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program per row. Accept x_i when p(x_i) > min(eps, alpha * exp(-H(p_i))); argmax at the first rejection;
    bonus drawn by the exponential race (argmax for greedy rows)."""
    row = tl.program_id(0).to(tl.int64)
    Vl = V.to(tl.int64)
    tp_row = tp_ptr + row * (K + 1) * Vl
    ids_row = ids_ptr + row * K
    seed = tl.load(seeds_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0

    n = tl.zeros((), dtype=tl.int64)
    accepting = tl.full((), 1, dtype=tl.int1)
    for i in range(0, K):
        x = tl.load(ids_row + i)
        valid = x >= 0
        xs = tl.where(valid, x, 0)
        pos_ptr = tp_row + i * Vl
        neg_entropy = 0.0
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V).to(tl.int64)
            m = offs < Vl
            p = tl.load(pos_ptr + offs, mask=m, other=0.0).to(tl.float32)
            neg_entropy += tl.sum(tl.where(p > 0.0, p * tl.log(tl.where(p > 0.0, p, 1.0)), 0.0), axis=0)
        threshold = tl.minimum(posterior_alpha * tl.exp(neg_entropy), posterior_threshold)
        p_x = tl.load(pos_ptr + xs).to(tl.float32)
        accepting = accepting & valid & (p_x > threshold)
        n += accepting.to(tl.int64)

    pos_ptr = tp_row + n * Vl
    e_row = e_ptr + row * Vl
    p_val = -1.0
    p_idx = tl.zeros((), dtype=tl.int64)
    g_val = -1.0
    g_idx = tl.zeros((), dtype=tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V).to(tl.int64)
        m = offs < Vl
        p = tl.load(pos_ptr + offs, mask=m, other=0.0).to(tl.float32)
        e = _exponential(seed, e_row, offs, m, K, HAS_NOISE)
        p_val, p_idx = _argmax_tile_update(tl.where(m, p / e, -1.0), start, p_val, p_idx)
        g_val, g_idx = _argmax_tile_update(tl.where(m, p, -1.0), start, g_val, g_idx)
    token = tl.where((n < K) | greedy, g_idx, p_idx)
    _write_output(out_ptr + row * (K + 1), ids_row, n, token, K)


def _block_v(v: int) -> int:
    return min(4096, triton.next_power_of_2(v))


def rejection_triton(target_probs, draft_token_ids, draft_probs, seeds, is_greedy, noise=None) -> torch.Tensor:
    """Launch :func:`rejection_kernel`. ``noise`` = (uniform [B, k], exponential [B, V]) or None (Philox in-kernel).

    Returns [B, k+1] int64 on the input device.
    """
    b, k1, v = target_probs.shape
    dev = target_probs.device
    tp = target_probs.contiguous()
    dp = draft_probs.contiguous() if draft_probs is not None else tp  # dummy pointer when absent
    out = torch.empty((b, k1), dtype=torch.int64, device=dev)
    if noise is None:
        u = e = torch.empty(1, dtype=torch.float32, device=dev)
    else:
        u, e = (t.to(device=dev, dtype=torch.float32).contiguous() for t in noise)
    rejection_kernel[(b,)](
        tp, dp, draft_token_ids.contiguous(), seeds.to(dev), is_greedy.to(device=dev, dtype=torch.int8), u, e, out,
        k1 - 1, v, HAS_DRAFT_PROBS=draft_probs is not None, HAS_NOISE=noise is not None, BLOCK_V=_block_v(v),
    )
    return out


def typical_triton(target_probs, draft_token_ids, posterior_threshold, posterior_alpha, seeds, is_greedy,
                   exponential=None) -> torch.Tensor:
    """Launch :func:`typical_kernel`; ``exponential`` [B, V] or None (Philox in-kernel). Returns [B, k+1] int64."""
    b, k1, v = target_probs.shape
    dev = target_probs.device
    out = torch.empty((b, k1), dtype=torch.int64, device=dev)
    e = (exponential.to(device=dev, dtype=torch.float32).contiguous() if exponential is not None
         else torch.empty(1, dtype=torch.float32, device=dev))
    typical_kernel[(b,)](
        target_probs.contiguous(), draft_token_ids.contiguous(), seeds.to(dev),
        is_greedy.to(device=dev, dtype=torch.int8), e, out, k1 - 1, v, float(posterior_threshold),
        float(posterior_alpha), HAS_NOISE=exponential is not None, BLOCK_V=_block_v(v),
    )
    return out
