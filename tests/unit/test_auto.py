"""spec_decode.scheduler.auto: the goodput rule's arithmetic on recorded acceptance and cost traces, and auto in
process."""

import numpy as np
import pytest
import torch

from spec_decode.engine.kv_cache import CachedCausalLM
from spec_decode.engine.scorer import TargetScorer
from spec_decode.generation import Generation
from spec_decode.in_process import LocalStep, run_local
from spec_decode.proposers import DraftModelProposer, Proposal, Proposer
from spec_decode.protocol import AUTO, StepInputs, StepResult
from spec_decode.request import GenerationRequest
from spec_decode.sampling import SamplingParams
from spec_decode.scheduler.auto import (
    AcceptanceStats,
    AutoController,
    RoundCost,
    _Sequence,
    arm,
    expected_tokens,
    step_trials,
)

# bench.forward_cost on the 2-core CPU (docs/benchmarks.md): scoring 2, 3, 5, 9 positions costs 1.13, 1.26, 1.69,
# 2.13x one position (a 45 ms forward)
CPU_CURVE = {1: 0.045, 2: 0.045 * 1.13, 3: 0.045 * 1.26, 5: 0.045 * 1.69, 9: 0.045 * 2.13}


class FixedCost(RoundCost):
    """The prior curve alone: measured round times are ignored (deterministic choices in tests)."""

    def observe(self, sequences, positions, seconds, methods=(), forward=None):
        pass


def test_expected_tokens_is_leviathans_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.8, 3) == pytest.approx((1 - 0.8 ** 4) / 0.2)
    with pytest.raises(ValueError):
        expected_tokens(1.5, 2)


def test_a_step_counts_its_accepted_drafts_and_the_first_rejection():
    assert step_trials(4, 4) == (4, 4)  # all accepted: no failure seen
    assert step_trials(4, 1) == (1, 2)
    assert step_trials(3, 0) == (0, 1)
    with pytest.raises(ValueError):
        step_trials(2, 3)


def test_acceptance_counts_decay_towards_a_half():
    s = AcceptanceStats()
    assert s.mean() == 0.5
    s.add(0, 10)
    assert s.mean() == pytest.approx(1 / 12)
    for _ in range(100):
        s.decay(0.9)
    assert s.mean() == pytest.approx(0.5, abs=1e-3)  # evidence faded: back to the Laplace prior


def test_the_cost_model_keeps_the_forward_apart_from_the_rest_of_the_round_and_from_drafting():
    cost = RoundCost(weight=1.0)
    assert cost.predict(1, 5) / cost.predict(1, 1) == pytest.approx(5)  # nothing measured: cautious, P units
    cost.observe(1, 1, 0.050, forward=0.040)  # a plain round: 40 ms forward, 10 ms of the rest
    assert (cost.forward[(1, 1)], cost.rest[1]) == (pytest.approx(0.040), pytest.approx(0.010))
    assert cost.predict(1, 5) == pytest.approx(5 * 0.040 + 0.010)  # no slope known yet: proportional
    cost.observe(1, 5, 0.085, forward=0.060, methods=("draft_model",))  # 5 ms per position; the hop 15 ms
    assert cost.slope == {1: pytest.approx(0.005)}
    assert cost.extra["draft_model"] == pytest.approx(0.085 - 0.060 - 0.010)
    assert cost.predict(1, 3) == pytest.approx(0.050 + 0.010)  # between two measured forwards
    assert cost.predict(1, 9) == pytest.approx(0.060 + 4 * 0.005 + 0.010)  # past them: along the slope
    assert cost.predict(4, 5, ("draft_model",)) == pytest.approx(0.060 + 0.010 + 0.015)  # the nearest S's figures
    cost.observe(8, 8, 0.110, forward=0.100)  # a full round: its own points, and a position costs its share there
    assert cost.predict(8, 12) == pytest.approx(0.100 + 4 * 0.100 / 8 + 0.010)
    cost.observe(8, 9, 0.108, forward=0.098)  # a noisy point next to it says nothing of the slope alone...
    cost.observe(8, 16, 0.160, forward=0.150)
    assert cost.slope[8] == pytest.approx(0.0067, abs=5e-4)  # ...the least-squares line over all three does
    cost.observe(2, 2, 0.070)  # a transport that does not say: the whole round counts as forward
    assert (cost.forward[(2, 2)], cost.rest[2]) == (pytest.approx(0.070), 0.0)


def test_the_prior_curve_shapes_predictions_around_the_measured_forwards():
    cost = RoundCost(weight=1.0, prior=CPU_CURVE)
    assert cost.predict(1, 5) == pytest.approx(CPU_CURVE[5])  # nothing measured: the prior itself
    assert cost.predict(1, 4) == pytest.approx((CPU_CURVE[3] + CPU_CURVE[5]) / 2)
    assert cost.predict(1, 17) == pytest.approx(CPU_CURVE[9] + 8 * (CPU_CURVE[9] - CPU_CURVE[5]) / 4)
    cost.observe(1, 1, 0.090, forward=0.090)  # twice as slow as the prior: anchored to the measurement
    assert cost.predict(1, 5) == pytest.approx(0.090 * 1.69)
    with pytest.raises(ValueError):
        RoundCost(prior={0: 0.1})


def _inputs(seq_id, cap=4):
    return StepInputs(seq_id, [1, 2, 3], cap, AUTO, SamplingParams(), 0, cached_len=2, auto=True)


def _play(ctrl, seq_id, accept_fn, steps, cap=4):
    """Run ``steps`` planned steps of one sequence; ``accept_fn(step, k) -> accepted``. Returns the choices."""
    choices = []
    for t in range(steps):
        submitted = _inputs(seq_id, cap)
        (inp,) = ctrl.plan([submitted])
        assert (submitted.method, submitted.num_draft_tokens) == (AUTO, cap)  # a new input, the submitted unchanged
        choices.append((inp.method, inp.num_draft_tokens))
        k = inp.num_draft_tokens
        acc = accept_fn(t, k) if k else 0
        ctrl.observe([inp], [StepResult(list(range(acc + 1)), k)], 0.05)
    return choices


def test_high_acceptance_drafts_the_cap_and_no_acceptance_drafts_nothing():
    ctrl = AutoController(["ngram", "suffix"], cost=FixedCost(prior=CPU_CURVE))
    good = _play(ctrl, 1, lambda t, k: k, 30)  # every draft accepted
    assert good[-1][1] == 4 and good[-1][0] in ("ngram", "suffix")
    bad = _play(ctrl, 2, lambda t, k: 0, 30)  # nothing ever accepted
    assert bad[-10:].count(("none", 0)) >= 8


def test_the_choice_leaves_a_proposer_whose_drafts_are_rejected_and_returns_once_they_are_accepted():
    """A recorded trace: drafts always rejected for 60 steps, then always accepted."""
    ctrl = AutoController(["garbage"], cost=FixedCost(prior=CPU_CURVE))
    choices = _play(ctrl, 1, lambda t, k: 0 if t < 60 else k, 120)
    assert choices[0][0] == "garbage"  # tried first (nothing known: the prior is a half)
    rejected = choices[20:60]
    assert sum(m == "none" for m, _ in rejected) >= 0.8 * len(rejected)  # it stopped speculating...
    assert any(m == "garbage" for m, _ in rejected)  # ...but kept probing, cheaply (k = 1)
    assert all(k <= 1 for m, k in rejected if m == "garbage")
    assert choices[-20:] == [("garbage", 4)] * 20  # back to full speculation once drafts are accepted


def test_the_rule_speculates_less_when_the_round_is_full():
    """Same acceptance (0.6 per token), two cost models: at one sequence scoring a few more positions is nearly
    free; with 8 sequences the round is compute-bound (cost grows with every position), so auto drafts less."""
    def drafted(sequences: int, curve: dict) -> float:
        ctrl = AutoController(["ngram"], cost=FixedCost(prior=curve))
        for s in range(sequences):  # a history of 0.6 per token for every sequence
            ctrl.sequences[s] = _Sequence(stats={"ngram": AcceptanceStats(60, 100)})
        inps = ctrl.plan([_inputs(s) for s in range(sequences)])
        return sum(i.num_draft_tokens for i in inps) / sequences

    alone = drafted(1, CPU_CURVE)
    linear = {p: 0.045 * (1 + 0.9 * (p - 1) / 8) for p in (1, 8, 16, 40)}  # 8 rows ~ 1.8x one: compute-bound
    full = drafted(8, linear)
    assert alone >= 2 and full < alone


def test_a_model_proposer_is_chosen_only_when_its_acceptance_pays_for_its_own_cost():
    cost = FixedCost(prior=CPU_CURVE)
    cost.extra["draft"] = 0.045  # the draft LM costs a whole target forward per round
    ctrl = AutoController(["ngram", "draft"], model_methods=["draft"], cost=cost)
    ctrl.sequences[1] = _Sequence(stats={"draft": AcceptanceStats(95, 100), "ngram": AcceptanceStats(5, 100)})
    ctrl.sequences[2] = _Sequence(stats={"draft": AcceptanceStats(30, 100), "ngram": AcceptanceStats(5, 100)},
                                  probe_due={"draft": 9, "ngram": 9})  # no probe due yet
    (a,) = ctrl.plan([_inputs(1)])
    (b,) = ctrl.plan([_inputs(2)])
    assert (a.method, a.num_draft_tokens) == ("draft", 4)
    assert b.method == "none"  # 0.3 per token does not pay for a second forward


class Flaky(Proposer):
    """Drafts the target's own greedy continuation, shifted by one token id (always rejected) while the sequence is
    shorter than ``switch_at`` tokens, then unshifted (always accepted)."""

    name = "flaky"

    def __init__(self, lm, switch_at: int):
        self.inner = DraftModelProposer(CachedCausalLM(lm))
        self.vocab = lm.config.vocab_size
        self.switch_at = switch_at

    def propose(self, requests):
        out = []
        for r, p in zip(requests, self.inner.propose(requests)):
            ids = p.draft_token_ids
            out.append(Proposal.of(((ids + 1) % self.vocab if len(r.token_ids) < self.switch_at else ids).tolist()))
        return out

    def release(self, seq_id, final_token_ids=None):
        self.inner.release(seq_id, final_token_ids)


def test_auto_in_process_equals_plain_greedy_and_moves_to_none_and_back(tiny_lm, real_tokenizer):
    """The whole loop with a real (tiny) target: a proposer that drafts garbage for the first 40 tokens and the
    target's own tokens after: auto stops speculating, then speculates fully; the output is plain greedy's."""
    prompt = [5, 17, 3]
    with torch.inference_mode():
        ref = tiny_lm.generate(torch.tensor([prompt]), max_new_tokens=90, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, 3:].tolist()
    step = LocalStep({"flaky": Flaky(tiny_lm, switch_at=43)}, TargetScorer(CachedCausalLM(tiny_lm)))
    ctrl = AutoController(["flaky"], cost=FixedCost(prior=CPU_CURVE))
    gen = Generation(7, prompt, GenerationRequest("x", 90, speculative_method=AUTO), real_tokenizer, [], 256, 0)
    run_local(gen, step, controller=ctrl)
    assert gen.output_ids == ref
    s = gen.stats
    assert len(s.step_methods) == len(s.step_draft_tokens) == s.steps
    early = s.step_methods[:30]
    assert early[0] == "flaky" and early.count("none") >= 20  # tried, then given up on but for a few probes
    back = len(s.step_methods) - s.step_methods[::-1].index("none")  # the steps after the last plain one
    ks = s.step_draft_tokens[back:]
    assert set(s.step_methods[back:]) == {"flaky"} and ks == sorted(ks) and ks[-1] == 4  # back, up to the cap
    assert s.accepted_tokens > 0 and ctrl.sequences == {}  # released
    with pytest.raises(ValueError, match="AutoController"):
        run_local(Generation(8, prompt, GenerationRequest("x", 4, speculative_method=AUTO), real_tokenizer, [],
                             256, 0), step)


def test_a_new_sequence_probes_a_method_the_server_holds_low():
    ctrl = AutoController(["suffix"], cost=FixedCost(prior=CPU_CURVE))
    ctrl.server["suffix"] = AcceptanceStats(0, 200)  # the server's recent history: nothing accepted
    choices = _play(ctrl, 1, lambda t, k: k, 12)
    assert choices[0] == ("suffix", 1) and choices[-1] == ("suffix", 4)


def test_a_proposer_that_rarely_drafts_is_weighed_by_how_often_it_does():
    """Suffix decoding drafts only on a match: with every draft accepted when it drafts, auto still asks it for the
    cap (a step without a match costs only the draft_model hop); its probes back off while it has nothing."""
    cost = FixedCost(prior=CPU_CURVE)
    cost.extra["draft_model"] = 0.002
    ctrl = AutoController(["suffix"], cost=cost)
    offered = []

    def accept(t, k):
        return k

    choices = []
    for t in range(40):  # a match every fourth step
        (inp,) = ctrl.plan([_inputs(1)])
        choices.append((inp.method, inp.num_draft_tokens))
        drafted = inp.num_draft_tokens if t % 4 == 0 else 0
        offered.append(drafted)
        ctrl.observe([inp], [StepResult(list(range(accept(t, drafted) + 1)), drafted)], 0.05)
    assert 0.2 < ctrl.offer_rate(1, "suffix") < 0.45
    assert choices[-1] == ("suffix", 4)


def test_auto_sampled_output_keeps_the_target_law(real_tokenizer):
    """Temperature 1 with auto choosing among another small LM, a uniform draft and none, one controller across
    all requests (its choices move with the history): the joint law of the first three output tokens is the
    target's (chi-square over 1,500 seeds)."""
    from scipy.stats import chisquare

    from tests.helpers import UniformDrafts, peaked_lm

    v, prompt = 8, [5, 7, 3]

    class Uniform(UniformDrafts, Proposer):
        vocab = v

    lm = peaked_lm(0, 4.0, v)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny forwards
    try:
        with torch.inference_mode():
            def law(ids):
                return torch.softmax(lm(torch.tensor([ids])).logits[0, -1].double(), -1).numpy()

            joint = np.zeros((v, v, v))
            p1 = law(prompt)
            for a in range(v):
                p2 = law(prompt + [a])
                for b in range(v):
                    joint[a, b] = p1[a] * p2[b] * law(prompt + [a, b])
        step = LocalStep({"draft": DraftModelProposer(CachedCausalLM(peaked_lm(1, 2.0, v))), "uniform": Uniform()},
                         TargetScorer(CachedCausalLM(lm)))
        ctrl = AutoController(["draft", "uniform"], cost=FixedCost(prior=CPU_CURVE))
        n, seen, chosen = 1500, [], set()
        for s in range(n):
            req = GenerationRequest("x", 3, temperature=1.0, random_seed=s, speculative_method=AUTO,
                                    num_draft_tokens=2)
            gen = Generation(100 + s, prompt, req, real_tokenizer, [], 64, s)
            run_local(gen, step, controller=ctrl)
            seen.append((gen.output_ids[0] * v + gen.output_ids[1]) * v + gen.output_ids[2])
            chosen |= set(gen.stats.step_methods)
    finally:
        torch.set_num_threads(threads)
    assert len(chosen) >= 2  # the choice moved
    counts = np.bincount(seen, minlength=v ** 3)
    expected = joint.reshape(-1) * n
    big = expected >= 5
    observed, expected = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3


@pytest.mark.parametrize("alpha", [0.05, 0.2, 0.4, 0.6, 0.8, 0.95])
def test_one_sequence_gets_the_k_that_maximises_expected_tokens_per_second(alpha):
    """The rule against brute force on the measured CPU curve: k = argmax over 0..4 of
    expected_tokens(alpha, k) / c(k + 1)."""
    cost = FixedCost(prior=CPU_CURVE)
    ctrl = AutoController(["ngram"], cost=cost)
    n = 1e6
    ctrl.sequences[1] = _Sequence(stats={"ngram": AcceptanceStats(alpha * n, n)},
                                  offers={"ngram": AcceptanceStats(n, n)}, probe_due={"ngram": 99})
    (inp,) = ctrl.plan([_inputs(1)])
    best = max(range(5), key=lambda k: expected_tokens(alpha, k) / cost.predict(1, k + 1, ("draft_model",) if k
                                                                                 else ()))
    assert inp.num_draft_tokens == best
    assert (best == 0) == (alpha <= 0.1) and (best == 4) == (alpha >= 0.95)  # none at low acceptance, all at high


def test_probes_stay_within_their_share_of_the_round_time():
    """A full round (8 sequences) whose hop to draft_model costs 15 ms of a 110 ms round, nothing ever accepted (so
    every draft is a probe): the probes' predicted seconds stay within probe_budget of the measured round time, where
    the 8 sequences, each due a probe every few steps (suffix decoding finds no match: its probes back off to 4
    steps at most), would otherwise send most rounds through draft_model."""
    cost = FixedCost()
    RoundCost.observe(cost, 8, 8, 0.110, forward=0.100)
    RoundCost.observe(cost, 8, 9, 0.129, forward=0.104, methods=("draft_model",))
    counts = {}
    for budget in (0.05, 1.0):
        ctrl = AutoController(["suffix"], cost=cost, probe_budget=budget)
        ctrl.server["suffix"] = AcceptanceStats(0, 1000)  # nothing ever accepted: the rule alone drafts nothing
        for s in range(8):  # sequences that started at different times: their probes fall due in different rounds
            ctrl.sequences[s] = _Sequence(probe_due={"suffix": s % 4})
        probes = 0
        for _ in range(100):
            ran = ctrl.plan([_inputs(s) for s in range(8)])
            probes += any(r.num_draft_tokens for r in ran)  # rounds sent through draft_model
            ctrl.observe(ran, [StepResult([1], 0, cached_tokens=2, forward_seconds=0.1) for r in ran], 0.110)
        counts[budget] = probes
        assert ctrl.probe_seconds <= budget * ctrl.round_seconds
    # probes still run, and gather in fewer rounds (once one pays the hop, the others cost a position each)
    assert 5 <= counts[0.05] <= 0.05 * 11.0 / 0.015 + 1 < counts[1.0]
    with pytest.raises(ValueError):
        AutoController(["suffix"], probe_budget=1.5)


def _play_shapes(ctrl, seq_id, chain_accepts, tree_result, steps, cap=8, trees=True):
    """Steps of one sequence that allows trees (``trees``): a chain step of k drafts accepts ``chain_accepts(k)``;
    a tree step of k nodes returns ``tree_result(k) -> (depth, accepted)``. Returns (method, k, draft_tree) per
    step."""
    choices = []
    for _ in range(steps):
        submitted = StepInputs(seq_id, [1, 2, 3], cap, AUTO, SamplingParams(), 0, cached_len=2, auto=True,
                               draft_tree=trees)
        (inp,) = ctrl.plan([submitted])
        k = inp.num_draft_tokens
        choices.append((inp.method, k, inp.draft_tree))
        if inp.draft_tree:
            depth, acc = tree_result(k)
            result = StepResult(list(range(acc + 1)), k, draft_depth=depth)
        else:
            result = StepResult(list(range((chain_accepts(k) if k else 0) + 1)), k)
        ctrl.observe([inp], [result], 0.05)
    return choices


def test_auto_chooses_trees_where_their_depth_pays_and_chains_where_it_does_not():
    """A proposer whose chains are accepted at 0.3 per token while its trees of k nodes reach k / 2 deep, each depth
    accepted: auto moves to trees (counted as such), with k nodes each. The same proposer whose trees reach
    only one level, accepted at the chains' rate: auto keeps chains. A request that does not allow trees never gets
    one, and a tree method's trees start from its chains' estimate."""
    def chain_30(k):  # 3 in 10 per token: accepts the first draft on 3 of 10 steps, nothing else
        chain_30.n += 1
        return 1 if chain_30.n % 10 < 3 else 0
    chain_30.n = 0
    ctrl = AutoController(["eagle3"], tree_methods=["eagle3"], cost=FixedCost(prior=CPU_CURVE))
    assert ctrl.alpha(1, "eagle3", True) == ctrl.alpha(1, "eagle3")  # no tree seen: the chains' estimate
    deep = _play_shapes(ctrl, 1, chain_30, lambda k: (max(1, k // 2), max(1, k // 2)), 40)
    assert all(tree and k > 1 for _, k, tree in deep[-10:]), deep
    assert ctrl.depth_ratio(1, "eagle3") == pytest.approx(0.5, abs=0.1)

    ctrl = AutoController(["eagle3"], tree_methods=["eagle3"], cost=FixedCost(prior=CPU_CURVE))
    flat = _play_shapes(ctrl, 2, chain_30, lambda k: (1, 1 if chain_30.n % 10 < 3 else 0), 40)
    assert not any(tree for _, _, tree in flat[-10:]), flat

    ctrl = AutoController(["eagle3"], tree_methods=["eagle3"], cost=FixedCost(prior=CPU_CURVE))
    never = _play_shapes(ctrl, 3, chain_30, lambda k: (max(1, k // 2), max(1, k // 2)), 20, trees=False)
    assert not any(tree for _, _, tree in never)
    with pytest.raises(ValueError, match="tree methods"):
        AutoController(["ngram"], tree_methods=["eagle3"])


def test_auto_tries_each_tree_width_then_keeps_the_one_that_reaches_deepest():
    """With width methods, each width (tree_top_k) is an arm of its own: the widths are tried in order, one step each
    at first, then the trees take the width whose trees emit the most (here width 4: its trees reach k/2 deep, every
    depth accepted, where width 2's and 8's reach one level); the step carries the width, and a request's own
    tree_top_k is kept. A sampled request gets no tree from a proposer that trees only greedy requests."""
    ctrl = AutoController(["eagle3"], ["eagle3"], ["eagle3"], greedy_tree_methods=["eagle3"],
                          width_methods=["eagle3"], tree_top_ks=(2, 4, 8), cost=FixedCost(prior=CPU_CURVE))
    widths = []
    for _ in range(40):
        (inp,) = ctrl.plan([StepInputs(1, [1, 2, 3], 8, AUTO, SamplingParams(), 0, cached_len=2, auto=True,
                                       draft_tree=True)])
        k = inp.num_draft_tokens
        if inp.draft_tree:
            widths.append(inp.tree_top_k)
            depth = max(1, k // 2) if inp.tree_top_k == 4 else 1
            result = StepResult(list(range(depth + 1)), k, draft_depth=depth)
        else:
            widths.append(0)
            result = StepResult([0], k)
        ctrl.observe([inp], [result], 0.05)
    assert widths[:3] == [2, 4, 8] and set(widths[-10:]) == {4}, widths
    value = {w: expected_tokens(ctrl.alpha(1, "eagle3", True, w), ctrl.depth_ratio(1, "eagle3", w) * 8)
             for w in (2, 4, 8)}
    assert value[4] > max(value[2], value[8]), value
    (own,) = ctrl.plan([StepInputs(2, [1, 2, 3], 8, AUTO, SamplingParams(), 0, cached_len=2, auto=True,
                                   draft_tree=True, tree_top_k=3)])
    assert own.tree_top_k == 3
    sampled = SamplingParams(temperature=1.0, seed=1)
    for _ in range(5):
        (inp,) = ctrl.plan([StepInputs(3, [1, 2, 3], 8, AUTO, sampled, 0, cached_len=2, auto=True, draft_tree=True)])
        assert not inp.draft_tree and inp.tree_top_k == 0
        ctrl.observe([inp], [StepResult(list(range(min(inp.num_draft_tokens, 2) + 1)), inp.num_draft_tokens)], 0.05)
    assert "eagle3+tree" not in ctrl.sequences[3].stats  # its chains were counted as chains
    assert arm("eagle3", True, 4) == "eagle3+tree4" and arm("suffix", True) == "suffix+tree"
    with pytest.raises(ValueError, match="width methods"):
        AutoController(["eagle3"], tree_methods=[], width_methods=["eagle3"])
