"""Logits processors applied exactly at every position of a speculative step.

A step scores k+1 positions at once: position j follows the committed ids and the first j drafts. Plain decoding
would have applied every processor over exactly those ids before sampling there, so :func:`process_logits` applies
each one per position over ``committed + drafts[:j]``: the penalties count the drafts before j, ``min_tokens`` counts
them as output, a bad word's prefix may end in a draft, and the grammar's state is the one after those drafts. A draft
the processors forbid gets probability zero at its position and is rejected there, and the recovered token is drawn
from the processed distribution, so rejection sampling still returns the processed target distribution exactly
(Leviathan et al. 2023, Theorem 1, applied to the processed distribution; vLLM v1 / Arctic Inference apply the grammar
bitmask to the target logits before the rejection sampler in the same way).

The formulas follow vLLM's sampler (``vllm/model_executor/layers/utils.py``, ``apply_penalties``): the repetition
penalty (Keskar et al. 2019, CTRL) divides positive logits and multiplies negative ones of every token seen in the
prompt or the output; presence and frequency penalties (OpenAI's definitions) subtract from the logits of output
tokens; ``min_tokens`` forbids the end ids while the output is shorter; a bad word's last token is forbidden where the
output ends with the rest of it (vLLM's ``NoBadWordsLogitsProcessor``).

The spec travels to draft_model, target_model and the verifier as one JSON text per row (STEP tensor
``logits_processors``): :attr:`ProcessorSpec.wire_text` / :meth:`ProcessorSpec.from_json`, which checks every value,
since the step models are reachable by any client.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING

import torch

from ..settings import InvalidInputError, in_range
from ..tree import is_chain, path_tokens
from .grammar import GUIDE_TYPES

if TYPE_CHECKING:
    from .grammar import GrammarCache

MAX_TOP_LOGPROBS = 20  # top_logprobs and prompt_logprobs: 0..20, as vLLM's default max_logprobs and OpenAI's API
MAX_BAD_WORDS = 64
MAX_BAD_WORD_TOKENS = 32
MAX_STOP_IDS = 64
PRESENCE_FREQUENCY_RANGE = (-2.0, 2.0)  # OpenAI's and vLLM's range
MAX_REPETITION_PENALTY = 10.0
LOGPROBS_MODES = ("raw", "processed")  # vLLM's logprobs_mode names (raw_logprobs / processed_logprobs)


@dataclass(frozen=True)
class ProcessorSpec:
    """What a sequence's logits go through before sampling, and which log-probs it wants.

    Attributes:
        prompt_len: the prompt's token count (output tokens are the ids after it), >= 1.
        repetition_penalty: > 0, 1 = off; divides positive logits (multiplies negative ones) of every token in the
            prompt or the output.
        presence_penalty: in [-2, 2], 0 = off; subtracted once from the logits of every token in the output.
        frequency_penalty: in [-2, 2], 0 = off; subtracted per occurrence in the output.
        min_tokens: >= 0; the end ids are forbidden while the output has fewer tokens.
        stop_ids: the end ids of the request (EOS ids unless ignore_eos, ``end_id``, ``stop_token_ids``): what
            ``min_tokens`` forbids and what a finished grammar allows.
        bad_words: token-id sequences that must not appear in the output.
        guide_type: structured output: "" (none) or one of :data:`~.grammar.GUIDE_TYPES`.
        guide: the schema, regex or grammar text for ``guide_type``.
        logprobs: the request wants log-probs of its tokens (``return_log_probs`` or ``top_logprobs`` > 0).
        top_logprobs: alternatives per emitted token, 0..20.
        prompt_logprobs: -1 = no prompt log-probs; else the prompt tokens' log-probs with this many alternatives
            each, 0..20 (vLLM's ``prompt_logprobs``).

    Raises:
        InvalidInputError: (construction) a value out of range, naming it.
    """

    prompt_len: int
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    guide_type: str = ""
    guide: str = ""
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int = -1
    _stop: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        in_range("prompt_len", self.prompt_len, 1)
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:  # also refuses NaN
            raise InvalidInputError("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), got "
                                                          f"{self.repetition_penalty}")
        in_range("presence_penalty", self.presence_penalty, *PRESENCE_FREQUENCY_RANGE, " (0 = off)")
        in_range("frequency_penalty", self.frequency_penalty, *PRESENCE_FREQUENCY_RANGE, " (0 = off)")
        in_range("min_tokens", self.min_tokens, 0)
        in_range("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        in_range("prompt_logprobs", self.prompt_logprobs, -1, MAX_TOP_LOGPROBS, " (-1 = none)")
        if len(self.stop_ids) > MAX_STOP_IDS or any(t < 0 for t in self.stop_ids):
            raise InvalidInputError("stop_token_ids", f"at most {MAX_STOP_IDS} non-negative token ids")
        if len(self.bad_words) > 2 * MAX_BAD_WORDS or any(
                not 0 < len(w) <= MAX_BAD_WORD_TOKENS or min(w) < 0 for w in self.bad_words):
            raise InvalidInputError("bad_words", f"at most {MAX_BAD_WORDS} words of 1..{MAX_BAD_WORD_TOKENS} tokens")
        if self.guide_type:
            if self.guide_type not in GUIDE_TYPES:
                raise InvalidInputError("guided_decoding_guide_type",
                                        f"{self.guide_type!r} is not one of {', '.join(GUIDE_TYPES)}")
        object.__setattr__(self, "_stop", torch.tensor(sorted(set(self.stop_ids)), dtype=torch.int64))

    @property
    def penalties(self) -> bool:
        """Whether any penalty is on."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def changes_logits(self) -> bool:
        """Whether any processor can change a logit (else the step is plain sampling)."""
        return self.penalties or self.min_tokens > 0 or bool(self.bad_words) or bool(self.guide_type)

    def prompt_logprobs_at(self, n_token_ids: int) -> bool:
        """Whether a step whose row holds ``n_token_ids`` committed ids returns the prompt's log-probs: the
        sequence's first step (nothing generated yet), when the request asks for them."""
        return self.prompt_logprobs >= 0 and n_token_ids == self.prompt_len

    def chains_only(self, n_token_ids: int) -> bool:
        """Whether such a step must draft a chain, not a tree (:mod:`spec_decode.tree`): a guide's matcher walks one
        path, and a first step's prompt log-probs are scored with a chain."""
        return bool(self.guide_type) or self.prompt_logprobs_at(n_token_ids)

    @cached_property
    def wire_text(self) -> str:
        """The spec as the JSON text of the ``logits_processors`` step tensor (made once: every step sends it)."""
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        return json.dumps(d, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> ProcessorSpec | None:
        """A spec from its JSON text; None for an empty text (no processors, no log-probs).

        Raises:
            InvalidInputError: (field ``logits_processors``) text that is not a JSON object of this spec's fields,
                or a value out of range (naming the field).
        """
        if not text.strip():
            return None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidInputError("logits_processors", f"not JSON: {e}") from None
        names = {f for f in ProcessorSpec.__dataclass_fields__ if not f.startswith("_")}
        if not isinstance(d, dict) or not set(d) <= names or "prompt_len" not in d:
            raise InvalidInputError("logits_processors", f"must be a JSON object with prompt_len and keys among "
                                                         f"{', '.join(sorted(names))}")
        try:
            d["stop_ids"] = tuple(int(t) for t in d.get("stop_ids", ()))
            d["bad_words"] = tuple(tuple(int(t) for t in w) for w in d.get("bad_words", ()))
            return ProcessorSpec(**d)
        except InvalidInputError:
            raise
        except (TypeError, ValueError) as e:
            raise InvalidInputError("logits_processors", str(e)) from None


def _banned_bad_words(spec: ProcessorSpec, output: Sequence[int]) -> list[int]:
    """The last tokens of the bad words whose other tokens end ``output`` (single-token words always)."""
    banned = []
    for w in spec.bad_words:
        n = len(w) - 1
        if n == 0 or (len(output) >= n and tuple(output[len(output) - n:]) == w[:-1]):
            banned.append(w[-1])
    return banned


def process_logits(logits: torch.Tensor, spec: ProcessorSpec, token_ids: Sequence[int], drafts: Sequence[int] = (),
                   grammar: GrammarCache | None = None, seq_id: int = 0,
                   column_ids: torch.Tensor | None = None, parents: Sequence[int] | None = None) -> torch.Tensor:
    """Apply the spec's processors to the logits of a step's positions, each over its own prefix.

    Args:
        logits: [n, C] logits (any float dtype, any device) of n = len(drafts) + 1 positions: row j follows
            ``token_ids + drafts[:j]``, or, for a draft tree (``parents``), ``token_ids`` + the path of node j - 1
            (:func:`spec_decode.tree.path_tokens`). A draft model's single position: n = 1, drafts empty.
        spec: the sequence's processors.
        token_ids: the committed ids (prompt + output so far; the output is ``token_ids[spec.prompt_len:]``).
        drafts: the step's draft ids (target ids), len n - 1.
        grammar: the process's grammar matchers (required when ``spec.guide_type`` is set).
        seq_id: the sequence (keys its grammar matcher).
        column_ids: [C] int64, the target token id of each logits column (a draft model's pruned vocabulary), or
            None when column c is token c.
        parents: the drafts' parents (a draft tree; None: a chain). A guide needs a chain: the grammar's matcher
            walks one path (generate drafts chains for guided requests).

    Returns:
        [n, C] float32 processed logits (forbidden tokens at -inf) on the logits' device; the input itself when no
        processor changes anything. A row that every processor together forbids entirely (``min_tokens`` against a
        finished grammar) keeps its end ids allowed, so that the sequence ends instead of sampling from nothing.

    Raises:
        ValueError: ``len(drafts) + 1 != n``; a guide without ``grammar``, or with a tree; from the grammar (a guide
            that does not compile, or committed output it refuses).
    """
    n, cols = logits.shape
    if len(drafts) + 1 != n:
        raise ValueError(f"process_logits: {n} rows for {len(drafts)} drafts")
    if not spec.changes_logits:
        return logits
    tree = None if is_chain(parents) else parents
    if tree is not None and spec.guide_type:
        raise ValueError("process_logits: a guided request's drafts must be a chain, not a tree")
    prefixes = path_tokens(drafts, tree)  # row j's drafts before it
    dev = logits.device
    out = logits.float().clone()
    ids = list(token_ids)
    output = ids[spec.prompt_len:]
    space = cols if column_ids is None else max(cols, int(column_ids.max()) + 1)
    gather = None if column_ids is None else column_ids.to(dev)

    def to_cols(full: torch.Tensor) -> torch.Tensor:  # [n, space] -> [n, C]
        return full if gather is None else full[:, gather]

    if spec.penalties:
        counts = torch.zeros((n, space), dtype=torch.float32)
        if output:
            counts += torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=space)[:space].float()
        for j, before in enumerate(prefixes):  # row j counts the drafts before it
            for t in before:
                if t < space:
                    counts[j, t] += 1
        counts = to_cols(counts.to(dev))
        if spec.repetition_penalty != 1.0:
            seen = counts > 0
            prompt = torch.tensor(ids[:spec.prompt_len], dtype=torch.int64)
            in_prompt = torch.zeros(space, dtype=torch.bool)
            in_prompt[prompt[prompt < space]] = True
            seen |= to_cols(in_prompt[None].to(dev))
            r = spec.repetition_penalty
            out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
        if spec.frequency_penalty:
            out -= spec.frequency_penalty * counts
        if spec.presence_penalty:
            out -= spec.presence_penalty * (counts > 0).float()
    forbid = torch.zeros((n, space), dtype=torch.bool)
    stop = spec._stop[spec._stop < space]
    for j in range(n):
        row_output = output + prefixes[j]
        if len(row_output) < spec.min_tokens and len(stop):
            forbid[j, stop] = True
        banned = [t for t in _banned_bad_words(spec, row_output) if t < space]
        if banned:
            forbid[j, banned] = True
    if spec.guide_type:
        if grammar is None:
            raise ValueError("process_logits: a guide needs the process's GrammarCache")
        allowed = grammar.masks(seq_id, spec.guide_type, spec.guide, output, list(drafts), spec.stop_ids)
        width = min(space, allowed.shape[1])
        forbid[:, :width] |= ~allowed[:, :width]
        forbid[:, width:] = True
    if bool(forbid.any()):
        f = to_cols(forbid.to(dev))
        out = out.masked_fill(f, float("-inf"))
        dead = ~torch.isfinite(out).any(dim=-1)
        if bool(dead.any()) and len(stop):  # every token forbidden: let the sequence end
            stop_cols = stop.to(dev) if gather is None else torch.nonzero(torch.isin(gather, stop.to(dev)))[:, 0]
            rows = torch.nonzero(dead)[:, 0]
            keep = logits.float()[rows][:, stop_cols]
            out[rows[:, None], stop_cols[None]] = keep
    return out


@lru_cache(maxsize=256)
def parse_spec(text: str) -> ProcessorSpec | None:
    """:meth:`ProcessorSpec.from_json`, cached by text: a sequence sends the same spec at every step.

    Raises:
        InvalidInputError: as :meth:`ProcessorSpec.from_json`.
    """
    return ProcessorSpec.from_json(text)
