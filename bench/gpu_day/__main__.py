"""``make gpu-day``: one command for a bare GPU machine lent for minutes (``python -m bench.gpu_day``).

    PYTHONPATH=backend_src:.:build/gpu_day/site python3 -m bench.gpu_day [--device auto|cuda|cpu]
        [--output results/gpu_day.json] [--budget-s 540] [--parts NAME ...]

It runs the parts of :data:`PARTS` in order of value, each in its own process (what a part holds on the GPU is
freed when it exits; a part that hangs or crashes costs only its own time), within a total time budget: a part gets
its planned seconds or what is left, and a part with under :data:`MIN_PART_S` left is skipped. After each part the
JSON at ``--output`` holds everything measured so far (a killed run leaves it), and one line per part is printed.
The exit status is 1 when a part failed, crashed, ran out of time or was skipped, and the last line names each.

Without CUDA (``--device cpu``, the default there) the same parts run at tiny sizes on the CPU, the kernels under
``TRITON_INTERPRET=1``, the served part on a CPU tritonserver (``tests/unit/bench/test_gpu_day.py`` runs it).

What travels to the GPU machine besides the repository: ``build/gpu_day`` (``python -m bench.gpu_day.bundle`` or
``make gpu-bundle`` builds it here: the tritonserver bundle, ``site/`` and the tokenizer), carried by the device
tool. docs/gpus.md says what each part checks and what the last run measured.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "build" / "gpu_day" / "tritonserver.tar.xz"
MIN_PART_S = 30.0
FORWARD_METHODS = ("none", "suffix", "eagle3", "draft", "self")
"""The forward parts' decoding methods: plain decoding, the default method, a head, the draft LM and the target
drafting for itself (every draft accepted); the other methods run in ``rest``."""
OTHER_METHODS = ("none", "ngram", "eagle", "medusa", "mlp_speculator", "arctic")


@dataclass(frozen=True)
class Part:
    """One part: its name, the module it runs (``python -m``) with these arguments, its planned seconds on CUDA,
    and whether its module takes gpu_check's ``--budget-s`` (runs past it are reported skipped, not killed)."""

    name: str
    module: str
    args: tuple[str, ...]
    seconds: float
    budgeted: bool = True


PARTS: tuple[Part, ...] = (
    Part("forward_float32", "bench.gpu_check",
         ("--parts", "decoding", "--dtypes", "float32", "--methods", *FORWARD_METHODS), 170),
    Part("forward_bfloat16", "bench.gpu_check",
         ("--parts", "decoding", "--dtypes", "bfloat16", "--methods", *FORWARD_METHODS), 140),
    Part("served", "bench.gpu_day.served", (), 170, budgeted=False),
    Part("kernels", "bench.gpu_check", ("--parts", "kernels", "bandwidth"), 60),
    Part("rest", "bench.gpu_check", ("--parts", "distribution", "batch_invariance", "decoding", "big_batch",
                                     "--dtypes", "float32", "--methods", *OTHER_METHODS), 120),
)
"""In order of value (the forward's goals, the served path, the verifier kernels, the rest of ``make gpu-check``)."""


def run_part(part: Part, device: str, out_dir: Path, timeout_s: float) -> dict:
    """Run ``part`` in its own process group, killed after ``timeout_s``; its result.

    Returns:
        dict: status (``passed``, ``failed``, ``timed out``), exit_code, seconds, failures (the part's own list, or
        the last lines of its output), result (its JSON, when it wrote one), output (the path of its log).
    """
    out = out_dir / f"gpu_day.{part.name}.json"
    log = out_dir / f"gpu_day.{part.name}.log"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", part.module, "--device", device, "--output", str(out), *part.args]
    if part.budgeted:
        cmd += ["--budget-s", str(max(timeout_s - 25, 10))]  # leave time to write the JSON and exit
    elif part.name == "served" and BUNDLE.is_file():
        cmd += ["--bundle", str(BUNDLE)]
    t = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
            status = "passed" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code, status = None, "timed out"
    res: dict = {"status": status, "exit_code": code, "seconds": round(time.perf_counter() - t, 1),
                 "output": str(log)}
    if out.is_file():
        res["result"] = json.loads(out.read_text())
        res["failures"] = list(res["result"].get("failures", []))
        skipped = [r for r in res["result"].get("parts", {}).get("decoding", {}).get("runs", []) if "skipped" in r]
        if skipped:
            res["skipped_runs"] = skipped
        if part.module == "bench.gpu_check" and code == 1 and not res["failures"] and not skipped:
            status = res["status"] = "passed"  # gpu_check exits 1 for a subset of its parts: this one passed whole
        elif skipped and status == "passed":
            status = res["status"] = "failed"
    if status != "passed" and not res.get("failures"):
        res["failures"] = log.read_text(errors="replace").splitlines()[-15:]
    return res


def summary(part: str, res: dict) -> str:
    """The part's one line: status, seconds and what it measured or why it failed."""
    line = f"{res['status'].upper():<9} {part:<17} {res['seconds']:>6.1f} s"
    r = res.get("result", {})
    goals = r.get("parts", {}).get("decoding", {}).get("goals")
    if goals:
        g: dict = next((goals[d] for d in ("float32", "bfloat16") if goals.get(d)), {})
        if "none_batch1_tokens_per_s" in g:
            line += (f"  none b1 {g['none_batch1_tokens_per_s']:.0f} tok/s ({g['fraction_of_roofline']:.0%} of the "
                     f"roofline), b8/b1 {g.get('batch8_over_batch1', 0):.1f}x, 5/1 positions "
                     f"{g.get('forward5_over_forward1', 0):.2f}x")
    if "server_over_in_process" in r:
        line += (f"  server/in-process {r['server_over_in_process']:.2f}x, round beyond forward "
                 f"{r.get('round_beyond_forward_ms') or float('nan'):.2f} ms")
    if res.get("failures"):
        line += f"  | {res['failures'][0]}"
    return line


def main(argv: list[str] | None = None) -> int:
    """Run the parts within the budget, save the JSON after each, print a line per part; 0 when all passed."""
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_day", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--output", type=Path, default=ROOT / "results" / "gpu_day.json")
    ap.add_argument("--budget-s", type=float, default=540.0, help="seconds for every part together (default 540)")
    ap.add_argument("--parts", nargs="+", choices=[p.name for p in PARTS], default=[p.name for p in PARTS])
    args = ap.parse_args(argv)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": args.device, "budget_s": args.budget_s, "bundle": BUNDLE.is_file(), "parts": {},
                    "passed": False}
    args.output.write_text(json.dumps(result, indent=2))  # a run that dies before any part leaves a failing JSON
    if args.device == "auto":
        import torch

        args.device = result["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    for part in (p for p in PARTS if p.name in args.parts):
        left = args.budget_s - (time.perf_counter() - start)
        if left < MIN_PART_S:
            res: dict = {"status": "skipped", "seconds": 0.0, "failures": [f"{left:.0f} s of the budget left"]}
        else:
            print(f"== {part.name} (up to {min(part.seconds, left):.0f} s)", flush=True)
            # on a CPU the parts are tiny: every part gets the time left
            res = run_part(part, args.device, args.output.parent, min(part.seconds, left)
                           if args.device == "cuda" else left)
        result["parts"][part.name] = res
        result["seconds"] = time.perf_counter() - start
        args.output.write_text(json.dumps(result, indent=2, default=str))  # kept if the run is killed
        print(summary(part.name, res), flush=True)
    bad = [f"{n} ({r['status']})" for n, r in result["parts"].items() if r["status"] != "passed"]
    result["passed"] = not bad and len(result["parts"]) == len(PARTS)
    args.output.write_text(json.dumps(result, indent=2, default=str))
    verdict = "passed" if result["passed"] else f"FAILED: {', '.join(bad)}" if bad else "incomplete (--parts)"
    print(f"gpu_day: {verdict} in {result.get('seconds', 0):.0f} s; saved {args.output}", flush=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
