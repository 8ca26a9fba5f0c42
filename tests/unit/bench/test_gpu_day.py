"""bench.gpu_day (``make gpu-day``): its CPU mode runs the served part as on a bare GPU machine and passes (the
forward parts are gpu_check's decoding part, which tests/unit/bench/test_gpu_check.py runs), a part that fails is
named, and the served path's checks run through a real tritonserver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _env() -> dict[str, str]:
    # as `make gpu-day` runs it on a GPU machine: the tree on PYTHONPATH, and the packages that machine lacks not
    # importable (gpu_machine/sitecustomize.py, inherited by the server's model processes too)
    here = Path(__file__).parent / "gpu_machine"
    path = [str(here), str(ROOT / "backend_src"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def test_cpu_mode_served_part_passes(tmp_path):
    from bench.gpu_day.served import save_tokenizer

    out = tmp_path / "gpu_day.json"
    # the tokenizer that travels in build/gpu_day (made here: the embedded model's package is hidden in the part)
    env = {**_env(), "SPEC_DECODE_GPU_DAY_TOKENIZER": str(save_tokenizer(tmp_path / "tokenizer"))}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_day", "--device", "cpu", "--output", str(out),
                           "--parts", "served"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    res = json.loads(out.read_text())
    assert {n: p["status"] for n, p in res["parts"].items()} == {"served": "passed"}, \
        proc.stdout[-4000:] + proc.stderr[-4000:]
    # a subset of the parts is not a whole run: exit 1, said so
    assert proc.returncode == 1 and not res["passed"] and "incomplete" in proc.stdout.splitlines()[-1]
    served = res["parts"]["served"]["result"]
    assert not served["failures"] and served["instances"] == "KIND_CPU, device cpu"
    runs = {(r["method"], r["concurrency"]): r for r in served["runs"]}
    assert set(runs) == {(m, c) for m in ("none", "ngram", "suffix", "eagle3", "eagle3:chain") for c in (1, 8)}
    assert all(r["equal_to_transformers"] for r in runs.values())
    assert runs[("eagle3", 1)]["drafted"] > 0 and runs[("none", 1)]["drafted"] == 0
    assert served["server_over_in_process"] > 0 and served["round_beyond_forward_ms"] is not None
    assert "ms_per_round" in runs[("suffix", 8)] and "ms_per_round" not in runs[("ngram", 1)]
    assert "PASSED    served" in proc.stdout


def test_a_failing_part_is_named(tmp_path):
    from bench.gpu_day.__main__ import Part, run_part, summary

    res = run_part(Part("broken", "bench.gpu_day.no_such_part", (), 60, budgeted=False), "cpu", tmp_path, 60)
    assert res["status"] == "failed" and res["exit_code"] == 1
    assert any("No module named" in line for line in res["failures"])
    assert summary("broken", res).startswith("FAILED    broken")
