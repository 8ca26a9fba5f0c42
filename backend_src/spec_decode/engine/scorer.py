"""The target scorer: one forward pass over the pending tokens plus k drafts (vLLM's ``MQAScorer``; gpt-fast).

Returns target probabilities for the k+1 positions after the request's logits processors (each position over its own
prefix: :func:`~spec_decode.processors.process_logits`) and sampling transforms: row i is the target distribution for
the token after draft i-1 (row 0 follows the last committed token; row k is the bonus position; for a draft tree, row
i follows node i - 1's path: :mod:`spec_decode.tree`, scored under the tree mask), and the target's last
hidden states at the same positions (what a hidden-state speculator drafts from); with log-probs asked for, the log-prob
rows of the server's ``logprobs_mode`` and, on a sequence's first step, the prompt tokens' log-probs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ..processors import LOGPROBS_MODES, ProcessorSpec, TokenLogprobs, process_logits, token_logprobs
from ..sampling import SamplingParams, logits_to_probs
from ..tree import is_chain
from .kv_cache import CachedCausalLM

if TYPE_CHECKING:
    from ..processors.grammar import GrammarCache


class Scores(NamedTuple):
    """One sequence's scores.

    Attributes:
        probs: [k+1, V] float32 target probabilities on the model's device.
        hidden: [k+1, H] the target's last hidden states (model dtype) at those positions: row j is the state after
            the last committed token and the first j drafts.
        log_probs: [k+1, V] float32 log-prob rows of the server's ``logprobs_mode`` when the sequence asks for
            log-probs and the mode is ``raw`` (the target's log-softmax before any processing); None otherwise (the
            verifier then takes the log of ``probs``: ``processed``).
        prompt: the prompt tokens' log-probs (tokens 1..P-1; the raw log-softmax) on a sequence's first step when it
            asks for them (``prompt_logprobs`` >= 0), else None.
        cached: leading token ids the forward reused from the target's cache instead of computing them (vLLM's
            ``num_cached_tokens``).
    """

    probs: torch.Tensor
    hidden: torch.Tensor
    log_probs: torch.Tensor | None = None
    prompt: TokenLogprobs | None = None
    cached: int = 0


class TargetScorer:
    """Scores drafts with the target model on its per-sequence KV cache.

    Args:
        lm: the target model wrapped with its per-sequence KV cache.
        logprobs_mode: ``raw`` or ``processed`` (:mod:`spec_decode.processors.logprobs`).
        grammar: the process's grammar matchers, for sequences with structured output (None: refused).

    Raises:
        ValueError: an unknown ``logprobs_mode``.
    """

    def __init__(self, lm: CachedCausalLM, logprobs_mode: str = "raw", grammar: GrammarCache | None = None):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.lm = lm
        self.logprobs_mode = logprobs_mode
        self.grammar = grammar

    def score(
        self, seq_id: int, token_ids: list[int], draft_token_ids: list[int], params: SamplingParams
    ) -> torch.Tensor:
        """Target probabilities for k+1 positions (:meth:`score_batch` of one sequence, without the hidden states).

        Args:
            seq_id: sequence identifier.
            token_ids: committed token ids (prompt + accepted output), length >= 1.
            draft_token_ids: the k draft tokens (k >= 0).
            params: the request's sampling parameters.

        Returns:
            [k+1, V] float32 on the model's device.

        Raises:
            ValueError: as :meth:`score_batch`.
        """
        return self.score_batch([(seq_id, token_ids, draft_token_ids, params)])[0].probs

    def score_batch(self, items: list[tuple]) -> list[Scores]:
        """The k+1 positions of several sequences in one forward pass (:meth:`~.kv_cache.CachedCausalLM.logits_batch`).

        Args:
            items: (seq_id, token_ids, draft_token_ids, params) per sequence, optionally with a fifth element, its
                :class:`~spec_decode.processors.ProcessorSpec` or None, and a sixth, the drafts' parents (a draft tree,
                :mod:`spec_decode.tree`; None: a chain); seq_ids distinct.

        Returns:
            per item, its :class:`Scores` ([k_i+1, V] probabilities, [k_i+1, H] hidden states, log-prob rows and
            prompt log-probs as asked).

        Raises:
            ValueError: as :meth:`~.kv_cache.CachedCausalLM.logits_batch`; a guide on a scorer without grammar
                matchers, or from the grammar (:func:`~spec_decode.processors.process_logits`); parents that are not a
                tree of the drafts (checked by ``logits_batch``: :func:`~spec_decode.tree.check_tree`, naming
                ``draft_parents``).
        """
        calls, specs = [], []
        for seq_id, ids, d, _, *rest in items:
            spec: ProcessorSpec | None = rest[0] if rest else None
            parents = rest[1] if len(rest) > 1 else None
            tree = None if parents is None or is_chain(parents) else [int(p) for p in parents]
            n = len(d) + 1
            if tree is None and spec is not None and spec.prompt_logprobs_at(len(ids)):
                n = len(ids) + len(d)  # the first step: every prompt position too
            calls.append((seq_id, list(ids) + list(d), n, tree))
            specs.append(spec)
        reused: list[int] = []
        out = self.lm.logits_batch(calls, hidden=True, reused=reused)
        return [self._scores(lg, h, item, spec)._replace(cached=c)
                for (lg, h), item, spec, c in zip(out, items, specs, reused)]

    def chunk_end(self, seq_id: int, token_ids: list[int], num_drafts: int, spec: ProcessorSpec | None,
                  budget: int) -> int | None:
        """Chunked prefill, decided where the cache is known: where the prompt chunk of this step ends when its
        uncached tokens exceed ``budget`` (the step's share of the round's token budget), else None (the step runs
        whole). vLLM's scheduler budgets a request by its tokens past its prefix-cache hit the same way.

        Only a step without drafts whose first step does not ask for the prompt's log-probs is cut. A chunk is scored
        as ``token_ids[:end]`` without drafts or processors; its sampled token is discarded and its keys stay cached,
        so the next step computes only what follows.

        Args:
            seq_id: the sequence. token_ids: its committed ids. num_drafts: the step's drafts (k).
            spec: its processors, or None. budget: new positions it may compute (<= 0: no bound).

        Returns:
            the chunk's end (cached tokens + ``budget``), or None.
        """
        if budget <= 0 or num_drafts or (spec is not None and spec.prompt_logprobs_at(len(token_ids))):
            return None
        held = self.lm.held_prefix_len(seq_id, token_ids)
        return held + budget if len(token_ids) - held > budget else None

    def _scores(self, logits: torch.Tensor, hidden: torch.Tensor, item: tuple, spec: ProcessorSpec | None) -> Scores:
        """One sequence's :class:`Scores` from its logits (the step's k+1 rows last, after any prompt rows)."""
        seq_id, ids, drafts, params = item[:4]
        parents = item[5] if len(item) > 5 else None
        n = len(drafts) + 1
        prompt = None
        if spec is not None and logits.shape[0] > n:  # prompt rows 0..P-2 predict prompt tokens 1..P-1
            rows = torch.log_softmax(logits[: len(ids) - 1].float(), dim=-1)
            prompt = token_logprobs(rows, list(ids[1:]), spec.prompt_logprobs)
        step = logits[-n:]
        processed = step if spec is None else process_logits(step, spec, ids, list(drafts), self.grammar, seq_id,
                                                             parents=parents)
        probs = logits_to_probs(processed, params)
        log_probs = None
        if spec is not None and spec.logprobs and self.logprobs_mode == "raw":
            log_probs = torch.log_softmax(step.float(), dim=-1)
        return Scores(probs, hidden[-n:], log_probs, prompt)

    def release(self, seq_id: int) -> None:
        """Free the KV cache (and the grammar matcher) of ``seq_id``."""
        self.lm.release(seq_id)
        if self.grammar is not None:
            self.grammar.release(seq_id)
