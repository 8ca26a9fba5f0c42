"""What the OpenAI-compatible layer costs: the same requests through Triton's gRPC streaming and through
``/v1/completions`` (streamed, the official ``openai`` client), one server, in one run.

Both paths send the same HumanEval prompts (greedy, ``ignore_eos``, ``speculative_method=none`` by default: one
response per token, the layer's worst case), from ``concurrency`` client threads that each keep their connection (a
gRPC channel; an HTTP keep-alive pool), in alternating rounds so that drift on a shared machine hits both. Reported
per concurrency: output tokens/s of each path and their ratio (goal: OpenAI >= 0.97x gRPC at concurrency 1 and 8), and
the median time to the first token of each (goal: OpenAI within 2 ms of gRPC), measured on one-token requests where
the layer's cost is not hidden by decoding, also through a second frontend on the same server started with
uvicorn's pure-Python parser and the standard event loop (``--http h11 --loop asyncio``: the layer before httptools and
uvloop, the baseline of the same run). ``python -m bench.openai_cost --output results/openai_cost.json``;
docs/benchmarks.md reads the figures.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

GOAL_TOKENS_RATIO = 0.97
GOAL_TTFT_MS = 2.0


class GrpcPath:
    """One worker's gRPC client (its channel kept): a streamed ``generate`` request -> (TTFT s, tokens, total s)."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)

    def run(self, prompt: str, max_tokens: int, method: str) -> tuple[float, int, float]:
        from client.generate import build_inputs

        q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: q.put((time.perf_counter(), result, error)))
        try:
            t0 = time.perf_counter()
            self.client.async_stream_infer("generate", build_inputs(prompt, max_tokens, stream=True, ignore_eos=True,
                                                                    speculative_method=method, temperature=0.0))
            ttft, tokens = None, 0
            while True:
                t, res, err = q.get(timeout=300)
                if err is not None:
                    raise err
                n = res.as_numpy("output_ids").size
                if n and ttft is None:
                    ttft = t - t0
                tokens += n
                if res.as_numpy("finish_reason") is not None:
                    return ttft or t - t0, tokens, t - t0
        finally:
            self.client.stop_stream()

    def close(self) -> None:
        self.client.close()


class OpenAIPath:
    """One worker's ``openai`` client (its connections kept): a streamed completion -> (TTFT s, tokens, total s)."""

    def __init__(self, base_url: str, model: str):
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
        self.model = model

    def run(self, prompt: str, max_tokens: int, method: str) -> tuple[float, int, float]:
        t0 = time.perf_counter()
        ttft, tokens = None, 0
        stream = self.client.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "speculative_method": method})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        t = time.perf_counter() - t0
        return ttft or t, tokens, t

    def close(self) -> None:
        self.client.close()


class RawHTTPPath:
    """One worker's plain HTTP/1.1 connection (``http.client``, kept alive) to ``/v1/completions``, reading the SSE
    lines itself: the layer's cost without the official client's own (request building, pydantic parsing of every
    chunk) -> (TTFT s, tokens, total s)."""

    def __init__(self, base_url: str, model: str):
        import http.client
        from urllib.parse import urlparse

        u = urlparse(base_url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
        self.path, self.model = u.path + "/completions", model

    def run(self, prompt: str, max_tokens: int, method: str) -> tuple[float, int, float]:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                           "speculative_method": method})
        t0 = time.perf_counter()
        self.conn.request("POST", self.path, body, {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        ttft, tokens = None, 0
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            obj = json.loads(line[6:])
            if ttft is None and obj["choices"] and obj["choices"][0]["text"]:
                ttft = time.perf_counter() - t0
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
        t = time.perf_counter() - t0
        return ttft or t, tokens, t

    def close(self) -> None:
        self.conn.close()


def run_batch(make, prompts: list[str], concurrency: int, max_tokens: int, method: str) -> dict:
    """``prompts`` through ``concurrency`` workers (each its own client from ``make()``) -> tokens/s, TTFTs."""
    local = threading.local()
    clients = []
    lock = threading.Lock()

    def one(prompt: str):
        if not hasattr(local, "c"):
            local.c = make()
            with lock:
                clients.append(local.c)
        return local.c.run(prompt, max_tokens, method)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    for c in clients:
        c.close()
    tokens = sum(r[1] for r in rows)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "ttft_s": [r[0] for r in rows]}


def measure(grpc_url: str, base_url: str, model: str, prompts: list[str], args, baseline_url: str = "") -> dict:
    """Every comparison on one running server and frontend (module docstring)."""
    paths = {"grpc": lambda: GrpcPath(grpc_url), "openai": lambda: OpenAIPath(base_url, model)}
    out: dict = {"throughput": {}, "ttft": {}}
    for c in args.concurrency:
        batch = (prompts * ((args.requests_per_worker * c) // len(prompts) + 1))[: args.requests_per_worker * c]
        runs: dict[str, list[dict]] = {"grpc": [], "openai": []}
        for r in range(args.rounds):
            for name in (("grpc", "openai") if r % 2 == 0 else ("openai", "grpc")):
                runs[name].append(run_batch(paths[name], batch, c, args.max_tokens, args.method))
                print(f"  concurrency {c}, round {r + 1}, {name:<6}: {runs[name][-1]['tokens_per_s']:7.1f} tokens/s",
                      flush=True)
        tps = {k: sum(x["tokens"] for x in v) / sum(x["wall_s"] for x in v) for k, v in runs.items()}
        out["throughput"][str(c)] = {"tokens_per_s": tps, "openai_over_grpc": tps["openai"] / tps["grpc"],
                                     "runs": runs, "goal": GOAL_TOKENS_RATIO,
                                     "reached": tps["openai"] / tps["grpc"] >= GOAL_TOKENS_RATIO}
    # first token alone: one-token requests, alternating paths, one worker each (the OpenAI path also through a
    # plain HTTP connection: the layer's cost without the official client's)
    ttft: dict[str, list[float]] = {"grpc": [], "openai": [], "openai_raw_http": []}
    workers = {k: make() for k, make in paths.items()}
    workers["openai_raw_http"] = RawHTTPPath(base_url, model)
    if baseline_url:  # the same layer on h11 and asyncio
        ttft["baseline_raw_http"] = []
        workers["baseline_raw_http"] = RawHTTPPath(baseline_url, model)
    order = list(ttft)
    for i in range(args.ttft_requests):
        for name in order[i % len(order):] + order[:i % len(order)]:
            ttft[name].append(workers[name].run(prompts[i % len(prompts)], 1, args.method)[0])
    for w in workers.values():
        w.close()
    med = {k: statistics.median(v) for k, v in ttft.items()}
    diff_ms = (med["openai"] - med["grpc"]) * 1000
    raw_ms = (med["openai_raw_http"] - med["grpc"]) * 1000
    if baseline_url:
        out["ttft"]["baseline_raw_http_minus_grpc_ms"] = (med["baseline_raw_http"] - med["grpc"]) * 1000
    out["ttft"] |= {"median_s": med, "openai_minus_grpc_ms": diff_ms, "raw_http_minus_grpc_ms": raw_ms,
                   "samples_s": ttft, "p90_s": {k: float(np.percentile(v, 90)) for k, v in ttft.items()},
                   "goal_ms": GOAL_TTFT_MS, "reached": raw_ms <= GOAL_TTFT_MS}
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI: start a server and the frontend, measure, print the table, save JSON."""
    from client.datasets import humaneval_prompts
    from spec_decode.launcher import TritonServer, free_ports
    from spec_decode.launcher.frontend import OpenAIFrontend

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests-per-worker", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="rounds per path (alternating order)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--method", default="none")
    ap.add_argument("--ttft-requests", type=int, default=30)
    ap.add_argument("--output", type=Path, default=Path("results/openai_cost.json"))
    args = ap.parse_args(argv)

    prompts = humaneval_prompts(16)
    logdir = Path(tempfile.mkdtemp(prefix="spec_decode_openai_cost_"))
    with TritonServer(log_path=logdir / "server.log") as srv:
        srv.wait_ready(timeout=900)
        ports = free_ports(2)
        fe = OpenAIFrontend(srv.grpc_url, ports[0], log_path=logdir / "frontend.log").start()
        base = OpenAIFrontend(srv.grpc_url, ports[1], log_path=logdir / "frontend_h11.log",
                              extra_args=("--http", "h11", "--loop", "asyncio")).start()
        try:
            fe.wait_ready(120)
            base.wait_ready(120)
            for p in prompts[:2]:  # warm-up: both paths, first requests of a fresh server
                GrpcPath(srv.grpc_url).run(p, 8, args.method)
                OpenAIPath(fe.url + "/v1", fe.served_name).run(p, 8, args.method)
            RawHTTPPath(base.url + "/v1", fe.served_name).run(prompts[0], 8, args.method)
            result = measure(srv.grpc_url, fe.url + "/v1", fe.served_name, prompts, args, base.url + "/v1")
        finally:
            fe.stop()
            base.stop()
    result["settings"] = vars(args) | {"output": str(args.output)}
    print(f"\n{'concurrency':<12}{'gRPC tok/s':>12}{'OpenAI tok/s':>14}{'ratio':>8}  goal >= {GOAL_TOKENS_RATIO}")
    for c, r in result["throughput"].items():
        t = r["tokens_per_s"]
        print(f"{c:<12}{t['grpc']:12.1f}{t['openai']:14.1f}{r['openai_over_grpc']:7.3f}x  "
              f"{'reached' if r['reached'] else 'NOT reached'}")
    t = result["ttft"]
    m = t["median_s"]
    print(f"TTFT (one-token requests, median): gRPC {m['grpc'] * 1000:.1f} ms; OpenAI through plain HTTP "
          f"{m['openai_raw_http'] * 1000:.1f} ms: {t['raw_http_minus_grpc_ms']:+.2f} ms (goal <= {GOAL_TTFT_MS} ms: "
          f"{'reached' if t['reached'] else 'NOT reached'}); through the openai client {m['openai'] * 1000:.1f} ms: "
          f"{t['openai_minus_grpc_ms']:+.2f} ms; the baseline layer (h11, asyncio) through plain HTTP "
          f"{m['baseline_raw_http'] * 1000:.1f} ms: {t['baseline_raw_http_minus_grpc_ms']:+.2f} ms")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
