"""Train the EAGLE head on CPU: ``python -m spec_decode.training.speculator`` (``make speculator``).

The head (:mod:`spec_decode.proposers.eagle`; EAGLE, Li et al. 2024, arXiv 2401.15077, with EAGLE-3's training-time
test, arXiv 2503.01840) drafts from the target's own last hidden states. It learns the target's predictions,
teacher-forced, over code every machine has (:mod:`spec_decode.training.corpus`: the standard library's sources and
HumanEval's training tasks). The logged phases:

1. corpus: ``--stdlib-tokens`` of standard-library code (files in a seeded order) plus HumanEval tasks 20..163.
2. teacher: the target's last hidden states at every position (:func:`spec_decode.training.teacher.cached_teacher`:
   kept under ``$SPEC_DECODE_CACHE/teacher``, shared with ``make draft``, resumed when interrupted; in bfloat16 where
   the CPU multiplies it natively, ``--teacher-dtype``).
3. vocabulary: the ``--draft-vocab`` tokens most frequent in the corpus and in the target's predictions; the head's
   input embedding and LM head are the target's rows of them (frozen).
4. train: windows of ``--seq-len`` pairs (:func:`windows`); the head's outputs unrolled ``--depth`` draft positions
   deep (:func:`unrolled_outputs`: from the second on it reads its own outputs, as drafting does), each learning the
   target's next hidden state and its distribution of the next token there (:func:`unrolled_loss`: EAGLE's smooth L1
   feature loss, and the KL to the target's LM head over the kept tokens); AdamW, cosine schedule, seeded, bfloat16
   products where the CPU has them, checkpointed every ``--checkpoint-every`` steps in ``<output>.work`` (a rerun
   resumes).
5. evaluate on the target's greedy continuations of held-out HumanEval tasks 0..``--eval-prompts``-1, with the
   serving proposer stepped as live greedy decoding steps it (:func:`evaluate`): tokens per step and acceptance per
   draft position with k = 4 drafting every slot, and at the served confidence threshold.

The folder (``--output``, default ``$SPEC_DECODE_CACHE/models/SmolLM2-135M-Instruct-eagle``) is written whole under a
temporary name, then renamed into place (:func:`spec_decode.training.cli.publish`), with ``train_speculator.json``
(settings, corpus, loss curve, evaluation, minutes). docs/trained-proposers.md describes the tool for users;
docs/benchmarks.md has its running time.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..engine.draft_vocab import DraftVocab
    from ..proposers.eagle import EagleHead, EagleProposer
    from .teacher import Teacher

logger = logging.getLogger(__name__)


def unroll_mask(t: int, depth: int, device: torch.device | None = None) -> torch.Tensor:
    """Attention mask of unrolled step ``depth`` >= 1 over the keys of steps 0..depth (``[1, 1, t, (depth + 1) t]``
    bool): the query at j sees step 0's keys at positions <= j - depth (pairs built from the target's features) and
    step e's key at position j - depth + e for e = 1..depth (the pairs the head built from its own outputs on the way
    from there to j), as a live draft of depth + 1 tokens does."""
    j = torch.arange(t, device=device)[:, None]
    i = torch.arange(t, device=device)[None]
    blocks = [i <= j - depth] + [i == j - depth + e for e in range(1, depth + 1)]
    return torch.cat(blocks, 1)[None, None]


def unrolled_outputs(model: EagleHead, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                     depth: int) -> list[torch.Tensor]:
    """The head's outputs as drafting sees them, for draft positions 1..``depth`` (EAGLE-3's training-time test).

    Step 0 is the teacher-forced pass. Step d's input at pair j is the head's own step d-1 output at j - 1 with the true
    token x_{j+1} (in greedy drafting an accepted draft is the true token), and it attends as :func:`unroll_mask` says.

    Args:
        model: the head.
        features: [B, T, H]; tokens: [B, T]; positions: [B, T], as
            :meth:`~spec_decode.proposers.eagle.EagleHead.forward` takes them.
        depth: how many draft positions to unroll, >= 1.

    Returns:
        ``depth`` tensors [B, T, H]: step d's outputs (rows j < d have no valid input and should not count).
    """
    t = features.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=features.device).tril()[None, None]
    out, (k, v) = model.layer(model.pair_inputs(features, tokens), positions, causal)
    outs, keys, values = [out], [k], [v]
    for d in range(1, depth):
        prev = torch.cat([out[:, :1] * 0, out[:, :-1]], 1)  # step d-1's output for the pair before
        out, (k, v) = model.layer(model.pair_inputs(prev, tokens), positions,
                                  unroll_mask(t, d, features.device), (torch.cat(keys, 2), torch.cat(values, 2)))
        outs.append(out)
        keys.append(k)
        values.append(v)
    return outs


# What :func:`windows` yields: (features, tokens, positions, next features, mask)
WindowBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def windows(sequences: list[list[int]], teacher: Teacher, seq_len: int, batch_size: int, gen: torch.Generator,
            vocab: DraftVocab) -> Iterator[WindowBatch]:
    """Random training windows of pairs, forever.

    Pair j of a window starting at position s of a sequence x joins the target's hidden state f_{s+j} with token
    x_{s+j+1}; its target is the next hidden state f_{s+j+1} (from which the target's LM head reads the distribution
    of x_{s+j+2}). Rows shorter than the longest (T <= ``seq_len``) are padded at the end (the causal attention never
    reads padding from a real position) and masked. Sequences of fewer than 2 tokens are never drawn.

    Yields:
        (features [B, T, H] float32, tokens [B, T] int64 draft-vocabulary indices, positions [B, T] int64, next
        features [B, T, H] float32, mask [B, T] float32), B = ``batch_size``.
    """
    usable = [i for i, s in enumerate(sequences) if len(s) >= 2]
    while True:
        rows = [usable[i] for i in torch.randint(len(usable), (batch_size,), generator=gen).tolist()]
        spans = []
        for r in rows:
            pairs = len(sequences[r]) - 1  # pairs 0..len-2 have a following token
            start = int(torch.randint(max(1, pairs - seq_len + 1), (1,), generator=gen))
            spans.append((r, start, min(seq_len, pairs - start)))
        t = max(n for *_, n in spans)
        width = teacher.hidden[rows[0]].shape[1]
        feats, nxt = torch.zeros(batch_size, t, width), torch.zeros(batch_size, t, width)
        tokens, pos = torch.zeros(batch_size, t, dtype=torch.long), torch.zeros(batch_size, t, dtype=torch.long)
        mask = torch.zeros(batch_size, t)
        for b, (r, s, n) in enumerate(spans):
            feats[b, :n] = teacher.hidden[r][s : s + n].float()
            nxt[b, :n] = teacher.hidden[r][s + 1 : s + n + 1].float()
            tokens[b, :n] = torch.tensor(sequences[r][s + 1 : s + n + 1])
            pos[b, :n] = torch.arange(s, s + n)
            mask[b, :n] = 1.0
        yield feats, vocab.to_draft[tokens], pos, nxt, mask


def unrolled_loss(model: EagleHead, batch: WindowBatch, depth: int,
                  feature_weight: float) -> tuple[torch.Tensor, list[float]]:
    """EAGLE's loss over a :func:`windows` batch, averaged over the ``depth`` draft positions: the KL to the target's
    next-token distribution over the kept tokens (:func:`~spec_decode.training.teacher.distillation_loss`; the
    target's LM head over its next hidden state) plus ``feature_weight`` x the smooth L1 distance of the predicted
    hidden state to the target's (feature regression).

    Returns:
        (the loss, a 0-dim float32 tensor with its graph; each position's KL in nats).
    """
    import torch.nn.functional as F

    from .teacher import distillation_loss, native_bfloat16, target_distribution

    feats, tokens, pos, nxt, mask = batch
    # bfloat16 matrix products where the CPU has them natively (faster; docs/benchmarks.md); the losses and the
    # weights stay float32
    with torch.autocast(feats.device.type, dtype=torch.bfloat16, enabled=native_bfloat16(feats.device)):
        with torch.no_grad():  # the target's distribution over the kept tokens: its frozen LM head over its states
            target = target_distribution(model.logits(nxt))
        outs = unrolled_outputs(model, feats, tokens, pos, depth)
        logits = [model.logits(out) for out in outs]
    total: torch.Tensor | float = 0.0
    per: list[float] = []
    for d, out in enumerate(outs):
        m = mask.clone()
        m[:, :d] = 0.0  # step d's first d pairs have no own output to read
        kl = distillation_loss(logits[d], target, m)
        reg = (F.smooth_l1_loss(out.float(), nxt, reduction="none").mean(-1) * m).sum() / m.sum().clamp_min(1.0)
        total = total + kl + feature_weight * reg
        per.append(kl.item())
    assert isinstance(total, torch.Tensor)  # outs holds at least step 0
    return total / depth, per


def evaluate(proposer: EagleProposer, sequences: list[list[int]], prompt_lens: list[int], teacher: Teacher,
             k: int = 4) -> dict:
    """The serving proposer stepped over held-out target greedy continuations as live greedy decoding steps it.

    A sequence's first step (after the prompt) drafts nothing; each later step brings the hidden states of the
    positions the previous step accepted, drafts up to ``k`` tokens and accepts them while they equal the target's
    argmax (the continuation is the target's own choice, so this is what the server accepts).

    Returns:
        dict: ``tokens_per_step``, ``acceptance_rate`` (accepted / drafted), ``drafts_per_step``,
        ``acceptance_per_position`` (P(at least j+1 drafts accepted) per step), ``steps``.
    """
    from ..proposers.base import ProposalRequest
    from ..sampling import SamplingParams

    hist, drafted, steps = [0] * (k + 1), 0, 0
    greedy = SamplingParams()
    for n, (seq, plen, top, hid) in enumerate(zip(sequences, prompt_lens, teacher.argmax, teacher.hidden)):
        target = top.tolist()  # the target's argmax after each position
        s = plen  # the first step committed x_plen; it brought the state of position plen - 1
        hidden = hid[plen - 1 : plen].float()
        while s < len(seq) - 1:
            want = min(k, len(seq) - 1 - s)
            (p,) = proposer.propose([ProposalRequest(n, seq[: s + 1], want, greedy, steps, hidden)])
            a = 0
            for t in p.draft_token_ids.tolist():
                if t != target[s + a]:
                    break
                a += 1
            hist[a] += 1
            drafted += len(p.draft_token_ids)
            steps += 1
            hidden = hid[s : s + a + 1].float()
            s += a + 1
        proposer.release(n)
    total = max(1, steps)
    return {"tokens_per_step": sum((a + 1) * c for a, c in enumerate(hist)) / total,
            "acceptance_rate": sum(a * c for a, c in enumerate(hist)) / max(1, drafted),
            "drafts_per_step": drafted / total, "steps": steps,
            "acceptance_per_position": [sum(hist[j + 1 :]) / total for j in range(k)]}


def main(argv: list[str] | None = None) -> int:
    """Run (or resume) the training; writes the head's folder. Returns 0."""
    from tqdm import tqdm

    from ..proposers.eagle import REPORT_FILE, EagleHead, EagleProposer, EagleSettings, default_eagle_dir, eagle_config
    from .cli import optimizer_step, publish, start_run, tool_parser, training_data
    from .teacher import choose_vocabulary

    ap = tool_parser("spec_decode.training.speculator", __doc__ or "", "head folder (default: the cache's default)")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="kept tokens of the embedding and LM head")
    ap.add_argument("--seq-len", type=int, default=256, help="pairs per training window")
    ap.add_argument("--depth", type=int, default=3, help="draft positions unrolled in training (>= 1)")
    ap.add_argument("--steps", type=int, default=380, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=12, help="windows per step")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, cosine)")
    ap.add_argument("--feature-weight", type=float, default=0.1,
                    help="weight of the hidden-state regression beside the KL (EAGLE's L_reg)")
    ap.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    ap.add_argument("--if-missing", action="store_true", help="do nothing when the default head exists")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.depth < 1:
        ap.error(f"--depth must be >= 1, got {args.depth}")
    default_out = default_eagle_dir()
    if args.if_missing and args.output is None and (default_out / REPORT_FILE).exists():
        logger.info("EAGLE head ready at %s", default_out)
        return 0
    t_start = time.perf_counter()
    run = start_run(args.output, default_out, args.target, args.seed, args.fresh, args.teacher_cache)
    out, work, target_dir, tok, target = run.out, run.work, run.target_dir, run.tokenizer, run.target

    data = training_data(target, target_dir, tok, run.cache, stdlib_tokens=args.stdlib_tokens,
                         seq_len=args.corpus_seq_len, seed=args.seed, humaneval_tasks=args.humaneval_tasks,
                         eval_prompts=args.eval_prompts, eval_tokens=args.eval_tokens, phases=5,
                         dtype=args.teacher_dtype)
    corpus, teacher = data.corpus, data.teacher

    logger.info("phase 3/5: vocabulary of %d tokens", args.draft_vocab)
    vocab = choose_vocabulary(corpus.sequences, teacher.argmax, args.draft_vocab, target.config.vocab_size,
                              always=[t for t in (tok.eos_token_id,) if t is not None])
    emb = target.get_input_embeddings().weight.detach()[vocab.token_ids]
    head = target.get_output_embeddings().weight.detach()[vocab.token_ids]
    model = EagleHead(torch.cat([emb, emb.mean(0, keepdim=True)]), head, eagle_config(target.config))
    del target
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    gen = torch.Generator().manual_seed(args.seed)
    key = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
           if k not in ("output", "fresh", "if_missing", "checkpoint_every", "teacher_cache")}
    ckpt_file = work / "checkpoint.pt"
    step, losses, per_depth = 0, [], []
    if ckpt_file.exists():
        ck = torch.load(ckpt_file, weights_only=False)
        if ck.get("key") == key:
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            sched.load_state_dict(ck["sched"])
            gen.set_state(ck["gen"])
            step, losses, per_depth = ck["step"], ck["losses"], ck["per_depth"]
            logger.info("resuming from %s at step %d", ckpt_file, step)
    batches = windows(corpus.sequences, teacher, args.seq_len, args.batch_size, gen, vocab)
    logger.info("phase 4/5: training the head %d positions deep for %d steps of %d windows of %d pairs (%d tokens)",
                args.depth, args.steps, args.batch_size, args.seq_len, corpus.tokens)
    model.train()
    bar = tqdm(total=args.steps, initial=step, desc="EAGLE head", unit="step")
    while step < args.steps:
        loss, per = unrolled_loss(model, next(batches), args.depth, args.feature_weight)
        optimizer_step(loss, opt, sched, trainable)
        step += 1
        losses.append(loss.item())
        per_depth.append(per)
        bar.set_postfix(kl=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        bar.update(1)
        if step % args.checkpoint_every == 0 or step == args.steps:
            torch.save({"key": key, "model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "gen": gen.get_state(), "step": step, "losses": losses, "per_depth": per_depth}, ckpt_file)
    bar.close()
    model.eval()
    logger.info("phase 5/5: evaluation on %d held-out HumanEval tasks (target greedy continuations)",
                len(data.eval_sequences))
    served = EagleSettings().eagle_min_token_prob
    report = {"every_slot": evaluate(EagleProposer(model, vocab, 0.0), data.eval_sequences, data.eval_prompt_lens,
                                     data.eval_teacher),
              f"min_token_prob_{served}": evaluate(EagleProposer(model, vocab, served), data.eval_sequences,
                                                   data.eval_prompt_lens, data.eval_teacher)}
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save(tmp, vocab, {"target": str(target_dir)})
    last = per_depth[-20:]
    info = {"settings": key, "target": str(target_dir), "corpus": {
                "sequences": len(corpus.sequences), "tokens": corpus.tokens, "stdlib_files": corpus.files,
                "humaneval_tasks": args.humaneval_tasks},
            "draft_vocab": len(vocab), "parameters": sum(p.numel() for p in trainable),
            "loss_first": losses[0] if losses else None,
            "loss_last": sum(losses[-20:]) / max(1, len(losses[-20:])),
            "loss_last_per_depth": [sum(p[d] for p in last) / max(1, len(last)) for d in range(args.depth)],
            "losses": losses, "eval": report, "minutes": (time.perf_counter() - t_start) / 60}
    (tmp / REPORT_FILE).write_text(json.dumps(info, indent=2))
    publish(tmp, out)
    every = report["every_slot"]
    logger.info("EAGLE head ready at %s: KL %.3f -> %.3f; held-out, drafting every slot of 4: %.2f tokens per step, "
                "acceptance per position %s; at min_token_prob %.2f: %.2f tokens per step, acceptance rate %.2f; "
                "%.1f minutes", out, info["loss_first"] or float("nan"), info["loss_last"], every["tokens_per_step"],
                ", ".join(f"{a:.2f}" for a in every["acceptance_per_position"]), served,
                report[f"min_token_prob_{served}"]["tokens_per_step"],
                report[f"min_token_prob_{served}"]["acceptance_rate"], info["minutes"])
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
