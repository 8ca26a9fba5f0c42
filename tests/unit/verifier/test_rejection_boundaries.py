"""The verifier at its boundaries, on both paths: the torch maths and the Triton kernels (under TRITON_INTERPRET=1).

Each case feeds explicit noise (accept uniforms u [B, k], race exponentials E [B, V]) and asserts the exact output,
the same on both paths; the rules are the ones listed in ``rejection_sample``'s docstring.
"""

import pytest
import torch

from spec_decode.verifier import rejection_sample, typical_acceptance_sample
from spec_decode.verifier.kernels import rejection_triton, typical_triton
from spec_decode.verifier.torch_impl import rejection_torch, typical_torch

BACKENDS = ["torch", "triton"]
U_MAX = 1.0 - 2.0**-24  # the largest float32 below 1: the largest accept uniform either path can draw


def _noise(b, k, v, u, e):
    u = torch.zeros(b, k) if u is None else torch.as_tensor(u, dtype=torch.float32).reshape(b, k)
    e = torch.ones(b, v) if e is None else torch.as_tensor(e, dtype=torch.float32).reshape(b, v)
    return u, e


def reject(backend, tp, ids, dp=None, u=None, e=None, greedy=None):
    """Rejection sampling on one path with explicit noise (u defaults to 0, E to 1)."""
    b, k1, v = tp.shape
    u, e = _noise(b, k1 - 1, v, u, e)
    greedy = torch.zeros(b, dtype=torch.bool) if greedy is None else torch.as_tensor(greedy)
    if backend == "torch":
        return rejection_torch(tp, ids, dp, u, e, greedy)
    return rejection_triton(tp, ids, dp, torch.arange(b), greedy, noise=(u, e))


def typical(backend, tp, ids, eps=0.09, alpha=0.3, e=None, greedy=None):
    """Typical acceptance on one path with explicit race noise (E defaults to 1)."""
    b, k1, v = tp.shape
    _, e = _noise(b, k1 - 1, v, None, e)
    greedy = torch.zeros(b, dtype=torch.bool) if greedy is None else torch.as_tensor(greedy)
    if backend == "torch":
        return typical_torch(tp, ids, eps, alpha, e, greedy)
    return typical_triton(tp, ids, eps, alpha, torch.arange(b), greedy, e)


def _uniform(b, k1, v):
    return torch.full((b, k1, v), 1.0 / v)


def _ids(*rows):
    return torch.tensor(rows, dtype=torch.int64)


# --- the reported case: a draft token with zero target and zero draft probability ----------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_target_and_zero_draft_probability_is_never_accepted_nor_emitted(backend):
    """Issue 13's case: V = 16, k = 2, p(3) = q(3) = 0 at position 0, drafts [3, 7]: 200 seeded runs, never 3."""
    v, k, n = 16, 2, 200
    g = torch.Generator().manual_seed(13)
    tp = torch.full((1, k + 1, v), 1.0 / (v - 1))
    tp[0, 0, 3] = 0.0
    dp = torch.softmax(torch.randn(1, k, v, generator=g), -1)
    dp[0, 0, 3] = 0.0
    dp = dp / dp.sum(-1, keepdim=True)
    out = rejection_sample(tp.expand(n, -1, -1).contiguous(), _ids([3, 7]).expand(n, -1).contiguous(),
                           dp.expand(n, -1, -1).contiguous(), seeds=torch.arange(n), backend=backend)
    assert (out[:, 0] != 3).all() and (out[:, 0] >= 0).all()
    assert (out[:, 1:] == -1).all()  # rejected at position 0 in every run: one recovered token, then padding


# --- the accept test ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_target_probability_is_rejected_even_at_u_zero(backend):
    tp, dp = _uniform(1, 2, 8), _uniform(1, 1, 8)
    tp[0, 0, 5] = 0.0
    tp[0, 0, 2] = 2.0 / 8  # the largest residual: the recovered token with E = 1
    out = reject(backend, tp, _ids([5]), dp, u=[0.0])
    assert out.tolist() == [[2, -1]]
    out = reject(backend, tp, _ids([5]), None, u=[0.0])  # without draft probabilities too
    assert out.tolist() == [[2, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_u_zero_accepts_any_positive_target_probability(backend):
    tp, dp = _uniform(1, 2, 8), _uniform(1, 1, 8)
    tp[0, 0, 5] = 1e-30
    assert reject(backend, tp, _ids([5]), dp, u=[0.0]).tolist() == [[5, 0]]
    assert reject(backend, tp, _ids([5]), None, u=[0.0]).tolist() == [[5, 0]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_draft_probability_is_rejected_and_recovered_from_the_residual(backend):
    """q(x) = 0 < p(x): rejected (vLLM's rule); the residual max(0, p - q) keeps p(x), so x can be recovered."""
    tp, dp = _uniform(1, 2, 8), _uniform(1, 1, 8)
    tp[0, 0] = torch.tensor([0.05, 0.05, 0.05, 0.05, 0.5, 0.1, 0.1, 0.1])
    dp[0, 0] = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.0, 0.1, 0.05, 0.05])
    for u in (0.0, 0.5, U_MAX):
        assert reject(backend, tp, _ids([4]), dp, u=[u]).tolist() == [[4, -1]]  # recovered, not accepted
    e = torch.ones(8)
    e[4] = 100.0  # 4's race score 0.5 / 100 loses to 6 and 7 (0.05): the lowest index of the tie wins
    assert reject(backend, tp, _ids([4]), dp, e=e).tolist() == [[6, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equal_probabilities_accept_at_the_largest_uniform(backend, dtype):
    """p == q (the same stored values, any dtype): every draft accepted, even at u = 1 - 2^-24."""
    g = torch.Generator().manual_seed(1)
    k, v = 3, 50
    tp = torch.softmax(torch.randn(2, k + 1, v, generator=g) * 2, -1).to(dtype)
    ids = torch.randint(0, v, (2, k), generator=g)
    out = reject(backend, tp, ids, tp[:, :k].clone(), u=torch.full((2, k), U_MAX))
    assert torch.equal(out[:, :k], ids)
    assert torch.equal(out[:, k], tp[:, k].float().argmax(-1))  # E = 1: the bonus race is the argmax


@pytest.mark.parametrize("backend", BACKENDS)
def test_uniform_near_one_against_a_ratio_just_below_one(backend):
    """p/q = 1 - 2^-24 exactly: u = 1 - 2^-24 rejects (strict), u = 1 - 2^-23 accepts; p >= q always accepts."""
    tp, dp = _uniform(1, 2, 4), _uniform(1, 1, 4)
    dp[0, 0] = torch.tensor([0.5, 0.5, 0.0, 0.0])
    tp[0, 0] = torch.tensor([0.5 - 2.0**-25, 0.5 + 2.0**-24, 0.0, 0.0])  # exact in float32
    assert reject(backend, tp, _ids([0]), dp, u=[U_MAX]).tolist() == [[1, -1]]  # residual only at token 1
    assert reject(backend, tp, _ids([0]), dp, u=[1.0 - 2.0**-23]).tolist() == [[0, 0]]
    assert reject(backend, tp, _ids([1]), dp, u=[U_MAX]).tolist() == [[1, 0]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_draft_probabilities_the_target_probability_is_the_acceptance_probability(backend):
    tp = _uniform(1, 2, 4)
    tp[0, 0] = torch.tensor([0.25, 0.75, 0.0, 0.0])
    assert reject(backend, tp, _ids([1]), None, u=[0.7499]).tolist() == [[1, 0]]
    assert reject(backend, tp, _ids([1]), None, u=[0.75]).tolist() == [[0, -1]]  # strict; recovered from p without 1
    tp[0, 0] = torch.tensor([0.0, 1.0, 0.0, 0.0])
    assert reject(backend, tp, _ids([1]), None, u=[U_MAX]).tolist() == [[1, 0]]


# --- the recovered and bonus draws ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_zero_residual_falls_back_to_the_target(backend):
    """The rejection had probability 0 (p <= q everywhere): the token is drawn from p, never NaN or a p = 0 token."""
    tp = torch.zeros(1, 2, 4)
    tp[0, 0] = torch.tensor([0.0, 1.0 - 2.0**-24, 0.0, 0.0])  # p(1) rounds just below 1, the rest 0
    tp[0, 1] = 0.25
    assert reject(backend, tp, _ids([1]), None, u=[U_MAX]).tolist() == [[1, -1]]  # rejected, then drawn from p: 1
    p = torch.tensor([0.0, 0.3, 0.5, 0.2])
    tp[0, 0] = p
    dp = p.reshape(1, 1, 4).clone()  # p == q, and the draft is 0, which both give probability 0
    e = torch.tensor([1.0, 0.5, 2.0, 1.0])  # race scores 0.6, 0.25, 0.2: token 1
    assert reject(backend, tp, _ids([0]), dp, e=e).tolist() == [[1, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_probability_tokens_never_win_the_race_even_when_every_score_underflows(backend):
    tp = torch.zeros(1, 1, 6)
    tp[0, 0, 3:] = 1e-38  # tokens 0..2 have p = 0; every p / E underflows to 0 with E = 1e30
    e = torch.full((6,), 1e30)
    assert reject(backend, tp, _ids([]).reshape(1, 0), None, e=e).tolist() == [[3]]
    assert typical(backend, tp, _ids([]).reshape(1, 0), e=e).tolist() == [[3]]
    tp2 = torch.zeros(1, 2, 6)
    tp2[0, 0, 3:] = 1e-38
    tp2[0, 1] = 1.0 / 6
    dp = torch.zeros(1, 1, 6)
    dp[0, 0, 0] = 1.0  # residual max(0, p - q): zero at 0..2
    assert reject(backend, tp2, _ids([0]), dp, e=e).tolist() == [[3, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_hot_target_gives_its_token_whatever_the_draft_and_the_noise(backend):
    v, t = 8, 5
    tp = torch.zeros(1, 2, v)
    tp[0, :, t] = 1.0
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        u = torch.rand(1, 1, generator=g)
        e = torch.empty(1, v).exponential_(generator=g)
        q_spread = torch.softmax(torch.randn(1, 1, v, generator=g), -1)
        q_no_t = q_spread.clone()
        q_no_t[0, 0, t] = 0.0
        q_one_hot = torch.zeros(1, 1, v)
        q_one_hot[0, 0, t] = 1.0
        assert reject(backend, tp, _ids([t]), q_spread, u=u, e=e).tolist() == [[t, t]]  # accepted, bonus t
        assert reject(backend, tp, _ids([t]), q_no_t, u=u, e=e).tolist() == [[t, -1]]  # q(t) = 0: recovered t
        assert reject(backend, tp, _ids([2]), q_spread, u=u, e=e).tolist() == [[t, -1]]
        assert reject(backend, tp, _ids([2]), q_one_hot, u=u, e=e).tolist() == [[t, -1]]  # empty residual -> p
        assert reject(backend, tp, _ids([2]), None, u=u, e=e).tolist() == [[t, -1]]
        assert reject(backend, tp, _ids([t]), None, u=u, e=e).tolist() == [[t, t]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_placeholder_ends_the_drafts_and_gets_a_bonus_token_from_the_target(backend):
    """A -1 at position n: no draft there, so the token at n is drawn from p_n, not from max(0, p_n - q_n)."""
    tp = _uniform(1, 3, 4)
    tp[0, 0] = torch.tensor([0.1, 0.6, 0.2, 0.1])
    dp = torch.zeros(1, 2, 4)
    dp[0, 0] = torch.tensor([0.0, 0.7, 0.3, 0.0])  # padding values: the residual would favour token 0 or 3
    assert reject(backend, tp, _ids([-1, 2]), dp).tolist() == [[1, -1, -1]]
    assert reject(backend, tp, _ids([-1, 2]), None).tolist() == [[1, -1, -1]]
    e = torch.tensor([1.0, 10.0, 1.0, 1.0])  # the race: 0.1, 0.06, 0.2, 0.1 -> token 2
    assert typical(backend, tp, _ids([-1, 2]), e=e).tolist() == [[2, -1, -1]]  # a draw, not the argmax


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_rows_accept_the_argmax_with_ties_to_the_lowest_index(backend):
    tp = torch.zeros(2, 3, 6)
    tp[:, 0] = torch.tensor([0.1, 0.3, 0.3, 0.1, 0.1, 0.1])  # tie between 1 and 2: 1 is the argmax
    tp[:, 1] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    tp[:, 2] = torch.tensor([0.5, 0.0, 0.0, 0.0, 0.5, 0.0])
    greedy = torch.tensor([True, True])
    out = reject(backend, tp, _ids([1, 5], [2, 5]), None, u=torch.full((2, 2), U_MAX), greedy=greedy)
    assert out.tolist() == [[1, 5, 0], [1, -1, -1]]
    out = typical(backend, tp, _ids([1, 5], [2, 5]), greedy=greedy)
    assert out.tolist() == [[1, 5, 0], [1, -1, -1]]


# --- half precision -------------------------------------------------------------------------------------------------


def _bf16_case():
    v = 4
    tp = torch.zeros(1, 2, v)
    dp = torch.zeros(1, 1, v)
    tp[0, 1] = 0.25
    # p(0) = 2^-130 and q(0) = 2^-129 are bfloat16 subnormals (exact): p/q = 1/2; 1e-42 underflows to 0 in bfloat16
    tp[0, 0] = torch.tensor([2.0**-130, 0.5, 0.5, 1e-42])
    dp[0, 0] = torch.tensor([2.0**-129, 1e-42, 0.5, 0.5])
    tp, dp = tp.bfloat16(), dp.bfloat16()
    assert float(tp[0, 0, 3]) == 0.0 and float(dp[0, 0, 1]) == 0.0 and float(tp[0, 0, 0]) > 0.0
    return tp, dp


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_underflow_is_a_zero_probability(backend):
    tp, dp = _bf16_case()
    assert reject(backend, tp, _ids([3]), dp, u=[0.0]).tolist() == [[1, -1]]  # p underflowed to 0: never accepted
    assert reject(backend, tp, _ids([1]), dp, u=[0.0]).tolist() == [[1, -1]]  # q underflowed to 0: rejected, p(1) kept
    assert reject(backend, tp, _ids([2]), dp, u=[U_MAX]).tolist() == [[2, 0]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_subnormals_stay_positive(backend):
    """The kernels widen bfloat16 by its bit pattern (exact, as GPUs do; Triton 3.7's interpreter would flush
    subnormals to 0 in a plain .to(float32)), so subnormal probabilities keep their values on both paths."""
    tp, dp = _bf16_case()
    assert reject(backend, tp, _ids([0]), dp, u=[0.25]).tolist() == [[0, 0]]  # 0.25 * q < p: accepted
    assert reject(backend, tp, _ids([0]), dp, u=[0.5]).tolist() == [[1, -1]]  # 0.5 * q == p: rejected (strict)
    same = torch.tensor([[[2.0**-130, 0, 0, 0]]]).bfloat16()
    tp[0, 0] = same[0, 0]
    assert reject(backend, tp, _ids([0]), same, u=[U_MAX]).tolist() == [[0, 0]]  # p == q subnormal: accepted
    tp[0, 0, 2] = -(2.0**-133)  # the smallest negative bfloat16 subnormal is still a negative probability
    _both_raise(lambda b: reject(b, tp, _ids([2]), same, u=[0.0]), "target_probs contains NaN, infinite or negative")


# --- typical acceptance ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_typical_zero_probability_is_never_accepted_even_with_zero_thresholds(backend):
    tp = _uniform(1, 2, 8)
    tp[0, 0] = torch.tensor([0.0, 1e-30, 0.3, 0.2, 0.2, 0.1, 0.1, 0.1 - 1e-30])
    assert typical(backend, tp, _ids([0]), eps=0.0, alpha=0.0).tolist() == [[2, -1]]  # argmax at the rejection
    assert typical(backend, tp, _ids([1]), eps=0.0, alpha=0.0).tolist() == [[1, 0]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_typical_one_hot_target_has_zero_entropy(backend):
    """H = 0: threshold min(eps, alpha). Drafted t is accepted below 1 and replaced by the argmax (t) above."""
    tp = torch.zeros(1, 2, 8)
    tp[0, :, 6] = 1.0
    assert typical(backend, tp, _ids([6]), eps=0.09, alpha=0.3).tolist() == [[6, 6]]
    assert typical(backend, tp, _ids([6]), eps=1.5, alpha=2.0).tolist() == [[6, -1]]
    assert typical(backend, tp, _ids([3]), eps=0.0, alpha=0.0).tolist() == [[6, -1]]


@pytest.mark.parametrize("n", list(range(2, 65)))
def test_typical_decides_ties_with_the_threshold_alike_on_both_paths(n):
    """A target uniform over n tokens with alpha = 1: threshold alpha * exp(-H) = 1/n, and p(x) is 1/n rounded to
    float32. Both paths decide alike; an exact tie (n a power of two, 1/n exact) is rejected (then the argmax, 0);
    alpha 1e-6 below or above 1 accepts or rejects every n."""
    tp = torch.zeros(1, 2, 80)
    tp[0, :, :n] = 1.0 / n
    at_one = [typical(b, tp, _ids([0]), eps=1.0, alpha=1.0).tolist() for b in BACKENDS]
    assert at_one[0] == at_one[1]
    if n & (n - 1) == 0:
        assert at_one[0] == [[0, -1]]
    for backend in BACKENDS:
        assert typical(backend, tp, _ids([0]), eps=1.0, alpha=1.0 - 1e-6).tolist() == [[0, 0]]
        assert typical(backend, tp, _ids([0]), eps=1.0, alpha=1.0 + 1e-6).tolist() == [[0, -1]]


def test_typical_paths_agree_when_alpha_puts_the_threshold_on_the_draft_probability():
    """alpha = p(x) * exp(H) (float64, then float32): the threshold lands within float32 rounding of p(x), where the
    two paths' float32 entropies (different summation orders) would disagree; both decide in float64 there."""
    g = torch.Generator().manual_seed(17)
    decisions = []
    for case in range(40):
        v = int(torch.randint(5, 3000, (1,), generator=g))
        tp = torch.softmax(torch.randn(1, 2, v, generator=g) * 2, -1)
        x = int(torch.randint(0, v, (1,), generator=g))
        p64 = tp[0, 0].double()
        alpha = float(p64[x] * torch.exp(-(p64 * torch.log(p64)).sum()))
        outs = [typical(b, tp, _ids([x]), eps=1.0, alpha=alpha).tolist() for b in BACKENDS]
        assert outs[0] == outs[1], (case, v, x, alpha, outs)
        decisions.append(outs[0][0][1] >= 0)
    assert 0 < sum(decisions) < len(decisions)  # the cases fall on both sides


# --- invalid values: the kernels flag what they read, the caller raises the torch path's error ---------------------


def _both_raise(fn, match):
    messages = []
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=match) as info:
            fn(backend)
        messages.append(str(info.value))
    assert messages[0] == messages[1], messages


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's numpy meeting inf/NaN inputs
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -0.25])
@pytest.mark.parametrize("where", ["draft token", "recovered row", "bonus row"])
def test_invalid_target_values_raise_the_same_error_on_both_paths(value, where):
    tp, dp = _uniform(3, 3, 8), _uniform(3, 2, 8)
    ids = _ids([1, 2], [1, 2], [1, 2])
    dp[1, 0] = 0.0  # row 1 rejects at 0 (q = 0): the kernel reads all of row 1's position 0
    if where == "draft token":
        tp[2, 0, 1] = value
    elif where == "recovered row":
        tp[1, 0, 6] = value
    else:
        tp[2, 2, 7] = value  # row 2 accepts both drafts (u = 0) and draws its bonus from position 2
    row = 1 if where == "recovered row" else 2
    _both_raise(lambda b: reject(b, tp, ids, dp), rf"target_probs contains NaN, infinite or negative .*rows \[{row}\]")
    _both_raise(lambda b: typical(b, tp, ids, eps=0.0, alpha=0.0), rf"target_probs contains NaN.*rows \[{row}\]")


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1e-3])
@pytest.mark.parametrize("where", ["draft token", "recovered row"])
def test_invalid_draft_values_raise_the_same_error_on_both_paths(value, where):
    tp, dp = _uniform(2, 3, 8), _uniform(2, 2, 8)
    ids = _ids([1, 2], [1, 2])
    if where == "draft token":
        dp[0, 1, 2] = value
    else:
        tp[0, 0, 1] = 0.0  # row 0 rejects at 0: the kernel reads all of q at position 0
        dp[0, 0, 5] = value
    _both_raise(lambda b: reject(b, tp, ids, dp), r"draft_probs contains NaN, infinite or negative .*rows \[0\]")


def test_nan_in_a_greedy_row_is_an_error_not_a_token():
    tp = _uniform(1, 2, 8)
    tp[0, 0, 4] = float("nan")
    _both_raise(lambda b: reject(b, tp, _ids([0]), None, greedy=[True]), "target_probs contains NaN")
    _both_raise(lambda b: typical(b, tp, _ids([0]), greedy=[True]), "target_probs contains NaN")


def test_a_sampled_target_row_that_sums_to_zero_is_an_error():
    tp = _uniform(2, 3, 8)
    tp[1, 0] = 0.0  # row 1 rejects at 0 and must sample from an empty row
    ids = _ids([1, 2], [1, 2])
    _both_raise(lambda b: reject(b, tp, ids, None), r"sums to zero .*rows \[1\]")
    _both_raise(lambda b: reject(b, tp, ids, None, greedy=[True, True]), r"sums to zero .*rows \[1\]")
    _both_raise(lambda b: typical(b, tp, ids), r"sums to zero .*rows \[1\]")
    tp = _uniform(1, 2, 8)
    tp[0, 1] = 0.0  # the bonus position
    _both_raise(lambda b: reject(b, tp, _ids([1]), None), r"sums to zero")


def test_public_api_raises_on_both_backends():
    tp = _uniform(1, 2, 8)
    tp[0, 0, 3] = float("nan")
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="target_probs contains NaN"):
            rejection_sample(tp, _ids([3]), None, seeds=torch.tensor([1]), backend=backend)
        with pytest.raises(ValueError, match="target_probs contains NaN"):
            typical_acceptance_sample(tp, _ids([3]), seeds=torch.tensor([1]), backend=backend)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 1e39, True, "0.1"])
def test_typical_parameters_outside_finite_float32_are_errors(bad):
    tp = _uniform(1, 2, 8)
    for backend in BACKENDS:
        for kw in ({"posterior_threshold": bad}, {"posterior_alpha": bad}):
            with pytest.raises(ValueError, match=rf"'{next(iter(kw))}': allowed values are finite numbers in \[0, "):
                typical_acceptance_sample(tp, _ids([1]), backend=backend, **kw)


@pytest.mark.parametrize("arg", ["target_probs", "draft_token_ids", "draft_probs", "seeds", "is_greedy"])
def test_non_tensor_arguments_are_value_errors_naming_them(arg):
    kw = dict(target_probs=_uniform(1, 2, 8), draft_token_ids=_ids([1]), draft_probs=None, seeds=None, is_greedy=None)
    kw[arg] = [[1]] if arg != "draft_probs" else [[[0.125] * 8]]
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=arg):
            rejection_sample(kw["target_probs"], kw["draft_token_ids"], kw["draft_probs"], seeds=kw["seeds"],
                             is_greedy=kw["is_greedy"], backend=backend)
        if arg in ("target_probs", "draft_token_ids"):
            with pytest.raises(ValueError, match=arg):
                typical_acceptance_sample(kw["target_probs"], kw["draft_token_ids"], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_seeds_and_greedy_flags_are_read_as_their_values(backend):
    """A non-contiguous seeds view ([11, 22] with stride 2): row 1 draws with seed 22, as it does alone."""
    g = torch.Generator().manual_seed(9)
    tp = torch.softmax(torch.randn(2, 1, 64, generator=g), -1)
    ids = torch.empty(2, 0, dtype=torch.int64)
    seeds = torch.tensor([11, 0, 22, 0])[::2]
    greedy = torch.tensor([False, True, False, True])[::2]
    for fn in (rejection_sample, typical_acceptance_sample):
        both = fn(tp, ids, seeds=seeds, is_greedy=greedy, backend=backend)
        for row, seed in ((0, 11), (1, 22)):
            alone = fn(tp[row:row + 1], ids[row:row + 1], seeds=torch.tensor([seed]), backend=backend)
            assert torch.equal(both[row], alone[0]), (fn.__name__, row)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_vocabulary_of_one_token(backend):
    tp = torch.ones(2, 2, 1)
    out = reject(backend, tp, _ids([0], [-1]), torch.ones(2, 1, 1), u=torch.full((2, 1), U_MAX))
    assert out.tolist() == [[0, 0], [0, -1]]
    assert typical(backend, tp, _ids([0], [-1])).tolist() == [[0, 0], [0, -1]]
