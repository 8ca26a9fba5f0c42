"""What the logits processors cost a speculative step: every processor on against off, in one process, in one run.

The three step models' backends run exactly as the ensemble runs them (:class:`spec_decode.serving.local_ensemble.
LocalEnsemble`: draft_model -> target_model -> verifier, each round one batched call per model) on the embedded
target, method ``suffix`` with k = 4. For greedy and sampled requests and B = 1 and 8 concurrent sequences, HumanEval
prompts are decoded once with every processor on (repetition, presence and frequency penalties, min_tokens, two bad
words, a JSON-schema guide, top-5 log-probs with the raw log-prob rows), recording each round's inputs; the recorded
rounds are then replayed, from cold caches, without the processors and with them, alternating repeat by repeat, so
both score exactly the same positions and machine noise hits both alike. The per-step time is a replay's mean time per
round (prefill included, as in serving). Goal: on / off <= 1.10.

Then the grammar mask alone (:meth:`spec_decode.processors.grammar.GrammarCache.masks`, k = 4: five rows) per step per
sequence, median over a walk through a JSON document; goal <= 1 ms on this CPU.

    python -m bench.processors [--tokens 32] [--repeats 3] [--output results/processors.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
                                                                               "items": {"type": "string"}}},
          "required": ["name", "tags"]}
ON = dict(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2, min_tokens=16,
          bad_words=("import", "foo"), guided_decoding_guide_type="json_schema",
          guided_decoding_guide=json.dumps(SCHEMA), top_logprobs=5, return_log_probs=True)


def record(ens, tokenizer, eos_ids, prompts, tokens, sampled, seq0) -> list[list]:
    """Decode ``prompts`` together with every processor on (so the trajectory is one the processors allow), one round
    per step; returns each round's step inputs."""
    from spec_decode.generation import Generation
    from spec_decode.request import GenerationRequest

    kw = dict(temperature=0.8, top_p=0.95, random_seed=1) if sampled else {}
    gens = []
    for i, prompt in enumerate(prompts):
        req = GenerationRequest(prompt, tokens, speculative_method="suffix", num_draft_tokens=4, **kw, **ON)
        gens.append(Generation(seq0 + i, tokenizer(prompt)["input_ids"], req, tokenizer, eos_ids, 2048,
                               kw.get("random_seed", 0)))
    rounds = []
    while any(not g.finished for g in gens):
        live = [g for g in gens if not g.finished]
        inps = [g.next_step() for g in live]
        rounds.append(inps)
        for g, r in zip(live, ens.run_round(inps)):
            g.commit(r)
    ens.release([g.next_step() for g in gens])
    return rounds


def replay(ens, rounds, on: bool) -> float:
    """Run the recorded rounds again (the same token ids, k and drafts), with the processors or without; returns the
    mean seconds per round. The sequences' caches start cold and are freed at the end, as in the recording."""
    seconds = 0.0
    for inps in rounds:
        inps = [replace(i, processors=i.processors if on else None) for i in inps]
        t0 = time.perf_counter()
        ens.run_round(inps)
        seconds += time.perf_counter() - t0
    last = {i.seq_id: i for inps in rounds for i in inps}  # each sequence's last step inputs
    ens.release(list(last.values()))
    return seconds / max(1, len(rounds))


def grammar_mask_ms(tokenizer, vocab_size: int, k: int = 4, calls: int = 200) -> float:
    """Median ms of one step's masks (k drafts, k+1 rows) for one sequence, walking a JSON document that fits SCHEMA."""
    from spec_decode.processors.grammar import GrammarCache

    cache = GrammarCache(tokenizer, vocab_size)
    doc = json.dumps({"name": "benchmark", "tags": [f"tag number {i}" for i in range(200)]})
    ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
    guide = json.dumps(SCHEMA)
    times = []
    for i in range(calls):
        at = len(ids) // 4 + i
        t0 = time.perf_counter()
        cache.masks(1, "json_schema", guide, ids[:at], ids[at:at + k], [tokenizer.eos_token_id])
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    """Measure; print a table and the goals; save JSON."""
    from client.datasets import humaneval_prompts
    from spec_decode.engine.model_loading import load_tokenizer, prepare_default_model
    from spec_decode.serving.draft_model import DraftBackend
    from spec_decode.serving.generate import end_token_ids
    from spec_decode.serving.local_ensemble import LocalEnsemble
    from spec_decode.serving.target_model import TargetBackend
    from spec_decode.serving.verifier_model import VerifierBackend

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--repeats", type=int, default=3, help="off/on pairs per configuration")
    ap.add_argument("--output", type=Path, default=Path("results/processors.json"))
    args = ap.parse_args(argv)

    path = prepare_default_model()
    tokenizer = load_tokenizer(path)
    eos_ids = end_token_ids(tokenizer, path)
    # no global suffix tree: a replay's drafts are the recording's (they depend on the token ids alone)
    ens = LocalEnsemble(DraftBackend({"draft_model_path": "", "speculator_path": "", "device": "cpu",
                                      "suffix_max_cached_requests": "0"}),
                        TargetBackend({"model_path": str(path), "device": "cpu"}),
                        VerifierBackend({"backend": "torch"}))
    prompts = humaneval_prompts(8)
    rows = []
    print(f"{'mode':<8}{'B':>3}{'off ms/step':>13}{'on ms/step':>12}{'on/off':>8}")
    for sampled in (False, True):
        for b in (1, 8):
            per: dict[bool, list[float]] = {False: [], True: []}
            rounds = record(ens, tokenizer, eos_ids, prompts[:b], args.tokens, sampled, 1000 * (b + sampled))
            replay(ens, rounds, True)  # warm-up
            for _ in range(args.repeats):
                for on in (False, True):
                    per[on].append(replay(ens, rounds, on) * 1000)
            off, on_ms = statistics.median(per[False]), statistics.median(per[True])
            rows.append({"mode": "sampled" if sampled else "greedy", "batch": b, "k": 4, "off_ms_per_step": off,
                         "on_ms_per_step": on_ms, "ratio": on_ms / off})
            print(f"{rows[-1]['mode']:<8}{b:>3}{off:>13.1f}{on_ms:>12.1f}{on_ms / off:>8.2f}", flush=True)
    mask_ms = grammar_mask_ms(tokenizer, ens.target.lm.vocab_size)
    worst = max(r["ratio"] for r in rows)
    print(f"grammar mask (k = 4, one sequence): {mask_ms:.3f} ms per step (goal <= 1 ms: "
          f"{'reached' if mask_ms <= 1 else 'NOT reached'})")
    print(f"every processor on / off, worst: {worst:.2f}x (goal <= 1.10x: "
          f"{'reached' if worst <= 1.10 else 'NOT reached'})")
    out = {"machine": platform.processor() or platform.machine(), "python": sys.version.split()[0],
           "tokens": args.tokens, "repeats": args.repeats, "processors_on": ON,
           "steps": rows, "grammar_mask_ms_per_step_k4": mask_ms}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2))
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
