"""Train the MLP speculator on CPU: ``python -m spec_decode.train_speculator`` (``make speculator``).

The speculator (:mod:`spec_decode.proposers.mlp_speculator`; Wertheimer et al. 2024) drafts from the target's last
hidden state. It learns the target's own predictions, teacher-forced, over code every machine has
(:mod:`spec_decode.corpus`: the standard library's sources and HumanEval's training tasks):

1. corpus: ``--stdlib-tokens`` of standard-library code (files in a seeded order) plus HumanEval tasks 20..163.
2. teacher: the target's last hidden states and top ``--top-k`` next-token log-probabilities at every position
   (:func:`spec_decode.teacher.cached_teacher`: kept under ``$SPEC_DECODE_CACHE/teacher``, shared with ``make draft``,
   resumed when interrupted).
3. vocabulary: the ``--draft-vocab`` tokens most frequent in the corpus and in the target's predictions; the
   speculator's input embedding and LM head are the target's rows of them (frozen).
4. train: for a position t with hidden state h_t, stage i reads token x_{t+1+i} and learns the target's distribution at
   t+1+i (KL over the teacher's top-k, renormalised over the kept tokens); AdamW, cosine schedule, seeded, checkpointed
   every ``--checkpoint-every`` steps in ``<output>.work`` (a rerun resumes).
5. evaluate on the target's greedy continuations of held-out HumanEval tasks 0..``--eval-prompts``-1: each stage's
   top-1 agreement with the target, and the speculator stepped as live greedy decoding steps it (a step drafts
   ``--n-predict`` tokens from the state before its last token; it accepts while they equal the target's): accepted
   per position, acceptance rate, tokens per step.

The folder (``--output``, default ``$SPEC_DECODE_CACHE/models/SmolLM2-135M-Instruct-mlp-speculator``) is written
atomically with ``train_speculator.json`` (settings, corpus, loss curve, evaluation, minutes). About 11 minutes on
2 CPU cores with the defaults, most of it the teacher's forward passes (about 450-700 tokens/s here).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


class _Flat:
    """A corpus and its teacher outputs laid end to end: position p's next positions p+1.. while in its sequence."""

    def __init__(self, sequences: list[list[int]], teacher):
        self.tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
        self.hidden = torch.cat(teacher.hidden)  # [P, H] float16
        self.logp = torch.cat(teacher.top_logp)  # [P, K] float16
        self.idx = torch.cat(teacher.top_idx).long()  # [P, K]
        ends = torch.cumsum(torch.tensor([len(s) for s in sequences]), 0)
        self.end = torch.repeat_interleave(ends, torch.tensor([len(s) for s in sequences]))  # sequence end per position
        self.starts = torch.nonzero(torch.arange(len(self.tokens)) + 1 < self.end).squeeze(1)  # positions with a next

    def batch(self, positions: torch.Tensor, n_predict: int, vocab):
        """(hidden [B, H], stage input tokens [B, n], teacher log-probs [B, n, K], teacher ids [B, n, K], mask [B, n])
        for starts ``positions``; ids in the draft vocabulary (teacher entries outside it get -inf)."""
        q = positions[:, None] + 1 + torch.arange(n_predict)[None]  # the positions stage i predicts at
        mask = (q < self.end[positions][:, None]).float()
        q = torch.minimum(q, torch.tensor(len(self.tokens) - 1))
        tokens = vocab.to_draft[self.tokens[q]]
        logp, idx = self.logp[q].float(), vocab.to_draft[self.idx[q]]
        outside = idx == vocab.unk_index
        logp = logp.masked_fill(outside, float("-inf"))
        mask = mask * (~outside.all(-1)).float()
        logp = logp.masked_fill(outside.all(-1, keepdim=True), 0.0)  # fully masked rows: finite, not counted
        return self.hidden[positions].float(), tokens, logp, idx.masked_fill(outside, 0), mask


def evaluate(model, vocab, sequences: list[list[int]], prompt_lens: list[int], teacher) -> dict:
    """Held-out metrics on target greedy continuations (where the text is the target's own choice, so the teacher-
    forced agreement is what a live step accepts).

    Returns:
        dict: ``stage_agreement`` (per stage, top-1 agreement with the target given the true previous tokens),
        ``live_acceptance_per_position`` (P(at least j+1 drafts accepted) per step), ``live_acceptance_rate``,
        ``live_tokens_per_step``, ``live_steps``, ``positions``.
    """
    n = model.n_predict
    agree, counted = [0] * n, [0] * n
    hist = [0] * (n + 1)
    with torch.inference_mode():
        for seq, plen, lp_idx, hid in zip(sequences, prompt_lens, teacher.top_idx, teacher.hidden):
            target = lp_idx[:, 0].long()  # the target's argmax at every position
            ids = torch.tensor(seq)
            # teacher-forced: stage i at start t reads x_{t+1+i}, predicts at t+1+i
            for t in range(plen - 2, len(seq) - 1):
                state = hid[t : t + 1].float()
                for i in range(n):
                    q = t + 1 + i
                    if q >= len(seq):
                        break
                    state, logits = model.stage(i, state, vocab.to_draft[ids[q : q + 1]])
                    guess = vocab.token_ids[logits.argmax(-1)]
                    agree[i] += int(guess[0] == target[q])
                    counted[i] += 1
            # live: a step starts after the previous step's last token and drafts from its own guesses
            s = plen - 1  # index of the last committed token
            while s < len(seq) - 1:
                state, tok, a = hid[s - 1 : s].float(), vocab.to_draft[ids[s : s + 1]], 0
                for i in range(n):
                    q = s + i
                    if q >= len(seq) - 1:
                        break
                    state, logits = model.stage(i, state, tok)
                    guess = logits.argmax(-1)
                    if vocab.token_ids[guess][0] != target[q]:
                        break
                    a, tok = a + 1, guess
                hist[a] += 1
                s += a + 1
    steps = max(1, sum(hist))
    return {"stage_agreement": [a / max(1, c) for a, c in zip(agree, counted)], "positions": counted[0],
            "live_steps": sum(hist), "live_acceptance_per_position": [sum(hist[j + 1 :]) / steps for j in range(n)],
            "live_acceptance_rate": sum(a * c for a, c in enumerate(hist)) / (n * steps),
            "live_tokens_per_step": sum((a + 1) * c for a, c in enumerate(hist)) / steps}


def main(argv: list[str] | None = None) -> int:
    """Run (or resume) the training; writes the speculator folder. Returns 0."""
    from tqdm import tqdm

    from .proposers.mlp_speculator import REPORT_FILE, MLPSpeculator, default_speculator_dir
    from .teacher import add_data_arguments, start_run, training_data
    from .train_draft import choose_vocabulary, distillation_loss

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_arguments(ap)
    ap.add_argument("--output", type=Path, default=None, help="speculator folder (default: the cache's default)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--n-predict", type=int, default=4, help="stages: the most tokens a step drafts")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="kept tokens of the embedding and LM head")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch-size", type=int, default=256, help="positions per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--if-missing", action="store_true", help="do nothing when the default speculator exists")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    default_out = default_speculator_dir()
    if args.if_missing and args.output is None and (default_out / REPORT_FILE).exists():
        logger.info("speculator ready at %s", default_out)
        return 0
    t_start = time.perf_counter()
    run = start_run(args.output, default_out, args.target, args.seed, args.fresh, args.teacher_cache)
    out, work, target_dir, tok, target, teacher_cache = (run.out, run.work, run.target_dir, run.tokenizer, run.target,
                                                         run.cache)

    data = training_data(target, target_dir, tok, teacher_cache, stdlib_tokens=args.stdlib_tokens,
                         seq_len=args.seq_len, seed=args.seed, humaneval_tasks=args.humaneval_tasks, top_k=args.top_k,
                         eval_prompts=args.eval_prompts, eval_tokens=args.eval_tokens, with_hidden=True,
                         phases=5)
    corpus, teacher = data.corpus, data.teacher
    eval_seqs, eval_lens, eval_teacher = data.eval_sequences, data.eval_prompt_lens, data.eval_teacher

    logger.info("phase 3/5: vocabulary of %d tokens", args.draft_vocab)
    vocab = choose_vocabulary(corpus.sequences, list(zip(teacher.top_logp, teacher.top_idx)), args.draft_vocab,
                              target.config.vocab_size, always=[t for t in (tok.eos_token_id,) if t is not None])
    emb = target.get_input_embeddings().weight.detach()[vocab.token_ids]
    head = target.get_output_embeddings().weight.detach()[vocab.token_ids]
    model = MLPSpeculator(torch.cat([emb, emb.mean(0, keepdim=True)]), head, args.n_predict)
    del target
    flat = _Flat(corpus.sequences, teacher)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    gen = torch.Generator().manual_seed(args.seed)
    key = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
           if k not in ("output", "fresh", "if_missing", "checkpoint_every", "teacher_cache")}
    ckpt_file = work / "checkpoint.pt"
    step, losses = 0, []
    if ckpt_file.exists():
        ck = torch.load(ckpt_file, weights_only=False)
        if ck.get("key") == key:
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            sched.load_state_dict(ck["sched"])
            gen.set_state(ck["gen"])
            step, losses = ck["step"], ck["losses"]
            logger.info("resuming from %s at step %d", ckpt_file, step)
    logger.info("phase 4/5: training %d stages for %d steps of %d positions (%d positions in all)", args.n_predict,
                args.steps, args.batch_size, len(flat.starts))
    model.train()
    bar = tqdm(total=args.steps, initial=step, desc="speculator", unit="step")
    while step < args.steps:
        pos = flat.starts[torch.randint(len(flat.starts), (args.batch_size,), generator=gen)]
        hidden, tokens, t_lp, t_idx, mask = flat.batch(pos, args.n_predict, vocab)
        logits = model(hidden, tokens)
        loss = sum(distillation_loss(logits[:, i : i + 1], t_lp[:, i : i + 1], t_idx[:, i : i + 1],
                                     mask[:, i : i + 1]) for i in range(args.n_predict)) / args.n_predict
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        sched.step()
        step += 1
        losses.append(loss.item())
        bar.set_postfix(kl=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        bar.update(1)
        if step % args.checkpoint_every == 0 or step == args.steps:
            torch.save({"key": key, "model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "gen": gen.get_state(), "step": step, "losses": losses}, ckpt_file)
    bar.close()
    model.eval()
    logger.info("phase 5/5: evaluation on %d held-out HumanEval tasks (target greedy continuations)", len(eval_seqs))
    report = evaluate(model, vocab, eval_seqs, eval_lens, eval_teacher)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save(tmp, vocab, {"target": str(target_dir)})
    info = {"settings": key, "target": str(target_dir), "corpus": {
                "sequences": len(corpus.sequences), "tokens": corpus.tokens, "stdlib_files": corpus.files,
                "humaneval_tasks": args.humaneval_tasks},
            "draft_vocab": len(vocab), "parameters": sum(p.numel() for p in trainable),
            "loss_first": losses[0] if losses else None,
            "loss_last": sum(losses[-20:]) / max(1, len(losses[-20:])), "losses": losses, "eval": report,
            "minutes": (time.perf_counter() - t_start) / 60}
    (tmp / REPORT_FILE).write_text(json.dumps(info, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    logger.info("speculator ready at %s: KL %.3f -> %.3f; held-out stage agreement %s; live tokens per step %.2f "
                "(acceptance %.2f) in %.1f minutes", out, info["loss_first"] or float("nan"), info["loss_last"],
                ", ".join(f"{a:.2f}" for a in report["stage_agreement"]), report["live_tokens_per_step"],
                report["live_acceptance_rate"], info["minutes"])
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
