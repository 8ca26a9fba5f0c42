"""bench.scheduling's gaps, ratios and goals from arrival timestamps (the runs themselves need servers)."""

import pytest

from bench.scheduling import (
    config_value,
    gaps,
    goals,
    known_overrides,
    longest_gap_during,
    median_gap_before,
    mixed_arrival_summary,
    ratio,
)


def test_gaps_and_median_before_use_only_responses_up_to_the_arrival():
    times = [0.0, 0.1, 0.3, 0.4, 2.4, 2.5]
    assert gaps(times) == pytest.approx([0.1, 0.2, 0.1, 2.0, 0.1])
    assert median_gap_before(times, 0.4) == pytest.approx(0.1)  # gaps 0.1, 0.2, 0.1
    assert median_gap_before(times, 0.35) == pytest.approx(0.15)  # gaps 0.1, 0.2
    assert median_gap_before(times, 0.05) is None  # one response: no gap
    assert gaps([]) == [] and median_gap_before([], 1.0) is None


def test_longest_gap_counts_the_gaps_that_overlap_the_window():
    times = [0.0, 0.1, 0.3, 0.4, 2.4, 2.5, 3.5]
    assert longest_gap_during(times, 0.35, 2.45) == pytest.approx(2.0)  # straddles the arrival
    assert longest_gap_during(times, 2.45, 3.0) == pytest.approx(1.0)  # straddles the first token
    assert longest_gap_during(times, 0.15, 0.25) == pytest.approx(0.2)  # one gap holds the whole window
    assert longest_gap_during(times, 4.0, 5.0) is None  # finished before the arrival
    assert longest_gap_during([1.0, 1.1], 0.0, 0.5) is None  # not started yet


def test_mixed_arrival_summary_takes_the_worst_running_stream():
    # the long prompt arrives at 1.0 s, its first token at 3.0 s
    steady = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.05, 3.05, 3.15]  # stalled 2.0 s: 20x its 0.1 s
    slow = [0.0, 0.5, 1.0, 2.5, 3.5]  # stalled 1.5 s: 3x its 0.5 s
    done = [0.0, 0.2, 0.4]  # finished before the arrival
    s = mixed_arrival_summary([steady, slow, done], 1.0, 3.0)
    assert s["long_ttft_s"] == pytest.approx(2.0)
    assert s["running"] == 2 and s["longest_gap_s"] == pytest.approx(2.0)
    assert [r["ratio"] for r in s["streams"]] == [pytest.approx(20.0), pytest.approx(3.0), None]
    assert s["worst_ratio"] == pytest.approx(20.0)
    assert s["streams"][2]["median_gap_before_s"] == pytest.approx(0.2)


def test_ratio_and_goals():
    assert ratio(1.0, 4.0) == pytest.approx(0.25) and ratio(None, 1.0) is None and ratio(1.0, 0.0) is None
    mixed = {"chunked": {"worst_ratio": 2.5, "ttft_mixed_over_alone": 1.8},
             "unchunked": {"worst_ratio": 20.0, "ttft_mixed_over_alone": 1.1}}
    prefix = {"cache_on": {"b_over_a": 0.2}, "cache_off": {"b_over_a": 1.0}, "outputs_identical": True}
    g = {x["goal"].split(": ")[1]: x for x in goals(mixed, prefix)}
    assert len(g) == 4
    gap = next(x for k, x in g.items() if k.startswith("longest stream gap"))
    assert gap["reached"] == pytest.approx(2.5) and gap["met"]  # the chunked server's, not the baseline's
    ttft = next(x for k, x in g.items() if k.startswith("long prompt's TTFT"))
    assert ttft["reached"] == pytest.approx(1.8) and not ttft["met"]
    reuse = next(x for k, x in g.items() if k.startswith("TTFT of B"))
    assert reuse["reached"] == pytest.approx(0.2) and reuse["met"]
    assert next(x for k, x in g.items() if k.startswith("A's and B's"))["met"]
    # nothing measured: every goal is reported, none met
    assert not any(x["met"] for x in goals({}, {}))


def test_overrides_the_configs_lack_are_left_out(tmp_path):
    (tmp_path / "generate").mkdir()
    (tmp_path / "generate" / "config.pbtxt").write_text(
        'parameters: { key: "max_model_len" value: { string_value: "2048" } }\n')
    assert config_value(tmp_path, "generate", "max_model_len") == "2048"
    assert config_value(tmp_path, "generate", "max_num_batched_tokens") is None
    kept, missing = known_overrides({"generate": {"max_model_len": "1024", "max_num_batched_tokens": "0"}}, tmp_path)
    assert kept == {"generate": {"max_model_len": "1024"}} and missing == ["generate.max_num_batched_tokens"]
