"""perf_analyzer and genai-perf against ``generate``: one run each, and the figures read from their exports.

Used by :mod:`bench.serving`. perf_analyzer is tritonclient's (``scripts/setup.sh`` installs it into the venv, beside
this interpreter); genai-perf lives in its own venv (``scripts/setup_bench.sh``), since it pins packages the serving
venv must not take.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def perf_analyzer_env() -> dict[str, str]:
    """Environment for tritonclient's perf_analyzer: libcudart.so.12 (PyPI nvidia-cuda-runtime-cu12) on
    LD_LIBRARY_PATH, and the venv's bin first on PATH (genai-perf calls ``perf_analyzer`` from PATH)."""
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


def find_genai_perf(explicit: str | None) -> str | None:
    """The genai-perf executable: ``explicit``, else ``.venv-genai-perf/bin/genai-perf``, else on PATH
    (None if none)."""
    for cand in (explicit, str(ROOT / ".venv-genai-perf" / "bin" / "genai-perf"), shutil.which("genai-perf")):
        if cand and Path(cand).exists():
            return cand
    return None


def run_genai_perf(exe: str, url: str, prompts: list[str], method: str, k: int, concurrency: int, requests: int,
                   max_tokens: int, tokenizer: Path, workdir: Path) -> dict:
    """One genai-perf profile (Triton gRPC, TensorRT-LLM-style inputs, streaming) -> its own summary figures.

    Args:
        exe: the genai-perf executable (:func:`find_genai_perf`).
        url, prompts, method, k, concurrency, requests, max_tokens: as :func:`run_perf_analyzer`.
        tokenizer: the target's model folder (genai-perf counts tokens with its tokenizer).
        workdir: where the prompts file and the artifacts are written.

    Returns:
        dict: tool, method, concurrency, tokens_per_s, ttft_ms and itl_ms (p50), request_latency_ms (p50),
        output_sequence_length (mean, tokens), export (the JSON's path).

    Raises:
        RuntimeError: genai-perf failed or wrote no JSON export.
    """
    tag = f"{method}.c{concurrency}"
    art = workdir / f"genai_perf.{tag}"
    shutil.rmtree(art, ignore_errors=True)
    prompts_file = workdir / "genai_perf_prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts))
    cmd = [exe, "profile", "-m", "generate", "--endpoint-type", "kserve", "--backend", "tensorrtllm", "--streaming",
           "-u", url, "--input-file", str(prompts_file), "--tokenizer", str(tokenizer),
           "--output-tokens-mean", str(max_tokens), "--extra-inputs", f"speculative_method:{method}",
           "--extra-inputs", f"num_draft_tokens:{k if method != 'none' else 0}", "--extra-inputs", "ignore_eos:true",
           "--concurrency", str(concurrency), "--request-count", str(requests), "--artifact-dir", str(art)]
    r = subprocess.run(cmd, env=perf_analyzer_env(), capture_output=True, text=True, timeout=3600, cwd=workdir)
    exports = sorted(art.rglob("*genai_perf.json"))
    if r.returncode != 0 or not exports:
        raise RuntimeError(
            f"genai-perf failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    s = json.loads(exports[0].read_text())

    def stat(name, key="avg"):
        v = s.get(name, {})
        return v.get(key) if isinstance(v, dict) else None

    return {"tool": "genai-perf", "method": method, "concurrency": concurrency,
            "tokens_per_s": stat("output_token_throughput"), "ttft_ms": stat("time_to_first_token", "p50"),
            "itl_ms": stat("inter_token_latency", "p50"), "request_latency_ms": stat("request_latency", "p50"),
            "output_sequence_length": stat("output_sequence_length"), "export": str(exports[0])}
