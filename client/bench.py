"""``make bench``: tokens/s and tokens per step through the real server, beside in-process transformers generate.

In one run: start tritonserver on free ports with the default model, stream N HumanEval prompts (greedy, M new tokens)
for each speculative_method, then run transformers ``generate(do_sample=False)`` on the same prompts in this process.
Prints a table and saves JSON. Ratios are measured in the same run (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path


def bench_server(url: str, prompts: list[str], max_tokens: int, method: str, k: int) -> dict:
    """Stream every prompt once with ``method``; aggregate tokens/s, TTFT, tokens per step, acceptance."""
    from .generate import stream_generate

    stream_generate(url, "warm up", 4, speculative_method=method)
    tokens = seconds = steps = drafted = accepted = 0
    ttfts, per_prompt = [], []
    for prompt in prompts:
        r = stream_generate(url, prompt, max_tokens, speculative_method=method, num_draft_tokens=k)
        tokens += len(r.output_ids)
        seconds += r.total_s
        steps += r.stats["num_steps"]
        drafted += r.stats["num_draft_tokens_total"]
        accepted += r.stats["num_accepted_tokens"]
        ttfts.append(r.ttft_s)
        per_prompt.append({"tokens": len(r.output_ids), "seconds": r.total_s, "steps": r.stats["num_steps"]})
    return {
        "method": f"server:{method}", "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "mean_tokens_per_step": tokens / steps, "draft_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None, "median_ttft_ms": 1000 * statistics.median(ttfts),
        "per_prompt": per_prompt,
    }


def bench_transformers(prompts: list[str], max_tokens: int) -> dict:
    """In-process transformers greedy generate of the target alone on the same prompts."""
    import torch

    from spec_decode.models import load_causal_lm, load_tokenizer, prepare_default_model

    path = prepare_default_model()
    tok = load_tokenizer(path)
    model = load_causal_lm(path, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        model.generate(tok("warm up", return_tensors="pt")["input_ids"], max_new_tokens=4, do_sample=False)
    tokens = seconds = 0.0
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
        seconds += time.perf_counter() - t0
        eos = tok.eos_token_id
        tokens += out.index(eos) if eos in out else len(out)
    return {"method": "transformers:generate", "tokens": int(tokens), "seconds": seconds,
            "tokens_per_s": tokens / seconds, "mean_tokens_per_step": 1.0}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, save JSON."""
    from spec_decode.server import TritonServer

    from .datasets import humaneval_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=10, help="number of HumanEval prompts (default 10)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", default="none,ngram")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--output", type=Path, default=Path("results/bench.json"))
    ap.add_argument("--url", help="use an already running server (gRPC host:port) instead of starting one")
    args = ap.parse_args(argv)

    prompts = humaneval_prompts(args.prompts)
    rows = []
    if args.url:
        for m in args.methods.split(","):
            rows.append(bench_server(args.url, prompts, args.max_tokens, m, args.num_draft_tokens))
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        log = args.output.with_suffix(".server.log")
        with TritonServer(log_path=log) as srv:
            srv.wait_ready()
            for m in args.methods.split(","):
                print(f"benchmarking speculative_method={m} through the server ...", flush=True)
                rows.append(bench_server(srv.grpc_url, prompts, args.max_tokens, m, args.num_draft_tokens))
    print("benchmarking in-process transformers generate ...", flush=True)
    rows.append(bench_transformers(prompts, args.max_tokens))

    base = next(r for r in rows if r["method"] == "transformers:generate")["tokens_per_s"]
    none = next((r["tokens_per_s"] for r in rows if r["method"] == "server:none"), None)
    print(f"\n{len(prompts)} HumanEval prompts, {args.max_tokens} new tokens, greedy, k={args.num_draft_tokens}\n")
    print(f"{'method':<24}{'tokens/s':>10}{'tok/step':>10}{'accept':>8}{'TTFT ms':>9}{'vs HF':>7}{'vs none':>9}")
    for r in rows:
        acc = r.get("acceptance_rate")
        acc_s = f"{acc:.2f}" if acc is not None else "-"
        ttft_s = f"{r['median_ttft_ms']:.0f}" if "median_ttft_ms" in r else "-"
        vs_none = f"{r['tokens_per_s'] / none:.2f}" if none else "-"
        print(f"{r['method']:<24}{r['tokens_per_s']:>10.2f}{r['mean_tokens_per_step']:>10.2f}{acc_s:>8}{ttft_s:>9}"
              f"{r['tokens_per_s'] / base:>7.2f}{vs_none:>9}")
    result = {"prompts": len(prompts), "max_tokens": args.max_tokens, "num_draft_tokens": args.num_draft_tokens,
              "machine": {"cpus": __import__("os").cpu_count(), "platform": platform.platform()},
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"\nsaved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
