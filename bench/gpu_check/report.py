"""The GPU check's report: the machine's versions and toolchain, and the short table printed at the end."""

from __future__ import annotations

import os
import platform
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import torch

from .context import FORWARD_NEW_POSITIONS, Context


def versions(ctx: Context) -> dict:
    """python, torch, triton, transformers and numpy versions; on CUDA also device_name, cuda and capability."""
    import transformers
    import triton

    v = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
         "transformers": transformers.__version__, "numpy": np.__version__}
    if ctx.cuda:
        v["device_name"] = torch.cuda.get_device_name()
        v["cuda"] = torch.version.cuda
        v["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return v


def toolchain() -> dict:
    """What Triton needs to build its kernels' launchers on first use: a C compiler and Python's headers.

    Returns:
        dict: c_compiler (``$CC`` or the first of gcc, cc, clang on PATH; None if none), python_headers (bool), ok.
    """
    cc = os.environ.get("CC") or next((c for c in ("gcc", "cc", "clang") if shutil.which(c)), None)
    headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    return {"c_compiler": cc, "python_headers": headers, "ok": bool(cc) and headers}


def equal_note(run: dict) -> str:
    """How a decoding run that differs from plain greedy decoding differs: only at near-ties, or not."""
    return (f"False ({run['mismatched_sequences']} at near-ties)" if run.get("divergences_at_near_ties")
            else f"False ({run['mismatched_sequences']} sequences)")


def table(result: dict) -> str:
    """The short summary printed at the end (and kept in the JSON) of ``result``: mode, versions, seconds, passed,
    complete, failures, and the parts that ran (see each part's return value)."""
    lines = [f"gpu_check on {result['mode']} ({result['versions'].get('device_name', 'CPU, kernels interpreted')}), "
             f"{result['seconds']:.0f} s: {'PASSED' if result['passed'] else 'FAILED'}"
             f"{'' if result['complete'] else ' (incomplete: parts or runs skipped)'}"]
    parts = result["parts"]
    if "kernels" in parts:
        k = parts["kernels"]
        lines.append(f"kernels == torch (same noise)   {k['equal']}/{k['compared']} comparisons")
    if "distribution" in parts:
        worst = min(t["p_value"] for d in parts["distribution"]["tests"].values() for t in d.values())
        lines.append(f"distribution (chi-square)        {parts['distribution']['rows']} rows, lowest p-value "
                     f"{worst:.3g}")
    if "big_batch" in parts:
        b = parts["big_batch"]
        lines.append(f"64-bit offsets                   {b['elements']:,} elements, equal {b['equal']}")
    if "batch_invariance" in parts:
        lines.append(f"seeded batch invariance          {all(parts['batch_invariance']['invariant'].values())}")
    if "bandwidth" in parts:
        bw = parts["bandwidth"]
        lines.append(f"verifier B={bw['B']} k={bw['k']} V={bw['V']} (copy {bw['copy_GB_per_s']:.0f} GB/s):")
        for r in bw["rows"]:
            lines.append(f"  {r['variant']:<34}{r['dtype']:>9}{' greedy' if r['greedy'] else ' sampled':>9}"
                         f"{r['seconds'] * 1e3:>9.3f} ms {r['GB_per_s']:>8.1f} GB/s "
                         f"{100 * r['fraction_of_copy']:>6.1f}% of copy")
    if "decoding" in parts:
        d = parts["decoding"]
        lines.append(f"decoding, {d['target_parameters'] / 1e9:.2f}B random Llama, k={d['k']}, greedy, verifier "
                     f"{d['verifier_backend']} (tokens/s, tokens per step, equal to plain greedy; {d['note']}):")
        for r in d["runs"]:
            if "skipped" in r:
                lines.append(f"  {r['dtype']:<9} {r.get('method', '')} skipped ({r['skipped']})")
                continue
            lines.append(f"  {r['dtype']:<9} B={r['batch']} {r['method']:<15}{r['tokens_per_s']:>9.1f}"
                         f"{r['mean_tokens_per_step']:>6.2f}  {r['equal_to_plain_greedy'] or equal_note(r)}")
        if d.get("layouts"):
            lines.append("  other layouts draft as the served heads: " + ", ".join(
                f"{x['layout']} {x['equal']}" for x in d["layouts"]))
        for dtype, e in d.get("engine", {}).items():
            g = e["target"]["graphs"]
            pool = f"KV pool {e['target']['pool_tokens']} tokens ({e['target']['pool_GiB']:.2f} GiB)"
            lines.append(f"  {dtype:<9} {pool}; "
                         + ("CUDA graphs: none (eager)" if g is None else
                            f"CUDA graphs: {g['captured']} shapes emulated (eager at the captured shapes)"
                            if g.get("emulated") else
                            f"CUDA graphs: {g['captured']} captured in {g['seconds']:.1f} s, {g['MiB']:.0f} MiB"))
        for dtype, f in d.get("forward_cost", {}).items():
            t = f["target"]["ms"]
            lines.append(f"  {dtype:<9} forward ms, batch 1, 1..9 new positions: "
                         + " ".join(f"{t[1][n]:.2f}" for n in FORWARD_NEW_POSITIONS))
            if 8 in t:
                lines.append(f"  {dtype:<9} forward ms, batch 8, 1/2/5/9 new positions: "
                             + " ".join(f"{v:.2f}" for v in t[8].values()))
            lines.append(f"  {dtype:<9} early-exit draft forward ms, batch 1: {f['draft']['ms'][1][1]:.2f}")
        for dtype in ("float32", "bfloat16"):
            g = d.get("goals", {}).get(dtype) or {}
            if "fraction_of_roofline" in g:
                lines.append(f"  {dtype:<9} goals: none batch 1 {g['none_batch1_tokens_per_s']:.0f} tok/s = "
                             f"{100 * g['fraction_of_roofline']:.0f}% of the roofline "
                             f"({g['roofline_tokens_per_s']:.0f}; goal {g['none_batch1_goal']:.0f}: "
                             f"{g['none_batch1_met']}), batch 8 / 1 {g.get('batch8_over_batch1', 0):.1f}x, "
                             f"5 / 1 positions {g.get('forward5_over_forward1', 0):.2f}x, draft / target forward "
                             f"{g.get('draft_over_target_forward', 0):.2f}")
    if result["failures"]:
        lines.append(f"{len(result['failures'])} failed checks, first: {result['failures'][0]}")
    return "\n".join(lines)
