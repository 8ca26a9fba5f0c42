"""Which tree shape pays for a head: tokens per step of chains and of EAGLE-2 trees of several ``tree_top_k`` and
``tree_depth``, at the same node budget, in one process.

The held-out HumanEval prompts (0..N-1) are decoded greedily in process (:class:`spec_decode.in_process.LocalStep`:
the proposer, scorer and verifier objects the server runs) with the trained EAGLE-3 head (``make speculator``;
``--method eagle3``) or another served head, one shape after another, each prompt under every shape before the next
prompt (machine noise hits every shape alike). Every shape's greedy output must equal the chain's. Prints and saves
tokens per step, tokens/s and the nodes drafted per step; the shape of highest tokens per step is what the config's
defaults (``tree_top_k``, ``tree_depth``) should be (docs/benchmarks.md).

    python -m bench.tree_shapes --prompts 10 --max-tokens 96 --nodes 8 --output results/tree_shapes.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SHAPES = ((1, 0), (2, 0), (4, 0), (8, 0), (4, 4), (8, 4))
"""(tree_top_k, tree_depth) pairs measured by default; (1, 0) is a chain (one child per node)."""


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; returns 0, or 1 when a shape's output differs from the chain's."""
    from client.datasets import humaneval_prompts
    from spec_decode.engine.kv_cache import CachedCausalLM
    from spec_decode.engine.model_loading import load_causal_lm, load_tokenizer, prepare_default_model
    from spec_decode.engine.scorer import TargetScorer
    from spec_decode.generation import Generation
    from spec_decode.in_process import LocalStep, run_local
    from spec_decode.proposers import build_proposers
    from spec_decode.proposers.speculators import aux_hidden_state_layers
    from spec_decode.request import GenerationRequest

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=10, help="held-out HumanEval prompts 0..N-1")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--nodes", type=int, default=8, help="num_draft_tokens: the node budget of every shape")
    ap.add_argument("--method", default="eagle3", help="the head (its proposer must take tree_top_k, tree_depth)")
    ap.add_argument("--speculator-path", default="auto", help="draft_model's speculator_path (default: the trained)")
    ap.add_argument("--min-token-prob", default="0.3", help="speculator_min_token_prob (the config's default 0.3)")
    ap.add_argument("--shapes", default=",".join(f"{k}x{d}" for k, d in SHAPES),
                    help="tree_top_k x tree_depth pairs (depth 0: up to the node budget)")
    ap.add_argument("--output", type=Path, default=Path("results/tree_shapes.json"))
    args = ap.parse_args(argv)

    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    path = prepare_default_model()
    tok = load_tokenizer(path)
    params = {"speculator_path": args.speculator_path, "speculator_min_token_prob": args.min_token_prob,
              "device": "cpu", "dtype": "float32", "draft_model_path": "none"}
    proposer = build_proposers(params).get(args.method)
    if proposer is None:
        print(f"no {args.method} head is served by speculator_path {args.speculator_path!r} (make speculator?)")
        return 1
    target = load_causal_lm(path, torch.device("cpu"), torch.float32)
    layers = tuple(aux_hidden_state_layers(args.speculator_path, target.config.num_hidden_layers))
    step = LocalStep({args.method: proposer}, TargetScorer(CachedCausalLM(target, aux_layers=layers)))
    names = ["chain"] + [f"top_k {k}, depth {d or 'budget'}" for k, d in shapes]
    agg = {n: {"tokens": 0, "steps": 0, "drafted": 0, "seconds": 0.0} for n in names}
    differ: dict[str, list[int]] = {n: [] for n in names}
    seq = 0
    for i, prompt in enumerate(humaneval_prompts(args.prompts)):
        ids = tok(prompt)["input_ids"]
        ref = None
        for name, shape in zip(names, [None, *shapes]):
            if shape is not None:
                proposer.top_k, proposer.depth = shape  # type: ignore[attr-defined]
            req = GenerationRequest(text_input=prompt, max_tokens=args.max_tokens, speculative_method=args.method,
                                    num_draft_tokens=args.nodes, temperature=0.0, draft_tree=shape is not None)
            seq += 1
            gen = Generation(seq, ids, req, tok, {tok.eos_token_id}, 4096, 0)
            t0 = time.perf_counter()
            run_local(gen, step)
            a = agg[name]
            a["seconds"] += time.perf_counter() - t0
            a["tokens"] += len(gen.output_ids)
            a["steps"] += gen.stats.steps
            a["drafted"] += gen.stats.draft_tokens
            ref = gen.output_ids if ref is None else ref
            if gen.output_ids != ref:
                differ[name].append(i)
        print(f"prompt {i}: done", flush=True)
    chain = agg["chain"]["tokens"] / agg["chain"]["steps"]
    rows = []
    print(f"\n{'shape':24} {'tok/step':>8} {'x chain':>7} {'nodes/step':>10} {'tokens/s':>9}")
    for name, a in agg.items():
        row = {"shape": name, "tokens_per_step": a["tokens"] / a["steps"], "tokens_per_s": a["tokens"] / a["seconds"],
               "nodes_per_step": a["drafted"] / a["steps"], "differing_prompts": differ[name], **a}
        row["x_chain"] = row["tokens_per_step"] / chain
        rows.append(row)
        print(f"{name:24} {row['tokens_per_step']:8.2f} {row['x_chain']:7.2f} {row['nodes_per_step']:10.2f} "
              f"{row['tokens_per_s']:9.2f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"method": args.method, "prompts": args.prompts, "max_tokens": args.max_tokens,
                                       "nodes": args.nodes, "min_token_prob": float(args.min_token_prob),
                                       "rows": rows}, indent=1))
    print(f"saved {args.output}")
    wrong = [name for name, d in differ.items() if d]
    if wrong:
        print(f"outputs differ from the chain's: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
