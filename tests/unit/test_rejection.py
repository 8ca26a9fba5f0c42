"""Rejection sampler (torch path): exactness of the output distribution, greedy, edge cases, seeding, validation."""

import numpy as np
import pytest
import torch

from spec_decode.verifier import rejection_sample


def _random_dist(gen, *shape, sharp=1.0):
    return torch.softmax(torch.randn(*shape, generator=gen) * sharp, dim=-1)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_first_token_distribution_equals_target(with_draft_probs):
    """Chi-square: the first emitted token is distributed as target_probs[0], whatever the draft (fixed seeds)."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(1)
    v, k, n = 8, 2, 6000
    p = _random_dist(g, 1, k + 1, v, sharp=1.5)
    q = _random_dist(g, 1, k, v, sharp=1.5)
    counts = np.zeros(v)
    for i in range(n):
        # Drafts sampled from q (or arbitrary tokens when there are no draft probabilities).
        d = torch.multinomial(q[0], 1, generator=g).T if with_draft_probs else torch.randint(0, v, (1, k), generator=g)
        out = rejection_sample(p, d, q if with_draft_probs else None, seeds=torch.tensor([i]))
        counts[int(out[0, 0])] += 1
    expected = p[0, 0].double().numpy()
    expected = expected / expected.sum() * n
    stat, pvalue = chisquare(counts, expected)
    assert pvalue > 0.001, (counts, expected)


def test_two_token_joint_distribution_converges():
    """Like vLLM's convergence test: the joint law of the first two tokens approaches p0(x) * p1(y) when x is accepted."""
    g = torch.Generator().manual_seed(2)
    v, k, n = 5, 1, 20000
    p = _random_dist(g, 1, k + 1, v)
    q = _random_dist(g, 1, k, v)
    first = np.zeros(v)
    for i in range(n):
        d = torch.multinomial(q[0], 1, generator=g).T
        out = rejection_sample(p, d, q, seeds=torch.tensor([10_000 + i]))
        first[int(out[0, 0])] += 1
    tv = 0.5 * np.abs(first / n - p[0, 0].numpy()).sum()
    assert tv < 0.02


def test_greedy_rows_follow_argmax_walk():
    g = torch.Generator().manual_seed(3)
    p = _random_dist(g, 1, 4, 50)
    arg = p[0].argmax(-1)
    drafts = arg[:3].clone().reshape(1, 3)
    drafts[0, 2] = (arg[2] + 1) % 50  # third draft wrong
    out = rejection_sample(p, drafts, None, is_greedy=torch.tensor([True]))
    assert out[0].tolist() == [int(arg[0]), int(arg[1]), int(arg[2]), -1]
    out = rejection_sample(p, arg[:3].reshape(1, 3), None, is_greedy=torch.tensor([True]))
    assert out[0].tolist() == arg.tolist()  # all accepted + bonus argmax


def test_p_equals_q_accepts_all_and_no_nan():
    g = torch.Generator().manual_seed(4)
    p = _random_dist(g, 2, 4, 100)
    d = torch.stack([torch.multinomial(p[b, :3], 1, generator=g)[:, 0] for b in range(2)])
    out = rejection_sample(p, d, p[:, :3].clone(), seeds=torch.tensor([1, 2]))
    assert (out[:, :3] == d).all() and (out[:, 3] >= 0).all()


def test_placeholder_draft_is_rejected():
    p = torch.full((1, 3, 10), 0.1)
    out = rejection_sample(p, torch.tensor([[-1, 3]]), None, seeds=torch.tensor([0]))
    assert out[0, 0] >= 0 and out[0, 1:].tolist() == [-1, -1]


def test_seeded_rows_are_batch_invariant():
    g = torch.Generator().manual_seed(5)
    p = _random_dist(g, 3, 5, 30)
    q = _random_dist(g, 3, 4, 30)
    d = torch.randint(0, 30, (3, 4), generator=g)
    a = rejection_sample(p, d, q, seeds=torch.tensor([7, 8, 9]))
    b = rejection_sample(p[1:2], d[1:2], q[1:2], seeds=torch.tensor([8]))
    c = rejection_sample(p, d, q, seeds=torch.tensor([7, 8, 9]))
    assert torch.equal(a[1], b[0]) and torch.equal(a, c)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda p, d, q: (p[0], d, q), "target_probs"),
        (lambda p, d, q: (p, d.int(), q), "draft_token_ids dtype"),
        (lambda p, d, q: (p, d + 100, q), r"\[0, 10\)"),
        (lambda p, d, q: (p * float("nan"), d, q), "NaN"),
        (lambda p, d, q: (p, d, q[:, :1]), "draft_probs"),
    ],
)
def test_validation_errors(mutate, match):
    p = torch.full((1, 3, 10), 0.1)
    d = torch.tensor([[1, 2]])
    q = torch.full((1, 2, 10), 0.1)
    with pytest.raises(ValueError, match=match):
        rejection_sample(*mutate(p, d, q))
