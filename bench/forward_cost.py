"""Forward cost against the number of new positions: what a speculative step's scoring pass costs (``make bench``).

Speculation pays only if scoring k+1 positions costs about what one position costs (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding", section 3: the step's cost ratio c). In one process, in one run,
with every variant's forwards interleaved (these machines are shared and noisy: ratios are taken between numbers
measured side by side):

1. The read bandwidth: summing a 512 MB float32 array (median of repeats), GB/s.
2. For the target and the draft LM (the distilled draft of ``make draft`` when it exists, else a model of the same
   shape: the target's first 3 layers over an 8,192-token vocabulary, untrained; timing does not depend on weights), on
   300- and 1,500-token caches, for 1, 2, 3, 5, 9 and 17 new positions:
   - ``transformers``: the model as transformers runs it (``nn.Linear``, a DynamicCache cropped back after each call);
   - ``engine``: what the server runs, :class:`spec_decode.engine.kv_cache.CachedCausalLM` (pages of a paged KV pool,
     rounds at padded static shapes), through ``logits`` with the cached prefix.
   Each as milliseconds (median), ratio to one position of the same variant, and ratio to the roofline (the bytes of
   the weights a forward reads, at the measured bandwidth).
3. Batched rounds (engine, target): B = 1, 2, 4, 8 sequences on 300-token caches, each scoring k+1 = 1, 2, 3, 5, 9
   positions in one ``logits_batch`` forward; the ratio to the same round with one position per sequence.

4. Prefill chunks (target): chunks of 64, 192 and 512 new positions after 0, 500 and 1,500 cached ones, fresh random
   tokens each time (no prefix cache helps), ``transformers`` against ``engine``: what chunked prefill costs the
   running streams per round.

Each part in the dtype of ``--dtype`` (float32, bfloat16, or both one after the other; in bfloat16 on a CPU the engine
runs its batch-invariant forward, spec_decode.engine.invariant_attention). Prints tables and the goals (n <= 9 within
1.15x one position, 5 within 1.15x and 17 within 1.3x; one position within 1.3x the roofline; the engine's forward no
slower than transformers' at every cache length, position count and chunk), saves JSON.

    python -m bench.forward_cost --dtype both --output results/forward_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

NEW_POSITIONS = (1, 2, 3, 5, 9, 17)
CACHE_LENGTHS = (300, 1500)
BATCH_SIZES = (1, 2, 4, 8)
ROWS_PER_SEQUENCE = (1, 2, 3, 5, 9)
CHUNKS = (64, 192, 512)
CHUNK_CONTEXTS = (0, 500, 1500)


def read_bandwidth_gb_s(megabytes: int = 512, repeats: int = 7) -> float:
    """Read bandwidth in GB/s (1e9 bytes/s): median time to sum a ``megabytes`` MB float32 array."""
    a = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    a.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t0)
    return a.numel() * 4 / statistics.median(times) / 1e9


def weight_bytes(model) -> int:
    """Bytes of weights one forward reads: every distinct parameter, less an input embedding table that is not also
    the LM head (a lookup reads only its rows)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if emb is not head:
        total -= emb.numel() * emb.element_size()
    return total


def draft_model(target, draft_dir: Path | None):
    """The draft LM to time: the distilled draft (``draft_dir``), else the target's first 3 layers over an 8,192-token
    vocabulary (untrained: timing does not depend on weights).

    Returns:
        (model in eval mode, float32 on the CPU; a description of which it is).
    """
    from spec_decode.engine.draft_vocab import DraftVocab
    from spec_decode.engine.model_loading import load_causal_lm
    from spec_decode.engine.surgery import prune_vocabulary, truncated_copy

    if draft_dir is not None:
        return load_causal_lm(draft_dir, torch.device("cpu"), torch.float32), "distilled draft"
    draft = truncated_copy(target, 3)
    prune_vocabulary(draft, DraftVocab(torch.arange(8192), target.config.vocab_size))
    return draft.eval(), ("untrained stand-in (3 target layers, 8,192-token vocabulary; "
                          "run `make draft` for the real one)")


class _Transformers:
    """Plain transformers: one DynamicCache per cache length, cropped back after every call."""

    def __init__(self, model, prompts: dict[int, list[int]]):
        from transformers import DynamicCache

        from spec_decode.engine.kv_pool import cache_keyword

        self.model, self.caches, self.kw = model, {}, cache_keyword(model)
        with torch.inference_mode():
            for c, ids in prompts.items():
                cache = DynamicCache(config=model.config)
                model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1, **{self.kw: cache})
                self.caches[c] = cache

    @torch.inference_mode()
    def __call__(self, c: int, new: list[int]) -> None:
        self.model(input_ids=torch.tensor([new]), use_cache=True, logits_to_keep=len(new), **{self.kw: self.caches[c]})
        self.caches[c].crop(-len(new))


class _Engine:
    """The server's engine: CachedCausalLM.logits with the prompt cached (each call crops back the previous drafts)."""

    def __init__(self, lm, prompts: dict[int, list[int]]):
        self.lm, self.prompts = lm, prompts
        for c, ids in prompts.items():
            lm.logits(c, ids, 1)

    def __call__(self, c: int, new: list[int]) -> None:
        self.lm.logits(c, self.prompts[c] + new, len(new))


def time_single(variants: dict, vocab: int, repeats: int, gen: torch.Generator) -> dict:
    """Median seconds of one forward per (variant, cache length, new positions), every configuration interleaved
    within each of ``repeats`` passes (after one warm-up pass).

    Args:
        variants: name -> callable(cache length, new token ids) running one forward (:class:`_Transformers`,
            :class:`_Engine`).
        vocab: new token ids are drawn from [0, ``vocab``) with ``gen``.
    """
    times = {(v, c, n): [] for v in variants for c in CACHE_LENGTHS for n in NEW_POSITIONS}
    for rep in range(repeats + 1):
        for c in CACHE_LENGTHS:
            for n in NEW_POSITIONS:
                new = torch.randint(0, vocab, (n,), generator=gen).tolist()
                for name, fn in variants.items():
                    t0 = time.perf_counter()
                    fn(c, new)
                    if rep:  # the first pass warms up
                        times[(name, c, n)].append(time.perf_counter() - t0)
    return {key: statistics.median(ts) for key, ts in times.items()}


def time_batched(lm, prompts: list[list[int]], vocab: int, repeats: int, gen: torch.Generator) -> dict:
    """Median seconds of a ``logits_batch`` round of ``lm`` (a CachedCausalLM) per (sequences B, rows per sequence
    k+1), over ``repeats`` passes after one warm-up pass; ``prompts`` (token ids) are cached first, one per sequence."""
    for i, ids in enumerate(prompts):
        lm.logits(1000 + i, ids, 1)
    times = {(b, r): [] for b in BATCH_SIZES for r in ROWS_PER_SEQUENCE}
    for rep in range(repeats + 1):
        for b in BATCH_SIZES:
            for r in ROWS_PER_SEQUENCE:
                calls = [(1000 + i, prompts[i] + torch.randint(0, vocab, (r,), generator=gen).tolist(), r)
                         for i in range(b)]
                t0 = time.perf_counter()
                lm.logits_batch(calls)
                if rep:
                    times[(b, r)].append(time.perf_counter() - t0)
    return {key: statistics.median(ts) for key, ts in times.items()}


def time_chunks(plain, engine, vocab: int, repeats: int, gen: torch.Generator) -> dict:
    """Median seconds of one prefill chunk per (variant, cached positions c, chunk n): ``transformers`` (``plain``
    with a DynamicCache filled with c positions first) and ``engine`` (``engine``, a CachedCausalLM, with a sequence
    holding them), both asked for the chunk's last logits only; fresh random tokens per repeat, every configuration
    interleaved, after one warm-up pass."""
    from transformers import DynamicCache

    from spec_decode.engine.kv_pool import cache_keyword

    kw = cache_keyword(plain)
    times: dict = {(v, c, n): [] for v in ("transformers", "engine") for c in CHUNK_CONTEXTS for n in CHUNKS}
    for rep in range(repeats + 1):
        for c in CHUNK_CONTEXTS:
            for n in CHUNKS:
                ids = torch.randint(0, vocab, (c + n,), generator=gen).tolist()
                with torch.inference_mode():
                    cache = DynamicCache(config=plain.config)
                    if c:
                        plain(input_ids=torch.tensor([ids[:c]]), use_cache=True, logits_to_keep=1, **{kw: cache})
                    t0 = time.perf_counter()
                    plain(input_ids=torch.tensor([ids[c:]]), use_cache=True, logits_to_keep=1, **{kw: cache})
                    t_hf = time.perf_counter() - t0
                seq = 10_000 + rep
                if c:
                    engine.logits(seq, ids[:c], 1)
                t0 = time.perf_counter()
                engine.logits(seq, ids, 1)
                t_engine = time.perf_counter() - t0
                engine.release(seq)
                if rep:
                    times[("transformers", c, n)].append(t_hf)
                    times[("engine", c, n)].append(t_engine)
    return {key: statistics.median(ts) for key, ts in times.items()}


def _goal(goal: str, value: float, bound: float, worst: str) -> dict:
    """A goal's entry: reached when ``value`` <= ``bound``; ``worst`` names where the value was measured."""
    return {"goal": goal, "value": value, "reached": value <= bound, "worst": worst}


def measure(dtype: torch.dtype, path: Path, bandwidth: float, repeats: int, gen: torch.Generator) -> tuple[dict, list]:
    """Parts 2-4 of the module docstring in ``dtype``; prints the tables. Returns (models: label -> tables, goals)."""
    from spec_decode.engine.kv_cache import CachedCausalLM
    from spec_decode.engine.model_loading import load_causal_lm
    from spec_decode.proposers.draft_lm import default_draft_dir, default_draft_ready

    name = str(dtype).removeprefix("torch.")
    target = load_causal_lm(path, torch.device("cpu"), dtype)
    draft_dir = default_draft_dir() if default_draft_ready() else None
    draft, draft_kind = draft_model(target, draft_dir)
    draft = draft.to(dtype)
    models, goals = {}, []
    for label, plain, kind in (("target", target, str(path.name)), ("draft", draft, draft_kind)):
        vocab = int(plain.config.vocab_size)
        prompts = {c: torch.randint(0, vocab, (c,), generator=gen).tolist() for c in CACHE_LENGTHS}
        if label == "target":  # the engine gets its own copy of the same weights
            engine_model = load_causal_lm(path, torch.device("cpu"), dtype)
        else:
            engine_model = draft_model(target, draft_dir)[0].to(dtype)
        engine = CachedCausalLM(engine_model, max_sequences=64)
        variants = {"transformers": _Transformers(plain, prompts), "engine": _Engine(engine, prompts)}
        print(f"\n{label} in {name}: {kind}; {weight_bytes(plain) / 1e6:.0f} MB of weights per forward; timing "
              f"{len(NEW_POSITIONS)} position counts x {len(CACHE_LENGTHS)} caches ...", flush=True)
        single = time_single(variants, vocab, repeats, gen)
        roofline_s = weight_bytes(plain) / (bandwidth * 1e9)
        rows = []
        for v in variants:
            for c in CACHE_LENGTHS:
                one = single[(v, c, 1)]
                for n in NEW_POSITIONS:
                    t = single[(v, c, n)]
                    rows.append({"variant": v, "cache": c, "new_positions": n, "ms": 1000 * t,
                                 "vs_one_position": t / one, "vs_roofline": t / roofline_s,
                                 "vs_transformers": t / single[("transformers", c, n)]})
        print(f"{'variant':<14}{'cache':>6}" + "".join(f"{f'n={n}':>14}" for n in NEW_POSITIONS))
        for v in variants:
            for c in CACHE_LENGTHS:
                cells = [r for r in rows if r["variant"] == v and r["cache"] == c]
                print(f"{v:<14}{c:>6}" + "".join(f"{r['ms']:>7.1f} ({r['vs_one_position']:.2f})" for r in cells))
        print(f"roofline (weights at {bandwidth:.1f} GB/s): {1000 * roofline_s:.1f} ms; "
              + ", ".join(f"{v} one position {single[(v, 300, 1)] / roofline_s:.2f}x" for v in variants))
        entry = {"kind": kind, "weight_bytes": weight_bytes(plain), "roofline_ms": 1000 * roofline_s,
                 "batch_invariant": engine.batch_invariant, "single": rows}
        if label == "target":
            print(f"batched rounds (engine, target, {CACHE_LENGTHS[0]}-token caches): ms (ratio to 1 row per sequence)",
                  flush=True)
            seq_prompts = [torch.randint(0, vocab, (CACHE_LENGTHS[0],), generator=gen).tolist()
                           for _ in range(max(BATCH_SIZES))]
            batched = time_batched(engine, seq_prompts, vocab, max(3, repeats - 2), gen)
            brows = [{"sequences": b, "rows_per_sequence": r, "ms": 1000 * batched[(b, r)],
                      "vs_one_row_per_sequence": batched[(b, r)] / batched[(b, 1)],
                      "vs_one_position": batched[(b, r)] / batched[(1, 1)]} for b in BATCH_SIZES
                     for r in ROWS_PER_SEQUENCE]
            print(f"{'B':>3}" + "".join(f"{f'k+1={r}':>15}" for r in ROWS_PER_SEQUENCE))
            for b in BATCH_SIZES:
                print(f"{b:>3}" + "".join(f"{x['ms']:>8.1f} ({x['vs_one_row_per_sequence']:.2f})"
                                          for x in brows if x["sequences"] == b))
            entry["batched"] = brows
            print("prefill chunks (target): ms, transformers | engine (engine / transformers)", flush=True)
            chunks = time_chunks(plain, engine, vocab, max(3, repeats // 3), gen)
            crows = [{"cache": c, "chunk": n, "transformers_ms": 1000 * chunks[("transformers", c, n)],
                      "engine_ms": 1000 * chunks[("engine", c, n)],
                      "vs_transformers": chunks[("engine", c, n)] / chunks[("transformers", c, n)]}
                     for c in CHUNK_CONTEXTS for n in CHUNKS]
            print(f"{'cache':>6}" + "".join(f"{f'chunk {n}':>26}" for n in CHUNKS))
            for c in CHUNK_CONTEXTS:
                cells = [x for x in crows if x["cache"] == c]
                print(f"{c:>6}" + "".join(f"{x['transformers_ms']:>8.0f} | {x['engine_ms']:>6.0f} "
                                          f"({x['vs_transformers']:.2f})" for x in cells))
            entry["chunks"] = crows
            engine_rows = [r for r in rows if r["variant"] == "engine"]
            worst = max((r for r in engine_rows if r["new_positions"] <= 9), key=lambda r: r["vs_one_position"])
            worst_b = max((x for x in brows if x["rows_per_sequence"] <= 9), key=lambda x: x["vs_one_row_per_sequence"])
            one = next(r for r in engine_rows if r["cache"] == 300 and r["new_positions"] == 1)
            slow = max(engine_rows, key=lambda r: r["vs_transformers"])
            slow_chunk = max(crows, key=lambda x: x["vs_transformers"])
            for n, bound in ((5, 1.15), (17, 1.3)):
                at = max((r for r in engine_rows if r["new_positions"] == n), key=lambda r: r["vs_one_position"])
                goals.append(_goal(f"{name}: target, {n} new positions <= {bound}x one position",
                                   at["vs_one_position"], bound, f"cache {at['cache']}"))
            goals += [
                _goal(f"{name}: target, one sequence: n <= 9 new positions <= 1.15x one position",
                      worst["vs_one_position"], 1.15, f"n={worst['new_positions']}, cache {worst['cache']}"),
                _goal(f"{name}: target, batched rounds: k+1 <= 9 rows per sequence <= 1.15x one row per sequence",
                      worst_b["vs_one_row_per_sequence"], 1.15,
                      f"B={worst_b['sequences']}, k+1={worst_b['rows_per_sequence']}"),
                _goal(f"{name}: target, one position <= 1.3x the roofline", one["vs_roofline"], 1.3, "cache 300"),
                _goal(f"{name}: target, the engine's forward <= 1.0x transformers' (every cache and n)",
                      slow["vs_transformers"], 1.0, f"n={slow['new_positions']}, cache {slow['cache']}"),
                _goal(f"{name}: target, the engine's prefill chunk <= 1.0x transformers' (every cache and chunk)",
                      slow_chunk["vs_transformers"], 1.0, f"chunk {slow_chunk['chunk']}, cache {slow_chunk['cache']}"),
            ]
        models[label] = entry
        del variants, engine, engine_model
    return models, goals


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the tables and goals; save JSON."""
    from spec_decode.engine.model_loading import prepare_default_model

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9, help="timed forwards per configuration (median; default 9)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="both",
                    help="the models' dtype (default both, float32 first)")
    ap.add_argument("--output", type=Path, default=Path("results/forward_cost.json"))
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    path = prepare_default_model()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    bandwidth = read_bandwidth_gb_s()
    print(f"read bandwidth: {bandwidth:.1f} GB/s (sum of a 512 MB array)", flush=True)
    result = {"bandwidth_gb_s": bandwidth, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "dtypes": {}}
    goals: list = []
    for name in (("float32", "bfloat16") if args.dtype == "both" else (args.dtype,)):
        models, dtype_goals = measure(getattr(torch, name), path, bandwidth, args.repeats, gen)
        result["dtypes"][name] = {"models": models}
        goals += dtype_goals
    result["goals"] = goals
    print("\ngoals:")
    for g in goals:
        print(f"  {'REACHED' if g['reached'] else 'not reached'}: {g['goal']}: {g['value']:.2f} ({g['worst']})")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"\nsaved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
