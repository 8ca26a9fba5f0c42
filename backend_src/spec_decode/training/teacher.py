"""The target as teacher: its last hidden states and argmax over a corpus (cached on disk), and the distillation losses.

:func:`teacher_pass` runs the target teacher-forced and keeps, for every position t of a sequence x, its last hidden
state after x_t (after the final norm: what its LM head reads, and what the EAGLE head drafts from) and its argmax next
token. The hidden state is the whole teacher: the target's next-token distribution at t is its LM head applied to it,
so the training tools compute the distillation targets (knowledge distillation, Hinton et al. 2015) over their pruned
vocabularies from the states as they train (:func:`target_logits`, :func:`target_distribution`,
:func:`distillation_loss`), and the pass skips the LM head's softmax over the full vocabulary. :func:`cached_teacher`
keeps the result on disk in shards, outside the repository, so an interrupted run resumes and ``make draft`` and
``make speculator`` share one pass. On a CPU that multiplies bfloat16 matrices natively (AMX, AVX-512 BF16) the pass
over the training corpus runs the target in bfloat16 (:func:`teacher_dtype`), so the tools see more data in their
budget (docs/benchmarks.md has the speed-up).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; the package also runs on 3.10, where annotations stay strings

    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from ..engine.draft_vocab import DraftVocab

logger = logging.getLogger(__name__)


class CausalLM(Protocol):
    """What the training tools use of the target: a transformers causal LM of the Llama layout (an embedding, a
    decoder, a linear LM head; e.g. ``LlamaForCausalLM`` as :func:`spec_decode.engine.model_loading.load_causal_lm`
    loads it)."""

    config: PretrainedConfig

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def get_decoder(self) -> nn.Module: ...

    def get_input_embeddings(self) -> nn.Embedding: ...

    def get_output_embeddings(self) -> nn.Linear: ...

    def generate(self, *args: Any, **kwargs: Any) -> torch.Tensor: ...

    def to(self, dtype: torch.dtype) -> Self: ...


@dataclass
class Teacher:
    """The teacher's outputs for a list of sequences (index i: sequence i of n tokens, positions 0..n-1).

    Attributes:
        argmax: per sequence [n] int32, the target's most probable next token after each position (CPU).
        wire: per sequence [n, H x (1 + A)] float16 (CPU): the target's last hidden state (after the final norm), then
            the inputs of the A layers ``aux_layers`` (transformers' ``hidden_states[i]`` of layer i), in that order:
            the layout in which the server sends hidden states to the proposers
            (:func:`spec_decode.proposers.speculators.aux_hidden_state_layers`).
        aux_layers: the target layers whose inputs ``wire`` holds after the last hidden state (empty: [n, H]).
        hidden: per sequence [n, H], the last hidden states: views of ``wire``'s first H columns (derived).
    """

    argmax: list[torch.Tensor]
    wire: list[torch.Tensor]
    aux_layers: tuple[int, ...] = ()
    hidden: list[torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        blocks = 1 + len(self.aux_layers)
        self.hidden = [w[:, : w.shape[1] // blocks] for w in self.wire]


@torch.inference_mode()
def teacher_pass(model: CausalLM, sequences: list[list[int]], batch_tokens: int = 2048,
                 progress: bool = True, aux_layers: Iterable[int] = ()) -> Teacher:
    """The target's last hidden state and argmax next token at every position of every sequence, and the inputs of
    its layers ``aux_layers`` there (EAGLE-3's auxiliary hidden states: transformers' ``output_hidden_states``
    ``hidden_states[i]`` is the input of layer i, as vLLM's and the EAGLE authors' targets return them).

    Sequences are grouped by length (right padding, masked) into forwards of at most ``batch_tokens`` padded tokens
    (a sequence longer than that gets a forward of its own).

    Args:
        model: the target (:class:`CausalLM`), in eval mode, on any device.
        sequences: token-id lists (each >= 1 token).
        batch_tokens: the most (padded) tokens per forward.
        progress: show a progress bar (tqdm).
        aux_layers: layer ids in [0, L) whose inputs to keep beside the last hidden state, in this order.

    Returns:
        :class:`Teacher`, in the order of ``sequences`` (``wire`` [n, H x (1 + len(aux_layers))] float16).

    Raises:
        ValueError: a layer id outside [0, L).
    """
    from tqdm import tqdm

    decoder, head = model.get_decoder(), model.get_output_embeddings()
    aux = tuple(int(i) for i in aux_layers)
    layers = int(model.config.num_hidden_layers)
    if any(not 0 <= i < layers for i in aux):
        raise ValueError(f"auxiliary layers {list(aux)} must be in [0, {layers})")
    dev = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    argmax: list = [None] * len(sequences)
    hid: list = [None] * len(sequences)
    bar = tqdm(total=sum(len(s) for s in sequences), desc="teacher forward", unit="tok", disable=not progress)
    i = 0
    while i < len(order):
        # ascending lengths: a group grows while its padded size (rows x its longest, the last one) fits
        end = i + 1
        while end < len(order) and (end + 1 - i) * len(sequences[order[end]]) <= batch_tokens:
            end += 1
        group = order[i:end]
        longest = len(sequences[group[-1]])
        ids = torch.zeros((len(group), longest), dtype=torch.long)
        mask = torch.zeros((len(group), longest), dtype=torch.long)
        for r, j in enumerate(group):
            ids[r, : len(sequences[j])] = torch.tensor(sequences[j])
            mask[r, : len(sequences[j])] = 1
        out = decoder(input_ids=ids.to(dev), attention_mask=mask.to(dev), output_hidden_states=bool(aux))
        h = out.last_hidden_state
        wire = torch.cat([h, *(out.hidden_states[a] for a in aux)], -1) if aux else h
        for r, j in enumerate(group):
            n = len(sequences[j])
            argmax[j] = head(h[r, :n]).argmax(-1).int().cpu()
            hid[j] = wire[r, :n].half().cpu()
            bar.update(n)
        del out, h, wire
        i = end
    bar.close()
    return Teacher(argmax, hid, aux)


def target_logits(hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """The target's next-token logits over a pruned vocabulary from its hidden states: ``hidden @ head.T``.

    Args:
        hidden: [..., H] the target's last hidden states (any float dtype).
        head: [N, H] the target's LM head rows of the kept tokens.

    Returns:
        [..., N] float32: softmax of it is the target's distribution renormalised over the kept tokens (what a pruned
        draft can match).
    """
    return (hidden.to(head.dtype) @ head.T).float()


def native_bfloat16(device: torch.device | None = None) -> bool:
    """Whether ``device`` (default: the CPU) multiplies bfloat16 matrices natively: CUDA, or a CPU with AMX or AVX-512
    BF16 (where bfloat16 products beat float32; elsewhere they are emulated and slow)."""
    if device is not None and device.type == "cuda":
        return True
    return any(getattr(torch.cpu, f, lambda: False)() for f in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))


def teacher_dtype(name: str = "auto", device: torch.device | None = None) -> torch.dtype:
    """The dtype of the target's pass over the training corpus on ``device`` (default: the CPU, where the tools run
    it): ``float32``, ``bfloat16``, or ``auto`` (bfloat16 where :func:`native_bfloat16`, float32 elsewhere).

    Raises:
        ValueError: another name.
    """
    if name not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"teacher dtype must be auto, float32 or bfloat16, got {name!r}")
    if name == "auto":
        return torch.bfloat16 if native_bfloat16(device) else torch.float32
    return getattr(torch, name)


def _key(model: CausalLM, model_dir: Path, sequences: list[list[int]], aux_layers: tuple[int, ...] = ()) -> str:
    h = hashlib.sha256()
    h.update(f"hidden+argmax:{next(model.parameters()).dtype}".encode())
    if aux_layers:  # the wire layout: another content than a last-hidden-only pass, so another folder
        h.update(f"wire:last+inputs-of-layers:{','.join(map(str, aux_layers))}".encode())
    cfg = Path(model_dir) / "config.json"
    h.update(cfg.read_bytes() if cfg.exists() else str(model_dir).encode())
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    for s in sequences:
        h.update(len(s).to_bytes(4, "little"))
        h.update(torch.tensor(s, dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()[:20]


def cached_teacher(model: CausalLM, model_dir: Path, sequences: list[list[int]], cache: Path,
                   shard: int = 64, aux_layers: Iterable[int] = ()) -> Teacher:
    """:func:`teacher_pass` kept on disk under ``cache/<key>/`` in shards of ``shard`` sequences: a rerun (or the other
    training tool) loads what is there and computes only what is missing.

    The key covers the model's dtype, its folder ``model_dir`` (config.json and the safetensors files' names and sizes),
    the sequences and the auxiliary layers ``aux_layers`` (:func:`teacher_pass`; a pass that keeps them is another
    folder than one that does not, so a cache of another layout is never misread). Each shard is written under a
    temporary name and renamed (``shard-NNNNN.pt``), and ``done.json`` marks a complete pass, so an interrupted run
    leaves only whole shards.

    Returns:
        :class:`Teacher`, in the order of ``sequences``.

    Raises:
        ValueError: as :func:`teacher_pass`.
    """
    aux = tuple(int(i) for i in aux_layers)
    folder = Path(cache) / _key(model, model_dir, sequences, aux)
    if (folder / "done.json").exists():
        logger.info("teacher outputs cached in %s", folder)
        return _load(folder, len(sequences), shard, aux)
    folder.mkdir(parents=True, exist_ok=True)
    starts = range(0, len(sequences), shard)
    todo = [s for s in starts if not (folder / f"shard-{s // shard:05d}.pt").exists()]
    if len(todo) < len(starts):
        logger.info("teacher outputs: resuming in %s (%d of %d shards done)", folder, len(starts) - len(todo),
                    len(starts))
    from tqdm import tqdm

    for s in tqdm(todo, desc="teacher shards", unit="shard"):
        part = teacher_pass(model, sequences[s : s + shard], progress=False, aux_layers=aux)
        tmp = folder / f"shard-{s // shard:05d}.pt.tmp"
        torch.save({"argmax": part.argmax, "hidden": part.wire}, tmp)
        tmp.rename(folder / f"shard-{s // shard:05d}.pt")
    (folder / "done.json").write_text(json.dumps({"sequences": len(sequences), "shard": shard,
                                                  "aux_layers": list(aux)}))
    return _load(folder, len(sequences), shard, aux)


def _load(folder: Path, n: int, shard: int, aux: tuple[int, ...]) -> Teacher:
    shard = json.loads((folder / "done.json").read_text()).get("shard", shard)
    argmax: list[torch.Tensor] = []
    wire: list[torch.Tensor] = []
    for s in range(0, n, shard):
        part = torch.load(folder / f"shard-{s // shard:05d}.pt")
        argmax += part["argmax"]
        wire += part["hidden"]
    return Teacher(argmax, wire, aux)


def greedy_continuations(model: CausalLM, tok: PreTrainedTokenizerBase, prompts: list[str], new_tokens: int,
                         batch_size: int = 16, cache: Path | None = None) -> list[list[int]]:
    """Per prompt, its token ids + the target's greedy continuation of up to ``new_tokens`` tokens (EOS and after
    dropped), generated ``batch_size`` prompts at a time (transformers ``generate``, left padding); kept in ``cache``
    (``continuations-<key>.json``, keyed by the model's config, the prompts and ``new_tokens``) when given.

    Sets ``tok.padding_side`` to ``"left"`` and, where it has none, its pad token to its EOS token.
    """
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


def target_distribution(target_logits: torch.Tensor, top_k: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse distillation target from the target's logits [..., N] over the kept tokens (:func:`target_logits`):
    its K = min(``top_k``, N) most probable tokens, (probabilities [..., K] float32 renormalised over them, their
    indices [..., K] int64 into the N), computed once for the losses of a step. The top 32 carry nearly all of the
    target's mass on code and cost less than the full distribution (docs/benchmarks.md has the measurement)."""
    values, idx = target_logits.float().topk(min(top_k, target_logits.shape[-1]), -1)
    return torch.softmax(values, -1), idx


def distillation_loss(student_logits: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor],
                      mask: torch.Tensor) -> torch.Tensor:
    """KL(target || student) over the target's top-k tokens (nats; Hinton et al. 2015), mean over unmasked positions.

    Args:
        student_logits: [B, L, N] float, over the tokens the target's indices point into.
        target: :func:`target_distribution` of the target's logits ([B, L, K] probabilities, [B, L, K] indices).
        mask: [B, L] 1.0 where the position counts, 0.0 elsewhere.

    Returns:
        0-dim float32 tensor (0 when no position counts).
    """
    p, idx = target
    log_q = torch.log_softmax(student_logits.float(), -1).gather(-1, idx)
    kl = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-12)) - log_q), torch.zeros_like(p)).sum(-1)
    return (kl * mask).sum() / mask.sum().clamp_min(1.0)


def choose_vocabulary(seqs: list[list[int]], argmax: list[torch.Tensor], size: int, target_vocab_size: int,
                      always: Iterable[int] = ()) -> DraftVocab:
    """The ``size`` most frequent target tokens of the training text and of the target's argmax predictions.

    Args:
        seqs: the corpus' token-id lists.
        argmax: per sequence [n] the target's argmax next token at each position (:class:`Teacher`).
        size: tokens to keep (at most ``target_vocab_size``).
        target_vocab_size: V of the target.
        always: ids kept whatever their count (e.g. EOS).

    Returns:
        :class:`~spec_decode.engine.draft_vocab.DraftVocab` (sorted ids; ``always`` ids included).
    """
    from ..engine.draft_vocab import DraftVocab

    counts = torch.zeros(target_vocab_size, dtype=torch.float64)
    for ids, top in zip(seqs, argmax):
        counts += torch.bincount(torch.tensor(ids), minlength=target_vocab_size)
        counts += torch.bincount(top.long(), minlength=target_vocab_size)
    for t in always:
        counts[t] = float("inf")
    keep = torch.sort(torch.topk(counts, min(size, target_vocab_size)).indices).values
    return DraftVocab(keep, target_vocab_size)
