"""Where a served round's time goes: a stage breakdown of one round through the real server (``make bench``).

For ``none`` and suffix decoding (k = 4; ``--methods``, where ``eagle3:chain`` / ``eagle3:tree`` sends ``draft_tree``
false / true), each on a fresh tritonserver, at concurrency 1 and 8 (greedy, held-out HumanEval prompts), the
milliseconds per round of each stage, from the server's own counters (docs/metrics.md) read before and after the load:

- generate (``spec_decode_round_seconds_total``): ``plan`` (auto and the token budget), ``build_request`` (the BLS
  request's tensors), ``ensemble`` (awaiting the BLS call), ``parse_response`` (the response into step results),
  ``between_rounds`` (generate's own work between rounds: commits, streamed responses, the next steps' inputs);
- per step model (``draft_model``, ``target_model``, ``verifier``): Triton's request time (``nv_inference_request_
  duration_us``: queue, inputs, execute, outputs) and execute time (both per execution: Triton times each request,
  and requests batched into one execute each count all of it), and inside ``execute`` our input decoding
  (``decode_inputs``), the model's work (proposer, target forward, sampler) and output encoding (``encode_outputs``);
- Triton outside the models: the BLS call less the step models' execute times (the ensemble's scheduling, the
  models' queues, the hand-off of tensors between processes). Not less their request times: a request's time ends
  when Triton releases it, after the ensemble has passed its outputs on, so those overlap the next model's.

The round's wall time is the client's seconds over the rounds; its non-forward time is that less the target's forward
and the proposer's (everything the serving adds). Prints a table and saves JSON.

    python -m bench.round_stages --output results/round_stages.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

STEP_MODELS = ("draft_model", "target_model", "verifier")
GENERATE_STAGES = ("plan", "build_request", "ensemble", "parse_response", "between_rounds")
WORK = {"draft_model": "spec_decode_propose_seconds_total", "target_model": "spec_decode_score_seconds_total",
        "verifier": "spec_decode_verify_seconds_total"}
IO = {m: f"spec_decode_{m}_io_seconds_total" for m in STEP_MODELS}
SETTLE_S = 2.5  # before each snapshot: the models export their counters at most every 0.5 s, Triton its own on a poll


def counters(metrics_url: str) -> dict[str, float]:
    """The counters :func:`breakdown` reads, summed over their other labels, by a flat name."""
    from client.metrics import scrape

    s = scrape(metrics_url, prefix="")

    def total(name: str, **labels: str) -> float:
        return sum(v for (n, ls), v in s.items()
                   if n in (name, name + "_total") and all(dict(ls).get(k) == x for k, x in labels.items()))

    out = {"rounds": total("spec_decode_rounds_total")}
    for stage in GENERATE_STAGES:
        out[f"generate.{stage}"] = total("spec_decode_round_seconds_total", stage=stage)
    for m in (*STEP_MODELS, "spec_step", "score_step", "greedy_step"):
        out[f"{m}.request_us"] = total("nv_inference_request_duration_us", model=m)
        out[f"{m}.execute_us"] = total("nv_inference_compute_infer_duration_us", model=m)
        out[f"{m}.requests"] = total("nv_inference_request_success", model=m)
        out[f"{m}.executions"] = total("nv_inference_exec_count", model=m)
    for m in STEP_MODELS:
        out[f"{m}.work"] = total(WORK[m])
        out[f"{m}.decode_inputs"] = total(IO[m], stage="decode_inputs")
        out[f"{m}.encode_outputs"] = total(IO[m], stage="encode_outputs")
    return out


def breakdown(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Milliseconds per round of each stage between two :func:`counters` snapshots, over ``seconds`` of load.

    Raises:
        RuntimeError: no round ran in between.
    """
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    rounds = d["rounds"]
    if rounds <= 0:
        raise RuntimeError("no round ran: spec_decode_rounds_total did not move")
    ms = lambda s: 1000 * s / rounds  # noqa: E731 - seconds -> ms per round
    out = {"rounds": rounds, "round (client wall time)": ms(seconds)}
    for stage in GENERATE_STAGES:
        out[f"generate: {stage}"] = ms(d[f"generate.{stage}"])
    executes_us = 0.0
    for m in STEP_MODELS:
        # Triton times each request: requests that shared an execute (a release batched with a round) each count
        # the whole execute, so the totals are scaled to executions (the mean per request x the executes)
        share = d[f"{m}.executions"] / d[f"{m}.requests"] if d[f"{m}.requests"] > 0 else 1.0
        executes_us += d[f"{m}.execute_us"] * share
        out[f"{m}: Triton request"] = ms(d[f"{m}.request_us"] * share / 1e6)
        out[f"{m}: execute"] = ms(d[f"{m}.execute_us"] * share / 1e6)
        out[f"{m}: decode inputs"] = ms(d[f"{m}.decode_inputs"])
        out[f"{m}: work"] = ms(d[f"{m}.work"])
        out[f"{m}: encode outputs"] = ms(d[f"{m}.encode_outputs"])
    out["Triton outside the models' execute (BLS call less them)"] = ms(d["generate.ensemble"] - executes_us / 1e6)
    forwards = d["target_model.work"] + d["draft_model.work"]
    out["non-forward time (wall less target and proposer work)"] = ms(seconds - forwards)
    return out


def run(method: str, k: int, concurrency: int, prompts: list[str], max_tokens: int, srv, **params) -> dict:
    """One load on a running server: ``concurrency`` greedy streams over ``prompts`` (``params``: more ``generate``
    inputs); its :func:`breakdown`."""
    from client.bench import bench_concurrent

    time.sleep(SETTLE_S)
    before = counters(srv.metrics_url)
    t0 = time.perf_counter()
    load = bench_concurrent(srv.grpc_url, prompts, max_tokens, method, k, concurrency, **params)
    seconds = time.perf_counter() - t0
    time.sleep(SETTLE_S)
    return {"method": method, "k": k, "concurrency": concurrency, "tokens_per_s": load["tokens_per_s"],
            "ms_per_round": breakdown(before, counters(srv.metrics_url), seconds)}


def main(argv: list[str] | None = None) -> int:
    """Run the breakdown for ``none`` and suffix at concurrency 1 and 8; print it and save JSON."""
    from client.datasets import humaneval_prompts
    from client.generate import stream_generate
    from spec_decode.launcher import TritonServer, prepare_repository

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="held-out HumanEval prompts per load (default 8)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--methods", default="none,suffix")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--min-token-prob", default=None, help="draft_model's speculator_min_token_prob and "
                                                            "draft_min_token_prob (default: the config's)")
    ap.add_argument("--output", type=Path, default=Path("results/round_stages.json"))
    args = ap.parse_args(argv)
    prompts = humaneval_prompts(args.prompts)
    rows = []
    overrides = None if args.min_token_prob is None else {"draft_model": {
        "speculator_min_token_prob": args.min_token_prob, "draft_min_token_prob": args.min_token_prob}}
    for spec in args.methods.split(","):
        method, _, shape = spec.partition(":")
        params = {"draft_tree": shape == "tree"} if shape else {}
        k = 0 if method == "none" else args.num_draft_tokens
        log = args.output.with_name(f"{args.output.stem}.{spec.replace(':', '.')}.server.log")
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with TritonServer(prepare_repository(overrides), log_path=log) as srv:
            srv.wait_ready()
            stream_generate(srv.grpc_url, "warm up", 4, speculative_method=method, **params)
            for concurrency in (1, 8):
                print(f"{spec} (k={k}) at concurrency {concurrency} ...", flush=True)
                row = run(method, k, concurrency, prompts, args.max_tokens, srv, **params)
                rows.append({**row, "method": spec})
    names = list(rows[0]["ms_per_round"])
    head = "".join(f"{r['method']} c={r['concurrency']:<3}".rjust(16) for r in rows)
    print(f"\nms per round{'':<47}{head}")
    for name in names:
        print(f"{name:<59}" + "".join(f"{r['ms_per_round'][name]:>16.2f}" for r in rows))
    result = {"rows": rows, "prompts": args.prompts, "max_tokens": args.max_tokens,
              "machine": platform.platform(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    args.output.write_text(json.dumps(result, indent=1))
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
