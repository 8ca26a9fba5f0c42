"""Backend of the ``verifier`` model: rejection sampling (lossless) or typical acceptance (not lossless).

Config parameters: :class:`~spec_decode.verifier.VerifierSettings` (``acceptance_method``, the default when a request
names none; ``typical_epsilon``, ``typical_alpha``, ``backend``, ``num_threads``; docs/verifier.md). Inputs:
:data:`~.wire.VERIFIER_INPUTS`. Outputs per row: ``output_ids`` INT64 [n] (1 <= n <= k+1) and ``output_log_probs``
FP32 [n]; for a row whose ``logits_processors`` ask for log-probs, ``output_token_ranks`` INT64 [n] and the top
``top_logprobs`` alternatives ``top_log_probs`` FP32 / ``top_log_prob_ids`` INT64 [n, N], from target_model's raw
``log_probs`` rows (``logprobs_mode: raw``) or the log of ``target_probs`` (``processed``)
(:func:`~spec_decode.processors.step_logprobs`); all empty for a release. The rows of one ``execute()`` (a round,
and requests queued with it) are verified in one :meth:`~spec_decode.verifier.Verifier.verify_batch` call: one kernel
launch per kind of row on CUDA; a row's bad input fails that row alone, a sampler error the rows verified with it.
Greedy rows (temperature 0) are the argmax walk; one that target_model sent as its argmax alone (``target_argmax``,
``target_argmax_probs``: no log-probs asked) is walked here over those (:func:`~spec_decode.verifier.argmax_walk`),
with the same result.
Seeded sampled rows under rejection sampling are verified by the coupled race keyed by (seed, absolute position)
(:func:`~spec_decode.verifier.rejection.coupled_sample`): ``token_ids`` gives the position (the number of committed
ids), ``seeded`` whether the seed came from the client (absent: True). ``draft_parents`` (INT32 [k], optional;
absent or empty: a chain; padded in a batch: its first k entries are read) makes a row's drafts a tree
(:mod:`spec_decode.tree`; SpecInfer, Miao et al. 2024): the verifier walks it down, and a row's log-probs come from the
target rows of its accepted path (:func:`spec_decode.tree.rows_of`); parents that are not a tree of the drafts fail
that row alone, naming ``draft_parents``. Metrics (docs/metrics.md): time verifying.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .. import tree
from ..processors import ProcessorSpec, TokenLogprobs, logprob_arrays, step_logprobs
from ..settings import InvalidInputError
from ..verifier import Verifier, VerifierRow, VerifierSettings, argmax_walk
from .adapter import strip_padding
from .batching import BatchedBackend, Work
from .metrics import Metrics
from .step_inputs import acceptance_method, draft_parents, draft_token_ids, processor_spec, sampling_params, scalar
from .wire import VERIFIER_INPUTS


def _outputs(out: tuple[list[int], list[float], TokenLogprobs | None]) -> dict:
    """A row's (ids, log-probs, asked-for log-probs) as the verifier's outputs."""
    ids, lps, asked = out
    if asked is None:  # no ranks, no alternatives
        asked = TokenLogprobs(lps, [], [[] for _ in ids], [[] for _ in ids])
    log_probs, ranks, top_lps, top_ids = logprob_arrays(asked)
    return {"output_ids": np.asarray(ids, np.int64), "output_log_probs": log_probs, "output_token_ranks": ranks,
            "top_log_probs": top_lps, "top_log_prob_ids": top_ids}


_EMPTY = _outputs(([], [], None))


def _argmax_ids(inputs: dict) -> list[int]:
    """A greedy row's target argmax ids (target_model's ``target_argmax``), [] for a row that sent its
    distributions."""
    x = inputs.get("target_argmax")
    return [] if x is None else strip_padding(x)


def _scored_nothing(inputs: dict) -> bool:
    """Whether target_model scored nothing for a row without argmax: ``target_probs`` with no rows, or, padded in a
    batch, a first row of zeros (no probability row is all zero)."""
    tp = inputs.get("target_probs")
    if tp is None:
        return False
    tp = torch.as_tensor(tp)
    return tp.shape[0] == 0 or not bool(tp[0].any())


def _given_rows(inputs: dict, name: str, n: int) -> torch.Tensor | None:
    """The first ``n`` rows of a [rows, V] input, or None when the row has none: absent, empty, or all zeros (the
    padding a batched request gives a row without them, e.g. n-gram's draft_probs, or log-prob rows not asked for;
    real probability and log-probability rows are never all zero)."""
    x = inputs.get(name)
    if x is None or np.prod(tuple(x.shape)) == 0:
        return None
    x = torch.as_tensor(x)[:n]
    return x if bool(x.any()) else None


class VerifierBackend(BatchedBackend):
    """verifier: verifies each row's drafts against its target probabilities.

    Args:
        params: the config.pbtxt parameters (name -> string value).
        metrics: where its metrics go (default: kept in the process only).

    Raises:
        ValueError: a config parameter out of range (named).
    """

    IO_METRIC = "spec_decode_verifier_io_seconds_total"  # adapter.execute: decode and encode times
    MODEL, Settings, INPUTS = "verifier", VerifierSettings, VERIFIER_INPUTS

    def __init__(self, params: dict[str, str], metrics: Metrics | None = None):
        super().__init__(params, metrics)
        if self.settings.num_threads > 0:  # its CPU work is small: more threads only spin against the target's
            torch.set_num_threads(self.settings.num_threads)
        self.verifier = Verifier(self.settings)

    def run_batch(self, inputs_list: list[dict]) -> list:
        """Serve a round's rows (:meth:`BatchedBackend.run_batch`), the greedy rows' argmax ids and probabilities
        brought to the host in one copy first (:func:`argmax_to_host`)."""
        return super().run_batch(argmax_to_host(inputs_list))

    @staticmethod
    def _row(inputs: dict) -> VerifierRow:
        """One sequence's row of :meth:`Verifier.verify_batch`, without the round's padding."""
        tp = torch.as_tensor(inputs["target_probs"])
        # In a batched request rows are padded to the round's largest k: k is the row's draft count without padding
        # (and without drafts outside the vocabulary, which target_model cut too).
        drafts = torch.as_tensor(draft_token_ids(inputs, tp.shape[-1] if tp.dim() == 2 else 0), dtype=torch.int64)
        k = len(drafts)
        dp = _given_rows(inputs, "draft_probs", k)
        params = sampling_params(inputs)
        # A seeded row's coupled race is keyed by the absolute position of its first draft: the number of committed
        # ids. Without token_ids (a direct caller of the verifier) the position is unknown: such a row keeps the
        # rejection sampler keyed by (seed, step). ``seeded`` absent counts as seeded (SamplingParams' default;
        # generate sends it in every round).
        has_ids = inputs.get("token_ids") is not None
        position = len(strip_padding(inputs["token_ids"])) if has_ids else 0
        parents = draft_parents(inputs, drafts.tolist())
        return VerifierRow(tp[: k + 1], drafts.to(tp.device), dp, params.seed, int(scalar(inputs, "step", 0)),
                           params.is_greedy, acceptance_method(inputs), position, params.seeded and has_ids,
                           None if parents is None else torch.tensor(parents, dtype=torch.int64))

    @staticmethod
    def _is_release(inputs: dict) -> bool:
        """A row target_model scored nothing for (:func:`_scored_nothing`, and no argmax): a release, or a prompt
        chunk of chunked prefill. It is answered with no token."""
        return not _argmax_ids(inputs) and _scored_nothing(inputs)

    def _plan(self, inputs: dict):
        best = _argmax_ids(inputs)
        if best:  # a greedy row without log-probs: the argmax walk over what target_model sent
            start = time.perf_counter()
            drafts = strip_padding(inputs.get("draft_token_ids", np.zeros(0, np.int64)))
            parents = draft_parents(inputs, drafts)
            given = inputs.get("target_argmax_probs")
            best_probs = torch.zeros(0) if given is None else torch.as_tensor(given)
            if best_probs.reshape(-1).shape[0] < len(best):
                raise InvalidInputError("target_argmax_probs", f"expected one probability per target_argmax id "
                                                               f"({len(best)}), got {best_probs.reshape(-1).shape[0]}")
            ids, lps = argmax_walk(best, best_probs.reshape(-1), drafts, parents)
            out = _outputs((ids, lps, None))
            self.metrics.add("spec_decode_verify_seconds_total", time.perf_counter() - start)
            return out
        if _scored_nothing(inputs):  # a release or a prompt chunk
            return dict(_EMPTY)
        # Rows have no per-sequence state: any distinct key puts them all in one call.
        row, spec = self._row(inputs), processor_spec(inputs)
        log_rows = _given_rows(inputs, "log_probs", row.k + 1) if spec is not None and spec.logprobs else None
        return Work(id(inputs), (row, spec, log_rows), _outputs)

    def _run_group(self, group, items: list[tuple[VerifierRow, ProcessorSpec | None, torch.Tensor | None]]) -> list:
        start = time.perf_counter()
        out = self.verifier.verify_batch([row for row, _, _ in items])
        self.metrics.add("spec_decode_verify_seconds_total", time.perf_counter() - start)
        return [(ids, lps, step_logprobs(row.target_probs, log_rows, ids, spec.top_logprobs, _path_rows(row, ids))
                 if spec is not None and spec.logprobs else None)
                for (ids, lps), (row, spec, log_rows) in zip(out, items)]


def argmax_to_host(rows: list[dict]) -> list[dict]:
    """The rows with every torch ``target_argmax`` and ``target_argmax_probs`` replaced by numpy arrays, all read in
    one device-to-host copy (packed as float64, which holds token ids and float32 probabilities exactly): the argmax
    walk then reads host memory, where it read the device once per row and per draft (on CUDA each read waits for the
    device). Rows without both tensors are passed as they are; the dicts given are not changed.

    Args:
        rows: the verifier's inputs, one dict per row.

    Returns:
        The rows, the ones changed as new dicts.
    """
    picked = [i for i, r in enumerate(rows)
              if isinstance(r.get("target_argmax"), torch.Tensor) and isinstance(r.get("target_argmax_probs"),
                                                                                 torch.Tensor)]
    if not picked:
        return rows
    parts = [t.reshape(-1).double() for i in picked for t in (rows[i]["target_argmax"], rows[i]["target_argmax_probs"])]
    host = torch.cat([t.to(parts[0].device) for t in parts]).cpu().numpy()  # a direct caller may mix devices
    out, offset = list(rows), 0
    for i in picked:
        a, p = rows[i]["target_argmax"], rows[i]["target_argmax_probs"]
        ids = host[offset: offset + a.numel()].astype(np.int64).reshape(tuple(a.shape))
        offset += a.numel()
        probs = host[offset: offset + p.numel()].astype(np.float32).reshape(tuple(p.shape))
        offset += p.numel()
        out[i] = {**rows[i], "target_argmax": ids, "target_argmax_probs": probs}
    return out


def _path_rows(row: VerifierRow, ids: list[int]) -> list[int] | None:
    """The target rows that predicted a tree row's emitted ``ids`` (its accepted path's, :func:`spec_decode.tree.
    rows_of`); None for a chain (its first rows)."""
    if row.tree_parents is None:
        return None
    return tree.rows_of(tree.accepted_nodes(row.draft_token_ids.tolist(), row.tree_parents, ids))
