"""The tree verifier's Triton kernels: exact agreement with the torch maths under TRITON_INTERPRET=1 (tests/conftest.py
sets it) for the same tensor noise on random trees, the chain kernels' Philox keys, and sm_90 compilation."""

import os
import subprocess
import sys

import pytest
import torch

from spec_decode.verifier import rejection_sample, typical_acceptance_sample
from spec_decode.verifier.tree_kernels import tree_rejection_triton, tree_typical_triton
from spec_decode.verifier.tree_sampler import tree_rejection_sample, tree_typical_sample
from spec_decode.verifier.tree_torch import tree_rejection_torch, tree_typical_torch

U_MAX = 1.0 - 2.0**-24


def random_tree(g: torch.Generator, b: int, n: int, v: int, fill: float = 0.8) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, n] ids and parents: each row ~fill * n real nodes (random parents among the real nodes before, distinct
    siblings), the rest -1 padding nodes (parents -1) anywhere."""
    ids, par = torch.full((b, n), -1), torch.full((b, n), -1)
    for r in range(b):
        taken: set[tuple[int, int]] = set()
        for i in range(n):
            if float(torch.rand((), generator=g)) > fill:
                continue
            real = [j for j in range(i) if ids[r, j] >= 0]
            p = real[int(torch.randint(0, len(real), (), generator=g))] if real and float(
                torch.rand((), generator=g)) < 0.7 else -1
            t = int(torch.randint(0, v, (), generator=g))
            if (p, t) not in taken:
                taken.add((p, t))
                ids[r, i], par[r, i] = t, p
    return ids, par


def _case(seed: int, b: int, n: int, v: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    tp = torch.softmax(torch.randn(b, n + 1, v, generator=g) * 2, -1)
    dp = torch.softmax(torch.randn(b, n, v, generator=g) * 2, -1)
    ids, par = random_tree(g, b, n, v)
    u = torch.rand(b, n, generator=g)
    if b >= 3:
        tp[0, 0] = 0.0  # a one-hot root: every child but one has p = 0
        tp[0, 0, 1] = 1.0
        dp[1] = tp[1, par[1] + 1]  # p == q at every node of row 1
        u[2] = U_MAX  # rejections down to an exhausted residual
    e = torch.empty(b, v).exponential_(generator=g)
    greedy = torch.arange(b) % 3 == 2
    return tp.to(dtype), dp.to(dtype), ids, par, u, e, greedy


def _same(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("v, n, seed", [(3, 8, 0), (7, 6, 1), (300, 5, 2), (5000, 3, 3)])
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_tree_rejection_kernel_equals_torch_with_same_noise(v, n, seed, with_draft_probs):
    tp, dp, ids, par, u, e, greedy = _case(seed, 6, n, v)
    dp = dp if with_draft_probs else None
    got = tree_rejection_triton(tp, ids, par, dp, torch.arange(6), greedy, noise=(u, e))
    assert _same(got, tree_rejection_torch(tp, ids, par, dp, u, e, greedy))


@pytest.mark.parametrize("v, n, seed", [(4, 8, 4), (300, 5, 5)])
def test_tree_typical_kernel_equals_torch_with_same_noise(v, n, seed):
    tp, _, ids, par, _, e, greedy = _case(seed, 6, n, v)
    for eps, alpha in ((0.09, 0.3), (0.0, 0.0), (0.5, 1.0)):
        got = tree_typical_triton(tp, ids, par, eps, alpha, torch.arange(6), greedy, e)
        assert _same(got, tree_typical_torch(tp, ids, par, eps, alpha, e, greedy)), (eps, alpha)


def test_bfloat16_inputs_match_torch():
    tp, dp, ids, par, u, e, greedy = _case(6, 4, 5, 40, dtype=torch.bfloat16)
    got = tree_rejection_triton(tp, ids, par, dp, torch.arange(4), greedy, noise=(u, e))
    assert _same(got, tree_rejection_torch(tp, ids, par, dp, u, e, greedy))


def test_greedy_rows_follow_the_argmax_down_a_later_branch_on_both_paths():
    tp = torch.tensor([[[0.1, 0.2, 0.1, 0.5, 0.1], [0.2] * 5, [0.1, 0.1, 0.1, 0.1, 0.6], [0.2] * 5,
                        [0.1, 0.1, 0.7, 0.0, 0.1]]])
    ids, par, greedy = torch.tensor([[1, 3, 0, 4]]), torch.tensor([[-1, -1, 1, 1]]), torch.tensor([True])
    for out, path in (tree_rejection_sample(tp, ids, par, is_greedy=greedy, backend="triton"),
                      tree_typical_sample(tp, ids, par, is_greedy=greedy, backend="triton")):
        assert out.tolist() == [[3, 4, 2, -1, -1]] and path.tolist() == [[1, 3, -1, -1]]


def test_philox_noise_is_keyed_as_the_chain_kernel_s():
    """On a chain the tree kernels draw what the chain kernels draw (same seeds): the same tokens."""
    g = torch.Generator().manual_seed(8)
    b, k, v = 4, 3, 33
    tp = torch.softmax(torch.randn(b, k + 1, v, generator=g) * 2, -1)
    dp = torch.softmax(torch.randn(b, k, v, generator=g) * 2, -1)
    ids = torch.randint(0, v, (b, k), generator=g)
    ids[:, 0] = tp[:, 0].argmax(-1)
    ids[0, -1] = -1
    par, seeds = torch.arange(-1, k - 1).expand(b, k).contiguous(), torch.tensor([3, 4, 5, 6])
    for probs in (dp, None):
        out, _ = tree_rejection_sample(tp, ids, par, probs, seeds=seeds, backend="triton")
        assert torch.equal(out, rejection_sample(tp, ids, probs, seeds=seeds, backend="triton"))
    out, _ = tree_typical_sample(tp, ids, par, seeds=seeds, backend="triton")
    assert torch.equal(out, typical_acceptance_sample(tp, ids, seeds=seeds, backend="triton"))


def test_philox_seeded_rows_are_reproducible_and_independent_of_padding_and_batch():
    tp, dp, ids, par, _, _, _ = _case(9, 3, 5, 20)
    seeds = torch.tensor([11, -1, 13])
    a = tree_rejection_sample(tp, ids, par, dp, seeds=seeds, backend="triton")
    alone = tree_rejection_sample(tp[2:], ids[2:], par[2:], dp[2:], seeds=seeds[2:], backend="triton")
    pad = torch.full((1, 2), -1)
    padded = tree_rejection_sample(torch.cat([tp[2:], torch.rand(1, 2, 20)], 1), torch.cat([ids[2:], pad], 1),
                                   torch.cat([par[2:], pad], 1), torch.cat([dp[2:], torch.zeros(1, 2, 20)], 1),
                                   seeds=seeds[2:], backend="triton")
    assert torch.equal(a[0][2], alone[0][0]) and torch.equal(a[1][2], alone[1][0])
    assert torch.equal(padded[0][0, :6], alone[0][0]) and torch.equal(padded[1][0, :5], alone[1][0])


@pytest.mark.parametrize("where", ["target", "draft"])
def test_invalid_values_raise_the_torch_path_s_error(where):
    tp, dp, ids, par, u, e, greedy = _case(10, 2, 3, 6)
    (tp if where == "target" else dp)[:, 0] = float("nan")  # row 0 is read at the root; draft row 0 at node 0
    ids[:, 0], par[:, 0] = 2, -1
    name = "target_probs" if where == "target" else "draft_probs"
    sampled = torch.zeros(2, dtype=torch.bool)
    for call in (lambda: tree_rejection_triton(tp, ids, par, dp, torch.arange(2), sampled, noise=(u, e)),
                 lambda: tree_rejection_torch(tp, ids, par, dp, u, e, sampled)):
        with pytest.raises(ValueError, match=f"{name} contains NaN"):
            call()


def test_tree_kernels_compile_for_sm90():
    """Ahead-of-time compilation for sm_90 (no GPU needed), float32 variants (``python -m
    spec_decode.verifier.compile_check --tree`` compiles bfloat16 and float16 as well)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from spec_decode.verifier.compile_check import compile_all\n"
            "print('\\n'.join(compile_all(tree=True, dtypes=('fp32',))))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("-> sm_90 ok") == 12 and "tree_typical_kernel" in r.stdout, r.stdout
