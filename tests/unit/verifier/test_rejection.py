"""Verifier maths (torch path): the output distribution is the target's, greedy, edge cases, seeding, validation."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spec_decode.verifier import rejection_sample, typical_acceptance_sample
from tests.helpers import assert_token_law, random_dist


def _zero_where(x, idx):
    x = x.clone()
    x[..., idx] = 0.0
    return x / x.sum(-1, keepdim=True)


DRAFTS = ["from_q", "q_zero_on_target_favourites", "target_truncated", "without_probs"]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("draft", DRAFTS)
def test_output_distribution_equals_target(k, draft):
    """Chi-square at every position: given the first j tokens were accepted drafts, token j ~ target_probs[j].

    Drafts come from q (lossless only then): a generic q; a q that gives zero probability to the target's two most
    likely tokens at every position (they can only come from the residual); a target that gives zero probability to
    two tokens the draft likes (a top-k target: they must never appear); and drafts without probabilities."""
    g = torch.Generator().manual_seed(100 + k)
    v, n = 6, 12000
    p1 = random_dist(g, 1, k + 1, v, sharp=1.2)
    q1 = random_dist(g, 1, k, v, sharp=1.2)
    if draft == "q_zero_on_target_favourites":
        top2 = p1[0, :k].topk(2, -1).indices  # [k, 2]
        q1 = torch.stack([_zero_where(q1[0, i], top2[i]) for i in range(k)])[None]
    elif draft == "target_truncated":
        fav = q1[0].mean(0).topk(2).indices
        p1 = _zero_where(p1, fav)
    p = p1.expand(n, k + 1, v).contiguous()
    q = q1.expand(n, k, v).contiguous()
    if draft != "without_probs":  # drafts sampled from q
        d = torch.multinomial(q.reshape(-1, v), 1, replacement=True, generator=g).reshape(n, k)
    else:  # any proposal: skewed towards token 0
        d = torch.where(torch.rand(n, k, generator=g) < 0.6, 0, torch.randint(0, v, (n, k), generator=g))
    out = rejection_sample(p, d, None if draft == "without_probs" else q, seeds=torch.arange(n))
    for j in range(k + 1):
        col = out[:, j][out[:, j] >= 0].numpy()
        if len(col) >= 500:
            assert_token_law(col, p1[0, j].double().numpy(), v, (draft, j))


@pytest.mark.parametrize("p_zero_at_draft", [False, True])
def test_a_draft_with_zero_draft_probability_is_recovered_from_the_residual_law(p_zero_at_draft):
    """q(x) = 0: always rejected; the emitted token ~ normalize(max(0, p - q)), which keeps p(x) at x (vLLM)."""
    g = torch.Generator().manual_seed(31 + p_zero_at_draft)
    v, n, x = 7, 12000, 2
    p1 = random_dist(g, 1, 2, v, sharp=1.5)
    if p_zero_at_draft:
        p1 = _zero_where(p1, [x])
    q1 = _zero_where(random_dist(g, 1, 1, v, sharp=1.5), [x])
    out = rejection_sample(p1.expand(n, -1, -1).contiguous(), torch.full((n, 1), x), q1.expand(n, -1, -1).contiguous(),
                           seeds=torch.arange(n) + 50000)
    assert (out[:, 1] == -1).all()  # never accepted
    residual = (p1[0, 0] - q1[0, 0]).clamp_min(0).double().numpy()
    assert_token_law(out[:, 0].numpy(), residual, v, "residual")


def test_convergence_to_target_like_vllm():
    """TV distance between the empirical first-token law and the target shrinks as samples grow (vLLM's test)."""
    g = torch.Generator().manual_seed(7)
    v, k = 10, 2
    p1, q1 = random_dist(g, 1, k + 1, v, sharp=2.0), random_dist(g, 1, k, v, sharp=2.0)
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
    p = random_dist(g, 2, 4, v, sharp=3.0)
    arg = p.argmax(-1)  # [2, 4]
    drafts = arg[:, :3].clone()
    drafts[0, 2] = (arg[0, 2] + 1) % v  # row 0: third draft wrong
    out = rejection_sample(p, drafts, None, is_greedy=torch.tensor([True, True]))
    assert out[0].tolist() == [int(arg[0, 0]), int(arg[0, 1]), int(arg[0, 2]), -1]
    assert out[1].tolist() == arg[1].tolist()  # all accepted + bonus argmax


@pytest.mark.parametrize("v", [100, 8193, 49152, 151936])
def test_p_equals_q_accepts_all_and_gives_no_nan(v):
    g = torch.Generator().manual_seed(4)
    p = random_dist(g, 2, 4, v)
    d = torch.stack([torch.multinomial(p[b, :3], 1, generator=g)[:, 0] for b in range(2)])
    out = rejection_sample(p, d, p[:, :3].clone(), seeds=torch.tensor([1, 2]))
    assert (out[:, :3] == d).all() and ((out[:, 3] >= 0) & (out[:, 3] < v)).all()


def test_placeholder_draft_is_rejected_without_indexing():
    p = torch.full((1, 3, 10), 0.1)
    out = rejection_sample(p, torch.tensor([[-1, 3]]), None, seeds=torch.tensor([0]))
    assert 0 <= out[0, 0] < 10 and out[0, 1:].tolist() == [-1, -1]


def test_seeded_rows_are_reproducible_and_batch_invariant_with_unseeded_rows():
    g = torch.Generator().manual_seed(5)
    p, q = random_dist(g, 3, 5, 30), random_dist(g, 3, 4, 30)
    d = torch.randint(0, 30, (3, 4), generator=g)
    a = rejection_sample(p, d, q, seeds=torch.tensor([7, -1, 9]))
    b = rejection_sample(p[2:3], d[2:3], q[2:3], seeds=torch.tensor([9]))
    c = rejection_sample(p, d, q, seeds=torch.tensor([7, 8, 9]))
    assert torch.equal(a[2], b[0]) and torch.equal(a[0], c[0])


def test_half_precision_inputs_are_accepted():
    g = torch.Generator().manual_seed(6)
    p = random_dist(g, 2, 3, 50)
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
    p = random_dist(g, 3, 5, 64)
    d = torch.randint(0, 64, (3, 4), generator=g)
    out = typical_acceptance_sample(p, d, posterior_threshold=0.0, posterior_alpha=0.0)
    assert torch.equal(out[:, :4], d)
    with pytest.raises(ValueError, match="posterior"):
        typical_acceptance_sample(p, d, posterior_threshold=-1.0)


def test_real_model_truncated_distributions_keep_the_target_law_and_never_emit_outside_its_support(
        real_model, real_tokenizer):
    """The embedded target's own next-token distributions at a HumanEval prompt, with the request's top-k (many zeros)
    and a draft q of a different truncation that gives zero probability to the target's most likely token: drafts
    from q leave the first token's law equal to p (chi-square on p's support, nothing outside it); a draft of a token
    q gives zero (but p does not) is never accepted, on both paths."""
    from client.datasets import humaneval_prompts
    from spec_decode.sampling import SamplingParams, logits_to_probs

    ids = real_tokenizer(humaneval_prompts(1)[0])["input_ids"]
    with torch.inference_mode():
        logits = real_model(torch.tensor([ids])).logits[0, -2:].float()  # [2, V]: two positions -> k = 1
    p1 = logits_to_probs(logits, SamplingParams(0.9, 6, 1.0))[None]  # [1, 2, V]: six tokens per position
    q1 = logits_to_probs(logits[:1] * 0.5, SamplingParams(1.0, 30, 1.0))  # [1, V]: 30 tokens, flatter
    q1[0, p1[0, 0].argmax()] = 0.0
    q1 = (q1 / q1.sum(-1, keepdim=True))[None]  # [1, 1, V]
    v = p1.shape[-1]
    support = torch.nonzero(p1[0, 0] > 0)[:, 0]
    counts = torch.zeros(v, dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    n, chunk = 6000, 1500
    for start in range(0, n, chunk):  # chunks keep [chunk, V] temporaries small
        d = torch.multinomial(q1[0], chunk, replacement=True, generator=g).reshape(chunk, 1)
        out = rejection_sample(p1.expand(chunk, -1, -1), d, q1.expand(chunk, -1, -1),
                               seeds=torch.arange(start, start + chunk))
        counts += torch.bincount(out[:, 0], minlength=v)
    assert counts.sum() == n and counts[p1[0, 0] == 0].sum() == 0
    expected = p1[0, 0, support].double().numpy()
    stat, pvalue = chisquare(counts[support].numpy(), expected / expected.sum() * n)
    assert pvalue > 1e-3, (counts[support], expected)

    x = int(p1[0, 0].argmax())  # q(x) = 0 < p(x)
    for backend in ("torch", "triton"):
        rows = 32 if backend == "triton" else 1000  # the interpreter takes ~0.2 s per row at this V
        out = rejection_sample(p1.expand(rows, -1, -1).contiguous(), torch.full((rows, 1), x),
                               q1.expand(rows, -1, -1).contiguous(), seeds=torch.arange(rows), backend=backend)
        assert (out[:, 1] == -1).all(), backend  # never accepted
        assert bool((p1[0, 0][out[:, 0]] > 0).all()), backend  # recovered inside p's support
