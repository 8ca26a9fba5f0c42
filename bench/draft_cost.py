"""Draft cost against target cost, per token, in one process (the ``c`` of Leviathan et al. 2023's
speed-up (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))).

Times, with the KV caches the server uses (:class:`spec_decode.engine.kv_cache.CachedCausalLM`) on held-out HumanEval
prompts: one decode token of the draft, one decode token of the target, a whole draft proposal of k tokens
(:class:`spec_decode.proposers.DraftModelProposer`, including its softmax) and the target's scoring of k + 1
positions (:class:`spec_decode.engine.scorer.TargetScorer`). Target and draft calls alternate so machine noise hits
both.
Prints medians and ratios; saves JSON.

Usage: python -m bench.draft_cost [--draft PATH] [--k 4] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    """Measure and print the cost ratios; returns 0 (also when no draft exists: nothing to measure)."""
    from client.datasets import humaneval_prompts
    from spec_decode.engine.draft_vocab import load_draft_vocab
    from spec_decode.engine.kv_cache import CachedCausalLM
    from spec_decode.engine.model_loading import load_causal_lm, load_tokenizer, prepare_default_model
    from spec_decode.engine.scorer import TargetScorer
    from spec_decode.proposers import DraftModelProposer
    from spec_decode.proposers.draft_lm import default_draft_dir, default_draft_ready
    from spec_decode.sampling import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=None, help="draft folder (default: the distilled default draft)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--output", type=Path, default=Path("results/draft_cost.json"))
    args = ap.parse_args(argv)
    draft_dir = Path(args.draft) if args.draft else default_draft_dir()
    if args.draft is None and not default_draft_ready():
        print("no draft model: skipping the draft cost benchmark (run `make draft` first, or pass --draft)")
        return 0

    target_dir = prepare_default_model()
    tok = load_tokenizer(target_dir)
    target = CachedCausalLM(load_causal_lm(target_dir, torch.device("cpu"), torch.float32))
    draft_lm = CachedCausalLM(load_causal_lm(draft_dir, torch.device("cpu"), torch.float32))
    vocab = load_draft_vocab(draft_dir)
    proposer, scorer = DraftModelProposer(draft_lm, vocab), TargetScorer(target)
    as_draft = vocab.map_ids if vocab is not None else list
    greedy = SamplingParams(0.0, 0, 1.0, 0)
    times = {"target_token": [], "draft_token": [], "target_score_k1": [], "draft_propose_k": []}
    prompts = humaneval_prompts(5)
    for r in range(args.repeats):
        ids = tok(prompts[r % len(prompts)])["input_ids"] + [r % 100 + 200] * (r % 7)
        seq = 1000 + r
        for lm, key, m in ((target, "target_token", list), (draft_lm, "draft_token", as_draft)):
            lm.logits(seq, m(ids), 1)  # prefill (not timed)
            t = time.perf_counter()
            lm.logits(seq, m(ids + [198]), 1)
            times[key].append(time.perf_counter() - t)
        drafts = proposer.propose_one(seq, ids + [198, 220], args.k, greedy, 0)  # warm the draft cache to this length
        t = time.perf_counter()
        drafts = proposer.propose_one(seq, ids + [198, 220, 220], args.k, greedy, 1)
        times["draft_propose_k"].append(time.perf_counter() - t)
        scorer.score(seq, ids + [198, 220], [220], greedy)  # warm the target cache
        t = time.perf_counter()
        scorer.score(seq, ids + [198, 220, 220], drafts.draft_token_ids.tolist(), greedy)
        times["target_score_k1"].append(time.perf_counter() - t)
        target.release(seq)
        draft_lm.release(seq)
    med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    result = {
        "draft": str(draft_dir), "k": args.k, "repeats": args.repeats, "median_ms": med,
        "cost_ratio_per_token": med["draft_token"] / med["target_token"],
        "cost_ratio_step": med["draft_propose_k"] / (args.k * med["target_score_k1"]),
        "draft_layers": draft_lm.model.config.num_hidden_layers, "draft_vocab": len(vocab) if vocab else None,
        "target_layers": target.model.config.num_hidden_layers,
    }
    print(f"draft {draft_dir.name} ({result['draft_layers']} layers, vocabulary {result['draft_vocab'] or 'full'}) "
          f"vs target ({result['target_layers']} layers), CPU, median of {args.repeats}")
    print(f"  one decode token: draft {med['draft_token']:.2f} ms, target {med['target_token']:.2f} ms -> "
          f"cost ratio c = {result['cost_ratio_per_token']:.3f}")
    print(f"  a step: draft proposes k={args.k} in {med['draft_propose_k']:.2f} ms, target scores k+1 in "
          f"{med['target_score_k1']:.2f} ms -> per drafted token {result['cost_ratio_step']:.3f} of a target step")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
