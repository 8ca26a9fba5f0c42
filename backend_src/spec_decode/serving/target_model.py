"""Backend of the ``target_model`` model: the scorer over k+1 positions with the per-sequence KV cache.

Config parameters: :class:`~spec_decode.settings.TargetSettings` (``model_path``, ``device``, ``dtype``,
``max_sequences``). Inputs: :data:`~.wire.TARGET_MODEL_INPUTS`. Outputs per row: ``target_probs`` FP32 [k+1, V] and
``hidden_states`` FP32 [k+1, H], the target's last hidden states at the same positions (what a hidden-state speculator
drafts from; generate keeps those of the accepted positions for the sequence's next step), both on the model's device
([0, 0] for a release). The rows of one ``execute()`` are scored in one forward pass
(:meth:`~spec_decode.engine.scorer.TargetScorer.score_batch`). Metrics (docs/metrics.md): time scoring, the target's
KV caches.
"""

from __future__ import annotations

import time

import torch

from ..engine.model_loading import load_cached_lm, resolve_model_path
from ..engine.scorer import Scores, TargetScorer
from ..settings import TargetSettings
from .batching import BatchedBackend, Work
from .metrics import Metrics
from .step_inputs import draft_token_ids, is_release, sampling_params, sequence_id, token_ids
from .wire import TARGET_MODEL_INPUTS


def _outputs(scores: Scores) -> dict:
    """A row's scores as target_model's outputs (float32)."""
    return {"target_probs": scores.probs.float(), "hidden_states": scores.hidden.float()}


class TargetBackend(BatchedBackend):
    """target_model: scores each row's drafts.

    Args:
        params: the config.pbtxt parameters (name -> string value).
        metrics: where its metrics go (default: kept in the process only).

    Raises:
        ValueError: a config parameter out of range or naming no model (named).
        FileNotFoundError: a model folder that does not exist.
    """

    MODEL, Settings, INPUTS = "target_model", TargetSettings, TARGET_MODEL_INPUTS

    def __init__(self, params: dict[str, str], metrics: Metrics | None = None):
        super().__init__(params, metrics)
        path = resolve_model_path(self.settings.model_path)
        if path is None:
            raise ValueError(f"config parameter 'model_path': {self.settings.model_path!r} names no model")
        self.lm = load_cached_lm(path, self.settings)
        self.scorer = TargetScorer(self.lm)
        self._refresh_gauges()

    def _refresh_gauges(self) -> None:
        self.metrics.set("spec_decode_target_kv_cache_sequences", len(self.lm))
        self.metrics.set("spec_decode_target_kv_cache_tokens", self.lm.cached_tokens())

    def _run_group(self, group, items: list[tuple]) -> list:  # the k+1 positions of several sequences in one forward
        start = time.perf_counter()
        out = self.scorer.score_batch(items)
        self.metrics.add("spec_decode_score_seconds_total", time.perf_counter() - start)
        return out

    def _plan(self, inputs: dict):
        seq_id = sequence_id(inputs)
        if is_release(inputs):
            self.scorer.release(seq_id)
            return {"target_probs": torch.zeros((0, 0), dtype=torch.float32),
                    "hidden_states": torch.zeros((0, 0), dtype=torch.float32)}
        drafts = draft_token_ids(inputs, self.lm.vocab_size)
        ids, params = token_ids(inputs), sampling_params(inputs)
        self.lm.check(ids + drafts, len(drafts) + 1)
        return Work(seq_id, (seq_id, ids, drafts, params), _outputs)
