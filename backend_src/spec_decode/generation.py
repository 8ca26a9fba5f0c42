"""One request's generation: a state machine that asks for steps and applies their tokens, with no I/O.

One loop, two transports (docs/architecture.md, "One loop, two transports"): a driver asks :class:`Generation` for
the next step's inputs (:meth:`Generation.next_step`), runs the step (in process: :mod:`spec_decode.in_process`; over
Triton by BLS to the ``spec_step`` ensemble: :mod:`spec_decode.serving.generate`), and hands the step's tokens back
(:meth:`Generation.commit`), which applies the stop conditions, moves k by the method's schedule and returns the text
and ids to stream.

Stops: EOS (the tokenizer's and the model's generation config), ``end_id`` or ``stop_token_ids`` (not emitted), a stop
word (the first occurrence completed by a token at or after the ``min_tokens``-th output token; text is cut before
it and the token that completed it is the last id emitted, as in vLLM; an occurrence completed earlier never stops
the request), ``max_tokens`` (exactly), and ``max_model_len``. They are checked token by token, so a stop inside an
accepted run discards the rest of the run, nothing past a stop is sent or counted, and the cut is the same however
the steps split the token stream (every method, every k).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from .processors import ProcessorSpec, TokenLogprobs
from .protocol import AUTO, NO_SPECULATION, StepInputs, StepResult
from .request import GenerationRequest
from .sampling import SamplingParams
from .scheduler.k_schedule import ConstantK, KSchedule
from .settings import InvalidInputError

if TYPE_CHECKING:
    import numpy as np


@dataclass
class Chunk:
    """One streamed response's worth of output.

    Attributes:
        text: new text (complete UTF-8 characters only).
        token_ids: new token ids.
        log_probs: target log-probs of ``token_ids`` (empty unless requested).
        finished: True on the last chunk.
        finish_reason: None, "stop" (EOS, end_id or stop word), "length" (max_tokens or max_model_len) or "cancelled".
        ranks: the 1-based rank of each of ``token_ids`` (with ``top_logprobs`` or log-probs asked for; else empty).
        top_ids: per token, its position's ``top_logprobs`` most probable ids (else empty).
        top_log_probs: their log-probs.
    """

    text: str
    token_ids: list[int]
    log_probs: list[float] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    ranks: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_log_probs: list[list[float]] = field(default_factory=list)


@dataclass
class GenerationStats:
    """Per-request statistics (vLLM ``SpecDecodeWorkerMetrics`` counted per request, on committed tokens); with
    ``speculative_method=auto``, the method and k chosen for each committed step (:meth:`Generation.commit`)."""

    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    step_methods: list[str] = field(default_factory=list)  # speculative_method=auto: the method of each step
    step_draft_tokens: list[int] = field(default_factory=list)  # and the k it chose
    step_draft_trees: list[bool] = field(default_factory=list)  # and whether it chose a tree
    step_tree_top_k: list[int] = field(default_factory=list)  # and that tree's width (0: the config's, or none)


class Generation:
    """State of one request's generation (no I/O).

    Args:
        seq_id: unique sequence id (uint64).
        prompt_ids: tokenised prompt (int token ids, length >= 1).
        request: the validated request.
        tokenizer: a Hugging Face fast tokenizer: text is streamed by tokenizers' ``DecodeStream`` over its
            ``backend_tokenizer`` (never a broken UTF-8 character; the prompt gives the first token its context).
        eos_token_ids: ids that end generation (not emitted), besides ``request.end_id`` and
            ``request.stop_token_ids``; ignored (emitted like any token) when ``request.ignore_eos``.
        max_model_len: prompt + output must fit in this many tokens.
        seed: the request seed (``request.random_seed`` or one drawn by the caller).
        schedule: how k moves from step to step, starting at ``request.num_draft_tokens`` (the method's
            :func:`~spec_decode.proposers.k_schedule`; default: constant).

    Raises:
        InvalidInputError: (field ``text_input``) a prompt of no tokens, or one that leaves no room for an output token
            within ``max_model_len``.
    """

    def __init__(self, seq_id, prompt_ids, request: GenerationRequest, tokenizer, eos_token_ids, max_model_len, seed,
                 schedule: KSchedule | None = None):
        if len(prompt_ids) < 1:
            raise InvalidInputError("text_input", "the prompt must contain at least one token")
        if len(prompt_ids) >= max_model_len:
            raise InvalidInputError("text_input", f"prompt is {len(prompt_ids)} tokens; must be below "
                                                  f"max_model_len={max_model_len} (prompt + output)")
        self.seq_id = seq_id
        self.request = request
        self.token_ids = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.max_model_len = max_model_len
        self.stop_ids = set() if request.ignore_eos else set(int(t) for t in eos_token_ids)
        if request.end_id is not None:
            self.stop_ids.add(int(request.end_id))
        self.stop_ids.update(request.stop_token_ids)
        self.processors = self._processors(tokenizer)
        self.prompt_logprobs: TokenLogprobs | None = None  # from the first step, when asked for
        self.params = SamplingParams(request.temperature, request.top_k, request.top_p, int(seed),
                                     seeded=request.random_seed is not None)
        self._tokenizer = tokenizer.backend_tokenizer
        self._decode = DecodeStream(ids=list(prompt_ids), skip_special_tokens=True)
        self.stats = GenerationStats()
        self.text = ""  # all complete output text so far (stop words are searched here)
        self.sent_chars = 0  # how much of ``text`` has been handed out
        self.finished = False
        self.finish_reason: str | None = None
        self.cum_log_prob = 0.0
        self.hidden_states: np.ndarray | None = None  # [m, H] float32 before the last committed token (StepInputs)
        self.schedule = schedule or ConstantK()
        self.k = request.num_draft_tokens  # k of the next step (the schedule moves it)
        self.cached_len = 0  # leading token ids the target's cache is expected to hold (StepInputs.cached_len)

    def _processors(self, tokenizer) -> ProcessorSpec | None:
        """The request's :class:`~spec_decode.processors.ProcessorSpec`, or None when it asks for no processor and no
        log-probs. Bad words are tokenised as written and after a space (a word inside text is usually one token
        with its leading space), as vLLM does."""
        req = self.request
        bad: list[tuple[int, ...]] = []
        for word in req.bad_words:
            for variant in (word, " " + word):
                ids = tuple(tokenizer(variant, add_special_tokens=False)["input_ids"])
                if ids and ids not in bad:
                    bad.append(ids)
        spec = ProcessorSpec(self.prompt_len, req.repetition_penalty, req.presence_penalty, req.frequency_penalty,
                             req.min_tokens, tuple(sorted(self.stop_ids)), tuple(bad), req.guided_decoding_guide_type,
                             req.guided_decoding_guide, req.wants_logprobs, req.top_logprobs, req.prompt_logprobs)
        return spec if spec.changes_logits or spec.logprobs or spec.prompt_logprobs >= 0 else None

    @property
    def output_ids(self) -> list[int]:
        """Committed output token ids."""
        return self.token_ids[self.prompt_len :]

    def next_step(self) -> StepInputs:
        """Inputs of the next step; k is clamped so that the sequence never passes max_model_len.

        k is deliberately not clamped by max_tokens: the step structure (and so a seeded request's noise) then does
        not depend on max_tokens, and a shorter request's output is a prefix of a longer one's. What passes
        max_tokens is trimmed by :meth:`commit`.
        """
        req = self.request
        room = self.max_model_len - len(self.token_ids)
        k = 0 if req.speculative_method == NO_SPECULATION else max(0, min(self.k, room - 1))
        spec = self.processors
        tree = req.draft_tree and not (spec is not None and spec.chains_only(len(self.token_ids)))
        return StepInputs(self.seq_id, list(self.token_ids), k, req.speculative_method, self.params, self.stats.steps,
                          req.acceptance_method, self.hidden_states, self.processors, self.cached_len,
                          auto=req.speculative_method == AUTO, draft_tree=bool(tree), tree_top_k=req.tree_top_k,
                          tree_depth=req.tree_depth)

    def _held_back(self) -> int:
        """Characters at the end of ``text`` that could begin a stop word (not sent until resolved)."""
        hold = 0
        for w in self.request.stop_words:
            for n in range(min(len(w) - 1, len(self.text)), hold, -1):
                if self.text.endswith(w[:n]):
                    hold = n
                    break
        return hold

    def _stop_completed_after(self, before: int) -> int | None:
        """Where the earliest stop word occurrence that ends past ``text[:before]`` starts (None: no such occurrence).

        Only occurrences completed by the token just decoded count: one completed earlier (before ``min_tokens``, or
        by an earlier token of the same step) never ends the request later, so the cut depends on the token stream
        alone, not on how the steps split it (vLLM's ``StopChecker``). Such an occurrence never starts in text already
        sent: its start lies in the held-back tail (:meth:`_held_back`).
        """
        stop_at = None
        if len(self.text) == before:  # the token completed no character
            return None
        for w in self.request.stop_words:
            pos = self.text.find(w, max(0, before - len(w) + 1))
            if pos >= 0 and (stop_at is None or pos < stop_at):
                stop_at = pos
        return stop_at

    def commit(self, result: StepResult, step: StepInputs | None = None) -> Chunk:
        """Apply one step's tokens with the stop conditions; return what to stream.

        Args:
            result: the step's output ids (1..k+1), drafts proposed, log-probs and hidden states; or a prompt chunk's
                result (``prefilled`` set: :mod:`spec_decode.scheduler.chunked_prefill`), which only moves
                ``cached_len``.
            step: the inputs the step ran with; for an ``auto`` step, its chosen method and k join the statistics.

        Returns:
            the new text and ids that passed the stop conditions (possibly none), finished on the last chunk; empty
            for a prompt chunk.

        Raises:
            RuntimeError: the step returned no token, or the generation already finished.
        """
        if self.finished:
            raise RuntimeError("generation already finished")
        if result.prefilled is not None:  # a chunk of the prompt (chunked prefill): no token, not a step
            self.cached_len = result.prefilled
            return Chunk("", [])
        if not result.output_ids:
            raise RuntimeError("speculative step returned no token")
        req = self.request
        self.stats.steps += 1
        self.stats.draft_tokens += result.num_draft_tokens
        if step is not None and step.auto:
            self.stats.step_methods.append(step.method)
            self.stats.step_draft_tokens.append(step.num_draft_tokens)
            self.stats.step_draft_trees.append(step.draft_tree)
            self.stats.step_tree_top_k.append(step.tree_top_k if step.draft_tree else 0)
        accepted_in_step = len(result.output_ids) - 1
        # a tree's k is its node budget: the step counts as wholly accepted when its deepest path was
        depth = result.num_draft_tokens if result.draft_depth is None else result.draft_depth
        full = accepted_in_step >= depth
        self.k = self.schedule.update(self.k, result.num_draft_tokens,
                                      result.num_draft_tokens if full else accepted_in_step)
        # the positions that predicted this step's tokens: before the last of them once they are committed
        self.hidden_states = result.hidden_states
        if result.prompt is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = result.prompt
        new_ids: list[int] = []
        new_lps: list[float] = []
        stop_at: int | None = None  # cut ``text`` here (stop word)
        for j, tok in enumerate(result.output_ids):
            if tok in self.stop_ids:
                self.finish_reason = "stop"
                break
            self.token_ids.append(tok)
            new_ids.append(tok)
            if result.log_probs is not None:
                new_lps.append(float(result.log_probs[j]))
            before = len(self.text)
            self.text += self._decode.step(self._tokenizer, tok) or ""
            if len(self.token_ids) - self.prompt_len >= req.min_tokens:
                stop_at = self._stop_completed_after(before)
            if stop_at is not None:
                self.finish_reason = "stop"
                break
            if len(new_ids) + self.stats.emitted_tokens >= req.max_tokens or len(self.token_ids) >= self.max_model_len:
                self.finish_reason = "length"
                break
        self.cached_len = len(self.token_ids) - 1  # the step computed every position before its last token
        self.stats.emitted_tokens += len(new_ids)
        self.stats.accepted_tokens += min(accepted_in_step, len(new_ids))
        self.cum_log_prob += sum(new_lps)
        self.finished = self.finish_reason is not None
        if stop_at is not None:
            self.text = self.text[:stop_at]
            end = len(self.text)
        elif self.finished:
            end = len(self.text)
        else:
            end = len(self.text) - self._held_back()
        end = max(end, self.sent_chars)
        chunk_text = self.text[self.sent_chars : end]
        self.sent_chars = end
        chunk = Chunk(chunk_text, new_ids, new_lps if req.wants_logprobs else [], self.finished, self.finish_reason)
        if result.logprobs is not None and req.wants_logprobs:
            n = len(new_ids)
            chunk.ranks = list(result.logprobs.ranks[:n])
            chunk.top_ids = [list(r) for r in result.logprobs.top_ids[:n]]
            chunk.top_log_probs = [list(r) for r in result.logprobs.top_log_probs[:n]]
        return chunk

    def cancel(self) -> Chunk:
        """Finish as cancelled; returns an empty final chunk."""
        self.finished, self.finish_reason = True, "cancelled"
        return Chunk("", [], [], True, "cancelled")


__all__ = ["Chunk", "Generation", "GenerationStats"]
