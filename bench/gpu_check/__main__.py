"""The GPU check's command line: ``python -m bench.gpu_check [--device auto|cuda|cpu] [--output PATH] [--budget-s S]``.

Nothing is parsed or imported on import: :func:`main` settles the device and ``TRITON_INTERPRET`` before anything
imports triton (the parts' modules define the kernels when imported), then runs the parts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DECODING_DTYPES = ("float32", "bfloat16")
PARTS = ("kernels", "distribution", "batch_invariance", "bandwidth", "decoding", "big_batch")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options: device, output (a JSON path), budget_s (seconds), parts, dtypes (the decoding part's)."""
    from bench import gpu_check

    summary = (gpu_check.__doc__ or "").split("\n\n")[0]
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=summary)
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="cuda: the full check; cpu: tiny sizes, kernels under TRITON_INTERPRET=1 (auto: cuda if any)")
    ap.add_argument("--output", type=Path, default=ROOT / "results" / "gpu_check.json")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds after which the decoding part's remaining runs are skipped (reported as skipped)")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                    help="run only these parts (a rerun of one part; the check then reports itself incomplete)")
    ap.add_argument("--dtypes", nargs="+", choices=DECODING_DTYPES, default=list(DECODING_DTYPES),
                    help="the decoding part's model dtypes")
    ap.add_argument("--methods", nargs="+", default=None,
                    help="the decoding part's methods (default: every one; none always runs; self: the target "
                         "drafting for itself)")
    return ap.parse_args(argv)


def select_device(requested: str) -> str:
    """The device to run on (``cuda`` or ``cpu``) for ``--device requested``, with ``TRITON_INTERPRET=1`` set for CPU
    mode before triton is imported (``cpu``: before torch is; ``auto``: once torch says there is no CUDA).

    Raises:
        SystemExit: ``auto`` found no CUDA, but triton was imported already without ``TRITON_INTERPRET=1``.
    """
    if requested == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if requested != "auto":
        return requested
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise SystemExit("gpu_check: CPU mode needs TRITON_INTERPRET=1 before triton is imported: use --device cpu")
        os.environ["TRITON_INTERPRET"] = "1"
    return device


def main(argv: list[str] | None = None) -> int:
    """Run the parts, save the JSON after each (kept if a later part hangs), print the table.

    Args:
        argv: the command line's arguments (default: ``sys.argv[1:]``).

    Returns:
        0 when every check passed and nothing was skipped; 1 otherwise (a failed check, a crashed part, a skipped
        decoding run, or Triton unable to build its launchers).
    """
    args = parse_args(argv)
    device = select_device(args.device)
    if args.methods:
        from .decoding import DECODING_METHODS as known

        unknown = sorted(set(args.methods) - set(known))
        if unknown:
            raise SystemExit(f"gpu_check: --methods {unknown}: not among {', '.join(known)}")
    import torch

    # Only now: these modules import triton's kernels, which read TRITON_INTERPRET when defined.
    from .bandwidth import bandwidth
    from .context import Context
    from .decoding import DECODING_METHODS, decoding
    from .kernels import batch_invariance, big_batch, distribution, kernels_vs_torch
    from .report import table, toolchain, versions

    torch.set_float32_matmul_precision("highest")  # float32 GEMMs in IEEE float32 (no TF32): the exact greedy check
    ctx = Context.for_device(device)
    start = time.perf_counter()
    deadline = start + args.budget_s
    result: dict = {"mode": ctx.device.type, "versions": versions(ctx), "toolchain": toolchain(), "parts": {}}
    print(f"gpu_check: {result['versions']} {result['toolchain']}", flush=True)
    methods = args.methods or DECODING_METHODS
    runs = {"kernels": kernels_vs_torch, "distribution": distribution, "batch_invariance": batch_invariance,
            "bandwidth": bandwidth, "decoding": lambda c: decoding(c, deadline, args.dtypes, methods),
            "big_batch": big_batch}
    # big_batch last: an illegal address there would be a sticky CUDA error for the rest
    parts = [p for p in PARTS if p in args.parts]
    if not result["toolchain"]["ok"]:
        ctx.fail(f"Triton cannot build its kernels' launchers (needs a C compiler and Python.h): "
                 f"{result['toolchain']}; the kernel parts are skipped and decoding verifies with the torch backend")
        parts = ["decoding"]
        ctx.verifier_backend = "torch"
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for name in parts:
        t = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            result["parts"][name] = runs[name](ctx)
        except Exception as exc:  # noqa: BLE001 - one part's crash is reported and the rest still run
            ctx.fail(f"{name} crashed: {type(exc).__name__}: {exc}")
            result.setdefault("tracebacks", {})[name] = traceback.format_exc()
            print(traceback.format_exc(), flush=True)
        result.setdefault("part_seconds", {})[name] = round(time.perf_counter() - t, 1)
        result["seconds"] = time.perf_counter() - start
        result["failures"] = ctx.failures
        args.output.write_text(json.dumps(result, indent=2, default=str))  # kept if a later part hangs
    skipped = [r for r in result["parts"].get("decoding", {}).get("runs", []) if "skipped" in r]
    every_method = not args.methods or set(args.methods) >= set(DECODING_METHODS)
    result["complete"] = len(result["parts"]) == len(PARTS) and not skipped and every_method
    result["passed"] = not ctx.failures and result["complete"]
    result["table"] = table(result)
    args.output.write_text(json.dumps(result, indent=2, default=str))
    print(result["table"])
    print(f"saved {args.output}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
