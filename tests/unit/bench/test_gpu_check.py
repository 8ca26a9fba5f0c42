"""bench.gpu_check (``make gpu-check``): its CPU mode runs every part and passes, and its checks can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def test_cpu_mode_runs_every_part_and_every_method_equals_plain_greedy(tmp_path):
    out = tmp_path / "gpu_check.json"
    # as `make gpu-check` runs it on a GPU machine: the tree on PYTHONPATH, nothing installed needed, and the
    # packages that machine lacks not importable (gpu_machine/sitecustomize.py)
    here = Path(__file__).parent / "gpu_machine"
    path = [str(here), str(ROOT / "backend_src"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--output", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["mode"] == "cpu" and res["passed"] and res["complete"] and not res["failures"]
    assert set(res["parts"]) == {"kernels", "distribution", "big_batch", "batch_invariance", "bandwidth", "decoding"}
    kernels = res["parts"]["kernels"]
    # 2 V x 2 k x 2 B x 2 dtypes, each: rejection with/without draft probs x greedy/sampled, typical x 2
    assert kernels["compared"] == kernels["equal"] == 96
    assert res["parts"]["big_batch"]["equal"] and all(res["parts"]["batch_invariance"]["invariant"].values())
    from bench.gpu_check.decoding import DECODING_METHODS, SELF

    runs = res["parts"]["decoding"]["runs"]
    # 2 dtypes x batches of 1 and 8 x every registered method but hybrid, and the target drafting for itself
    assert len(runs) == 2 * 2 * len(DECODING_METHODS) and all(r["equal_to_plain_greedy"] for r in runs)
    assert {r["method"] for r in runs} == set(DECODING_METHODS) and {"none", "draft", SELF} <= set(DECODING_METHODS)
    # The target drafting for itself: greedy drafts are its own argmax, so every one is accepted.
    assert all(r["acceptance_rate"] == 1.0 for r in runs if r["method"] == SELF)
    dec = res["parts"]["decoding"]
    for dtype in ("float32", "bfloat16"):
        ms = dec["forward_cost"][dtype]["target"]["ms"]
        assert len(ms["1"]) == 9 and list(ms["8"]) == ["1", "2", "5", "9"]  # JSON keys
        graphs = dec["engine"][dtype]["target"]["graphs"]  # CPU mode: the captured branch, eagerly at its shapes
        if dtype == "float32":
            assert graphs["emulated"] and graphs["captured"] > 0 and graphs["seconds"] == 0
        else:  # the batch-invariant bfloat16 forward pads few-row products itself: no captured shapes
            assert graphs is None
        # the attention calls of the rounds and the kernel each runs on (CPU: flash or math)
        attention = dec["engine"][dtype]["attention"]
        decoder = {"float32": "backend_src/spec_decode/engine/paged_forward.py:__call__",  # through transformers
                   "bfloat16": "backend_src/spec_decode/engine/invariant_attention.py:_padded_sdpa"}[dtype]
        heads = "backend_src/spec_decode/proposers/eagle/model.py:gqa_attention"
        assert {a["site"] for a in attention} >= {decoder, heads}
        assert all(a["picked"] in ("FLASH_ATTENTION", "MATH") and a["picked"] == a["kernels"][0] for a in attention)
        syncs = dec["engine"][dtype]["round_syncs"]
        assert syncs["plain"]["reads"] == 2 and syncs["head chain, greedy"]["reads"] > 2
        goals = dec["goals"][dtype]
        assert 0 < goals["fraction_of_roofline"] and goals["batch8_over_batch1"] > 0
        # a ratio of two timings: measured, not held to a bound here (a loaded machine moves it; the GPU run's
        # report compares it)
        assert 0 < goals["draft_over_target_forward"] < float("inf")
    assert "PASSED" in proc.stdout and res["table"] in proc.stdout


class _Logits:
    """A stand-in for a transformers causal LM: the same last-position logits for any input."""

    device = torch.device("cpu")

    def __init__(self, last: list[float]):
        self.last = torch.tensor(last)

    def __call__(self, input_ids):
        return type("Out", (), {"logits": self.last.expand(1, input_ids.shape[1], -1)})()


@pytest.mark.parametrize(("last", "emitted", "near_tie"), [
    ([4.0, 3.99, 1.0], 1, True),    # the emitted token second, one bfloat16 step below the reference's
    ([3.99, 4.0, 1.0], 1, True),    # the emitted token first in a plain forward: the reference's decoding chose 0
    ([4.0, 3.5, 1.0], 1, False),    # a real gap
    ([4.0, 3.99, 3.98], 2, False),  # the reference's token first, the emitted one third
    ([3.0, 4.0, 3.99], 1, False),   # the emitted first and close to the runner-up, the reference's token far below
])
def test_a_divergence_is_a_near_tie_only_when_both_tokens_are_within_the_tolerance(last, emitted, near_tie):
    from bench.gpu_check.decoding import describe_divergence, divergence

    d = divergence(_Logits(last), [5, 6], ref=[0, 0], got=[0, emitted], dtype="bfloat16")
    assert d["position"] == 1 and d["near_tie"] is near_tie
    # a failure names the position and both tokens with their logits
    assert (d["reference_token"], d["emitted_token"]) == (0, emitted)
    assert (d["reference_logit"], d["emitted_logit"]) == pytest.approx((last[0], last[emitted]))
    words = describe_divergence(d)
    assert "position 1" in words and f"reference token 0 (logit {last[0]:.4f})" in words
    assert f"emitted {emitted} (logit {last[emitted]:.4f}" in words


@pytest.fixture
def gpu_check():
    """The kernels part's module and a CPU context at one small size (the kernels run interpreted: conftest)."""
    from bench.gpu_check import kernels
    from bench.gpu_check.context import TINY, Context

    sizes = replace(TINY, vocabs=(37,), ks=(2,), batches=(3,), dtypes=(torch.float32,))
    return kernels, Context(torch.device("cpu"), sizes)


def test_a_kernel_that_disagrees_with_the_torch_path_fails_the_check(gpu_check, monkeypatch):
    kernels, ctx = gpu_check
    real = kernels.rejection_torch

    def off_by_one(tp, ids, dp, seeds, greedy, noise):
        out = real(tp, ids, dp, *noise, greedy)
        out[0, 0] = (out[0, 0] + 1) % tp.shape[-1]
        return out

    monkeypatch.setattr(kernels, "rejection_triton", off_by_one)
    kernels.kernels_vs_torch(ctx)
    assert any("kernel != torch" in f for f in ctx.failures)


def test_a_biased_sampler_fails_the_distribution_test(gpu_check, monkeypatch):
    kernels, ctx = gpu_check
    real = kernels.rejection_sample

    def always_argmax(tp, ids, dp, seeds=None, is_greedy=None, backend="auto"):  # not the target's distribution
        return real(tp, ids, dp, is_greedy=torch.ones(tp.shape[0], dtype=torch.bool), backend="torch")

    monkeypatch.setattr(kernels, "rejection_sample", always_argmax)
    kernels.distribution(ctx)
    assert any("distribution" in f and "p-value" in f for f in ctx.failures)
