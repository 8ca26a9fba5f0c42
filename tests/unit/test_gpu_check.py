"""bench/gpu_check.py (``make gpu-check``): its CPU mode runs every part and passes, and its checks can fail."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def test_cpu_mode_runs_every_part_and_every_method_equals_plain_greedy(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--output", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["mode"] == "cpu" and res["passed"] and res["complete"] and not res["failures"]
    assert set(res["parts"]) == {"kernels", "distribution", "big_batch", "batch_invariance", "bandwidth", "decoding"}
    kernels = res["parts"]["kernels"]
    # 2 V x 2 k x 2 B x 2 dtypes, each: rejection with/without draft probs x greedy/sampled, typical x 2
    assert kernels["compared"] == kernels["equal"] == 96
    assert res["parts"]["big_batch"]["equal"] and all(res["parts"]["batch_invariance"]["invariant"].values())
    runs = res["parts"]["decoding"]["runs"]
    assert len(runs) == 24 and all(r["equal_to_plain_greedy"] for r in runs)
    # The target drafting for itself: greedy drafts are its own argmax, so every one is accepted.
    assert all(r["acceptance_rate"] == 1.0 for r in runs if r["method"] == "self")
    assert {r["method"] for r in runs} == {"none", "draft", "ngram", "suffix", "eagle", "self"}
    assert len(res["parts"]["decoding"]["forward_cost"]["ms"]) == 9
    assert "PASSED" in proc.stdout and res["table"] in proc.stdout


@pytest.fixture
def gpu_check(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "FAILURES", [])
    monkeypatch.setattr(mod, "VOCABS", (37,))
    monkeypatch.setattr(mod, "KS", (2,))
    monkeypatch.setattr(mod, "BATCHES", (3,))
    monkeypatch.setattr(mod, "DTYPES", (torch.float32,))
    return mod


def test_a_kernel_that_disagrees_with_the_torch_path_fails_the_check(gpu_check, monkeypatch):
    real = gpu_check.rejection_torch

    def off_by_one(tp, ids, dp, seeds, greedy, noise):
        out = real(tp, ids, dp, *noise, greedy)
        out[0, 0] = (out[0, 0] + 1) % tp.shape[-1]
        return out

    monkeypatch.setattr(gpu_check, "rejection_triton", off_by_one)
    gpu_check.kernels_vs_torch()
    assert any("kernel != torch" in f for f in gpu_check.FAILURES)


def test_a_biased_sampler_fails_the_distribution_test(gpu_check, monkeypatch):
    real = gpu_check.rejection_sample

    def always_argmax(tp, ids, dp, seeds=None, is_greedy=None, backend="auto"):  # not the target's distribution
        return real(tp, ids, dp, is_greedy=torch.ones(tp.shape[0], dtype=torch.bool), backend="torch")

    monkeypatch.setattr(gpu_check, "rejection_sample", always_argmax)
    gpu_check.distribution()
    assert any("distribution" in f and "p-value" in f for f in gpu_check.FAILURES)
