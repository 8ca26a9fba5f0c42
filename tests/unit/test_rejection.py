"""Verifier maths (torch path): the output distribution is the target's, greedy, edge cases, seeding, validation."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spec_decode.verifier import rejection_sample, typical_acceptance_sample


def _dist(gen, *shape, sharp=1.0):
    return torch.softmax(torch.randn(*shape, generator=gen) * sharp, dim=-1)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_output_distribution_equals_target(k, with_draft_probs):
    """Chi-square at every position: given the first j tokens were accepted drafts, token j ~ target_probs[j]."""
    g = torch.Generator().manual_seed(100 + k)
    v, n = 6, 12000
    p = _dist(g, 1, k + 1, v, sharp=1.2).expand(n, k + 1, v).contiguous()
    q = _dist(g, 1, k, v, sharp=1.2).expand(n, k, v).contiguous()
    if with_draft_probs:  # drafts sampled from q
        d = torch.multinomial(q.reshape(-1, v), 1, generator=g).reshape(n, k)
    else:  # any proposal: skewed towards token 0
        d = torch.where(torch.rand(n, k, generator=g) < 0.6, 0, torch.randint(0, v, (n, k), generator=g))
    out = rejection_sample(p, d, q if with_draft_probs else None, seeds=torch.arange(n))
    for j in range(k + 1):
        col = out[:, j][out[:, j] >= 0].numpy()
        if len(col) < 500:
            continue
        counts = np.bincount(col, minlength=v)
        expected = p[0, j].double().numpy()
        stat, pvalue = chisquare(counts, expected / expected.sum() * len(col))
        assert pvalue > 1e-3, (j, counts, expected)


def test_convergence_to_target_like_vllm():
    """TV distance between the empirical first-token law and the target shrinks as samples grow (vLLM's test)."""
    g = torch.Generator().manual_seed(7)
    v, k = 10, 2
    p1, q1 = _dist(g, 1, k + 1, v, sharp=2.0), _dist(g, 1, k, v, sharp=2.0)
    tvs = []
    for n in (200, 2000, 20000):
        p, q = p1.expand(n, k + 1, v).contiguous(), q1.expand(n, k, v).contiguous()
        d = torch.multinomial(q.reshape(-1, v), 1, generator=g).reshape(n, k)
        out = rejection_sample(p, d, q, seeds=torch.arange(n) + 10 * n)
        emp = np.bincount(out[:, 0].numpy(), minlength=v) / n
        tvs.append(0.5 * np.abs(emp - p1[0, 0].numpy()).sum())
    assert tvs[2] < tvs[0] and tvs[2] < 0.02, tvs


@pytest.mark.parametrize("v", [100, 8193, 49152, 151936])
def test_greedy_rows_follow_argmax_walk(v):
    g = torch.Generator().manual_seed(3)
    p = _dist(g, 2, 4, v, sharp=3.0)
    arg = p.argmax(-1)  # [2, 4]
    drafts = arg[:, :3].clone()
    drafts[0, 2] = (arg[0, 2] + 1) % v  # row 0: third draft wrong
    out = rejection_sample(p, drafts, None, is_greedy=torch.tensor([True, True]))
    assert out[0].tolist() == [int(arg[0, 0]), int(arg[0, 1]), int(arg[0, 2]), -1]
    assert out[1].tolist() == arg[1].tolist()  # all accepted + bonus argmax


@pytest.mark.parametrize("v", [100, 8193, 49152, 151936])
def test_p_equals_q_accepts_all_and_gives_no_nan(v):
    g = torch.Generator().manual_seed(4)
    p = _dist(g, 2, 4, v)
    d = torch.stack([torch.multinomial(p[b, :3], 1, generator=g)[:, 0] for b in range(2)])
    out = rejection_sample(p, d, p[:, :3].clone(), seeds=torch.tensor([1, 2]))
    assert (out[:, :3] == d).all() and ((out[:, 3] >= 0) & (out[:, 3] < v)).all()


def test_placeholder_draft_is_rejected_without_indexing():
    p = torch.full((1, 3, 10), 0.1)
    out = rejection_sample(p, torch.tensor([[-1, 3]]), None, seeds=torch.tensor([0]))
    assert 0 <= out[0, 0] < 10 and out[0, 1:].tolist() == [-1, -1]


def test_seeded_rows_are_reproducible_and_batch_invariant_with_unseeded_rows():
    g = torch.Generator().manual_seed(5)
    p, q = _dist(g, 3, 5, 30), _dist(g, 3, 4, 30)
    d = torch.randint(0, 30, (3, 4), generator=g)
    a = rejection_sample(p, d, q, seeds=torch.tensor([7, -1, 9]))
    b = rejection_sample(p[2:3], d[2:3], q[2:3], seeds=torch.tensor([9]))
    c = rejection_sample(p, d, q, seeds=torch.tensor([7, 8, 9]))
    assert torch.equal(a[2], b[0]) and torch.equal(a[0], c[0])


def test_half_precision_inputs_are_accepted():
    g = torch.Generator().manual_seed(6)
    p = _dist(g, 2, 3, 50)
    d = torch.randint(0, 50, (2, 2), generator=g)
    for dt in (torch.bfloat16, torch.float16):
        out = rejection_sample(p.to(dt), d, p[:, :2].to(dt), seeds=torch.tensor([1, 2]))
        assert out.shape == (2, 3) and (out[:, 0] >= 0).all()


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda p, d, q: (p[0], d, q), "target_probs"),
        (lambda p, d, q: (p.double(), d, q), "target_probs dtype"),
        (lambda p, d, q: (p, d.int(), q), "draft_token_ids dtype"),
        (lambda p, d, q: (p, d[:, :1], q), "draft_token_ids must be"),
        (lambda p, d, q: (p, d + 100, q), r"\[0, 10\)"),
        (lambda p, d, q: (p, d - 5, q), r"\[0, 10\)"),
        (lambda p, d, q: (p * float("nan"), d, q), "NaN"),
        (lambda p, d, q: (p - 1, d, q), "negative"),
        (lambda p, d, q: (p, d, q[:, :1]), "draft_probs must be"),
        (lambda p, d, q: (p, d, q.half()), "draft_probs dtype"),
    ],
)
def test_validation_errors_name_the_argument(mutate, match):
    p = torch.full((1, 3, 10), 0.1)
    d = torch.tensor([[1, 2]])
    q = torch.full((1, 2, 10), 0.1)
    with pytest.raises(ValueError, match=match):
        rejection_sample(*mutate(p, d, q))


def test_unknown_backend_and_seed_shape_are_errors():
    p, d = torch.full((1, 2, 10), 0.1), torch.tensor([[1]])
    with pytest.raises(ValueError, match="backend"):
        rejection_sample(p, d, backend="cuda")
    with pytest.raises(ValueError, match="seeds"):
        rejection_sample(p, d, seeds=torch.tensor([1, 2]))


def test_typical_high_entropy_target_accepts_every_draft():
    v, k = 1000, 4
    p = torch.full((2, k + 1, v), 1.0 / v)
    d = torch.randint(0, v, (2, k))
    out = typical_acceptance_sample(p, d, seeds=torch.tensor([1, 2]))
    assert torch.equal(out[:, :k], d) and (out[:, k] >= 0).all()


def test_typical_one_hot_target_with_wrong_drafts_gives_argmax_then_padding():
    v, k = 50, 3
    p = torch.zeros(1, k + 1, v)
    p[0, torch.arange(k + 1), torch.tensor([5, 6, 7, 8])] = 1.0
    out = typical_acceptance_sample(p, torch.tensor([[9, 9, 9]]))
    assert out[0].tolist() == [5, -1, -1, -1]


def test_typical_zero_thresholds_accept_everything():
    g = torch.Generator().manual_seed(8)
    p = _dist(g, 3, 5, 64)
    d = torch.randint(0, 64, (3, 4), generator=g)
    out = typical_acceptance_sample(p, d, posterior_threshold=0.0, posterior_alpha=0.0)
    assert torch.equal(out[:, :4], d)
    with pytest.raises(ValueError, match="posterior"):
        typical_acceptance_sample(p, d, posterior_threshold=-1.0)
