"""Does adapting k to recent acceptance help?  Fixed k against transformers' "heuristic" schedule, in one process.

For each proposer (ngram, suffix, and draft when ``--draft`` names a draft model folder), HumanEval prompts are decoded
greedily in process (:class:`spec_decode.in_process.LocalStep`, the same proposer/scorer/verifier objects the server
runs) with a fixed k and with the heuristic schedule (:class:`spec_decode.scheduler.k_schedule.HeuristicK`: k += 2
after a fully accepted step, k -= 1 after a rejection). Fixed and adaptive runs alternate prompt by prompt, so
machine noise hits both alike. Prints tokens/s, tokens per step and acceptance, saves JSON.

Usage: python -m bench.adaptive_k --prompts 10 --max-tokens 128 --k 4 --max-k 8 [--draft PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; returns 0."""
    from client.datasets import humaneval_prompts
    from spec_decode.engine.kv_cache import CachedCausalLM
    from spec_decode.engine.model_loading import load_causal_lm, load_tokenizer, prepare_default_model
    from spec_decode.engine.scorer import TargetScorer
    from spec_decode.generation import Generation
    from spec_decode.in_process import LocalStep, run_local
    from spec_decode.proposers import DraftModelProposer, NgramProposer, SuffixProposer, SuffixSettings
    from spec_decode.request import GenerationRequest
    from spec_decode.scheduler.k_schedule import ConstantK, HeuristicK

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--draft", default=None, help="draft model folder (adds method=draft)")
    ap.add_argument("--output", type=Path, default=Path("results/adaptive_k.json"))
    args = ap.parse_args(argv)

    torch.set_num_threads(max(1, torch.get_num_threads()))
    path = prepare_default_model()
    tok = load_tokenizer(path)
    target = load_causal_lm(path, torch.device("cpu"), torch.float32)
    proposers = {"ngram": NgramProposer(), "suffix": SuffixProposer(SuffixSettings(max_cached_requests=0))}
    if args.draft:
        draft = load_causal_lm(args.draft, torch.device("cpu"), torch.float32)
        proposers["draft"] = DraftModelProposer(CachedCausalLM(draft))
    step = LocalStep(proposers, TargetScorer(CachedCausalLM(target)))
    prompts = humaneval_prompts(args.prompts)
    eos = {tok.eos_token_id}
    rows = []
    seq = 0
    for method in proposers:
        agg = {mode: {"tokens": 0, "seconds": 0.0, "steps": 0, "draft": 0, "accepted": 0}
               for mode in ("fixed", "adaptive")}
        for prompt in prompts:
            ids = tok(prompt)["input_ids"]
            outs = {}
            for mode in ("fixed", "adaptive"):
                req = GenerationRequest(text_input=prompt, max_tokens=args.max_tokens, speculative_method=method,
                                        num_draft_tokens=args.k, temperature=0.0)
                seq += 1
                gen = Generation(seq, ids, req, tok, eos, 4096, 0,
                                 HeuristicK(args.max_k) if mode == "adaptive" else ConstantK())
                t0 = time.perf_counter()
                run_local(gen, step)
                a = agg[mode]
                a["seconds"] += time.perf_counter() - t0
                a["tokens"] += len(gen.output_ids)
                a["steps"] += gen.stats.steps
                a["draft"] += gen.stats.draft_tokens
                a["accepted"] += gen.stats.accepted_tokens
                outs[mode] = gen.output_ids
            if outs["fixed"] != outs["adaptive"]:
                raise AssertionError(f"greedy outputs differ between fixed and adaptive k ({method})")
        for mode, a in agg.items():
            rows.append({"method": method, "mode": mode, "tokens_per_s": a["tokens"] / a["seconds"],
                         "tokens_per_step": a["tokens"] / a["steps"],
                         "acceptance_rate": a["accepted"] / a["draft"] if a["draft"] else None, **a})
        f, ad = rows[-2], rows[-1]
        print(f"{method:<8} fixed k={args.k}: {f['tokens_per_s']:6.2f} tok/s {f['tokens_per_step']:.2f} tok/step "
              f"acc {f['acceptance_rate'] or 0:.2f} | adaptive (max {args.max_k}): {ad['tokens_per_s']:6.2f} tok/s "
              f"{ad['tokens_per_step']:.2f} tok/step acc {ad['acceptance_rate'] or 0:.2f} | "
              f"ratio {ad['tokens_per_s'] / f['tokens_per_s']:.3f}", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"prompts": len(prompts), "max_tokens": args.max_tokens, "k": args.k,
                                       "max_k": args.max_k, "results": rows}, indent=2))
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
