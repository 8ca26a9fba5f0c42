"""``make bench``: a repeated workload through the real server, beside in-process transformers generate.

In one run, for each speculative_method (none, ngram, suffix, draft, hybrid): start a fresh tritonserver on free
ports (empty caches, so no method profits from another's responses), stream N HumanEval prompts (greedy, M new tokens)
twice: the second pass can hit suffix decoding's global cache of earlier responses. Then transformers
``generate(do_sample=False)`` runs on the same prompts in this process. Prints a table, saves JSON and a PNG plot
(tokens/s and mean tokens per step per method and pass). Ratios are measured in the same run (the machine is shared
and noisy). ``draft`` (and hybrid's fallback) needs a draft LM: ``--draft-model`` / ``DRAFT_MODEL``; without one, draft is
skipped and hybrid falls back to n-gram lookup. By default the distilled draft of ``make draft`` is used when it exists.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path


def bench_server(url: str, prompts: list[str], max_tokens: int, method: str, k: int, warm_up: bool = True) -> dict:
    """Stream every prompt once with ``method``; aggregate tokens/s, TTFT, tokens per step, acceptance.

    Returns:
        dict with method, tokens, seconds, tokens_per_s, mean_tokens_per_step (emitted tokens / steps),
        mean_accepted_per_step, draft_tokens, accepted_tokens, acceptance_rate (None without drafts),
        median_ttft_ms, tokens_per_step_histogram (emitted tokens per streamed step -> steps), acceptance_per_position
        and per_prompt figures.
    """
    from .generate import stream_generate

    if warm_up:
        stream_generate(url, "warm up", 4, speculative_method=method)
    tokens = seconds = steps = drafted = accepted = 0
    ttfts, per_prompt, hist = [], [], {}
    for prompt in prompts:
        r = stream_generate(url, prompt, max_tokens, speculative_method=method, num_draft_tokens=k)
        tokens += len(r.output_ids)
        seconds += r.total_s
        steps += r.stats["num_steps"]
        drafted += r.stats["num_draft_tokens_total"]
        accepted += r.stats["num_accepted_tokens"]
        ttfts.append(r.ttft_s)
        for _, _, ids in r.responses:  # stream=true: one response per step
            if ids:
                hist[len(ids)] = hist.get(len(ids), 0) + 1
        per_prompt.append({"tokens": len(r.output_ids), "seconds": r.total_s, "steps": r.stats["num_steps"]})
    return {
        "method": f"server:{method}", "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "mean_tokens_per_step": tokens / steps, "mean_accepted_per_step": accepted / steps, "draft_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None, "median_ttft_ms": 1000 * statistics.median(ttfts),
        "tokens_per_step_histogram": {str(n): c for n, c in sorted(hist.items())},
        # P(at least j drafts accepted in a step), j = 1..k: exact for methods that draft k tokens every step (draft)
        "acceptance_per_position": [sum(c for n, c in hist.items() if n > j) / max(1, sum(hist.values()))
                                    for j in range(1, k + 1)],
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


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Bar charts of tokens/s and mean tokens per step per method, one bar per pass; saved as PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    server = [r for r in rows if r["method"].startswith("server:")]
    methods = list(dict.fromkeys(r["method"].split(":", 1)[1] for r in server))
    passes = sorted({r["pass"] for r in server})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(passes))
    for ax, key, label in ((axes[0], "tokens_per_s", "output tokens/s"), (axes[1], "mean_tokens_per_step",
                                                                            "mean tokens per step")):
        for j, p in enumerate(passes):
            vals = [next((r[key] for r in server if r["method"] == f"server:{m}" and r["pass"] == p), 0) for m in methods]
            xs = [i + (j - (len(passes) - 1) / 2) * width for i in range(len(methods))]
            bars = ax.bar(xs, vals, width, label=f"pass {p}")
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        hf = next((r for r in rows if r["method"] == "transformers:generate"), None)
        if hf is not None and key == "tokens_per_s":
            ax.axhline(hf[key], color="gray", linestyle="--", label="transformers generate")
        ax.set_xticks(range(len(methods)), methods)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, save JSON and the PNG plot."""
    import os

    from spec_decode.server import TritonServer, draft_overrides, prepare_repository

    from .datasets import humaneval_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=10, help="number of HumanEval prompts (default 10)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", default="none,ngram,suffix,draft,hybrid")
    ap.add_argument("--passes", type=int, default=2, help="times the prompt set is sent (default 2: repeated workload)")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--draft-model", default=os.environ.get("DRAFT_MODEL", ""),
                    help="draft LM folder for speculative_method=draft and hybrid's fallback (default: $DRAFT_MODEL, "
                         "else the distilled default draft when `make draft` has built it)")
    ap.add_argument("--output", type=Path, default=Path("results/bench.json"))
    ap.add_argument("--url", help="use an already running server (gRPC host:port) instead of starting one per method")
    args = ap.parse_args(argv)

    prompts = humaneval_prompts(args.prompts)
    methods = args.methods.split(",")
    if not args.draft_model and not args.url:
        from spec_decode.models import default_draft_dir, default_draft_ready

        if default_draft_ready():
            args.draft_model = str(default_draft_dir())
    if "draft" in methods and not args.draft_model and not args.url:
        print("no draft model (--draft-model / DRAFT_MODEL): skipping speculative_method=draft; hybrid falls back to "
              "n-gram lookup", flush=True)
        methods.remove("draft")
    rows = []
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for m in methods:
        if args.url:
            for p in range(1, args.passes + 1):
                rows.append(bench_server(args.url, prompts, args.max_tokens, m, args.num_draft_tokens, p == 1) | {"pass": p})
            continue
        repo = prepare_repository(draft_overrides(args.draft_model) if args.draft_model else None)
        log = args.output.with_name(f"{args.output.stem}.{m}.server.log")
        with TritonServer(repo, log_path=log) as srv:
            srv.wait_ready()
            for p in range(1, args.passes + 1):
                print(f"speculative_method={m}, pass {p}/{args.passes}: {len(prompts)} prompts through a fresh server ...",
                      flush=True)
                rows.append(bench_server(srv.grpc_url, prompts, args.max_tokens, m, args.num_draft_tokens, p == 1)
                            | {"pass": p})
    print("benchmarking in-process transformers generate ...", flush=True)
    rows.append(bench_transformers(prompts, args.max_tokens))

    base = next(r for r in rows if r["method"] == "transformers:generate")["tokens_per_s"]
    none = {r["pass"]: r["tokens_per_s"] for r in rows if r["method"] == "server:none"}
    title = (f"{len(prompts)} HumanEval prompts x {args.passes} passes, {args.max_tokens} new tokens, greedy, "
             f"k={args.num_draft_tokens}" + (f", draft={Path(args.draft_model).name}" if args.draft_model else ""))
    print(f"\n{title}\n")
    print(f"{'method':<24}{'pass':>5}{'tokens/s':>10}{'tok/step':>10}{'acc/step':>9}{'accept':>8}{'TTFT ms':>9}"
          f"{'vs HF':>7}{'vs none':>9}")
    for r in rows:
        acc = r.get("acceptance_rate")
        acc_s = f"{acc:.2f}" if acc is not None else "-"
        ttft_s = f"{r['median_ttft_ms']:.0f}" if "median_ttft_ms" in r else "-"
        n = none.get(r.get("pass"))
        vs_none = f"{r['tokens_per_s'] / n:.2f}" if n else "-"
        acc_step = f"{r['mean_accepted_per_step']:.2f}" if "mean_accepted_per_step" in r else "-"
        print(f"{r['method']:<24}{r.get('pass', '-'):>5}{r['tokens_per_s']:>10.2f}{r['mean_tokens_per_step']:>10.2f}"
              f"{acc_step:>9}{acc_s:>8}{ttft_s:>9}{r['tokens_per_s'] / base:>7.2f}{vs_none:>9}")
    result = {"prompts": len(prompts), "passes": args.passes, "max_tokens": args.max_tokens,
              "num_draft_tokens": args.num_draft_tokens, "draft_model": args.draft_model or None,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": rows}
    args.output.write_text(json.dumps(result, indent=2))
    png = args.output.with_suffix(".png")
    plot(rows, png, title)
    print(f"\nsaved {args.output} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
