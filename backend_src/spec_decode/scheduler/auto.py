"""``speculative_method=auto``: per sequence and per step, the proposer and k that maximise the round's goodput.

Speculation pays only when the tokens it adds are worth more than the positions it makes the target score. The rule
(docs/auto.md) is the goodput rule of SmartSpec (Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large
Language Models Using Goodput", arXiv:2406.14066): choose the draft lengths that maximise the expected tokens a
round emits per second of round time. With a per-token acceptance rate alpha, a step that drafts k tokens emits
``(1 - alpha**(k+1)) / (1 - alpha)`` tokens in expectation (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding", eq. 1), and the round costs ``c(P)`` seconds for the P positions it scores.

Three parts, no I/O (the round's :class:`~.plan.Scheduler` feeds them, in generate and in process alike):

- :class:`AcceptanceStats`: each sequence's acceptance per proposer, as decayed Bernoulli counts, with a prior from
  the server's recent acceptance of that proposer (what a sequence that has not tried it starts from), and probes
  with exponential backoff of a proposer the rule left;
- :class:`~.round_cost.RoundCost`: the round's cost as a function of the sequences in it and the positions it
  scores, learned from the target's forward seconds each round reports and the round's own time, plus what each
  model proposer and the draft_model hop add to a round;
- :class:`AutoController`: plans a round (every ``auto`` row's method and k at once, so that at high load the round
  speculates less) and learns from its results.

Exactness: the controller changes only which drafts the target scores; its choices depend on the acceptance of
earlier steps (functions of the committed tokens) and on round times, never on the tokens a step samples, so greedy
output stays the target's own and rejection sampling keeps the target's distribution.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

from ..protocol import AUTO, NO_SPECULATION, StepInputs, StepResult
from .round_cost import DRAFT_HOP, RoundCost


def expected_tokens(alpha: float, k: float) -> float:
    """Expected tokens emitted by a step that drafts ``k`` tokens, each accepted with probability ``alpha`` given
    the previous ones were (Leviathan et al. 2023, eq. 1): ``(1 - alpha**(k+1)) / (1 - alpha)``; k + 1 at alpha 1.
    A fractional k (a tree's expected depth, :meth:`AutoController.depth_ratio`) interpolates.

    Raises:
        ValueError: alpha outside [0, 1] or k < 0.
    """
    if not 0.0 <= alpha <= 1.0 or k < 0:
        raise ValueError(f"alpha must be in [0, 1] and k >= 0, got {alpha}, {k}")
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def step_trials(drafted: int, accepted: int) -> tuple[int, int]:
    """(successes, trials) of one verified step for a per-token acceptance estimate: the drafts are tried in order
    until the first rejection, so ``accepted`` successes and one failure unless every draft was accepted.

    Raises:
        ValueError: accepted outside [0, drafted].
    """
    if not 0 <= accepted <= drafted:
        raise ValueError(f"accepted must be in [0, drafted={drafted}], got {accepted}")
    return accepted, accepted + (1 if accepted < drafted else 0)


@dataclass
class AcceptanceStats:
    """Decayed per-token acceptance counts (successes, trials) of one proposer for one sequence or for the server.

    Every :meth:`decay` multiplies both counts by a factor, so recent steps weigh most.
    """

    successes: float = 0.0
    trials: float = 0.0

    def add(self, successes: int, trials: int) -> None:
        """Count one step's (successes, trials) (:func:`step_trials`)."""
        self.successes += successes
        self.trials += trials

    def decay(self, factor: float) -> None:
        """Multiply both counts by ``factor`` (in (0, 1])."""
        self.successes *= factor
        self.trials *= factor

    def mean(self) -> float:
        """The Laplace estimate (successes + 1) / (trials + 2): 1/2 with no evidence."""
        return (self.successes + 1.0) / (self.trials + 2.0)


TREE_ARM = "+tree"
"""Suffix of the name under which the controller counts a method's tree steps (``eagle3+tree``): a method that drafts
trees is two arms, its chains and its trees, each with its own acceptance per depth."""


def arm(method: str, tree: bool) -> str:
    """The controller's name for ``method`` drafting trees (``method`` + :data:`TREE_ARM`) or chains (``method``)."""
    return method + TREE_ARM if tree else method


@dataclass
class _Row:
    """One auto row being planned: its cap, choice (method and shape) and expected tokens."""

    index: int
    seq_id: int
    cap: int
    trees: bool  # the row may draft a tree (the request allows it)
    method: str | None = None
    tree: bool = False
    k: int = 0
    gain: float = 1.0  # expected tokens of its step so far
    alphas: dict[str, float] = field(default_factory=dict)  # arm -> per-depth acceptance estimate
    offers: dict[str, float] = field(default_factory=dict)  # method -> estimated chance that it drafts at all
    ratios: dict[str, float] = field(default_factory=dict)  # tree arm -> its trees' depth per node


@dataclass
class _Sequence:
    """What the controller knows of one sequence: its steps, acceptance per method, and when to probe each."""

    steps: int = 0
    stats: dict[str, AcceptanceStats] = field(default_factory=dict)  # per arm, per drafted depth
    depths: dict[str, AcceptanceStats] = field(default_factory=dict)  # tree arm -> (depth reached, nodes) sums
    offers: dict[str, AcceptanceStats] = field(default_factory=dict)  # steps it drafted in / steps it was asked
    probe_due: dict[str, int] = field(default_factory=dict)  # method -> the step from which a probe may run
    backoff: dict[str, int] = field(default_factory=dict)  # method -> steps to the next probe after a failed one


class AutoController:
    """Chooses the proposer and k of every ``auto`` row of a round, and learns from the round.

    Args:
        methods: the single proposers it may choose (served; ``none`` is always possible: k = 0).
        model_methods: those of ``methods`` that run a model (the draft LM, the heads): a round where one drafts
            pays its seconds (:class:`RoundCost`).
        tree_methods: those of ``methods`` that draft trees for a request that allows them (``draft_tree``): for such
            a row the controller also chooses the shape, chain or tree, at each step (:meth:`plan`).
        decay: the factor by which a sequence's counts of a method fade at each step that method drafts, in (0, 1]
            (0.9: the last ~10 such steps weigh most, so the estimate follows a change of text, and ten rejections
            outweigh a prior of one trial).
        prior_weight: how many trials the server's recent acceptance of a method counts as for a sequence (>= 0).
        server_decay: the same factor for the server's counts of a method, at each step any sequence drafts with it.
        max_backoff: the most steps between two probes of a method whose drafts were rejected (>= 1; see
            :meth:`plan`).
        max_idle_backoff: the most steps between two probes of a method that drafted nothing (no match yet; >= 1):
            such a probe costs only the draft_model hop, and a match may come at any step.
        cost: the round cost model (default: a new :class:`RoundCost`, learned from the rounds).
        probe_budget: the share of the server's round time that probes may add, in [0, 1] (their predicted seconds
            over the measured seconds of every round so far): probes cost what they may win, however many sequences
            are due one.

    Raises:
        ValueError: a factor outside (0, 1], a negative prior_weight, a backoff < 1, or a model method not in
            methods.
    """

    def __init__(self, methods: Sequence[str], model_methods: Collection[str] = (), tree_methods: Collection[str] = (),
                 decay: float = 0.9, prior_weight: float = 1.0,
                 server_decay: float = 0.99, max_backoff: int = 32, max_idle_backoff: int = 4,
                 cost: RoundCost | None = None, probe_budget: float = 0.05):
        if (not (0.0 < decay <= 1.0 and 0.0 < server_decay <= 1.0) or prior_weight < 0
                or min(max_backoff, max_idle_backoff) < 1 or not 0.0 <= probe_budget <= 1.0):
            raise ValueError(f"decay and server_decay must be in (0, 1], prior_weight >= 0, backoffs >= 1, "
                             f"probe_budget in [0, 1]; got {decay}, {server_decay}, {prior_weight}, {max_backoff}, "
                             f"{max_idle_backoff}, {probe_budget}")
        self.methods = tuple(m for m in methods if m not in (NO_SPECULATION, AUTO))
        if not set(model_methods) | set(tree_methods) <= set(self.methods):
            raise ValueError(f"model and tree methods must be among {self.methods}")
        self.model_methods, self.tree_methods = frozenset(model_methods), frozenset(tree_methods)
        self.decay, self.server_decay = decay, server_decay
        self.prior_weight = prior_weight
        self.max_backoff, self.max_idle_backoff = max_backoff, max_idle_backoff
        self.cost = cost or RoundCost()
        self.probe_budget = probe_budget
        self.round_seconds = 0.0  # measured seconds of every round observed
        self.probe_seconds = 0.0  # predicted seconds the probes planned so far added to their rounds
        self.server: dict[str, AcceptanceStats] = {arm(m, t): AcceptanceStats() for m in self.methods
                                                   for t in ((False, True) if m in self.tree_methods else (False,))}
        self.server_depths: dict[str, AcceptanceStats] = {arm(m, True): AcceptanceStats() for m in self.tree_methods}
        self.server_offers: dict[str, AcceptanceStats] = {m: AcceptanceStats() for m in self.methods}
        self.sequences: dict[int, _Sequence] = {}

    def alpha(self, seq_id: int, method: str, tree: bool = False) -> float:
        """The per-token acceptance estimate of ``method`` for ``seq_id`` (``tree``: per depth of its trees): its
        decayed counts, with the server's recent mean (:meth:`AcceptanceStats.mean`) as a prior worth
        ``prior_weight`` trials. A tree arm the server has not seen yet starts from the chain's estimate (a tree
        holds the chain's path and more)."""
        name = arm(method, tree)
        seq = self.sequences.get(seq_id)
        mine = seq.stats.get(name) if seq is not None else None
        if tree and not self.server[name].trials and mine is None:
            return self.alpha(seq_id, method)
        return self._estimate(mine, self.server[name])

    def depth_ratio(self, seq_id: int, method: str) -> float:
        """The depth a tree of ``method`` reaches per node of its budget, for ``seq_id``: its trees' decayed (depth,
        nodes) sums, with the server's as a prior worth ``prior_weight`` trees, and 1 (a chain) before any tree; in
        (0, 1]."""
        server = self.server_depths[arm(method, True)]
        prior = (server.successes + 1.0) / (server.trials + 1.0)  # one chain-like tree of one node as the prior
        seq = self.sequences.get(seq_id)
        mine = seq.depths.get(arm(method, True)) if seq is not None else None
        w = self.prior_weight
        if mine is None or mine.trials + w <= 0:
            return prior
        return min(1.0, (mine.successes + w * prior) / (mine.trials + w))

    def offer_rate(self, seq_id: int, method: str) -> float:
        """The chance that ``method`` drafts anything when asked, for ``seq_id`` (suffix decoding and n-gram lookup
        draft only on a match): estimated as :meth:`alpha`, from the steps it was asked for drafts."""
        seq = self.sequences.get(seq_id)
        return self._estimate(seq.offers.get(method) if seq is not None else None, self.server_offers[method])

    def _estimate(self, mine: AcceptanceStats | None, server: AcceptanceStats) -> float:
        prior, w = server.mean(), self.prior_weight
        if mine is None or mine.trials + w <= 0:
            return prior
        return (mine.successes + w * prior) / (mine.trials + w)

    def plan(self, inps: Sequence[StepInputs]) -> list[StepInputs]:
        """The round's steps with the method, shape and k of each auto row chosen (``inp.auto``; its
        ``num_draft_tokens`` is its cap): new inputs for those rows, the others as given (fixed, only counted in the
        round's cost).

        Greedy on the round's goodput (expected tokens / predicted seconds), as SmartSpec's batch-level choice: from
        every auto row at k = 0, repeatedly take the move that raises the goodput most, where a row without a
        method may take any (method, k) up to its cap and a row with one may add one draft token; stop when no
        move raises it. A method that drafts only on a match (suffix decoding, n-gram lookup) counts with the
        chance that it drafts at all (:meth:`offer_rate`): q * (expected_tokens - 1) more tokens for q * k more
        positions, in expectation; the first drafting row of a round adds the draft_model hop's seconds.

        The shape: a row that allows trees (``draft_tree``) may take each tree method (``tree_methods``) as a chain
        or as a tree of k nodes. A tree counts with its own acceptance per depth (:meth:`alpha` with ``tree``) over
        the depth its trees reach per node (:meth:`depth_ratio` x k), so a tree wins where its branches raise the
        acceptance per depth more than their nodes cost in depth; the chosen step carries ``draft_tree`` accordingly.
        Before any evidence a tree counts as its chain, and a tie goes to the tree (so trees are tried, and kept only
        while they pay).

        A row left at k = 0 runs without speculation, unless a model-free method is due a probe: one draft token of
        it, so that a method given up (or never tried: the server's history may hold it low) is found again when
        the text turns its way. Model proposers are not probed (a probe would make the whole round pay their
        forward): the server's acceptance of them, shared by every sequence, and their measured cost decide. A
        method is due from a sequence's first step; after a step of it that accepted nothing or drafted nothing,
        the next probe waits twice as many steps as the last (up to ``max_backoff`` after a rejection,
        ``max_idle_backoff`` after a step without drafts); one accepted token brings it back to the next step. A due
        probe runs only while the probes' predicted seconds stay within ``probe_budget`` of the rounds' measured
        time: a probe in a round that drafts anyway costs one position; one that sends a round through draft_model
        costs the hop too, and at high load that hop is paid by every sequence of the round.
        """
        rows = [_Row(i, inp.seq_id, inp.num_draft_tokens, inp.draft_tree) for i, inp in enumerate(inps) if inp.auto]
        if not rows:
            return list(inps)
        fixed = [inp for inp in inps if not inp.auto and inp.drafts]
        used = {inp.method for inp in fixed if inp.method in self.model_methods} | ({DRAFT_HOP} if fixed else set())
        positions = float(len(inps) + sum(inp.num_draft_tokens for inp in fixed))
        sequences = len(inps)
        tokens = float(len(inps))
        memo: dict[tuple[float, frozenset], float] = {}

        def cost(p: float, ms: set[str]) -> float:
            key = (p, frozenset(ms))
            if key not in memo:
                memo[key] = self.cost.predict(sequences, p, key[1])
            return memo[key]

        for r in rows:
            r.offers = {m: self.offer_rate(r.seq_id, m) for m in self.methods}
            for m in self.methods:
                r.alphas[m] = self.alpha(r.seq_id, m)
                if r.trees and m in self.tree_methods:
                    r.alphas[arm(m, True)] = self.alpha(r.seq_id, m, True)
                    r.ratios[m] = self.depth_ratio(r.seq_id, m)
        current = tokens / cost(positions, used)
        while True:
            best: tuple[float, _Row, str, bool, int, float, float] | None = None
            for r in rows:
                if r.k >= r.cap:
                    continue
                # its arms: each method's trees where the row allows them (a node budget of k reaches depth ratio x
                # k, each depth accepted with the trees' own rate), first so that they win a tie (before any evidence
                # a tree is its chain: trying it is free), then its chains; one more node once chosen
                arms = ([(r.method, r.tree)] if r.method else
                        [(m, t) for m in self.methods for t in (True, False) if not t or m in r.ratios])
                for m, tree in arms:
                    a, q = r.alphas[arm(m, tree)], r.offers[m]
                    ms = used | {DRAFT_HOP, m} if m in self.model_methods else used | {DRAFT_HOP}
                    for k in range(r.k + 1, (r.k + 2) if r.method else (r.cap + 1)):
                        # a proposer drafts only when it has something (q); then k positions more, expected_tokens
                        gain = q * (expected_tokens(a, r.ratios[m] * k if tree else k) - 1.0) - (r.gain - 1.0)
                        more = q * k - q * r.k
                        rate = (tokens + gain) / cost(positions + more, ms)
                        if best is None or rate > best[0]:
                            best = (rate, r, m, tree, k, gain, more)
            if best is None or best[0] <= current:
                break
            current, r, m, tree, k, gain, more = best
            positions += more
            tokens += gain
            r.method, r.tree, r.k, r.gain = m, tree, k, r.gain + gain
            used |= {DRAFT_HOP, m} if m in self.model_methods else {DRAFT_HOP}
        for r in rows:
            if r.k == 0 and r.cap > 0:
                seq = self.sequences.get(r.seq_id)
                steps = seq.steps if seq is not None else 0
                due = [m for m in self.methods if m not in self.model_methods
                       and (seq.probe_due.get(m, 0) if seq is not None else 0) <= steps]
                if due:  # a probe of the most promising method given up on, within the probes' budget
                    m = max(due, key=lambda m: r.alphas[m])
                    extra = cost(positions + r.offers[m], used | {DRAFT_HOP}) - cost(positions, used)
                    if not self.cost.forward:  # nothing measured yet: its cost is unknown, and learning it is the point
                        extra = 0.0
                    if self.probe_seconds + extra <= self.probe_budget * self.round_seconds or extra == 0.0:
                        r.method, r.tree, r.k = m, False, 1  # one node: a chain
                        self.probe_seconds += extra
                        positions += r.offers[m]
                        used |= {DRAFT_HOP}
        out = list(inps)
        for r in rows:
            method = r.method if r.k > 0 and r.method else NO_SPECULATION
            k = r.k if method != NO_SPECULATION else 0
            out[r.index] = replace(inps[r.index], method=method, num_draft_tokens=k, draft_tree=r.tree and k > 1)
        return out

    def observe(self, inps: Sequence[StepInputs], results: Sequence[StepResult | BaseException],
                seconds: float) -> None:
        """Learn from a finished round (``inps``: the steps as run, planned): each auto row's acceptance (its
        sequence's and the server's counts of the method it ran, and the method's probe schedule), and the round's
        time and its target forward's (the results' ``forward_seconds``) when no prompt was prefilled in it
        (:meth:`RoundCost.observe`). A row's positions are what the target computed: its tokens past those it
        reused (``cached_tokens``, else ``cached_len``) plus its drafts."""
        prefill = False
        positions = 0
        methods: set[str] = set()
        forward: float | None = None
        for inp, res in zip(inps, results):
            if isinstance(res, BaseException):
                prefill = True  # a failed row: its time says nothing
                continue
            cached = res.cached_tokens if res.cached_tokens is not None else inp.cached_len
            if res.prefilled is not None or cached < len(inp.token_ids) - 1:
                prefill = True
            if res.forward_seconds is not None:
                forward = max(forward or 0.0, res.forward_seconds)
            positions += 1 + (res.num_draft_tokens if res.prefilled is None else 0)
            if inp.drafts:  # the round went through draft_model
                methods.add(DRAFT_HOP)
            if res.num_draft_tokens and inp.method in self.model_methods:
                methods.add(inp.method)
            if inp.auto and res.prefilled is None:
                self._learn(inp, res)
        self.round_seconds += max(seconds, 0.0)
        if not prefill and inps:
            self.cost.observe(len(inps), positions, seconds, methods, forward)

    def _learn(self, inp: StepInputs, res: StepResult) -> None:
        """One committed auto step: the counts of the method and shape it drafted with (a tree arm's also the depth
        its tree reached per node), and that method's probe schedule."""
        seq = self.sequences.setdefault(inp.seq_id, _Sequence())
        seq.steps += 1
        m = inp.method
        if not inp.drafts or m not in self.server:
            return
        offered = seq.offers.setdefault(m, AcceptanceStats())
        offered.decay(self.decay)
        offered.add(1 if res.num_draft_tokens else 0, 1)
        self.server_offers[m].decay(self.server_decay)
        self.server_offers[m].add(1 if res.num_draft_tokens else 0, 1)
        if not res.num_draft_tokens:  # nothing to say this step (no match): asked again soon, a match may come
            back = min(2 * seq.backoff.get(m, 1), self.max_idle_backoff)
            seq.backoff[m] = back
            seq.probe_due[m] = seq.steps + back
            return
        depth = res.num_draft_tokens if res.draft_depth is None else res.draft_depth  # a tree: its deepest path
        succ, trials = step_trials(depth, min(len(res.output_ids) - 1, depth))
        name = arm(m, inp.draft_tree and m in self.tree_methods)
        for counts, factor in ((seq.stats.setdefault(name, AcceptanceStats()), self.decay),
                               (self.server[name], self.server_decay)):
            counts.decay(factor)
            counts.add(succ, trials)
        if name in self.server_depths:  # how deep its trees reach per node
            for counts, factor in ((seq.depths.setdefault(name, AcceptanceStats()), self.decay),
                                   (self.server_depths[name], self.server_decay)):
                counts.decay(factor)
                counts.add(depth, res.num_draft_tokens)
        back = 1 if succ else min(2 * seq.backoff.get(m, 1), self.max_backoff)
        seq.backoff[m] = back
        seq.probe_due[m] = seq.steps + back

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence."""
        self.sequences.pop(seq_id, None)


__all__ = ["AUTO", "TREE_ARM", "AcceptanceStats", "AutoController", "RoundCost", "arm", "expected_tokens",
           "step_trials"]
