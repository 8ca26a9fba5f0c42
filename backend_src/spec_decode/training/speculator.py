"""Train the EAGLE-3 head on CPU: ``python -m spec_decode.training.speculator`` (``make speculator``).

The head (:class:`~spec_decode.proposers.eagle.eagle3.Eagle3Head`; EAGLE-3, Li et al. 2025, arXiv 2503.01840) drafts
from three of the target's layers: the inputs of its layers 2, L // 2 and L - 3 ([2, 15, 27] for SmolLM2-135M), fused
by ``fc``, then one decoder layer over [its normed input embedding; the normed fused state], a final norm and an LM
head over a draft vocabulary. It learns the target's predictions, teacher-forced, over code every machine has
(:mod:`spec_decode.training.corpus`: the standard library's sources and HumanEval's training tasks). The logged and
timed phases:

1. corpus: ``--stdlib-tokens`` of standard-library code (files in a seeded order) plus HumanEval tasks 20..163.
2. teacher: at every position, the target's last hidden state and the inputs of those layers, side by side as the
   server's wire carries them (:func:`spec_decode.training.teacher.cached_teacher`: kept under
   ``$SPEC_DECODE_CACHE/teacher``, resumed when interrupted; in bfloat16 where the CPU multiplies it natively,
   ``--teacher-dtype``); then the target's greedy continuations of the held-out tasks and its pass over them.
3. vocabulary: the ``--draft-vocab`` tokens most frequent in the corpus and in the target's predictions
   (EAGLE-3's ``d2t``/``t2d``); the head's LM head starts as the target's rows of them and its final norm as the
   target's (both train); its input embedding is the target's whole one (frozen).
4. train: windows of ``--seq-len`` pairs (:func:`windows`); the head's outputs unrolled ``--depth`` draft positions
   deep (:func:`unrolled_outputs`: EAGLE-3's training-time test, from the second position on it reads its own
   outputs, as drafting does), each learning the target's distribution of the next token there
   (:func:`unrolled_loss`: the KL to the target's LM head over the kept tokens, positions weighted 0.8^d, pairs whose
   target argmax is not kept masked, as EAGLE-3's trainer); AdamW, cosine schedule, seeded, bfloat16 products where
   the CPU has them, checkpointed every ``--checkpoint-every`` steps in ``<output>.work`` (a rerun resumes). After
   its first steps, and again every few steps, the training plans as many steps (at most ``--steps``) as end by
   ``--max-minutes`` at the pace it measures (:class:`StepPlan`): a loaded or slower machine trains fewer.
5. evaluate on the target's greedy continuations of held-out HumanEval tasks 0..``--eval-prompts``-1, with the
   serving proposer (:class:`~spec_decode.proposers.eagle.proposer.Eagle3Proposer`) stepped as live greedy decoding
   steps it (:func:`evaluate`): tokens per step and acceptance per draft position with k = 4 drafting every slot,
   and at the served confidence threshold.

The folder (``--output``, default ``$SPEC_DECODE_CACHE/models/SmolLM2-135M-Instruct-eagle``) is the published EAGLE-3
layout (:meth:`~spec_decode.proposers.eagle.eagle3.Eagle3Head.save`: ``config.json`` ``LlamaForCausalLMEagle3`` and
``model.safetensors``, as vLLM and SGLang load them), written whole under a temporary name, then renamed into place
(:func:`spec_decode.training.cli.publish`), with ``train_speculator.json`` (settings, corpus, loss curve, evaluation,
minutes per phase). The defaults fit the run in 15 minutes on a 2-core CPU without AMX; docs/trained-proposers.md
describes the tool for users and has the measured phases.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # the command line, before torch loads OpenMP (it reads this once)
    # OpenMP threads that sleep at a barrier instead of spinning: on a 2-core machine shared with other processes,
    # spinning threads fight them for the cores and the passes slow down 2-4x (the target's pass measured 3.5-4.8 ms
    # per token against 1.8 passive beside one busy process; docs/trained-proposers.md)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from .objective import (  # re-exported: the tool's tests use them from here
    WindowBatch,
    depth_weights,
    evaluate,
    unroll_mask,
    unrolled_loss,
    unrolled_outputs,
    windows,
)

logger = logging.getLogger(__name__)

# The tool's data defaults (its command line's; make draft keeps the shared ones of :mod:`.cli`): sized so that the
# whole run fits 15 minutes on a 2-core CPU without AMX (docs/trained-proposers.md has the measured phases).
DEFAULT_STDLIB_TOKENS = 100_000
DEFAULT_HUMANEVAL_TASKS = 144
DEFAULT_CORPUS_SEQ_LEN = 512
DEFAULT_EVAL_PROMPTS = 10
DEFAULT_EVAL_TOKENS = 96
DEFAULT_MAX_MINUTES = 12.0  # the run's ceiling: 3 minutes under the 15-minute budget for what the plan cannot see



__all__ = ["WindowBatch", "depth_weights", "evaluate", "main", "unroll_mask", "unrolled_loss", "unrolled_outputs",
           "windows"]


def head_config(target_config, draft_vocab: int) -> dict:
    """The EAGLE-3 head's config (:class:`~spec_decode.proposers.eagle.eagle3.Eagle3Head`) for a Llama-style target's
    transformers config: its layer's sizes (:func:`~spec_decode.proposers.eagle.model.eagle_config`), its hidden size,
    the draft vocabulary's size, and its rope scaling when it has one other than the default."""
    from ..proposers.eagle import eagle_config

    c = target_config
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    return {**eagle_config(c), "hidden_size": int(c.hidden_size), "draft_vocab_size": int(draft_vocab),
            "rope_scaling": dict(rope) if kind != "default" else None}


BUDGET_MINUTES = 15.0  # what make speculator must fit on a 2-core machine (Makefile, docs/trained-proposers.md)
PROBE_STEPS = 5  # the training plans its length against --max-minutes every this many steps, from the pace of the
PACE_STEPS = 20  # last this many steps
EVAL_RESERVE_MINUTES = 1.5  # kept for the evaluation and the writing of the head when planning


def main(argv: list[str] | None = None) -> int:
    """Run (or resume) the training; writes the head's folder (:meth:`~spec_decode.proposers.eagle.eagle3.Eagle3Head.
    save`'s layout and ``train_speculator.json``). Returns 0.

    Raises:
        SystemExit: bad options (argparse).
        ValueError: as :func:`~spec_decode.training.cli.training_data`.
    """
    from tqdm import tqdm

    from ..proposers.eagle import REPORT_FILE, Eagle3Head, Eagle3Proposer, default_eagle_dir
    from ..proposers.speculators.base import SpeculatorSettings
    from .cli import optimizer_step, publish, start_run, tool_parser, training_data
    from .teacher import choose_vocabulary

    ap = tool_parser("spec_decode.training.speculator", __doc__ or "", "head folder (default: the cache's default)")
    ap.set_defaults(stdlib_tokens=DEFAULT_STDLIB_TOKENS, humaneval_tasks=DEFAULT_HUMANEVAL_TASKS,
                    corpus_seq_len=DEFAULT_CORPUS_SEQ_LEN, eval_prompts=DEFAULT_EVAL_PROMPTS,
                    eval_tokens=DEFAULT_EVAL_TOKENS)
    ap.add_argument("--draft-vocab", type=int, default=8192, help="tokens of the head's LM head (draft vocabulary)")
    ap.add_argument("--seq-len", type=int, default=128, help="pairs per training window")
    ap.add_argument("--depth", type=int, default=3, help="draft positions unrolled in training (>= 1)")
    ap.add_argument("--steps", type=int, default=400, help="optimizer steps (fewer when --max-minutes says so)")
    ap.add_argument("--batch-size", type=int, default=12, help="windows per step")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, cosine)")
    ap.add_argument("--feature-weight", type=float, default=0.0,
                    help="EAGLE-1's hidden-state regression; EAGLE-3 has none: accepted and ignored")
    ap.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    ap.add_argument("--max-minutes", type=float, default=DEFAULT_MAX_MINUTES,
                    help="wall-clock ceiling of the run: every few steps the training plans as many steps (at most "
                         "--steps) as end by then at its measured pace, leaving time to evaluate and write the head "
                         "(a loaded or slower machine trains fewer); 0: no ceiling")
    ap.add_argument("--if-missing", action="store_true", help="do nothing when the default head exists")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.depth < 1:
        ap.error(f"--depth must be >= 1, got {args.depth}")
    if args.feature_weight:
        logger.warning("--feature-weight %g ignored: the EAGLE-3 head learns the target's distributions alone",
                       args.feature_weight)
    default_out = default_eagle_dir()
    if args.if_missing and args.output is None and (default_out / REPORT_FILE).exists():
        logger.info("EAGLE head ready at %s", default_out)
        return 0
    t_start = time.perf_counter()
    clock = PhaseClock()
    run = start_run(args.output, default_out, args.target, args.seed, args.fresh, args.teacher_cache)
    out, work, target_dir, tok, target = run.out, run.work, run.target_dir, run.tokenizer, run.target
    clock.lap("setup")

    data = training_data(target, target_dir, tok, run.cache, stdlib_tokens=args.stdlib_tokens,
                         seq_len=args.corpus_seq_len, seed=args.seed, humaneval_tasks=args.humaneval_tasks,
                         eval_prompts=args.eval_prompts, eval_tokens=args.eval_tokens, phases=5,
                         dtype=args.teacher_dtype)
    corpus, teacher, layer_ids = data.corpus, data.teacher, list(data.aux_layers)
    clock.add(data.minutes)
    if len(layer_ids) != 3:
        raise ValueError(f"the EAGLE-3 head reads 3 target layers; a target of {target.config.num_hidden_layers} "
                         f"layers gives {layer_ids}")

    logger.info("phase 3/5: vocabulary of %d tokens", args.draft_vocab)
    vocab = choose_vocabulary(corpus.sequences, teacher.argmax, args.draft_vocab, target.config.vocab_size,
                              always=[t for t in (tok.eos_token_id,) if t is not None])
    kept = torch.zeros(vocab.target_vocab_size, dtype=torch.bool)
    kept[vocab.token_ids] = True
    target_head = target.get_output_embeddings().weight.detach()[vocab.token_ids].float().clone()
    model = Eagle3Head(target.get_input_embeddings().weight.detach(), head_config(target.config, len(vocab)))
    with torch.no_grad():  # the head's LM head and final norm start as the target's (its rows of the kept tokens)
        model.lm_head.weight.copy_(target_head)
        final_norm = getattr(target.get_decoder(), "norm", None)
        if final_norm is not None:
            model.norm.weight.copy_(final_norm.weight.detach().float())
    held = sum(int(kept[torch.tensor(s)].sum()) for s in data.eval_sequences)
    logger.info("  covering %.2f%% of the held-out tokens", 100 * held / max(1, sum(map(len, data.eval_sequences))))
    del target
    clock.lap("vocabulary")

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    plan = StepPlan(args.steps)
    warmup = max(1, min(50, args.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, plan.steps) / plan.steps)))
    gen = torch.Generator().manual_seed(args.seed)
    key = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
           if k not in ("output", "fresh", "if_missing", "checkpoint_every", "teacher_cache", "max_minutes")}
    key["head"] = "eagle3"
    ckpt_file = work / "checkpoint.pt"
    step, losses, per_depth = 0, [], []
    if ckpt_file.exists():
        ck = torch.load(ckpt_file, weights_only=False)
        if ck.get("key") == key:
            model.load_state_dict({**ck["model"], "embedding": model.embedding})
            opt.load_state_dict(ck["opt"])
            sched.load_state_dict(ck["sched"])
            gen.set_state(ck["gen"])
            step, losses, per_depth = ck["step"], ck["losses"], ck["per_depth"]
            plan.steps = ck["planned_steps"]
            logger.info("resuming from %s at step %d of %d", ckpt_file, step, plan.steps)
    batches = windows(corpus.sequences, teacher, args.seq_len, args.batch_size, gen, kept)
    logger.info("phase 4/5: training the EAGLE-3 head (layers %s) %d positions deep for %d steps of %d windows of "
                "%d pairs (%d corpus tokens)", ", ".join(map(str, layer_ids)), args.depth, plan.steps,
                args.batch_size, args.seq_len, corpus.tokens)
    model.train()
    bar = tqdm(total=plan.steps, initial=step, desc="EAGLE-3 head", unit="step")
    stamps = [time.perf_counter()]  # when each step of this invocation ended (the first: when training began)
    logged = plan.steps
    while step < plan.steps:
        loss, per = unrolled_loss(model, next(batches), args.depth, target_head)
        optimizer_step(loss, opt, sched, trainable)
        step += 1
        losses.append(loss.item())
        per_depth.append(per)
        bar.set_postfix(kl=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        bar.update(1)
        stamps.append(time.perf_counter())
        if args.max_minutes > 0 and (len(stamps) - 1) % PROBE_STEPS == 0:
            recent = stamps[-PACE_STEPS - 1 :]
            pace = (recent[-1] - recent[0]) / 60 / (len(recent) - 1)
            if plan.fit(step, pace, args.max_minutes - (stamps[-1] - t_start) / 60 - EVAL_RESERVE_MINUTES):
                bar.total = plan.steps
                bar.refresh()
                if abs(plan.steps - logged) >= max(10, logged // 10):
                    logger.info("  at %.3f min per step, %d steps end by the %.1f-minute ceiling (--max-minutes)",
                                pace, plan.steps, args.max_minutes)
                    logged = plan.steps
        if step % args.checkpoint_every == 0 or step == plan.steps:
            state = {k: v for k, v in model.state_dict().items() if k != "embedding"}  # the target's, not trained
            torch.save({"key": key, "model": state, "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "gen": gen.get_state(), "step": step, "losses": losses, "per_depth": per_depth,
                        "planned_steps": plan.steps}, ckpt_file)
    bar.close()
    model.eval()
    clock.lap("train")

    logger.info("phase 5/5: evaluation on %d held-out HumanEval tasks (target greedy continuations)",
                len(data.eval_sequences))
    served = SpeculatorSettings().speculator_min_token_prob
    report = {"every_slot": evaluate(Eagle3Proposer(model, vocab, 0.0), data.eval_sequences, data.eval_prompt_lens,
                                     data.eval_teacher),
              f"min_token_prob_{served}": evaluate(Eagle3Proposer(model, vocab, served), data.eval_sequences,
                                                   data.eval_prompt_lens, data.eval_teacher)}
    clock.lap("evaluate")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save(tmp, vocab, layer_ids, {"spec_decode": {"trained_by": "spec_decode.training.speculator",
                                                       "target": str(target_dir)}})
    clock.lap("save")
    last = per_depth[-20:]
    total = (time.perf_counter() - t_start) / 60
    info = {"settings": key, "head": "eagle3", "target": str(target_dir), "aux_layers": layer_ids, "corpus": {
                "sequences": len(corpus.sequences), "tokens": corpus.tokens, "stdlib_files": corpus.files,
                "humaneval_tasks": args.humaneval_tasks},
            "draft_vocab": len(vocab), "parameters": sum(p.numel() for p in trainable),
            "loss_first": losses[0] if losses else None,
            "loss_last": sum(losses[-20:]) / max(1, len(losses[-20:])),
            "loss_last_per_depth": [sum(p[d] for p in last) / max(1, len(last)) for d in range(args.depth)],
            "steps": plan.steps, "losses": losses, "eval": report, "minutes": total, "phase_minutes": clock.minutes,
            "teacher_ms_per_token": clock.minutes.get("teacher", 0.0) * 60e3 / max(1, corpus.tokens),
            "budget_minutes": BUDGET_MINUTES, "within_budget": total <= BUDGET_MINUTES}
    (tmp / REPORT_FILE).write_text(json.dumps(info, indent=2))
    publish(tmp, out)
    every = report["every_slot"]
    logger.info("EAGLE-3 head ready at %s: KL %.3f -> %.3f; held-out, drafting every slot of 4: %.2f tokens per step, "
                "acceptance per position %s; at min_token_prob %.2f: %.2f tokens per step, acceptance rate %.2f",
                out, info["loss_first"] or float("nan"), info["loss_last"], every["tokens_per_step"],
                ", ".join(f"{a:.2f}" for a in every["acceptance_per_position"]), served,
                report[f"min_token_prob_{served}"]["tokens_per_step"],
                report[f"min_token_prob_{served}"]["acceptance_rate"])
    logger.info("minutes per phase: %s; total %.1f: %s the %.0f-minute budget", ", ".join(
        f"{name} {m:.2f}" for name, m in clock.minutes.items()), total,
        "within" if info["within_budget"] else "OVER", BUDGET_MINUTES)
    return 0


class StepPlan:
    """How many optimizer steps a run takes: ``limit`` (``--steps``), or fewer while the time left would not fit them
    (:meth:`fit`, every few steps: the plan follows the machine's pace, which other processes change).

    Attributes:
        limit: the most steps.
        steps: the planned total, in [the steps already taken, ``limit``].
    """

    def __init__(self, limit: int) -> None:
        self.limit = self.steps = limit

    def fit(self, done: int, minutes_per_step: float, minutes_left: float) -> bool:
        """Plan ``done`` + the steps that fit ``minutes_left`` at ``minutes_per_step``, within [``done``,
        ``limit``]; returns whether the plan changed."""
        fits = done + max(0, int(minutes_left / max(minutes_per_step, 1e-9)))
        new = max(done, min(self.limit, fits))
        changed, self.steps = new != self.steps, new
        return changed


class PhaseClock:
    """Wall-clock minutes of a run's phases, in order (:attr:`minutes`; a phase timed twice adds up)."""

    def __init__(self) -> None:
        self.minutes: dict[str, float] = {}
        self._at = time.perf_counter()

    def lap(self, name: str) -> None:
        """Charge the time since the last lap (or the clock's start) to phase ``name``."""
        now = time.perf_counter()
        self.minutes[name] = self.minutes.get(name, 0.0) + (now - self._at) / 60
        self._at = now

    def add(self, minutes: dict[str, float]) -> None:
        """Record phases timed elsewhere (``{name: minutes}``, e.g. :attr:`~spec_decode.training.cli.TrainingData.
        minutes`) and restart the lap from now."""
        for name, m in minutes.items():
            self.minutes[name] = self.minutes.get(name, 0.0) + m
        self._at = time.perf_counter()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
