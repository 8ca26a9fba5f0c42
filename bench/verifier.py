"""Benchmark of the verifier: torch path and Triton kernels, with achieved memory bandwidth against the device's peak.

    python -m bench.verifier [--quick] [--output results/verifier.json]

For B in {1, 8, 64}, k in {1, 4, 8}, V in {32000, 49152, 128256} (float32, with draft probabilities), it times
``rejection_sample`` on each backend available (torch always; the Triton kernels where CUDA is available) and reports
bytes of probabilities per call (target [B, k+1, V] + draft [B, k, V], float32) divided by the time: the bandwidth the
call would need if it read them all once, beside the peak measured by a large device copy in the same run. On CPU the
kernels only run under the interpreter (far too slow to time), so the table has the torch path alone.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from functools import partial
from pathlib import Path

import torch

from spec_decode.verifier import rejection_sample


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def peak_copy_bandwidth(dev: torch.device, nbytes: int = 1 << 30) -> float:
    """GB/s of a large tensor copy on ``dev`` (read + write counted), best of 5."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(dev)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9


def time_call(fn, dev, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    """Run the sweep, print the table, save JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="B in {1, 8}, V in {32000, 49152}: a fast smoke run")
    ap.add_argument("--output", type=Path, default=Path("results/verifier.json"))
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = ["torch", "triton"] if dev.type == "cuda" else ["torch"]
    bs, ks, vs = ([1, 8], [1, 4, 8], [32000, 49152]) if args.quick else ([1, 8, 64], [1, 4, 8], [32000, 49152, 128256])
    peak = peak_copy_bandwidth(dev)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu"
    print(f"device: {name}; measured copy bandwidth {peak:.1f} GB/s")
    print(f"{'backend':<8}{'B':>4}{'k':>4}{'V':>8}{'MB/call':>10}{'ms':>10}{'GB/s':>9}{'% peak':>8}")
    rows = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for b in bs:
        for k in ks:
            for v in vs:
                tp = torch.softmax(torch.randn(b, k + 1, v, generator=g), -1).to(dev)
                dp = torch.softmax(torch.randn(b, k, v, generator=g), -1).to(dev)
                ids = torch.multinomial(dp.reshape(-1, v).cpu(), 1, generator=g).reshape(b, k).to(dev)
                seeds = torch.arange(b, dtype=torch.int64)
                nbytes = (tp.numel() + dp.numel()) * 4
                for be in backends:
                    s = time_call(partial(rejection_sample, tp, ids, dp, seeds=seeds, backend=be), dev, args.reps)
                    gbs = nbytes / s / 1e9
                    rows.append({"backend": be, "B": b, "k": k, "V": v, "bytes": nbytes, "seconds": s, "GB_per_s": gbs,
                                 "fraction_of_peak": gbs / peak})
                    print(f"{be:<8}{b:>4}{k:>4}{v:>8}{nbytes / 1e6:>10.1f}{s * 1e3:>10.3f}{gbs:>9.1f}"
                          f"{100 * gbs / peak:>7.1f}%", flush=True)
                del tp, dp
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"device": name, "peak_copy_GB_per_s": peak, "rows": rows}, indent=2))
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
