"""Backend of the ``draft_model`` model: the proposers of :mod:`spec_decode.proposers.registry`.

Config parameters: ``max_num_draft_tokens`` and ``tokenizer_path`` (:class:`~spec_decode.settings.DraftModelSettings`;
the target tokenizer over which the model proposers keep structured output's grammar state) and each registered
proposer's own (its ``Settings``: the draft LM's ``draft_model_path``, ``draft_min_token_prob``, ``device``, ``dtype``,
``max_sequences``; ``ngram_*``; ``suffix_*``; the published heads' ``speculator_*`` and ``target_model_path``;
``hybrid_fallback``; docs/configuration.md). Inputs: the
step protocol's (:data:`~.wire.DRAFT_MODEL_INPUTS`; a row with ``draft_tree`` set may be drafted as a tree:
:attr:`~spec_decode.proposers.ProposalRequest.tree`). Outputs per row: ``draft_token_ids`` INT64 [k'],
``draft_parents`` INT32 [k'] (each draft's parent, -1 = the last committed token: :mod:`spec_decode.tree`; a chain's
``[-1, 0, ..., k' - 2]``; [0] without drafts and for a release) and ``draft_probs`` FP32 [k', V] ([0, 0] for drafts
without probabilities, and for a release). The rows of one
``execute()`` that name the same method go to their proposer in one ``propose`` call (the draft LM runs each draft
position as one batched forward over them). Metrics (docs/metrics.md): time proposing per method, and each proposer's
gauges.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import numpy as np
import torch

from ..engine.model_loading import load_tokenizer, resolve_model_path
from ..processors.grammar import GrammarCache
from ..proposers import NO_SPECULATION, Proposal, build_proposers
from ..proposers.registry import config_parameters
from ..settings import DraftModelSettings, InvalidInputError
from ..tree import chain_parents
from .batching import BatchedBackend, Work
from .metrics import Metrics
from .step_inputs import is_release, proposal_request, sequence_id, token_ids
from .wire import DRAFT_MODEL_INPUTS

logger = logging.getLogger(__name__)


def _no_drafts() -> dict:
    """draft_model outputs for "nothing proposed" (also what a release returns)."""
    return {"draft_token_ids": np.zeros(0, np.int64), "draft_parents": np.zeros(0, np.int32),
            "draft_probs": np.zeros((0, 0), np.float32)}


def _outputs(proposal: Proposal, greedy: bool = False) -> dict:
    """A proposal as draft_model's outputs (draft_probs [0, 0] when it has none, and for a greedy row: the argmax walk
    never reads them; draft_parents the chain's when it has none)."""
    probs = proposal.draft_probs
    if probs is None or greedy:
        probs = torch.zeros((0, 0), dtype=torch.float32)
    tokens = proposal.draft_token_ids.to(torch.int64).numpy()
    parents = (np.asarray(chain_parents(len(tokens)), np.int32) if proposal.draft_parents is None
               else proposal.draft_parents.to(torch.int32).numpy())
    return {"draft_token_ids": tokens, "draft_parents": parents, "draft_probs": probs}


class DraftBackend(BatchedBackend):
    """draft_model: proposes each row's drafts with the proposer its ``speculative_method`` names.

    Args:
        params: the config.pbtxt parameters (name -> string value).
        metrics: where its metrics go (default: kept in the process only).
        target_params: target_model's config parameters (its ``model_path`` is the heads' ``target_model_path``
            unless that is set), or None (the embedded model).

    Raises:
        ValueError: a config parameter out of range (named).
        FileNotFoundError: a model folder that does not exist.
    """

    IO_METRIC = "spec_decode_draft_model_io_seconds_total"  # adapter.execute: decode and encode times
    MODEL, Settings, INPUTS = "draft_model", DraftModelSettings, DRAFT_MODEL_INPUTS

    def __init__(self, params: dict[str, str], metrics: Metrics | None = None,
                 target_params: dict[str, str] | None = None):
        if not (params.get("target_model_path") or "").strip():  # the heads fit the target target_model serves
            params = {**params, "target_model_path": (target_params or {}).get("model_path") or "default"}
        super().__init__(params, metrics, config_parameters())
        self.proposers = build_proposers(params)
        self.methods = (NO_SPECULATION, *self.proposers)
        self.grammar: GrammarCache | None = None  # built at the first structured-output row (model proposers)
        self._grammar_tried = not any(p.applies_processors for p in self.proposers.values())
        tokenizer_path = resolve_model_path(self.settings.tokenizer_path)
        if tokenizer_path is None:
            raise ValueError(f"config parameter 'tokenizer_path': {self.settings.tokenizer_path!r} names no tokenizer")
        self._tokenizer_path = tokenizer_path
        for p in self.proposers.values():
            self.metrics.declare(p.GAUGES)
        self._refresh_gauges()

    def _start_grammar(self) -> None:
        """Give the model proposers (:attr:`~spec_decode.proposers.Proposer.applies_processors`) grammar matchers over
        the target's tokenizer, so that they draft only what the grammar allows. Without a tokenizer they draft
        unconstrained (a warning, once): target_model still enforces the grammar, so output is unchanged."""
        self._grammar_tried = True
        try:
            tokenizer = load_tokenizer(self._tokenizer_path)
        except (OSError, ValueError) as e:
            logger.warning("draft_model: no tokenizer at %s (%s): model proposers draft without the grammar",
                           self._tokenizer_path, e)
            return
        self.grammar = GrammarCache(tokenizer, len(tokenizer))
        for p in self.proposers.values():
            if p.applies_processors:
                p.grammar = self.grammar

    def _refresh_gauges(self) -> None:
        for p in self.proposers.values():
            for name, value in p.gauges().items():
                self.metrics.set(name, value)

    def _plan(self, inputs: dict):
        seq_id = sequence_id(inputs)
        if is_release(inputs):  # with the final ids: the whole response joins suffix decoding's cache
            try:
                final = token_ids(inputs)
            except InvalidInputError:  # none, or not token ids: the caches are freed all the same, nothing joins
                final = None
            for p in self.proposers.values():
                p.release(seq_id, final)
            if self.grammar is not None:
                self.grammar.release(seq_id)
            return _no_drafts()
        method, request = proposal_request(inputs, self.methods, self.settings.max_num_draft_tokens)
        if request is None:
            return _no_drafts()
        if request.processors is not None and request.processors.guide_type and not self._grammar_tried:
            self._start_grammar()
        self.proposers[method].check(request)
        return Work(seq_id, request, partial(_outputs, greedy=request.params.is_greedy), group=method)

    def _run_group(self, method: str, requests: list) -> list[Proposal]:
        start = time.perf_counter()
        out = self.proposers[method].propose(requests)
        self.metrics.add("spec_decode_propose_seconds_total", time.perf_counter() - start, method=method)
        return out
