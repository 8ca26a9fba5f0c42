"""Speculative-decoding metrics on Triton's Prometheus port (``/metrics``), through ``pb_utils.MetricFamily``.

Every model process exports its own metrics (names are unique per model, so no two processes write the same series):

- ``generate``: per ``method`` (the request's ``speculative_method``) the counters of committed steps, draft, accepted
  and emitted tokens (vLLM's ``SpecDecodeWorkerMetrics``, counted on what the client received: the tail of a run that a
  stop trims is not counted), finished requests by ``finish_reason``, and gauges derived from the counters since the
  server started: acceptance rate (accepted / draft tokens), system efficiency (emitted tokens / the most the steps
  could emit, sum of k + 1), mean accepted length (emitted tokens per step: accepted drafts + 1); running sequences.
- ``draft_model``: time spent proposing (per method), and the gauges each proposer declares (its ``GAUGES``: the draft
  LM's KV-cache sequences and tokens, the EAGLE head's contexts and positions, the suffix cache's active requests,
  cached responses and cached tokens).
- ``target_model``: time spent scoring, the target's KV-cache sequences and tokens.
- ``verifier``: time spent verifying.

Names follow Prometheus conventions (counters end in ``_total``, times in seconds). Times are wall-clock seconds
inside the model's ``execute``; on a GPU they include only what the model waits for (outputs that stay on the device
may still be in flight). Triton's own per-model ``nv_inference_*`` metrics are on the same port. docs/metrics.md
documents them for operators.
"""

from __future__ import annotations

import time
from typing import Protocol

COUNTER, GAUGE = "counter", "gauge"
MAX_DEPTH_LABEL = 16  # the deepest ``depth`` label of the per-depth counters

METRICS: dict[str, tuple[str, str]] = {
    # generate
    "spec_decode_requests_total": (COUNTER, "Finished generate requests, by method and finish_reason "
                                            "(stop, length, cancelled, error)"),
    "spec_decode_steps_total": (COUNTER, "Speculative steps (draft, score, verify) committed, by method"),
    "spec_decode_draft_tokens_total": (COUNTER, "Draft tokens proposed in committed steps, by method"),
    "spec_decode_accepted_tokens_total": (COUNTER, "Draft tokens accepted and committed (a stop's trimmed tail is not "
                                                   "counted), by method"),
    "spec_decode_emitted_tokens_total": (COUNTER, "Output tokens committed (accepted drafts plus recovered or bonus "
                                                  "tokens), by method"),
    "spec_decode_auto_steps_total": (COUNTER, "Steps of speculative_method=auto requests, by the method auto chose "
                                              "(none when it did not speculate)"),
    "spec_decode_auto_draft_tokens_total": (COUNTER, "Draft tokens proposed in auto's steps, by the method it chose"),
    "spec_decode_auto_accepted_tokens_total": (COUNTER, "Draft tokens accepted in auto's steps, by the method it "
                                                        "chose"),
    "spec_decode_auto_tree_steps_total": (COUNTER, "auto's steps for which it chose a draft tree over a chain, by the "
                                                   "method and the tree width it chose (tree_top_k; 0: a proposer "
                                                   "whose trees have none)"),
    "spec_decode_max_emitted_tokens_total": (COUNTER, "The most tokens the committed steps could emit (sum of k + 1), "
                                                      "by method"),
    "spec_decode_acceptance_rate": (GAUGE, "Accepted / draft tokens since start, by method"),
    "spec_decode_system_efficiency": (GAUGE, "Emitted / max emitted tokens (sum of k + 1 over steps) since start, "
                                             "by method"),
    "spec_decode_mean_accepted_length": (GAUGE, "Emitted tokens per step (accepted drafts + 1) since start, by method"),
    "spec_decode_tree_steps_total": (COUNTER, "Committed steps whose drafts were a tree (several candidates per "
                                              "position), by method"),
    "spec_decode_chain_fallback_steps_total": (COUNTER, "Steps drafted as a chain although the request allowed a tree, "
                                                        "by method and reason (guided: a grammar walks one path; "
                                                        "prompt_logprobs: a first step that returns the prompt's "
                                                        "log-probs)"),
    "spec_decode_drafted_depth_total": (COUNTER, "Committed steps whose drafts reached this depth (1 = the first "
                                                 "draft position), by method and depth"),
    "spec_decode_accepted_depth_total": (COUNTER, "Committed steps that accepted a draft at this depth, by method and "
                                                  "depth (accepted / drafted per depth: the acceptance per depth)"),
    "spec_decode_running_sequences": (GAUGE, "generate requests being generated"),
    "spec_decode_rounds_total": (COUNTER, "Rounds of steps generate ran"),
    "spec_decode_round_seconds_total": (COUNTER, "generate's time in its rounds by stage (seconds): plan (auto and the "
                                                 "token budget), build_request (the BLS request), ensemble (the BLS "
                                                 "call: Triton's ensemble and the step models), parse_response (the "
                                                 "BLS response into step results), between_rounds (generate's own "
                                                 "work from a round's end to the next round's start when every "
                                                 "running sequence came back: commits, streamed responses, the next "
                                                 "steps' inputs)"),
    # draft_model
    "spec_decode_propose_seconds_total": (COUNTER, "Time draft_model spent proposing (seconds), by method"),
    "spec_decode_draft_model_io_seconds_total": (COUNTER, "Time draft_model spent reading its request tensors "
                                                          "(stage=decode_inputs) and building its response tensors "
                                                          "(stage=encode_outputs), seconds"),
    # (and the proposers' gauges: Proposer.GAUGES, declared by draft_model)
    # target_model
    "spec_decode_score_seconds_total": (COUNTER, "Time target_model spent scoring (seconds)"),
    "spec_decode_target_model_io_seconds_total": (COUNTER, "Time target_model spent reading its request tensors "
                                                           "(stage=decode_inputs) and building its response tensors "
                                                           "(stage=encode_outputs), seconds"),
    "spec_decode_target_kv_cache_sequences": (GAUGE, "Sequences holding a KV cache in the target"),
    "spec_decode_target_kv_cache_tokens": (GAUGE, "Tokens held in the target's KV caches of running sequences"),
    "spec_decode_target_kv_cache_allocated_tokens": (GAUGE, "Positions allocated by the target's KV caches, running "
                                                            "and released ones kept for prefix reuse"),
    "spec_decode_target_kv_cache_max_tokens": (GAUGE, "Positions of the target's paged KV pool (kv_cache_max_tokens, "
                                                      "or the size chosen from memory when that is 0)"),
    "spec_decode_target_prefix_cache_queries_total": (COUNTER, "Target computations of a full block or more that "
                                                               "looked for a cached prefix"),
    "spec_decode_target_prefix_cache_hits_total": (COUNTER, "Those that reused a cached prefix"),
    "spec_decode_target_prefix_cache_reused_tokens_total": (COUNTER, "Tokens whose keys and values the target reused "
                                                                     "from a cached prefix's shared pages instead of "
                                                                     "computing them"),
    "spec_decode_target_prefix_cache_hit_rate": (GAUGE, "Target prefix-cache hits / queries since start"),
    # verifier
    "spec_decode_verify_seconds_total": (COUNTER, "Time the verifier spent verifying (seconds)"),
    "spec_decode_verifier_io_seconds_total": (COUNTER, "Time the verifier spent reading its request tensors "
                                                       "(stage=decode_inputs) and building its response tensors "
                                                       "(stage=encode_outputs), seconds"),
}


class _TritonMetric(Protocol):
    """One labelled series of a ``pb_utils.MetricFamily``."""

    def increment(self, value: float) -> None: ...

    def set(self, value: float) -> None: ...


class _TritonFamily(Protocol):
    """A ``pb_utils.MetricFamily``: makes its labelled series."""

    def Metric(self, labels: dict[str, str]) -> _TritonMetric: ...


class Metrics:
    """Counters and gauges kept in the process and, inside Triton, exported through ``pb_utils.MetricFamily``.

    Every write to a Triton metric is a round trip from the model's stub process to the server process, and a step
    makes many (docs/benchmarks.md has their cost). So values change here at once (:meth:`get`, :attr:`values`) and
    are exported at most every ``export_interval_s`` seconds, when a value changes, plus at once on :meth:`flush` (the
    models flush when a sequence ends, so what a scrape sees after a request is complete).

    Args:
        pb_utils: the ``triton_python_backend_utils`` module, or None (unit tests, in-process use): values are then
            only kept in :attr:`values`.
        export_interval_s: seconds between exports while values keep changing (>= 0; 0 exports every write).

    Raises:
        KeyError: (methods) a metric name neither in :data:`METRICS` nor declared (:meth:`declare`).
        ValueError: (``add``) a negative increment of a counter; (``set``) a counter.
    """

    def __init__(self, pb_utils=None, export_interval_s: float = 0.5):
        self.known: dict[str, tuple[str, str]] = dict(METRICS)  # name -> (kind, help)
        self.values: dict[tuple, float] = {}  # (name, sorted label items) -> value
        self._pb = pb_utils if pb_utils is not None and hasattr(pb_utils, "MetricFamily") else None
        self._families: dict[str, _TritonFamily] = {}  # kept alive: Triton drops a family when its object is deleted
        self._metrics: dict[tuple, _TritonMetric] = {}
        self._exported: dict[tuple, float] = {}  # what Triton holds, per key
        self._dirty: set[tuple] = set()
        self.export_interval_s = export_interval_s
        self._last_export = 0.0
        self.exports = 0  # round trips to Triton so far (for tests)

    def declare(self, gauges: dict[str, str]) -> None:
        """Add gauges (name -> help) beside :data:`METRICS` (a proposer's ``GAUGES``)."""
        for name, description in gauges.items():
            self.known[name] = (GAUGE, description)

    def _key(self, name: str, labels: dict[str, str]) -> tuple[str, tuple]:
        kind, _ = self.known[name]
        return kind, (name, tuple(sorted(labels.items())))

    def _triton_metric(self, key: tuple) -> _TritonMetric:
        """The Triton series of ``key`` = (name, label items), made on first use."""
        assert self._pb is not None  # only flush() calls it, when exporting to Triton
        metric = self._metrics.get(key)
        if metric is None:
            name, labels = key
            kind, description = self.known[name]
            family = self._families.get(name)
            if family is None:
                mf = self._pb.MetricFamily
                family = mf(name=name, description=description, kind=mf.COUNTER if kind == COUNTER else mf.GAUGE)
                self._families[name] = family
            metric = self._metrics[key] = family.Metric(labels=dict(labels))
        return metric

    def add(self, name: str, value: float, **labels: str) -> None:
        """Increase a counter by ``value`` (>= 0)."""
        kind, key = self._key(name, labels)
        if kind == COUNTER and value < 0:
            raise ValueError(f"counter {name} cannot decrease (got {value})")
        self.values[key] = self.values.get(key, 0.0) + value
        self._changed(key)

    def set(self, name: str, value: float, **labels: str) -> None:
        """Set a gauge."""
        kind, key = self._key(name, labels)
        if kind != GAUGE:
            raise ValueError(f"{name} is a counter; use add()")
        self.values[key] = float(value)
        self._changed(key)

    def _changed(self, key: tuple) -> None:
        if self._pb is None:
            return
        self._dirty.add(key)
        if time.monotonic() - self._last_export >= self.export_interval_s:
            self.flush()

    def flush(self) -> None:
        """Export every value changed since the last export to Triton (nothing outside Triton)."""
        if self._pb is None:
            return
        for key in self._dirty:
            value, before = self.values[key], self._exported.get(key)
            if value == before:
                continue
            metric = self._triton_metric(key)
            if self.known[key[0]][0] == COUNTER:
                metric.increment(value - (before or 0.0))
            else:
                metric.set(value)
            self._exported[key] = value
            self.exports += 1
        self._dirty.clear()
        self._last_export = time.monotonic()

    def get(self, name: str, **labels: str) -> float:
        """The current value (0 when never written)."""
        self.known[name]  # noqa: B018 - unknown names are an error
        return self.values.get((name, tuple(sorted(labels.items()))), 0.0)

    def record_depths(self, method: str, num_draft_tokens: int, depth: int | None, accepted: int) -> None:
        """Count one committed step's draft shape: a tree when its deepest path (``depth``) is shorter than its
        ``num_draft_tokens`` nodes, and per depth 1..``depth`` whether it drafted and accepted there (depths above
        :data:`MAX_DEPTH_LABEL` counted at it). ``depth`` None: the transport did not say (a chain of
        ``num_draft_tokens``)."""
        depth = num_draft_tokens if depth is None else depth
        if 0 < depth < num_draft_tokens:
            self.add("spec_decode_tree_steps_total", 1, method=method)
        for d in range(1, min(depth, MAX_DEPTH_LABEL) + 1):
            self.add("spec_decode_drafted_depth_total", 1, method=method, depth=str(d))
            if accepted >= d:
                self.add("spec_decode_accepted_depth_total", 1, method=method, depth=str(d))

    def record_step(self, method: str, num_draft_tokens: int, before: tuple[int, int, int, int], after) -> None:
        """Count one committed ``generate`` step and refresh the method's derived gauges.

        Args:
            method: the request's speculative_method (label).
            num_draft_tokens: k asked of this step (the step could emit k + 1 tokens).
            before: (steps, draft, accepted, emitted) of the request's :class:`~spec_decode.generation.GenerationStats`
                before the step was committed.
            after: the stats object after the commit.
        """
        deltas = (after.steps - before[0], after.draft_tokens - before[1], after.accepted_tokens - before[2],
                  after.emitted_tokens - before[3])
        names = ("spec_decode_steps_total", "spec_decode_draft_tokens_total", "spec_decode_accepted_tokens_total",
                 "spec_decode_emitted_tokens_total")
        for name, d in zip(names, deltas):
            self.add(name, d, method=method)
        self.add("spec_decode_max_emitted_tokens_total", deltas[0] * (num_draft_tokens + 1), method=method)
        steps, drafted, accepted, emitted, most = (
            self.get(n, method=method) for n in (*names, "spec_decode_max_emitted_tokens_total"))
        self.set("spec_decode_acceptance_rate", accepted / drafted if drafted else 0.0, method=method)
        self.set("spec_decode_system_efficiency", emitted / most if most else 0.0, method=method)
        self.set("spec_decode_mean_accepted_length", emitted / steps if steps else 0.0, method=method)


def stats_tuple(stats) -> tuple[int, int, int, int]:
    """(steps, draft, accepted, emitted) of a :class:`~spec_decode.generation.GenerationStats`
    (for :meth:`Metrics.record_step`)."""
    return stats.steps, stats.draft_tokens, stats.accepted_tokens, stats.emitted_tokens
