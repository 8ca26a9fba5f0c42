"""The training tools' shared command line: their data options, the run's folders and target, publishing the result.

``make draft`` (:mod:`.draft`) and ``make speculator`` (:mod:`.speculator`) parse their command line from one base
(:func:`tool_parser`, with the data options of :func:`add_data_arguments`), start the same way (:func:`start_run`),
build the same data (:func:`training_data`: the corpus, the target's passes over it, the held-out evaluation) and
publish their folder the same way (:func:`publish`).
docs/trained-proposers.md describes the tools and their options for users.
"""

from __future__ import annotations

import argparse
import copy
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .teacher import CausalLM, Teacher, cached_teacher, greedy_continuations, teacher_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .corpus import Corpus

logger = logging.getLogger(__name__)


@dataclass
class TrainingData:
    """What ``make draft`` and ``make speculator`` learn from and are evaluated on (:func:`training_data`).

    Attributes:
        corpus: the training corpus (:class:`~spec_decode.training.corpus.Corpus`).
        teacher: the target's outputs over ``corpus.sequences``.
        eval_sequences: per held-out HumanEval task, prompt ids + the target's greedy continuation.
        eval_prompt_lens: their prompts' lengths in tokens.
        eval_teacher: the target's outputs over ``eval_sequences``.
        aux_layers: the target layers whose inputs both teachers hold beside the last hidden state
            (:attr:`~.teacher.Teacher.wire`).
        minutes: wall-clock minutes of the phases: ``corpus``, ``teacher`` (the corpus' pass), ``held_out`` (the
            target's continuations of the held-out tasks and its pass over them).
    """

    corpus: Corpus
    teacher: Teacher
    eval_sequences: list[list[int]]
    eval_prompt_lens: list[int]
    eval_teacher: Teacher
    aux_layers: tuple[int, ...] = ()
    minutes: dict[str, float] = field(default_factory=dict)


def teacher_layers(target: CausalLM) -> tuple[int, ...]:
    """The target layers whose inputs the teacher's passes keep: EAGLE-3's defaults (layers 2, L // 2 and L - 3,
    :func:`~spec_decode.proposers.speculators.eagle3_layer_ids`; [2, 15, 27] for the 30-layer SmolLM2-135M), the same
    for both tools so that they share one pass; none for a target of fewer than 6 layers (tests' tiny models)."""
    from ..proposers.speculators.layouts import eagle3_layer_ids

    layers = int(target.config.num_hidden_layers)
    return tuple(eagle3_layer_ids({}, layers)) if layers >= 6 else ()


def training_data(target: CausalLM, target_dir: Path, tok: PreTrainedTokenizerBase, cache: Path, *,
                  stdlib_tokens: int, seq_len: int, seed: int, humaneval_tasks: int, eval_prompts: int,
                  eval_tokens: int, phases: int, dtype: str = "auto",
                  aux_layers: tuple[int, ...] | None = None) -> TrainingData:
    """The training tools' phases 1 and 2 (of ``phases``, logged and timed): the corpus, the target's passes over it
    (cached under ``cache``; the corpus' in ``dtype``, as :func:`~.teacher.teacher_dtype` reads it; with the inputs of
    ``aux_layers``, default :func:`teacher_layers`, beside the last hidden state) and the held-out tasks
    0..``eval_prompts``-1 continued greedily by the target for ``eval_tokens`` tokens, with its passes (in the
    target's own dtype, float32 as it is served on CPU, so the held-out metrics read what the server computes).
    The corpus' pass logs its cost in ms per token when it ran.

    The other keywords are :func:`~.corpus.training_corpus`'s (``seq_len`` its longest window).

    Raises:
        ValueError: ``eval_prompts`` outside [1, HELD_OUT], or an unknown ``dtype``.
    """
    from .corpus import HELD_OUT, heldout_tasks, training_corpus

    if not 1 <= eval_prompts <= HELD_OUT:
        raise ValueError(f"--eval-prompts must be in [1, {HELD_OUT}], got {eval_prompts}")
    aux = teacher_layers(target) if aux_layers is None else tuple(aux_layers)
    minutes: dict[str, float] = {}
    t0 = time.perf_counter()
    logger.info("phase 1/%d: corpus (standard library up to %d tokens, HumanEval tasks from %d)", phases,
                stdlib_tokens, HELD_OUT)
    corpus = training_corpus(tok, stdlib_tokens, seq_len, seed, humaneval_tasks)
    logger.info("  %d sequences, %d tokens, %d standard-library files", len(corpus.sequences), corpus.tokens,
                len(corpus.files))
    minutes["corpus"] = (time.perf_counter() - t0) / 60
    t0 = time.perf_counter()
    corpus_dtype = teacher_dtype(dtype, next(target.parameters()).device)
    logger.info("phase 2/%d: the target's hidden states (%s; last hidden state%s)", phases,
                str(corpus_dtype).removeprefix("torch."),
                f" and the inputs of layers {', '.join(map(str, aux))}" if aux else "")
    same = corpus_dtype == next(target.parameters()).dtype
    teacher_model = target if same else copy.deepcopy(target).to(corpus_dtype)
    teacher = cached_teacher(teacher_model, target_dir, corpus.sequences, cache, aux_layers=aux)
    del teacher_model
    minutes["teacher"] = (time.perf_counter() - t0) / 60
    logger.info("  %.2f min, %.2f ms per corpus token (0 when cached)", minutes["teacher"],
                minutes["teacher"] * 60e3 / max(1, corpus.tokens))
    t0 = time.perf_counter()
    tasks = heldout_tasks(eval_prompts)
    eval_seqs = greedy_continuations(target, tok, [t["prompt"] for t in tasks], eval_tokens, cache=cache)
    eval_lens = [len(tok(t["prompt"])["input_ids"]) for t in tasks]
    eval_teacher = cached_teacher(target, target_dir, eval_seqs, cache, aux_layers=aux)
    minutes["held_out"] = (time.perf_counter() - t0) / 60
    return TrainingData(corpus, teacher, eval_seqs, eval_lens, eval_teacher, aux, minutes)


@dataclass
class TrainingRun:
    """A training tool's folders and target (:func:`start_run`).

    Attributes:
        out: the folder the tool writes (atomically, at the end).
        work: ``<out>.work``, its checkpoints.
        target_dir: the target's folder.
        tokenizer: the target's tokenizer.
        target: the target (float32 on CPU, eval mode).
        cache: where the teacher's passes are kept.
    """

    out: Path
    work: Path
    target_dir: Path
    tokenizer: PreTrainedTokenizerBase
    target: CausalLM
    cache: Path


def start_run(output: Path | None, default_output: Path, target: str, seed: int, fresh: bool,
              teacher_cache: Path | None) -> TrainingRun:
    """Make the work folder ``<out>.work`` (emptied when ``fresh``), seed torch, and load the target (``target``: a
    folder, or ``"default"``: the embedded one, converted on first use) and its tokenizer. ``out`` is ``output`` or
    else ``default_output``; the teacher's cache ``teacher_cache`` or else ``$SPEC_DECODE_CACHE/teacher``.

    Raises:
        FileNotFoundError: ``"default"`` without the embedded model's package
            (:func:`~spec_decode.engine.model_loading.prepare_default_model`).
        OSError, ValueError: a ``target`` that is not a model folder (transformers' errors).
    """
    from ..engine.model_loading import cache_dir, load_causal_lm, load_tokenizer, prepare_default_model

    out = Path(output or default_output).expanduser()
    work = out.with_name(out.name + ".work")
    if fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    target_dir = prepare_default_model() if target == "default" else Path(target)
    model = load_causal_lm(target_dir, torch.device("cpu"), torch.float32).eval()
    return TrainingRun(out, work, target_dir, load_tokenizer(target_dir), model,
                       teacher_cache or cache_dir() / "teacher")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` of ``make draft``/``make speculator``: each option's default, except unset ones (None, False)."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, False) else super()._get_help_string(action)


def publish(tmp: Path, out: Path) -> None:
    """Move the finished folder ``tmp`` to ``out``, replacing an older one: the old folder is first renamed aside
    (``<out>.old``), so ``out`` is never half-written (only missing between two renames), and removed last.

    Raises:
        OSError: a rename fails (``tmp`` and ``out`` must be on one file system).
    """
    old = out.with_name(out.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    if old.exists():
        shutil.rmtree(old)


def add_data_arguments(ap: argparse.ArgumentParser) -> None:
    """The command-line options ``make draft`` and ``make speculator`` share (the target, the corpus, the teacher,
    the held-out evaluation, the seed), added to the ``argparse.ArgumentParser`` ``ap``."""
    from .corpus import DEFAULT_STDLIB_TOKENS

    ap.add_argument("--target", default="default", help="target folder ('default' = embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--stdlib-tokens", type=int, default=DEFAULT_STDLIB_TOKENS,
                    help="standard-library tokens to learn from")
    ap.add_argument("--humaneval-tasks", type=int, default=144, help="HumanEval training tasks (20.. on) to learn from")
    ap.add_argument("--teacher-cache", type=Path, default=None,
                    help="where the target's passes are kept (default $SPEC_DECODE_CACHE/teacher)")
    ap.add_argument("--teacher-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="dtype of the target's pass over the corpus (auto: bfloat16 where the CPU multiplies it "
                         "natively)")
    ap.add_argument("--eval-prompts", type=int, default=10, help="held-out HumanEval tasks continued for evaluation")
    ap.add_argument("--eval-tokens", type=int, default=128, help="target continuation length per held-out task")
    ap.add_argument("--seed", type=int, default=0, help="seed of the corpus order, the batches and the init")
    ap.add_argument("--fresh", action="store_true", help="ignore the work folder's checkpoint")


def tool_parser(module: str, doc: str, output_help: str) -> argparse.ArgumentParser:
    """The command line both tools start from: ``python -m <module>``, the description (``doc``'s first paragraph), the
    data options (:func:`add_data_arguments`), ``--output`` (helped by ``output_help``) and ``--corpus-seq-len``, which
    must be the same in both for them to share the teacher's pass."""
    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    add_data_arguments(ap)
    ap.add_argument("--output", type=Path, default=None, help=output_help)
    ap.add_argument("--corpus-seq-len", type=int, default=512,
                    help="longest corpus window (the same default in make draft and make speculator)")
    return ap


def optimizer_step(loss: torch.Tensor, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
                   params: list[torch.nn.Parameter]) -> None:
    """One training step of both tools: backpropagate ``loss``, clip the gradients of ``params`` to norm 1.0, step
    the optimizer (AdamW) and the learning-rate schedule."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
