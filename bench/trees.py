"""Draft trees against chains through the server: what trees buy at the same node cap, and that they lose nothing.

In one run, one fresh tritonserver per setting, one after the other (empty caches: no setting profits from another's
responses): ``none``, then each tree method (default ``suffix``) with ``draft_tree`` false (chains) and true (trees)
at the same ``num_draft_tokens`` (the node cap, default 8). Each server streams the held-out HumanEval prompts
(0..N-1) and the chat set (``client.datasets.chat_prompts``, rendered with the target's chat template), greedy, up to
M new tokens, one at a time; then the same prompts 8 at a time (exactness only). The dtype is the servers' (``DTYPE``,
default ``auto``: bfloat16 where the CPU multiplies it natively and its kernels are batch-invariant).

Reports, per prompt set and setting: tokens per step, tokens/s, and the goals' ratios (trees >= 1.3x the tokens per
step of chains, 1.4x for ``eagle3``'s and 1.2x for the draft LM's: :data:`TREE_GOALS`; trees' tokens/s against
chains'; the default method >= 2.0x ``none`` with no prompt below 0.98x; with ``auto`` among the methods, ``auto``
with trees allowed against the best fixed setting and no prompt below 0.98x ``none``);
exactness: the prompts where a setting's tokens (at concurrency 1 or 8) differ from ``none``'s (goal: none).

    python -m bench.trees --output results/trees.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TREE_GOALS = {"eagle3": 1.4, "draft": 1.2}
"""Per method, the goal for its trees' tokens per step over its chains' at the same node cap (else 1.3: the model-free
proposers')."""


def run_prompts(url: str, prompts: list[str], max_tokens: int, concurrency: int, **params) -> list[dict]:
    """Each prompt streamed once (greedy), ``concurrency`` at a time; per prompt its output ids, seconds and steps
    (with ``auto``, also its steps by shape: ``none``, ``chain``, or ``tree`` and the width it chose, ``tree4``)."""
    from client.generate import stream_generate

    def one(prompt: str) -> dict:
        r = stream_generate(url, prompt, max_tokens, **params)
        out = {"ids": list(r.output_ids), "seconds": r.total_s, "steps": r.stats["num_steps"],
               "drafted": r.stats["num_draft_tokens_total"]}
        if "auto_draft_trees" in r.stats:
            shapes = ["none" if m == "none" else f"tree{w or ''}" if t else "chain" for m, t, w in zip(
                r.stats["auto_methods"], r.stats["auto_draft_trees"], r.stats["auto_tree_top_k"])]
            out["auto_shapes"] = dict(Counter(shapes))
        return out

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def summary(per_prompt: list[dict]) -> dict:
    """Tokens, tokens/s (over the prompts' summed seconds) and tokens per step of a setting's prompts."""
    tokens = sum(len(p["ids"]) for p in per_prompt)
    return {"tokens": tokens, "tokens_per_s": tokens / max(1e-9, sum(p["seconds"] for p in per_prompt)),
            "tokens_per_step": tokens / max(1, sum(p["steps"] for p in per_prompt)),
            "nodes_per_step": sum(p["drafted"] for p in per_prompt) / max(1, sum(p["steps"] for p in per_prompt))}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring); returns 0."""
    from client.datasets import chat_prompts, humaneval_prompts
    from spec_decode.engine.model_loading import load_tokenizer, prepare_default_model
    from spec_decode.launcher import TritonServer, prepare_repository
    from spec_decode.settings import GenerateSettings

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=10, help="held-out HumanEval prompts 0..N-1 (default 10)")
    ap.add_argument("--chat", type=int, default=10, help="chat prompts (default 10; 0: none)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--nodes", type=int, default=8, help="num_draft_tokens: the node cap of trees and chains")
    ap.add_argument("--methods", default="suffix", help="comma-separated tree methods (default suffix)")
    ap.add_argument("--concurrency", type=int, default=8, help="the exactness pass's concurrent streams")
    ap.add_argument("--min-token-prob", default=None, help="draft_model's speculator_min_token_prob and "
                                                            "draft_min_token_prob (default: the config's, 0.3); 0: "
                                                            "every node of the budget, to compare shapes at one budget")
    ap.add_argument("--output", type=Path, default=Path("results/trees.json"))
    args = ap.parse_args(argv)

    sets = {"humaneval": humaneval_prompts(args.prompts)}
    if args.chat:
        sets["chat"] = chat_prompts(args.chat, load_tokenizer(prepare_default_model()))
    prompts = [p for ps in sets.values() for p in ps]
    settings = [("none", None)] + [(m, tree) for m in args.methods.split(",") for tree in (False, True)]
    runs: dict[str, dict] = {}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for method, tree in settings:
        name = method if tree is None else f"{method}:{'tree' if tree else 'chain'}"
        params = {"speculative_method": method, "num_draft_tokens": 0 if method == "none" else args.nodes}
        if tree is not None:
            params["draft_tree"] = tree
        log = args.output.with_name(f"{args.output.stem}.{name.replace(':', '.')}.server.log")
        overrides = None if args.min_token_prob is None else {"draft_model": {
            "speculator_min_token_prob": args.min_token_prob, "draft_min_token_prob": args.min_token_prob}}
        with TritonServer(prepare_repository(overrides), log_path=log) as srv:
            srv.wait_ready()
            run_prompts(srv.grpc_url, ["warm up"], 4, 1, **params)
            print(f"{name}: {len(prompts)} prompts, then {args.concurrency} at a time ...", flush=True)
            t0 = time.perf_counter()
            c1 = run_prompts(srv.grpc_url, prompts, args.max_tokens, 1, **params)
            wall = time.perf_counter() - t0
            c8 = run_prompts(srv.grpc_url, prompts, args.max_tokens, args.concurrency, **params)
        runs[name] = {"method": method, "draft_tree": tree, "wall_s": wall, "per_prompt": c1,
                      "concurrent_ids": [p["ids"] for p in c8]}

    def part(name: str, set_name: str) -> list[dict]:  # a setting's prompts of one set
        start = 0
        for s, ps in sets.items():
            if s == set_name:
                return runs[name]["per_prompt"][start : start + len(ps)]
            start += len(ps)
        raise KeyError(set_name)

    rate = lambda p: len(p["ids"]) / p["seconds"]  # noqa: E731 - tokens/s of one prompt
    default = GenerateSettings.default_speculative_method
    table, goals = {}, []
    print(f"\n{'set':10} {'setting':14} {'tok/step':>8} {'nodes/step':>10} {'tokens/s':>9} {'x none':>7}")
    for set_name in sets:
        base = summary(part("none", set_name))
        for name in runs:
            s = summary(part(name, set_name))
            s["x_none"] = s["tokens_per_s"] / base["tokens_per_s"]
            table[f"{set_name}:{name}"] = s
            print(f"{set_name:10} {name:14} {s['tokens_per_step']:8.2f} {s['nodes_per_step']:10.2f} "
                  f"{s['tokens_per_s']:9.2f} {s['x_none']:7.2f}")
        if "auto:tree" in runs:  # auto's steps by the shape it chose (a method's chains, or its trees of a width)
            shapes = dict(sum((Counter(p.get("auto_shapes", {})) for p in part("auto:tree", set_name)), Counter()))
            table[f"{set_name}:auto:tree"]["auto_shapes"] = shapes
            print(f"{'':10} auto's steps by shape: {shapes}")
        for method in args.methods.split(","):
            chain, tree = table[f"{set_name}:{method}:chain"], table[f"{set_name}:{method}:tree"]
            if method == "auto":  # auto choosing the shape against the best fixed setting and against none
                fixed = max((n for n in runs if n.split(":")[0] not in ("auto", "none")),
                            key=lambda n: table[f"{set_name}:{n}"]["tokens_per_s"], default=None)
                if fixed is not None:
                    goals.append({"goal": f"{set_name}: auto (trees allowed) >= the best fixed setting ({fixed}) in "
                                          "tokens/s", "target": 1.0,
                                  "value": tree["tokens_per_s"] / table[f"{set_name}:{fixed}"]["tokens_per_s"]})
                worst = min(rate(a) / rate(b) for a, b in zip(part("auto:tree", set_name), part("none", set_name)))
                goals.append({"goal": f"{set_name}: no prompt of auto (trees allowed) below 0.98x none",
                              "value": worst, "target": 0.98})
                continue
            target = TREE_GOALS.get(method, 1.3)
            goals.append({"goal": f"{set_name}: {method} trees >= {target}x the tokens per step of chains "
                                  f"({args.nodes} nodes)", "value": tree["tokens_per_step"] / chain["tokens_per_step"],
                          "target": target})
            goals.append({"goal": f"{set_name}: {method} trees' tokens/s >= chains' (not slower)",
                          "value": tree["tokens_per_s"] / chain["tokens_per_s"], "target": 1.0})
        if f"{default}:tree" in runs:
            goals.append({"goal": f"{set_name}: the default method ({default}, trees) >= 2.0x none",
                          "value": table[f"{set_name}:{default}:tree"]["x_none"], "target": 2.0})
            worst = min(rate(a) / rate(b) for a, b in zip(part(f"{default}:tree", set_name), part("none", set_name)))
            goals.append({"goal": f"{set_name}: no prompt of {default} (trees) below 0.98x none", "value": worst,
                          "target": 0.98})
    ref = [p["ids"] for p in runs["none"]["per_prompt"]]
    differ = {}
    for name, r in runs.items():
        differ[f"{name} c=1"] = [i for i, p in enumerate(r["per_prompt"]) if p["ids"] != ref[i]]
        differ[f"{name} c={args.concurrency}"] = [i for i, ids in enumerate(r["concurrent_ids"]) if ids != ref[i]]
    goals.append({"goal": "every setting and concurrency gives none's greedy tokens (prompts differing)",
                  "value": sum(len(v) for v in differ.values()), "target": 0, "lower_is_better": True,
                  "differing": differ})
    for g in goals:
        g["reached"] = g["value"] <= g["target"] if g.get("lower_is_better") else g["value"] >= g["target"]
        print(f"{'REACHED' if g['reached'] else 'missed '}  {g['goal']}: {g['value']:.2f} (target {g['target']})")
    import torch

    from spec_decode.engine.dtype_choice import choose_dtype

    result = {
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
                    "dtype": os.environ.get("DTYPE", "auto"), "auto": str(choose_dtype("auto", torch.device("cpu")))},
        "sets": {k: len(v) for k, v in sets.items()}, "max_tokens": args.max_tokens, "nodes": args.nodes,
        "min_token_prob": args.min_token_prob,
        "table": table, "goals": goals, "runs": runs,
    }
    args.output.write_text(json.dumps(result, indent=1))
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
