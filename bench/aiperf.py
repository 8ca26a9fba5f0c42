"""NVIDIA AIPerf (genai-perf's successor) against the server: one profile each, and the figures of its JSON export.

Used by :mod:`bench.serving`. AIPerf lives in a venv of its own (``scripts/setup_bench.sh``: ``.venv-aiperf``; it pins
huggingface-hub < 2 and psutil 7.0, which the serving venv must not take). Two kinds of endpoint:

- ``triton-generate``: Triton's HTTP generate extension, ``POST /v2/models/generate/generate_stream`` (server-sent
  events), through AIPerf's ``template`` endpoint: a Jinja body with ``text_input``, ``max_tokens`` and ``stream``,
  and ``text_output`` read from every event. AIPerf 0.13 has no KServe gRPC transport (only HTTP), so genai-perf's
  ``--endpoint-type kserve`` has no counterpart; the generate extension is the same model behind Triton's HTTP
  frontend (perf_analyzer keeps measuring gRPC).
- ``openai-completions`` and ``openai-chat``: the OpenAI-compatible frontend (``spec_decode.openai_api``,
  ``/v1/completions`` and ``/v1/chat/completions``, streamed).

The same prompts go to every endpoint, from a JSONL file (``--custom-dataset-type single_turn``, sent in order),
each line carrying the generate inputs of its request in ``extra`` (``speculative_method``, ``num_draft_tokens``,
``ignore_eos``): AIPerf's ``--extra-inputs`` turns the string ``none`` into null, so a method cannot go there.
AIPerf counts output tokens with the target's tokenizer (``--tokenizer``, a local folder).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENDPOINTS = ("triton-generate", "openai-completions", "openai-chat")
# The request body of Triton's generate extension; text, max_tokens and stream are AIPerf's template variables.
TRITON_GENERATE_TEMPLATE = ('{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens }}, '
                            '"stream": {{ stream|tojson }}}')
# AIPerf's concurrency mode polls for a free slot without sleeping (its timing manager took a whole core of this
# 2-core machine from the server: TTFT 5.2 s instead of ~0.15 s at concurrency 1); with a request rate as well it
# polls once per interval. 200/s keeps the concurrency the limit and delays a request by at most 5 ms after a slot
# frees.
PACING_REQUESTS_PER_S = 200


def find_aiperf(explicit: str | None = None) -> str | None:
    """The aiperf executable: ``explicit``, else ``.venv-aiperf/bin/aiperf``, else on PATH (None if none)."""
    for cand in (explicit, str(ROOT / ".venv-aiperf" / "bin" / "aiperf"), shutil.which("aiperf")):
        if cand and Path(cand).exists():
            return cand
    return None


def request_inputs(method: str, k: int) -> dict:
    """The generate inputs every request of a run carries beside its prompt: greedy (``temperature`` 0, said outright
    since OpenAI's default is 1), ``ignore_eos`` (every request ``max_tokens`` long), the method and its number of
    draft tokens (0 for ``none``)."""
    return {"speculative_method": method, "num_draft_tokens": k if method != "none" else 0, "ignore_eos": True,
            "temperature": 0.0}


def write_prompts(path: Path, prompts: list[str], extra: dict, warmup_prompt: str | None = None) -> None:
    """The JSONL input file: one ``{"text", "extra"}`` line per request, in order; ``warmup_prompt`` (sent first, by
    AIPerf's warm-up phase, outside the figures) leads when given."""
    lines = ([warmup_prompt] if warmup_prompt is not None else []) + list(prompts)
    path.write_text("".join(json.dumps({"text": p, "extra": extra}) + "\n" for p in lines))


def _common_args(prompts_file: Path, tokenizer: Path, max_tokens: int, concurrency: int, requests: int,
                 artifact_dir: Path, warmup: int) -> list[str]:
    return ["--streaming", "--input-file", str(prompts_file), "--custom-dataset-type", "single_turn",
            "--dataset-sampling-strategy", "sequential", "--tokenizer", str(tokenizer), "--osl", str(max_tokens),
            "--concurrency", str(concurrency), "--request-count", str(requests),
            "--request-rate", str(PACING_REQUESTS_PER_S), "--arrival-pattern", "constant",
            "--warmup-request-count", str(warmup), "--artifact-dir", str(artifact_dir), "--ui", "none",
            "--no-gpu-telemetry", "--no-server-metrics"]


def triton_command(exe: str, http_url: str, prompts_file: Path, tokenizer: Path, max_tokens: int, concurrency: int,
                   requests: int, artifact_dir: Path, warmup: int = 0, model: str = "generate") -> list[str]:
    """``aiperf profile`` against Triton's ``generate_stream`` (HTTP generate extension, server-sent events).

    Args:
        exe: the aiperf executable (:func:`find_aiperf`).
        http_url: Triton's HTTP host:port (or ``http://host:port``).
        prompts_file: the JSONL of :func:`write_prompts`.
        tokenizer: the target's model folder (AIPerf counts the output tokens with it).
        max_tokens, concurrency, requests: new tokens per request, requests in flight, requests in all.
        artifact_dir: where AIPerf writes its exports (``profile_export_aiperf.json``) and log.
        warmup: requests of the warm-up phase (the first lines of the file).
        model: the Triton model.
    """
    return [exe, "profile", "-m", model, "--url", http_url, "--endpoint-type", "template",
            "--custom-endpoint", f"/v2/models/{model}/generate_stream",
            "--extra-inputs",
            json.dumps({"payload_template": TRITON_GENERATE_TEMPLATE, "response_field": "text_output"}),
            *_common_args(prompts_file, tokenizer, max_tokens, concurrency, requests, artifact_dir, warmup)]


def openai_command(exe: str, base_url: str, kind: str, model: str, prompts_file: Path, tokenizer: Path,
                   max_tokens: int, concurrency: int, requests: int, artifact_dir: Path, warmup: int = 0) -> list[str]:
    """``aiperf profile`` against an OpenAI-compatible server, streamed.

    Args:
        base_url: the server's ``http://host:port`` (AIPerf appends ``/v1/completions`` or ``/v1/chat/completions``).
        kind: ``completions`` (the prompt as it is) or ``chat`` (the prompt as one user message; the server applies
            the chat template, ``max_tokens`` goes as ``max_completion_tokens``).
        model: the served model name (:func:`openai_model`).
        Others: as :func:`triton_command`.
    """
    if kind not in ("completions", "chat"):
        raise ValueError(f"kind must be completions or chat, got {kind!r}")
    return [exe, "profile", "-m", model, "--url", base_url, "--endpoint-type", kind,
            *_common_args(prompts_file, tokenizer, max_tokens, concurrency, requests, artifact_dir, warmup)]


def openai_model(base_url: str, timeout: float = 10.0) -> str:
    """The first model ``GET /v1/models`` lists."""
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/v1/models", timeout=timeout) as r:
        return json.loads(r.read())["data"][0]["id"]


def parse_export(path: Path) -> dict:
    """Figures from AIPerf's summary export (``profile_export_aiperf.json``; the profiling phase, warm-up excluded).

    Returns:
        dict: tokens_per_s (output token throughput: output tokens / the benchmark's duration), ttft_ms, ttft_p90_ms,
        itl_ms, itl_p90_ms (inter-token latency: (latency - TTFT) / (tokens - 1) per request), request_latency_ms
        (p50 unless named), output_sequence_length (mean, tokens as the tokenizer counts the text),
        tokens_per_response (output tokens / streamed events: tokens per step on generate), requests, errors,
        duration_s, aiperf_version. A figure the export lacks is None.

    Raises:
        ValueError: the export holds no successful request.
    """
    s = json.loads(Path(path).read_text())

    def stat(name: str, key: str = "avg"):
        v = s.get(name)
        return v.get(key) if isinstance(v, dict) else None

    requests = int(stat("request_count") or 0)
    if not requests:
        raise ValueError(f"{path}: no successful request ({s.get('error_summary')})")
    osl, events = stat("output_sequence_length"), stat("http_req_chunks_received")
    errors = sum(int(e.get("count", 0)) for e in s.get("error_summary") or [] if isinstance(e, dict))
    return {"tokens_per_s": stat("output_token_throughput"), "ttft_ms": stat("time_to_first_token", "p50"),
            "ttft_p90_ms": stat("time_to_first_token", "p90"), "itl_ms": stat("inter_token_latency", "p50"),
            "itl_p90_ms": stat("inter_token_latency", "p90"), "request_latency_ms": stat("request_latency", "p50"),
            "output_sequence_length": osl, "tokens_per_response": osl / events if osl and events else None,
            "requests": requests, "errors": errors, "duration_s": stat("benchmark_duration"),
            "aiperf_version": s.get("aiperf_version")}


def run(cmd: list[str], artifact_dir: Path, timeout: float = 3600) -> dict:
    """Run one ``aiperf profile`` command -> :func:`parse_export` of its export. Its output goes to
    ``artifact_dir/aiperf.out`` (AIPerf's own log: ``artifact_dir/logs/aiperf.log``).

    Raises:
        RuntimeError: aiperf failed, wrote no export, or every request failed (the end of its output is in the
            message).
    """
    shutil.rmtree(artifact_dir, ignore_errors=True)
    artifact_dir.mkdir(parents=True)
    # Not HF_HUB_OFFLINE: with it AIPerf 0.13 looks a local tokenizer folder up in the hub's cache and fails.
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=artifact_dir)
    (artifact_dir / "aiperf.out").write_text(r.stdout + r.stderr)
    export = artifact_dir / "profile_export_aiperf.json"
    try:
        if r.returncode != 0:
            raise ValueError(f"exit status {r.returncode}")
        return parse_export(export)
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"aiperf failed ({exc}): {' '.join(cmd)}\n{(r.stdout + r.stderr)[-3000:]}") from exc


def profile(exe: str, endpoint: str, url: str, prompts: list[str], method: str, k: int, concurrency: int,
            requests: int, max_tokens: int, tokenizer: Path, workdir: Path, warmup_prompt: str | None = None,
            model: str | None = None) -> dict:
    """One AIPerf profile of ``endpoint`` (one of :data:`ENDPOINTS`) -> a row of :mod:`bench.serving`.

    Args:
        url: Triton's HTTP host:port for ``triton-generate``; the OpenAI server's ``http://host:port`` otherwise.
        prompts: the request texts, in order (``requests`` of them are sent).
        method, k: speculative_method and num_draft_tokens (0 for ``none``).
        workdir: where the prompts file and the artifacts go (``aiperf.<endpoint>.<method>.c<C>``).
        warmup_prompt: sent once before the measured requests (AIPerf's warm-up phase), or None for none.
        model: the OpenAI model name (default: :func:`openai_model`).

    Returns:
        dict: tool ``aiperf``, endpoint, method, concurrency, :func:`parse_export`'s figures and export (its path).

    Raises:
        RuntimeError: as :func:`run`.
    """
    tag = f"{endpoint}.{method}.c{concurrency}"
    art, prompts_file = workdir / f"aiperf.{tag}", workdir / f"aiperf_prompts.{tag}.jsonl"
    write_prompts(prompts_file, prompts[:requests], request_inputs(method, k), warmup_prompt)
    warmup = int(warmup_prompt is not None)
    if endpoint == "triton-generate":
        cmd = triton_command(exe, url, prompts_file, tokenizer, max_tokens, concurrency, requests, art, warmup)
    elif endpoint in ("openai-completions", "openai-chat"):
        cmd = openai_command(exe, url, endpoint.split("-")[1], model or openai_model(url), prompts_file, tokenizer,
                             max_tokens, concurrency, requests, art, warmup)
    else:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    return ({"tool": "aiperf", "endpoint": endpoint, "method": method, "concurrency": concurrency}
            | run(cmd, art) | {"export": str(art / "profile_export_aiperf.json")})


def profile_endpoints(exe: str, urls: dict[str, str], methods: list[str], windows: dict[tuple[int, int], list[str]],
                      k: int, max_tokens: int, tokenizer: Path, workdir: Path, warmup_prompt: str | None = None,
                      own_window: frozenset[str] = frozenset()) -> list[dict]:
    """:func:`profile` for every method, concurrency and endpoint; a failed profile becomes a row with ``error``.

    Args:
        urls: endpoint (:data:`ENDPOINTS`) -> its URL, in the order they run.
        windows: (concurrency, slot) -> the prompts of a run; every endpoint takes slot 0 (the same prompts), except
            for the methods in ``own_window`` (those that draft from earlier responses, such as suffix decoding, which
            would find the answers the first endpoint got), where the i-th endpoint takes slot i.
        Others: as :func:`profile`.
    """
    rows = []
    for m in methods:
        for c in sorted({c for c, _ in windows}):
            for slot, (endpoint, url) in enumerate(urls.items()):
                prompts = windows[(c, slot if m in own_window else 0)]
                print(f"aiperf: {endpoint}, {m}, concurrency {c}, {len(prompts)} requests ...", flush=True)
                try:
                    row = profile(exe, endpoint, url, prompts, m, k, c, len(prompts), max_tokens, tokenizer, workdir,
                                  warmup_prompt)
                except RuntimeError as exc:
                    print(f"  {exc}", flush=True)
                    rows.append({"tool": "aiperf", "endpoint": endpoint, "method": m, "concurrency": c,
                                 "error": str(exc)[-2000:]})
                    continue
                rows.append(row)
                print(f"  {row['tokens_per_s']:.2f} tokens/s, TTFT {row['ttft_ms']:.0f} ms, ITL {row['itl_ms']:.1f} ms",
                      flush=True)
    return rows


def compare_endpoints(rows: list[dict]) -> list[dict]:
    """The AIPerf rows side by side: per (method, concurrency), endpoint -> tokens_per_s, ttft_ms, itl_ms (or error)."""
    out: dict[tuple[str, int], dict] = {}
    for r in rows:
        if r.get("tool") != "aiperf":
            continue
        key = (r["method"], r["concurrency"])
        entry = out.setdefault(key, {"method": key[0], "concurrency": key[1]})
        entry[r["endpoint"]] = ({"error": r["error"][:200]} if "error" in r else
                                {f: r.get(f) for f in ("tokens_per_s", "ttft_ms", "itl_ms")})
    return list(out.values())


def print_comparison(table: list[dict]) -> None:
    """:func:`compare_endpoints`' table: tokens/s, TTFT ms, ITL ms per endpoint."""
    endpoints = [e for e in ENDPOINTS if any(e in t for t in table)]
    if not endpoints:
        return
    print("\naiperf, the same prompts through each endpoint: tokens/s | TTFT ms | ITL ms")
    print(f"{'method':<12}{'conc':>5}" + "".join(f"{e:>28}" for e in endpoints))
    for t in table:
        cells = []
        for e in endpoints:
            v = t.get(e) or {}
            tps, ttft, itl = (v.get(f) for f in ("tokens_per_s", "ttft_ms", "itl_ms"))
            ok = all(isinstance(x, (int, float)) for x in (tps, ttft, itl))
            cells.append(f"{tps:.2f} | {ttft:.0f} | {itl:.1f}" if ok else "error" if "error" in v else "-")
        print(f"{t['method']:<12}{t['concurrency']:>5}" + "".join(f"{c:>28}" for c in cells))


@contextlib.contextmanager
def openai_frontend(srv, log_path: Path | None = None, wanted: bool = True) -> Iterator[str | None]:
    """The OpenAI-compatible frontend (``python -m spec_decode.openai_api``, as the launcher starts it) in front of
    the :class:`~spec_decode.launcher.TritonServer` ``srv``, on a free port, for the ``with`` block.

    Yields:
        its ``http://host:port``, or None: not ``wanted``, or (with a line saying why) this checkout has no frontend
        or it did not start.
    """
    if not wanted:
        yield None
        return
    try:
        from spec_decode.launcher import free_ports
        from spec_decode.launcher.frontend import OpenAIFrontend, tokenizer_path
    except ImportError as exc:
        print(f"no OpenAI frontend here ({exc}): aiperf skips /v1", flush=True)
        yield None
        return
    frontend = OpenAIFrontend(srv.grpc_url, free_ports(1)[0], tokenizer=tokenizer_path(srv.repository),
                              log_path=log_path).start()
    try:
        try:
            frontend.wait_ready()
        except RuntimeError as exc:
            print(f"the OpenAI frontend did not start ({exc}): aiperf skips /v1", flush=True)
            yield None
        else:
            yield frontend.url
    finally:
        frontend.stop()
