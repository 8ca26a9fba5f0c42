"""Tree verification's maths in torch (CPU path, and the reference the Triton kernels in ``tree_kernels`` are tested
against), with explicit noise as :mod:`spec_decode.verifier.torch_impl`: ``uniform`` [B, n] float32 in [0, 1) (node
i's accept test) and ``exponential`` [B, V] float32 > 0 (one race per row, for its recovered or bonus token).

A row's drafts are a tree (:mod:`spec_decode.tree`): node i carries ``draft_token_ids[b, i]`` (-1: a padding node,
ignored) and ``draft_parents[b, i]`` in [-1, i) (-1: a child of the last committed token); siblings carry distinct
tokens. Row 0 of ``target_probs`` follows the last committed token and row i + 1 follows node i. Both samplers walk
down from the root and return ``out`` [B, n+1] int64 (the accepted path's tokens, then the recovered or bonus token,
-1 padding) and ``path`` [B, n] int64 (the accepted node indices in order, -1 padding). Every row is processed in one
pass over the nodes in index order, vectorised over the batch; all comparisons are made in float32.
"""

from __future__ import annotations

import torch

from .checks import check_probabilities, check_sampled_rows
from .torch_impl import NEAR_TIE, TIE, _greedy_accepts, _neg_entropy, _race, _row_at, as_float32

FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: the floor of the draft's remaining mass qmass


def _at(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, V], idx [B] -> x[b, idx[b]] as [B]."""
    return x.gather(1, idx[:, None])[:, 0]


def _mass(r: torch.Tensor) -> torch.Tensor:
    """[B] float32: the rows of r [B, V] summed in float64, then rounded once (as the kernel sums its tiles), so
    both paths agree on the mass up to float64 rounding rather than float32 summation order."""
    return r.double().sum(-1).float()


def tree_rejection_torch(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniform: torch.Tensor,
    exponential: torch.Tensor,
    is_greedy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree rejection sampling with explicit noise: SpecInfer's multi-step speculative sampling (Miao et al. 2024)
    with the siblings of a node drawn without replacement as in Recursive Speculative Decoding (Jeon et al. 2024).

    Per row, cur = -1 (the root, whose distribution is row 0); p(cur) = target_probs[b, cur + 1]; the residual
    r = p(cur) with mass S = 1 and the draft's remaining mass qmass = 1. For each real node i whose parent is cur, in
    index order, with token x:

    - greedy row: accepted iff x == argmax p(cur) (lowest index on ties) and p(cur)[x] > 0;
    - no draft probabilities (q one-hot at x): accepted iff ``r[x] > 0 and u[i] * S < r[x]``; on rejection
      S -= r[x] and r[x] = 0 (S is tracked, never re-summed: S = 1 exactly at the first child);
    - with draft probabilities: q = draft_probs[b, i] (the distribution node i was drawn from; siblings drawn
      without replacement share it), q_i = q with the tokens of the siblings already rejected at cur zeroed, divided
      by qmass (floored at the smallest normal float32); accepted iff ``q_i(x) > 0 and (r[x] / S >= q_i(x) or
      u[i] * q_i(x) * S < r[x])`` (the chain's ``q > 0 and (p >= q or u * q < p)`` at the first child); on
      rejection r = max(r / S - q_i, 0), S = sum(r) (in float64, rounded to float32), qmass -= q(x), and when S <= 0
      r = p(cur), S = 1 (an empty residual falls back to p, as in the chain).

    On acceptance i joins the path, x is emitted and cur = i (r = p(i), S = 1, qmass = 1). At the end a greedy row
    emits argmax p(cur); a sampled row races r (p(cur) itself when no child of cur was tested: the bonus token; the
    residual otherwise; p(cur) when the residual has no positive entry) with ``exponential[b]`` (zero entries never
    win). For a chain (parents [-1, 0, 1, ...], -1 drafts only at the end) this is exactly
    :func:`~.torch_impl.rejection_torch`, bit for bit, for the same noise. Each emitted token follows the target's
    law given the tokens before it, when the drafts below each node are distinct draws without replacement from its
    q (or fixed tokens, without draft probabilities).

    Args:
        target_probs: [B, n+1, V] float32 (bfloat16/float16 accepted). draft_token_ids: [B, n] int64 (-1: padding
            node). draft_parents: [B, n] int64, checked by the caller (:func:`.tree_sampler.validate_tree`).
        draft_probs: [B, n, V] like ``target_probs``, or None (q one-hot at each node's token).
        uniform: [B, n] float32 in [0, 1). exponential: [B, V] float32 > 0. is_greedy: [B] bool.

    Returns:
        (out [B, n+1] int64, path [B, n] int64), as the module docstring says.

    Raises:
        ValueError: NaN, infinite or negative probabilities; a target row the row samples from that sums to zero
            (:mod:`spec_decode.verifier.checks`).
    """
    check_probabilities("target_probs", target_probs)
    check_probabilities("draft_probs", draft_probs)
    tp = target_probs.float()
    dp = draft_probs.float() if draft_probs is not None else None
    b, n1, v = tp.shape
    n = n1 - 1
    dev = tp.device
    rows = torch.arange(b, device=dev)
    amax = tp.argmax(-1)  # [B, n+1]: each row's greedy token
    out = torch.full((b, n1), -1, dtype=torch.int64, device=dev)
    path = torch.full((b, n), -1, dtype=torch.int64, device=dev)
    depth = torch.zeros(b, dtype=torch.int64, device=dev)
    cur = torch.full((b,), -1, dtype=torch.int64, device=dev)
    p_cur = tp[:, 0].clone()
    r = p_cur.clone()
    mass = torch.ones(b, device=dev)  # S
    qmass = torch.ones(b, device=dev)
    rejected = torch.zeros(b, v, dtype=torch.bool, device=dev)  # the tokens of cur's rejected children
    sampled = ~is_greedy
    for i in range(n):
        x = draft_token_ids[:, i]
        test = (x >= 0) & (draft_parents[:, i] == cur)
        if not bool(test.any()):
            continue
        xs = x.clamp_min(0)
        u = uniform[:, i]
        r_x = _at(r, xs)
        greedy_ok = (xs == _at(amax, cur + 1)) & (_at(p_cur, xs) > 0)
        if dp is None:
            ok = (r_x > 0) & (u * mass < r_x)
        else:
            q = dp[:, i]
            q_x = _at(q, xs)
            qm = qmass.clamp_min(FLOAT32_TINY)
            q_ix = q_x / qm  # x is no rejected sibling (siblings differ): q_i(x) = q(x) / qmass
            ok = (q_ix > 0) & ((r_x / mass >= q_ix) | (u * q_ix * mass < r_x))
        ok = test & torch.where(is_greedy, greedy_ok, ok)
        reject = test & ~ok & sampled
        if bool(reject.any()):
            if dp is None:
                mass = torch.where(reject, mass - r_x, mass)
                r = r.scatter(1, xs[:, None], torch.where(reject, 0.0, r_x)[:, None])
            else:
                q_i = torch.where(rejected, 0.0, q) / qm[:, None]
                new_r = torch.clamp(r / mass[:, None] - q_i, min=0.0)
                new_mass = _mass(new_r)
                empty = new_mass <= 0  # p(cur) <= q_i everywhere: fall back to p(cur)
                new_r = torch.where(empty[:, None], p_cur, new_r)
                new_mass = torch.where(empty, 1.0, new_mass)
                r = torch.where(reject[:, None], new_r, r)
                mass = torch.where(reject, new_mass, mass)
                qmass = torch.where(reject, qmass - q_x, qmass)
        rejected[rows, xs] |= test & ~ok
        if bool(ok.any()):
            path[rows[ok], depth[ok]] = i
            out[rows[ok], depth[ok]] = x[ok]
            depth = depth + ok.to(torch.int64)
            cur = torch.where(ok, i, cur)
            p_cur = torch.where(ok[:, None], tp[:, i + 1], p_cur)
            r = torch.where(ok[:, None], p_cur, r)
            mass = torch.where(ok, 1.0, mass)
            qmass = torch.where(ok, 1.0, qmass)
            rejected &= ~ok[:, None]

    check_sampled_rows(p_cur)
    token = _at(amax, cur + 1)
    if not bool(is_greedy.all()):
        d = torch.where((r.sum(-1) > 0)[:, None], r, p_cur)  # a residual with no positive entry: p(cur)
        token = torch.where(is_greedy, token, _race(d, exponential))
    out[rows, depth] = token
    return out, path


def _pass_typical(p_par: torch.Tensor, ids: torch.Tensor, posterior_threshold: float,
                  posterior_alpha: float) -> torch.Tensor:
    """[B, n] bool: p_par[b, i] (the parent's distribution) passes typical acceptance at ids[b, i] (as
    :func:`~.torch_impl.typical_torch`: float32, float64 near the threshold, exact ties rejected)."""
    eps, alpha = as_float32(posterior_threshold), as_float32(posterior_alpha)
    p_x = p_par.gather(-1, ids.clamp_min(0)[..., None])[..., 0]
    threshold = torch.clamp(alpha * torch.exp(_neg_entropy(p_par)), max=eps)  # [B, n] float32
    above = p_x > threshold
    near = (p_x - threshold).abs() <= threshold * NEAR_TIE
    if bool(near.any()):  # rare: decide these in float64, where only exact ties remain (as the kernel does)
        t64 = torch.clamp(alpha * torch.exp(_neg_entropy(p_par[near].double())), max=eps)
        above[near] = (p_x[near].double() - t64) > t64 * TIE
    return above


def tree_typical_torch(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_parents: torch.Tensor,
    posterior_threshold: float,
    posterior_alpha: float,
    exponential: torch.Tensor,
    is_greedy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree typical acceptance with explicit noise (Medusa, Cai et al. 2024: tree attention with typical acceptance,
    the longest accepted candidate wins). NOT lossless.

    Node i passes when its token x passes the chain's test against its parent's distribution p (row parent + 1):
    p(x) > min(epsilon, alpha * exp(-H(p))), decided as :func:`~.torch_impl.typical_torch` decides it (float64 near
    the threshold, exact ties rejected); on a greedy row, when x is the argmax of p and p(x) > 0. The accepted path
    ends at the deepest node all of whose path passes (ties: the lowest index; none: the root). The final token is
    argmax p(end) when the end node has a real child (a rejected draft), else a race of p(end) with
    ``exponential[b]`` (the bonus token; argmax on a greedy row). For a chain this is exactly
    :func:`~.torch_impl.typical_torch`.

    Args:
        target_probs, draft_token_ids, draft_parents, exponential, is_greedy: as :func:`tree_rejection_torch`.
        posterior_threshold: epsilon >= 0. posterior_alpha: alpha >= 0 (both used as float32).

    Returns:
        (out [B, n+1] int64, path [B, n] int64) as :func:`tree_rejection_torch`.

    Raises:
        ValueError: NaN, infinite or negative probabilities; a sampled target row that sums to zero.
    """
    check_probabilities("target_probs", target_probs)
    tp = target_probs.float()
    b, n1, v = tp.shape
    n = n1 - 1
    dev = tp.device
    rows = torch.arange(b, device=dev)
    ids, par = draft_token_ids, draft_parents.clamp(-1, max(n - 1, 0))
    p_par = tp[rows[:, None], par + 1]  # [B, n, V]; a chain's is tp[:, :n], as typical_torch reads it
    p_x = p_par.gather(-1, ids.clamp_min(0)[..., None])[..., 0]
    ok = (ids >= 0) & torch.where(is_greedy[:, None], _greedy_accepts(p_par, ids, p_x),
                                  _pass_typical(p_par, ids, posterior_threshold, posterior_alpha))
    depth = torch.zeros(b, n, dtype=torch.int64, device=dev)  # a node's depth if its whole path passes, else 0
    for i in range(n):
        above = torch.where(par[:, i] >= 0, depth.gather(1, par[:, i : i + 1].clamp_min(0))[:, 0], 0)
        depth[:, i] = torch.where(ok[:, i] & ((par[:, i] < 0) | (above > 0)), above + 1, 0)
    best, end = (depth.max(-1) if n else (depth.new_zeros(b), depth.new_zeros(b)))  # ties: the lowest index
    end = torch.where(best > 0, end, -1)
    out = torch.full((b, n1), -1, dtype=torch.int64, device=dev)
    path = torch.full((b, n), -1, dtype=torch.int64, device=dev)
    node = end
    for step in range(int(best.max()) if n else 0):  # walk up from the end node, filling the path backwards
        pos = best - 1 - step
        live = pos >= 0
        safe = node.clamp_min(0)
        path[rows[live], pos[live]] = safe[live]
        out[rows[live], pos[live]] = ids[rows, safe][live]
        node = torch.where(live, par[rows, safe], node)
    p_end = _row_at(tp, end + 1)
    check_sampled_rows(p_end)
    has_child = ((draft_parents == end[:, None]) & (ids >= 0)).any(-1)
    token = torch.where(has_child | is_greedy, p_end.argmax(-1), _race(p_end, exponential))
    out[rows, best] = token
    return out, path
