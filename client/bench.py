"""``make bench``: a repeated workload through the real server, beside in-process transformers, and the speed goals.

In one run, for each speculative_method in ``proposers.registry.METHODS`` and ``auto``: start a fresh tritonserver
on free ports (empty caches, so no method profits from another's responses), stream N held-out HumanEval prompts
(0..N-1, greedy, up to M new tokens, stopping at EOS as users do) twice: the second pass can hit suffix decoding's
global cache of earlier responses; then HumanEval prompts 20..39 at concurrency 8 (other prompts than the passes',
whose answers suffix decoding now holds), and the per-step time of each stage on pass 1 (from Triton's per-model
``nv_inference_*`` and our ``spec_decode_*_seconds_total`` metrics). After every server
has stopped, transformers ``generate(do_sample=False)`` and its prompt lookup (``prompt_lookup_num_tokens=k``) run on
the same prompts in this process. Prints a table, the stages and the goals (the default method >= 2.0x ``none`` and
>= 1.0x in-process prompt lookup; no method below 0.95x ``none`` on any prompt; ``none`` at concurrency 8 >= 3x
concurrency 1; ``none`` through the server >= 0.95x in-process ``generate``; ``auto``'s goals, :func:`auto_goals`,
with its per-prompt table), saves JSON and a PNG plot (tokens/s and mean tokens per step per method and pass).
Ratios are measured in the same run (the machine is shared and noisy).
``draft`` (and hybrid's fallback) needs a draft LM: ``--draft-model`` / ``DRAFT_MODEL``; without one, draft is skipped
and hybrid falls back to n-gram lookup. By default the distilled draft of ``make draft`` is used when it exists.
``--methods`` names registered methods and ``auto``: an unknown one, or one that cannot run here (draft without a
draft LM, a head's method without that head), is refused with the allowed ones.
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
        chosen = {m: r.stats.get("auto_methods", []).count(m) for m in dict.fromkeys(r.stats.get("auto_methods", []))}
        per_prompt.append({"tokens": len(r.output_ids), "seconds": r.total_s, "steps": r.stats["num_steps"]}
                          | ({"auto_methods": chosen} if chosen else {}))
    return {
        "method": f"server:{method}", "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "mean_tokens_per_step": tokens / steps, "mean_accepted_per_step": accepted / steps, "steps": steps,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None, "median_ttft_ms": 1000 * statistics.median(ttfts),
        "tokens_per_step_histogram": {str(n): c for n, c in sorted(hist.items())},
        # P(at least j drafts accepted in a step), j = 1..k: exact for methods that draft k tokens every step (draft)
        "acceptance_per_position": [sum(c for n, c in hist.items() if n > j) / max(1, sum(hist.values()))
                                    for j in range(1, k + 1)],
        "per_prompt": per_prompt,
    }


def bench_transformers(prompts: list[str], max_tokens: int, k: int = 4) -> list[dict]:
    """In-process transformers greedy ``generate`` of the target alone, and its prompt lookup decoding
    (``prompt_lookup_num_tokens=k``), on the same prompts, stopping at EOS; tokens counted up to EOS.

    Returns:
        one row per variant: method (``transformers:generate``, ``transformers:prompt_lookup``), tokens, seconds,
        tokens_per_s, per_prompt (tokens, seconds).
    """
    import torch

    from spec_decode.engine.model_loading import load_causal_lm, load_tokenizer, prepare_default_model

    path = prepare_default_model()
    tok = load_tokenizer(path)
    model = load_causal_lm(path, torch.device("cpu"), torch.float32)
    rows = []
    for name, extra in (("transformers:generate", {}), ("transformers:prompt_lookup", {"prompt_lookup_num_tokens": k})):
        with torch.inference_mode():
            model.generate(tok("warm up", return_tensors="pt")["input_ids"], max_new_tokens=4, do_sample=False, **extra)
        tokens = seconds = 0.0
        per_prompt = []
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt")["input_ids"]
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                     **extra)[0, ids.shape[1]:].tolist()
            dt = time.perf_counter() - t0
            eos = tok.eos_token_id
            n = out.index(eos) if eos in out else len(out)
            tokens += n
            seconds += dt
            per_prompt.append({"tokens": n, "seconds": dt})
        rows.append({"method": name, "tokens": int(tokens), "seconds": seconds, "tokens_per_s": tokens / seconds,
                     "mean_tokens_per_step": None, "per_prompt": per_prompt})
    return rows


def bench_concurrent(url: str, prompts: list[str], max_tokens: int, method: str, k: int, concurrency: int,
                     **params) -> dict:
    """``concurrency`` streams at once over ``prompts`` (each stream takes the next prompt when it finishes);
    ``params``: more ``generate`` inputs of every request (``draft_tree``, ...).

    Returns:
        dict with method, concurrency, tokens, seconds (wall clock, first send to last response), tokens_per_s.
    """
    from concurrent.futures import ThreadPoolExecutor

    from .generate import stream_generate

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: stream_generate(url, p, max_tokens, speculative_method=method,
                                                          num_draft_tokens=k, **params), prompts))
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in results)
    return {"method": f"server:{method}", "concurrency": concurrency, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds}


STAGE_MODELS = ("spec_step", "score_step", "greedy_step", "draft_model", "target_model", "verifier")


def stage_counters(metrics_url: str) -> dict:
    """Triton's per-model request count, request and compute times (us), and our stage seconds, for :func:`stages`."""
    from .metrics import scrape, value

    s = scrape(metrics_url, prefix="")
    out = {}
    for m in STAGE_MODELS:
        out[m] = {name: value(s, f"nv_inference_{name}", model=m, version="1")
                  for name in ("request_success", "request_duration_us", "compute_infer_duration_us",
                               "queue_duration_us")}
    out["score_s"] = value(s, "spec_decode_score_seconds_total")
    out["verify_s"] = value(s, "spec_decode_verify_seconds_total")
    out["calls_s"] = value(s, "spec_decode_round_seconds_total", stage="ensemble")  # generate awaiting its BLS calls
    return out


def stages(before: dict, after: dict, steps: int, step_s: float) -> dict:
    """Per-step milliseconds of each stage between two :func:`stage_counters` snapshots.

    ``client step`` is the client's time per step (seconds / steps); ``step calls`` the time generate awaited its
    BLS calls (``spec_decode_round_seconds_total{stage="ensemble"}``: ``spec_step``, ``score_step``,
    ``greedy_step`` or ``target_model`` alone, with the hops between their models); ``generate + gRPC`` the rest:
    generate's loop (tokenising, building the call, the response) and the stream to the client. Per model: request
    time (queue, inputs, execute, outputs) and execute time; ``target forward`` is the scorer alone. Releases (one per
    request) count in the models' figures, not in ``step calls``.
    """
    d = {m: {k: after[m][k] - before[m][k] for k in after[m]} for m in STAGE_MODELS}
    per = lambda us: us / 1000 / max(1, steps)  # noqa: E731 - ms per step
    calls = 1000 * (after["calls_s"] - before["calls_s"]) / max(1, steps)
    out = {"client step": 1000 * step_s, "step calls": calls, "generate + gRPC": 1000 * step_s - calls}
    for m in STAGE_MODELS[3:]:
        out[f"{m} request"] = per(d[m]["request_duration_us"])
        out[f"{m} execute"] = per(d[m]["compute_infer_duration_us"])
    out["target forward (scorer)"] = 1000 * (after["score_s"] - before["score_s"]) / max(1, steps)
    out["verifier (sampler)"] = 1000 * (after["verify_s"] - before["verify_s"]) / max(1, steps)
    return out


def goals(rows: list[dict], default_method: str) -> list[dict]:
    """The speed goals from ``rows`` (pass 1: fresh caches); each with its value and whether it was reached."""
    def get(method, **kw):
        return next((r for r in rows if r["method"] == method and all(r.get(a) == b for a, b in kw.items())), None)

    none = get("server:none", **{"pass": 1})
    out = []
    if none is None:
        return out
    default = get(f"server:{default_method}", **{"pass": 1})
    lookup = get("transformers:prompt_lookup")
    hf = get("transformers:generate")
    if default is not None:
        out.append({"goal": f"default method ({default_method}) >= 2.0x none", "value":
                    default["tokens_per_s"] / none["tokens_per_s"], "target": 2.0})
        if lookup is not None:
            out.append({"goal": f"default method ({default_method}) >= 1.0x in-process prompt lookup",
                        "value": default["tokens_per_s"] / lookup["tokens_per_s"], "target": 1.0})
    worst = None
    for r in rows:
        if not r["method"].startswith("server:") or r.get("pass") != 1 or r is none or "per_prompt" not in r:
            continue
        for i, (a, b) in enumerate(zip(r["per_prompt"], none["per_prompt"])):
            ratio = (a["tokens"] / a["seconds"]) / (b["tokens"] / b["seconds"])
            if worst is None or ratio < worst[0]:
                worst = (ratio, r["method"], i)
    if worst is not None:
        out.append({"goal": "no method below 0.95x none on any prompt", "value": worst[0], "target": 0.95,
                    "worst": f"{worst[1]}, prompt {worst[2]}"})
    head = get("server:eagle3", **{"pass": 1})
    if head is not None:
        out.append({"goal": "eagle3: mean tokens per step >= 2.5", "value": head["mean_tokens_per_step"],
                    "target": 2.5})
        st = head.get("stages_ms_per_step", {})
        drafted = head["draft_tokens"] / max(1, head["steps"])
        if st.get("target forward (scorer)") and drafted:
            out.append({"goal": "eagle3: cost per drafted token <= 0.1 target step (lower is better)",
                        "value": st["draft_model execute"] / drafted / st["target forward (scorer)"], "target": 0.1,
                        "lower_is_better": True})
        out.append({"goal": "eagle3 >= 1.8x none", "value": head["tokens_per_s"] / none["tokens_per_s"],
                    "target": 1.8})
        hybrid, best = get("server:hybrid", **{"pass": 1}), best_single(rows)
        if hybrid is not None and best is not None:
            out.append({"goal": f"hybrid (suffix + eagle3) >= the best single method ({best['method']})",
                        "value": hybrid["tokens_per_s"] / best["tokens_per_s"], "target": 1.0})
    out += auto_goals(rows, get)
    draft = get("server:draft", **{"pass": 1})
    if draft is not None and draft.get("acceptance_rate") is not None:
        out.append({"goal": "draft LM acceptance rate >= 0.4", "value": draft["acceptance_rate"], "target": 0.4})
    c8 = get("server:none", concurrency=8)
    if c8 is not None:
        out.append({"goal": "none at concurrency 8 >= 3x concurrency 1", "value": c8["tokens_per_s"] /
                    none["tokens_per_s"], "target": 3.0})
    if hf is not None:
        out.append({"goal": "none through the server >= 0.95x in-process transformers generate",
                    "value": none["tokens_per_s"] / hf["tokens_per_s"], "target": 0.95})
    for g in out:
        g["reached"] = g["value"] <= g["target"] if g.get("lower_is_better") else g["value"] >= g["target"]
    return out


SINGLE_EXCLUDED = ("server:none", "server:hybrid", "server:auto")  # not single proposers


def best_single(rows: list[dict]) -> dict | None:
    """The single proposer's server row with the most tokens/s on pass 1 at concurrency 1 (not none, hybrid or
    auto), or None when there is none."""
    singles = [r for r in rows if r["method"].startswith("server:") and r.get("pass") == 1
               and r.get("concurrency", 1) == 1 and r["method"] not in SINGLE_EXCLUDED]
    return max(singles, key=lambda r: r["tokens_per_s"]) if singles else None


def auto_goals(rows: list[dict], get) -> list[dict]:
    """speculative_method=auto's goals (docs/auto.md): >= 0.98x none on every prompt and >= the best single
    method's mean tokens/s (pass 1); >= 0.95x suffix on the second pass; at the largest concurrency, >= 1.0x none
    and >= every single method."""
    auto, none = get("server:auto", **{"pass": 1}), get("server:none", **{"pass": 1})
    if auto is None or none is None:
        return []
    out = []
    ratios = [(a["tokens"] / a["seconds"]) / (b["tokens"] / b["seconds"])
              for a, b in zip(auto["per_prompt"], none["per_prompt"])]
    worst = min(range(len(ratios)), key=ratios.__getitem__)
    out.append({"goal": "auto >= 0.98x none on every prompt", "value": ratios[worst], "target": 0.98,
                "worst": f"prompt {worst}"})
    best = best_single(rows)
    if best is not None:
        out.append({"goal": f"auto >= the best single method ({best['method']}), mean tokens/s", "value":
                    auto["tokens_per_s"] / best["tokens_per_s"], "target": 1.0})
    a2, s2 = get("server:auto", **{"pass": 2}), get("server:suffix", **{"pass": 2})
    if a2 is not None and s2 is not None:
        out.append({"goal": "auto >= 0.95x suffix on the repeated workload's second pass",
                    "value": a2["tokens_per_s"] / s2["tokens_per_s"], "target": 0.95})
    conc = [r for r in rows if r.get("concurrency", 1) > 1]
    top = max((r["concurrency"] for r in conc), default=0)
    at = {r["method"]: r for r in conc if r["concurrency"] == top}
    if "server:auto" in at and "server:none" in at:
        out.append({"goal": f"auto at concurrency {top} >= 1.0x none", "value":
                    at["server:auto"]["tokens_per_s"] / at["server:none"]["tokens_per_s"], "target": 1.0})
        others = [r for m, r in at.items() if m not in SINGLE_EXCLUDED]
        if others:
            best = max(others, key=lambda r: r["tokens_per_s"])
            out.append({"goal": f"auto at concurrency {top} >= every single method ({best['method']} best)",
                        "value": at["server:auto"]["tokens_per_s"] / best["tokens_per_s"], "target": 1.0})
    return out


def auto_table(rows: list[dict]) -> list[str]:
    """Per prompt (pass 1): tokens/s of none, the best single method (by mean) and auto, auto's ratios, and the
    methods auto chose (steps each)."""
    get = {r["method"]: r for r in rows if r.get("pass") == 1 and r.get("concurrency", 1) == 1}
    auto, none = get.get("server:auto"), get.get("server:none")
    if auto is None or none is None:
        return []
    best = best_single(rows)
    name = best["method"].split(":", 1)[1] if best else "-"
    lines = [f"{'prompt':>6}{'none':>8}{name:>9}{'auto':>8}{'/none':>7}{'/' + name:>9}  auto's choices (steps)"]
    for i, (a, n) in enumerate(zip(auto["per_prompt"], none["per_prompt"])):
        ta, tn = a["tokens"] / a["seconds"], n["tokens"] / n["seconds"]
        tb = best["per_prompt"][i]["tokens"] / best["per_prompt"][i]["seconds"] if best else float("nan")
        chosen = " ".join(f"{m} {c}" for m, c in sorted(a.get("auto_methods", {}).items(), key=lambda x: -x[1]))
        lines.append(f"{i:>6}{tn:>8.1f}{tb:>9.1f}{ta:>8.1f}{ta / tn:>7.2f}{ta / tb:>9.2f}  {chosen}")
    return lines


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Bar charts of tokens/s and mean tokens per step per method, one bar per pass; saved as PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    server = [r for r in rows if r["method"].startswith("server:") and r.get("concurrency", 1) == 1]
    methods = list(dict.fromkeys(r["method"].split(":", 1)[1] for r in server))
    passes = sorted({r["pass"] for r in server})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(passes))
    for ax, key, label in ((axes[0], "tokens_per_s", "output tokens/s"), (axes[1], "mean_tokens_per_step",
                                                                            "mean tokens per step")):
        for j, p in enumerate(passes):
            vals = [next((r[key] for r in server if r["method"] == f"server:{m}" and r["pass"] == p), 0)
                    for m in methods]
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


def parse_methods(ap: argparse.ArgumentParser, value: str | None, known: tuple[str, ...],
                  unavailable: dict[str, str]) -> list[str]:
    """The methods to run from ``--methods``.

    Args:
        ap: the parser whose ``error`` refuses a bad list (exit status 2, naming the methods at fault and the allowed
            ones).
        value: ``--methods`` as given (comma-separated), or None: every method of ``known`` that can run here (those
            of ``unavailable`` skipped, each with a printed line saying why).
        known: every method a request may name (``proposers.registry.METHODS`` and ``auto``).
        unavailable: method -> why it cannot run here (no draft LM, no head of that method).

    Returns:
        The methods in the order given.
    """
    if value is None:
        for m, why in unavailable.items():
            print(f"{why}: skipping speculative_method={m}", flush=True)
        return [m for m in known if m not in unavailable]
    methods = [m.strip() for m in value.split(",") if m.strip()]
    unknown = [m for m in methods if m not in known]
    if unknown:
        ap.error(f"--methods: unknown method(s) {', '.join(unknown)}; allowed: {', '.join(known)}")
    blocked = [m for m in methods if m in unavailable]
    if blocked:
        ap.error(f"--methods: cannot run {'; '.join(f'{m} ({unavailable[m]})' for m in blocked)}; allowed here: "
                 f"{', '.join(m for m in known if m not in unavailable)}")
    if not methods:
        ap.error(f"--methods: no method given; allowed: {', '.join(known)}")
    return methods


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, save JSON and the PNG plot."""
    import os

    from spec_decode.launcher import TritonServer, draft_overrides, prepare_repository
    from spec_decode.proposers.registry import METHODS
    from spec_decode.settings import GenerateSettings

    from .datasets import humaneval_prompts
    from .generate import stream_generate

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=20, help="held-out HumanEval prompts 0..N-1 (default 20)")
    ap.add_argument("--max-tokens", type=int, default=128)
    known = (*METHODS, "auto")
    ap.add_argument("--methods",
                    help=f"comma-separated methods, a fresh server each, of {', '.join(known)} (default: every one "
                         "that can run here: draft and eagle3 only when built, the other heads (eagle, medusa, "
                         "mlp_speculator, arctic) only when draft_model.speculator_path names one (--set); a method "
                         "named here that cannot run is refused; hybrid falls back to the EAGLE-3 head when there is "
                         "one, else n-gram lookup)")
    ap.add_argument("--passes", type=int, default=2, help="times the prompt set is sent (default 2: repeated workload)")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--draft-model", default=os.environ.get("DRAFT_MODEL", ""),
                    help="draft LM folder for speculative_method=draft and hybrid's fallback (default: $DRAFT_MODEL, "
                         "else the distilled default draft when `make draft` has built it)")
    ap.add_argument("--concurrency", type=int, default=8,
                    help="concurrent streams of each server's last run, over HumanEval prompts 20..39 (0: none)")
    ap.add_argument("--default-method", default=GenerateSettings.default_speculative_method,
                    help="the repository's default_speculative_method (default: the shipped one)")
    ap.add_argument("--output", type=Path, default=Path("results/bench.json"))
    ap.add_argument("--url", help="use an already running server (gRPC host:port) instead of starting one per method")
    ap.add_argument("--set", action="append", default=[], metavar="MODEL.PARAMETER=VALUE",
                    help="a config.pbtxt parameter for every server started (repeatable), e.g. "
                         "draft_model.speculator_min_token_prob=0")
    args = ap.parse_args(argv)
    settings: dict[str, dict[str, str]] = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        model, dot, param = key.partition(".")
        if not (eq and dot and model and param):
            ap.error(f"--set {item!r}: expected MODEL.PARAMETER=VALUE")
        settings.setdefault(model, {})[param] = value

    if not args.draft_model and not args.url:
        from spec_decode.proposers.draft_lm import default_draft_dir, default_draft_ready

        if default_draft_ready():
            args.draft_model = str(default_draft_dir())
    from spec_decode.proposers.speculators import HEAD_METHODS, SpeculatorLoadError, served_heads

    # the heads draft_model.speculator_path serves ("auto": the EAGLE-3 head of make speculator, when built)
    try:
        heads = served_heads(settings.get("draft_model", {}).get("speculator_path", "auto"))
    except SpeculatorLoadError as e:
        ap.error(f"--set draft_model.speculator_path: {e}")
    unavailable: dict[str, str] = {}  # with --url, the running server decides
    if not args.url and not args.draft_model:
        unavailable["draft"] = "no draft model (--draft-model / DRAFT_MODEL, or make draft)"
    for m in HEAD_METHODS:
        if m not in heads and not args.url:
            unavailable[m] = ("no EAGLE-3 head (make speculator)" if m == "eagle3" else
                              f"no {m} head in speculator_path (--set draft_model.speculator_path=FOLDER)")
    methods = parse_methods(ap, args.methods, known, unavailable)

    prompts = humaneval_prompts(args.prompts)
    concurrent_prompts = humaneval_prompts(40)[20:40]  # HumanEval 20..39, for the concurrency runs
    if "hybrid" in methods and "eagle3" not in heads and not args.url:
        print("hybrid falls back to n-gram lookup (no EAGLE-3 head)", flush=True)
    rows = []
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for m in methods:
        if args.url:
            for p in range(1, args.passes + 1):
                rows.append(bench_server(args.url, prompts, args.max_tokens, m, args.num_draft_tokens, p == 1)
                            | {"pass": p})
            continue
        overrides = draft_overrides(args.draft_model) if args.draft_model else {}
        if m == "hybrid" and "eagle3" in heads:  # Arctic's arrangement: suffix, else the model speculator
            overrides.setdefault("draft_model", {})["hybrid_fallback"] = "eagle3"
        for model, params in settings.items():
            overrides.setdefault(model, {}).update(params)
        repo = prepare_repository(overrides or None)
        log = args.output.with_name(f"{args.output.stem}.{m}.server.log")
        with TritonServer(repo, log_path=log) as srv:
            srv.wait_ready()
            for p in range(1, args.passes + 1):
                print(f"speculative_method={m}, pass {p}/{args.passes}: {len(prompts)} prompts through a fresh "
                      "server ...", flush=True)
                if p == 1:
                    stream_generate(srv.grpc_url, "warm up", 4, speculative_method=m)
                    before = stage_counters(srv.metrics_url)
                row = bench_server(srv.grpc_url, prompts, args.max_tokens, m, args.num_draft_tokens, False)
                if p == 1:
                    steps = sum(x["steps"] for x in row["per_prompt"])
                    row["stages_ms_per_step"] = stages(before, stage_counters(srv.metrics_url), steps,
                                                       row["seconds"] / steps)
                rows.append(row | {"pass": p, "concurrency": 1})
            if args.concurrency > 1:  # other prompts than the passes' (whose answers suffix decoding now holds)
                print(f"speculative_method={m} at concurrency {args.concurrency} ...", flush=True)
                rows.append(bench_concurrent(srv.grpc_url, concurrent_prompts, args.max_tokens, m,
                                             args.num_draft_tokens, args.concurrency))
    print("benchmarking in-process transformers generate and prompt lookup (servers stopped) ...", flush=True)
    rows += bench_transformers(prompts, args.max_tokens, args.num_draft_tokens)

    base = next(r for r in rows if r["method"] == "transformers:generate")["tokens_per_s"]
    none = {r["pass"]: r["tokens_per_s"] for r in rows if r["method"] == "server:none" and r.get("concurrency", 1) == 1}
    title = (f"{len(prompts)} HumanEval prompts x {args.passes} passes, {args.max_tokens} new tokens, greedy, "
             f"k={args.num_draft_tokens}" + (f", draft={Path(args.draft_model).name}" if args.draft_model else ""))
    print(f"\n{title}\n")
    print(f"{'method':<24}{'pass':>5}{'tokens/s':>10}{'tok/step':>10}{'acc/step':>9}{'accept':>8}{'TTFT ms':>9}"
          f"{'vs HF':>7}{'vs none':>9}")
    for r in rows:
        if r.get("concurrency", 1) != 1:
            continue
        acc = r.get("acceptance_rate")
        acc_s = f"{acc:.2f}" if acc is not None else "-"
        ttft_s = f"{r['median_ttft_ms']:.0f}" if "median_ttft_ms" in r else "-"
        n = none.get(r.get("pass"))
        vs_none = f"{r['tokens_per_s'] / n:.2f}" if n else "-"
        acc_step = f"{r['mean_accepted_per_step']:.2f}" if "mean_accepted_per_step" in r else "-"
        tps = f"{r['mean_tokens_per_step']:.2f}" if r.get("mean_tokens_per_step") else "-"
        print(f"{r['method']:<24}{r.get('pass', '-'):>5}{r['tokens_per_s']:>10.2f}{tps:>10}"
              f"{acc_step:>9}{acc_s:>8}{ttft_s:>9}{r['tokens_per_s'] / base:>7.2f}{vs_none:>9}")
    for r in rows:
        if r.get("concurrency", 1) != 1:
            print(f"{r['method']} at concurrency {r['concurrency']}: {r['tokens_per_s']:.2f} tokens/s")
    for r in rows:
        if "stages_ms_per_step" in r:
            print(f"\n{r['method']}, pass 1: ms per step by stage")
            for name, ms in r["stages_ms_per_step"].items():
                print(f"  {name:<28}{ms:>8.2f}")
    table = auto_table(rows)
    if table:
        print("\nauto per prompt (pass 1, tokens/s):")
        print("\n".join(table))
    result_goals = goals(rows, args.default_method)
    print("\ngoals (pass 1, fresh caches):")
    for g in result_goals:
        where = f" ({g['worst']})" if "worst" in g else ""
        print(f"  {'REACHED' if g['reached'] else 'not reached'}: {g['goal']}: {g['value']:.2f}{where}")
    result = {"goals": result_goals, "prompts": len(prompts), "passes": args.passes, "max_tokens": args.max_tokens,
              "settings": settings,
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
