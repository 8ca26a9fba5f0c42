"""``speculative_method=auto``: per sequence and per step, the proposer and k that maximise the round's goodput.

Speculation pays only when the tokens it adds are worth more than the positions it makes the target score. The rule
(docs/auto.md) is the goodput rule of SmartSpec (Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large
Language Models Using Goodput", arXiv:2406.14066): choose the draft lengths that maximise the expected tokens a
round emits per second of round time. With a per-token acceptance rate alpha, a step that drafts k tokens emits
``(1 - alpha**(k+1)) / (1 - alpha)`` tokens in expectation (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding", eq. 1), and the round costs ``c(P)`` seconds for the P positions it scores.

Three parts, no I/O (the round's :class:`~.plan.Scheduler` feeds them, in generate and in process alike):

- :class:`~.acceptance.AcceptanceStats`: each sequence's acceptance per proposer and shape, as decayed Bernoulli
  counts, with a prior from the server's recent acceptance of that proposer (what a sequence that has not tried it
  starts from), and probes with exponential backoff of a proposer the rule left;
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
from .acceptance import TREE_ARM, AcceptanceStats, arm, expected_tokens, step_trials
from .round_cost import DRAFT_HOP, RoundCost

AUTO_TREE_TOP_KS = (2, 4, 8)
"""The widths (``tree_top_k``) among which auto chooses the trees of a proposer whose trees have one (the EAGLE, Medusa,
MLP and Arctic heads, the draft LM), unless the request sets its own."""


@dataclass
class _Row:
    """One auto row being planned: its cap, choice (method and shape) and expected tokens."""

    index: int
    seq_id: int
    cap: int
    trees: frozenset[str]  # the methods that may draft it a tree (the request allows trees; greedy for some)
    top_k: int  # the request's own tree width (0: auto chooses)
    method: str | None = None
    tree: bool = False
    k: int = 0
    gain: float = 1.0  # expected tokens of its step so far
    alphas: dict[str, float] = field(default_factory=dict)  # arm -> per-depth acceptance estimate
    offers: dict[str, float] = field(default_factory=dict)  # method -> estimated chance that it drafts at all
    ratios: dict[str, float] = field(default_factory=dict)  # tree method -> its trees' depth per node
    widths: dict[str, int] = field(default_factory=dict)  # tree method -> the width its tree would take (0: none)


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
        greedy_tree_methods: those of ``tree_methods`` that draft trees only for greedy requests (the proposers whose
            chains are drawn: :meth:`spec_decode.proposers.base.Proposer.takes_tree`); a sampled row takes them as
            chains.
        width_methods: those of ``tree_methods`` whose trees take a width (``tree_top_k``): auto chooses it among
            ``tree_top_ks`` per step, each width an arm of its own (a request's own ``tree_top_k`` is kept).
        tree_top_ks: those widths, each in [1, 10].
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
        ValueError: a factor outside (0, 1], a negative prior_weight, a backoff < 1, a model method not in
            methods, a greedy-tree or width method not in tree_methods, or no widths.
    """

    def __init__(self, methods: Sequence[str], model_methods: Collection[str] = (), tree_methods: Collection[str] = (),
                 greedy_tree_methods: Collection[str] = (), width_methods: Collection[str] = (),
                 tree_top_ks: Sequence[int] = AUTO_TREE_TOP_KS, decay: float = 0.9, prior_weight: float = 1.0,
                 server_decay: float = 0.99, max_backoff: int = 32, max_idle_backoff: int = 4,
                 cost: RoundCost | None = None, probe_budget: float = 0.05):
        if (not (0.0 < decay <= 1.0 and 0.0 < server_decay <= 1.0) or prior_weight < 0
                or min(max_backoff, max_idle_backoff) < 1 or not 0.0 <= probe_budget <= 1.0):
            raise ValueError(f"decay and server_decay must be in (0, 1], prior_weight >= 0, backoffs >= 1, "
                             f"probe_budget in [0, 1]; got {decay}, {server_decay}, {prior_weight}, {max_backoff}, "
                             f"{max_idle_backoff}, {probe_budget}")
        self.methods = tuple(m for m in methods if m not in (NO_SPECULATION, AUTO))
        if not set(model_methods) | set(tree_methods) <= set(self.methods) or not (
                set(greedy_tree_methods) | set(width_methods) <= set(tree_methods)) or not tree_top_ks:
            raise ValueError(f"model and tree methods must be among {self.methods}, greedy-tree and width methods "
                             f"among the tree methods, with widths")
        self.model_methods, self.tree_methods = frozenset(model_methods), frozenset(tree_methods)
        self.greedy_tree_methods = frozenset(greedy_tree_methods)
        self.width_methods = frozenset(width_methods)
        self.widths = {m: tuple(tree_top_ks) if m in self.width_methods else (0,) for m in self.tree_methods}
        self.decay, self.server_decay = decay, server_decay
        self.prior_weight = prior_weight
        self.max_backoff, self.max_idle_backoff = max_backoff, max_idle_backoff
        self.cost = cost or RoundCost()
        self.probe_budget = probe_budget
        self.round_seconds = 0.0  # measured seconds of every round observed
        self.probe_seconds = 0.0  # predicted seconds the probes planned so far added to their rounds
        self.server: dict[str, AcceptanceStats] = {m: AcceptanceStats() for m in self.methods}
        self.server_depths: dict[str, AcceptanceStats] = {}  # tree arm -> its trees' (depth, nodes) sums
        for m, widths in self.widths.items():
            for w in widths:
                self.server[arm(m, True, w)] = AcceptanceStats()
                self.server_depths[arm(m, True, w)] = AcceptanceStats()
        self.server_offers: dict[str, AcceptanceStats] = {m: AcceptanceStats() for m in self.methods}
        self.sequences: dict[int, _Sequence] = {}

    def alpha(self, seq_id: int, method: str, tree: bool = False, top_k: int = 0) -> float:
        """The per-token acceptance estimate of ``method`` for ``seq_id`` (``tree``: per depth of its trees of width
        ``top_k``): its decayed counts, with the server's recent mean (:meth:`AcceptanceStats.mean`) as a prior worth
        ``prior_weight`` trials. A tree arm the server has not seen yet starts from the chain's estimate (a tree
        holds the chain's path and more)."""
        name = arm(method, tree, top_k)
        seq = self.sequences.get(seq_id)
        mine = seq.stats.get(name) if seq is not None else None
        server = self.server.get(name, AcceptanceStats())  # (none yet for a width a request set itself)
        if tree and not server.trials and mine is None:
            return self.alpha(seq_id, method)
        return self._estimate(mine, server)

    def depth_ratio(self, seq_id: int, method: str, top_k: int = 0) -> float:
        """The depth a tree of ``method`` (width ``top_k``) reaches per node of its budget, for ``seq_id``: its
        trees' decayed (depth, nodes) sums, with the server's as a prior worth ``prior_weight`` trees, and 1 (a
        chain) before any tree; in (0, 1]."""
        server = self.server_depths.get(arm(method, True, top_k), AcceptanceStats())
        prior = (server.successes + 1.0) / (server.trials + 1.0)  # one chain-like tree of one node as the prior
        seq = self.sequences.get(seq_id)
        mine = seq.depths.get(arm(method, True, top_k)) if seq is not None else None
        w = self.prior_weight
        if mine is None or mine.trials + w <= 0:
            return prior
        return min(1.0, (mine.successes + w * prior) / (mine.trials + w))

    def tree_width(self, seq_id: int, method: str, widths: Sequence[int], cap: int) -> tuple[int, float, float]:
        """The width of ``method``'s trees for ``seq_id`` at a node budget of ``cap``, as (width, per-depth
        acceptance, depth per node): a width the server has never drafted is tried first (in the order given), then
        the one whose trees are expected to emit the most tokens (:func:`expected_tokens` at its depth per node x
        ``cap``)."""
        def value(w: int) -> tuple[bool, float, float, float]:
            a, ratio = self.alpha(seq_id, method, True, w), self.depth_ratio(seq_id, method, w)
            untried = not self.server.get(arm(method, True, w), AcceptanceStats()).trials
            return untried, expected_tokens(a, ratio * cap), a, ratio

        values = {w: value(w) for w in widths}
        best = max(widths, key=lambda w: values[w][:2])
        return best, values[best][2], values[best][3]

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

        The shape: a row that allows trees (``draft_tree``) may take each tree method (``tree_methods``; for a sampled
        row, not ``greedy_tree_methods``) as a chain or as a tree of k nodes. A tree counts with its own acceptance
        per depth (:meth:`alpha` with ``tree``) over the depth its trees reach per node (:meth:`depth_ratio` x k), so
        a tree wins where its branches raise the acceptance per depth more than their nodes cost in depth; the chosen
        step carries ``draft_tree`` accordingly. Before any evidence a tree counts as its chain, and a tie goes to the
        tree (so trees are tried, and kept only while they pay). Where the trees take a width (``width_methods``),
        each width is an arm of its own and the row's tree takes the width :meth:`tree_width` picks (the request's
        own ``tree_top_k`` where it sets one); the step carries it as ``tree_top_k``. The depth stays the request's
        or the config's (``tree_depth``): at a node budget of k, EAGLE-2's rerank already keeps the deepest nodes
        that pay, and the depth bounds only the proposer's forwards.

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
        rows = [_Row(i, inp.seq_id, inp.num_draft_tokens, self._tree_methods(inp), inp.tree_top_k)
                for i, inp in enumerate(inps) if inp.auto]
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
                if m in r.trees:  # the width its tree would take (the request's own, else auto's choice)
                    widths = (r.top_k,) if r.top_k and m in self.width_methods else self.widths[m]
                    r.widths[m], r.alphas[arm(m, True)], r.ratios[m] = self.tree_width(r.seq_id, m, widths, r.cap)
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
            tree = r.tree and k > 1
            out[r.index] = replace(inps[r.index], method=method, num_draft_tokens=k, draft_tree=tree,
                                   tree_top_k=r.widths[method] if tree else inps[r.index].tree_top_k)
        return out

    def _tree_methods(self, inp: StepInputs) -> frozenset[str]:
        """The methods that may draft ``inp`` a tree: none unless it allows trees; for a sampled request, those that
        draft trees for sampled requests too."""
        if not inp.draft_tree:
            return frozenset()
        return self.tree_methods if inp.params.is_greedy else self.tree_methods - self.greedy_tree_methods

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
        tree = inp.draft_tree and m in self._tree_methods(inp)
        name = arm(m, tree, inp.tree_top_k if tree and m in self.width_methods else 0)
        for counts, factor in ((seq.stats.setdefault(name, AcceptanceStats()), self.decay),
                               (self.server.setdefault(name, AcceptanceStats()), self.server_decay)):
            counts.decay(factor)
            counts.add(succ, trials)
        if tree:  # how deep its trees reach per node
            for counts, factor in ((seq.depths.setdefault(name, AcceptanceStats()), self.decay),
                                   (self.server_depths.setdefault(name, AcceptanceStats()), self.server_decay)):
                counts.decay(factor)
                counts.add(depth, res.num_draft_tokens)
        back = 1 if succ else min(2 * seq.backoff.get(m, 1), self.max_backoff)
        seq.backoff[m] = back
        seq.probe_due[m] = seq.steps + back

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence."""
        self.sequences.pop(seq_id, None)


__all__ = ["AUTO", "AUTO_TREE_TOP_KS", "TREE_ARM", "AcceptanceStats", "AutoController", "RoundCost", "arm",
           "expected_tokens", "step_trials"]
