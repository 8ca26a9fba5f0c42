"""bfloat16 against float32 through the server: what ``dtype: auto`` buys on this CPU, and that it loses nothing.

In one run, one fresh tritonserver per (dtype, method), one after the other: float32 and bfloat16 (target_model's and
draft_model's ``dtype``), each with ``speculative_method`` ``none`` and the default method (suffix). Each server
streams N held-out HumanEval prompts (0..N-1, greedy, up to M new tokens, stopping at EOS) one at a time, then the same
prompts 8 at a time. Then, with every server stopped, transformers' own ``generate(do_sample=False)`` in bfloat16 on
the same prompts in this process.

Reports:

- speed: tokens/s of each (dtype, method) at concurrency 1, and the goals' ratios (bfloat16 ``none`` >= 1.0x float32
  ``none``; the default method in bfloat16 >= 1.8x float32 ``none`` with no prompt below 1.0x);
- exactness: per dtype, the prompts where a method's tokens (at concurrency 1 or 8) differ from ``none``'s at
  concurrency 1 (goal: none);
- agreement with transformers: per prompt, whether the server's bfloat16 ``none`` gives transformers' bfloat16
  greedy tokens, and where not, whether the first difference is a near-tie (transformers' two candidates' logits
  within one bfloat16 step of each other: either kernel may round either way there).

Prints the tables and saves JSON with the machine's facts (CPU flags, what ``auto`` picks).

    python -m bench.dtype --output results/dtype.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DTYPES = ("float32", "bfloat16")


def run_prompts(url: str, prompts: list[str], max_tokens: int, method: str, concurrency: int) -> list[dict]:
    """Each prompt streamed once (greedy) with ``method``, ``concurrency`` at a time; per prompt its output ids,
    seconds and steps."""
    from client.generate import stream_generate

    def one(prompt: str) -> dict:
        r = stream_generate(url, prompt, max_tokens, speculative_method=method)
        return {"ids": list(r.output_ids), "seconds": r.total_s, "steps": r.stats["num_steps"]}

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def near_tie(logits, a: int, b: int) -> bool:
    """Whether tokens ``a`` and ``b`` are within one bfloat16 step of each other in ``logits`` (a 1-D float tensor):
    the spacing of bfloat16 numbers at the larger of the two magnitudes (8 significant bits)."""
    import math

    la, lb = float(logits[a]), float(logits[b])
    top = max(abs(la), abs(lb), 1e-30)
    step = 2.0 ** (math.floor(math.log2(top)) - 7)
    return abs(la - lb) <= step


def transformers_agreement(prompts: list[str], served: list[list[int]], max_tokens: int) -> list[dict]:
    """Per prompt: transformers' bfloat16 greedy tokens against ``served`` (the server's bfloat16 ``none``): equal,
    or the first index where they differ and whether that is a :func:`near_tie` in transformers' logits."""
    import torch

    from spec_decode.engine.model_loading import load_causal_lm, load_tokenizer, prepare_default_model

    folder = prepare_default_model()
    tok = load_tokenizer(folder)
    model = load_causal_lm(folder, torch.device("cpu"), torch.bfloat16)
    out = []
    for prompt, ids in zip(prompts, served):
        enc = tok(prompt, return_tensors="pt")
        with torch.inference_mode():
            g = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
        ref = g.sequences[0, enc["input_ids"].shape[1]:].tolist()
        n = min(len(ref), len(ids))
        first = next((i for i in range(n) if ref[i] != ids[i]), None)
        if first is None and len(ref) == len(ids):
            out.append({"equal": True})
            continue
        if first is None:  # one stopped earlier (an end-of-sequence token the other did not produce)
            first = n
        tie = first < len(g.logits) and first < len(ids) and near_tie(g.logits[first][0].float(), ref[first],
                                                                       ids[first])
        out.append({"equal": False, "first_difference": first, "near_tie": bool(tie)})
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring); returns 0."""
    from client.datasets import humaneval_prompts
    from spec_decode.engine.dtype_choice import choose_dtype, cpu_bf16_flag, kernels_batch_invariant
    from spec_decode.launcher import TritonServer, prepare_repository
    from spec_decode.settings import GenerateSettings

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=10, help="held-out HumanEval prompts 0..N-1 (default 10)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8, help="the second pass's concurrent streams")
    ap.add_argument("--output", type=Path, default=Path("results/dtype.json"))
    args = ap.parse_args(argv)
    import torch

    prompts = humaneval_prompts(args.prompts)
    default = GenerateSettings.default_speculative_method
    methods = ("none", default)
    runs: dict[str, dict] = {}
    for dtype in DTYPES:
        for method in methods:
            repo = prepare_repository({"target_model": {"dtype": dtype}, "draft_model": {"dtype": dtype}})
            log = args.output.with_name(f"{args.output.stem}.{dtype}.{method}.server.log")
            args.output.parent.mkdir(parents=True, exist_ok=True)
            with TritonServer(repo, log_path=log) as srv:
                srv.wait_ready()
                run_prompts(srv.grpc_url, ["warm up"], 4, method, 1)
                print(f"{dtype} {method}: {len(prompts)} prompts, then {args.concurrency} at a time ...", flush=True)
                t0 = time.perf_counter()
                c1 = run_prompts(srv.grpc_url, prompts, args.max_tokens, method, 1)
                wall = time.perf_counter() - t0
                c8 = run_prompts(srv.grpc_url, prompts, args.max_tokens, method, args.concurrency)
            tokens = sum(len(p["ids"]) for p in c1)
            runs[f"{dtype}:{method}"] = {"dtype": dtype, "method": method, "tokens": tokens, "wall_s": wall,
                                         "tokens_per_s": tokens / sum(p["seconds"] for p in c1),
                                         "mean_tokens_per_step": tokens / max(1, sum(p["steps"] for p in c1)),
                                         "per_prompt": c1, "concurrent_ids": [p["ids"] for p in c8]}
    print("transformers generate in bfloat16, in process (servers stopped) ...", flush=True)
    agreement = transformers_agreement(prompts, [p["ids"] for p in runs["bfloat16:none"]["per_prompt"]],
                                       args.max_tokens)

    base = runs["float32:none"]
    rate = lambda p: len(p["ids"]) / p["seconds"]  # noqa: E731 - tokens/s of one prompt
    print(f"\n{'dtype':9} {'method':8} {'tokens/s':>9} {'x f32 none':>10} {'tok/step':>8}")
    for r in runs.values():
        ratio = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{r['dtype']:9} {r['method']:8} {r['tokens_per_s']:9.2f} {ratio:10.2f} {r['mean_tokens_per_step']:8.2f}")
    worst = min(rate(a) / rate(b) for a, b in zip(runs[f"bfloat16:{default}"]["per_prompt"], base["per_prompt"]))
    goals = [
        {"goal": "none in bfloat16 >= 1.0x none in float32",
         "value": runs["bfloat16:none"]["tokens_per_s"] / base["tokens_per_s"], "target": 1.0},
        {"goal": f"default method ({default}) in bfloat16 >= 1.8x float32 none",
         "value": runs[f"bfloat16:{default}"]["tokens_per_s"] / base["tokens_per_s"], "target": 1.8},
        {"goal": f"no prompt of {default} in bfloat16 below 1.0x float32 none", "value": worst, "target": 1.0},
    ]
    exact = {}
    for dtype in DTYPES:
        ref = [p["ids"] for p in runs[f"{dtype}:none"]["per_prompt"]]
        differ = {}
        for method in methods:
            r = runs[f"{dtype}:{method}"]
            differ[f"{method} c=1"] = [i for i, p in enumerate(r["per_prompt"]) if p["ids"] != ref[i]]
            differ[f"{method} c={args.concurrency}"] = [i for i, ids in enumerate(r["concurrent_ids"]) if ids != ref[i]]
        exact[dtype] = differ
        goals.append({"goal": f"{dtype}: every method and concurrency gives none's greedy tokens (prompts differing)",
                      "value": sum(len(v) for v in differ.values()), "target": 0, "lower_is_better": True,
                      "differing": differ})
    for g in goals:
        g["reached"] = g["value"] <= g["target"] if g.get("lower_is_better") else g["value"] >= g["target"]
        print(f"{'REACHED' if g['reached'] else 'missed '}  {g['goal']}: {g['value']:.2f} (target {g['target']})")
    ties = sum(1 for a in agreement if not a["equal"] and a["near_tie"])
    other = sum(1 for a in agreement if not a["equal"] and not a["near_tie"])
    print(f"server bfloat16 none against transformers bfloat16 greedy: {sum(a['equal'] for a in agreement)} of "
          f"{len(agreement)} prompts equal, {ties} differ first at a near-tie, {other} elsewhere")
    auto = choose_dtype("auto", torch.device("cpu"))
    result = {
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
                    "cpu_bf16_flag": cpu_bf16_flag(), "bf16_kernels_batch_invariant":
                    kernels_batch_invariant(torch.bfloat16), "auto": str(auto)},
        "prompts": len(prompts), "max_tokens": args.max_tokens, "runs": runs, "goals": goals,
        "exactness": exact, "transformers_agreement": agreement,
    }
    args.output.write_text(json.dumps(result, indent=1))
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
