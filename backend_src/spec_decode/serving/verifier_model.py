"""Backend of the ``verifier`` model: rejection sampling (lossless) or typical acceptance (not lossless).

Config parameters: :class:`~spec_decode.verifier.VerifierSettings` (``acceptance_method``, the default when a request
names none; ``typical_epsilon``, ``typical_alpha``, ``backend``, ``num_threads``; docs/verifier.md). Inputs:
:data:`~.wire.VERIFIER_INPUTS`. Outputs per row: ``output_ids`` INT64 [n] (1 <= n <= k+1) and ``output_log_probs``
FP32 [n]; both empty for a release. The rows of one ``execute()`` (a round, and requests queued with it) are verified
in one :meth:`~spec_decode.verifier.Verifier.verify_batch` call: one kernel launch per kind of row on CUDA; a row's bad
input fails that row alone, a sampler error the rows verified with it. Greedy rows (temperature 0) are the argmax walk.
Metrics (docs/metrics.md): time verifying.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..verifier import Verifier, VerifierRow, VerifierSettings
from .batching import BatchedBackend, Work
from .metrics import Metrics
from .step_inputs import acceptance_method, draft_token_ids, sampling_params, scalar
from .wire import VERIFIER_INPUTS


def _outputs(out: tuple[list[int], list[float]]) -> dict:
    """A row's (ids, log-probs) as the verifier's outputs."""
    return {"output_ids": np.asarray(out[0], np.int64), "output_log_probs": np.asarray(out[1], np.float32)}


class VerifierBackend(BatchedBackend):
    """verifier: verifies each row's drafts against its target probabilities.

    Args:
        params: the config.pbtxt parameters (name -> string value).
        metrics: where its metrics go (default: kept in the process only).

    Raises:
        ValueError: a config parameter out of range (named).
    """

    MODEL, Settings, INPUTS = "verifier", VerifierSettings, VERIFIER_INPUTS

    def __init__(self, params: dict[str, str], metrics: Metrics | None = None):
        super().__init__(params, metrics)
        if self.settings.num_threads > 0:  # its CPU work is small: more threads only spin against the target's
            torch.set_num_threads(self.settings.num_threads)
        self.verifier = Verifier(self.settings)

    @staticmethod
    def _row(inputs: dict) -> VerifierRow:
        """One sequence's row of :meth:`Verifier.verify_batch`, without the round's padding."""
        tp = torch.as_tensor(inputs["target_probs"])
        # In a batched request rows are padded to the round's largest k: k is the row's draft count without padding
        # (and without drafts outside the vocabulary, which target_model cut too).
        drafts = torch.as_tensor(draft_token_ids(inputs, tp.shape[-1] if tp.dim() == 2 else 0), dtype=torch.int64)
        k = len(drafts)
        dp = inputs.get("draft_probs")
        if dp is not None and np.prod(tuple(dp.shape)) > 0:
            dp = torch.as_tensor(dp)[:k]
            if not bool(dp.any()):  # padding of a row without draft probabilities (n-gram, suffix) in a batch
                dp = None
        else:
            dp = None
        params = sampling_params(inputs)
        return VerifierRow(tp[: k + 1], drafts.to(tp.device), dp, params.seed, int(scalar(inputs, "step", 0)),
                           params.is_greedy, acceptance_method(inputs))

    @staticmethod
    def _is_release(inputs: dict) -> bool:
        """A release reaches the verifier as target_probs with no rows (target_model's output for it)."""
        tp = inputs.get("target_probs")
        return tp is not None and torch.as_tensor(tp).shape[0] == 0

    def _plan(self, inputs: dict):
        if self._is_release(inputs):
            return {"output_ids": np.zeros(0, np.int64), "output_log_probs": np.zeros(0, np.float32)}
        # Rows have no per-sequence state: any distinct key puts them all in one call.
        return Work(id(inputs), self._row(inputs), _outputs)

    def _run_group(self, group, rows: list[VerifierRow]) -> list:
        start = time.perf_counter()
        out = self.verifier.verify_batch(rows)
        self.metrics.add("spec_decode_verify_seconds_total", time.perf_counter() - start)
        return out
