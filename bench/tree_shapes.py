"""Which tree shape pays for a model proposer: tokens per step of chains and of trees of several shapes, at the same
node budget, in one process.

The held-out HumanEval prompts (0..N-1) are decoded greedily in process (:class:`spec_decode.in_process.LocalStep`:
the proposer, scorer and verifier objects the server runs), one shape after another, each prompt under every shape
before the next prompt (machine noise hits every shape alike). A shape is two numbers: for a head (default: the
EAGLE-3 head ``make speculator`` trains, ``--method eagle3``) EAGLE-2's ``tree_top_k`` x ``tree_depth`` (0: up to the
budget); for the draft LM (``--method draft``, the one ``make draft`` distils) ``draft_tree_top_k`` x
``draft_branch_prob``. Every shape's greedy output must equal the chain's. Prints and saves tokens per step, tokens/s
and the nodes drafted per step: what the config's defaults are chosen by (docs/benchmarks.md).

    python -m bench.tree_shapes --prompts 10 --max-tokens 96 --nodes 8 --output results/tree_shapes.json
    python -m bench.tree_shapes --method draft --shapes 2x0.8,2x0.5,4x0.8 --output results/tree_shapes.draft.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SHAPES = "2x0,4x0,8x0,4x4"
"""The heads' shapes measured by default (``tree_top_k`` x ``tree_depth``)."""
ATTRIBUTES = {"draft": ("tree_top_k", "branch_prob"), "mlp_speculator": ("tree_top_k", "tree_depth"),
              "arctic": ("tree_top_k", "tree_depth")}
"""The proposer attributes a shape's two numbers set, per method (else ``top_k``, ``depth``: the EAGLE heads')."""


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
    ap.add_argument("--method", default="eagle3", help="eagle3, eagle, mlp_speculator, arctic or draft")
    ap.add_argument("--speculator-path", default="auto", help="draft_model's speculator_path (default: the trained)")
    ap.add_argument("--draft-model-path", default="auto", help="draft_model's draft_model_path for --method draft "
                                                                "(default: the distilled; default: the target itself)")
    ap.add_argument("--min-token-prob", default="0.3", help="speculator_min_token_prob and draft_min_token_prob (the "
                                                             "config's default 0.3)")
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated AxB: a head's tree_top_k x tree_depth (0: up "
                                                      "to the budget), the draft LM's top_k x branch_prob")
    ap.add_argument("--output", type=Path, default=Path("results/tree_shapes.json"))
    args = ap.parse_args(argv)

    shapes = [(int(s.split("x")[0]), float(s.split("x")[1])) for s in args.shapes.split(",")]
    first, second = ATTRIBUTES.get(args.method, ("top_k", "depth"))
    path = prepare_default_model()
    tok = load_tokenizer(path)
    params = {"speculator_path": args.speculator_path, "speculator_min_token_prob": args.min_token_prob,
              "draft_min_token_prob": args.min_token_prob, "device": "cpu", "dtype": "float32",
              "draft_model_path": args.draft_model_path if args.method == "draft" else "none"}
    proposer = build_proposers(params).get(args.method)
    if proposer is None:
        print(f"no {args.method} head is served by speculator_path {args.speculator_path!r} (make speculator?)")
        return 1
    target = load_causal_lm(path, torch.device("cpu"), torch.float32)
    layers = tuple(aux_hidden_state_layers(args.speculator_path, target.config.num_hidden_layers))
    step = LocalStep({args.method: proposer}, TargetScorer(CachedCausalLM(target, aux_layers=layers)))
    names = ["chain"] + [f"{first} {a}, {second} {b:g}" for a, b in shapes]
    agg = {n: {"tokens": 0, "steps": 0, "drafted": 0, "seconds": 0.0} for n in names}
    differ: dict[str, list[int]] = {n: [] for n in names}
    seq = 0
    for i, prompt in enumerate(humaneval_prompts(args.prompts)):
        ids = tok(prompt)["input_ids"]
        ref = None
        for name, shape in zip(names, [None, *shapes]):
            if shape is not None:
                setattr(proposer, first, shape[0])
                setattr(proposer, second, shape[1] if second == "branch_prob" else int(shape[1]))
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
