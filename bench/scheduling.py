"""The scheduling benchmark of ``make bench``: chunked prefill and prefix caching through a real tritonserver.

In one run, through tritonclient gRPC streams to ``generate``, side by side:

1. Mixed arrival (chunked prefill's goal), on a server with chunked prefill on (generate's ``max_num_batched_tokens`` at
   its configured default) and one with ``max_num_batched_tokens: "0"`` (a prompt is prefilled in one piece inside a
   round), both with prefix caching off so that nothing is reused: four streams (``speculative_method`` suffix, 200
   tokens each with ``ignore_eos``, four different HumanEval prompts) start; once every one of them has streamed for
   1.5 s and sent at least 5 responses, a long prompt (>= 1,500 tokens of standard-library source, counted with the
   model's tokenizer; ``max_tokens`` 8, method none) arrives. From every response's arrival time: each stream's median
   gap between responses before the long prompt arrived, the longest gap of any running stream between the long prompt's
   arrival and its first token, their ratio (goal <= 3x), and the long prompt's time to first token (TTFT). Then, with
   the streams finished, a long prompt of the same length (another text) alone on the same server: its TTFT, and the
   ratio mixed / alone (goal <= 1.5x).
2. Prefix reuse (prefix caching's goal), on a server with ``enable_prefix_caching`` on and one with it off: request A =
   a shared prefix of >= 1,000 tokens + a last line, request B = the same prefix + another last line (``max_tokens`` 8,
   greedy, method none, ``ignore_eos``). TTFT of A, of B, B / A (goal <= 0.25 with caching on); A's and B's output
   tokens must be identical on both servers. The ``spec_decode_*prefix_cache_*`` series of each server's metrics
   endpoint (the target's and the draft LM's) are reported as they are.

Every long text is a different standard-library module, so no cache can help where none should. Three servers, one
at a time: chunking off; chunking on (part 1, and part 2's caching off); caching on (part 2). A parameter that the
served configs do not have yet is left out (noted in the output: that server runs today's behaviour). Prints the
tables and the goals, saves JSON with the machine's facts.

    python -m bench.scheduling --output results/scheduling.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import queue
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Standard-library modules whose source gives the long prompts: each text is taken from the start of a module of its
# own, so no two prompts share a first block.
SOURCE_MODULES = ("argparse", "typing", "subprocess", "inspect", "tarfile", "zipfile", "functools", "dataclasses",
                  "enum", "difflib", "configparser", "logging", "shutil", "pickle", "threading", "ast", "calendar",
                  "optparse", "gettext", "textwrap")
# The parameters this benchmark sets, per model; those absent from the served configs are left out.
CHUNK_PARAM = ("generate", "max_num_batched_tokens")
CACHE_PARAMS = (("target_model", "enable_prefix_caching"), ("draft_model", "enable_prefix_caching"))
REPORTED_PARAMS = (CHUNK_PARAM, *CACHE_PARAMS, ("target_model", "kv_cache_max_tokens"))
LAST_LINES = ("\n\n# Question: what does the first function defined above return?\n# Answer:",
              "\n\n# Question: which modules does the code above import?\n# Answer:")


# --- pure functions: gaps and ratios from arrival times (seconds) -------------------------------------------------

def gaps(times: Sequence[float]) -> list[float]:
    """The gaps between consecutive arrival times (one fewer than the times)."""
    return [b - a for a, b in zip(times, times[1:])]


def median_gap_before(times: Sequence[float], t: float) -> float | None:
    """The median gap between consecutive responses that both arrived at or before ``t`` (None: fewer than two)."""
    g = gaps([x for x in times if x <= t])
    return statistics.median(g) if g else None


def longest_gap_during(times: Sequence[float], start: float, end: float) -> float | None:
    """The longest gap between consecutive responses that overlaps the window (``start``, ``end``): the gap that
    straddles ``start`` counts, as does the one that straddles ``end``.

    Returns:
        None when the stream was not running in the window (its last response at or before ``start``, or its first
        at or after ``end``).
    """
    during = [b - a for a, b in zip(times, times[1:]) if b > start and a < end]
    return max(during) if during else None


def mixed_arrival_summary(streams: Sequence[Sequence[float]], long_sent: float, long_first: float) -> dict:
    """Per stream and overall, how a long prompt's arrival at ``long_sent`` (first token at ``long_first``) stalled
    the streams (each a list of its responses' arrival times).

    Returns:
        ``streams``: per stream ``median_gap_before_s``, ``longest_gap_during_s`` and their ``ratio`` (None where a
        value is missing: a stream that was not running); ``worst_ratio`` (the largest ratio), ``longest_gap_s`` (the
        longest gap of any running stream), ``running`` (how many streams were) and ``long_ttft_s``.
    """
    rows = []
    for times in streams:
        before = median_gap_before(times, long_sent)
        during = longest_gap_during(times, long_sent, long_first)
        ratio = during / before if before and during is not None else None
        rows.append({"median_gap_before_s": before, "longest_gap_during_s": during, "ratio": ratio,
                     "responses": len(times)})
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    longest = [r["longest_gap_during_s"] for r in rows if r["longest_gap_during_s"] is not None]
    return {"streams": rows, "worst_ratio": max(ratios) if ratios else None,
            "longest_gap_s": max(longest) if longest else None, "running": len(longest),
            "long_ttft_s": long_first - long_sent}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    return a / b if a is not None and b else None


def goals(mixed: dict, prefix: dict) -> list[dict]:
    """The scheduling goals from this run's results, each with goal, target, reached (a number or None) and met.

    Args:
        mixed: part 1's results per server tag (``chunked``, ``unchunked``), each with ``worst_ratio`` and
            ``ttft_mixed_over_alone``.
        prefix: part 2's results per server tag (``cache_on``, ``cache_off``), each with ``b_over_a``; and
            ``outputs_identical`` (bool) beside them.
    """
    out = []
    on = mixed.get("chunked", {})
    worst = on.get("worst_ratio")
    out.append({"goal": "chunked prefill: longest stream gap while a long prompt is prefilled / median gap before",
                "target": "<= 3", "reached": worst, "met": worst is not None and worst <= 3})
    mva = on.get("ttft_mixed_over_alone")
    out.append({"goal": "chunked prefill: long prompt's TTFT among running streams / alone", "target": "<= 1.5",
                "reached": mva, "met": mva is not None and mva <= 1.5})
    ba = prefix.get("cache_on", {}).get("b_over_a")
    out.append({"goal": "prefix caching: TTFT of B (shared prefix cached) / TTFT of A", "target": "<= 0.25",
                "reached": ba, "met": ba is not None and ba <= 0.25})
    same = prefix.get("outputs_identical")
    out.append({"goal": "prefix caching: A's and B's output tokens identical with caching on and off",
                "target": "identical", "reached": None if same is None else float(same), "met": bool(same)})
    return out


# --- prompts ----------------------------------------------------------------------------------------------------

class TextPool:
    """Long texts of a given token count, each from the start of a standard-library module not used before.

    Args:
        tokenizer: the served model's tokenizer (the counts are the server's: ``tokenizer(text)["input_ids"]``).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._modules = iter(SOURCE_MODULES)

    def count(self, text: str) -> int:
        """Tokens of ``text`` as the server counts them."""
        return len(self.tokenizer(text)["input_ids"])

    def take(self, n_tokens: int) -> tuple[str, int, str]:
        """A text of about ``n_tokens`` tokens (never more) from the next module long enough.

        Returns:
            (text, its token count, the module's name).

        Raises:
            RuntimeError: the modules are used up.
        """
        for name in self._modules:
            spec = importlib.util.find_spec(name)
            if spec is None or spec.origin is None:
                continue
            ids = self.tokenizer(Path(spec.origin).read_text(encoding="utf-8"))["input_ids"]
            if len(ids) < n_tokens:
                continue
            keep = n_tokens
            while True:  # decoding and encoding again may merge tokens differently: trim until it fits
                text = self.tokenizer.decode(ids[:keep])
                n = self.count(text)
                if n <= n_tokens:
                    return text, n, name
                keep -= n - n_tokens
        raise RuntimeError("no standard-library module left for another long prompt")


# --- one streamed request with absolute arrival times ------------------------------------------------------------

@dataclass
class TimedStream:
    """One streamed request as the client saw it, in ``time.perf_counter()`` seconds.

    Attributes:
        sent: when the request was sent.
        times: when each response that carried tokens arrived.
        ids: the output token ids, joined.
        done: when the final response arrived (None while running).
        error: the error, when the server answered with one.
    """

    sent: float = 0.0
    times: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    done: float | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token (None without tokens)."""
        return self.times[0] - self.sent if self.times else None


def timed_stream(url: str, prompt: str, max_tokens: int, out: TimedStream, timeout_s: float = 600.0,
                 **params) -> TimedStream:
    """Stream one request to ``generate`` (``stream`` true), filling ``out`` as responses arrive (so another thread
    can watch it); returns ``out``. An error response or a timeout is recorded in ``out.error``."""
    import tritonclient.grpc as grpcclient

    from client.generate import build_inputs

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((time.perf_counter(), result, error)))
    try:
        inputs = build_inputs(prompt, max_tokens, stream=True, **params)
        out.sent = time.perf_counter()
        client.async_stream_infer("generate", inputs, enable_empty_final_response=True)
        while out.done is None:
            t, res, err = q.get(timeout=max(0.0, timeout_s - (time.perf_counter() - out.sent)))
            if err is not None:
                out.error, out.done = str(err), t
                break
            resp = res.get_response()
            if "output_ids" in {o.name for o in resp.outputs}:
                ids = res.as_numpy("output_ids").reshape(-1).tolist()
                if ids:
                    out.ids += ids
                    out.times.append(t)
            if resp.parameters["triton_final_response"].bool_param:
                out.done = t
    except queue.Empty:
        out.error = f"no final response within {timeout_s} s"
    finally:
        client.stop_stream()
        client.close()
    return out


# --- the two parts ------------------------------------------------------------------------------------------------

def mixed_arrival(url: str, prompts: Sequence[str], long_text: str, alone_text: str, stream_tokens: int,
                  method: str, stream_for_s: float, long_max_tokens: int, min_responses: int = 5) -> dict:
    """Part 1 on one server: the streams; the long prompt once every stream has streamed for ``stream_for_s`` seconds
    and sent at least ``min_responses`` responses (a median of a few gaps, however slow the machine); then a long
    prompt alone.

    Returns:
        :func:`mixed_arrival_summary`'s result plus ``long_ttft_alone_s``, ``ttft_mixed_over_alone``, the streams'
        ``tokens`` and ``errors``, and each request's arrival times relative to the long prompt's sending
        (``timeline``).
    """
    streams = [TimedStream() for _ in prompts]
    threads = [threading.Thread(target=timed_stream, args=(url, p, stream_tokens, s),
                                kwargs=dict(speculative_method=method, ignore_eos=True), daemon=True)
               for p, s in zip(prompts, streams)]
    for th in threads:
        th.start()
    deadline = time.perf_counter() + 600
    while not all(s.done or (len(s.times) >= min_responses and s.times[0] + stream_for_s <= time.perf_counter())
                  for s in streams):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"the streams sent fewer than {min_responses} responses within 600 s")
        time.sleep(0.005)
    long = timed_stream(url, long_text, long_max_tokens, TimedStream(), speculative_method="none", ignore_eos=True)
    for th in threads:
        th.join(timeout=600)
    errors = [e for e in (*(s.error for s in streams), long.error) if e]
    if not long.times:
        raise RuntimeError(f"the long prompt got no token: {errors}")
    res = mixed_arrival_summary([s.times for s in streams], long.sent, long.times[0])
    alone = timed_stream(url, alone_text, long_max_tokens, TimedStream(), speculative_method="none", ignore_eos=True)
    if alone.error:
        errors.append(alone.error)
    res["long_ttft_alone_s"] = alone.ttft_s
    res["ttft_mixed_over_alone"] = ratio(res["long_ttft_s"], alone.ttft_s)
    res["tokens"] = [len(s.ids) for s in streams]
    res["errors"] = errors
    res["timeline"] = {"streams": [[round(t - long.sent, 4) for t in s.times] for s in streams],
                       "long": [round(t - long.sent, 4) for t in long.times]}
    return res


def prefix_reuse(url: str, prompt_a: str, prompt_b: str, max_tokens: int) -> dict:
    """Part 2 on one server: A, then B (greedy, method none, ``ignore_eos``); their TTFTs, B / A and output ids."""
    a = timed_stream(url, prompt_a, max_tokens, TimedStream(), speculative_method="none", ignore_eos=True)
    b = timed_stream(url, prompt_b, max_tokens, TimedStream(), speculative_method="none", ignore_eos=True)
    return {"ttft_a_s": a.ttft_s, "ttft_b_s": b.ttft_s, "b_over_a": ratio(b.ttft_s, a.ttft_s), "ids_a": a.ids,
            "ids_b": b.ids, "errors": [e for e in (a.error, b.error) if e]}


def prefix_cache_series(metrics_url: str) -> dict[str, float]:
    """Every prefix-caching sample the server exports (``spec_decode_*prefix_cache_*``: the target's and the draft
    LM's), as ``name{labels}`` -> value."""
    from client.metrics import scrape

    out = {}
    for (name, labels), v in sorted(scrape(metrics_url, prefix="spec_decode_").items()):
        if "prefix_cache_" not in name:
            continue
        lab = ",".join(f'{k}="{x}"' for k, x in labels)
        out[f"{name}{{{lab}}}" if lab else name] = v
    return out


# --- servers ------------------------------------------------------------------------------------------------------

def config_value(repo: Path, model: str, key: str) -> str | None:
    """The value of parameter ``key`` in ``repo``/``model``/config.pbtxt (None: the config has no such parameter)."""
    text = (repo / model / "config.pbtxt").read_text()
    m = re.search(r'key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)
    return m.group(1) if m else None


def known_overrides(overrides: dict[str, dict[str, str]], repo: Path) -> tuple[dict[str, dict[str, str]], list[str]]:
    """``overrides`` without the parameters that ``repo``'s configs do not have, and those left out
    (``model.key``)."""
    kept: dict[str, dict[str, str]] = {}
    missing = []
    for model, params in overrides.items():
        for key, value in params.items():
            if config_value(repo, model, key) is None:
                missing.append(f"{model}.{key}")
            else:
                kept.setdefault(model, {})[key] = value
    return kept, missing


@contextlib.contextmanager
def serve(overrides: dict[str, dict[str, str]], log: Path) -> Iterator[tuple]:
    """A started, ready tritonserver on free ports with ``overrides`` (those the configs have); stopped on exit, and
    its copy of the repository removed.

    Yields:
        (the server, {``model.key``: effective value or None} for :data:`REPORTED_PARAMS`, the overrides left out).
    """
    from spec_decode.launcher import TritonServer, prepare_repository
    from spec_decode.launcher.repository import DEFAULT_REPOSITORY

    kept, missing = known_overrides(overrides, DEFAULT_REPOSITORY)
    for name in missing:
        print(f"  (the served configs have no parameter {name} yet: left out, today's behaviour)", flush=True)
    repo = prepare_repository(kept or None)
    config = {f"{m}.{k}": config_value(repo, m, k) for m, k in REPORTED_PARAMS}
    try:
        with TritonServer(repo, log_path=log) as srv:
            srv.wait_ready(timeout=900)
            yield srv, config, missing
    finally:
        if repo != DEFAULT_REPOSITORY:
            shutil.rmtree(repo, ignore_errors=True)


def warm_up(url: str, text: str, prompt: str, method: str) -> None:
    """First requests on a fresh server (texts used nowhere else): a medium prompt, and a short one with the
    streams' method."""
    for m in ("none", method):
        timed_stream(url, prompt, 8, TimedStream(), speculative_method=m, ignore_eos=True)
    timed_stream(url, text, 4, TimedStream(), speculative_method="none", ignore_eos=True)


# --- output -------------------------------------------------------------------------------------------------------

def _ms(v: float | None, width: int = 9) -> str:
    return f"{v * 1000:{width}.0f}" if v is not None else "-".rjust(width)


def _x(v: float | None, width: int = 8) -> str:
    return f"{v:{width - 1}.2f}x" if v is not None else "-".rjust(width)


def print_tables(mixed: dict, prefix: dict) -> None:
    """The two parts' tables."""
    print("\nmixed arrival: gaps between a stream's responses (ms)")
    print(f"{'server':<12}{'median gap before, per stream':>32}{'longest during':>16}{'ratio':>8}"
          f"{'TTFT mixed':>12}{'TTFT alone':>12}{'mixed/alone':>12}")
    for tag, r in mixed.items():
        before = "/".join(_ms(s["median_gap_before_s"], 0).strip() for s in r["streams"])
        print(f"{tag:<12}{before:>32}{_ms(r['longest_gap_s'], 16)}{_x(r['worst_ratio'])}"
              f"{_ms(r['long_ttft_s'], 12)}{_ms(r['long_ttft_alone_s'], 12)}{_x(r['ttft_mixed_over_alone'], 12)}")
    print("\nprefix reuse: TTFT (ms)")
    print(f"{'server':<12}{'A':>9}{'B':>9}{'B/A':>8}  prefix cache series")
    for tag in ("cache_on", "cache_off"):
        r = prefix.get(tag)
        if r:
            series = ", ".join(f"{k} {v:g}" for k, v in r["metrics"].items()) or "none exported"
            print(f"{tag:<12}{_ms(r['ttft_a_s'])}{_ms(r['ttft_b_s'])}{_x(r['b_over_a'])}  {series}")
    print(f"outputs identical with caching on and off: {prefix.get('outputs_identical')}")


def main(argv: list[str] | None = None) -> int:
    """CLI: run both parts on three servers (one at a time), print the tables and goals, save JSON."""
    from client.datasets import humaneval_prompts
    from spec_decode.engine.model_loading import load_tokenizer, prepare_default_model
    from spec_decode.sequences import common_prefix_len

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=4, help="running streams in part 1")
    ap.add_argument("--stream-tokens", type=int, default=200, help="tokens per stream (ignore_eos)")
    ap.add_argument("--method", default="suffix", help="the streams' speculative_method")
    ap.add_argument("--stream-for", type=float, default=1.5, help="seconds the streams run before the long prompt")
    ap.add_argument("--min-responses", type=int, default=5,
                    help="responses each stream sends before the long prompt (a slow machine waits longer)")
    ap.add_argument("--long-tokens", type=int, default=1600, help="the long prompt's tokens (>= 1,500 for the goal)")
    ap.add_argument("--prefix-tokens", type=int, default=1200, help="part 2's shared prefix (>= 1,000 for the goal)")
    ap.add_argument("--max-tokens", type=int, default=8, help="the long prompts' and part 2's max_tokens")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0,
                    help="the chunked server's budget (0: the configured default)")
    ap.add_argument("--output", type=Path, default=Path("results/scheduling.json"))
    args = ap.parse_args(argv)

    tokenizer = load_tokenizer(prepare_default_model())
    pool = TextPool(tokenizer)
    humaneval = humaneval_prompts(args.streams + 3)
    prompts, warm_prompts = humaneval[:args.streams], humaneval[args.streams:]
    prefix, prefix_n, prefix_src = pool.take(args.prefix_tokens)
    prompt_a, prompt_b = prefix + LAST_LINES[0], prefix + LAST_LINES[1]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    logdir = Path(tempfile.mkdtemp(prefix="spec_decode_scheduling_"))
    texts: list[dict] = [{"use": "prefix", "module": prefix_src, "tokens": prefix_n}]

    def long_text(use: str, n: int) -> str:
        text, count, src = pool.take(n)
        texts.append({"use": use, "module": src, "tokens": count})
        return text

    cache_off = {m: {k: "false"} for m, k in CACHE_PARAMS}
    budget = args.max_num_batched_tokens
    chunked = {CHUNK_PARAM[0]: {CHUNK_PARAM[1]: str(budget)}} if budget > 0 else {}
    servers = [  # tag, overrides, parts
        ("unchunked", {CHUNK_PARAM[0]: {CHUNK_PARAM[1]: "0"}} | cache_off, ("mixed",)),
        ("chunked", cache_off | chunked, ("mixed", "cache_off")),
        ("cache_on", {m: {k: "true"} for m, k in CACHE_PARAMS}, ("cache_on",)),
    ]
    mixed: dict[str, dict] = {}
    prefix_rows: dict = {}
    configs: dict[str, dict] = {}
    t_start = time.perf_counter()
    for i, (tag, overrides, parts) in enumerate(servers):
        print(f"server {tag}: starting ...", flush=True)
        with serve(overrides, logdir / f"{tag}.server.log") as (srv, config, missing):
            configs[tag] = {"config": config, "left_out": missing}
            warm_up(srv.grpc_url, long_text(f"{tag}: warm-up", 400), warm_prompts[i % len(warm_prompts)],
                    args.method)
            if "mixed" in parts:
                print(f"server {tag}: mixed arrival ...", flush=True)
                mixed[tag] = mixed_arrival(srv.grpc_url, prompts, long_text(f"{tag}: long, mixed", args.long_tokens),
                                           long_text(f"{tag}: long, alone", args.long_tokens), args.stream_tokens,
                                           args.method, args.stream_for, args.max_tokens, args.min_responses)
                r = mixed[tag]
                before = "/".join(_ms(x["median_gap_before_s"], 0).strip() for x in r["streams"])
                print(f"  median gaps before {before} ms, longest during {_ms(r['longest_gap_s']).strip()} ms "
                      f"(worst ratio {_x(r['worst_ratio']).strip()}; {r['running']} streams running), TTFT mixed "
                      f"{_ms(r['long_ttft_s']).strip()} ms, alone {_ms(r['long_ttft_alone_s']).strip()} ms", flush=True)
            for part in (p for p in parts if p.startswith("cache_")):
                print(f"server {tag}: prefix reuse ({part}) ...", flush=True)
                prefix_rows[part] = prefix_reuse(srv.grpc_url, prompt_a, prompt_b, args.max_tokens)
                prefix_rows[part]["metrics"] = prefix_cache_series(srv.metrics_url)
                prefix_rows[part]["server"] = tag
    on, off = prefix_rows.get("cache_on"), prefix_rows.get("cache_off")
    if on and off:
        prefix_rows["outputs_identical"] = bool(on["ids_a"]) and on["ids_a"] == off["ids_a"] and \
            on["ids_b"] == off["ids_b"]
    prefix_rows["shared_prefix_tokens"] = common_prefix_len(tokenizer(prompt_a)["input_ids"],
                                                            tokenizer(prompt_b)["input_ids"])
    print_tables(mixed, prefix_rows)
    goal_rows = goals(mixed, prefix_rows)
    print("\ngoals:")
    for g in goal_rows:
        reached = "-" if g["reached"] is None else f"{g['reached']:.2f}"
        print(f"  {'MET    ' if g['met'] else 'not met'}  {g['goal']}: {reached} (target {g['target']})")
    result = {"title": f"{args.streams} streams x {args.stream_tokens} tokens ({args.method}, ignore_eos) + a "
                       f"{args.long_tokens}-token prompt; prefix reuse over a {prefix_n}-token prefix",
              "args": {k: str(v) for k, v in vars(args).items()},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": sys.version.split()[0]},
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "seconds": time.perf_counter() - t_start,
              "servers": configs, "texts": texts, "mixed_arrival": mixed, "prefix_reuse": prefix_rows,
              "goals": goal_rows, "server_logs": str(logdir)}
    args.output.write_text(json.dumps(result, indent=2))
    print(f"\nsaved {args.output} (server logs in {logdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
