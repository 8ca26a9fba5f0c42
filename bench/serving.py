"""The serving benchmark of ``make bench``: perf_analyzer and AIPerf against ``generate``, beside in-process
baselines.

In one run, on HumanEval prompts (greedy, ``max_tokens`` new tokens with ``ignore_eos`` so every request has the same
length):

1. One tritonserver (started here on free ports). For each speculative_method and each concurrency (1, 2, 4, 8):
   ``perf_analyzer -i grpc --streaming --concurrency-range C --input-data ... --request-count N
   --profile-export-file ...``. From the per-response timestamps of the export: output tokens/s (all output tokens /
   the span from the first request to the last response), TTFT and inter-token latency (ITL = (latency - TTFT) /
   (tokens - 1), genai-perf's definition) and the distribution of tokens per response (= per step: one streamed
   response per step). Each concurrency level uses its own window of prompts, so suffix decoding's cache of earlier
   responses never holds the answer to a prompt it is asked again.
2. AIPerf (:mod:`bench.aiperf`), when it is installed (``scripts/setup_bench.sh`` puts it in ``.venv-aiperf``;
   ``--aiperf`` names another executable), for each method at concurrency 1 and the largest level, through each
   endpoint with the same prompts (windows of their own, after perf_analyzer's): Triton's HTTP generate extension
   (``generate_stream``; AIPerf has no KServe gRPC), and the OpenAI-compatible frontend's ``/v1/completions`` and
   ``/v1/chat/completions`` (started here beside the server), streamed: its own output token throughput, TTFT and
   ITL, side by side per endpoint. Suffix decoding and hybrid, which draft from earlier responses, get a window per
   endpoint instead (the second endpoint would find the first one's answers).
3. A second server with ``disable_by_batch_size`` set: each method against none at the largest concurrency.
4. In process, on the prompts of the concurrency-1 window: transformers ``generate`` (greedy), prompt lookup
   (``prompt_lookup_num_tokens=k``) and assisted generation with the same draft (its pruned vocabulary scattered back
   to the target's, see :func:`full_vocab_draft`).

Prints the tables and the speed goals (docs/benchmarks.md), saves JSON and two PNG plots (tokens/s against
concurrency per method; the distribution of tokens per step per method). Ratios compare numbers measured in this one
run. The methods by default: :func:`default_methods`. :mod:`bench.perf_tools` runs perf_analyzer, :mod:`bench.aiperf`
AIPerf.

    python -m bench.serving --output results/serving.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from bench import aiperf
from bench.perf_tools import run_perf_analyzer
from client.datasets import humaneval_prompts
from client.generate import stream_generate
from client.metrics import scrape, value


def default_methods() -> tuple[str, ...]:
    """The methods the suite measures unless ``--methods`` says otherwise: the model-free methods the registry
    serves (:func:`client.soak.model_free_methods`: no draft LM and no speculator head), then the draft
    LM (``main`` drops it when ``make draft`` has not built one).

    Left out: ``hybrid`` and the heads of ``speculator_path`` (``eagle3``, ``eagle``, ...). The suite runs
    perf_analyzer at every concurrency level (and AIPerf) for each method on one server, its longest part;
    ``client.bench``'s repeated workload measures hybrid and the heads, through a fresh server each, and ``--methods``
    adds them here.
    """
    from client.soak import model_free_methods
    from spec_decode.proposers.draft_lm import DraftModelProposer
    from spec_decode.proposers.hybrid import HybridProposer

    return (*(m for m in model_free_methods() if m != HybridProposer.name), DraftModelProposer.name)


def model_batching(metrics_url: str, model: str = "target_model") -> tuple[float, float]:
    """(inferences, executions) of ``model`` so far (Triton's nv_inference_count / nv_inference_exec_count); their
    ratio over an interval is the mean number of sequences per forward."""
    s = scrape(metrics_url, prefix="nv_inference_")
    return (value(s, "nv_inference_count", model=model, version="1"),
            value(s, "nv_inference_exec_count", model=model, version="1"))


def measure(srv, fn) -> dict:
    """``fn()``'s row plus target_mean_batch: sequences per target forward while it ran."""
    before = model_batching(srv.metrics_url)
    row = fn()
    after = model_batching(srv.metrics_url)
    execs = after[1] - before[1]
    return row | {"target_mean_batch": (after[0] - before[0]) / execs if execs else None}


def full_vocab_draft(draft_dir: Path, target_vocab_size: int):
    """The distilled draft as a full-vocabulary transformers model, for ``generate(assistant_model=...)``.

    The draft's embedding and head have N + 1 rows (kept target tokens + one row for every other token). Here the
    embedding gets V rows (each target id reads its draft row, the shared row for ids outside the set) and the head V
    rows plus a bias of -1e9 outside the set, so the greedy proposals equal the served draft's exactly.

    Returns:
        a ``*ForCausalLM`` (float32, CPU, eval) with vocab_size V.
    """
    import torch

    from spec_decode.engine.draft_vocab import load_draft_vocab
    from spec_decode.engine.model_loading import load_causal_lm

    model = load_causal_lm(draft_dir, torch.device("cpu"), torch.float32)
    vocab = load_draft_vocab(draft_dir)
    if vocab is None:
        return model
    rows = model.get_input_embeddings().weight.detach()[vocab.to_draft]  # [V, H]
    emb = torch.nn.Embedding(target_vocab_size, rows.shape[1])
    emb.weight.data = rows.clone()
    head = torch.nn.Linear(rows.shape[1], target_vocab_size, bias=True)
    head.weight.data = rows.clone()
    head.bias.data = torch.full((target_vocab_size,), -1e9)
    head.bias.data[vocab.token_ids] = 0.0
    model.set_input_embeddings(emb)
    model.lm_head = head
    model.config.vocab_size = target_vocab_size
    model.config.tie_word_embeddings = False
    return model.eval()


def in_process_baselines(prompts: list[str], max_tokens: int, k: int, draft_dir: Path | None) -> list[dict]:
    """transformers generate, prompt lookup and assisted generation (greedy, ``max_tokens`` new tokens each, EOS
    ignored as the server's ``ignore_eos``) on ``prompts``, one at a time, on the CPU in float32.

    Args:
        k: prompt lookup's ``prompt_lookup_num_tokens`` and the assistant's tokens per step.
        draft_dir: the distilled draft for assisted generation (None: that variant is skipped).

    Returns:
        one row per variant: tool, method (``transformers:<variant>``), concurrency 1, tokens, seconds, tokens_per_s.
    """
    import torch

    from spec_decode.engine.model_loading import load_causal_lm, load_tokenizer, prepare_default_model

    path = prepare_default_model()
    tok = load_tokenizer(path)
    model = load_causal_lm(path, torch.device("cpu"), torch.float32)
    variants = {"transformers:generate": {}, "transformers:prompt_lookup": {"prompt_lookup_num_tokens": k}}
    if draft_dir is not None:
        assistant = full_vocab_draft(draft_dir, int(model.config.vocab_size))
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        variants["transformers:assisted"] = {"assistant_model": assistant}
    rows = []
    for name, extra in variants.items():
        kw = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **extra)
        with torch.inference_mode():
            model.generate(**tok("warm up", return_tensors="pt"), **(kw | {"max_new_tokens": 4, "min_new_tokens": 4}))
        tokens, seconds = 0, 0.0
        for p in prompts:
            enc = tok(p, return_tensors="pt")
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(**enc, **kw)
            seconds += time.perf_counter() - t0
            tokens += out.shape[1] - enc["input_ids"].shape[1]
        rows.append({"tool": "in-process", "method": name, "concurrency": 1, "tokens": tokens, "seconds": seconds,
                     "tokens_per_s": tokens / seconds})
        print(f"{name:<28} {tokens / seconds:8.2f} tokens/s", flush=True)
    return rows


def plot(rows: list[dict], baselines: list[dict], path_tps: Path, path_hist: Path, title: str) -> None:
    """tokens/s against concurrency per method (perf_analyzer; in-process baselines as lines at concurrency 1), and the
    distribution of tokens per step per method (perf_analyzer, all levels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pa = [r for r in rows if r["tool"] == "perf_analyzer" and not r.get("disable_by_batch_size")]
    methods = list(dict.fromkeys(r["method"] for r in pa))
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for m in methods:
        pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in pa if r["method"] == m)
        ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=f"server {m}")
    for r in [r for r in rows if r.get("disable_by_batch_size")]:
        ax.scatter([r["concurrency"]], [r["tokens_per_s"]], marker="x", s=60,
                   label=f"{r['method']}, disable_by_batch_size={r['disable_by_batch_size']}")
    for b, style in zip(baselines, ("--", ":", "-.")):
        ax.axhline(b["tokens_per_s"], color="gray", linestyle=style, linewidth=1, label=f"{b['method']} (c=1)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["concurrency"] for r in pa}), [str(c) for c in sorted({r["concurrency"] for r in pa})])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s (all streams)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path_tps, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    width = 0.8 / max(1, len(methods))
    kmax = max((int(n) for r in pa for n in r["tokens_per_step_histogram"]), default=1)
    for j, m in enumerate(methods):
        hist: dict[int, int] = {}
        for r in pa:
            if r["method"] == m:
                for n, c in r["tokens_per_step_histogram"].items():
                    hist[int(n)] = hist.get(int(n), 0) + c
        total = sum(hist.values()) or 1
        xs = [n + (j - (len(methods) - 1) / 2) * width for n in range(1, kmax + 1)]
        ax.bar(xs, [hist.get(n, 0) / total for n in range(1, kmax + 1)], width,
               label=f"{m} (mean {sum(n * c for n, c in hist.items()) / total:.2f})")
    ax.set_xlabel("tokens emitted per step")
    ax.set_ylabel("fraction of steps")
    ax.set_xticks(range(1, kmax + 1))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path_hist, dpi=120)
    plt.close(fig)


def goals(rows: list[dict], baselines: list[dict], levels: list[int]) -> list[dict]:
    """The serving goals from this run's rows (best method >= 1.8x none at the lowest concurrency; none through the
    server >= 0.9x in-process generate; none at the highest concurrency >= 3x the lowest; with disable_by_batch_size,
    every method >= none): each with goal, target, reached (a number), met (bool) and, for the first, detail (the
    method)."""
    pa = {(r["method"], r["concurrency"]): r["tokens_per_s"] for r in rows
          if r["tool"] == "perf_analyzer" and not r.get("disable_by_batch_size")}
    out = []
    c1, cmax = levels[0], levels[-1]
    none1 = pa.get(("none", c1))
    spec = {m: v for (m, c), v in pa.items() if c == c1 and m != "none"}
    if none1 and spec:
        best = max(spec, key=spec.get)
        out.append({"goal": f"best method / none at concurrency {c1}", "target": ">= 1.8",
                    "reached": spec[best] / none1, "detail": best, "met": spec[best] / none1 >= 1.8})
    hf = next((b["tokens_per_s"] for b in baselines if b["method"] == "transformers:generate"), None)
    if none1 and hf:
        out.append({"goal": f"none through the server / in-process transformers generate (concurrency {c1})",
                    "target": ">= 0.9", "reached": none1 / hf, "met": none1 / hf >= 0.9})
    if none1 and pa.get(("none", cmax)):
        r = pa[("none", cmax)] / none1
        out.append({"goal": f"none: tokens/s at concurrency {cmax} / at {c1}", "target": ">= 3", "reached": r,
                    "met": r >= 3})
    dis = [r for r in rows if r.get("disable_by_batch_size")]
    none_d = next((r["tokens_per_s"] for r in dis if r["method"] == "none"), None)
    for r in dis:
        if r["method"] != "none" and none_d:
            out.append({"goal": f"{r['method']} with disable_by_batch_size={r['disable_by_batch_size']} / none "
                                f"(concurrency {r['concurrency']})", "target": ">= 1.0",
                        "reached": r["tokens_per_s"] / none_d, "met": r["tokens_per_s"] / none_d >= 1.0})
    return out


def _print_rows(rows: list[dict]) -> None:
    print(f"\n{'tool':<26}{'method':<28}{'conc':>5}{'tokens/s':>10}{'TTFT ms':>9}{'ITL ms':>8}{'tok/step':>9}"
          f"{'batch':>7}  note")
    for r in rows:
        h = r.get("tokens_per_step_histogram") or {}
        steps = sum(h.values())
        tps = f"{sum(int(n) * c for n, c in h.items()) / steps:.2f}" if steps else (
            f"{r['tokens_per_response']:.2f}" if r.get("tokens_per_response") else "-")
        fmt = lambda v, f: format(v, f) if isinstance(v, (int, float)) else "-".rjust(int(f.split(".")[0]))  # noqa: E731
        note = f"disable_by_batch_size={r['disable_by_batch_size']}" if r.get("disable_by_batch_size") else ""
        tool = f"{r['tool']}:{r['endpoint']}" if r.get("endpoint") else r["tool"]
        print(f"{tool:<26}{r['method']:<28}{r['concurrency']:>5}{fmt(r.get('tokens_per_s'), '10.2f')}"
              f"{fmt(r.get('ttft_ms'), '9.0f')}{fmt(r.get('itl_ms'), '8.1f')}{tps:>9}"
              f"{fmt(r.get('target_mean_batch'), '7.2f')}  {note or r.get('error', '')[:60]}")


def prompt_windows(sizes: dict, pool: list[str]) -> dict:
    """Consecutive windows of ``pool``, in the order of ``sizes`` (key -> number of prompts), wrapping around when
    the pool runs out: key -> its prompts."""
    out, at = {}, 0
    for key, n in sizes.items():
        out[key] = [pool[(at + i) % len(pool)] for i in range(n)]
        at += n
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI: run the suite, print the tables and goals, save JSON and PNGs."""
    from spec_decode.engine.model_loading import prepare_default_model
    from spec_decode.launcher import TritonServer, draft_overrides, prepare_repository
    from spec_decode.proposers.draft_lm import default_draft_dir, default_draft_ready
    from spec_decode.proposers.hybrid import HybridProposer
    from spec_decode.proposers.suffix import SuffixProposer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=",".join(default_methods()),
                    help="speculative methods, comma-separated (default: %(default)s; draft is dropped when no draft "
                         "LM is built)")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--requests-per-stream", type=int, default=2, help="requests per level = this x concurrency")
    ap.add_argument("--min-requests", type=int, default=4, help="at least this many requests per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--disable-by-batch-size", type=int, default=4,
                    help="the second server's disable_by_batch_size (0 = skip that part)")
    ap.add_argument("--aiperf", help="aiperf executable (default: .venv-aiperf/bin/aiperf or PATH; 'none' skips it)")
    ap.add_argument("--aiperf-endpoints", default=",".join(aiperf.ENDPOINTS),
                    help="the endpoints AIPerf profiles, comma-separated (default: %(default)s)")
    ap.add_argument("--skip-baselines", action="store_true", help="skip the in-process transformers baselines")
    ap.add_argument("--output", type=Path, default=Path("results/serving.json"))
    args = ap.parse_args(argv)

    levels = [int(c) for c in args.concurrency.split(",")]
    methods = args.methods.split(",")
    draft_dir = default_draft_dir() if default_draft_ready() else None
    if "draft" in methods and draft_dir is None:
        print("no distilled draft (make draft): skipping speculative_method=draft", flush=True)
        methods.remove("draft")
    counts = dict(zip(levels, [max(args.min_requests, args.requests_per_stream * c) for c in levels]))
    aip = None if args.aiperf == "none" else aiperf.find_aiperf(args.aiperf)
    if aip is None and args.aiperf != "none":
        print("aiperf not found (scripts/setup_bench.sh installs it into .venv-aiperf): skipping it", flush=True)
    endpoints = [e for e in args.aiperf_endpoints.split(",") if e] if aip else []
    if set(endpoints) - set(aiperf.ENDPOINTS):
        ap.error(f"--aiperf-endpoints: each one of {', '.join(aiperf.ENDPOINTS)}")
    own_window = frozenset({SuffixProposer.name, HybridProposer.name})  # they draft from earlier responses
    slots = len(endpoints) if own_window & set(methods) else min(1, len(endpoints))
    # A window of prompts per perf_analyzer level, then AIPerf's (concurrency, slot) windows, then the warm-up
    # prompt, so suffix decoding never sees a prompt twice.
    sizes = {("pa", c): n for c, n in counts.items()} | {
        (c, s): counts[c] for c in sorted({levels[0], levels[-1]}) for s in range(slots)}
    pool = humaneval_prompts(min(164, sum(sizes.values()) + 1))
    warm, all_windows = pool[-1], prompt_windows(sizes, pool[:-1])
    windows = {c: all_windows[("pa", c)] for c in levels}
    aip_windows = {key: w for key, w in all_windows.items() if key[0] != "pa"}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="spec_decode_bench_"))
    overrides = draft_overrides(str(draft_dir)) if draft_dir is not None else {}
    rows: list[dict] = []

    @contextlib.contextmanager
    def serve(extra: dict, tag: str):
        ov = {m: dict(p) for m, p in overrides.items()}
        for m, p in extra.items():
            ov.setdefault(m, {}).update(p)
        log = args.output.with_name(f"{args.output.stem}.{tag}.server.log")
        with TritonServer(prepare_repository(ov or None), log_path=log) as srv:
            srv.wait_ready(timeout=900)
            yield srv

    with serve({}, "main") as srv:
        for m in methods:
            stream_generate(srv.grpc_url, warm, 8, speculative_method=m)  # warm-up
            for c in levels:
                print(f"perf_analyzer: {m}, concurrency {c}, {len(windows[c])} requests ...", flush=True)
                rows.append(measure(srv, partial(
                    run_perf_analyzer, srv.grpc_url, windows[c], m, args.num_draft_tokens, c, len(windows[c]),
                    args.max_tokens, workdir)))
                print(f"  {rows[-1]['tokens_per_s']:.2f} tokens/s, TTFT {rows[-1]['ttft_ms']:.0f} ms, "
                      f"ITL {rows[-1]['itl_ms']:.1f} ms, target batch {rows[-1]['target_mean_batch'] or 0:.2f}",
                      flush=True)
        if aip is not None:
            log = args.output.with_name(f"{args.output.stem}.openai.log")
            with aiperf.openai_frontend(srv, log, wanted=any(e.startswith("openai") for e in endpoints)) as openai_url:
                urls = {e: srv.http_url if e == "triton-generate" else openai_url for e in endpoints}
                rows += aiperf.profile_endpoints(
                    aip, {e: u for e, u in urls.items() if u}, methods, aip_windows, args.num_draft_tokens,
                    args.max_tokens, prepare_default_model(), workdir, warm, own_window)
    if args.disable_by_batch_size > 0:
        c = levels[-1]
        with serve({"generate": {"disable_by_batch_size": str(args.disable_by_batch_size)}}, "disable") as srv:
            for m in methods:
                stream_generate(srv.grpc_url, warm, 8, speculative_method=m)
                print(f"perf_analyzer (disable_by_batch_size={args.disable_by_batch_size}): {m}, concurrency {c} ...",
                      flush=True)
                row = measure(srv, partial(
                    run_perf_analyzer, srv.grpc_url, windows[c], m, args.num_draft_tokens, c, len(windows[c]),
                    args.max_tokens, workdir, tag="disable."))
                rows.append(row | {"disable_by_batch_size": args.disable_by_batch_size})
    baselines = []
    if not args.skip_baselines:
        print(f"in-process baselines on the {len(windows[levels[0]])} prompts of the concurrency-{levels[0]} "
              "window ...", flush=True)
        baselines = in_process_baselines(windows[levels[0]], args.max_tokens, args.num_draft_tokens, draft_dir)

    title = (f"HumanEval, {args.max_tokens} tokens/request (ignore_eos), greedy, k={args.num_draft_tokens}, "
             f"{os.cpu_count()} CPUs")
    _print_rows(rows + baselines)
    aiperf.print_comparison(endpoint_table := aiperf.compare_endpoints(rows))
    goal_rows = goals(rows, baselines, levels)
    print("\ngoals:")
    for g in goal_rows:
        print(f"  {'MET ' if g['met'] else 'not met'}  {g['goal']}: {g['reached']:.2f} (target {g['target']})"
              + (f" [{g['detail']}]" if g.get("detail") else ""))
    result = {"title": title, "max_tokens": args.max_tokens, "num_draft_tokens": args.num_draft_tokens,
              "levels": levels, "methods": methods, "draft_model": str(draft_dir) if draft_dir else None,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows, "baselines": baselines, "goals": goal_rows,
              "aiperf_endpoints": endpoint_table}
    args.output.write_text(json.dumps(result, indent=2))
    tps_png = args.output.with_name(f"{args.output.stem}_tokens_per_s.png")
    hist_png = args.output.with_name(f"{args.output.stem}_tokens_per_step.png")
    plot(rows, baselines, tps_png, hist_png, title)
    print(f"\nsaved {args.output}, {tps_png} and {hist_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
