"""The coupled race of seeded sampled rows (Daliri et al. 2024, "Drafter-invariant speculative decoding"): its output
follows the target's law whatever the drafts, and a seed's tokens do not depend on k, the drafts or the batch."""

import numpy as np
import pytest
import torch

from spec_decode.proposers import ProposalRequest
from spec_decode.proposers.base import draft_token
from spec_decode.sampling import NoisePurpose, SamplingParams, coupled_exponentials, coupled_seed, race
from spec_decode.verifier import Verifier, VerifierRow, VerifierSettings
from spec_decode.verifier.rejection import _torch_noise, coupled_sample
from tests.helpers import assert_token_law, random_dist


def _coupled_drafts(p, seeds, positions):
    """Drafts raced with the target's own coupled noise (what a self-draft proposes): [B, k]."""
    b, k1, v = p.shape
    return torch.tensor([[race(p[r, i], coupled_exponentials(int(seeds[r]), int(positions[r]) + i, v))
                          for i in range(k1 - 1)] for r in range(b)], dtype=torch.int64)


DRAFTS = ["from_q", "target_truncated", "without_probs", "coupled_self_draft"]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("draft", DRAFTS)
def test_output_distribution_equals_target(k, draft):
    """Chi-square at every position (torch path): given the first j tokens were accepted drafts, token j ~ p_j, for
    drafts from another q, a target that forbids the draft's favourites, drafts without probabilities, and drafts
    raced with the target's own noise (then all are accepted)."""
    g = torch.Generator().manual_seed(200 + k)
    v, n = 6, 8000
    p1 = random_dist(g, 1, k + 1, v, sharp=1.2)
    q1 = random_dist(g, 1, k, v, sharp=1.2)
    if draft == "target_truncated":
        fav = q1[0].mean(0).topk(2).indices
        p1[..., fav] = 0.0
        p1 = p1 / p1.sum(-1, keepdim=True)
    p = p1.expand(n, k + 1, v).contiguous()
    seeds, positions = torch.arange(n) * 31 + 7, torch.arange(n) % 50
    if draft == "without_probs":  # any proposal: skewed towards token 0
        d = torch.where(torch.rand(n, k, generator=g) < 0.6, 0, torch.randint(0, v, (n, k), generator=g))
    elif draft == "coupled_self_draft":
        d = _coupled_drafts(p, seeds, positions)
    else:
        d = torch.multinomial(q1.expand(n, k, v).reshape(-1, v), 1, replacement=True, generator=g).reshape(n, k)
    out = coupled_sample(p, d, seeds=seeds, positions=positions, backend="torch")
    if draft == "coupled_self_draft":
        assert torch.equal(out[:, :k], d)  # every draft accepted
    for j in range(k + 1):
        col = out[:, j][out[:, j] >= 0].numpy()
        if len(col) >= 500:
            assert_token_law(col, p1[0, j].double().numpy(), v, (draft, j))


def test_kernel_output_distribution_equals_target_with_philox_noise():
    """The same chi-square on the Triton path (in-kernel Philox noise, under TRITON_INTERPRET=1 in the tests)."""
    g = torch.Generator().manual_seed(23)
    v, k, n = 5, 1, 400  # the interpreter runs ~25 ms per program: keep n small
    p1 = random_dist(g, 1, k + 1, v, sharp=1.2)
    q1 = random_dist(g, 1, k, v, sharp=1.2)
    p = p1.expand(n, k + 1, v).contiguous()
    d = torch.multinomial(q1.expand(n, k, v).reshape(-1, v), 1, replacement=True, generator=g).reshape(n, k)
    out = coupled_sample(p, d, seeds=torch.arange(n) * 7919, positions=torch.full((n,), 3), backend="triton")
    for j in range(k + 1):
        col = out[:, j][out[:, j] >= 0].numpy()
        if len(col) >= 200:
            assert_token_law(col, p1[0, j].double().numpy(), v, j)


def _reference(p, seed, position, backend):
    """The target's token at each position of p [K+1, V] raced alone (k = 0 rows): [K+1] ints."""
    none = torch.empty((1, 0), dtype=torch.int64)
    return [int(coupled_sample(p[i : i + 1][None], none, seeds=torch.tensor([seed]),
                               positions=torch.tensor([position + i]), backend=backend)[0, 0])
            for i in range(p.shape[0])]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_seed_s_tokens_do_not_depend_on_k_the_drafts_or_the_batch(backend):
    """Outputs are always the prefix of the target's own tokens t_pos, t_pos+1, ...: with k = 0..4, random drafts, the
    target's own tokens as drafts, and rows batched with others (other seeds, k, greedy, unseeded and typical rows)."""
    g = torch.Generator().manual_seed(5)
    v, kmax, seed, position = 37, 4, 1234, 17
    p = random_dist(g, kmax + 1, v, sharp=2.0)
    t = _reference(p, seed, position, backend)
    ver = Verifier(VerifierSettings(backend=backend))
    cases = []
    for k in range(kmax + 1):
        cases.append(torch.randint(0, v, (k,), generator=g))  # random drafts
        cases.append(torch.tensor(t[:k], dtype=torch.int64))  # the target's own tokens: all accepted
        if k >= 2:
            cases.append(torch.tensor(t[:1] + [(t[1] + 1) % v] + t[2:k], dtype=torch.int64))  # a mismatch at 1
    others = []
    for i in range(6):
        ko = i % 3 + 1
        others.append(VerifierRow(random_dist(g, ko + 1, v), torch.randint(0, v, (ko,), generator=g),
                                  random_dist(g, ko, v) if i % 2 else None, 50 + i, i, i == 3,
                                  "typical" if i == 4 else "", 9 + i, i != 5))
    for drafts in cases:
        k = len(drafts)
        dp = random_dist(g, k, v)  # ignored by the coupled race
        row = VerifierRow(p[: k + 1], drafts, dp, seed, step=k * 3 + 1, greedy=False, position=position, seeded=True)
        alone, _ = ver.verify_batch([row])[0]
        n = len(alone) - 1
        assert alone == t[: n + 1], (k, drafts.tolist())
        assert drafts[:n].tolist() == t[:n] and (n == k or int(drafts[n]) != t[n])
        batched, _ = ver.verify_batch(others[:3] + [row] + others[3:])[3]
        assert batched == alone


def test_only_seeded_sampled_rejection_rows_are_coupled():
    """Greedy rows, typical acceptance and unseeded rows keep their paths: seeded or not, they give the same tokens."""
    g = torch.Generator().manual_seed(8)
    v, k = 29, 3
    p = random_dist(g, k + 1, v, sharp=2.0)
    drafts = p[:k].argmax(-1)
    ver = Verifier(VerifierSettings(backend="torch"))
    for greedy, method in ((True, ""), (True, "rejection"), (False, "typical")):
        a = ver.verify(p, drafts, None, 3, 4, greedy, method, position=10, seeded=True)
        b = ver.verify(p, drafts, None, 3, 4, greedy, method, position=10, seeded=False)
        assert a == b, (greedy, method)
    row = VerifierRow(p, drafts, None, 3, 4, False, "", 10, True)
    assert ver.is_coupled(row) and not Verifier(VerifierSettings(acceptance_method="typical")).is_coupled(row)


def test_the_drafts_noise_is_the_torch_verifier_s_noise():
    """coupled_exponentials(seed, position, V) is the race noise of a k = 0 row with seed coupled_seed(seed, position);
    a seeded sampled draft over a pruned vocabulary (columns = target ids) races that noise gathered at its ids."""
    v, seed, position = 50, 99, 12
    _, e = _torch_noise(torch.tensor([coupled_seed(seed, position)]), torch.tensor([False]),
                        torch.empty((1, 0), dtype=torch.int64), v)
    assert torch.equal(e[0], coupled_exponentials(seed, position, v))
    g = torch.Generator().manual_seed(1)
    cols = torch.tensor([3, 7, 11, 20, 41, 49])
    logits = torch.randn(len(cols), generator=g)
    req = ProposalRequest(1, list(range(position)), 2, SamplingParams(temperature=0.9, seed=seed), 5)
    tok, probs = draft_token(logits, req, NoisePurpose.DRAFT_LM, 0, [], cols, None, v)
    full = torch.zeros(v)
    full[cols] = probs
    assert int(cols[tok]) == race(full, coupled_exponentials(seed, position, v))
    # an unseeded request keeps its (seed, step, purpose, slot) noise, and greedy its argmax
    unseeded = ProposalRequest(1, list(range(position)), 2, SamplingParams(temperature=0.9, seed=seed, seeded=False), 5)
    assert not unseeded.coupled and req.coupled and req.position(3) == position + 3


def test_invalid_seeds_or_positions_are_refused():
    p = torch.full((2, 2, 4), 0.25)
    d = torch.zeros((2, 1), dtype=torch.int64)
    with pytest.raises(ValueError, match="positions"):
        coupled_sample(p, d, seeds=torch.tensor([1, 2]), positions=torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="seeds"):
        coupled_sample(p, d, seeds=torch.tensor([1]), positions=torch.tensor([0, 1]))


def test_the_verifier_model_reads_each_row_s_position_and_seededness():
    """verifier_model: the position is the number of committed ids without the -1 padding; a row without token_ids
    (a direct caller) or with seeded = false is not coupled; seeded absent counts as true (score_step's rounds)."""
    from spec_decode.serving.verifier_model import VerifierBackend

    base = {"target_probs": np.full((2, 5), 0.2, np.float32), "draft_token_ids": np.array([1, -1], np.int64),
            "temperature": np.array([0.8], np.float32), "random_seed": np.array([4]), "step": np.array([2])}
    row = VerifierBackend._row(dict(base, token_ids=np.array([3, 4, 5, -1, -1], np.int64)))
    assert (row.position, row.seeded, row.k) == (3, True, 1)
    assert not VerifierBackend._row(base).seeded
    assert not VerifierBackend._row(dict(base, token_ids=np.array([3]), seeded=np.array([False]))).seeded
    ver = VerifierBackend({"backend": "torch", "num_threads": "0"})
    a = ver.run(dict(base, token_ids=np.array([3, 4, 5, -1], np.int64)))["output_ids"].tolist()
    b = ver.run(dict(base, token_ids=np.array([3, 4, 5], np.int64), step=np.array([9]),
                     draft_token_ids=np.zeros(0, np.int64), target_probs=base["target_probs"][:1]))["output_ids"]
    assert a[0] == b[0]  # the race at position 3, whatever the draft and the step
