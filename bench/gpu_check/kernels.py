"""Part 1 of the GPU check: the verifier's Triton kernels against its torch path, and the kernels' own randomness.

Each check compares :mod:`spec_decode.verifier.kernels` (``rejection_triton``, ``typical_triton``, and the public
``rejection_sample(backend="triton")`` with in-kernel Philox noise) with :mod:`spec_decode.verifier.torch_impl` on the
same device; a disagreement is recorded with :meth:`~bench.gpu_check.context.Context.fail`, never raised. Importing
this module defines the Triton kernels: on CPU, ``TRITON_INTERPRET=1`` must be set before.
"""

from __future__ import annotations

import json
from functools import partial

import torch

from spec_decode.verifier import rejection_sample, typical_acceptance_sample
from spec_decode.verifier.kernels import rejection_triton, typical_triton
from spec_decode.verifier.rejection import TYPICAL_ALPHA, TYPICAL_EPSILON
from spec_decode.verifier.torch_impl import rejection_torch, typical_torch

from .context import Context

EPS, ALPHA = TYPICAL_EPSILON, TYPICAL_ALPHA  # typical acceptance's defaults


def exponential(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Exp(1) noise, the exponential race's E: float32 of ``shape`` on ``device``, every value > 0."""
    u = torch.rand(shape, generator=gen, device=device)
    return (-torch.log1p(-u)).clamp_min(1e-30)


def make_case(device: torch.device, b: int, k: int, v: int, dtype: torch.dtype, with_draft_probs: bool,
              gen: torch.Generator, peak: float = 3.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random verifier inputs: peaked target rows, draft rows near them, drafts drawn from the draft rows.

    Args:
        device: where the tensors are made.
        b, k, v: rows, drafts per row, vocabulary.
        dtype: of the probabilities.
        with_draft_probs: whether to return the draft rows (else None: the drafts count as one-hot).
        gen: a generator on ``device``.
        peak: the standard deviation of the target's logits (larger: more peaked rows).

    Returns:
        (target_probs [b, k+1, v] ``dtype``, draft_token_ids [b, k] int64 with a -1 placeholder ending every fifth
        row's drafts when k > 1, draft_probs [b, k, v] ``dtype`` or None), on ``device``.
    """
    logits = torch.randn((b, k + 1, v), generator=gen, device=device) * peak
    tp = torch.softmax(logits, -1)
    q = torch.softmax(logits[:, :k] + torch.randn((b, k, v), generator=gen, device=device), -1)
    ids = torch.argmax(q / exponential((b, k, v), gen, device), -1)  # x ~ q (exponential race)
    if k > 1:
        ids[4::5, -1] = -1
    dp = q.to(dtype) if with_draft_probs else None
    return tp.to(dtype), ids, dp


def check_output_shape(ctx: Context, out: torch.Tensor, ids: torch.Tensor, tp: torch.Tensor, label: str) -> None:
    """Fail ``label`` unless every row of ``out`` [B, k+1] is the accepted drafts of ``ids`` [B, k], then one token
    with p > 0 under ``tp`` [B, k+1, V] at its position, then -1."""
    b, k1 = out.shape
    n = (out >= 0).sum(-1) - 1
    pos = torch.arange(k1, device=out.device)[None]
    drafts = torch.cat([ids, ids.new_full((b, 1), -1)], 1)
    ok = torch.where(pos < n[:, None], out == drafts, torch.where(pos == n[:, None], out >= 0, out == -1))
    tok = out.gather(1, n[:, None])[:, 0]
    p_tok = tp[torch.arange(b, device=out.device), n, tok.clamp_min(0)]
    if not bool(ok.all()) or not bool((p_tok > 0).all()):
        ctx.fail(f"{label}: malformed output (accepted prefix, a token with p > 0, -1 after)")


def kernels_vs_torch(ctx: Context) -> dict:
    """Every (V, k, B, dtype) of ``ctx.sizes``: the kernels equal the torch path fed the same noise, for rejection
    sampling with and without draft probabilities and typical acceptance, greedy and sampled rows; and the in-kernel
    Philox path gives well-formed output.

    Returns:
        dict: compared and equal (counts of comparisons), cases (one row per comparison).
    """
    s, dev = ctx.sizes, ctx.device
    gen = torch.Generator(device=dev).manual_seed(1)
    rows, compared, equal = [], 0, 0
    for v in s.vocabs:
        for k in s.ks:
            for b in s.batches:
                for dtype in s.dtypes:
                    seeds = torch.arange(b, dtype=torch.int64, device=dev) + 1000
                    u = torch.rand((b, k), generator=gen, device=dev)
                    e = exponential((b, v), gen, dev)
                    for with_dp in (True, False):
                        tp, ids, dp = make_case(dev, b, k, v, dtype, with_dp, gen)
                        for greedy_rows in (False, True):
                            greedy = torch.full((b,), greedy_rows, dtype=torch.bool, device=dev)
                            kinds = [("rejection", partial(rejection_triton, tp, ids, dp, seeds, greedy, (u, e)),
                                      partial(rejection_torch, tp, ids, dp, u, e, greedy))]
                            if not with_dp:
                                kinds.append(("typical",
                                              partial(typical_triton, tp, ids, EPS, ALPHA, seeds, greedy, e),
                                              partial(typical_torch, tp, ids, EPS, ALPHA, e, greedy)))
                            for name, kernel, reference in kinds:
                                label = (f"{name} V={v} k={k} B={b} {str(dtype)[6:]} "
                                         f"{'draft probs' if with_dp else 'no draft probs'} "
                                         f"{'greedy' if greedy_rows else 'sampled'}")
                                try:
                                    got, want = kernel(), reference()
                                    same = bool(torch.equal(got, want))
                                except Exception as exc:  # noqa: BLE001 - reported as a failed check
                                    ctx.fail(f"{label}: {type(exc).__name__}: {exc}")
                                    continue
                                compared += 1
                                equal += same
                                if not same:
                                    rows_off = torch.nonzero((got != want).any(-1)).reshape(-1).tolist()
                                    ctx.fail(f"{label}: kernel != torch in rows {rows_off[:8]}")
                                check_output_shape(ctx, got, ids, tp, label)
                                accepted = float(((got >= 0).sum(-1) - 1).float().mean()) / k
                                rows.append({"sampler": name, "V": v, "k": k, "B": b, "dtype": str(dtype)[6:],
                                             "draft_probs": with_dp, "greedy": greedy_rows, "equal": same,
                                             "mean_accepted_fraction": round(accepted, 3)})
                            # The in-kernel Philox path (what serving runs): well-formed output.
                            out = rejection_sample(tp, ids, dp, seeds=seeds, is_greedy=greedy, backend="triton")
                            check_output_shape(ctx, out, ids, tp, f"philox V={v} k={k} B={b}")
    print(f"kernels vs torch: {equal}/{compared} comparisons equal", flush=True)
    return {"compared": compared, "equal": equal, "cases": rows}


def _chi_square(observed: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic of ``observed`` counts against ``probs`` and its p-value (df = cells - 1)."""
    n = float(observed.sum())
    expected = probs.double().cpu() * n
    stat = float(((observed.double().cpu() - expected) ** 2 / expected).sum())
    df = observed.numel() - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, p_value


def distribution(ctx: Context) -> dict:
    """The kernels' own randomness: the first emitted token, the token after an accepted draft and the bonus token
    after k accepted drafts follow the target's distribution (chi-square; a p-value below 1e-6 fails), with and
    without draft probabilities.

    Returns:
        dict: rows, V, k, and tests (per draft-probs case and test: samples, chi2, p_value).
    """
    s, dev = ctx.sizes, ctx.device
    gen = torch.Generator(device=dev).manual_seed(2)
    n, v, k = s.dist_rows, s.dist_v, s.dist_k
    p = torch.softmax(torch.randn((k + 1, v), generator=gen, device=dev), -1)
    q = torch.softmax(torch.randn((k, v), generator=gen, device=dev), -1)
    ids = torch.multinomial(q, n, replacement=True, generator=gen).T.contiguous()  # [n, k], x_i ~ q_i
    tp = p.expand(n, k + 1, v).contiguous()
    out = {}
    for with_dp in (True, False):
        dp = q.expand(n, k, v).contiguous() if with_dp else None
        seeds = torch.arange(n, dtype=torch.int64, device=dev) + (0 if with_dp else n)
        got = rejection_sample(tp, ids, dp, seeds=seeds, backend="triton")
        tests = {}
        first = got[:, 0]
        tests["first token ~ p0"] = (first, p[0])
        after = got[:, 1][(first == ids[:, 0]) & (got[:, 1] >= 0)]  # draft 0 accepted: the next token ~ p1
        tests["token after an accepted draft ~ p1"] = (after, p[1])
        bonus = got[:, k][(got[:, :k] == ids).all(-1)]
        tests[f"bonus after {k} accepted ~ p{k}"] = (bonus, p[k])
        res = {}
        for name, (tokens, probs) in tests.items():
            counts = torch.bincount(tokens, minlength=v)
            stat, pv = _chi_square(counts, probs)
            res[name] = {"samples": int(counts.sum()), "chi2": round(stat, 2), "p_value": pv}
            if pv < 1e-6:
                ctx.fail(f"distribution ({'draft probs' if with_dp else 'no draft probs'}) {name}: p-value {pv:.2e}")
        out["draft probs" if with_dp else "no draft probs"] = res
    print(f"distribution: {json.dumps(out)}", flush=True)
    return {"rows": n, "V": v, "k": k, "tests": out}


def big_batch(ctx: Context) -> dict:
    """B x (k+1) x V above 2^31 elements on CUDA (bfloat16): the kernel (64-bit offsets) equals the torch path, and
    the Philox path gives well-formed output.

    Returns:
        dict: B, k, V, elements, above_2_31, dtype, equal, last_row_tokens.
    """
    s, dev = ctx.sizes, ctx.device
    b, k, v = s.big_b, s.big_k, s.big_v
    gen = torch.Generator(device=dev).manual_seed(3)
    tp = torch.empty((b, k + 1, v), dtype=torch.bfloat16, device=dev)
    dp = torch.empty((b, k, v), dtype=torch.bfloat16, device=dev)
    ids = torch.empty((b, k), dtype=torch.int64, device=dev)
    for start in range(0, b, 64):  # fill in chunks (float32 temporaries stay small)
        t, i, d = make_case(dev, min(64, b - start), k, v, torch.bfloat16, True, gen)
        tp[start:start + 64], ids[start:start + 64], dp[start:start + 64] = t, i, d
    del t, i, d
    seeds = torch.arange(b, dtype=torch.int64, device=dev)
    greedy = torch.zeros(b, dtype=torch.bool, device=dev)
    greedy[1::3] = True
    u = torch.rand((b, k), generator=gen, device=dev)
    e = exponential((b, v), gen, dev)
    got = rejection_triton(tp, ids, dp, seeds, greedy, (u, e))
    want = rejection_torch(tp, ids, dp, u, e, greedy)
    same = bool(torch.equal(got, want))
    if not same:
        ctx.fail(f"big batch B={b} k={k} V={v}: kernel != torch in rows "
                 f"{torch.nonzero((got != want).any(-1)).reshape(-1).tolist()[:8]}")
    philox = rejection_sample(tp, ids, dp, seeds=seeds, is_greedy=greedy, backend="triton")
    check_output_shape(ctx, philox, ids, tp, "big batch philox")
    res = {"B": b, "k": k, "V": v, "elements": b * (k + 1) * v, "above_2_31": b * (k + 1) * v > 2**31,
           "dtype": "bfloat16", "equal": same, "last_row_tokens": got[-1].tolist()}
    print(f"big batch: {res}", flush=True)
    del tp, dp, e
    if ctx.cuda:
        torch.cuda.empty_cache()
    return res


def batch_invariance(ctx: Context) -> dict:
    """A seeded row gives the same tokens alone, in its batch, and in the batch reversed (rejection sampling and
    typical acceptance, both backends).

    Returns:
        dict: B, k, V, invariant (``"<sampler> <backend>"`` -> bool).
    """
    dev = ctx.device
    b, k, v = ctx.sizes.invariance
    gen = torch.Generator(device=dev).manual_seed(4)
    tp, ids, dp = make_case(dev, b, k, v, torch.float32, True, gen)
    seeds = torch.arange(b, dtype=torch.int64, device=dev) * 7919 + 3
    res = {}
    backends = ("triton", "torch")
    for backend in backends:
        for name, run in (
            ("rejection", lambda sl, s, be: rejection_sample(tp[sl], ids[sl], dp[sl], seeds=s, backend=be)),
            ("typical", lambda sl, s, be: typical_acceptance_sample(tp[sl], ids[sl], seeds=s, backend=be)),
        ):
            whole = run(slice(None), seeds, backend)
            rev = torch.arange(b - 1, -1, -1, device=dev)
            reversed_ = run(rev, seeds[rev], backend).flip(0)
            alone = torch.cat([run(slice(r, r + 1), seeds[r:r + 1], backend) for r in range(b)])
            same = bool(torch.equal(whole, reversed_)) and bool(torch.equal(whole, alone))
            res[f"{name} {backend}"] = same
            if not same:
                ctx.fail(f"seeded batch invariance: {name} on {backend} differs between a row alone and in its batch")
    print(f"batch invariance (B={b}, k={k}, V={v}): {res}", flush=True)
    return {"B": b, "k": k, "V": v, "invariant": res}
