"""bench.aiperf: the aiperf command lines it builds, its input file, the figures it reads from AIPerf's summary export
(real exports of AIPerf 0.13.0 runs against this server, trimmed to the summary's metrics: data/aiperf_*.json), and
bench.serving's prompt windows. The runs themselves need a server and .venv-aiperf."""

import json
import sys
from pathlib import Path

import pytest

from bench import aiperf
from bench.serving import prompt_windows

DATA = Path(__file__).parent / "data"
TOK = Path("/models/SmolLM2-135M-Instruct")


def _opt(cmd: list[str], flag: str) -> str:
    """The value after ``flag`` (which appears once)."""
    assert cmd.count(flag) == 1, (flag, cmd)
    return cmd[cmd.index(flag) + 1]


def _common_checks(cmd: list[str], tmp_path: Path) -> None:
    assert cmd[:2] == ["aiperf", "profile"] and "--streaming" in cmd
    assert _opt(cmd, "--input-file") == str(tmp_path / "p.jsonl")
    assert _opt(cmd, "--custom-dataset-type") == "single_turn"
    assert _opt(cmd, "--dataset-sampling-strategy") == "sequential"  # the prompts in the file's order
    assert _opt(cmd, "--tokenizer") == str(TOK)
    assert (_opt(cmd, "--osl"), _opt(cmd, "--concurrency"), _opt(cmd, "--request-count")) == ("64", "8", "16")
    # concurrency alone busy-polls a core: a request rate paces the polling, the concurrency stays the limit
    assert _opt(cmd, "--request-rate") == str(aiperf.PACING_REQUESTS_PER_S)
    assert _opt(cmd, "--arrival-pattern") == "constant"
    assert _opt(cmd, "--warmup-request-count") == "1"
    assert _opt(cmd, "--artifact-dir") == str(tmp_path / "art")
    assert _opt(cmd, "--ui") == "none" and "--no-gpu-telemetry" in cmd and "--no-server-metrics" in cmd
    assert "--extra-inputs" not in cmd or "speculative_method" not in _opt(cmd, "--extra-inputs")


def test_triton_command_targets_the_generate_extension_through_the_template_endpoint(tmp_path):
    cmd = aiperf.triton_command("aiperf", "127.0.0.1:8000", tmp_path / "p.jsonl", TOK, 64, 8, 16, tmp_path / "art",
                                warmup=1)
    _common_checks(cmd, tmp_path)
    assert (_opt(cmd, "-m"), _opt(cmd, "--url")) == ("generate", "127.0.0.1:8000")
    assert _opt(cmd, "--endpoint-type") == "template"
    assert _opt(cmd, "--custom-endpoint") == "/v2/models/generate/generate_stream"
    extra = json.loads(_opt(cmd, "--extra-inputs"))
    assert extra == {"payload_template": aiperf.TRITON_GENERATE_TEMPLATE, "response_field": "text_output"}


def test_triton_template_renders_generate_inputs_as_aiperf_renders_it():
    jinja2 = pytest.importorskip("jinja2")
    text = 'def f(a, b):\n    """a < b & "c" \'d\'"""\n'
    # AIPerf 0.13's TemplateEndpoint: Environment(autoescape=True), these variables, then orjson.loads
    body = jinja2.Environment(autoescape=True).from_string(aiperf.TRITON_GENERATE_TEMPLATE).render(
        text=text, max_tokens=64, stream=True)
    assert json.loads(body) == {"text_input": text, "max_tokens": 64, "stream": True}


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_openai_command_names_the_endpoint_type_and_served_model(tmp_path, kind):
    cmd = aiperf.openai_command("aiperf", "http://127.0.0.1:9000", kind, "SmolLM2-135M-Instruct",
                                tmp_path / "p.jsonl", TOK, 64, 8, 16, tmp_path / "art", warmup=1)
    _common_checks(cmd, tmp_path)
    assert _opt(cmd, "--endpoint-type") == kind and _opt(cmd, "--url") == "http://127.0.0.1:9000"
    assert _opt(cmd, "-m") == "SmolLM2-135M-Instruct"
    assert "--custom-endpoint" not in cmd  # AIPerf appends /v1/completions or /v1/chat/completions
    with pytest.raises(ValueError, match="completions or chat"):
        aiperf.openai_command("aiperf", "http://x", "embeddings", "m", tmp_path, TOK, 1, 1, 1, tmp_path)


def test_prompts_file_carries_the_generate_inputs_per_line_with_the_warmup_first(tmp_path):
    path = tmp_path / "p.jsonl"
    aiperf.write_prompts(path, ["a", "b\n\"c\""], aiperf.request_inputs("none", 4), warmup_prompt="w")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["text"] for line in lines] == ["w", "a", "b\n\"c\""]
    # the string "none" (AIPerf's --extra-inputs would turn it into null), no draft tokens for the baseline
    assert all(line["extra"] == {"speculative_method": "none", "num_draft_tokens": 0, "ignore_eos": True,
                                 "temperature": 0.0} for line in lines)
    assert aiperf.request_inputs("suffix", 4)["num_draft_tokens"] == 4


def test_parse_export_of_a_triton_generate_run():
    r = aiperf.parse_export(DATA / "aiperf_triton_generate_c8.json")
    s = json.loads((DATA / "aiperf_triton_generate_c8.json").read_text())
    assert r["aiperf_version"] == "0.13.0" and r["requests"] == 16 and r["errors"] == 0
    assert r["tokens_per_s"] == pytest.approx(s["output_token_throughput"]["avg"])
    assert r["ttft_ms"] == pytest.approx(s["time_to_first_token"]["p50"])
    assert r["ttft_p90_ms"] == pytest.approx(s["time_to_first_token"]["p90"])
    assert r["itl_ms"] == pytest.approx(s["inter_token_latency"]["p50"])
    assert r["request_latency_ms"] == pytest.approx(s["request_latency"]["p50"])
    assert r["duration_s"] == pytest.approx(s["benchmark_duration"]["avg"])
    # output tokens / time is the throughput's definition: consistent within the export
    assert r["tokens_per_s"] == pytest.approx(s["total_output_tokens"]["avg"] / r["duration_s"], rel=1e-3)
    # method none: one streamed event per step, one token per step (up to the tokenizer's re-count of the text)
    assert r["tokens_per_response"] == pytest.approx(1.0, abs=0.05)
    assert "--endpoint-type 'template'" in s["run_info"]["cli_command"]


def test_parse_export_of_an_openai_chat_run():
    r = aiperf.parse_export(DATA / "aiperf_openai_chat_c1.json")
    s = json.loads((DATA / "aiperf_openai_chat_c1.json").read_text())
    assert r["requests"] == 4 and r["output_sequence_length"] == pytest.approx(32.0)
    assert r["tokens_per_s"] == pytest.approx(s["output_token_throughput"]["avg"])
    assert 0 < r["ttft_ms"] < r["request_latency_ms"] and r["itl_ms"] > 0
    assert "--endpoint-type 'chat'" in s["run_info"]["cli_command"]


def test_parse_export_without_a_successful_request_is_an_error(tmp_path):
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"aiperf_version": "0.13.0", "error_summary": [{"count": 3}]}))
    with pytest.raises(ValueError, match="no successful request"):
        aiperf.parse_export(path)


def _fake_aiperf(tmp_path: Path, export: Path | None, status: int = 0) -> str:
    """An executable standing in for aiperf: writes ``export`` into --artifact-dir and exits with ``status``."""
    exe = tmp_path / "fake_aiperf"
    copy = f"shutil.copy({str(export)!r}, Path(art) / 'profile_export_aiperf.json')" if export else "pass"
    exe.write_text(f"#!{sys.executable}\nimport shutil, sys\nfrom pathlib import Path\n"
                   f"art = sys.argv[sys.argv.index('--artifact-dir') + 1]\n{copy}\nprint('ran', *sys.argv[1:3])\n"
                   f"sys.exit({status})\n")
    exe.chmod(0o755)
    return str(exe)


def test_profile_runs_the_command_and_returns_a_row(tmp_path):
    exe = _fake_aiperf(tmp_path, DATA / "aiperf_triton_generate_c8.json")
    row = aiperf.profile(exe, "triton-generate", "127.0.0.1:8000", ["p"] * 20, "suffix", 4, 8, 16, 64, TOK, tmp_path,
                         warmup_prompt="w")
    assert (row["tool"], row["endpoint"], row["method"], row["concurrency"]) == ("aiperf", "triton-generate",
                                                                                  "suffix", 8)
    assert row["requests"] == 16 and Path(row["export"]).exists()
    lines = (tmp_path / "aiperf_prompts.triton-generate.suffix.c8.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 16  # the warm-up prompt, then the requests
    out = (tmp_path / "aiperf.triton-generate.suffix.c8" / "aiperf.out").read_text()
    assert out.startswith("ran profile -m")


def test_profile_failure_raises_with_the_command(tmp_path):
    exe = _fake_aiperf(tmp_path, None, status=1)
    with pytest.raises(RuntimeError, match="aiperf failed") as e:
        aiperf.profile(exe, "openai-chat", "http://127.0.0.1:9000", ["p"], "none", 4, 1, 1, 8, TOK, tmp_path,
                       model="m")
    assert "--endpoint-type chat" in str(e.value)
    with pytest.raises(ValueError, match="endpoint must be one of"):
        aiperf.profile(exe, "kserve", "x", ["p"], "none", 4, 1, 1, 8, TOK, tmp_path)


def test_profile_endpoints_share_prompts_except_for_methods_that_learn_from_responses(tmp_path, monkeypatch):
    seen = []

    def fake_profile(exe, endpoint, url, prompts, method, k, c, n, *args, **kw):
        seen.append((endpoint, method, c, tuple(prompts)))
        if endpoint == "openai-chat":
            raise RuntimeError("boom")
        return {"tool": "aiperf", "endpoint": endpoint, "method": method, "concurrency": c, "tokens_per_s": 1.0,
                "ttft_ms": 2.0, "itl_ms": 3.0}

    monkeypatch.setattr(aiperf, "profile", fake_profile)
    windows = {(1, 0): ["a"], (1, 1): ["b"], (1, 2): ["c"]}
    urls = {"triton-generate": "h", "openai-completions": "o", "openai-chat": "o"}
    rows = aiperf.profile_endpoints("aiperf", urls, ["none", "suffix"], windows, 4, 8, TOK, tmp_path,
                                    own_window=frozenset({"suffix"}))
    assert [p for e, m, c, p in seen if m == "none"] == [("a",)] * 3
    assert [p for e, m, c, p in seen if m == "suffix"] == [("a",), ("b",), ("c",)]
    assert [r.get("error") for r in rows] == [None, None, "boom", None, None, "boom"]
    table = aiperf.compare_endpoints(rows)
    assert [(t["method"], t["concurrency"]) for t in table] == [("none", 1), ("suffix", 1)]
    assert table[0]["triton-generate"] == {"tokens_per_s": 1.0, "ttft_ms": 2.0, "itl_ms": 3.0}
    assert table[0]["openai-chat"] == {"error": "boom"}


def test_prompt_windows_are_consecutive_and_wrap_around():
    w = prompt_windows({("pa", 1): 2, ("pa", 2): 2, (1, 0): 3}, ["a", "b", "c", "d", "e", "f"])
    assert w == {("pa", 1): ["a", "b"], ("pa", 2): ["c", "d"], (1, 0): ["e", "f", "a"]}
