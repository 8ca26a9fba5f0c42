"""Greedy agreement of the server's engine with transformers ``generate`` (``make bench``).

The engine (:class:`spec_decode.engine.kv_cache.CachedCausalLM`: its own KV buffers, an explicit 4D mask and position
ids) computes the same maths as transformers, but not necessarily in the same floating-point order, so logits can
differ in the last bits; greedy decoding can then diverge where the top two logits are that close. For the held-out
HumanEval prompts 0..N-1, up to M greedy tokens each, stopping at EOS (``min_new_tokens`` would make transformers mask
EOS, which is not the same argmax walk): transformers ``generate(do_sample=False)`` against the engine's argmax walk
(one position per step, as ``speculative_method=none`` serves), and the engine scoring transformers' tokens k+1 = 5 at
a time (as a speculative step does). Reports per prompt the first position where they differ (if any) and the gap
between the top two logits there; saves JSON.

    python -m bench.greedy_agreement --output results/greedy_agreement.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; print a table; save JSON."""
    from client.datasets import humaneval_prompts
    from spec_decode.engine.kv_cache import CachedCausalLM
    from spec_decode.engine.model_loading import load_causal_lm, load_tokenizer, prepare_default_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--output", type=Path, default=Path("results/greedy_agreement.json"))
    args = ap.parse_args(argv)
    path = prepare_default_model()
    tok = load_tokenizer(path)
    model = load_causal_lm(path, torch.device("cpu"), torch.float32)
    engine = CachedCausalLM(load_causal_lm(path, torch.device("cpu"), torch.float32))
    rows = []
    for i, prompt in enumerate(humaneval_prompts(args.prompts)):
        ids = tok(prompt)["input_ids"]
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        hf = out.sequences[0, len(ids):].tolist()
        hf = hf[: hf.index(tok.eos_token_id) + 1] if tok.eos_token_id in hf else hf
        hf_scores = torch.stack(out.scores)[:, 0]  # [tokens, V] logits of each greedy choice
        seq = list(ids)
        first, gap = None, None
        for t in range(args.tokens):  # the engine's own argmax walk, to EOS
            logits = engine.logits(i, seq, 1)[0]
            nxt = int(logits.argmax())
            if first is None and (t >= len(hf) or nxt != hf[t]):
                top2 = torch.topk(logits.float(), 2).values
                first, gap = t, float(top2[0] - top2[1])
            seq.append(nxt)
            if nxt == tok.eos_token_id:
                break
        engine.release(i)
        # A speculative step's view: the engine scores transformers' tokens 5 positions at a time.
        scored_first = None
        full = list(ids) + hf
        for start in range(0, len(hf), 5):
            n = min(5, len(hf) - start)
            logits = engine.logits(1000 + i, full[: len(ids) + start + n - 1], n)  # row j predicts hf[start + j]
            picks = logits.argmax(-1).tolist()
            for j, p in enumerate(picks):
                if scored_first is None and p != hf[start + j]:
                    scored_first = start + j
        engine.release(1000 + i)
        hf_gap = None
        if first is not None and first < len(hf):
            top2 = torch.topk(hf_scores[first].float(), 2).values
            hf_gap = float(top2[0] - top2[1])
        rows.append({"prompt": i, "first_difference": first, "engine_top2_gap": gap, "transformers_top2_gap": hf_gap,
                     "tokens": len(hf),
                     "differing_tokens": 0 if first is None else max(len(hf), len(seq) - len(ids)) - first,
                     "scored_5_at_a_time_first_difference": scored_first})
        print(f"prompt {i:>2}: " + ("equal" if first is None else
                                    f"differs from token {first} (top-2 gap {gap:.2e} engine, {hf_gap} transformers)")
              + ("" if scored_first is None else f"; 5-position scoring differs at {scored_first}"), flush=True)
    equal = sum(r["first_difference"] is None for r in rows)
    result = {"prompts": args.prompts, "tokens": args.tokens, "equal_prompts": equal,
              "differing_tokens": sum(r["differing_tokens"] for r in rows),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows}
    print(f"\n{equal} of {args.prompts} prompts token-for-token equal (up to {args.tokens} tokens or EOS); "
          f"{result['differing_tokens']} of {sum(r['tokens'] for r in rows)} tokens differ "
          "(from the first difference on)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
