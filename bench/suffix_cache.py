"""Speed and memory of suffix decoding's cache at serving scale, for both engines, in one run.

Fills a :class:`spec_decode.proposers.SuffixProposer` (the object draft_model serves) with N cached responses of L
tokens (default 10,000 x 500, max_tree_depth 64) through its serving API (first step with the prompt, the final ids,
release), then decodes fresh requests step by step, timing each ``speculate`` call including the update with the
step's new tokens. Each measurement runs in its own process; its RSS is read before and after filling (freed C++
memory is not returned to the OS, so runs cannot share a process). Filling past ``max_cached_requests`` shows the FIFO
bound. The pure-Python engine is measured on a smaller fill (its memory grows with depth x tokens) and reported per
token beside Arctic's.

Synthetic data (seed 0): a 49,152-token vocabulary with Zipf weights 1/(r + 2.7)^1.1 over a random permutation; each
response has three 50-token spans copied from earlier responses (30%) between fresh Zipf tokens. Test requests copy
spans the same way, so the global tree has something to match.

Usage: python -m bench.suffix_cache [--responses 10000] [--length 500] [--python-responses 200] [--output PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

V, SPAN, N_COPY = 49152, 50, 3
ROOT = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    """Resident set size of this process in MiB (``VmRSS`` of /proc/self/status; NaN where there is none)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Data:
    """Zipf token streams with spans copied from earlier rows (see module docstring)."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        p = 1.0 / (np.arange(V) + 2.7) ** 1.1
        self.cdf = np.cumsum(p / p.sum())
        self.perm = self.rng.permutation(V).astype(np.int64)
        self.rows: list[np.ndarray] = []

    def zipf(self, n: int) -> np.ndarray:
        """``n`` fresh token ids (int64), Zipf-weighted."""
        return self.perm[np.searchsorted(self.cdf, self.rng.random(n), side="right").clip(0, V - 1)]

    def row(self, length: int, keep: bool = True) -> list[int]:
        """A response of ``length`` token ids: fresh tokens with :data:`N_COPY` spans of :data:`SPAN` tokens copied
        from earlier rows (the first row: fresh only); ``keep`` makes it a source for later rows."""
        if not self.rows:
            out = self.zipf(length)
        else:
            n_fresh = length - N_COPY * SPAN
            cuts = np.diff(np.concatenate([[0], np.sort(self.rng.integers(0, n_fresh + 1, N_COPY)), [n_fresh]]))
            fresh, parts, pos = self.zipf(n_fresh), [], 0
            for j in range(N_COPY + 1):
                parts.append(fresh[pos : pos + cuts[j]])
                pos += cuts[j]
                if j < N_COPY:
                    src = self.rows[self.rng.integers(0, len(self.rows))]
                    off = self.rng.integers(0, len(src) - SPAN + 1)
                    parts.append(src[off : off + SPAN])
            out = np.concatenate(parts)
        if keep:
            self.rows.append(out)
        return out.tolist()


def measure(backend: str, responses: int, length: int, bound: int, queries: int, k: int) -> dict:
    """Fill one engine's cache with ``responses`` responses of ``length`` tokens (``bound``: its
    ``max_cached_requests``), time ``speculate`` (k drafts, with the update) over ``queries`` decoding steps of fresh
    requests, and read the memory.

    Returns:
        dict: backend, responses, length, tokens, max_cached_requests, cached_requests, fill_s (seconds),
        insert_us_per_token, rss_before_mb and rss_filled_mb (MiB), bytes_per_cached_token,
        bytes_per_inserted_token, speculate_ms (median, p99, max), steps_timed, mean_draft_len (tokens).
    """
    from spec_decode.proposers import SuffixProposer, SuffixSettings

    data = Data(0)
    prompts = [data.zipf(100).tolist() for _ in range(8)]
    rows = [data.row(length) for _ in range(responses)]
    gc.collect()
    rss0 = rss_mb()
    p = SuffixProposer(SuffixSettings(max_tree_depth=64, max_cached_requests=bound, max_cached_tokens=0,
                                      backend=backend))
    t0 = time.perf_counter()
    for i, resp in enumerate(rows):
        prompt = prompts[i % len(prompts)]
        p.speculate(i, prompt, k)
        p.release(i, prompt + resp)
    fill_s = time.perf_counter() - t0
    gc.collect()
    rss_filled = rss_mb()
    # Decode fresh requests step by step: each step adds 1..k+1 tokens (what the verifier would accept).
    lat, drafted, rng = [], 0, np.random.default_rng(1)
    seq, steps = responses, 0
    while steps < queries:
        seq += 1
        prompt, resp = prompts[seq % len(prompts)], data.row(length, keep=False)
        ids, pos = list(prompt), 0
        while pos < len(resp) and steps < queries:
            t = time.perf_counter()
            d = p.speculate(seq, ids, k)
            lat.append(time.perf_counter() - t)
            drafted += len(d.token_ids)
            step = int(rng.integers(1, k + 2))
            ids += resp[pos : pos + step]
            pos += step
            steps += 1
        p.release(seq)
    lat_ms = np.sort(np.array(lat) * 1000)
    out = {
        "backend": p.backend, "responses": responses, "length": length, "tokens": responses * length,
        "max_cached_requests": bound, "cached_requests": p.cache.cached_requests, "fill_s": fill_s,
        "insert_us_per_token": 1e6 * fill_s / (responses * length),
        "rss_before_mb": rss0, "rss_filled_mb": rss_filled,
        "bytes_per_cached_token": (rss_filled - rss0) * 2**20 / (min(responses, bound) * length),
        "bytes_per_inserted_token": (rss_filled - rss0) * 2**20 / (responses * length),
        "speculate_ms": {"median": float(np.median(lat_ms)), "p99": float(lat_ms[int(0.99 * (len(lat_ms) - 1))]),
                         "max": float(lat_ms[-1])},
        "steps_timed": len(lat_ms), "mean_draft_len": drafted / len(lat_ms),
    }
    del p
    gc.collect()
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure both engines; print a table and save JSON."""
    from spec_decode.proposers.suffix import arctic_available

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--responses", type=int, default=10000)
    ap.add_argument("--length", type=int, default=500)
    ap.add_argument("--python-responses", type=int, default=200)
    ap.add_argument("--queries", type=int, default=2000, help="timed decoding steps per engine")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--output", type=Path, default=Path("results/suffix_cache.json"))
    ap.add_argument("--single", help=argparse.SUPPRESS)  # backend,responses,bound: one measurement, JSON on stdout
    args = ap.parse_args(argv)

    if args.single:
        backend, responses, bound = args.single.split(",")
        print(json.dumps(measure(backend, int(responses), args.length, int(bound), args.queries, args.k)))
        return 0

    plan = []
    if arctic_available():
        plan.append(("arctic", args.responses, args.responses))
        plan.append(("arctic", args.responses + args.responses // 5, args.responses))  # past the bound: FIFO
    else:
        print("Arctic's suffix tree is not built (scripts/build_suffix_tree.sh): measuring the Python engine only")
    plan.append(("python", args.python_responses, args.python_responses))
    runs = []
    for backend, responses, bound in plan:
        print(f"{backend}: {responses} responses x {args.length} tokens into a cache bounded at {bound} "
              f"(own process) ...", flush=True)
        # run from the repository root, where `-m bench.suffix_cache` finds this module
        out = subprocess.run([sys.executable, "-m", "bench.suffix_cache", "--single", f"{backend},{responses},{bound}",
                              "--length", str(args.length), "--queries", str(args.queries), "--k", str(args.k)],
                             check=True, capture_output=True, text=True, cwd=ROOT).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))

    print(f"\nmax_tree_depth 64, k={args.k}; speculate timed over {args.queries} decoding steps "
          "(includes the update)\n")
    print(f"{'engine':<8}{'cached':>8}{'inserted':>11}{'insert us/tok':>14}{'RSS MB':>9}{'B/token':>9}"
          f"{'spec median ms':>16}{'p99 ms':>8}{'draft len':>10}")
    for r in runs:
        s = r["speculate_ms"]
        print(f"{r['backend']:<8}{r['cached_requests']:>8}{r['tokens']:>11,}{r['insert_us_per_token']:>14.1f}"
              f"{r['rss_filled_mb'] - r['rss_before_mb']:>9.0f}{r['bytes_per_cached_token']:>9.0f}"
              f"{s['median']:>16.3f}{s['p99']:>8.3f}{r['mean_draft_len']:>10.2f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "runs": runs}, indent=2))
    print(f"\nsaved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
