"""The verifier's Triton kernels: exact agreement with the torch maths under TRITON_INTERPRET=1, and sm_90
compilation."""

import os
import subprocess
import sys

import pytest
import torch

from spec_decode.verifier import rejection_sample, typical_acceptance_sample
from spec_decode.verifier.kernels import rejection_triton, typical_triton
from spec_decode.verifier.torch_impl import rejection_torch, typical_torch


def _case(v, k, b=4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    tp = torch.softmax(torch.randn(b, k + 1, v, generator=g) * 3, -1)
    dp = torch.softmax(torch.randn(b, k, v, generator=g) * 3, -1)
    ids = torch.randint(0, v, (b, k), generator=g)
    ids[:, 0] = tp[:, 0].argmax(-1)  # some drafts accepted under greedy
    ids[0, -1] = -1  # a placeholder
    if b > 2:
        dp[2] = tp[2, :k]  # p == q row
    u = torch.rand(b, k, generator=g)
    e = torch.empty(b, v).exponential_(generator=g).clamp_min(1e-30)
    greedy = torch.tensor([i % 2 == 1 for i in range(b)])
    return tp.to(dtype), dp.to(dtype), ids, u, e, greedy


@pytest.mark.parametrize("v", [100, 8193])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_rejection_kernel_equals_torch_with_same_noise(v, k, with_draft_probs):
    tp, dp, ids, u, e, greedy = _case(v, k, seed=v + k)
    dp = dp if with_draft_probs else None
    got = rejection_triton(tp, ids, dp, torch.arange(4), greedy, noise=(u, e))
    assert torch.equal(got, rejection_torch(tp, ids, dp, u, e, greedy))


@pytest.mark.parametrize("v, k", [(100, 1), (8193, 4)])
def test_typical_kernel_equals_torch_with_same_noise(v, k):
    tp, _, ids, _, e, greedy = _case(v, k, seed=2 * v + k)
    for eps, alpha in ((0.09, 0.3), (0.0, 0.0), (0.5, 1.0)):
        got = typical_triton(tp, ids, eps, alpha, torch.arange(4), greedy, e)
        assert torch.equal(got, typical_torch(tp, ids, eps, alpha, e, greedy)), (eps, alpha)


def test_bfloat16_inputs_match_torch():
    tp, dp, ids, u, e, greedy = _case(300, 3, dtype=torch.bfloat16)
    got = rejection_triton(tp, ids, dp, torch.arange(4), greedy, noise=(u, e))
    assert torch.equal(got, rejection_torch(tp, ids, dp, u, e, greedy))


@pytest.mark.parametrize("v", [49152, 151936])
def test_large_vocab_out_of_range_lanes_never_win(v):
    """V not a multiple of the 4096 tile: the greedy bonus is the true argmax, sampled ids stay in [0, V)."""
    g = torch.Generator().manual_seed(v)
    tp = torch.softmax(torch.randn(2, 2, v, generator=g), -1)
    tp[:, :, v - 1] = 0.9  # the winner sits in the last, partial tile
    tp = tp / tp.sum(-1, keepdim=True)
    ids = torch.tensor([[v - 1], [0]])
    out = rejection_sample(tp, ids, None, seeds=torch.tensor([1, 2]), is_greedy=torch.tensor([True, False]),
                           backend="triton")
    assert out[0].tolist() == [v - 1, v - 1]
    assert ((out[1] >= 0) & (out[1] < v) | (out[1] == -1)).all() and out[1, 0] >= 0


def test_philox_seeded_rows_are_reproducible_and_batch_invariant():
    tp, dp, ids, _, _, greedy = _case(257, 3, b=4, seed=11)
    seeds = torch.tensor([5, -1, 7, 8])
    a = rejection_sample(tp, ids, dp, seeds=seeds, is_greedy=torch.zeros(4, dtype=torch.bool), backend="triton")
    b = rejection_sample(tp[2:3], ids[2:3], dp[2:3], seeds=seeds[2:3], backend="triton")
    c = rejection_sample(tp, ids, dp, seeds=torch.tensor([5, 6, 7, 8]), backend="triton")
    assert torch.equal(a[2], b[0]) and torch.equal(a[0], c[0]) and torch.equal(a[3], c[3])
    t = typical_acceptance_sample(tp, ids, seeds=seeds, backend="triton")
    assert torch.equal(t[2], typical_acceptance_sample(tp[2:3], ids[2:3], seeds=seeds[2:3], backend="triton")[0])


def test_kernels_compile_for_sm90():
    """Ahead-of-time compilation for sm_90 (no GPU needed) catches constructs only the interpreter accepts."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "spec_decode.verifier.compile_check"], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("-> sm_90 ok") == 24, r.stdout


@pytest.mark.parametrize("q_zero_on_target_favourite", [False, True])
def test_kernel_output_distribution_equals_target_with_philox_noise(q_zero_on_target_favourite):
    """Chi-square on the kernel path with its in-kernel Philox noise (not only fed noise): token j ~ target_probs[j],
    also when the draft gives zero probability to the target's most likely token (it then comes from the residual)."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(21)
    v, k, n = 5, 2, 1000  # the interpreter runs ~25 ms per program here: keep n small
    p = torch.softmax(torch.randn(1, k + 1, v, generator=g) * 1.2, -1)
    q = torch.softmax(torch.randn(1, k, v, generator=g) * 1.2, -1)
    if q_zero_on_target_favourite:
        q[0, torch.arange(k), p[0, :k].argmax(-1)] = 0.0
        q = q / q.sum(-1, keepdim=True)
    p, q = p.expand(n, k + 1, v).contiguous(), q.expand(n, k, v).contiguous()
    d = torch.multinomial(q.reshape(-1, v), 1, generator=g).reshape(n, k)
    out = rejection_sample(p, d, q, seeds=torch.arange(n) * 7919, backend="triton")
    for j in range(k + 1):
        col = out[:, j][out[:, j] >= 0].numpy()
        if len(col) < 200:
            continue
        counts = torch.bincount(torch.from_numpy(col), minlength=v).numpy()
        expected = p[0, j].double().numpy()
        assert chisquare(counts, expected / expected.sum() * len(col)).pvalue > 1e-3, (j, counts)
