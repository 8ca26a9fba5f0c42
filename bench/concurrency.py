"""Throughput under concurrency through the server: aggregate output tokens/s, TTFT and inter-token latency per method at
concurrency 1, 2, 4, 8 (tritonclient gRPC streams, HumanEval prompts, fixed-length outputs with ``ignore_eos``).

One server (started here on free ports, or ``--url``/``--metrics-url`` of a running one), every method and concurrency
in the same run so the ratios compare like with like. Also reports the mean batch the target ran (Triton's
``nv_inference_count`` / ``nv_inference_exec_count`` of target_model) to show that concurrent steps share forward passes.

    python bench/concurrency.py --methods none,suffix --concurrency 1,2,4,8 --max-tokens 64 --output results/concurrency.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))

from client.datasets import humaneval_prompts  # noqa: E402
from client.generate import stream_generate  # noqa: E402
from client.metrics import scrape, value  # noqa: E402


def run_level(url: str, prompts: list[str], method: str, concurrency: int, requests: int, max_tokens: int,
              k: int) -> dict:
    """``requests`` requests, ``concurrency`` at a time; returns aggregate and per-request figures.

    Returns:
        dict: tokens_per_s (all output tokens / wall seconds), ttft_ms and itl_ms (medians over requests; ITL = time
        from the first to the last response / (tokens - 1)), tokens_per_step (mean).
    """
    results, lock, next_i = [], threading.Lock(), [0]

    def worker():
        while True:
            with lock:
                i = next_i[0]
                if i >= requests:
                    return
                next_i[0] += 1
            r = stream_generate(url, prompts[i % len(prompts)], max_tokens, speculative_method=method,
                                num_draft_tokens=k if method != "none" else 0, ignore_eos=True)
            with lock:
                results.append(r)

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    tokens = sum(len(r.output_ids) for r in results)
    itl = [(r.responses[-1][0] - r.ttft_s) / (len(r.output_ids) - 1) for r in results if len(r.output_ids) > 1]
    return {"method": method, "concurrency": concurrency, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_ms": 1e3 * statistics.median(r.ttft_s for r in results),
            "itl_ms": 1e3 * statistics.median(itl) if itl else None,
            "tokens_per_step": statistics.mean(r.tokens_per_step for r in results)}


def target_batching(metrics_url: str) -> tuple[float, float]:
    """(inferences, executions) of target_model so far."""
    s = scrape(metrics_url, prefix="nv_inference_")
    return (value(s, "nv_inference_count", model="target_model", version="1"),
            value(s, "nv_inference_exec_count", model="target_model", version="1"))


def main(argv: list[str] | None = None) -> int:
    """CLI: run the sweep, print a table, save JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="gRPC host:port of a running server (default: start one)")
    ap.add_argument("--metrics-url", help="its metrics host:port")
    ap.add_argument("--methods", default="none,suffix")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--requests-per-stream", type=int, default=2, help="requests = this x concurrency")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--output", default="results/concurrency.json")
    args = ap.parse_args(argv)

    server = None
    if args.url is None:
        from spec_decode.server import TritonServer, prepare_repository

        server = TritonServer(prepare_repository({}), log_path=Path(args.output).with_suffix(".server.log"))
        server.start()
        server.wait_ready(timeout=900)
        args.url, args.metrics_url = server.grpc_url, server.metrics_url
    try:
        prompts = humaneval_prompts(20)
        stream_generate(args.url, prompts[0], 8)  # warm-up
        rows = []
        print(f"{'method':<8}{'conc':>5}{'tok/s':>9}{'TTFT ms':>9}{'ITL ms':>8}{'tok/step':>9}{'batch':>7}")
        for method in args.methods.split(","):
            for c in (int(x) for x in args.concurrency.split(",")):
                before = target_batching(args.metrics_url)
                row = run_level(args.url, prompts, method, c, c * args.requests_per_stream, args.max_tokens,
                                args.num_draft_tokens)
                after = target_batching(args.metrics_url)
                execs = after[1] - before[1]
                row["target_mean_batch"] = (after[0] - before[0]) / execs if execs else None
                rows.append(row)
                print(f"{method:<8}{c:>5}{row['tokens_per_s']:>9.1f}{row['ttft_ms']:>9.0f}{row['itl_ms']:>8.1f}"
                      f"{row['tokens_per_step']:>9.2f}{row['target_mean_batch']:>7.2f}", flush=True)
        for method in args.methods.split(","):
            base = next(r for r in rows if r["method"] == method and r["concurrency"] == 1)
            for r in rows:
                if r["method"] == method:
                    r["speedup_vs_concurrency_1"] = r["tokens_per_s"] / base["tokens_per_s"]
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"max_tokens": args.max_tokens, "rows": rows}, indent=2))
        print(f"saved {args.output}")
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
