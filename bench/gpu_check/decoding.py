"""Part 3 of the GPU check: speculative decoding through the served backends, in process, against plain decoding.

The target is a Llama-architecture model with random weights (on CUDA about 1.2B parameters: 16 layers, hidden 2048,
vocabulary 128256; the embedded default model does not travel to the GPU machine), the draft LM its first two layers
with its embeddings and head (an early-exit draft), and the EAGLE head a random one over half of its vocabulary. They
are served in process by :class:`spec_decode.serving.local_ensemble.LocalEnsemble` (the three served backends, rows
stacked and padded as the Triton ensemble passes them), greedy, k = :data:`~bench.gpu_check.context.K_DECODE`. In
float32 every method's output at batch 1 and 8 must equal the target's plain greedy decoding by transformers'
``generate`` token for token; in bfloat16 the same comparison is reported, a divergence at a near-tie of the
reference's two best logits counted as such (bfloat16's rounding differs between a 1-position and a k+1-position
forward). Then the forward cost of 1-9 new positions on a 300-token cache (bfloat16 target), against one position.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from spec_decode.proposers.draft_lm import DraftModelProposer
from spec_decode.proposers.hybrid import HybridProposer
from spec_decode.proposers.registry import METHODS
from spec_decode.protocol import NO_SPECULATION, StepInputs
from spec_decode.sampling import SamplingParams

from .context import FORWARD_CACHE, FORWARD_NEW_POSITIONS, K_DECODE, Context

SELF = "self"
"""A pseudo-method: the draft LM proposer (``speculative_method=draft``) serving the target itself as its draft LM.
Its greedy drafts are the target's own argmax, so every one must be accepted: a check of the k+1-position scoring."""

# Every method the registry serves but hybrid, which only chooses between proposers run here on their own (suffix
# and its fallback) through the same draft_model path; then SELF.
DECODING_METHODS: tuple[str, ...] = (*(m for m in METHODS if m != HybridProposer.name), SELF)

# A divergence from the reference is a near-tie (numerics, not a bug) when the token emitted instead is the reference's
# second best there and the two best logits lie within this fraction of the largest |logit|: float32 GEMMs over 1 and
# over k+1 positions sum in different orders (~1e-6 relative); bfloat16 rounds each logit to 2^-8 relative.
TIE_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}


def build_models(ctx: Context, folder: Path) -> dict:
    """Save a random-weight Llama target (``ctx.sizes.llama``), its 2-layer early-exit draft (bfloat16 model folders)
    and a random EAGLE head over half of its vocabulary (as ``make speculator`` saves one) under ``folder``.

    Returns:
        dict: paths (``target``, ``draft``, ``eagle`` -> folder) and target_parameters (a count).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from spec_decode.engine.draft_vocab import DraftVocab
    from spec_decode.engine.surgery import truncated_copy
    from spec_decode.proposers.eagle import EagleHead, eagle_config

    llama, dev = ctx.sizes.llama, ctx.device
    torch.manual_seed(0)
    cfg = LlamaConfig(**llama, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    with torch.device(dev):
        target = LlamaForCausalLM(cfg)
        draft = truncated_copy(target, 2)
    paths = {"target": folder / "target", "draft": folder / "draft", "eagle": folder / "eagle"}
    vocab = DraftVocab(torch.arange(0, llama["vocab_size"], 2), llama["vocab_size"])
    emb = target.get_input_embeddings().weight.detach()[vocab.token_ids.to(dev)].cpu()
    head = target.get_output_embeddings().weight.detach()[vocab.token_ids.to(dev)].cpu()
    EagleHead(torch.cat([emb, emb.mean(0, keepdim=True)]), head, eagle_config(cfg)).save(paths["eagle"], vocab)
    for name, model in (("target", target), ("draft", draft)):
        model.to(torch.bfloat16).save_pretrained(paths[name])
    params = sum(p.numel() for p in target.parameters())
    del target, draft
    return {"paths": paths, "target_parameters": params}


def load_ensembles(ctx: Context, paths: dict, dtype: str) -> dict:
    """Method -> the LocalEnsemble that serves it: the served backends on ``ctx.device`` in ``dtype`` (``float32`` or
    ``bfloat16``) with the verifier backend ``ctx.verifier_backend``; one ensemble serves every registered method,
    another :data:`SELF`.

    Raises:
        FileNotFoundError: a folder of ``paths`` (see :func:`build_models`) that does not exist.
    """
    from transformers.utils import logging as hf_logging

    from spec_decode.serving.draft_model import DraftBackend
    from spec_decode.serving.local_ensemble import LocalEnsemble
    from spec_decode.serving.target_model import TargetBackend
    from spec_decode.serving.verifier_model import VerifierBackend

    hf_logging.disable_progress_bar()

    common = {"device": ctx.device.type, "dtype": dtype, "max_sequences": "64"}
    target = TargetBackend({**common, "model_path": str(paths["target"])})
    verifier = VerifierBackend({"num_threads": "0", "backend": ctx.verifier_backend})
    # the draft LMs draft every slot (a random-weight draft is never confident: the default 0.3 would draft nothing)
    suffix = {"suffix_backend": "python", "suffix_max_cached_requests": "64", "draft_min_token_prob": "0"}
    draft = DraftBackend({**common, **suffix, "draft_model_path": str(paths["draft"]),
                          "eagle_path": str(paths["eagle"]), "eagle_min_token_prob": "0"})
    self_draft = DraftBackend({**common, **suffix, "draft_model_path": str(paths["target"])})
    main = LocalEnsemble(draft, target, verifier)
    ensembles = {m: main for m in DECODING_METHODS if m != SELF}
    ensembles[SELF] = LocalEnsemble(self_draft, target, verifier)
    return ensembles


class _SeqIds:
    next = 1


def decode(ctx: Context, ensemble, method: str, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    """Greedy decoding of ``prompts`` (token ids) through ``ensemble``, ``batch`` sequences per round (lockstep, as
    generate's rounds), ``max_tokens`` new tokens each, k = :data:`K_DECODE` (0 for ``none``).

    The requests count as seeded, so suffix decoding drafts from each request's own tree only and no run learns from
    another's responses.

    Returns:
        dict: outputs (the new token ids per prompt), seconds (wall clock, device synchronised), steps (sequence
        steps), drafted and accepted (draft tokens).
    """
    params = SamplingParams(0.0, 0, 1.0, 0, seeded=True)
    served = DraftModelProposer.name if method == SELF else method
    k = 0 if method == NO_SPECULATION else K_DECODE
    outputs: list[list[int] | None] = [None] * len(prompts)
    steps, drafted, accepted = 0, 0, 0
    ctx.sync()
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        live = {}
        for i in range(first, min(first + batch, len(prompts))):
            live[i] = (_SeqIds.next, list(prompts[i]))
            _SeqIds.next += 1
        step = 0
        while live:
            order = list(live)
            inps = [StepInputs(live[i][0], live[i][1], k, served, params, step) for i in order]
            results = ensemble.run_round(inps)
            step += 1
            done = []
            for i, inp, r in zip(order, inps, results):
                steps += 1
                drafted += r.num_draft_tokens
                accepted += len(r.output_ids) - 1
                ids = live[i][1]
                ids += r.output_ids[: max_tokens - (len(ids) - len(prompts[i]))]
                if len(ids) - len(prompts[i]) >= max_tokens:
                    outputs[i] = ids[len(prompts[i]):]
                    done.append((i, inp))
            if done:
                ensemble.release([StepInputs(live[i][0], live[i][1], 0, served, params, step) for i, _ in done])
                for i, _ in done:
                    del live[i]
    ctx.sync()
    seconds = time.perf_counter() - start
    return {"outputs": outputs, "seconds": seconds, "steps": steps, "drafted": drafted, "accepted": accepted}


def reference(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The target's plain greedy decoding by transformers' ``generate`` (its own DynamicCache), one prompt at a time,
    exactly ``max_tokens`` new token ids each."""
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def divergence(model, prompt: list[int], ref: list[int], got: list[int], dtype: str) -> dict:
    """Where ``got`` first differs from ``ref``: the gap between the reference's two best logits there (a plain
    forward of prompt + reference prefix), the rank of the token emitted instead, and whether that is a near-tie
    (:data:`TIE_TOLERANCE` of ``dtype``).

    Returns:
        dict: position, top2_logit_gap, scale (the largest |logit|), emitted_rank, near_tie.
    """
    i = next(j for j, (a, b) in enumerate(zip(ref, got)) if a != b)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + ref[:i]], device=model.device)).logits[0, -1].float()
    top = torch.topk(logits, 2)
    gap, scale = float(top.values[0] - top.values[1]), float(logits.abs().max())
    rank = int((logits > logits[got[i]]).sum())
    return {"position": i, "top2_logit_gap": gap, "scale": scale, "emitted_rank": rank,
            "near_tie": rank == 1 and gap <= TIE_TOLERANCE[dtype] * scale}


def make_prompts(n: int, length: int, vocab: int, seed: int = 6) -> list[list[int]]:
    """``n`` token-id prompts of ``length`` ids in [3, ``vocab``), with repetition inside each (a phrase said twice,
    as code repeats names)."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        phrase = torch.randint(3, vocab, (length // 4,), generator=g).tolist()
        rest = torch.randint(3, vocab, (length - 2 * len(phrase),), generator=g).tolist()
        prompts.append(phrase + rest[: len(rest) // 2] + phrase + rest[len(rest) // 2:])
    return prompts


def forward_cost(ctx: Context, lm) -> dict:
    """Milliseconds of one forward of ``lm`` (a :class:`spec_decode.engine.kv_cache.CachedCausalLM`) over n new
    positions (:data:`FORWARD_NEW_POSITIONS`) on a :data:`FORWARD_CACHE`-token cache, median of ``ctx.sizes.reps``.

    Returns:
        dict: cache_tokens, ms (n -> milliseconds), ratio_to_one (n -> ms / ms of n = 1).
    """
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, lm.vocab_size, (FORWARD_CACHE + max(FORWARD_NEW_POSITIONS),), generator=g).tolist()
    seq = 10**9
    lm.logits(seq, ids[:FORWARD_CACHE], 1)
    res = {}
    for n in FORWARD_NEW_POSITIONS:  # the cache keeps the first FORWARD_CACHE tokens; each call recomputes n
        res[n] = ctx.timed(partial(lm.logits, seq, ids[:FORWARD_CACHE + n], n), ctx.sizes.reps) * 1e3
    lm.release(seq)
    return {"cache_tokens": FORWARD_CACHE, "ms": res, "ratio_to_one": {n: res[n] / res[1] for n in res}}


def decoding(ctx: Context, deadline: float) -> dict:
    """Part 3: greedy equality of every method of :data:`DECODING_METHODS` with plain decoding, tokens/s, forward
    cost. Runs that would start after ``deadline`` (a ``time.perf_counter()`` value) are reported as skipped.

    Returns:
        dict: target_parameters, config, k, max_tokens, prompts, verifier_backend, note, runs (per dtype, batch and
        method: sequences, tokens, seconds, tokens_per_s, mean_tokens_per_step, acceptance_rate,
        equal_to_plain_greedy, mismatched_sequences, and divergences where any; or skipped) and forward_cost.
    """
    s = ctx.sizes
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_models_"))
    try:
        built = build_models(ctx, folder)
        prompts = make_prompts(s.prompts, s.prompt_len, s.llama["vocab_size"])
        res = {"target_parameters": built["target_parameters"], "config": s.llama, "k": K_DECODE,
               "max_tokens": s.max_tokens, "prompts": len(prompts), "runs": []}
        res["verifier_backend"] = ctx.verifier_backend
        res["note"] = ("random weights; speeds are overhead checks of the step path (transformers' eager forward is "
                       "bound by kernel launches at these sizes), not what a trained model would reach")
        warm = make_prompts(1, s.prompt_len, s.llama["vocab_size"], seed=99)
        for dtype in ("float32", "bfloat16"):
            if time.perf_counter() > deadline:
                res["runs"].append({"dtype": dtype, "skipped": "time budget"})
                continue
            ens = load_ensembles(ctx, built["paths"], dtype)
            model = ens[NO_SPECULATION].target.lm.model
            # warm-up: CUDA context, cuBLAS, every kernel specialization a method launches
            for method in DECODING_METHODS:
                for batch in (1, 2):
                    decode(ctx, ens[method], method, warm * batch, batch, max_tokens=6)
            ref = reference(model, prompts, s.max_tokens)
            for batch in (1, 8):
                use = prompts if batch > 1 else prompts[: max(2, len(prompts) // 2)]
                for method in DECODING_METHODS:
                    if time.perf_counter() > deadline:
                        res["runs"].append({"dtype": dtype, "batch": batch, "method": method,
                                            "skipped": "time budget"})
                        continue
                    r = decode(ctx, ens[method], method, use, batch, s.max_tokens)
                    tokens = s.max_tokens * len(use)
                    mismatched = [i for i, (a, b) in enumerate(zip(ref, r["outputs"])) if a != b]
                    run = {"dtype": dtype, "batch": batch, "method": method, "sequences": len(use),
                           "tokens": tokens, "seconds": r["seconds"], "tokens_per_s": tokens / r["seconds"],
                           "mean_tokens_per_step": tokens / r["steps"] if r["steps"] else 0.0,
                           "acceptance_rate": r["accepted"] / r["drafted"] if r["drafted"] else None,
                           "equal_to_plain_greedy": not mismatched, "mismatched_sequences": len(mismatched)}
                    if mismatched:
                        d = [divergence(model, prompts[i], ref[i], r["outputs"][i], dtype) for i in mismatched]
                        run["divergences"] = d
                        run["divergences_at_near_ties"] = all(x["near_tie"] for x in d)
                        if not run["divergences_at_near_ties"]:
                            ctx.fail(f"decoding {dtype} batch {batch} {method}: {len(mismatched)} sequences differ "
                                     f"from plain greedy decoding, not at a near-tie ({d[:2]})")
                    res["runs"].append(run)
                    print(f"  {dtype:<9} B={batch} {method:<7}{run['tokens_per_s']:>9.1f} tok/s  "
                          f"tokens/step {run['mean_tokens_per_step']:.2f}  equal {run['equal_to_plain_greedy']}",
                          flush=True)
            if dtype == "bfloat16" and time.perf_counter() < deadline:
                res["forward_cost"] = forward_cost(ctx, ens[NO_SPECULATION].target.lm)
                print(f"  forward cost (ms by new positions): {res['forward_cost']['ms']}", flush=True)
            del ens, model
            if ctx.cuda:
                torch.cuda.empty_cache()
        return res
    finally:
        shutil.rmtree(folder, ignore_errors=True)
