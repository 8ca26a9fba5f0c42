"""The generation loop: one speculative step at a time until a stop condition, with per-step streaming chunks.

One loop, two transports (README, "How it works"): :class:`Generation` is a small state machine with no I/O. A driver
asks it for the next step's inputs (:meth:`Generation.next_step`), runs the step (in process with :class:`LocalStep`,
or over Triton by BLS to the ``spec_step`` ensemble in ``generate``'s ``model.py``), and hands the step's tokens back
(:meth:`Generation.commit`), which applies the stop conditions and returns the text and ids to stream.

Stops: EOS (the tokenizer's and the model's generation config) or ``end_id`` (not emitted), a stop word (text is cut
before it; the token that completed it is the last id emitted, as in vLLM), ``max_tokens`` (exactly), and
``max_model_len``. They are checked token by token, so a stop inside an accepted run discards the rest of the run:
nothing past a stop is sent or counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .detokenizer import IncrementalDetokenizer
from .request import GenerationRequest
from .sampling import SamplingParams


@dataclass
class StepInputs:
    """What one speculative step needs (the spec_step protocol: README, "How it works").

    Attributes:
        seq_id: sequence id (uint64), unique per request.
        token_ids: committed ids (prompt + accepted output).
        num_draft_tokens: k for this step (0 = plain decoding), already clamped by max_tokens and max_model_len.
        method: speculative method (none, draft, ngram).
        params: sampling parameters (with the request seed).
        step: step counter (0-based), mixed into the noise seed.
        acceptance_method: "rejection", "typical", or "" for the verifier's default.
    """

    seq_id: int
    token_ids: list[int]
    num_draft_tokens: int
    method: str
    params: SamplingParams
    step: int
    acceptance_method: str = ""


@dataclass
class StepResult:
    """What one speculative step returns.

    Attributes:
        output_ids: 1..k+1 token ids: accepted drafts then the recovered or bonus token.
        num_draft_tokens: how many draft tokens the proposer actually proposed (k' <= k).
        log_probs: target log-probability of each output id (same length), or None.
    """

    output_ids: list[int]
    num_draft_tokens: int
    log_probs: list[float] | None = None


@dataclass
class Chunk:
    """One streamed response's worth of output.

    Attributes:
        text: new text (complete UTF-8 characters only).
        token_ids: new token ids.
        log_probs: target log-probs of ``token_ids`` (empty unless requested).
        finished: True on the last chunk.
        finish_reason: None, "stop" (EOS, end_id or stop word), "length" (max_tokens or max_model_len) or "cancelled".
    """

    text: str
    token_ids: list[int]
    log_probs: list[float] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class GenerationStats:
    """Per-request statistics (vLLM ``SpecDecodeWorkerMetrics`` counted per request, on committed tokens)."""

    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """accepted / draft tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """emitted tokens / steps."""
        return self.emitted_tokens / self.steps if self.steps else 0.0


class Generation:
    """State of one request's generation (no I/O).

    Args:
        seq_id: unique sequence id.
        prompt_ids: tokenised prompt (length >= 1).
        request: the validated request.
        tokenizer: Hugging Face tokenizer (for incremental detokenisation).
        eos_token_ids: ids that end generation (not emitted), besides ``request.end_id``; ignored (emitted like any
            token) when ``request.ignore_eos``.
        max_model_len: prompt + output must fit.
        seed: the request seed (``request.random_seed`` or one drawn by the caller).
        adaptive_max_num_draft_tokens: 0 (default) keeps k = ``request.num_draft_tokens`` every step; > 0 adapts k
            to recent acceptance as transformers' assisted generation does (``num_assistant_tokens_schedule=
            "heuristic"``): k += 2 (up to this bound) after a step whose drafts were all accepted, k -= 1 (down to 1)
            after a step that rejected one. Steps where the proposer found fewer than k tokens leave k unchanged.

    Raises:
        ValueError: the prompt does not leave room for one output token within ``max_model_len``.
    """

    def __init__(self, seq_id, prompt_ids, request: GenerationRequest, tokenizer, eos_token_ids, max_model_len, seed,
                 adaptive_max_num_draft_tokens: int = 0):
        if len(prompt_ids) < 1:
            raise ValueError("prompt must contain at least one token")
        if len(prompt_ids) >= max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens; max_model_len is {max_model_len} (prompt + output)"
            )
        self.seq_id = seq_id
        self.request = request
        self.token_ids = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.max_model_len = max_model_len
        self.stop_ids = set() if request.ignore_eos else set(int(t) for t in eos_token_ids)
        if request.end_id is not None:
            self.stop_ids.add(int(request.end_id))
        self.params = SamplingParams(request.temperature, request.top_k, request.top_p, int(seed),
                                     seeded=request.random_seed is not None)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stats = GenerationStats()
        self.text = ""  # all complete output text so far (stop words are searched here)
        self.sent_chars = 0  # how much of ``text`` has been handed out
        self.finished = False
        self.finish_reason: str | None = None
        self.cum_log_prob = 0.0
        self.adaptive_max_k = int(adaptive_max_num_draft_tokens)
        self.k = request.num_draft_tokens  # k of the next step (changes only when adaptive)

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
        k = 0 if req.speculative_method == "none" else max(0, min(self.k, room - 1))
        return StepInputs(self.seq_id, list(self.token_ids), k, req.speculative_method, self.params, self.stats.steps,
                          req.acceptance_method)

    def _held_back(self) -> int:
        """Characters at the end of ``text`` that could begin a stop word (not sent until resolved)."""
        hold = 0
        for w in self.request.stop_words:
            for n in range(min(len(w) - 1, len(self.text)), hold, -1):
                if self.text.endswith(w[:n]):
                    hold = n
                    break
        return hold

    def commit(self, result: StepResult) -> Chunk:
        """Apply one step's tokens with the stop conditions; return what to stream.

        Raises:
            RuntimeError: the step returned no token, or the generation already finished.
        """
        if self.finished:
            raise RuntimeError("generation already finished")
        if not result.output_ids:
            raise RuntimeError("speculative step returned no token")
        req = self.request
        self.stats.steps += 1
        self.stats.draft_tokens += result.num_draft_tokens
        accepted_in_step = len(result.output_ids) - 1
        if self.adaptive_max_k > 0 and result.num_draft_tokens >= self.k > 0:
            if accepted_in_step >= result.num_draft_tokens:
                self.k = min(self.k + 2, self.adaptive_max_k)
            else:
                self.k = max(1, self.k - 1)
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
            self.text += self.detok.add(tok)
            for w in req.stop_words:
                # Search only where a new match could start: near the end of the text.
                pos = self.text.find(w, max(0, self.sent_chars - len(w)))
                if pos >= 0 and (stop_at is None or pos < stop_at):
                    stop_at = pos
            if stop_at is not None:
                self.finish_reason = "stop"
                break
            if len(new_ids) + self.stats.emitted_tokens >= req.max_tokens or len(self.token_ids) >= self.max_model_len:
                self.finish_reason = "length"
                break
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
        return Chunk(chunk_text, new_ids, new_lps if req.return_log_probs else [], self.finished, self.finish_reason)

    def cancel(self) -> Chunk:
        """Finish as cancelled; returns an empty final chunk."""
        self.finished, self.finish_reason = True, "cancelled"
        return Chunk("", [], [], True, "cancelled")


def speculation_disabled(running: int, disable_by_batch_size: int) -> bool:
    """vLLM's ``disable_by_batch_size``: with this many running sequences or more, steps run without speculation
    (k = 0).

    Speculation trades throughput for latency and loses at high load. ``disable_by_batch_size`` <= 0 never disables.
    """
    return 0 < disable_by_batch_size <= running


class LocalStep:
    """The in-process transport: proposer, scorer and verifier objects called directly (tests and benchmarks).

    Args:
        proposers: method name -> proposer (``none`` needs no entry).
        scorer: the :class:`~spec_decode.scorer.TargetScorer`.
        verifier: a :class:`~spec_decode.step.Verifier` (default: rejection sampling).
    """

    def __init__(self, proposers, scorer, verifier=None):
        from .step import Verifier

        self.proposers = dict(proposers)
        self.scorer = scorer
        self.verifier = verifier or Verifier()

    def __call__(self, inp: StepInputs) -> StepResult:
        """Run draft -> target -> verifier for one sequence."""
        from .step import run_step

        return run_step(inp, self.proposers, self.scorer, self.verifier)

    def release(self, seq_id: int) -> None:
        """Free every per-sequence cache of ``seq_id``."""
        for p in self.proposers.values():
            p.release(seq_id)
        self.scorer.release(seq_id)


def run_local(gen: Generation, step) -> list[Chunk]:
    """Drive ``gen`` to completion with a synchronous step callable; returns every chunk. Releases caches at the end."""
    chunks = []
    try:
        while not gen.finished:
            chunks.append(gen.commit(step(gen.next_step())))
    finally:
        step.release(gen.seq_id)
    return chunks


__all__ = ["Generation", "GenerationStats", "StepInputs", "StepResult", "Chunk", "LocalStep", "run_local"]
