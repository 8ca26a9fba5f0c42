"""Backends of the three models of the ``spec_step`` ensemble: draft_model, target_model, verifier.

Each takes the step protocol's inputs (README, "How it works": sequence id, committed token ids, k, method, sampling
parameters, seed and step, release flag) as numpy arrays (or torch tensors on GPU) and returns its outputs. A
``release`` request frees the sequence's caches and returns empty outputs, which flow through the ensemble to an empty
result.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..kv_cache import CachedCausalLM
from ..models import (
    load_causal_lm,
    load_draft_vocab,
    resolve_device,
    resolve_draft_path,
    resolve_dtype,
    resolve_model_path,
)
from ..proposers import DraftModelProposer, HybridProposer, NgramProposer, SuffixProposer
from ..sampling import SamplingParams
from ..scorer import TargetScorer
from ..step import Verifier
from .adapter import config_param, strip_padding
from .metrics import Metrics

logger = logging.getLogger(__name__)

STEP_INPUTS = ("sequence_id", "token_ids", "num_draft_tokens", "speculative_method", "temperature", "top_k", "top_p",
               "random_seed", "seeded", "step", "release")


def _one(inputs: dict, name: str, default=None):
    v = inputs.get(name)
    if v is None:
        if default is None:
            raise ValueError(f"missing input '{name}'")
        return default
    return np.asarray(v.cpu() if isinstance(v, torch.Tensor) else v).reshape(-1)[0]


def _params(inputs: dict) -> SamplingParams:
    """Sampling parameters of a step request, checked (the internal models can be called directly too).

    Raises:
        ValueError: naming the field and its allowed range.
    """
    p = SamplingParams(
        temperature=float(_one(inputs, "temperature", 0.0)),
        top_k=int(_one(inputs, "top_k", 0)),
        top_p=float(_one(inputs, "top_p", 1.0)),
        seed=int(_one(inputs, "random_seed", 0)),
        seeded=bool(_one(inputs, "seeded", True)),
    )
    if not (np.isfinite(p.temperature) and p.temperature >= 0):
        raise ValueError(f"temperature must be >= 0, got {p.temperature}")
    if p.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {p.top_k}")
    if not (0.0 < p.top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
    return p


def _token_ids(inputs: dict) -> list[int]:
    ids = strip_padding(inputs["token_ids"])
    if not ids:
        raise ValueError("token_ids must not be empty")
    return ids


def _is_release(inputs: dict) -> bool:
    return bool(_one(inputs, "release", False))


def _load_lm(path, params: dict) -> CachedCausalLM | None:
    """The model folder ``path`` (already resolved; None = no model) on the configured device/dtype, with its cache."""
    if path is None:
        return None
    device = resolve_device(config_param(params, "device", "auto"))
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # this process's CUDA context, and the work it launches, on its GPU
    dtype = resolve_dtype(config_param(params, "dtype", "auto"), device)
    logger.info("loading %s on %s (%s)", path, device, dtype)
    return CachedCausalLM(load_causal_lm(path, device, dtype), config_param(params, "max_sequences", 64))


class _Work:
    """A request's share of a batched forward: ``seq_id`` and the arguments of the batch function."""

    def __init__(self, seq_id: int, args: tuple, finish):
        self.seq_id, self.args, self.finish = seq_id, args, finish  # finish(result of the batch fn) -> outputs


def run_batched(inputs_list: list[dict], plan, run_group) -> list:
    """Run several requests, sharing forward passes where they can (Triton dynamic batching).

    Args:
        inputs_list: the requests' inputs.
        plan: inputs -> outputs dict (answered alone, e.g. a release) or a :class:`_Work` (joins the batch); may raise.
        run_group: list of _Work args (distinct seq_ids) -> list of results, in order; may raise.

    Returns:
        per request, its outputs dict or the exception that fails it (one request's error never fails another's; a
        failing batched forward fails the requests in that forward).
    """
    results: list = [None] * len(inputs_list)
    work: list[tuple[int, _Work]] = []
    for i, inputs in enumerate(inputs_list):
        try:
            r = plan(inputs)
        except Exception as exc:  # noqa: BLE001 - this request's error response
            r = exc
        if isinstance(r, _Work):
            work.append((i, r))
        else:
            results[i] = r
    while work:  # a sequence appears at most once per forward (only direct callers can send one twice)
        group, rest, seen = [], [], set()
        for i, w in work:
            (rest if w.seq_id in seen else group).append((i, w))
            seen.add(w.seq_id)
        work = rest
        try:
            outs = run_group([w.args for _, w in group])
            for (i, w), out in zip(group, outs):
                results[i] = w.finish(out)
        except Exception as exc:  # noqa: BLE001
            for i, _ in group:
                results[i] = exc
    return results


class _BatchedBackend:
    """``run``/``run_batch`` of a model whose requests can share forward passes (draft_model, target_model).

    Subclasses define ``_plan(inputs)`` (outputs, or a :class:`_Work` for the batch), ``_run_group(args list)`` (one
    batched call), ``_cache_gauges()`` (refreshed after every execute) and may override ``_is_release(inputs)``.
    """

    def run(self, inputs: dict) -> dict:
        """Serve one request alone.

        Raises:
            ValueError: an invalid input (named).
        """
        (result,) = self.run_batch([inputs])
        if isinstance(result, Exception):
            raise result
        return result

    def run_batch(self, inputs_list: list[dict]) -> list:
        """Serve the requests of one ``execute()`` (Triton's dynamic batcher), sharing forward passes.

        Returns:
            per request, its outputs or the exception that fails it (see :func:`run_batched`).
        """
        try:
            return run_batched(inputs_list, self._plan, self._run_group)
        finally:
            self._cache_gauges()
            if any(self._is_release(i) for i in inputs_list):  # a sequence ended: export its figures
                self.metrics.flush()

    @staticmethod
    def _is_release(inputs: dict) -> bool:
        return _is_release(inputs)


def _no_drafts() -> dict:
    """draft_model outputs for "nothing proposed" (also what a release returns)."""
    return {"draft_token_ids": np.zeros(0, np.int64), "draft_probs": np.zeros((0, 0), np.float32)}


class DraftBackend(_BatchedBackend):
    """draft_model: the proposers (draft LM when ``draft_model_path`` is set, n-gram prompt lookup).

    Config parameters: draft_model_path ("auto" = the distilled default draft when ``make draft`` has built it, else
    none; "" = none; "default" = the embedded target; or a folder), device, dtype,
    max_sequences, ngram_min, ngram_max, max_num_draft_tokens (the largest k a step may ask for), suffix_* (suffix
    decoding: max_tree_depth, max_cached_requests, max_spec_factor, max_spec_offset, min_token_prob, backend).
    Methods: ngram, suffix, hybrid (suffix when its score >= k, else the ``hybrid_fallback`` proposer: ngram (default),
    draft, or auto = the draft LM when there is one), draft.
    Outputs: draft_token_ids INT64 [k'], draft_probs FP32 [k', V] ([0, 0] for drafts without probabilities).
    Metrics (``metrics``, see :mod:`~spec_decode.serving.metrics`): time proposing per method, the draft LM's KV
    caches, the suffix cache. ``run`` proposes for one sequence (or frees its caches when ``release`` is set);
    ``run_batch`` lets draft-LM proposals of different sequences share each forward pass.
    """

    INPUTS = STEP_INPUTS

    def __init__(self, params: dict[str, str], metrics: Metrics | None = None):
        self.metrics = metrics if metrics is not None else Metrics()
        self.proposers = {
            "ngram": NgramProposer(config_param(params, "ngram_min", 1), config_param(params, "ngram_max", 4)),
        }
        self.max_k = config_param(params, "max_num_draft_tokens", 8)
        self.suffix = SuffixProposer(
            max_tree_depth=config_param(params, "suffix_max_tree_depth", 64),
            max_cached_requests=config_param(params, "suffix_max_cached_requests", 10000),
            max_spec_factor=config_param(params, "suffix_max_spec_factor", 1.0),
            max_spec_offset=config_param(params, "suffix_max_spec_offset", 0.0),
            min_token_prob=config_param(params, "suffix_min_token_prob", 0.1),
            backend=config_param(params, "suffix_backend", "auto"),
        )
        if self.suffix.backend == "python" and self.suffix.max_cached_requests > 256:
            logger.warning("suffix decoding uses the pure-Python trie (Arctic's C++ tree is not built: run "
                        "scripts/build_suffix_tree.sh); suffix_max_cached_requests=%d may need many GB of memory",
                        self.suffix.max_cached_requests)
        self.proposers["suffix"] = self.suffix
        draft_path = resolve_draft_path(config_param(params, "draft_model_path", "auto"))
        lm = _load_lm(draft_path, params)
        if lm is not None:
            self.proposers["draft"] = DraftModelProposer(lm, load_draft_vocab(draft_path))
        fallback = config_param(params, "hybrid_fallback", "ngram")
        if fallback not in ("ngram", "draft", "auto"):
            raise ValueError(f"hybrid_fallback={fallback!r}: allowed values are ngram, draft, auto")
        if fallback == "auto":
            fallback = "draft" if "draft" in self.proposers else "ngram"
        if fallback == "draft" and "draft" not in self.proposers:
            raise ValueError("hybrid_fallback=draft needs a draft LM (draft_model_path)")
        self.proposers["hybrid"] = HybridProposer(self.suffix, self.proposers[fallback])
        self._draft_lm = lm
        self._cache_gauges()

    def _cache_gauges(self) -> None:
        m = self.metrics
        m.set("spec_decode_suffix_active_requests", self.suffix.active_requests())
        m.set("spec_decode_suffix_cached_responses", self.suffix.cached_requests())
        m.set("spec_decode_suffix_cached_tokens", self.suffix.cache.cached_tokens())
        if self._draft_lm is not None:
            m.set("spec_decode_draft_kv_cache_sequences", len(self._draft_lm))
            m.set("spec_decode_draft_kv_cache_tokens", self._draft_lm.cached_tokens())

    def _run_group(self, items: list[tuple]) -> list:  # draft-LM proposals of several sequences
        start = time.perf_counter()
        out = self.proposers["draft"].propose_batch(items)
        self.metrics.add("spec_decode_propose_seconds_total", time.perf_counter() - start, method="draft")
        return out

    @staticmethod
    def _outputs(proposal) -> dict:
        probs = proposal.draft_probs
        if probs is None:
            probs = torch.zeros((0, 0), dtype=torch.float32)
        return {"draft_token_ids": proposal.draft_token_ids.to(torch.int64).numpy(), "draft_probs": probs}

    def _plan(self, inputs: dict):
        seq_id = int(_one(inputs, "sequence_id"))
        if _is_release(inputs):
            if "token_ids" in inputs:  # the final ids: the whole response joins the suffix cache
                self.suffix.update(seq_id, _token_ids(inputs))
            for p in self.proposers.values():
                p.release(seq_id)
            return _no_drafts()
        method = _one(inputs, "speculative_method", b"none")
        method = method.decode() if isinstance(method, bytes) else str(method)
        k = int(_one(inputs, "num_draft_tokens", 0))
        if not 0 <= k <= self.max_k:
            raise ValueError(f"num_draft_tokens must be in [0, {self.max_k}], got {k}")
        if method == "none" or k <= 0:
            return _no_drafts()
        if method not in self.proposers:
            raise ValueError(
                f"speculative_method={method!r} is not served here; available: none, {', '.join(self.proposers)}"
            )
        step = int(_one(inputs, "step", 0))
        ids, params = _token_ids(inputs), _params(inputs)
        if method == "draft":  # the draft LM: batched with the other sequences' draft steps
            vocab = self.proposers["draft"].vocab
            self._draft_lm.check(vocab.map_ids(ids) if vocab is not None else ids, 1)
            return _Work(seq_id, (seq_id, ids, k, params, step), self._outputs)
        start = time.perf_counter()
        proposal = self.proposers[method].propose(seq_id, ids, k, params, step)
        self.metrics.add("spec_decode_propose_seconds_total", time.perf_counter() - start, method=method)
        return self._outputs(proposal)


class TargetBackend(_BatchedBackend):
    """target_model: the scorer over k+1 positions with the per-sequence KV cache.

    Config parameters: model_path ("default" = the embedded SmolLM2-135M-Instruct), device, dtype, max_sequences.
    Output: target_probs FP32 [k+1, V] (on the model's device; [0, 0] for a release).
    Metrics: time scoring, the target's KV caches. ``run`` scores one sequence (or frees its KV cache when ``release``
    is set); ``run_batch`` scores several sequences' k+1 positions in one forward pass.
    """

    INPUTS = ("sequence_id", "token_ids", "draft_token_ids", "temperature", "top_k", "top_p", "release")

    def __init__(self, params: dict[str, str], metrics: Metrics | None = None):
        self.metrics = metrics if metrics is not None else Metrics()
        self.lm = _load_lm(resolve_model_path(config_param(params, "model_path", "default")), params)
        self.scorer = TargetScorer(self.lm)
        self._cache_gauges()

    def _cache_gauges(self) -> None:
        self.metrics.set("spec_decode_target_kv_cache_sequences", len(self.lm))
        self.metrics.set("spec_decode_target_kv_cache_tokens", self.lm.cached_tokens())

    def _run_group(self, items: list[tuple]) -> list:  # the k+1 positions of several sequences in one forward
        start = time.perf_counter()
        out = self.scorer.score_batch(items)
        self.metrics.add("spec_decode_score_seconds_total", time.perf_counter() - start)
        return out

    def _plan(self, inputs: dict):
        seq_id = int(_one(inputs, "sequence_id"))
        if _is_release(inputs):
            self.scorer.release(seq_id)
            return {"target_probs": torch.zeros((0, 0), dtype=torch.float32)}
        drafts = strip_padding(inputs.get("draft_token_ids", np.zeros(0, np.int64)))
        ids, params = _token_ids(inputs), _params(inputs)
        self.lm.check(ids + drafts, len(drafts) + 1)
        return _Work(seq_id, (seq_id, ids, drafts, params), lambda probs: {"target_probs": probs.float()})


class VerifierBackend(_BatchedBackend):
    """verifier: rejection sampling (lossless) or typical acceptance (not lossless); greedy check at temperature 0.

    Config parameters: acceptance_method (rejection | typical, the default when a request names none),
    typical_epsilon (0.09), typical_alpha (0.3), backend (auto | triton | torch), num_threads (torch CPU threads of
    this process, 1; 0 = torch's default).
    Outputs: output_ids INT64 [n] (1 <= n <= k+1), output_log_probs FP32 [n]; both empty for a release.
    Metrics: time verifying. ``run_batch`` verifies every sequence of one ``execute()`` (a round, and any requests
    queued with it) in one :meth:`Verifier.verify_batch` call: one kernel launch per kind of row on CUDA; a row's bad
    input fails that row alone, a sampler error the rows verified with it.
    """

    INPUTS = ("target_probs", "draft_token_ids", "draft_probs", "temperature", "random_seed", "step",
              "acceptance_method")

    def __init__(self, params: dict[str, str], metrics: Metrics | None = None):
        threads = config_param(params, "num_threads", 1)
        if threads > 0:  # its CPU work is small: more threads only spin against the target's on a small machine
            torch.set_num_threads(threads)
        self.metrics = metrics if metrics is not None else Metrics()
        self.verifier = Verifier(
            acceptance_method=config_param(params, "acceptance_method", "rejection"),
            typical_epsilon=config_param(params, "typical_epsilon", 0.09),
            typical_alpha=config_param(params, "typical_alpha", 0.3),
            backend=config_param(params, "backend", "auto"),
        )

    def _row(self, inputs: dict) -> tuple:
        """One sequence's arguments of :meth:`Verifier.verify_batch`, without the round's padding."""
        tp = torch.as_tensor(inputs["target_probs"])
        # In a batched request rows are padded to the round's largest k: k is the row's draft count without padding.
        drafts = torch.as_tensor(strip_padding(inputs["draft_token_ids"]), dtype=torch.int64)
        k = len(drafts)
        if tp.dim() != 2 or tp.shape[0] < k + 1:
            raise ValueError(f"target_probs has {tp.shape[0] if tp.dim() else 0} rows for {k} drafts (needs k + 1)")
        dp = inputs.get("draft_probs")
        if dp is not None and np.prod(tuple(dp.shape)) > 0:
            dp = torch.as_tensor(dp)[:k]
            if not bool(dp.any()):  # padding of a row without draft probabilities (n-gram, suffix) in a batch
                dp = None
        else:
            dp = None
        method = _one(inputs, "acceptance_method", b"")
        method = method.decode() if isinstance(method, bytes) else str(method)
        return (tp[: k + 1], drafts.to(tp.device), dp, int(_one(inputs, "random_seed", 0)),
                int(_one(inputs, "step", 0)), float(_one(inputs, "temperature", 0.0)) <= 0.0, method)

    @staticmethod
    def _is_release(inputs: dict) -> bool:
        """A release reaches the verifier as target_probs with no rows (target_model's output for it)."""
        tp = inputs.get("target_probs")
        return tp is not None and torch.as_tensor(tp).shape[0] == 0

    def _cache_gauges(self) -> None:
        """The verifier keeps no per-sequence state."""

    def _plan(self, inputs: dict):
        if self._is_release(inputs):
            return {"output_ids": np.zeros(0, np.int64), "output_log_probs": np.zeros(0, np.float32)}
        # Rows have no per-sequence state: any distinct key puts them all in one group.
        return _Work(id(inputs), self._row(inputs), lambda out: {
            "output_ids": np.asarray(out[0], np.int64), "output_log_probs": np.asarray(out[1], np.float32)})

    def _run_group(self, rows: list[tuple]) -> list:
        start = time.perf_counter()
        out = self.verifier.verify_batch(rows)
        self.metrics.add("spec_decode_verify_seconds_total", time.perf_counter() - start)
        return out
