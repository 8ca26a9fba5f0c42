"""bench.serving's parsing of perf_analyzer exports (bench.perf_tools) and its goals table (the runs themselves are
integration)."""

import json

import pytest

from bench.perf_tools import parse_profile_export
from bench.serving import goals

S = 1_000_000_000  # ns


def _export(tmp_path, requests):
    path = tmp_path / "export.json"
    path.write_text(json.dumps({"experiments": [{"experiment": {"mode": "concurrency", "value": 2},
                                                 "requests": requests}], "version": "", "service_kind": "triton"}))
    return path


def test_profile_export_gives_tokens_per_s_ttft_itl_and_tokens_per_step(tmp_path):
    # request A: sent at 0 s, responses at 1, 2, 3 s carrying 1, 3 (a list) and 2 tokens -> 6 tokens
    # request B: sent at 1 s, responses at 1.5 and 5 s carrying 1 and 1 token -> 2 tokens
    a = {"timestamp": 0, "response_timestamps": [1 * S, 2 * S, 3 * S],
         "response_outputs": [{"output_ids": 5}, {"output_ids": [1, 2, 3]}, {"output_ids": [4, 4]}]}
    b = {"timestamp": 1 * S, "response_timestamps": [int(1.5 * S), 5 * S],
         "response_outputs": [{"output_ids": 9}, {"output_ids": 8}]}
    empty = {"timestamp": 0, "response_timestamps": [], "response_outputs": []}
    r = parse_profile_export(_export(tmp_path, [a, b, empty]))
    assert r["requests"] == 2 and r["tokens"] == 8
    assert r["span_s"] == pytest.approx(5.0) and r["tokens_per_s"] == pytest.approx(8 / 5)
    assert r["ttft_ms"] == pytest.approx((1000 + 500) / 2)  # median of 1000 and 500 ms
    assert r["itl_ms"] == pytest.approx((2000 / 5 + 3500 / 1) / 2)  # (last - first) / (tokens - 1), median
    assert r["tokens_per_step_histogram"] == {"1": 3, "2": 1, "3": 1}


def test_profile_export_without_responses_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no request with a response"):
        parse_profile_export(_export(tmp_path, [{"timestamp": 0, "response_timestamps": []}]))


def test_goals_compare_rows_of_the_same_run():
    rows = [{"tool": "perf_analyzer", "method": "none", "concurrency": 1, "tokens_per_s": 10.0},
            {"tool": "perf_analyzer", "method": "none", "concurrency": 8, "tokens_per_s": 31.0},
            {"tool": "perf_analyzer", "method": "suffix", "concurrency": 1, "tokens_per_s": 17.0},
            {"tool": "perf_analyzer", "method": "ngram", "concurrency": 1, "tokens_per_s": 19.0},
            {"tool": "perf_analyzer", "method": "none", "concurrency": 8, "tokens_per_s": 30.0,
             "disable_by_batch_size": 4},
            {"tool": "perf_analyzer", "method": "suffix", "concurrency": 8, "tokens_per_s": 29.0,
             "disable_by_batch_size": 4}]
    g = {x["goal"].split(":")[0].split(" (")[0]: x for x in goals(rows, [{"method": "transformers:generate",
                                                                          "tokens_per_s": 10.5}], [1, 2, 4, 8])}
    best = g["best method / none at concurrency 1"]
    assert best["detail"] == "ngram" and best["reached"] == pytest.approx(1.9) and best["met"]
    hf = g["none through the server / in-process transformers generate"]
    assert hf["reached"] == pytest.approx(10 / 10.5) and hf["met"]
    assert g["none"]["reached"] == pytest.approx(3.1) and g["none"]["met"]
    dis = g["suffix with disable_by_batch_size=4 / none"]
    assert dis["reached"] == pytest.approx(29 / 30) and not dis["met"]


def test_make_bench_goals_use_pass_one_per_prompt_ratios_and_concurrency():
    """client/bench.py's goals: ratios of pass-1 rows, the worst per-prompt ratio against none, c8 against c1."""
    from client.bench import goals as bench_goals
    from client.bench import stages

    pp = lambda *secs: [{"tokens": 10, "seconds": s, "steps": 5} for s in secs]  # noqa: E731
    rows = [
        {"method": "server:none", "pass": 1, "concurrency": 1, "tokens_per_s": 10.0, "per_prompt": pp(1, 1, 1)},
        {"method": "server:suffix", "pass": 1, "concurrency": 1, "tokens_per_s": 25.0, "per_prompt": pp(0.4, 0.3, 1.1)},
        {"method": "server:suffix", "pass": 2, "concurrency": 1, "tokens_per_s": 99.0, "per_prompt": pp(0.1, 0.1, 0.1)},
        {"method": "server:none", "concurrency": 8, "tokens_per_s": 28.0},
        {"method": "transformers:generate", "tokens_per_s": 10.4},
        {"method": "transformers:prompt_lookup", "tokens_per_s": 20.0},
    ]
    speedup = next(x for x in bench_goals(rows, "suffix") if x["goal"].endswith("2.0x none"))
    assert speedup["value"] == pytest.approx(2.5) and speedup["reached"]
    lookup = next(x for x in bench_goals(rows, "suffix") if "prompt lookup" in x["goal"])
    assert lookup["value"] == pytest.approx(1.25) and lookup["reached"]
    worst = next(x for x in bench_goals(rows, "suffix") if "any prompt" in x["goal"])
    assert worst["value"] == pytest.approx(1 / 1.1) and not worst["reached"] and "prompt 2" in worst["worst"]
    c8 = next(x for x in bench_goals(rows, "suffix") if "concurrency 8" in x["goal"])
    assert c8["value"] == pytest.approx(2.8) and not c8["reached"]
    hf = next(x for x in bench_goals(rows, "suffix") if "in-process transformers" in x["goal"])
    assert hf["value"] == pytest.approx(10 / 10.4) and hf["reached"]

    before = {m: {"request_success": 0, "request_duration_us": 0, "compute_infer_duration_us": 0,
                  "queue_duration_us": 0}
              for m in ("spec_step", "score_step", "greedy_step", "draft_model", "target_model", "verifier")}
    before |= {"score_s": 1.0, "verify_s": 0.0, "calls_s": 2.0}
    after = {m: dict(v) for m, v in before.items() if isinstance(v, dict)}
    after["spec_step"]["request_duration_us"] = 250_000  # 10 steps of 45 ms, some with drafts, some without
    after["target_model"]["compute_infer_duration_us"] = 400_000
    after |= {"score_s": 1.38, "verify_s": 0.01, "calls_s": 2.45}
    st = stages(before, after, steps=10, step_s=0.05)
    assert st["client step"] == pytest.approx(50) and st["step calls"] == pytest.approx(45)
    assert st["generate + gRPC"] == pytest.approx(5) and st["target_model execute"] == pytest.approx(40)
    assert st["target forward (scorer)"] == pytest.approx(38) and st["verifier (sampler)"] == pytest.approx(1)


def test_make_bench_auto_goals_and_per_prompt_table():
    """client/bench.py's auto goals: worst per-prompt ratio to none, the best single method's mean, suffix's
    second pass, and the concurrency run against none and every single method (hybrid is not single)."""
    from client.bench import auto_goals, auto_table
    from client.bench import goals as bench_goals

    pp = lambda *secs: [{"tokens": 10, "seconds": s, "steps": 5} for s in secs]  # noqa: E731
    rows = [
        {"method": "server:none", "pass": 1, "concurrency": 1, "tokens_per_s": 10.0, "per_prompt": pp(1, 1)},
        {"method": "server:ngram", "pass": 1, "concurrency": 1, "tokens_per_s": 14.0, "per_prompt": pp(0.7, 0.8)},
        {"method": "server:suffix", "pass": 1, "concurrency": 1, "tokens_per_s": 16.0, "per_prompt": pp(0.5, 1.2)},
        {"method": "server:hybrid", "pass": 1, "concurrency": 1, "tokens_per_s": 30.0, "per_prompt": pp(0.3, 0.4)},
        {"method": "server:auto", "pass": 1, "concurrency": 1, "tokens_per_s": 17.0,
         "per_prompt": [{"tokens": 10, "seconds": 0.5, "steps": 3, "auto_methods": {"suffix": 2, "none": 1}},
                        {"tokens": 10, "seconds": 1.0, "steps": 10, "auto_methods": {"none": 10}}]},
        {"method": "server:suffix", "pass": 2, "concurrency": 1, "tokens_per_s": 40.0, "per_prompt": pp(0.2, 0.3)},
        {"method": "server:auto", "pass": 2, "concurrency": 1, "tokens_per_s": 36.0, "per_prompt": pp(0.2, 0.3)},
        {"method": "server:none", "concurrency": 8, "tokens_per_s": 30.0},
        {"method": "server:suffix", "concurrency": 8, "tokens_per_s": 33.0},
        {"method": "server:auto", "concurrency": 8, "tokens_per_s": 32.0},
    ]
    get = lambda method, **kw: next((r for r in rows if r["method"] == method  # noqa: E731
                                     and all(r.get(a) == b for a, b in kw.items())), None)
    g = {x["goal"].split(" (")[0].split(",")[0]: x for x in auto_goals(rows, get)}
    assert g["auto >= 0.98x none on every prompt"]["value"] == pytest.approx(1.0)
    assert g["auto >= the best single method"]["value"] == pytest.approx(17 / 16)  # suffix, not hybrid
    assert g["auto >= 0.95x suffix on the repeated workload's second pass"]["value"] == pytest.approx(0.9)
    assert g["auto at concurrency 8 >= 1.0x none"]["value"] == pytest.approx(32 / 30)
    assert g["auto at concurrency 8 >= every single method"]["value"] == pytest.approx(32 / 33)
    assert {x["goal"] for x in auto_goals(rows, get)} <= {x["goal"] for x in bench_goals(rows, "suffix")}
    table = auto_table(rows)
    assert "suffix" in table[0] and table[1].split()[:4] == ["0", "10.0", "20.0", "20.0"]
    assert table[1].endswith("suffix 2 none 1") and table[2].endswith("none 10")


def test_client_bench_refuses_an_unknown_method_naming_it_and_the_allowed_ones(capsys):
    """client.bench's --methods: a name that is no registered method (nor auto) is an argparse error (status 2) naming
    it and every allowed method, before any server starts or any prompt is read."""
    from client.bench import main as bench_main
    from spec_decode.proposers.registry import METHODS

    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--url", "127.0.0.1:1", "--methods", "none,suffix,eagle-3,hybrid,foo"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--methods: unknown method(s) eagle-3, foo; allowed: " + ", ".join((*METHODS, "auto")) in err



def test_client_bench_refuses_a_method_it_cannot_run_and_skips_it_by_default(capsys):
    """A method that cannot run here (no such head, no draft LM) is refused when --methods names it, and only skipped,
    with a line saying why, when --methods is left at its default."""
    import argparse

    from client.bench import parse_methods

    ap = argparse.ArgumentParser()
    known = ("none", "suffix", "eagle", "hybrid", "auto")
    unavailable = {"eagle": "no eagle head in speculator_path"}
    with pytest.raises(SystemExit) as exit_info:
        parse_methods(ap, "none,suffix,eagle,hybrid", known, unavailable)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "cannot run eagle (no eagle head in speculator_path); allowed here: none, suffix, hybrid, auto" in err
    assert parse_methods(ap, None, known, unavailable) == ["none", "suffix", "hybrid", "auto"]
    assert "no eagle head in speculator_path: skipping speculative_method=eagle" in capsys.readouterr().out
    assert parse_methods(ap, " suffix, none", known, unavailable) == ["suffix", "none"]


def test_client_bench_refuses_a_head_that_speculator_path_does_not_serve(capsys):
    """Through main, without --url: ``eagle`` with ``speculator_path`` none is refused before any server starts."""
    from client.bench import main as bench_main

    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--methods", "none,eagle", "--set", "draft_model.speculator_path=none"])
    assert exit_info.value.code == 2
    assert "cannot run eagle (no eagle head in speculator_path" in capsys.readouterr().err
