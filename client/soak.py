"""Soak test of a running server: many concurrent requests with random parameters and random cancellations.

Afterwards every per-sequence cache must be empty (the server's metrics) and, when the caller can read the model
processes' memory (``rss``), it must stay flat. Usage against a running server (prints and saves a JSON report):

    python -m client.soak --url 127.0.0.1:8001 --metrics-url 127.0.0.1:8002 --requests 200 --concurrency 8
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .generate import build_inputs
from .metrics import scrape, value

CACHE_GAUGES = ("spec_decode_running_sequences", "spec_decode_target_kv_cache_sequences",
                "spec_decode_draft_kv_cache_sequences", "spec_decode_eagle_cache_sequences",
                "spec_decode_eagle3_cache_sequences", "spec_decode_suffix_active_requests")


def model_free_methods() -> tuple[str, ...]:
    """``none`` and every registered proposer that needs no model (no draft LM, no speculator head), in the registry's
    order: what a server offers without either (:func:`spec_decode.proposers.registry.offered_methods`)."""
    from spec_decode.proposers.registry import offered_methods

    return offered_methods({"draft_model_path": "none", "speculator_path": "none"})


def random_request(rng: random.Random, prompts: list[str], methods: tuple[str, ...], cancel_fraction: float,
                   max_tokens: tuple[int, int] = (4, 48)) -> dict:
    """One random request: generate inputs (``params``) and when to cancel it (``cancel_after``: None = never, an int
    = after that many streamed responses, a float = after that many seconds)."""
    params = {"speculative_method": rng.choice(methods), "num_draft_tokens": rng.randint(0, 8),
              "stream": rng.random() < 0.8}
    if rng.random() < 0.5:
        params.update(temperature=rng.uniform(0.5, 1.2), top_k=rng.choice([0, 20, 50]), top_p=rng.choice([1.0, 0.9]))
        if rng.random() < 0.5:
            params["random_seed"] = rng.randrange(2**32)
    cancel_after = None
    if rng.random() < cancel_fraction:
        cancel_after = rng.randint(1, 3) if params["stream"] else rng.uniform(0.05, 0.5)
    return {"prompt": rng.choice(prompts), "max_tokens": rng.randint(*max_tokens), "params": params,
            "cancel_after": cancel_after}


def send(url: str, req: dict, timeout_s: float = 300.0) -> dict:
    """Send one request over a gRPC stream; cancel it as ``req['cancel_after']`` says.

    Returns:
        {"outcome": "finished" | "cancelled" | "error", "tokens": ids received, "error": message or None}.
    """
    import tritonclient.grpc as grpcclient

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    tokens, responses, outcome, message = 0, 0, "finished", None
    t0 = time.monotonic()
    try:
        client.async_stream_infer("generate", build_inputs(req["prompt"], req["max_tokens"], **req["params"]),
                                  enable_empty_final_response=True)
        cancel = req["cancel_after"]
        while True:
            wait = timeout_s
            if isinstance(cancel, float):
                wait = max(0.0, cancel - (time.monotonic() - t0))
            try:
                res, err = q.get(timeout=wait)
            except queue.Empty:
                if isinstance(cancel, float):
                    outcome = "cancelled"
                    break
                raise TimeoutError(f"no response within {timeout_s} s") from None
            if err is not None:
                outcome, message = "error", str(err)
                break
            resp = res.get_response()
            if any(o.name == "output_ids" for o in resp.outputs):
                tokens += res.as_numpy("output_ids").size
                responses += 1
            if resp.parameters["triton_final_response"].bool_param:
                break
            if isinstance(cancel, int) and responses >= cancel:
                outcome = "cancelled"
                break
    except Exception as exc:  # noqa: BLE001 - reported, the soak goes on
        outcome, message = "error", f"{type(exc).__name__}: {exc}"
    finally:
        client.stop_stream(cancel_requests=outcome == "cancelled")
        client.close()
    return {"outcome": outcome, "tokens": tokens, "error": message}


def run_soak(url: str, metrics_url: str, requests: int = 200, concurrency: int = 8, cancel_fraction: float = 0.3,
             seed: int = 0, prompts: list[str] | None = None, methods: tuple[str, ...] | None = None,
             rss=None, warmup: int = 40, settle_s: float = 60.0, max_tokens: tuple[int, int] = (4, 48)) -> dict:
    """Run the soak and report.

    Args:
        url: gRPC host:port of the server; metrics_url: its metrics host:port.
        requests: how many requests in all; concurrency: how many in flight at once.
        cancel_fraction: the fraction cancelled by the client (after 1-3 responses, or 0.05-0.5 s without streaming).
        seed: seeds the random requests (the same seed sends the same requests).
        prompts: texts to draw from (default: the first 20 HumanEval prompts).
        methods: speculative methods to draw from (the server must serve them; default: :func:`model_free_methods`,
            then the draft LM's ``draft``).
        rss: callable returning {process name: RSS bytes}, sampled after ``warmup`` requests and at the end (None =
            memory not measured).
        settle_s: how long to wait, at the end, for the server's running sequences and caches to reach zero.
        max_tokens: each request's max_tokens is drawn uniformly from this range (inclusive).

    Returns:
        dict with the outcome counts, tokens received, wall time, the cache gauges at the end (``caches``),
        ``caches_empty``, and when ``rss`` is given: ``rss_after_warmup``, ``rss_end``, ``rss_growth`` (bytes per
        process) and ``kv_allocated_growth`` (per model, the most positions its KV caches allocated, running and
        released ones kept for prefix reuse, after the warm-up, less what they allocated at its end: memory that
        prefix caching keeps by design, up to its ``kv_cache_max_tokens`` (docs/scheduling.md), and that the
        process's allocator keeps once it has been touched).
    """
    if prompts is None:
        from .datasets import humaneval_prompts

        prompts = humaneval_prompts(20)
    if methods is None:
        from spec_decode.proposers.draft_lm import DraftModelProposer

        methods = (*model_free_methods(), DraftModelProposer.name)
    rng = random.Random(seed)
    reqs = [random_request(rng, prompts, tuple(methods), cancel_fraction, max_tokens) for _ in range(requests)]
    results: list[dict | None] = [None] * requests
    lock = threading.Lock()
    done = 0
    report: dict = {"requests": requests, "concurrency": concurrency, "cancel_fraction": cancel_fraction,
                    "seed": seed}
    rss_warm = None
    kv_warm: dict[str, float] = {}
    kv_peak: dict[str, float] = {}

    def work(i: int) -> None:
        nonlocal done, rss_warm, kv_warm
        results[i] = send(url, reqs[i])
        with lock:
            done += 1
            if rss is not None and done == warmup:
                rss_warm = rss()
                kv_warm = kv_allocated(metrics_url)
            if rss is not None and done > warmup:
                for m, v in kv_allocated(metrics_url).items():
                    kv_peak[m] = max(kv_peak.get(m, 0.0), v)

    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(work, range(requests)))
    report["wall_s"] = time.monotonic() - t0

    deadline = time.monotonic() + settle_s
    while True:
        samples = scrape(metrics_url)
        caches = {g: value(samples, g) for g in CACHE_GAUGES}
        if not any(caches.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    report["caches"] = caches
    report["caches_empty"] = not any(caches.values())
    report["suffix_cached_responses"] = value(samples, "spec_decode_suffix_cached_responses")
    report["outcomes"] = {o: sum(r["outcome"] == o for r in results) for o in ("finished", "cancelled", "error")}
    report["errors"] = [r["error"] for r in results if r["outcome"] == "error"][:10]
    report["tokens_received"] = sum(r["tokens"] for r in results)
    report["requests_total"] = {f"{dict(lab)['method']}/{dict(lab)['finish_reason']}": v
                                for (name, lab), v in samples.items() if name == "spec_decode_requests_total"}
    if rss is not None:
        end = rss()
        report["rss_after_warmup"] = rss_warm
        report["rss_end"] = end
        report["rss_growth"] = {k: end[k] - rss_warm[k] for k in end if rss_warm and k in rss_warm}
        report["kv_allocated_growth"] = {m: max(0.0, v - kv_warm.get(m, 0.0)) for m, v in kv_peak.items()}
    return report


KV_ALLOCATED = {"target_model": "spec_decode_target_kv_cache_allocated_tokens",
                "draft_model": "spec_decode_draft_kv_cache_allocated_tokens"}


def kv_allocated(metrics_url: str) -> dict[str, float]:
    """Per model, the positions its KV caches allocate now (:data:`KV_ALLOCATED`'s gauges; 0 when absent)."""
    samples = scrape(metrics_url)
    return {m: value(samples, g) for m, g in KV_ALLOCATED.items()}


def main(argv: list[str] | None = None) -> int:
    """CLI: soak a running server, print the report, save it as JSON."""
    ap = argparse.ArgumentParser(description="Soak a running server with random requests and cancellations.")
    ap.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port")
    ap.add_argument("--metrics-url", default="127.0.0.1:8002", help="metrics host:port")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--cancel-fraction", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", help="comma-separated (default: none and every proposer served without a model; "
                                      "add draft or a head (eagle3, eagle, medusa, mlp_speculator, arctic) when "
                                      "served)")
    ap.add_argument("--max-tokens", default="4,48", help="range of max_tokens drawn per request: lo,hi")
    ap.add_argument("--output", default="results/soak.json")
    args = ap.parse_args(argv)
    report = run_soak(args.url, args.metrics_url, args.requests, args.concurrency, args.cancel_fraction, args.seed,
                      methods=tuple(args.methods.split(",")) if args.methods else model_free_methods(),
                      max_tokens=tuple(int(x) for x in args.max_tokens.split(",")))
    print(json.dumps(report, indent=2))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    return 0 if report["caches_empty"] and not report["outcomes"]["error"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
