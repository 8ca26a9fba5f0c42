"""Tree verification as Triton kernels: one launch per call, one program per row, the same maths as
:mod:`spec_decode.verifier.tree_torch` (tested for exact agreement under ``TRITON_INTERPRET=1`` when fed the same
noise) and the same noise keys as the chain kernels (:mod:`spec_decode.verifier.kernels`: Philox offset i for node i's
accept uniform, 2^16 + v for the race), so a chain gives what the chain kernel gives.

Each program walks its row's nodes in index order, testing the children of the current node (scalar loads; a greedy
row scans the current node's target row once for its argmax). Only a rejected child with draft probabilities costs a
pass over V: the residual r = max(r / S - q_i, 0) is written to a [B, V] float32 scratch row and summed in float64.
The tokens of the current node's rejected children go to a [B, n] int64 scratch row, zeroed in q_i and (without draft
probabilities) in the final race. Typical acceptance records each node's depth, or 0 when its path fails, in a
[B, n] int64 scratch row that its children read. A final tiled pass over the end node's target row races the residual
(or p) and takes the argmax, as :func:`~.kernels._sample_pass` does. Scalars a program writes and later reads
(scratch rows) are fenced with ``tl.debug_barrier`` (the threads of a program read them at other times than the one
that wrote them). Every probability read is checked as the chain kernels check it (flag bits of
:mod:`spec_decode.verifier.checks`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import raise_for_flags
from .kernels import (
    _argmax_tile_update,
    _block_v,
    _exponential,
    _f32,
    _invalid,
    _load_tile,
    _on,
    _race_score,
    _sample_pass,
    _scan_row,
    _typical_above_float64,
)
from .torch_impl import as_float32

FLOAT32_TINY = tl.constexpr(1.1754943508222875e-38)  # the floor of qmass (tree_torch.FLOAT32_TINY)


@triton.jit
def _residual_update(p_row, r_row, q_row, rej_row, m, in_scratch, S, qm, Vl, BLOCK_V: tl.constexpr):
    """One pass over V: r = max(r / S - q_i, 0) into the scratch row (r read from it when ``in_scratch``, else p),
    q_i = q with the m tokens of rej_row zeroed, / qm. Returns (sum of the new r in float64, bad p, bad q)."""
    total = tl.zeros((), dtype=tl.float64)
    bad_p = tl.zeros((), dtype=tl.int32)
    bad_q = tl.zeros((), dtype=tl.int32)
    for start in range(0, Vl, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V).to(tl.int64)
        mk = offs < Vl
        p = _f32(tl.load(p_row + offs, mask=mk & (in_scratch == 0), other=0.0))
        bad_p = bad_p | tl.max(_invalid(p), axis=0)
        r = tl.load(r_row + offs, mask=mk & (in_scratch != 0), other=0.0)
        r = tl.where(in_scratch != 0, r, p)
        q = _f32(tl.load(q_row + offs, mask=mk, other=0.0))
        bad_q = bad_q | tl.max(_invalid(q), axis=0)
        for j in range(0, m):
            q = tl.where(offs == tl.load(rej_row + j), 0.0, q)
        new = tl.maximum(tl.div_rn(r, S) - tl.div_rn(q, qm), 0.0)
        tl.store(r_row + offs, new, mask=mk)
        total += tl.sum(new.to(tl.float64), axis=0)
    return total, bad_p, bad_q


@triton.jit
def tree_rejection_kernel(
    tp_ptr, dp_ptr, ids_ptr, par_ptr, seeds_ptr, greedy_ptr, u_ptr, e_ptr, r_ptr, rej_ptr, out_ptr, path_ptr,
    flags_ptr, K, V,
    HAS_DRAFT_PROBS: tl.constexpr, HAS_NOISE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program per row b. tp [B, K+1, V], dp [B, K, V] (contiguous), ids and par [B, K] int64, seeds [B] int64,
    greedy [B] int8, u [B, K] and e [B, V] float32 (read only when HAS_NOISE), scratch r [B, V] float32 and rej
    [B, K] int64, out [B, K+1] and path [B, K] int64, flags [B] int32 (as :func:`~.kernels.rejection_kernel`)."""
    row = tl.program_id(0).to(tl.int64)
    Vl = V + tl.zeros((), dtype=tl.int64)  # int64 offsets (V or K may arrive as the constexpr 1)
    Kl = K + tl.zeros((), dtype=tl.int64)
    tp_row = tp_ptr + row * (Kl + 1) * Vl
    dp_row = dp_ptr + row * Kl * Vl
    ids_row = ids_ptr + row * Kl
    par_row = par_ptr + row * Kl
    rej_row = rej_ptr + row * Kl
    r_row = r_ptr + row * Vl
    out_row = out_ptr + row * (Kl + 1)
    path_row = path_ptr + row * Kl
    seed = tl.load(seeds_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    bad_p = tl.zeros((), dtype=tl.int32)
    bad_q = tl.zeros((), dtype=tl.int32)

    cur = tl.full((), -1, dtype=tl.int64)
    depth = tl.zeros((), dtype=tl.int64)
    m = tl.zeros((), dtype=tl.int64)  # cur's rejected children so far (their tokens: rej_row[:m])
    S = tl.full((), 1.0, dtype=tl.float32)
    qmass = tl.full((), 1.0, dtype=tl.float32)
    in_scratch = tl.zeros((), dtype=tl.int32)  # 1: r is the scratch row; 0: r is p(cur)
    g_valid = tl.zeros((), dtype=tl.int32)
    g_idx = tl.zeros((), dtype=tl.int64)
    for i in range(0, K):
        x = tl.load(ids_row + i)
        par = tl.load(par_row + i)
        if (x >= 0) & (par == cur):
            p_row = tp_row + (cur + 1) * Vl
            p_x = _f32(tl.load(p_row + x))
            bad_p = bad_p | _invalid(p_x)
            ok = tl.zeros((), dtype=tl.int1)
            if greedy:
                if g_valid == 0:
                    g_idx, _, bad = _scan_row(p_row, V, Vl, BLOCK_V, False)
                    bad_p = bad_p | bad
                    g_valid = g_valid + 1
                ok = (x == g_idx) & (p_x > 0.0)
            else:
                if HAS_NOISE:
                    u = tl.load(u_ptr + row * Kl + i)
                else:
                    u = tl.rand(seed, tl.full((), i, dtype=tl.int32))
                if HAS_DRAFT_PROBS:
                    r_x = tl.load(r_row + x, mask=in_scratch != 0, other=0.0)
                    r_x = tl.where(in_scratch != 0, r_x, p_x)
                    q_row = dp_row + i * Vl
                    q_x = _f32(tl.load(q_row + x))
                    bad_q = bad_q | _invalid(q_x)
                    qm = tl.maximum(qmass, FLOAT32_TINY)
                    q_ix = tl.div_rn(q_x, qm)  # x is no rejected sibling (siblings differ)
                    ok = (q_ix > 0.0) & ((tl.div_rn(r_x, S) >= q_ix) | (u * q_ix * S < r_x))
                    if ok == 0:
                        tl.debug_barrier()  # every thread has read r[x] before the scratch row changes
                        total, bad, bad_n = _residual_update(p_row, r_row, q_row, rej_row, m, in_scratch, S, qm, Vl,
                                                             BLOCK_V)
                        bad_p = bad_p | bad
                        bad_q = bad_q | bad_n
                        S = total.to(tl.float32)
                        qmass = qmass - q_x
                        in_scratch = tl.where(S > 0.0, 1, 0)
                        S = tl.where(S > 0.0, S, 1.0)  # an empty residual falls back to p(cur)
                else:
                    ok = (p_x > 0.0) & (u * S < p_x)  # r[x] = p(cur)[x]: x is no rejected sibling
                    if ok == 0:
                        S = S - p_x
            if ok:
                tl.store(out_row + depth, x)
                tl.store(path_row + depth, i)
                depth += 1
                cur = i + tl.zeros((), dtype=tl.int64)
                m = m * 0
                S = S * 0.0 + 1.0
                qmass = qmass * 0.0 + 1.0
                in_scratch = in_scratch * 0
                g_valid = g_valid * 0
            else:
                tl.store(rej_row + m, x)
                m += 1
            tl.debug_barrier()  # the scratch rows written above are read by every thread later

    # One pass over V at the end node: the residual's race (p(cur) without its rejected children's tokens, or the
    # scratch row), p's race (an empty residual), the argmax (greedy rows) and p's mass.
    p_row = tp_row + (cur + 1) * Vl
    e_row = e_ptr + row * Vl
    res_val = -1.0
    res_idx = tl.zeros((), dtype=tl.int64)
    p_val = -1.0
    p_idx = tl.zeros((), dtype=tl.int64)
    a_val = -1.0
    a_idx = tl.zeros((), dtype=tl.int64)
    res_sum = 0.0
    p_sum = 0.0
    for start in range(0, V, BLOCK_V):
        offs, mk, p, bad_tile = _load_tile(p_row, start, Vl, BLOCK_V)
        bad_p = bad_p | bad_tile
        e = _exponential(seed, e_row, offs, mk, HAS_NOISE)
        if HAS_DRAFT_PROBS:
            res = tl.load(r_row + offs, mask=mk & (in_scratch != 0), other=0.0)
            res = tl.where(in_scratch != 0, res, p)
        else:
            res = p
            for j in range(0, m):
                res = tl.where(offs == tl.load(rej_row + j), 0.0, res)
        res_val, res_idx = _argmax_tile_update(_race_score(res, e), start, res_val, res_idx)
        res_sum += tl.sum(res, axis=0)
        p_val, p_idx = _argmax_tile_update(_race_score(p, e), start, p_val, p_idx)
        a_val, a_idx = _argmax_tile_update(tl.where(mk, p, -1.0), start, a_val, a_idx)
        p_sum += tl.sum(p, axis=0)
    token = tl.where(greedy, a_idx, tl.where(res_sum > 0.0, res_idx, p_idx))
    tl.store(out_row + depth, token)
    for pos in range(depth + 1, Kl + 1):
        tl.store(out_row + pos, -1)
    for pos in range(depth, Kl):
        tl.store(path_row + pos, -1)
    tl.store(flags_ptr + row, bad_p + 2 * bad_q + tl.where(p_sum > 0.0, 0, 4))


@triton.jit
def tree_typical_kernel(
    tp_ptr, ids_ptr, par_ptr, seeds_ptr, greedy_ptr, e_ptr, d_ptr, out_ptr, path_ptr, flags_ptr,
    K, V, posterior_threshold, posterior_alpha,
    HAS_NOISE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program per row. Node i passes when it passes the chain's typical test against p(parent) (greedy rows:
    the argmax test) and its parent's path passes; d [B, K] int64 scratch holds each node's depth, 0 when its path
    fails. The path ends at the deepest passing node (lowest index on ties); then argmax p(end) if the end node has a
    real child, else p(end)'s race (argmax for greedy rows). Other arguments as :func:`tree_rejection_kernel`;
    flags bits 1 and 4."""
    row = tl.program_id(0).to(tl.int64)
    Vl = V + tl.zeros((), dtype=tl.int64)
    Kl = K + tl.zeros((), dtype=tl.int64)
    tp_row = tp_ptr + row * (Kl + 1) * Vl
    ids_row = ids_ptr + row * Kl
    par_row = par_ptr + row * Kl
    d_row = d_ptr + row * Kl
    out_row = out_ptr + row * (Kl + 1)
    path_row = path_ptr + row * Kl
    seed = tl.load(seeds_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    bad_p = tl.zeros((), dtype=tl.int32)

    best = tl.full((), -1, dtype=tl.int64)
    best_depth = tl.zeros((), dtype=tl.int64)
    c_row = tl.full((), -2, dtype=tl.int64)  # the parent whose row was scanned last (siblings share it)
    c_g = tl.zeros((), dtype=tl.int64)
    c_ne = tl.zeros((), dtype=tl.float32)
    for i in range(0, K):
        x = tl.load(ids_row + i)
        par = tl.load(par_row + i)
        d = tl.zeros((), dtype=tl.int64)
        above_d = tl.load(d_row + par, mask=(x >= 0) & (par >= 0), other=0)
        if (x >= 0) & ((par < 0) | (above_d > 0)):
            pos_ptr = tp_row + (par + 1) * Vl
            if c_row != par:
                c_g, c_ne, bad = _scan_row(pos_ptr, V, Vl, BLOCK_V, True)
                bad_p = bad_p | bad
                c_row = par + tl.zeros((), dtype=tl.int64)
            threshold = tl.minimum(posterior_alpha * tl.exp(c_ne), posterior_threshold)
            p_x = _f32(tl.load(pos_ptr + x))
            bad_p = bad_p | _invalid(p_x)
            if tl.abs(p_x - threshold) <= threshold * 0.0009765625:  # 2^-10: as kernels.typical_kernel
                above = _typical_above_float64(pos_ptr, p_x, V, Vl, posterior_threshold, posterior_alpha, BLOCK_V)
            else:
                above = p_x > threshold
            ok = tl.where(greedy, (x == c_g) & (p_x > 0.0), above)
            d = tl.where(ok, above_d + 1, 0)
        tl.store(d_row + i, d)
        if d > best_depth:
            best_depth = d
            best = i + tl.zeros((), dtype=tl.int64)
        tl.debug_barrier()  # d_row[i] is read by every thread at i's children

    node = best
    for step in range(0, best_depth):  # walk up from the end node, filling the path backwards
        pos = best_depth - 1 - step
        tl.store(out_row + pos, tl.load(ids_row + node))
        tl.store(path_row + pos, node)
        node = tl.load(par_row + node)
    has_child = tl.zeros((), dtype=tl.int32)
    for j in range(0, K):
        has_child = has_child | ((tl.load(par_row + j) == best) & (tl.load(ids_row + j) >= 0)).to(tl.int32)
    drawn, g_idx, p_sum, bad, _ = _sample_pass(
        tp_row + (best + 1) * Vl, tp_row, -1, seed, e_ptr + row * Vl, V, Vl, False, False, HAS_NOISE, BLOCK_V)
    bad_p = bad_p | bad
    token = tl.where((has_child != 0) | greedy, g_idx, drawn)
    tl.store(out_row + best_depth, token)
    for pos in range(best_depth + 1, Kl + 1):
        tl.store(out_row + pos, -1)
    for pos in range(best_depth, Kl):
        tl.store(path_row + pos, -1)
    tl.store(flags_ptr + row, bad_p + tl.where(p_sum > 0.0, 0, 4))


def _prepare(target_probs, draft_token_ids, draft_parents, seeds, is_greedy):
    b, k1, v = target_probs.shape
    dev = target_probs.device
    out = torch.empty((b, k1), dtype=torch.int64, device=dev)
    path = torch.empty((b, k1 - 1), dtype=torch.int64, device=dev)
    flags = torch.empty(b, dtype=torch.int32, device=dev)
    scratch = torch.empty((b, max(k1 - 1, 1)), dtype=torch.int64, device=dev)
    args = (draft_token_ids.contiguous(), draft_parents.to(dev).contiguous(), seeds.to(dev).contiguous(),
            is_greedy.to(device=dev, dtype=torch.int8).contiguous())
    return out, path, flags, scratch, args


def tree_rejection_triton(target_probs, draft_token_ids, draft_parents, draft_probs, seeds, is_greedy,
                          noise=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`tree_rejection_kernel` on inputs that :func:`~.tree_sampler.tree_rejection_sample` checked.

    Args:
        target_probs, draft_token_ids, draft_parents, draft_probs: as :func:`~.tree_sampler.tree_rejection_sample`.
        seeds: [B] int64 >= 0. is_greedy: [B] bool.
        noise: (uniform [B, n], exponential [B, V]) float32, or None: Philox in-kernel, keyed by (row seed, offset).

    Returns:
        (out [B, n+1] int64, path [B, n] int64) on the input device.

    Raises:
        ValueError: a probability the kernel read was NaN, infinite or negative, or the target row it sampled from
            sums to zero (from the kernel's flags, as :func:`~.kernels.rejection_triton`).
    """
    b, k1, v = target_probs.shape
    dev = target_probs.device
    out, path, flags, rej, (ids, par, seeds, greedy) = _prepare(target_probs, draft_token_ids, draft_parents, seeds,
                                                                is_greedy)
    tp = target_probs.contiguous()
    dp = draft_probs.contiguous() if draft_probs is not None else tp  # dummy pointer when absent
    r = torch.empty((b, v) if draft_probs is not None else (1,), dtype=torch.float32, device=dev)
    if noise is None:
        u = e = torch.empty(1, dtype=torch.float32, device=dev)
    else:
        u, e = (t.to(device=dev, dtype=torch.float32).contiguous() for t in noise)
    with _on(dev):
        tree_rejection_kernel[(b,)](
            tp, dp, ids, par, seeds, greedy, u, e, r, rej, out, path, flags, k1 - 1, v,
            HAS_DRAFT_PROBS=draft_probs is not None, HAS_NOISE=noise is not None, BLOCK_V=_block_v(v),
        )
    raise_for_flags(flags)
    return out, path


def tree_typical_triton(target_probs, draft_token_ids, draft_parents, posterior_threshold, posterior_alpha, seeds,
                        is_greedy, exponential=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`tree_typical_kernel`: arguments as :func:`tree_rejection_triton`, epsilon and alpha as
    :func:`~.tree_sampler.tree_typical_sample`; ``exponential`` [B, V] float32 or None (Philox in-kernel).

    Returns:
        (out [B, n+1] int64, path [B, n] int64) on the input device.

    Raises:
        ValueError: as :func:`tree_rejection_triton`.
    """
    b, k1, v = target_probs.shape
    dev = target_probs.device
    out, path, flags, d, (ids, par, seeds, greedy) = _prepare(target_probs, draft_token_ids, draft_parents, seeds,
                                                              is_greedy)
    e = (exponential.to(device=dev, dtype=torch.float32).contiguous() if exponential is not None
         else torch.empty(1, dtype=torch.float32, device=dev))
    with _on(dev):
        tree_typical_kernel[(b,)](
            target_probs.contiguous(), ids, par, seeds, greedy, e, d, out, path, flags, k1 - 1, v,
            as_float32(posterior_threshold), as_float32(posterior_alpha), HAS_NOISE=exponential is not None,
            BLOCK_V=_block_v(v),
        )
    raise_for_flags(flags)
    return out, path
