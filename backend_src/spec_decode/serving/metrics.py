"""Speculative-decoding metrics on Triton's Prometheus port (``/metrics``), through ``pb_utils.MetricFamily``.

Every model process exports its own metrics (names are unique per model, so no two processes write the same series):

- ``generate``: per ``method`` (the request's ``speculative_method``) the counters of committed steps, draft, accepted
  and emitted tokens (vLLM's ``SpecDecodeWorkerMetrics``, counted on what the client received: the tail of a run that a
  stop trims is not counted), finished requests by ``finish_reason``, and gauges derived from the counters since the
  server started: acceptance rate (accepted / draft tokens), system efficiency (emitted tokens / the most the steps
  could emit, sum of k + 1), mean accepted length (emitted tokens per step: accepted drafts + 1); running sequences.
- ``draft_model``: time spent proposing (per method), the draft LM's KV-cache sequences and tokens, the suffix cache's
  active requests, cached responses and cached tokens.
- ``target_model``: time spent scoring, the target's KV-cache sequences and tokens.
- ``verifier``: time spent verifying.

Names follow Prometheus conventions (counters end in ``_total``, times in seconds). Times are wall-clock seconds
inside the model's ``execute``; on a GPU they include only what the model waits for (outputs that stay on the device
may still be in flight). Triton's own per-model ``nv_inference_*`` metrics are on the same port.
"""

from __future__ import annotations

COUNTER, GAUGE = "counter", "gauge"

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
    "spec_decode_max_emitted_tokens_total": (COUNTER, "The most tokens the committed steps could emit (sum of k + 1), "
                                                      "by method"),
    "spec_decode_acceptance_rate": (GAUGE, "Accepted / draft tokens since start, by method"),
    "spec_decode_system_efficiency": (GAUGE, "Emitted / max emitted tokens (sum of k + 1 over steps) since start, "
                                             "by method"),
    "spec_decode_mean_accepted_length": (GAUGE, "Emitted tokens per step (accepted drafts + 1) since start, by method"),
    "spec_decode_running_sequences": (GAUGE, "generate requests being generated"),
    # draft_model
    "spec_decode_propose_seconds_total": (COUNTER, "Time draft_model spent proposing (seconds), by method"),
    "spec_decode_draft_kv_cache_sequences": (GAUGE, "Sequences holding a KV cache in the draft LM"),
    "spec_decode_draft_kv_cache_tokens": (GAUGE, "Tokens held in the draft LM's KV caches"),
    "spec_decode_suffix_active_requests": (GAUGE, "Requests with a suffix tree of their own (suffix, hybrid)"),
    "spec_decode_suffix_cached_responses": (GAUGE, "Responses in the suffix decoding global tree"),
    "spec_decode_suffix_cached_tokens": (GAUGE, "Tokens in the suffix decoding global tree"),
    # target_model
    "spec_decode_score_seconds_total": (COUNTER, "Time target_model spent scoring (seconds)"),
    "spec_decode_target_kv_cache_sequences": (GAUGE, "Sequences holding a KV cache in the target"),
    "spec_decode_target_kv_cache_tokens": (GAUGE, "Tokens held in the target's KV caches"),
    # verifier
    "spec_decode_verify_seconds_total": (COUNTER, "Time the verifier spent verifying (seconds)"),
}


class Metrics:
    """Counters and gauges kept in the process and, inside Triton, exported through ``pb_utils.MetricFamily``.

    Args:
        pb_utils: the ``triton_python_backend_utils`` module, or None (unit tests, in-process use): values are then
            only kept in :attr:`values`.

    Raises:
        KeyError: (methods) a metric name not in :data:`METRICS`.
        ValueError: (``add``) a negative increment of a counter.
    """

    def __init__(self, pb_utils=None):
        self.values: dict[tuple, float] = {}  # (name, sorted label items) -> value
        self._pb = pb_utils if pb_utils is not None and hasattr(pb_utils, "MetricFamily") else None
        self._families: dict[str, object] = {}  # kept alive: Triton drops a family when its object is deleted
        self._metrics: dict[tuple, object] = {}

    def _metric(self, name: str, labels: dict[str, str]):
        kind, description = METRICS[name]
        key = (name, tuple(sorted(labels.items())))
        if self._pb is not None and key not in self._metrics:
            family = self._families.get(name)
            if family is None:
                mf = self._pb.MetricFamily
                family = mf(name=name, description=description, kind=mf.COUNTER if kind == COUNTER else mf.GAUGE)
                self._families[name] = family
            self._metrics[key] = family.Metric(labels=dict(labels))
        return kind, key, self._metrics.get(key)

    def add(self, name: str, value: float, **labels: str) -> None:
        """Increase a counter by ``value`` (>= 0)."""
        kind, key, metric = self._metric(name, labels)
        if kind == COUNTER and value < 0:
            raise ValueError(f"counter {name} cannot decrease (got {value})")
        self.values[key] = self.values.get(key, 0.0) + value
        if metric is not None and value:
            metric.increment(float(value))

    def set(self, name: str, value: float, **labels: str) -> None:
        """Set a gauge."""
        kind, key, metric = self._metric(name, labels)
        if kind != GAUGE:
            raise ValueError(f"{name} is a counter; use add()")
        self.values[key] = float(value)
        if metric is not None:
            metric.set(float(value))

    def get(self, name: str, **labels: str) -> float:
        """The current value (0 when never written)."""
        METRICS[name]  # noqa: B018 - unknown names are an error
        return self.values.get((name, tuple(sorted(labels.items()))), 0.0)

    def record_step(self, method: str, num_draft_tokens: int, before: tuple[int, int, int, int], after) -> None:
        """Count one committed ``generate`` step and refresh the method's derived gauges.

        Args:
            method: the request's speculative_method (label).
            num_draft_tokens: k asked of this step (the step could emit k + 1 tokens).
            before: (steps, draft, accepted, emitted) of the request's :class:`~spec_decode.loop.GenerationStats`
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
    """(steps, draft, accepted, emitted) of a :class:`~spec_decode.loop.GenerationStats` (for :meth:`Metrics.record_step`)."""
    return stats.steps, stats.draft_tokens, stats.accepted_tokens, stats.emitted_tokens
