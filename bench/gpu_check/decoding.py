"""Part 3 of the GPU check: speculative decoding through the served backends, in process, against plain decoding.

The target is a Llama-architecture model with random weights (on CUDA about 1.2B parameters: 16 layers, hidden 2048,
vocabulary 128256; the embedded default model does not travel to the GPU machine), the draft LM its first two layers
with its embeddings and head (an early-exit draft), and one random head of each published speculator layout of its sizes
(:mod:`.speculators`: EAGLE-1, EAGLE-3, Medusa, the MLP speculator, Arctic's LSTM), all served by one draft_model
through ``speculator_path`` (``target_model_path`` set; the target built with draft_model's parameters, so that it
returns the EAGLE-3 head's auxiliary hidden states). They are served in process by
:class:`spec_decode.serving.local_ensemble.LocalEnsemble` (the three served backends, rows stacked and padded as the
Triton ensemble passes them), greedy, k = :data:`~bench.gpu_check.context.K_DECODE`, each step bringing the hidden
states the previous one returned (as generate sends them). In float32 every method's output at batch 1 and 8 must equal
the target's plain greedy decoding by transformers' ``generate`` token for token; in bfloat16 the same comparison is
reported, a divergence at a near-tie of the reference's two best logits counted as such (bfloat16's rounding differs
between a 1-position and a k+1-position forward). Where the engine runs its batch-invariant forward (a CPU in bfloat16:
:mod:`spec_decode.engine.invariant_attention`) the reference is the engine's own plain decoding, which every method must
equal token for token, and plain decoding's divergences from transformers' are reported beside it. Each model proposer
must draft, at most k or its head's number of predicted positions per step and, drafting every slot, exactly that many
once it has hidden states. The heads' other published layouts (EAGLE-1 and Medusa as vLLM converts them, the MLP
speculator as Arctic's ``ArcticMLPSpeculatorPreTrainedModel``) must draft what the served ones draft from the same
states. Then the forward cost of 1-9 new positions on 300-token caches at batch 1 and 8 (target and early-exit draft),
the KV pool and the CUDA graphs each model captured at load (none in CPU mode: the same code runs eagerly), and the
forward's goals against the roofline (:func:`goals`)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np
import torch

from spec_decode.proposers.draft_lm import DraftModelProposer
from spec_decode.proposers.hybrid import HybridProposer
from spec_decode.proposers.registry import METHODS
from spec_decode.protocol import NO_SPECULATION, StepInputs
from spec_decode.sampling import SamplingParams

from ..forward_cost import weight_bytes
from .attention import attention_report
from .context import FORWARD_CACHE, FORWARD_NEW_POSITIONS, K_DECODE, Context
from .speculators import ALTERNATIVES, N_PREDICT, SERVED
from .sync_sentinel import round_syncs

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

KV_POOL_TOKENS = 16384
"""Each model's KV pool in this check (positions): 8 sequences of at most ~400 tokens, the forward cost's caches and
the released sequences' cached pages fit with room to spare."""

MEMORY_SLACK_MIB = 64
"""After a dtype's models are deleted (``del``, no ``gc.collect()``), CUDA memory still allocated beyond what was
allocated before they loaded fails the check above this many MiB: something holds a model, its pool or its graphs."""


def build_models(ctx: Context, folder: Path) -> dict:
    """Save a random-weight Llama target (``ctx.sizes.llama``), its 2-layer early-exit draft (bfloat16 model folders)
    and a random head of each published speculator layout of its sizes (:func:`.speculators.write_speculators`) under
    ``folder``.

    Returns:
        dict: paths (``target``, ``draft`` and the speculators' keys -> folder) and target_parameters (a count).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from spec_decode.engine.surgery import truncated_copy

    from .speculators import write_speculators

    llama, dev = ctx.sizes.llama, ctx.device
    torch.manual_seed(0)
    cfg = LlamaConfig(**llama, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    with torch.device(dev):
        target = LlamaForCausalLM(cfg)
        draft = truncated_copy(target, 2)
    paths = {"target": folder / "target", "draft": folder / "draft"}
    for name, model in (("target", target), ("draft", draft)):
        model.to(torch.bfloat16).save_pretrained(paths[name])
    # the heads share the target's weights as saved (bfloat16)
    embedding, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    assert isinstance(embedding, torch.Tensor) and isinstance(lm_head, torch.Tensor)
    paths |= write_speculators(folder / "speculators", llama, embedding, lm_head)
    params = sum(p.numel() for p in target.parameters())
    del target, draft
    return {"paths": paths, "target_parameters": params}


def load_ensembles(ctx: Context, paths: dict, dtype: str, with_self: bool = True) -> dict:
    """Method -> the LocalEnsemble that serves it: the served backends on ``ctx.device`` in ``dtype`` (``float32`` or
    ``bfloat16``) with the verifier backend ``ctx.verifier_backend``; one ensemble serves every registered method
    (the draft LM and every head of :data:`.speculators.SERVED` in one draft_model), another :data:`SELF` (unless not
    ``with_self``: it loads a second copy of the target).

    Raises:
        FileNotFoundError: a folder of ``paths`` (see :func:`build_models`) that does not exist.
        SpeculatorLoadError: a head that does not load.
    """
    from transformers.utils import logging as hf_logging

    from spec_decode.serving.draft_model import DraftBackend
    from spec_decode.serving.local_ensemble import LocalEnsemble
    from spec_decode.serving.target_model import TargetBackend
    from spec_decode.serving.verifier_model import VerifierBackend

    hf_logging.disable_progress_bar()

    # 8 running sequences at most (the batches here): CUDA graphs captured for batches 1, 2, 4 and 8; a pool of what
    # the check needs (KV_POOL_TOKENS), not the served default; on CUDA a failed capture fails the load, naming the
    # shape (cuda_graphs: on), where serving would log it and run eagerly; on a CPU the rounds a graph would replay
    # run eagerly at the captured shapes (cuda_graphs: emulate): the captured branch's code; not in bfloat16 there,
    # whose batch-invariant forward pads a one-row product to more rows, which a captured shape does not
    graphs_mode = "on" if ctx.cuda else "emulate" if dtype == "float32" else "off"
    common = {"device": ctx.device.type, "dtype": dtype, "max_sequences": "8",
              "kv_cache_max_tokens": str(KV_POOL_TOKENS), "cuda_graphs": graphs_mode}
    # the draft LMs and the heads draft every slot (random weights are never confident: 0.3 would draft little)
    # tokenizer_path: the target's folder (no tokenizer in it, no guided rows here), not the embedded model's package
    suffix = {"suffix_backend": "python", "suffix_max_cached_requests": "64", "draft_min_token_prob": "0",
              "tokenizer_path": str(paths["target"])}
    draft_params = {**common, **suffix, "draft_model_path": str(paths["draft"]),
                    "speculator_path": ",".join(str(paths[m]) for m in SERVED),
                    "target_model_path": str(paths["target"]), "speculator_min_token_prob": "0"}
    target_params = {**common, "model_path": str(paths["target"])}
    # built with draft_model's parameters: it returns the EAGLE-3 head's layers beside its last hidden state
    target = TargetBackend(target_params, None, draft_params)
    verifier = VerifierBackend({"num_threads": "0", "backend": ctx.verifier_backend})
    draft = DraftBackend(draft_params, None, target_params)
    main = LocalEnsemble(draft, target, verifier)
    ensembles = {m: main for m in DECODING_METHODS if m != SELF}
    if with_self:
        self_draft = DraftBackend({**common, **suffix, "draft_model_path": str(paths["target"]),
                                   "speculator_path": "none"})
        ensembles[SELF] = LocalEnsemble(self_draft, target, verifier)
    return ensembles


def drafts_cap(method: str) -> int | None:
    """The most drafts a step of ``method`` proposes in this check: K_DECODE, or the head's number of predicted
    positions when fewer (:data:`.speculators.N_PREDICT` for Medusa, the MLP speculator and Arctic's); drafting every
    slot, a model proposer reaches it at every step that has hidden states. None: the model-free methods (their
    drafts depend on matches) and ``none``."""
    if method in ("medusa", "mlp_speculator", "arctic"):
        return min(K_DECODE, N_PREDICT)
    if method in ("eagle", "eagle3", DraftModelProposer.name, SELF):
        return K_DECODE
    return None


class _SeqIds:
    next = 1


def decode(ctx: Context, ensemble, method: str, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    """Greedy decoding of ``prompts`` (token ids) through ``ensemble``, ``batch`` sequences per round (lockstep, as
    generate's rounds), ``max_tokens`` new tokens each, k = :data:`K_DECODE` (0 for ``none``).

    The requests count as seeded, so suffix decoding drafts from each request's own tree only and no run learns from
    another's responses.

    Each step brings the hidden states the sequence's previous step returned (as generate sends them), so the heads
    draft from the second step on.

    Returns:
        dict: outputs (the new token ids per prompt), seconds (wall clock, device synchronised), steps (sequence
        steps), drafted and accepted (draft tokens), drafts_per_step (a histogram: drafts proposed -> steps).
    """
    params = SamplingParams(0.0, 0, 1.0, 0, seeded=True)
    served = DraftModelProposer.name if method == SELF else method
    k = 0 if method == NO_SPECULATION else K_DECODE
    outputs: list[list[int] | None] = [None] * len(prompts)
    steps, drafted, accepted = 0, 0, 0
    per_step: dict[int, int] = {}
    ctx.sync()
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        live: dict[int, tuple[int, list[int]]] = {}
        hidden: dict[int, np.ndarray | None] = {}  # each sequence's last step's hidden states (None: first step)
        for i in range(first, min(first + batch, len(prompts))):
            live[i] = (_SeqIds.next, list(prompts[i]))
            hidden[i] = None
            _SeqIds.next += 1
        step = 0
        while live:
            order = list(live)
            inps = [StepInputs(live[i][0], live[i][1], k, served, params, step, hidden_states=hidden[i])
                    for i in order]
            results = ensemble.run_round(inps)
            step += 1
            done = []
            for i, inp, r in zip(order, inps, results):
                steps += 1
                drafted += r.num_draft_tokens
                per_step[r.num_draft_tokens] = per_step.get(r.num_draft_tokens, 0) + 1
                accepted += len(r.output_ids) - 1
                hidden[i] = r.hidden_states
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
    return {"outputs": outputs, "seconds": seconds, "steps": steps, "drafted": drafted, "accepted": accepted,
            "drafts_per_step": dict(sorted(per_step.items()))}


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
        dict: position, reference_token and emitted_token (ids), reference_logit and emitted_logit (their logits in
        that plain forward), top2_logit_gap, scale (the largest |logit|), emitted_rank (0: this plain forward ranks the
        emitted token first, the reference's second), near_tie (the emitted and the reference's token both within
        the tolerance of the best logit).
    """
    i = next(j for j, (a, b) in enumerate(zip(ref, got)) if a != b)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + ref[:i]], device=model.device)).logits[0, -1].float()
    top = torch.topk(logits, 2)
    gap, scale = float(top.values[0] - top.values[1]), float(logits.abs().max())
    rank = int((logits > logits[got[i]]).sum())
    # both tokens within the tolerance of the best logit: the emitted one may rank first in this plain forward (the
    # reference's own cached decoding then chose the runner-up), or second
    spread = float(top.values[0] - torch.minimum(logits[got[i]], logits[ref[i]]))
    return {"position": i, "reference_token": ref[i], "emitted_token": got[i],
            "reference_logit": float(logits[ref[i]]), "emitted_logit": float(logits[got[i]]),
            "top2_logit_gap": gap, "scale": scale, "emitted_rank": rank,
            "near_tie": rank <= 1 and spread <= TIE_TOLERANCE[dtype] * scale}


def describe_divergence(d: dict) -> str:
    """One :func:`divergence` in words: the position and both tokens with their logits."""
    return (f"position {d['position']}: reference token {d['reference_token']} (logit {d['reference_logit']:.4f}), "
            f"emitted {d['emitted_token']} (logit {d['emitted_logit']:.4f}; rank {d['emitted_rank']}, scale "
            f"{d['scale']:.2f})")


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


def forward_cost(ctx: Context, lm, batches: Sequence[int] = (1, 8),
                 positions: Sequence[int] = FORWARD_NEW_POSITIONS) -> dict:
    """Milliseconds of one round of ``lm`` (a :class:`spec_decode.engine.kv_cache.CachedCausalLM`) over n new
    positions per sequence (``positions``; batch 8: 1, 2, 5 and 9 of them) on :data:`FORWARD_CACHE`-token caches, for
    ``batches`` sequences per round, median of ``ctx.sizes.reps``: what a captured round costs where one was
    captured.

    Returns:
        dict: cache_tokens, ms (batch -> n -> milliseconds), ratio_to_one (batch -> n -> ms / ms of n = 1).
    """
    g = torch.Generator().manual_seed(7)
    top = max(positions)
    ms: dict[int, dict[int, float]] = {}
    for batch in batches:
        seqs = [10**9 + j for j in range(batch)]
        ids = [torch.randint(3, lm.vocab_size, (FORWARD_CACHE + top,), generator=g).tolist() for _ in seqs]
        lm.logits_batch([(s, x[:FORWARD_CACHE], 1) for s, x in zip(seqs, ids)])
        use = positions if batch == 1 else [n for n in positions if n in (1, 2, 5, 9)]
        ms[batch] = {}
        for n in use:  # the caches keep the first FORWARD_CACHE tokens; each round recomputes n per sequence
            calls = [(s, x[: FORWARD_CACHE + n], n) for s, x in zip(seqs, ids)]
            ms[batch][n] = ctx.timed(partial(lm.logits_batch, calls), ctx.sizes.reps) * 1e3
        for s in seqs:
            lm.release(s)
    return {"cache_tokens": FORWARD_CACHE, "ms": ms,
            "ratio_to_one": {b: {n: v / m[1] for n, v in m.items()} for b, m in ms.items()}}


def sync_free(ctx: Context, lm) -> dict | None:
    """Whether a warm round's forward makes no host synchronisation on CUDA: one eager forward and, where a shape was
    captured, one graph replay of a batch-8 verification round (k = 4, 300-token caches), and the same round with its
    drafts as a tree (two branches: the tree mask built from parents), each under
    ``torch.cuda.set_sync_debug_mode("error")`` (a synchronising call raises). None in CPU mode."""
    if not ctx.cuda:
        return None
    from spec_decode.engine.paged_forward import pack_round, unpack_round

    g = torch.Generator().manual_seed(8)
    seqs = [2 * 10**9 + j for j in range(8)]
    ids = [torch.randint(3, lm.vocab_size, (FORWARD_CACHE + 5,), generator=g).tolist() for _ in seqs]
    out = {}
    for label, tree in (("", None), ("tree ", [-1, 0, -1, 2])):
        lm.logits_batch([(s, x[:FORWARD_CACHE], 1) for s, x in zip(seqs, ids)])
        rows = [lm._prepare(s, x, 5, set(seqs), tree).row for s, x in zip(seqs, ids)]
        for captured in (False, True):
            name = label + ("graph" if captured else "eager")
            shape, is_graph = lm.round_shape(rows)
            if captured and not is_graph:
                out[name] = "no captured shape"
                continue
            packed = pack_round(rows, shape, lm.block_size)
            if not captured:
                inputs = unpack_round(torch.from_numpy(packed).to(lm.device), shape)
            torch.cuda.synchronize()
            try:
                torch.cuda.set_sync_debug_mode("error")
                with torch.inference_mode():
                    if captured:  # the served path's replay: its pinned upload, event wait and graph
                        lm.graphs.run(packed, shape)
                    else:
                        lm._forward_fn.run(inputs)
                out[name] = "no synchronisation"
            except RuntimeError as exc:
                out[name] = f"synchronises: {exc}"
                ctx.fail(f"decoding: the {label}{'captured' if captured else 'eager'} forward synchronises with the "
                         f"host: {exc}")
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for s in seqs:
            lm.release(s)
    return out


def engine_report(lm) -> dict:
    """What the engine built for ``lm`` at load: the KV pool (tokens, GiB) and the CUDA graphs captured (count,
    seconds, MiB, emulated: the shapes run eagerly with ``cuda_graphs: emulate``; None with ``cuda_graphs: off``)."""
    from spec_decode.engine.cuda_graphs import EagerAtShapes

    graphs = lm.graphs
    return {"pool_tokens": lm.max_tokens, "pool_GiB": lm.pool.nbytes / 2**30,
            "graphs": None if graphs is None else {"captured": len(graphs), "seconds": graphs.capture_seconds,
                                                   "MiB": graphs.capture_bytes / 2**20,
                                                   "emulated": isinstance(graphs, EagerAtShapes)}}


def goals(res: dict, copy_gb_s: float) -> dict:
    """The issue's goals for the forward, from a decoding result: ``none`` at batch 1 against the roofline (the
    target's weight bytes at the copy bandwidth measured in this run; >= 400 tokens/s in float32 and >= 650 in
    bfloat16 on the H200), batch 8 over batch 1 (>= 6x), a 5-position forward over a 1-position one (<= 1.2x) and the
    early-exit draft's forward over the target's (<= 0.2), per dtype. Reported, not failures (they are speed goals)."""
    out: dict = {"copy_GB_per_s": copy_gb_s}
    for dtype in ("float32", "bfloat16"):
        runs = {(r["batch"], r["method"]): r for r in res["runs"] if r.get("dtype") == dtype and "skipped" not in r}
        one, eight = runs.get((1, NO_SPECULATION)), runs.get((8, NO_SPECULATION))
        f = res.get("forward_cost", {}).get(dtype)
        wb = res.get("weight_bytes", {}).get(dtype)
        g: dict = {}
        if one and wb:
            roofline = copy_gb_s * 1e9 / wb
            g["none_batch1_tokens_per_s"] = one["tokens_per_s"]
            g["roofline_tokens_per_s"] = roofline
            g["fraction_of_roofline"] = one["tokens_per_s"] / roofline
            g["none_batch1_goal"] = 400.0 if dtype == "float32" else 650.0
            g["none_batch1_met"] = one["tokens_per_s"] >= g["none_batch1_goal"]
        if one and eight:
            g["batch8_over_batch1"] = eight["tokens_per_s"] / one["tokens_per_s"]
            g["batch8_met"] = g["batch8_over_batch1"] >= 6.0
        if f:
            g["forward5_over_forward1"] = f["target"]["ratio_to_one"][1][5]
            g["forward5_met"] = g["forward5_over_forward1"] <= 1.2
            g["draft_over_target_forward"] = f["draft"]["ms"][1][1] / f["target"]["ms"][1][1]
            g["draft_forward_met"] = g["draft_over_target_forward"] <= 0.2
        out[dtype] = g
    return out


def speculator_layout(folder: Path) -> dict:
    """What a speculator folder of :func:`build_models` is: the method its layout serves (as draft_model detects it),
    its variant (as the launcher's banner names it), its ``architectures`` or ``model_type``, and its weights file
    (a sharded model's index)."""
    import json

    from spec_decode.proposers.speculators import detect
    from spec_decode.proposers.speculators.checkpoint import find_weights
    from spec_decode.proposers.speculators.layouts import describe_variant

    cfg = json.loads((folder / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    weights = index if index.is_file() else find_weights(
        folder, ("model.safetensors", "pytorch_model.bin", "medusa_lm_head.safetensors", "medusa_lm_head.pt"))
    method = detect(folder)
    return {"method": method, "variant": describe_variant(folder, method), "folder": folder.name,
            "architectures": cfg.get("architectures") or cfg.get("model_type") or "medusa_num_heads",
            "weights": weights.name}


def check_drafts(ctx: Context, run: dict) -> None:
    """A model proposer's drafts per step (``run["drafts_per_step"]``) must stay within its cap (:func:`drafts_cap`)
    and, drafting every slot, reach it at every step but a sequence's first (a head has no hidden states yet then;
    the draft LM reaches it there too): else a failure is recorded."""
    cap, hist = run["drafts_cap"], run["drafts_per_step"]
    if cap is None:
        return
    short = {n: c for n, c in hist.items() if n != cap}
    # a sequence's first step: no hidden states for a head (no drafts); the rest draft exactly the cap
    allowed = {0: run["sequences"]} if run["method"] not in (DraftModelProposer.name, SELF) else {}
    if any(n > cap for n in hist) or any(c > allowed.get(n, 0) for n, c in short.items()) or not hist.get(cap):
        ctx.fail(f"decoding {run['dtype']} batch {run['batch']} {run['method']}: drafts per step {hist}, expected "
                 f"{cap} at every step (but no drafts at each sequence's first step for a head)")


def same_drafts(ctx: Context, paths: dict, dtype: str, sequences: int = 3, states: int = 5) -> list[dict]:
    """Each other published layout of a served head (:data:`.speculators.ALTERNATIVES`) against that head: both
    loaded as draft_model loads them (``speculator_path``, ``target_model_path``, ``speculator_min_token_prob`` 0) on
    ``ctx.device`` in ``dtype``, given the same greedy requests (random token ids and hidden states of the target's
    width), must propose the same drafts and the same draft distributions (the same weights in another layout).

    Returns:
        per layout: layout, method, compared_with, equal (drafts and distributions), drafts (per request, the
        alternative's).
    """
    from spec_decode.proposers.base import ProposalRequest
    from spec_decode.proposers.registry import PROPOSERS

    s = ctx.sizes.llama
    g = torch.Generator().manual_seed(11)
    params = SamplingParams(0.0, 0, 1.0, 0, seeded=True)
    out = []
    for layout, (method, reference) in ALTERNATIVES.items():
        proposals = []
        for key in (reference, layout):
            cls = PROPOSERS[method if key == layout else reference]
            settings = cls.Settings.from_params({"speculator_path": str(paths[key]), "speculator_min_token_prob": "0",
                                                 "target_model_path": str(paths["target"]),
                                                 "device": ctx.device.type, "dtype": dtype})
            proposer = cls.from_config(settings, {})
            assert proposer is not None, f"{key}: {paths[key]} serves no {cls.name} head"
            g.manual_seed(11)  # the same requests for both
            width = s["hidden_size"] * (4 if method == "eagle3" else 1)  # EAGLE-3: the last state and 3 layers'
            requests = [ProposalRequest(j + 1, torch.randint(3, s["vocab_size"], (24,), generator=g).tolist(),
                                        K_DECODE, params, 1, torch.randn(states, width, generator=g))
                        for j in range(sequences)]
            proposals.append(proposer.propose(requests))
            del proposer
        equal = all(
            torch.equal(a.draft_token_ids.cpu(), b.draft_token_ids.cpu()) and len(a.draft_token_ids) > 0
            and (a.draft_probs is None) == (b.draft_probs is None)
            and (a.draft_probs is None or torch.allclose(a.draft_probs.float().cpu(), b.draft_probs.float().cpu(),
                                                         rtol=1e-5, atol=1e-6))
            for a, b in zip(*proposals))
        if not equal:
            ctx.fail(f"decoding {dtype}: the {layout} layout drafts other tokens than the {reference} head of the same "
                     f"weights")
        out.append({"dtype": dtype, "layout": layout, "method": method, "compared_with": reference, "equal": equal,
                    "drafts": [p.draft_token_ids.tolist() for p in proposals[1]]})
        print(f"  {dtype:<9} {layout:<12} drafts as {reference}: {equal}", flush=True)
    return out


def decoding(ctx: Context, deadline: float, dtypes: Sequence[str] = ("float32", "bfloat16"),
             methods: Sequence[str] = DECODING_METHODS) -> dict:
    """Part 3: greedy equality of every method of :data:`DECODING_METHODS` with plain decoding, tokens/s, forward
    cost, for the model dtypes ``dtypes`` (``float32``, ``bfloat16``) and the methods ``methods`` (a subset of
    :data:`DECODING_METHODS`; ``none`` always runs: it is the reference). Runs that would start after ``deadline`` (a
    ``time.perf_counter()`` value) are reported as skipped. The forward cost runs first (the forward's goals), then
    the methods; after a dtype, the CUDA memory its models held must be freed by ``del`` alone
    (:data:`MEMORY_SLACK_MIB`).

    Returns:
        dict: target_parameters, config, k, max_tokens, prompts, verifier_backend, note, speculators (method or other
        layout -> its layout, from :mod:`.speculators`), runs (per dtype, batch and method: sequences, tokens,
        seconds, tokens_per_s, mean_tokens_per_step, acceptance_rate, drafts_per_step, drafts_cap,
        equal_to_plain_greedy, mismatched_sequences, and divergences where any; or skipped), layouts
        (:func:`same_drafts`, float32), engine (per dtype, target and draft LM: :func:`engine_report`; memory: CUDA
        MiB allocated before the load, after it and after ``del``; round_syncs: the host reads of a warm round of each
        kind, :func:`.sync_sentinel.round_syncs`; attention: :func:`.attention.attention_report`), forward_cost
        (per dtype: the target's and the early-exit draft's, :func:`forward_cost`), weight_bytes (per dtype,
        :func:`bench.forward_cost.weight_bytes`) and goals (:func:`goals`).
    """
    s = ctx.sizes
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_models_"))
    try:
        built = build_models(ctx, folder)
        prompts = make_prompts(s.prompts, s.prompt_len, s.llama["vocab_size"])
        res = {"target_parameters": built["target_parameters"], "config": s.llama, "k": K_DECODE,
               "max_tokens": s.max_tokens, "prompts": len(prompts), "runs": [], "layouts": []}
        res["speculators"] = {key: speculator_layout(built["paths"][key]) for key in (*SERVED, *ALTERNATIVES)}
        res["verifier_backend"] = ctx.verifier_backend
        res["note"] = ("random weights; speeds are overhead checks of the step path (transformers' eager forward is "
                       "bound by kernel launches at these sizes), not what a trained model would reach")
        warm = make_prompts(1, s.prompt_len, s.llama["vocab_size"], seed=99)
        res["engine"], res["forward_cost"], res["weight_bytes"] = {}, {}, {}
        for dtype in dtypes:
            if time.perf_counter() > deadline:
                res["runs"].append({"dtype": dtype, "skipped": "time budget"})
                continue
            mem = {"before_MiB": torch.cuda.memory_allocated() / 2**20} if ctx.cuda else {}
            ens = load_ensembles(ctx, built["paths"], dtype, with_self=SELF in methods)
            model = ens[NO_SPECULATION].target.lm.model
            draft_lm = ens[DraftModelProposer.name].draft.proposers[DraftModelProposer.name].lm
            res["engine"][dtype] = {"target": engine_report(ens[NO_SPECULATION].target.lm),
                                    "draft": engine_report(draft_lm)}
            res["weight_bytes"][dtype] = weight_bytes(model)
            res["engine"][dtype]["sync_free"] = sync_free(ctx, ens[NO_SPECULATION].target.lm)
            if ctx.cuda:
                mem["loaded_MiB"] = torch.cuda.memory_allocated() / 2**20
            res["engine"][dtype]["memory"] = mem
            print(f"  {dtype:<9} engine: {res['engine'][dtype]}", flush=True)
            res["forward_cost"][dtype] = {"target": forward_cost(ctx, ens[NO_SPECULATION].target.lm),
                                          "draft": forward_cost(ctx, draft_lm, (1,), (1,))}
            print(f"  {dtype:<9} forward ms (batch -> new positions -> ms): "
                  f"{res['forward_cost'][dtype]['target']['ms']}, early-exit draft "
                  f"{res['forward_cost'][dtype]['draft']['ms']}", flush=True)
            # the attention kernels each call of a round can run on, and the one PyTorch picks (reported)
            res["engine"][dtype]["attention"] = attention_report(ens, prompts[:2])
            picked = {(a["site"].rsplit("/", 1)[-1], a["call"]["mask"]): a["picked"]
                      for a in res["engine"][dtype]["attention"]}
            print(f"  {dtype:<9} attention kernels picked: "
                  + ", ".join(f"{site} (mask {mask}) {k}" for (site, mask), k in picked.items()), flush=True)
            # host synchronisations of a warm round of each kind (reported: the drafting loops still read per slot)
            res["engine"][dtype]["round_syncs"] = round_syncs(ens, prompts[:2], ctx.cuda)
            print(f"  {dtype:<9} host reads per round: "
                  + ", ".join(f"{kind} {v.get('syncs', v.get('reads'))}"
                              for kind, v in res["engine"][dtype]["round_syncs"].items()), flush=True)
            # warm-up: CUDA context, cuBLAS, every kernel specialization a method launches
            run_methods = [m for m in DECODING_METHODS if m in methods or m == NO_SPECULATION]
            for method in run_methods:
                for batch in (1, 2):
                    decode(ctx, ens[method], method, warm * batch, batch, max_tokens=6)
            hf_ref = reference(model, prompts, s.max_tokens)
            # a CPU in bfloat16 runs the batch-invariant forward: every method must give the engine's own plain
            # decoding bit for bit, and plain decoding's distance from transformers' (another kernel order) is reported
            invariant = ens[NO_SPECULATION].target.lm.batch_invariant
            for batch in (1, 8):
                use = prompts if batch > 1 else prompts[: max(2, len(prompts) // 2)]
                ref = hf_ref
                for method in (NO_SPECULATION, *(m for m in run_methods if m != NO_SPECULATION)):
                    if time.perf_counter() > deadline:
                        res["runs"].append({"dtype": dtype, "batch": batch, "method": method,
                                            "skipped": "time budget"})
                        continue
                    r = decode(ctx, ens[method], method, use, batch, s.max_tokens)
                    off_hf = None
                    if invariant and method == NO_SPECULATION:
                        off = [i for i, (a, b) in enumerate(zip(hf_ref, r["outputs"])) if a != b]
                        off_hf = [divergence(model, prompts[i], hf_ref[i], r["outputs"][i], dtype) for i in off]
                        ref = r["outputs"]
                    tokens = s.max_tokens * len(use)
                    mismatched = [i for i, (a, b) in enumerate(zip(ref, r["outputs"])) if a != b]
                    run = {"dtype": dtype, "batch": batch, "method": method, "sequences": len(use),
                           "tokens": tokens, "seconds": r["seconds"], "tokens_per_s": tokens / r["seconds"],
                           "mean_tokens_per_step": tokens / r["steps"] if r["steps"] else 0.0,
                           "acceptance_rate": r["accepted"] / r["drafted"] if r["drafted"] else None,
                           "drafts_per_step": r["drafts_per_step"], "drafts_cap": drafts_cap(method),
                           "equal_to_plain_greedy": not mismatched, "mismatched_sequences": len(mismatched)}
                    if off_hf is not None:
                        run["reference"] = "the engine's plain decoding (batch-invariant forward)"
                        run["differs_from_transformers"] = off_hf
                    check_drafts(ctx, run)
                    if mismatched and invariant:
                        ctx.fail(f"decoding {dtype} batch {batch} {method}: {len(mismatched)} sequences differ from "
                                 f"plain decoding on a batch-invariant forward")
                    elif mismatched:
                        d = [divergence(model, prompts[i], ref[i], r["outputs"][i], dtype) for i in mismatched]
                        run["divergences"] = d
                        run["divergences_at_near_ties"] = all(x["near_tie"] for x in d)
                        if not run["divergences_at_near_ties"]:
                            ctx.fail(f"decoding {dtype} batch {batch} {method}: {len(mismatched)} sequences differ "
                                     f"from plain greedy decoding, not at a near-tie: "
                                     + "; ".join(describe_divergence(x) for x in d if not x["near_tie"]))
                    res["runs"].append(run)
                    print(f"  {dtype:<9} B={batch} {method:<15}{run['tokens_per_s']:>9.1f} tok/s  "
                          f"tokens/step {run['mean_tokens_per_step']:.2f}  equal {run['equal_to_plain_greedy']}",
                          flush=True)
            if dtype == "float32" and set(methods) >= set(DECODING_METHODS):  # the layouts: one dtype tells
                if time.perf_counter() < deadline:
                    res["layouts"] = same_drafts(ctx, built["paths"], dtype)
                else:
                    res["runs"].append({"dtype": dtype, "method": "layouts", "skipped": "time budget"})
            del ens, model, draft_lm
            if ctx.cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                mem["after_del_MiB"] = torch.cuda.memory_allocated() / 2**20
                if mem["after_del_MiB"] > mem["before_MiB"] + MEMORY_SLACK_MIB:
                    ctx.fail(f"decoding {dtype}: {mem['after_del_MiB'] - mem['before_MiB']:.0f} MiB of CUDA memory "
                             f"still allocated after its models were deleted (del, no gc.collect()): something "
                             f"holds a model, its KV pool or its graphs")
        from .bandwidth import copy_bandwidth_gb_s

        res["goals"] = goals(res, copy_bandwidth_gb_s(ctx, 1 << 30 if ctx.cuda else 1 << 26))
        print(f"  goals: {res['goals']}", flush=True)
        return res
    finally:
        shutil.rmtree(folder, ignore_errors=True)
