"""perf_analyzer against ``generate``: one run, and the figures read from its export.

Used by :mod:`bench.serving`. perf_analyzer is tritonclient's (``scripts/setup.sh`` installs it into the venv, beside
this interpreter). AIPerf, the other tool of the suite, is :mod:`bench.aiperf`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def perf_analyzer_env() -> dict[str, str]:
    """Environment for tritonclient's perf_analyzer: libcudart.so.12 (PyPI nvidia-cuda-runtime-cu12) on
    LD_LIBRARY_PATH, and the venv's bin first on PATH."""
    import nvidia.cuda_runtime

    env = dict(os.environ)
    libs = [str(Path(p) / "lib") for p in nvidia.cuda_runtime.__path__]
    env["LD_LIBRARY_PATH"] = ":".join(libs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def _ids_count(output: dict) -> int:
    ids = output.get("output_ids", [])
    return len(ids) if isinstance(ids, list) else 1


def parse_profile_export(path: Path) -> dict:
    """Figures from a perf_analyzer ``--profile-export-file`` of streaming requests to ``generate``.

    Returns:
        dict: requests, tokens, span_s, tokens_per_s (tokens / span from the first request to the last response),
        ttft_ms and itl_ms (median over requests, with their p90), latency_ms (median), tokens_per_step_histogram
        (tokens in one streamed response -> count; one response per step).

    Raises:
        ValueError: the export holds no request with a response.
    """
    data = json.loads(Path(path).read_text())
    reqs = [r for e in data["experiments"] for r in e["requests"] if r.get("response_timestamps")]
    if not reqs:
        raise ValueError(f"{path}: no request with a response")
    tokens, ttft, itl, lat, hist = 0, [], [], [], {}
    start = min(int(r["timestamp"]) for r in reqs)
    end = max(int(r["response_timestamps"][-1]) for r in reqs)
    for r in reqs:
        t0, times = int(r["timestamp"]), [int(t) for t in r["response_timestamps"]]
        counts = [_ids_count(o) for o in r.get("response_outputs", [])]
        n = sum(counts)
        tokens += n
        for c in counts:
            if c:
                hist[c] = hist.get(c, 0) + 1
        ttft.append((times[0] - t0) / 1e6)
        lat.append((times[-1] - t0) / 1e6)
        if n > 1:
            itl.append((times[-1] - times[0]) / 1e6 / (n - 1))

    def p90(x):
        return sorted(x)[min(len(x) - 1, int(0.9 * len(x)))]

    span = (end - start) / 1e9
    return {"requests": len(reqs), "tokens": tokens, "span_s": span, "tokens_per_s": tokens / span,
            "ttft_ms": statistics.median(ttft), "ttft_p90_ms": p90(ttft),
            "itl_ms": statistics.median(itl) if itl else None, "itl_p90_ms": p90(itl) if itl else None,
            "latency_ms": statistics.median(lat),
            "tokens_per_step_histogram": {str(k): v for k, v in sorted(hist.items())}}


def run_perf_analyzer(url: str, prompts: list[str], method: str, k: int, concurrency: int, requests: int,
                      max_tokens: int, workdir: Path, tag: str = "") -> dict:
    """One perf_analyzer run against ``generate`` (gRPC streaming) -> its export's figures.

    Args:
        url: the server's gRPC host:port.
        prompts: the request texts, sent greedy with ``ignore_eos`` (every request ``max_tokens`` new tokens).
        method, k: speculative_method and num_draft_tokens (0 for ``none``).
        concurrency, requests: streams in flight, and requests in all.
        workdir: where the input data, the export and each attempt's log are written (``tag`` prefixes the names).

    Returns:
        dict: tool, method, concurrency and :func:`parse_profile_export`'s figures.

    Raises:
        RuntimeError: perf_analyzer failed three times (its output is in the message).
    """
    tag = f"{tag}{method}.c{concurrency}"
    data = {"data": [{"text_input": [p], "max_tokens": [max_tokens], "stream": [True], "ignore_eos": [True],
                      "speculative_method": [method], "num_draft_tokens": [k if method != "none" else 0]}
                     for p in prompts]}
    inp, export = workdir / f"input.{tag}.json", workdir / f"perf_analyzer.{tag}.json"
    inp.write_text(json.dumps(data))
    # -x 1: without an explicit version perf_analyzer 2.49 sometimes fails its server-statistics lookup ("failed to
    # find the requested model version") after the run; now and then it also leaves an empty export with exit status
    # 0. Up to two retries cover those (each attempt's output is kept in the workdir).
    cmd = [str(Path(sys.executable).parent / "perf_analyzer"), "-m", "generate", "-x", "1", "-i", "grpc", "-u", url,
           "--streaming", "--concurrency-range", str(concurrency), "--input-data", str(inp), "--request-count",
           str(requests), "--profile-export-file", str(export)]
    for attempt in range(3):
        export.unlink(missing_ok=True)  # perf_analyzer refuses an existing export path
        r = subprocess.run(cmd, env=perf_analyzer_env(), capture_output=True, text=True, timeout=3600)
        (workdir / f"perf_analyzer.{tag}.{attempt}.log").write_text(r.stdout + r.stderr)
        try:
            if r.returncode == 0:
                return ({"tool": "perf_analyzer", "method": method, "concurrency": concurrency}
                        | parse_profile_export(export))
        except (OSError, ValueError) as exc:  # an empty export now and then, with exit status 0
            print(f"  perf_analyzer wrote no usable export ({exc}); running it again", flush=True)
    raise RuntimeError(f"perf_analyzer failed ({r.returncode}): {' '.join(cmd)}\n{(r.stdout + r.stderr)[:1500]}")
