"""spec_decode.serving.metrics: counters and gauges, exported to Triton at most once per interval."""

import pytest

from spec_decode.serving.metrics import Metrics
from tests.fake_pb_utils import FakePbUtils, exported


def test_metrics_reject_unknown_names_and_decreasing_counters():
    m = Metrics()
    with pytest.raises(KeyError):
        m.add("no_such_metric", 1)
    with pytest.raises(ValueError, match="cannot decrease"):
        m.add("spec_decode_steps_total", -1, method="none")
    with pytest.raises(ValueError, match="counter"):
        m.set("spec_decode_steps_total", 3, method="none")


def test_system_efficiency_counts_k_plus_one_per_step():
    from spec_decode.generation import GenerationStats

    m = Metrics()
    after = GenerationStats(steps=1, draft_tokens=4, accepted_tokens=1, emitted_tokens=2)
    m.record_step("draft", 4, (0, 0, 0, 0), after)
    assert m.get("spec_decode_system_efficiency", method="draft") == pytest.approx(2 / 5)
    assert m.get("spec_decode_acceptance_rate", method="draft") == pytest.approx(1 / 4)


def test_metrics_export_at_most_once_per_interval_and_on_flush(monkeypatch):
    """Writes to Triton (a round trip to the server process each) are batched: during a stream at most one export per
    interval, and everything changed is exported on flush (the end of a sequence), counters by their increments."""
    from spec_decode.serving import metrics as metrics_module

    now = [100.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: now[0])
    m = Metrics(FakePbUtils, export_interval_s=0.5)
    m.add("spec_decode_steps_total", 1, method="none")  # the first write exports at once
    assert m.exports == 1
    for _ in range(50):  # a stream's steps within the interval: kept in the process only
        m.add("spec_decode_steps_total", 1, method="none")
        m.set("spec_decode_target_kv_cache_tokens", 7)
    assert m.exports == 1 and m.get("spec_decode_steps_total", method="none") == 51
    now[0] += 0.6  # the interval has passed: the next write exports both changed series
    m.add("spec_decode_steps_total", 1, method="none")
    assert m.exports == 3
    m.add("spec_decode_steps_total", 2, method="none")
    m.set("spec_decode_target_kv_cache_tokens", 7)  # unchanged since the last export: nothing to send
    m.flush()
    values = exported(list(m._families.values()))
    assert values[("spec_decode_steps_total", (("method", "none"),))] == 54
    assert values[("spec_decode_target_kv_cache_tokens", ())] == 7
    assert m.exports == 4


def test_declared_gauges_join_the_known_metrics():
    m = Metrics(FakePbUtils)
    with pytest.raises(KeyError):
        m.set("spec_decode_echo_spans", 3)
    m.declare({"spec_decode_echo_spans": "Spans repeated by the echo proposer"})
    m.set("spec_decode_echo_spans", 3)
    m.flush()
    assert exported(list(m._families.values()))[("spec_decode_echo_spans", ())] == 3
