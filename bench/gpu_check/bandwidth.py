"""Part 2 of the GPU check: the verifier's bytes of probabilities per second against the device's copy bandwidth.

At (B, k, V) = ``ctx.sizes.bandwidth`` (64, 5, 128256 on CUDA), with draft probabilities, sampled and greedy rows,
each probability dtype: the kernel launch alone, ``rejection_triton`` (with its flag check), the public
``rejection_sample`` on each backend, and the torch maths alone, against a device-to-device copy measured in the same
run (1 GiB on CUDA, read + write counted). Two byte counts: the tensors' size (target [B, k+1, V] + draft [B, k, V]),
counted for the torch rows, which read them whole; and what the kernel must read (per row the position it samples
from, plus every drafted position's row for greedy rows), counted for the kernel rows. On CPU only the torch rows are
timed (the interpreter's time means nothing).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from spec_decode.verifier import rejection_sample
from spec_decode.verifier.kernels import rejection_triton
from spec_decode.verifier.torch_impl import rejection_torch

from .context import Context
from .kernels import exponential, make_case


def copy_bandwidth_gb_s(ctx: Context, nbytes: int) -> float:
    """GB/s (1e9 bytes/s) of a device-to-device copy of ``nbytes`` bytes (read + write counted), best of 10."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=ctx.device).uniform_()
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(10):
        ctx.sync()
        t = time.perf_counter()
        dst.copy_(src)
        ctx.sync()
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9


def bench_seconds(ctx: Context, fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``fn()``: on CUDA by ``triton.testing.do_bench`` (CUDA events, the L2 cache flushed before
    each run, so rows re-read across repeats come from memory as in serving), on CPU by
    :meth:`~bench.gpu_check.context.Context.timed` over ``reps`` runs."""
    if not ctx.cuda:
        return ctx.timed(fn, reps)
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def bandwidth(ctx: Context) -> dict:
    """The verifier's bytes per second at ``ctx.sizes.bandwidth`` against the device's copy bandwidth.

    Returns:
        dict: B, k, V, copy_GB_per_s, rows (per variant, dtype and row kind: seconds, tensor_bytes,
        kernel_read_bytes, counted_bytes, GB_per_s, fraction_of_copy) and bytes (what each row counts).
    """
    from spec_decode.verifier.kernels import _block_v, rejection_kernel

    dev = ctx.device
    b, k, v = ctx.sizes.bandwidth
    peak = copy_bandwidth_gb_s(ctx, 1 << 30 if ctx.cuda else 1 << 26)
    gen = torch.Generator(device=dev).manual_seed(5)
    rows = []
    reps = ctx.sizes.reps if ctx.cuda else 2

    # the kernel alone: buffers ready, no flag check (no host sync)
    def launch(tp, dp, ids, seeds, greedy8, u, e, out, flags):
        rejection_kernel[(b,)](tp, dp, ids, seeds, greedy8, u, e, out, flags, k, v, HAS_DRAFT_PROBS=True,
                               HAS_NOISE=False, BLOCK_V=_block_v(v))

    for dtype in ctx.sizes.dtypes:
        tp, ids, dp = make_case(dev, b, k, v, dtype, True, gen)
        ids[ids < 0] = 0  # no placeholders here
        seeds = torch.arange(b, dtype=torch.int64, device=dev)
        u, e = torch.rand((b, k), generator=gen, device=dev), exponential((b, v), gen, dev)
        elt = tp.element_size()
        tensor_bytes = (tp.numel() + dp.numel()) * elt
        out = torch.empty((b, k + 1), dtype=torch.int64, device=dev)
        flags = torch.empty(b, dtype=torch.int32, device=dev)
        for greedy_rows in (False, True):
            greedy = torch.full((b,), greedy_rows, dtype=torch.bool, device=dev)
            greedy8 = greedy.to(torch.int8)
            n = ((rejection_triton(tp, ids, dp, seeds, greedy) >= 0).sum(-1) - 1).cpu()
            # What the kernel reads: the row it samples from (p, and q where a draft was rejected there), and for
            # greedy rows the target row of every position up to the first rejection (the argmax check).
            read_bytes = sum((1 + (int(m) < k) + (min(int(m) + 1, k) if greedy_rows else 0)) * v * elt for m in n)
            variants = {
                "kernel launch": (partial(launch, tp, dp, ids, seeds, greedy8, u, e, out, flags), read_bytes),
                "rejection_triton (+ flag check)": (partial(rejection_triton, tp, ids, dp, seeds, greedy), read_bytes),
                "rejection_sample(backend=triton)": (partial(
                    rejection_sample, tp, ids, dp, seeds=seeds, is_greedy=greedy, backend="triton"), read_bytes),
                # the torch path reads the whole tensors (several passes): counted at their size
                "torch maths (noise given)": (partial(rejection_torch, tp, ids, dp, u, e, greedy), tensor_bytes),
                "rejection_sample(backend=torch)": (partial(
                    rejection_sample, tp, ids, dp, seeds=seeds, is_greedy=greedy, backend="torch"), tensor_bytes),
            }
            if not ctx.cuda:  # the interpreter's time means nothing: keep the CPU mode short
                variants = {name: fn for name, fn in variants.items() if "torch" in name}
            for name, (fn, counted) in variants.items():
                sec = bench_seconds(ctx, fn, reps)
                rows.append({"variant": name, "dtype": str(dtype)[6:], "greedy": greedy_rows, "seconds": sec,
                             "tensor_bytes": tensor_bytes, "kernel_read_bytes": read_bytes, "counted_bytes": counted,
                             "GB_per_s": counted / sec / 1e9, "fraction_of_copy": counted / sec / 1e9 / peak})
    for r in rows:
        print(f"  {r['variant']:<34}{r['dtype']:>9}{' greedy' if r['greedy'] else ' sampled':>9}"
              f"{r['seconds'] * 1e3:>9.3f} ms{r['GB_per_s']:>9.1f} GB/s ={100 * r['fraction_of_copy']:>6.1f}% of copy",
              flush=True)
    return {"B": b, "k": k, "V": v, "copy_GB_per_s": peak, "rows": rows,
            "bytes": "kernel rows: what the kernel reads (kernel_read_bytes); torch rows: the tensors' size"}
