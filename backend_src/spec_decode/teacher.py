"""The target as a teacher: its next-token distributions and last hidden states over a corpus, teacher-forced.

One batched forward pass per group of sequences (:func:`teacher_pass`) keeps, for every position t of a sequence x,
the target's top-k log-probabilities of p(x_{t+1} | x_0..x_t) (the sparse distillation target, Hinton et al. 2015) and,
when asked, its last hidden state after x_t (after the final norm: what its LM head reads, and what a hidden-state
speculator drafts from). :func:`cached_teacher` keeps the result on disk in shards, outside the repository, so an
interrupted run resumes and ``make draft`` and ``make speculator`` share one pass.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@dataclass
class Teacher:
    """The teacher's outputs for a list of sequences (index i: sequence i, positions 0..len-1).

    Attributes:
        top_logp: per sequence [n, K] float16, the top-K log-probabilities of the next token at each position.
        top_idx: per sequence [n, K] int32, their token ids (column 0: the target's argmax).
        hidden: per sequence [n, H] float16 last hidden states, or None when not kept.
    """

    top_logp: list[torch.Tensor]
    top_idx: list[torch.Tensor]
    hidden: list[torch.Tensor] | None = None


@torch.inference_mode()
def teacher_pass(model, sequences: list[list[int]], top_k: int = 32, with_hidden: bool = False,
                 batch_tokens: int = 2048, progress: bool = True) -> Teacher:
    """The target's top-k next-token log-probabilities (and hidden states) at every position of every sequence.

    Sequences are grouped by length (right padding, masked) into forwards of about ``batch_tokens`` tokens.

    Args:
        model: a transformers causal LM (``get_decoder()`` and ``get_output_embeddings()``), in eval mode.
        sequences: token-id lists (each >= 1 token).
        top_k: probabilities kept per position.
        with_hidden: also keep the last hidden states.
        batch_tokens: the most (padded) tokens per forward.
        progress: show a progress bar (tqdm).

    Returns:
        :class:`Teacher`, in the order of ``sequences``.
    """
    from tqdm import tqdm

    decoder, head = model.get_decoder(), model.get_output_embeddings()
    dev = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    logp: list = [None] * len(sequences)
    idx: list = [None] * len(sequences)
    hid: list | None = [None] * len(sequences) if with_hidden else None
    bar = tqdm(total=sum(len(s) for s in sequences), desc="teacher forward", unit="tok", disable=not progress)
    i = 0
    while i < len(order):
        longest = len(sequences[order[min(len(order), i + 1) - 1]])
        group = order[i : i + max(1, batch_tokens // max(1, longest))]
        longest = max(len(sequences[j]) for j in group)
        ids = torch.zeros((len(group), longest), dtype=torch.long)
        mask = torch.zeros((len(group), longest), dtype=torch.long)
        for r, j in enumerate(group):
            ids[r, : len(sequences[j])] = torch.tensor(sequences[j])
            mask[r, : len(sequences[j])] = 1
        h = decoder(input_ids=ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state
        for r, j in enumerate(group):
            n = len(sequences[j])
            lp, top = torch.log_softmax(head(h[r, :n]).float(), -1).topk(top_k, -1)
            logp[j], idx[j] = lp.half().cpu(), top.int().cpu()
            if hid is not None:
                hid[j] = h[r, :n].half().cpu()
            bar.update(n)
        i += len(group)
    bar.close()
    return Teacher(logp, idx, hid)


def _key(model_dir: Path, sequences: list[list[int]], top_k: int, with_hidden: bool) -> str:
    h = hashlib.sha256()
    cfg = Path(model_dir) / "config.json"
    h.update(cfg.read_bytes() if cfg.exists() else str(model_dir).encode())
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    h.update(f"{top_k}:{with_hidden}".encode())
    for s in sequences:
        h.update(len(s).to_bytes(4, "little"))
        h.update(torch.tensor(s, dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()[:20]


def cached_teacher(model, model_dir: Path, sequences: list[list[int]], cache: Path, top_k: int = 32,
                   with_hidden: bool = False, shard: int = 64) -> Teacher:
    """:func:`teacher_pass` kept on disk under ``cache/<key>/`` in shards of ``shard`` sequences: a rerun (or the other
    training tool) loads what is there and computes only what is missing. The key covers the model folder, the
    sequences, ``top_k`` and ``with_hidden``; a pass with hidden states also serves a request without them.

    Returns:
        :class:`Teacher`, in the order of ``sequences``.
    """
    for hidden in ((True, False) if not with_hidden else (True,)):  # a pass with hidden states serves both
        folder = Path(cache) / _key(model_dir, sequences, top_k, hidden)
        if (folder / "done.json").exists():
            logger.info("teacher outputs cached in %s", folder)
            return _load(folder, len(sequences), shard, with_hidden)
    folder = Path(cache) / _key(model_dir, sequences, top_k, with_hidden)
    folder.mkdir(parents=True, exist_ok=True)
    starts = range(0, len(sequences), shard)
    todo = [s for s in starts if not (folder / f"shard-{s // shard:05d}.pt").exists()]
    if len(todo) < len(starts):
        logger.info("teacher outputs: resuming in %s (%d of %d shards done)", folder, len(starts) - len(todo),
                    len(starts))
    from tqdm import tqdm

    for s in tqdm(todo, desc="teacher shards", unit="shard"):
        part = teacher_pass(model, sequences[s : s + shard], top_k, with_hidden, progress=False)
        tmp = folder / f"shard-{s // shard:05d}.pt.tmp"
        torch.save({"top_logp": part.top_logp, "top_idx": part.top_idx, "hidden": part.hidden}, tmp)
        tmp.rename(folder / f"shard-{s // shard:05d}.pt")
    (folder / "done.json").write_text(json.dumps({"sequences": len(sequences), "top_k": top_k,
                                                  "with_hidden": with_hidden, "shard": shard}))
    return _load(folder, len(sequences), shard, with_hidden)


def _load(folder: Path, n: int, shard: int, with_hidden: bool) -> Teacher:
    shard = json.loads((folder / "done.json").read_text()).get("shard", shard)
    out = Teacher([], [], [] if with_hidden else None)
    for s in range(0, n, shard):
        part = torch.load(folder / f"shard-{s // shard:05d}.pt")
        out.top_logp += part["top_logp"]
        out.top_idx += part["top_idx"]
        if with_hidden:
            out.hidden += part["hidden"]
    return out


def greedy_continuations(model, tok, prompts: list[str], new_tokens: int, batch_size: int = 16,
                         cache: Path | None = None) -> list[list[int]]:
    """prompt ids + the target's greedy continuation (EOS and after dropped) for every prompt, batched
    (transformers ``generate``); kept in ``cache`` (keyed by the model's config, the prompts and ``new_tokens``)."""
    from tqdm import tqdm

    key = hashlib.sha256(json.dumps([str(model.config.to_dict()), prompts, new_tokens]).encode()).hexdigest()[:20]
    file = None if cache is None else Path(cache) / f"continuations-{key}.json"
    if file is not None and file.exists():
        return json.loads(file.read_text())
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    out = []
    for i in tqdm(range(0, len(prompts), batch_size), desc="target continuations", unit="batch"):
        enc = tok(prompts[i : i + batch_size], return_tensors="pt", padding=True)
        with torch.inference_mode():
            gen = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        for row, mask in zip(gen, enc["attention_mask"]):
            ids = row.tolist()
            start = int(mask.numel() - mask.sum())  # left padding
            prompt_len = int(mask.numel())
            cont = ids[prompt_len:]
            if tok.eos_token_id in cont:
                cont = cont[: cont.index(tok.eos_token_id)]
            out.append(ids[start:prompt_len] + cont)
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(out))
    return out


@dataclass
class TrainingData:
    """What ``make draft`` and ``make speculator`` learn from and are evaluated on (:func:`training_data`).

    Attributes:
        corpus: the training corpus (:class:`spec_decode.corpus.Corpus`).
        teacher: the target's outputs over ``corpus.sequences``.
        eval_sequences: per held-out HumanEval task, prompt ids + the target's greedy continuation.
        eval_prompt_lens: their prompts' lengths in tokens.
        eval_teacher: the target's outputs over ``eval_sequences``.
    """

    corpus: object
    teacher: Teacher
    eval_sequences: list[list[int]]
    eval_prompt_lens: list[int]
    eval_teacher: Teacher


def training_data(target, target_dir: Path, tok, cache: Path, *, stdlib_tokens: int, seq_len: int, seed: int,
                  humaneval_tasks: int, top_k: int, eval_prompts: int, eval_tokens: int, with_hidden: bool,
                  phases: int) -> TrainingData:
    """The training tools' phases 1 and 2 (of ``phases``, logged): the corpus, the target's passes over it (cached
    under ``cache``) and the held-out tasks 0..``eval_prompts``-1 continued greedily by the target, with its passes.

    Raises:
        ValueError: ``eval_prompts`` outside [1, HELD_OUT].
    """
    from .corpus import HELD_OUT, heldout_tasks, training_corpus

    if not 1 <= eval_prompts <= HELD_OUT:
        raise ValueError(f"--eval-prompts must be in [1, {HELD_OUT}], got {eval_prompts}")
    logger.info("phase 1/%d: corpus (standard library up to %d tokens, HumanEval tasks from %d)", phases,
                stdlib_tokens, HELD_OUT)
    corpus = training_corpus(tok, stdlib_tokens, seq_len, seed, humaneval_tasks)
    logger.info("  %d sequences, %d tokens, %d standard-library files", len(corpus.sequences), corpus.tokens,
                len(corpus.files))
    logger.info("phase 2/%d: the target's %stop-%d distributions", phases, "hidden states and " * with_hidden, top_k)
    teacher = cached_teacher(target, target_dir, corpus.sequences, cache, top_k, with_hidden=with_hidden)
    tasks = heldout_tasks(eval_prompts)
    eval_seqs = greedy_continuations(target, tok, [t["prompt"] for t in tasks], eval_tokens, cache=cache)
    eval_lens = [len(tok(t["prompt"])["input_ids"]) for t in tasks]
    eval_teacher = cached_teacher(target, target_dir, eval_seqs, cache, top_k, with_hidden=with_hidden)
    return TrainingData(corpus, teacher, eval_seqs, eval_lens, eval_teacher)


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
    tokenizer: object
    target: torch.nn.Module
    cache: Path


def start_run(output: Path | None, default_output: Path, target: str, seed: int, fresh: bool,
              teacher_cache: Path | None) -> TrainingRun:
    """Make the work folder (emptied when ``fresh``), seed torch, and load the target (``"default"``: the embedded
    one, converted on first use) and its tokenizer.

    Raises:
        FileNotFoundError: a target folder without a model.
    """
    from .model_loading import cache_dir, load_causal_lm, load_tokenizer, prepare_default_model

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


def add_data_arguments(ap) -> None:
    """The command-line options ``make draft`` and ``make speculator`` share (the target, the corpus, the teacher,
    the held-out evaluation, the seed), added to the ``argparse.ArgumentParser`` ``ap``."""
    from .corpus import DEFAULT_STDLIB_TOKENS

    ap.add_argument("--target", default="default", help="target folder ('default' = embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--stdlib-tokens", type=int, default=DEFAULT_STDLIB_TOKENS,
                    help="standard-library tokens to learn from")
    ap.add_argument("--humaneval-tasks", type=int, default=144, help="HumanEval training tasks (20.. on) to learn from")
    ap.add_argument("--teacher-cache", type=Path, default=None,
                    help="where the target's passes are kept (default $SPEC_DECODE_CACHE/teacher)")
    ap.add_argument("--top-k", type=int, default=32, help="teacher probabilities kept per position")
    ap.add_argument("--eval-prompts", type=int, default=10, help="held-out HumanEval tasks continued for evaluation")
    ap.add_argument("--eval-tokens", type=int, default=128, help="target continuation length per held-out task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fresh", action="store_true", help="ignore the work folder's checkpoint")
