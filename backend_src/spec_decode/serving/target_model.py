"""Backend of the ``target_model`` model: the scorer over k+1 positions with the per-sequence KV cache.

Config parameters: :class:`~spec_decode.settings.TargetSettings` (``model_path``, ``device``, ``dtype``,
``max_sequences``, ``kv_cache_max_tokens``, ``enable_prefix_caching``, ``logprobs_mode``, ``aux_hidden_state_layers``).
Inputs: :data:`~.wire.TARGET_MODEL_INPUTS`. Outputs per row: ``target_probs`` FP32 [k+1, V] after the row's logits
processors (``logits_processors``: :mod:`spec_decode.processors`) and ``hidden_states`` FP32 [k+1, H x (1 + A)], the
target's last hidden states at the same positions followed by the inputs of the A ``aux_hidden_state_layers`` (what the
hidden-state speculators draft from; generate keeps those of the accepted positions for the sequence's next step), both
on the model's device ([0, 0] for a release); ``log_probs`` FP32 [k+1, V] raw log-prob rows when the row asks for
log-probs and ``logprobs_mode`` is ``raw`` (else [0, 0]); the prompt's log-probs (``prompt_log_probs`` [P-1],
``prompt_token_ranks`` [P-1], ``prompt_top_log_probs`` / ``prompt_top_log_prob_ids`` [P-1, N]) on a first step that asks
for them (else empty). A greedy row without log-probs sends ``target_probs`` [0, 0] and instead ``target_argmax``
INT64 [k+1] and ``target_argmax_probs`` FP32 [k+1], all the verifier's argmax walk reads ([0] for other rows). Every
row also says what the target measured: ``num_cached_tokens`` INT32 [1] (its leading token ids reused from the cache,
vLLM's name) and ``target_forward_seconds`` FP32 [1] (the execute's scoring seconds). A row without drafts whose
uncached prompt is longer than its ``num_scheduled_tokens`` (its share of generate's round budget) is prefilled in
part: that many positions are computed and nothing is scored (``target_probs`` [0, 0], no argmax; the verifier
answers it with no token). The rows of one ``execute()`` are scored in one forward pass
(:meth:`~spec_decode.engine.scorer.TargetScorer.score_batch`). Metrics
(docs/metrics.md): time scoring, the target's KV caches and prefix caching.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import numpy as np
import torch

from ..engine.model_loading import check_servable, load_cached_lm, load_tokenizer, resolve_model_path
from ..engine.scorer import Scores, TargetScorer
from ..processors import TokenLogprobs, logprob_arrays
from ..processors.grammar import GrammarCache
from ..settings import InvalidInputError, TargetSettings
from ..verifier import argmax_suffices
from .batching import BatchedBackend, Work
from .metrics import Metrics
from .step_inputs import (
    draft_parents,
    draft_token_ids,
    is_release,
    processor_spec,
    sampling_params,
    scheduled_tokens,
    sequence_id,
    token_ids,
)
from .wire import PROMPT_LOGPROB_OUTPUTS, TARGET_MODEL_INPUTS

logger = logging.getLogger(__name__)


def grammar_cache(model_path, vocab_size: int, max_sequences: int) -> GrammarCache:
    """Grammar matchers over the tokenizer of ``model_path`` (built at a process's first structured-output request).

    Raises:
        InvalidInputError: (field ``guided_decoding_guide_type``) the folder has no tokenizer to build them over.
    """
    try:
        tokenizer = load_tokenizer(model_path)
    except (OSError, ValueError) as e:
        raise InvalidInputError("guided_decoding_guide_type", f"structured output needs the target's tokenizer in "
                                f"{model_path}: {e}") from None
    return GrammarCache(tokenizer, vocab_size, max_sequences=max_sequences)


def prompt_outputs(prompt: TokenLogprobs | None) -> dict:
    """The prompt's log-probs as the ``prompt_*`` outputs (empty without them)."""
    return dict(zip(PROMPT_LOGPROB_OUTPUTS, logprob_arrays(prompt)))


_NO_ROWS = torch.zeros((0, 0), dtype=torch.float32)
_NO_ARGMAX = {"target_argmax": torch.zeros(0, dtype=torch.int64), "target_argmax_probs": torch.zeros(0)}


def _facts(cached: int, seconds: float) -> dict:
    """``num_cached_tokens`` and ``target_forward_seconds`` of a row."""
    return {"num_cached_tokens": np.array([cached], np.int32),
            "target_forward_seconds": np.array([seconds], np.float32)}


def _chunk_outputs(result: tuple[Scores, float]) -> dict:
    """A prompt chunk's outputs (:meth:`~spec_decode.engine.scorer.TargetScorer.chunk_end`): nothing scored (the
    verifier answers such a row with no token), the positions reused before it and the forward's seconds."""
    scores, seconds = result
    return {"target_probs": _NO_ROWS, "hidden_states": _NO_ROWS, "log_probs": _NO_ROWS, **prompt_outputs(None),
            **_NO_ARGMAX, **_facts(scores.cached, seconds)}


def _outputs(result: tuple[Scores, float], argmax_only: bool = False) -> dict:
    """A row's (scores, forward seconds) as target_model's outputs (float32). ``argmax_only`` (a greedy row without
    log-probs: the verifier's argmax walk reads nothing else): the k+1 argmax ids (the lowest index on ties, as the
    samplers) and their probabilities in ``target_argmax`` / ``target_argmax_probs``, and ``target_probs`` [0, 0]
    instead of its [k+1, V] rows."""
    scores, seconds = result
    lp = scores.log_probs if scores.log_probs is not None else _NO_ROWS
    probs = scores.probs.float()
    out = {"hidden_states": scores.hidden.float(), "log_probs": lp, **prompt_outputs(scores.prompt),
           **_facts(scores.cached, seconds)}
    if not argmax_only:
        return out | {"target_probs": probs} | _NO_ARGMAX
    best = probs.argmax(-1)
    return out | {"target_probs": _NO_ROWS, "target_argmax": best,
                  "target_argmax_probs": probs.gather(-1, best[:, None])[:, 0]}


class TargetBackend(BatchedBackend):
    """target_model: scores each row's drafts.

    Args:
        params: the config.pbtxt parameters (name -> string value).
        metrics: where its metrics go (default: kept in the process only).
        draft_params: draft_model's config parameters (its ``speculator_path`` decides ``aux_hidden_state_layers:
            auto``; a head that does not load adds no layers: draft_model's own load reports it), or None.

    Raises:
        ValueError: a config parameter out of range or naming no model (named), or a model the engine cannot serve
            (:func:`~spec_decode.engine.model_loading.check_servable`: not a causal decoder, sliding-window attention,
            no end-of-sequence id).
        FileNotFoundError: a model folder that does not exist, or a Hugging Face id not in the local cache.
    """

    IO_METRIC = "spec_decode_target_model_io_seconds_total"  # adapter.execute: decode and encode times
    MODEL, Settings, INPUTS = "target_model", TargetSettings, TARGET_MODEL_INPUTS

    def __init__(self, params: dict[str, str], metrics: Metrics | None = None,
                 draft_params: dict[str, str] | None = None):
        super().__init__(params, metrics)
        path = resolve_model_path(self.settings.model_path)
        if path is None:
            raise ValueError(f"config parameter 'model_path': {self.settings.model_path!r} names no model")
        try:  # an architecture the engine cannot serve fails the load, naming why
            check_servable(path)
        except ValueError as e:
            raise ValueError(f"config parameter 'model_path': {e}") from None
        self.lm = load_cached_lm(path, self.settings, self._aux_layers(path, draft_params))
        self.model_path = path
        self.scorer = TargetScorer(self.lm, self.settings.logprobs_mode)  # grammar matchers: at the first guide
        self._exported_prefix_stats = (0, 0, 0)  # prefix_stats as last exported (queries, hits, reused tokens)
        self._refresh_gauges()

    def _aux_layers(self, path, draft_params: dict[str, str] | None) -> tuple[int, ...]:
        """The layers of ``aux_hidden_state_layers`` (``auto``: those the EAGLE-3 heads of draft_model's
        ``speculator_path`` read; draft_model's defaults when its parameters are unknown)."""
        value = self.settings.aux_hidden_state_layers.strip().lower()
        if value in ("none", ""):
            return ()
        if value != "auto":
            return tuple(int(x) for x in value.split(","))
        from ..proposers.speculators import SpeculatorLoadError, SpeculatorSettings, TargetInfo, aux_hidden_state_layers

        try:
            heads = SpeculatorSettings.from_params(draft_params or {}).speculator_path
            return tuple(aux_hidden_state_layers(heads, TargetInfo.from_folder(path).num_layers))
        except (SpeculatorLoadError, ValueError, OSError) as e:  # draft_model fails its load with the same error
            logger.warning("target_model: draft_model's speculator settings do not load (%s); draft_model fails its "
                           "load with the same error, and target_model returns no auxiliary hidden states", e)
            return ()

    def _refresh_gauges(self) -> None:
        lm = self.lm
        self.metrics.set("spec_decode_target_kv_cache_sequences", len(lm))
        self.metrics.set("spec_decode_target_kv_cache_tokens", lm.cached_tokens())
        self.metrics.set("spec_decode_target_kv_cache_allocated_tokens", lm.allocated_tokens())
        self.metrics.set("spec_decode_target_kv_cache_max_tokens", lm.max_tokens)
        stats, last = lm.prefix_stats, self._exported_prefix_stats
        for name, now, before in (("queries", stats.queries, last[0]), ("hits", stats.hits, last[1]),
                                  ("reused_tokens", stats.reused_tokens, last[2])):
            if now > before:
                self.metrics.add(f"spec_decode_target_prefix_cache_{name}_total", now - before)
        self._exported_prefix_stats = (stats.queries, stats.hits, stats.reused_tokens)
        self.metrics.set("spec_decode_target_prefix_cache_hit_rate", stats.hits / max(1, stats.queries))

    def _run_group(self, group, items: list[tuple]) -> list:  # the k+1 positions of several sequences in one forward
        start = time.perf_counter()
        out = self.scorer.score_batch(items)
        seconds = time.perf_counter() - start
        self.metrics.add("spec_decode_score_seconds_total", seconds)
        return [(scores, seconds) for scores in out]

    def _plan(self, inputs: dict):
        seq_id = sequence_id(inputs)
        if is_release(inputs):
            self.scorer.release(seq_id)
            return {"target_probs": _NO_ROWS, "hidden_states": _NO_ROWS, "log_probs": _NO_ROWS, **prompt_outputs(None),
                    **_NO_ARGMAX, **_facts(0, 0.0)}
        drafts = draft_token_ids(inputs, self.lm.vocab_size)
        ids, params, spec = token_ids(inputs), sampling_params(inputs), processor_spec(inputs)
        self.lm.check(ids + drafts, len(drafts) + 1)
        if spec is not None and spec.prompt_len > len(ids):
            raise InvalidInputError("logits_processors", f"prompt_len {spec.prompt_len} is above the row's "
                                                         f"{len(ids)} token ids")
        if spec is not None and spec.guide_type and self.scorer.grammar is None:
            self.scorer.grammar = grammar_cache(self.model_path, self.lm.vocab_size, self.settings.max_sequences)
        parents = draft_parents(inputs, drafts)
        if parents is not None and spec is not None and spec.chains_only(len(ids)):
            raise InvalidInputError("draft_parents", "a guided row, and a first step that asks for the prompt's "
                                                     "log-probs, must draft a chain")
        end = self.scorer.chunk_end(seq_id, ids, len(drafts), spec, scheduled_tokens(inputs))
        if end is not None:  # chunked prefill: this step computes part of the prompt and scores nothing
            return Work(seq_id, (seq_id, ids[:end], [], params, None), _chunk_outputs)
        argmax_only = argmax_suffices(params, spec)
        return Work(seq_id, (seq_id, ids, drafts, params, spec, parents), partial(_outputs, argmax_only=argmax_only))
