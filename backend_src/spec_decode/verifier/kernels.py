"""The verifier as Triton (triton-lang) GPU kernels: one launch per call, one program per sequence.

Same maths as :mod:`spec_decode.verifier.torch_impl` (tested for exact agreement under ``TRITON_INTERPRET=1`` when fed
the same noise), with the same boundary rules (see :func:`spec_decode.verifier.rejection.rejection_sample`). Each
program walks its row's k drafts up to the first rejection (accept test, greedy check: a pass over V per position;
-1 placeholders rejected without indexing), then runs one
tiled pass over V at the first rejected position (or the bonus position) that computes the exponential race for the
recovered distribution max(0, p - q) (or p without the draft token), the race for p itself (used when the residual is
empty), and the argmax (greedy rows, typical acceptance). Zero-probability entries and out-of-range lanes score -1 and
never win. Offsets are int64. Noise comes from Philox keyed by (row seed, offset): offsets 0..k-1 are the accept
uniforms, 2^16 + v the race's exponentials, so a seeded row depends neither on the rest of the batch nor on the k
its rows are padded to.

Every probability a program reads is checked in the pass that reads it (NaN, +inf or negative sets a flag bit), and
so is the total mass of the row it samples from; the launchers turn the per-row flags into the torch path's
``ValueError`` (one host sync; no extra pass over the tensors). Values a program never reads (the rows after its first
rejection) cannot change its output and are not checked there.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .checks import raise_for_flags
from .torch_impl import as_float32


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
def _f32(x):
    """x widened to float32. bfloat16 is widened through its bit pattern (exact, subnormals included), which is what
    the GPU's conversion does anyway; Triton 3.7's interpreter would flush bfloat16 subnormals to 0 in .to()."""
    if x.dtype.is_bf16():
        y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _invalid(x):
    """int32 1 where x is not a probability (NaN, +inf or negative), else 0; same shape as x."""
    return tl.where((x >= 0.0) & (x < float("inf")), 0, 1).to(tl.int32)


@triton.jit
def _race_score(d, e):
    """Exponential-race score d / e, and -1 where d is 0 (or a masked lane): a zero-probability token never wins.

    The division is IEEE round-to-nearest (``div_rn``), as torch's: the default float32 ``/`` compiles to an
    approximate division (up to 2 ulp), which could pick another winner than the torch path fed the same noise."""
    return tl.where(d > 0.0, tl.div_rn(d, e), -1.0)


@triton.jit
def _load_tile(row_ptr, start, Vl, BLOCK_V: tl.constexpr):
    """The tile [start, start + BLOCK_V) of a [V] probability row: (int64 offsets, in-range mask, float32 values with
    0 outside V, int32 1 if any value is NaN/inf/negative)."""
    offs = start + tl.arange(0, BLOCK_V).to(tl.int64)
    m = offs < Vl
    p = _f32(tl.load(row_ptr + offs, mask=m, other=0.0))
    return offs, m, p, tl.max(_invalid(p), axis=0)


@triton.jit
def _scan_row(pos_ptr, V, Vl, BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    """One tiled pass over a [V] probability row: (argmax (lowest index on ties), sum(p log p) in float32 when
    WITH_ENTROPY else 0, int32 1 if any value is NaN/inf/negative)."""
    g_val = -1.0
    g_idx = tl.zeros((), dtype=tl.int64)
    neg_entropy = 0.0
    bad = tl.zeros((), dtype=tl.int32)
    for start in range(0, V, BLOCK_V):
        offs, m, p, bad_tile = _load_tile(pos_ptr, start, Vl, BLOCK_V)
        bad = bad | bad_tile
        if WITH_ENTROPY:
            neg_entropy += tl.sum(tl.where(p > 0.0, p * tl.log(tl.where(p > 0.0, p, 1.0)), 0.0), axis=0)
        g_val, g_idx = _argmax_tile_update(tl.where(m, p, -1.0), start, g_val, g_idx)
    return g_idx, neg_entropy, bad


@triton.jit
def _sample_pass(p_ptr, q_ptr, x_n, seed, e_row_ptr, V, Vl, WITH_RESIDUAL: tl.constexpr,
                 HAS_DRAFT_PROBS: tl.constexpr, HAS_NOISE: tl.constexpr, BLOCK_V: tl.constexpr):
    """One tiled pass over the target row p [V] at the position a row samples from (and, with HAS_DRAFT_PROBS, the
    draft row q [V] there, read only when x_n >= 0). Returns (drawn, argmax, sum of p, bad p, bad q): drawn races the
    residual max(0, p - q) (without draft probabilities: p with x_n zeroed) when WITH_RESIDUAL and that residual is not
    empty, else p itself; the bad flags are int32 1 if a value read was NaN/inf/negative."""
    res_val = -1.0
    res_idx = tl.zeros((), dtype=tl.int64)
    p_val = -1.0
    p_idx = tl.zeros((), dtype=tl.int64)
    g_val = -1.0
    g_idx = tl.zeros((), dtype=tl.int64)
    res_sum = 0.0
    p_sum = 0.0
    bad_p = tl.zeros((), dtype=tl.int32)
    bad_q = tl.zeros((), dtype=tl.int32)
    for start in range(0, V, BLOCK_V):
        offs, m, p, bad_tile = _load_tile(p_ptr, start, Vl, BLOCK_V)
        bad_p = bad_p | bad_tile
        e = _exponential(seed, e_row_ptr, offs, m, HAS_NOISE)
        if WITH_RESIDUAL:
            if HAS_DRAFT_PROBS:
                q = _f32(tl.load(q_ptr + offs, mask=m & (x_n >= 0), other=0.0))
                bad_q = bad_q | tl.max(_invalid(q), axis=0)
                residual = tl.maximum(p - q, 0.0)
            else:
                residual = tl.where(offs == x_n, 0.0, p)
            res_val, res_idx = _argmax_tile_update(_race_score(residual, e), start, res_val, res_idx)
            res_sum += tl.sum(residual, axis=0)
        p_val, p_idx = _argmax_tile_update(_race_score(p, e), start, p_val, p_idx)
        g_val, g_idx = _argmax_tile_update(tl.where(m, p, -1.0), start, g_val, g_idx)
        p_sum += tl.sum(p, axis=0)
    drawn = tl.where(res_sum > 0.0, res_idx, p_idx)  # an empty residual falls back to p
    return drawn, g_idx, p_sum, bad_p, bad_q


# Philox offsets of a row's noise: 0..k-1 the accept uniforms, RACE_OFFSET + v the race's exponentials. The race's
# offsets do not depend on k, so a row padded to a longer batch's k (-1 placeholders) draws the same noise as alone.
RACE_OFFSET = tl.constexpr(65536)  # k < 2^16: checked by rejection.validate_inputs


@triton.jit
def _exponential(seed, e_row_ptr, offs, m, HAS_NOISE: tl.constexpr):
    if HAS_NOISE:
        e = tl.load(e_row_ptr + offs, mask=m, other=1.0)
    else:
        u = tl.rand(seed, (offs + RACE_OFFSET).to(tl.int32))
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
    tp_ptr, dp_ptr, ids_ptr, seeds_ptr, greedy_ptr, u_ptr, e_ptr, out_ptr, flags_ptr,
    K, V,
    HAS_DRAFT_PROBS: tl.constexpr, HAS_NOISE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program per row b. tp [B, K+1, V], dp [B, K, V] (contiguous), ids [B, K] int64, seeds [B] int64,
    greedy [B] int8, u [B, K] and e [B, V] float32 (read only when HAS_NOISE), out [B, K+1] int64, flags [B] int32
    (bits of :mod:`spec_decode.verifier.checks`: 1 a target value read was NaN/inf/negative, 2 a draft value,
    4 the sampled target row sums to zero)."""
    row = tl.program_id(0).to(tl.int64)
    Vl = V + tl.zeros((), dtype=tl.int64)  # int64 offsets (V may arrive as a constexpr: the JIT specializes 1)
    tp_row = tp_ptr + row * (K + 1) * Vl
    dp_row = dp_ptr + row * K * Vl
    ids_row = ids_ptr + row * K
    seed = tl.load(seeds_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    bad_p = tl.zeros((), dtype=tl.int32)
    bad_q = tl.zeros((), dtype=tl.int32)

    n = tl.zeros((), dtype=tl.int64)
    accepting = tl.full((), 1, dtype=tl.int1)
    for i in range(0, K):
        x = tl.load(ids_row + i)
        valid = x >= 0
        xs = tl.where(valid, x, 0)
        pos_ptr = tp_row + i * Vl
        p = _f32(tl.load(pos_ptr + xs))
        bad_p = bad_p | _invalid(p)
        if greedy:
            ok = tl.zeros((), dtype=tl.int1)
            if accepting:  # after the first rejection no position can change the output: no scan of its row
                g_idx, _, bad = _scan_row(pos_ptr, V, Vl, BLOCK_V, False)
                bad_p = bad_p | bad
                ok = (xs == g_idx) & (p > 0.0)
        else:
            if HAS_NOISE:
                u = tl.load(u_ptr + row * K + i)
            else:
                u = tl.rand(seed, tl.full((), i, dtype=tl.int32))
            if HAS_DRAFT_PROBS:
                q = _f32(tl.load(dp_row + i * Vl + xs))
                bad_q = bad_q | _invalid(q)
                # accept with probability min(1, p/q); q = 0 rejects; no division: p == q accepts for every u < 1
                ok = (q > 0.0) & ((p >= q) | (u * q < p))
            else:
                ok = u < p  # q one-hot at the draft: accept with probability p(x)
        accepting = accepting & valid & ok
        n += accepting.to(tl.int64)

    # One pass over V at position n: recovered (a rejected draft at n) or bonus (n == K, or a placeholder at n) token.
    x_n = tl.load(ids_row + n, mask=n < K, other=-1)
    token, g_idx, p_sum, bad, bad_n = _sample_pass(
        tp_row + n * Vl, dp_row + n * Vl, x_n, seed, e_ptr + row * Vl, V, Vl, True, HAS_DRAFT_PROBS, HAS_NOISE,
        BLOCK_V)
    bad_p = bad_p | bad
    bad_q = bad_q | bad_n
    token = tl.where(greedy, g_idx, token)
    _write_output(out_ptr + row * (K + 1), ids_row, n, token, K)
    tl.store(flags_ptr + row, bad_p + 2 * bad_q + tl.where(p_sum > 0.0, 0, 4))


@triton.jit
def _typical_above_float64(pos_ptr, p_x, V, Vl, posterior_threshold, posterior_alpha, BLOCK_V: tl.constexpr):
    """Typical acceptance's test p(x) > min(eps, alpha * exp(-H)) with H and the threshold in float64; a p(x) above
    the threshold by less than 2^-28 of it counts as a tie and is rejected (as ``torch_impl.typical_torch``)."""
    neg_entropy = tl.zeros((), dtype=tl.float64)
    for start in range(0, V, BLOCK_V):
        _, _, p, _ = _load_tile(pos_ptr, start, Vl, BLOCK_V)
        p64 = tl.where(p > 0.0, p, 1.0).to(tl.float64)
        neg_entropy += tl.sum(tl.where(p > 0.0, p64 * tl.log(p64), 0.0), axis=0)
    zero64 = tl.zeros((), dtype=tl.float64)  # widens the float32 parameters exactly
    threshold = tl.minimum((posterior_alpha + zero64) * tl.exp(neg_entropy), posterior_threshold + zero64)
    return (p_x.to(tl.float64) - threshold) > threshold * 3.725290298461914e-09  # 2^-28


@triton.jit
def typical_kernel(
    tp_ptr, ids_ptr, seeds_ptr, greedy_ptr, e_ptr, out_ptr, flags_ptr,
    K, V, posterior_threshold, posterior_alpha,
    HAS_NOISE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program per row. Accept x_i when p(x_i) > min(eps, alpha * exp(-H(p_i))) (greedy rows: while x_i is the
    argmax); argmax at the first rejected draft; at the bonus position or a placeholder, a draw by the exponential
    race (argmax for greedy rows). flags [B] int32 as in :func:`rejection_kernel` (bits 1 and 4)."""
    row = tl.program_id(0).to(tl.int64)
    Vl = V + tl.zeros((), dtype=tl.int64)  # int64 offsets (V may arrive as a constexpr: the JIT specializes 1)
    tp_row = tp_ptr + row * (K + 1) * Vl
    ids_row = ids_ptr + row * K
    seed = tl.load(seeds_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    bad_p = tl.zeros((), dtype=tl.int32)

    n = tl.zeros((), dtype=tl.int64)
    accepting = tl.full((), 1, dtype=tl.int1)
    for i in range(0, K):
        x = tl.load(ids_row + i)
        valid = x >= 0
        xs = tl.where(valid, x, 0)
        pos_ptr = tp_row + i * Vl
        ok = tl.zeros((), dtype=tl.int1)
        if accepting:  # after the first rejection no position can change the output: no scan of its row
            g_idx, neg_entropy, bad = _scan_row(pos_ptr, V, Vl, BLOCK_V, True)
            bad_p = bad_p | bad
            threshold = tl.minimum(posterior_alpha * tl.exp(neg_entropy), posterior_threshold)
            p_x = _f32(tl.load(pos_ptr + xs))
            if tl.abs(p_x - threshold) <= threshold * 0.0009765625:  # 2^-10: far above float32's error in it
                # Near the threshold the float32 sum's rounding could decide: redo this row in float64 (rare).
                above = _typical_above_float64(pos_ptr, p_x, V, Vl, posterior_threshold, posterior_alpha, BLOCK_V)
            else:
                above = p_x > threshold
            ok = tl.where(greedy, (xs == g_idx) & (p_x > 0.0), above)
        accepting = accepting & valid & ok
        n += accepting.to(tl.int64)

    x_n = tl.load(ids_row + n, mask=n < K, other=-1)
    drawn, g_idx, p_sum, bad, _ = _sample_pass(
        tp_row + n * Vl, tp_row, x_n, seed, e_ptr + row * Vl, V, Vl, False, False, HAS_NOISE, BLOCK_V)
    bad_p = bad_p | bad
    token = tl.where((x_n >= 0) | greedy, g_idx, drawn)
    _write_output(out_ptr + row * (K + 1), ids_row, n, token, K)
    tl.store(flags_ptr + row, bad_p + tl.where(p_sum > 0.0, 0, 4))


def _block_v(v: int) -> int:
    return min(4096, triton.next_power_of_2(v))


def _on(dev: torch.device):
    """A context in which a kernel launches on ``dev``: Triton launches on the current CUDA device, which need not be
    the one the tensors are on (a verifier fed by a target on another GPU)."""
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def rejection_triton(target_probs, draft_token_ids, draft_probs, seeds, is_greedy, noise=None) -> torch.Tensor:
    """Launch :func:`rejection_kernel` on inputs that :func:`~.rejection.validate_inputs` accepted.

    Args:
        target_probs, draft_token_ids, draft_probs: as :func:`~.rejection.rejection_sample`.
        seeds: [B] int64 >= 0. is_greedy: [B] bool.
        noise: (uniform [B, k], exponential [B, V]) float32, or None: Philox in-kernel, keyed by (row seed, offset).

    Returns:
        [B, k+1] int64 on the input device.

    Raises:
        ValueError: a probability the kernel read was NaN, infinite or negative, or the target row it sampled from
            sums to zero: the torch path's errors (:mod:`spec_decode.verifier.checks`), from the kernel's flags.
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
    flags = torch.empty(b, dtype=torch.int32, device=dev)
    with _on(dev):
        rejection_kernel[(b,)](
            tp, dp, draft_token_ids.contiguous(), seeds.to(dev).contiguous(),
            is_greedy.to(device=dev, dtype=torch.int8).contiguous(), u, e, out, flags, k1 - 1, v,
            HAS_DRAFT_PROBS=draft_probs is not None, HAS_NOISE=noise is not None, BLOCK_V=_block_v(v),
        )
    raise_for_flags(flags)
    return out


def typical_triton(target_probs, draft_token_ids, posterior_threshold, posterior_alpha, seeds, is_greedy,
                   exponential=None) -> torch.Tensor:
    """Launch :func:`typical_kernel`: arguments as :func:`rejection_triton`, epsilon and alpha as
    :func:`~.rejection.typical_acceptance_sample`; ``exponential`` [B, V] float32 or None (Philox in-kernel).

    Returns:
        [B, k+1] int64 on the input device.

    Raises:
        ValueError: as :func:`rejection_triton`.
    """
    b, k1, v = target_probs.shape
    dev = target_probs.device
    out = torch.empty((b, k1), dtype=torch.int64, device=dev)
    flags = torch.empty(b, dtype=torch.int32, device=dev)
    e = (exponential.to(device=dev, dtype=torch.float32).contiguous() if exponential is not None
         else torch.empty(1, dtype=torch.float32, device=dev))
    with _on(dev):
        typical_kernel[(b,)](
            target_probs.contiguous(), draft_token_ids.contiguous(), seeds.to(dev).contiguous(),
            is_greedy.to(device=dev, dtype=torch.int8).contiguous(), e, out, flags, k1 - 1, v,
            as_float32(posterior_threshold), as_float32(posterior_alpha), HAS_NOISE=exponential is not None,
            BLOCK_V=_block_v(v),
        )
    raise_for_flags(flags)
    return out
