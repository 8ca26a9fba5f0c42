"""Distil a small draft LM from the target on CPU: ``python -m spec_decode.training.draft`` (``make draft``).

A layer-truncated copy of the target (:func:`spec_decode.engine.surgery.truncated_copy`: its embeddings, first
``--layers`` decoder layers, final norm and tied LM head; the "layer skip" / self-speculative draft of Elhoushi et al.
2024 and Zhang et al. 2023) is trained to match the target's next-token distribution (knowledge distillation, Hinton et
al. 2015; as DistillSpec, Zhou et al. 2024), teacher-forced, on code every machine has
(:mod:`spec_decode.training.corpus`). The logged phases:

1. corpus: ``--stdlib-tokens`` of the Python standard library's sources (files in a seeded order) plus HumanEval
   tasks 20..163 (prompt + canonical solution). Tasks 0..19 are never trained on (``client.bench`` uses them).
2. teacher: the target's last hidden states at every position (:func:`spec_decode.training.teacher.cached_teacher`,
   kept under ``$SPEC_DECODE_CACHE/teacher`` and shared with ``make speculator``: whichever runs second skips this
   pass; in bfloat16 where the CPU multiplies it natively); the target's distribution at a position is its LM head
   over them.
3. train: AdamW on KL(p || q) = sum_j p_j (log p_j - log q_j) over the target's 32 most probable kept tokens (p its
   distribution renormalised over them, :func:`~spec_decode.training.teacher.target_distribution`), seeded,
   checkpointed every ``--checkpoint-every`` steps: a rerun resumes from the work folder. The embeddings and the tied
   LM head stay the target's (frozen); the decoder layers and the final norm learn.
4. evaluate on the target's greedy continuations of held-out tasks 0..``--eval-prompts``-1 (:func:`evaluate`).

The draft's vocabulary is pruned to the ``--draft-vocab`` most frequent tokens
(:func:`spec_decode.engine.surgery.prune_vocabulary`; its LM head is the draft's largest matrix and, memory-bound on a
CPU, most of its cost); ``draft_vocab.json`` maps its indices to the target's, and rejection sampling stays exact (the
draft's probability is zero outside the set; vLLM/EAGLE-3 use the same idea).

The result is an ordinary Hugging Face folder (config.json, model.safetensors, tokenizer files) plus
``draft_vocab.json`` and ``train_draft.json`` (settings, corpus, loss curve, evaluation, minutes), written whole under
a temporary name, then renamed into place (:func:`spec_decode.training.cli.publish`) at ``--output`` (default
``$SPEC_DECODE_CACHE/models/SmolLM2-135M-Instruct-draft``, outside the repository). docs/trained-proposers.md
describes the tool for users; docs/benchmarks.md has its running time.
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
    from .teacher import Teacher

logger = logging.getLogger(__name__)


def _batches(seqs: list[list[int]], teacher: Teacher, seq_len: int, batch_size: int, gen: torch.Generator,
             vocab: DraftVocab | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Random windows of ``seq_len`` tokens, forever: (input ids [B, L] int64, the target's hidden states there
    [B, L, H] float32, mask [B, L] float32); with a pruned ``vocab`` the ids are draft indices."""
    width = teacher.hidden[0].shape[1]
    while True:
        rows = torch.randint(len(seqs), (batch_size,), generator=gen).tolist()
        ids_b, hid_b, mask_b = [], [], []
        for r in rows:
            ids = seqs[r]
            n = len(ids) - 1
            start = int(torch.randint(max(1, n - seq_len + 1), (1,), generator=gen))
            end = min(n, start + seq_len)
            pad = seq_len - (end - start)
            ids_b.append(torch.tensor(ids[start:end] + [0] * pad))
            hid_b.append(torch.cat([teacher.hidden[r][start:end].float(), torch.zeros(pad, width)]))
            mask_b.append(torch.tensor([1.0] * (end - start) + [0.0] * pad))
        ids_t = torch.stack(ids_b)
        yield (vocab.to_draft[ids_t] if vocab is not None else ids_t), torch.stack(hid_b), torch.stack(mask_b)


def evaluate(draft: torch.nn.Module, seqs: list[list[int]], prompt_lens: list[int], teacher: Teacher, k: int = 4,
             vocab: DraftVocab | None = None) -> dict:
    """The draft's greedy acceptance on held-out target continuations, teacher-forced (a draft token is accepted when
    it equals the target's argmax).

    Args:
        draft: the draft LM (its indices are ``vocab``'s when pruned).
        seqs: per held-out task, prompt ids + the target's greedy continuation.
        prompt_lens: their prompts' lengths in tokens; a sequence with fewer than 2 continuation tokens is skipped.
        teacher: the target's outputs over ``seqs`` (its argmax).
        k: draft tokens per step.
        vocab: the draft's pruned vocabulary, or None (the target's).

    Returns:
        dict: ``top1_agreement`` (fraction of the ``positions`` continuation positions where draft argmax == target
        argmax); ``acceptance_per_position`` (for drafts of ``k`` tokens started at every continuation position: the
        fraction whose first 1..k tokens all match; the draft runs on the target's tokens, a close proxy for greedy
        decoding where the accepted tokens are the target's); and the same drafts stepped as live greedy decoding
        steps them (a step starts only after the previous step's last token, so steps crowd into the positions the
        draft gets wrong and the live per-step acceptance is below the per-position agreement):
        ``live_acceptance_per_position`` (P(at least j+1 drafts accepted)), ``live_acceptance_rate``,
        ``live_tokens_per_step``, ``live_steps``.
    """
    agree = total = 0
    per_pos = [0] * k
    starts = 0
    live_hist = [0] * (k + 1)  # steps by number of drafts accepted
    with torch.inference_mode():
        for ids, plen, top in zip(seqs, prompt_lens, teacher.argmax):
            if len(ids) - plen < 2:
                continue
            if vocab is None:
                d_arg = draft(torch.tensor([ids])).logits[0, :-1].argmax(-1)
            else:
                logits = draft(torch.tensor([vocab.map_ids(ids)])).logits[0, :-1]
                d_arg = vocab.token_ids[logits[:, : vocab.unk_index].argmax(-1)]
            t_arg = top[: len(ids) - 1].long()  # teacher's argmax at the positions that have a next token
            match = (d_arg == t_arg)[plen - 1 :].tolist()
            agree += sum(match)
            total += len(match)
            for s in range(len(match)):
                starts += 1
                for j in range(k):
                    if s + j >= len(match) or not match[s + j]:
                        break
                    per_pos[j] += 1
            s = 0  # live greedy decoding: a step starts where the previous one's correction or bonus token ended
            while s < len(match):
                a = 0
                while a < k and s + a < len(match) and match[s + a]:
                    a += 1
                live_hist[a] += 1
                s += a + 1
    steps = max(1, sum(live_hist))
    return {"top1_agreement": agree / max(1, total), "positions": total,
            "acceptance_per_position": [c / max(1, starts) for c in per_pos],
            "live_steps": sum(live_hist),
            "live_acceptance_per_position": [sum(live_hist[j + 1 :]) / steps for j in range(k)],
            "live_acceptance_rate": sum(a * n for a, n in enumerate(live_hist)) / (k * steps),
            "live_tokens_per_step": sum((a + 1) * n for a, n in enumerate(live_hist)) / steps}


def main(argv: list[str] | None = None) -> int:
    """Run (or resume) the distillation; writes the draft folder. Returns 0."""
    from tqdm import tqdm

    from ..engine.surgery import prune_vocabulary, truncated_copy
    from ..proposers.draft_lm import default_draft_dir, default_draft_ready
    from ..proposers.draft_lm.artifacts import REPORT_FILE
    from .cli import optimizer_step, publish, start_run, tool_parser, training_data
    from .teacher import choose_vocabulary, distillation_loss, target_distribution, target_logits

    ap = tool_parser("spec_decode.training.draft", __doc__ or "", "draft folder (default: the cache's default draft)")
    ap.add_argument("--layers", type=int, default=3, help="decoder layers kept from the target")
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="keep the N most frequent tokens in the draft's vocabulary (0 = the target's full vocabulary)")
    ap.add_argument("--steps", type=int, default=400, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256, help="training window")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, cosine)")
    ap.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    ap.add_argument("--if-missing", action="store_true", help="do nothing when the default draft already exists")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.if_missing and args.output is None and default_draft_ready():
        logger.info("draft model ready at %s", default_draft_dir())
        return 0
    t_start = time.perf_counter()

    run = start_run(args.output, default_draft_dir(), args.target, args.seed, args.fresh, args.teacher_cache)
    out, work, target_dir, tok, target, teacher_cache = (run.out, run.work, run.target_dir, run.tokenizer, run.target,
                                                         run.cache)

    data = training_data(target, target_dir, tok, teacher_cache, stdlib_tokens=args.stdlib_tokens,
                         seq_len=args.corpus_seq_len, seed=args.seed, humaneval_tasks=args.humaneval_tasks,
                         eval_prompts=args.eval_prompts, eval_tokens=args.eval_tokens, phases=4,
                         dtype=args.teacher_dtype)
    corpus, teacher = data.corpus, data.teacher
    eval_seqs, eval_lens, eval_teacher = data.eval_sequences, data.eval_prompt_lens, data.eval_teacher
    data_key = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k not in ("output", "fresh", "if_missing", "checkpoint_every", "teacher_cache")}

    draft = truncated_copy(target, args.layers)
    vocab = None
    if 0 < args.draft_vocab < draft.config.vocab_size:
        vocab = choose_vocabulary(corpus.sequences, teacher.argmax, args.draft_vocab, draft.config.vocab_size,
                                  always=[t for t in (tok.eos_token_id,) if t is not None])
        prune_vocabulary(draft, vocab)
        covered = sum(int((vocab.to_draft[torch.tensor(s)] != vocab.unk_index).sum()) for s in eval_seqs)
        logger.info("draft vocabulary: %d tokens, covering %.2f%% of the held-out tokens", len(vocab),
                    100 * covered / sum(len(s) for s in eval_seqs))
    # the target's LM head over the kept tokens: its distribution there is the distillation target
    target_head = target.get_output_embeddings().weight.detach()
    target_head = (target_head if vocab is None else target_head[vocab.token_ids]).clone()
    kept = target_head.shape[0]  # the draft's logits past them (its "outside the set" row) are never proposed
    del target
    # The draft keeps the target's (tied) embeddings and LM head frozen: only its decoder layers and final norm learn,
    # which also saves the head's weight gradient, the largest matrix.
    draft.get_input_embeddings().weight.requires_grad_(False)
    draft.get_output_embeddings().weight.requires_grad_(False)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    gen = torch.Generator().manual_seed(args.seed)
    ckpt_file = work / f"checkpoint-L{args.layers}-V{args.draft_vocab}.pt"
    step, losses = 0, []
    if ckpt_file.exists():
        ck = torch.load(ckpt_file, weights_only=False)
        if ck.get("key") == data_key and ck.get("steps") == args.steps:
            draft.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            sched.load_state_dict(ck["sched"])
            gen.set_state(ck["gen"])
            step, losses = ck["step"], ck["losses"]
            logger.info("resuming from %s at step %d", ckpt_file, step)
    batches = _batches(corpus.sequences, teacher, args.seq_len, args.batch_size, gen, vocab)
    draft.train()
    logger.info("phase 3/4: distilling a %d-layer draft for %d steps", args.layers, args.steps)
    bar = tqdm(total=args.steps, initial=step, desc="distillation", unit="step")
    while step < args.steps:
        ids, hidden, mask = next(batches)
        target_dist = target_distribution(target_logits(hidden, target_head))
        loss = distillation_loss(draft(ids).logits[..., :kept], target_dist, mask)
        optimizer_step(loss, opt, sched, trainable)
        step += 1
        losses.append(loss.item())
        bar.set_postfix(kl=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
        bar.update(1)
        if step % args.checkpoint_every == 0 or step == args.steps:
            torch.save({"key": data_key, "steps": args.steps, "model": draft.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "gen": gen.get_state(), "step": step, "losses": losses},
                       ckpt_file)
    bar.close()
    draft.eval()
    logger.info("phase 4/4: evaluation on %d held-out HumanEval tasks (target greedy continuations)", len(eval_seqs))
    report = evaluate(draft, eval_seqs, eval_lens, eval_teacher, vocab=vocab)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    draft.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if vocab is not None:
        vocab.save(tmp)
    info = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "target": str(target_dir), "corpus": {"sequences": len(corpus.sequences), "tokens": corpus.tokens,
                                                  "stdlib_files": corpus.files,
                                                  "humaneval_tasks": args.humaneval_tasks},
            "draft_vocab": len(vocab) if vocab is not None else None, "loss_first": losses[0] if losses else None,
            "loss_last": sum(losses[-10:]) / max(1, len(losses[-10:])), "losses": losses, "eval": report,
            "minutes": (time.perf_counter() - t_start) / 60}
    (tmp / REPORT_FILE).write_text(json.dumps(info, indent=2))
    publish(tmp, out)
    logger.info("draft ready at %s: KL %.3f -> %.3f, held-out top-1 agreement %.3f, per-position acceptance %s",
                out, info["loss_first"] or float("nan"), info["loss_last"], report["top1_agreement"],
                ", ".join(f"{a:.2f}" for a in report["acceptance_per_position"]))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
