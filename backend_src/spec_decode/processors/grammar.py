"""Structured output: per-sequence grammar matchers and the allowed-token masks of a speculative step.

Glossary:
    guide: the request's ``guided_decoding_guide`` (a JSON schema, a regex or a grammar), of a guide type
        (``guided_decoding_guide_type``, TensorRT-LLM's values: :data:`GUIDE_TYPES`).
    matcher: the grammar engine's parser state of one sequence; it accepts tokens one by one, rolls back, and
        computes the set of tokens allowed next (its bitmask, one bit per token id).
    row: the bool [V] mask of one position of a step; a step of k drafts has k+1 rows, row j following the output so
        far plus ``drafts[:j]``. Applied to the target logits before the rejection sampler, a draft the grammar refuses
        gets probability zero and is rejected there, as vLLM v1's structured output
        (``vllm/v1/structured_output/__init__.py``, ``StructuredOutputManager.grammar_bitmask``) and Arctic
        Inference's model runner (``arctic_inference/vllm/model_runner.py``) do.

The engine is llguidance (github.com/guidance-ai/llguidance, ``python/llguidance/_lib.pyi``: ``LLMatcher``), chosen by
measurement (docs/benchmarks.md): about 1 ms to compile a small JSON schema and ~15 us per mask on one core, with
rollback of any number of tokens.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..sequences import SequenceLRU, common_prefix_len
from ..settings import InvalidInputError

if TYPE_CHECKING:
    import llguidance

GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")  # TensorRT-LLM's guided_decoding_guide_type values
MAX_GUIDE_CHARS = 65536
ANY_JSON = '{"type": "object"}'  # guide type "json" with an empty guide: any JSON object (OpenAI's JSON mode)
_TYPE_FIELD = "guided_decoding_guide_type"
_GUIDE_FIELD = "guided_decoding_guide"
_MAX_MESSAGE = 200


def _engine():
    """The llguidance module, imported at the first guide: the backends load and serve unguided requests without it
    (the GPU check runs them where only torch, triton, transformers and numpy are installed).

    Raises:
        ModuleNotFoundError: llguidance is not installed (``requirements.txt`` pins it).
    """
    import llguidance
    import llguidance.hf  # noqa: F401  (from_tokenizer)
    return llguidance


def _short(message: str) -> str:
    """The engine's message on one line, without its parser dump, at most :data:`_MAX_MESSAGE` characters."""
    text = " ".join(str(message).split("<state>")[0].split()) or "rejected by the grammar engine"
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE - 3] + "..."


def _schema_grammar(guide: str) -> str:
    """The llguidance grammar of a JSON schema text.

    Raises:
        InvalidInputError: not JSON, or not a JSON object.
    """
    try:
        schema = json.loads(guide)
    except json.JSONDecodeError as e:
        raise InvalidInputError(_GUIDE_FIELD, f"not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    if not isinstance(schema, dict):
        raise InvalidInputError(_GUIDE_FIELD, f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    try:
        return _engine().LLMatcher.grammar_from_json_schema(guide)
    except ValueError as e:
        raise InvalidInputError(_GUIDE_FIELD, _short(str(e))) from None


@lru_cache(maxsize=64)
def _grammar(guide_type: str, guide: str) -> str:
    """The checked llguidance grammar (its serialized form) of a guide; cached: a client repeats its guides.

    Raises:
        InvalidInputError: as :func:`check_guide`.
    """
    if guide_type not in GUIDE_TYPES:
        raise InvalidInputError(_TYPE_FIELD, f"{guide_type!r} is not one of {', '.join(GUIDE_TYPES)}")
    if len(guide) > MAX_GUIDE_CHARS:
        raise InvalidInputError(_GUIDE_FIELD, f"must be at most {MAX_GUIDE_CHARS} characters, got {len(guide)}")
    if guide_type == "json":
        text = _schema_grammar(guide if guide.strip() else ANY_JSON)
    elif not guide.strip():
        raise InvalidInputError(_GUIDE_FIELD, f"must not be empty for {guide_type}")
    elif guide_type == "json_schema":
        text = _schema_grammar(guide)
    elif guide_type == "regex":
        text = _engine().LLMatcher.grammar_from_regex(guide)
    else:
        try:  # Lark, or GBNF (llama.cpp's and XGrammar's EBNF, TensorRT-LLM's ebnf_grammar), converted to Lark
            text = _engine().grammar_from("grammar", guide)
        except ValueError as e:
            raise InvalidInputError(_GUIDE_FIELD, _short(str(e))) from None
    error = _engine().LLMatcher.validate_grammar(text)
    if error:
        raise InvalidInputError(_GUIDE_FIELD, _short(error))
    return text


def check_guide(guide_type: str, guide: str) -> None:
    """Validate a guide without a tokenizer (about 1 ms, then cached; generate calls it for every guided request).

    Guide types (TensorRT-LLM's ``guided_decoding_guide_type``):
        ``json``: an empty guide means any JSON object (OpenAI's JSON mode; TensorRT-LLM ignores the guide of this
            type); a non-empty guide is taken as a JSON schema, as for ``json_schema``, so that a schema the client
            sent is never silently dropped.
        ``json_schema``: a JSON schema (a JSON object; llguidance's supported subset, its docs/json_schema.md).
        ``regex``: a regular expression that the whole output must match (Rust ``regex`` syntax: no look-around,
            no back-references).
        ``ebnf_grammar``: a Lark grammar (llguidance's docs/syntax.md, rule ``start``) or a GBNF grammar (llama.cpp's
            grammars/README.md, as XGrammar's EBNF: rule ``root``), which llguidance converts to Lark.

    Follows TensorRT-LLM's guided decoding (``GuidedDecodingParams``; tensorrtllm_backend's docs/guided_decoding.md)
    for the types and llguidance's ``LLMatcher.validate_grammar`` (python/llguidance/_lib.pyi) for the check.

    Args:
        guide_type: one of :data:`GUIDE_TYPES` (exact, lower case).
        guide: the schema, regex or grammar text, at most :data:`MAX_GUIDE_CHARS` characters.

    Raises:
        InvalidInputError: ``guided_decoding_guide_type`` not one of :data:`GUIDE_TYPES`;
            ``guided_decoding_guide``: empty where one is needed, too long, not JSON or not an object (schemas), or
            refused by the engine (its message, first line).
    """
    _grammar(guide_type, guide)


@dataclass
class _State:
    """One sequence's matcher and the token ids it has accepted (never a stop id)."""

    key: tuple[str, str]
    matcher: llguidance.LLMatcher
    accepted: list[int] = field(default_factory=list)


class GrammarCache:
    """Per-sequence grammar matchers of one process (target_model's and draft_model's), kept as every cache here is.

    A :class:`~spec_decode.sequences.SequenceLRU` of at most ``max_sequences`` matchers. A matcher's state is synced
    to the ids it is given by longest common prefix: rolled back after a rejection, rebuilt from the committed ids on
    a miss, on a new guide for the sequence, or when the rollback would pass ``max_rollback`` tokens (llguidance itself
    rolls back any number; the bound keeps a resync's cost that of a fresh walk at most). Compiled grammars are
    cached by (guide_type, guide) in an LRU of ``max_grammars``; a sequence's matcher is a copy of its grammar's.

    Args:
        tokenizer: a Hugging Face fast tokenizer (the target's).
        vocab_size: V, the model's logits width; it may exceed ``len(tokenizer)`` (padding): those ids are never
            allowed.
        max_sequences: matchers kept, >= 1.
        max_grammars: compiled grammars kept, >= 1.
        max_rollback: most tokens rolled back to resync a matcher, >= 0; past it the matcher is rebuilt.

    Raises:
        ValueError: a bound out of range; the tokenizer is not a fast tokenizer (llguidance's ``from_tokenizer``).
    """

    def __init__(self, tokenizer, vocab_size: int, max_sequences: int = 64, max_grammars: int = 32,
                 max_rollback: int = 64):
        if vocab_size < 1 or max_grammars < 1 or max_rollback < 0:
            raise ValueError(f"GrammarCache: vocab_size {vocab_size} and max_grammars {max_grammars} must be >= 1, "
                             f"max_rollback {max_rollback} >= 0")
        self.vocab_size = vocab_size
        self.max_grammars = max_grammars
        self.max_rollback = max_rollback
        self._tokenizer = _engine().hf.from_tokenizer(tokenizer, n_vocab=max(vocab_size, len(tokenizer)))
        self._words = (self._tokenizer.vocab_size + 31) // 32  # int32 words of one bitmask
        self._engine_eos = [t for t in self._tokenizer.eos_tokens if t < vocab_size]  # allowed by it when it can end
        self._seqs: SequenceLRU[_State] = SequenceLRU(max_sequences)
        self._grammars: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seqs)

    def release(self, seq_id: int) -> None:
        """Forget the matcher of ``seq_id`` (a finished sequence); absent: nothing."""
        self._seqs.pop(seq_id)

    def _compiled(self, key: tuple[str, str]) -> llguidance.LLMatcher:
        """The fresh matcher of a guide (compiled once, LRU of ``max_grammars``); copy it before use.

        Raises:
            InvalidInputError: the guide does not check or compile.
        """
        matcher = self._grammars.get(key)
        if matcher is None:
            matcher = _engine().LLMatcher(self._tokenizer, _grammar(*key), log_level=0)
            if matcher.is_error():
                raise InvalidInputError(_GUIDE_FIELD, _short(matcher.get_error()))
            self._grammars[key] = matcher
            while len(self._grammars) > self.max_grammars:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(key)
        return matcher

    def _synced(self, seq_id: int, key: tuple[str, str], output_ids: Sequence[int]) -> _State:
        """The sequence's state rolled back to the longest common prefix of its accepted ids and ``output_ids``."""
        state = self._seqs.peek(seq_id)
        if state is not None and state.key == key:
            keep = common_prefix_len(state.accepted, output_ids)
            back = len(state.accepted) - keep
            if back <= self.max_rollback and (back == 0 or state.matcher.rollback(back)) and \
                    not state.matcher.is_error():
                del state.accepted[keep:]
                return self._seqs.put(seq_id, state)
        return self._seqs.put(seq_id, _State(key, self._compiled(key).deep_copy()))

    def masks(self, seq_id: int, guide_type: str, guide: str, output_ids: Sequence[int], drafts: Sequence[int],
              stop_ids: Collection[int]) -> torch.Tensor:
        """Allowed-token masks at the k+1 positions of a step.

        Row j holds the tokens the grammar allows after ``output_ids + drafts[:j]``. Stop ids: where the grammar may
        end (llguidance's ``is_accepting``) every id of ``stop_ids`` is allowed, and once it cannot go on
        (``is_stopped``) only they are; where it may not end none is. Stop ids are never fed to the matcher. A stop
        id in ``output_ids`` or ``drafts`` ends the walk: the rows after it copy the row before it (never read:
        generation stops there). A draft the grammar refuses ends it too: the rows after it copy that draft's row
        (never used: the target rejects the draft, whose probability is zero). Every row allows at least one token
        (an empty row allows ``stop_ids``, or the tokenizer's EOS when there are none). After the call the matcher
        may hold the drafts; the next call syncs by common prefix.

        Follows vLLM v1's structured output (``vllm/v1/structured_output/__init__.py``, ``grammar_bitmask``: one
        bitmask per draft position, the matcher advanced through the drafts, stopping at the first it refuses) and
        Arctic Inference's model runner (``arctic_inference/vllm/model_runner.py``), which applies those masks to the
        target logits before the rejection sampler; the masks are llguidance's (``LLMatcher.unsafe_compute_mask_ptr``).

        Args:
            seq_id: the sequence (uint64), the key of its matcher.
            guide_type: one of :data:`GUIDE_TYPES`.
            guide: the guide text (:func:`check_guide`).
            output_ids: the sequence's generated ids so far (not the prompt).
            drafts: the step's k draft ids (target ids; k >= 0).
            stop_ids: the request's end ids (EOS ids etc.); ids >= V are ignored.

        Returns:
            [k+1, V] bool on the CPU, True where the token is allowed.

        Raises:
            InvalidInputError: ``guided_decoding_guide``/``guided_decoding_guide_type`` when the guide does not check
                or compile (as :func:`check_guide`).
            ValueError: the grammar refuses a token of ``output_ids`` (committed output was always allowed, so the
                caller's ids or guide changed); the sequence's matcher is dropped.
        """
        key = (guide_type, guide)
        self._compiled(key)  # raises before any state changes
        stops = {int(t) for t in stop_ids}
        state = self._synced(seq_id, key, output_ids)
        m, accepted = state.matcher, state.accepted
        k = len(drafts)
        # llguidance's bitmask rows, little-endian: token t is bit t % 32 of word t // 32. numpy, not torch: these
        # small ops must not wake torch's intra-op threads, which the model's forward passes keep busy.
        bits = np.zeros((k + 1, self._words), dtype="<u4")
        row_bytes = self._words * 4
        flags = [(False, False)] * (k + 1)  # per row: (may end, cannot go on)

        def fill(j: int) -> None:
            m.unsafe_compute_mask_ptr(bits.ctypes.data + j * row_bytes, row_bytes)
            flags[j] = (m.is_accepting(), m.is_stopped())

        for i in range(len(accepted), len(output_ids)):
            t = int(output_ids[i])
            if t in stops:  # generation ended here: every row is the row before the stop id
                fill(0)
                bits[1:] = bits[0]
                flags[1:] = [flags[0]] * k
                return self._rows(bits, flags, stops)
            if not m.consume_token(t):
                self._seqs.pop(seq_id)
                raise ValueError(f"grammar: output token {t} at index {i} is refused by the "
                                 f"{guide_type} guide ({_short(m.get_error())})")
            accepted.append(t)
        for j in range(k + 1):
            fill(j)
            if j == k:
                break
            t = int(drafts[j])
            if t in stops or not self._engine_allows(bits[j], t) or not m.consume_token(t):
                bits[j + 1:] = bits[j]
                flags[j + 1:] = [flags[j]] * (k - j)
                if m.is_error():  # consumed against its own mask: should not happen, but never keep a dead matcher
                    self._seqs.pop(seq_id)
                break
            accepted.append(t)
        return self._rows(bits, flags, stops)

    def _engine_allows(self, row: np.ndarray, t: int) -> bool:
        """Whether a non-stop token ``t`` is allowed by the engine's bitmask ``row`` ([words] uint32)."""
        if not 0 <= t < self.vocab_size or t in self._engine_eos:
            return False
        return bool((int(row[t >> 5]) >> (t & 31)) & 1)

    def _rows(self, bits: np.ndarray, flags: list[tuple[bool, bool]], stops: set[int]) -> torch.Tensor:
        """Unpack [n, words] uint32 bitmasks into [n, V] bool rows and apply the stop ids' rule."""
        rows = np.unpackbits(bits.view(np.uint8), axis=1, count=self.vocab_size, bitorder="little").view(np.bool_)
        if self._engine_eos:
            rows[:, self._engine_eos] = False  # the engine's own EOS: only the request's stop ids end a sequence
        may_end = np.array([a or s for a, s in flags], dtype=np.bool_)
        rows[np.array([s for _, s in flags], dtype=np.bool_)] = False
        stop_cols = sorted(t for t in stops if 0 <= t < self.vocab_size)
        if stop_cols:
            rows[:, stop_cols] = may_end[:, None]
        empty = np.flatnonzero(~rows.any(axis=1))
        fallback = stop_cols or self._engine_eos
        if len(empty) and fallback:
            rows[np.ix_(empty, np.asarray(fallback, dtype=np.int64))] = True
        return torch.from_numpy(rows)
