"""The proposer contract: a round's sequences in, one proposal per sequence out.

Every proposer (draft LM, n-gram, suffix, EAGLE head, hybrid) subclasses :class:`Proposer`; CONTRIBUTING.md, "Adding
a proposer", documents the contract with an example. It follows vLLM's ``SpeculativeProposer.get_spec_proposals`` (one
call per batch of sequences, a proposal per sequence) and transformers' candidate generators (``get_candidates`` and
``update_candidate_strategy``: the proposer picks how its sequences' k changes from step to step,
:meth:`Proposer.k_schedule`). :func:`draft_token` and :func:`confident` are the helpers model proposers share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import torch

from ..processors import ProcessorSpec, process_logits
from ..sampling import (
    NoisePurpose,
    SamplingParams,
    coupled_exponentials,
    generator_for,
    logits_to_probs,
    race,
    sample_from,
)
from ..scheduler.k_schedule import KSchedule, make_schedule
from ..settings import ConfigSettings
from ..tree import is_chain

if TYPE_CHECKING:
    from ..processors.grammar import GrammarCache


@dataclass
class Proposal:
    """Draft tokens for one sequence (vLLM ``SpeculativeProposals`` for a single row).

    Attributes:
        draft_token_ids: [k'] int64, k' <= k requested (k' may be 0: nothing to propose).
        draft_probs: [k', V] float32, the distributions the drafts were sampled from over the target's vocabulary V,
            or None for proposers without probabilities (n-gram, suffix): the verifier then treats q as one-hot.
        score: the proposer's estimate of how many of the drafts the target will accept (suffix decoding's score,
            Arctic Inference), or None when it makes none. Hybrid reads it.
        draft_parents: [k'] int64, each draft's parent among the drafts (-1: the last committed token), in
            topological order with distinct siblings (:mod:`spec_decode.tree`), or None: a chain. Only for a request
            with ``tree`` set. With ``draft_probs``, row i is the distribution node i was drawn from, before its earlier
            siblings were taken out (the verifier draws the siblings without replacement: Jeon et al. 2024).
    """

    draft_token_ids: torch.Tensor
    draft_probs: torch.Tensor | None = None
    score: float | None = None
    draft_parents: torch.Tensor | None = None

    @staticmethod
    def empty() -> Proposal:
        """A proposal with no draft tokens."""
        return Proposal(torch.empty(0, dtype=torch.int64), None)

    @staticmethod
    def of(tokens: list[int], score: float | None = None, parents: list[int] | None = None) -> Proposal:
        """Drafts without probabilities (model-free proposers): [len(tokens)] int64, a tree when ``parents`` is given
        and is not a chain."""
        tree = None if is_chain(parents) else torch.tensor(parents, dtype=torch.int64)
        return Proposal(torch.tensor(tokens, dtype=torch.int64), None, score, tree)


@dataclass(frozen=True)
class ProposalRequest:
    """One sequence's share of a round.

    Attributes:
        seq_id: sequence id (uint64), unique per generate request.
        token_ids: its committed ids (prompt + accepted output), length >= 1, each in [0, 2^31).
        k: the most draft tokens to propose (>= 1; the proposer may return fewer).
        params: the request's sampling parameters (with its seed).
        step: the sequence's step counter (0-based); with the seed it keys a sampling proposer's noise.
        hidden_states: [m, H] float32, the target's last hidden states at the m positions before the last token
            (those the previous step scored and accepted; :class:`~spec_decode.protocol.StepInputs`), or None (a
            sequence's first step); only proposers with ``needs_hidden_states`` get them.
        processors: the request's logits processors (:mod:`spec_decode.processors`), or None: a model proposer
            applies them to its own distribution (:func:`draft_token`), so it does not draft tokens the target
            would give probability zero.
        tree: the proposer may return a tree of at most ``k`` nodes (``Proposal.draft_parents``); else a chain.
        tree_top_k: the tree's children per expanded node (EAGLE-2's ``top_k``; the draft LM's branches), or 0: the
            proposer's configured width (:meth:`tree_shape`).
        tree_depth: the tree's levels at most (EAGLE-2's ``depth``), or 0: the proposer's configured depth.
    """

    seq_id: int
    token_ids: list[int]
    k: int
    params: SamplingParams
    step: int
    hidden_states: torch.Tensor | None = None
    processors: ProcessorSpec | None = None
    tree: bool = False
    tree_top_k: int = 0
    tree_depth: int = 0

    def tree_shape(self, top_k: int, depth: int) -> tuple[int, int]:
        """(children per expanded node, levels at most) of this request's tree: its own ``tree_top_k`` and
        ``tree_depth`` where set (> 0), else the proposer's configured ``top_k`` and ``depth``; the levels are capped
        by ``k`` (a depth of 0 means up to ``k``)."""
        depth = self.tree_depth or depth or self.k
        return self.tree_top_k or top_k, min(depth, self.k)

    def position(self, slot: int) -> int:
        """The absolute position of the draft at ``slot`` (0-based) of this step: ``len(token_ids) + slot``, the index
        it would have in the sequence's token ids (what keys a seeded request's coupled race)."""
        return len(self.token_ids) + slot

    @property
    def coupled(self) -> bool:
        """Whether the request's sampled drafts are drawn with the target's coupled noise: seeded and not greedy
        (:func:`draft_token`; the verifier's coupled race, :func:`spec_decode.verifier.rejection.coupled_sample`)."""
        return self.params.seeded and not self.params.is_greedy


class Proposer:
    """Base class of the proposers: subclass it, give it a ``name`` and register it in :mod:`.registry`.

    The hooks below are the whole contract; CONTRIBUTING.md walks through an example. draft_model builds the served
    proposers once (:func:`~.registry.build_proposers`); Triton runs one ``execute()`` of a model instance at a time,
    so no hook is called concurrently with another.

    Class attributes:
        name: the ``speculative_method`` clients send (lower case, unique in the registry).
        Settings: its config.pbtxt parameters, a frozen :class:`~spec_decode.settings.ConfigSettings` dataclass
            (field defaults are the parameters' defaults; its ``PREFIX`` is prepended to each field's name). Default:
            ``ConfigSettings``, no parameters.
        needs_hidden_states: True when it drafts from the target's hidden states: generate then sends each drafting
            step its sequence's latest ones (``context_hidden_states`` on the wire; ``ProposalRequest.hidden_states``
            here). Default False.
        GAUGES: the Prometheus gauges it exports from draft_model, name -> help text; values from :meth:`gauges`.
            Default none.
        applies_processors: True when it drafts from its own distribution through :func:`draft_token`, which applies
            the request's logits processors (draft_model then gives it ``grammar``, its grammar matchers, for
            structured output). Default False (the target rejects the drafts the processors forbid).
        tree_widths: True when its trees take a width, ``tree_top_k`` (the heads, the draft LM): ``auto`` chooses
            it per step. Default False (the model-free proposers' trees follow their matches).
        greedy_trees: True when it drafts trees for greedy requests only (:meth:`takes_tree`: the proposers whose
            chains are drawn); ``auto`` then offers it a sampled request's steps as chains. Default False.

    Subclasses implement :meth:`propose` and override, where the defaults do not fit: :meth:`from_config` (default
    ``cls(settings)``), :meth:`configured` (default True), :meth:`check`, :meth:`observe` and :meth:`release`
    (default: nothing), :meth:`gauges` (default: none) and :meth:`k_schedule` (default: generate's configured one).
    """

    name: ClassVar[str] = ""
    Settings: ClassVar[type[ConfigSettings]] = ConfigSettings
    needs_hidden_states: ClassVar[bool] = False
    GAUGES: ClassVar[dict[str, str]] = {}
    applies_processors: ClassVar[bool] = False  # drafts from a distribution through draft_token (draft LM, EAGLE)
    tree_widths: ClassVar[bool] = False  # its trees take a width (tree_top_k)
    greedy_trees: ClassVar[bool] = False  # it drafts trees for greedy requests only (:meth:`takes_tree`)
    grammar: GrammarCache | None = None  # draft_model's grammar matchers, set on proposers that apply processors

    def __init__(self, settings: ConfigSettings | None = None) -> None:
        """Keeps nothing: a subclass's constructor takes what its :meth:`from_config` passes (by default its
        ``Settings``)."""

    @classmethod
    def from_config(cls, settings, served: dict[str, Proposer]) -> Proposer | None:
        """Build the proposer draft_model serves (called once, by :func:`~.registry.build_proposers`).

        Args:
            settings: ``cls.Settings.from_params`` of draft_model's config parameters (already checked).
            served: name -> the proposers built before this one (registry order), for a proposer composed of others
                (hybrid).

        Returns:
            The proposer, or None when these settings serve none (the draft LM without a model): the method is then
            not served, and must not be offered (:meth:`configured` returns False for the same settings).

        Raises:
            ValueError: settings it cannot be served with (naming the config parameter); draft_model fails to load.
            FileNotFoundError: a model folder that does not exist.
        """
        return cls(settings)

    @classmethod
    def configured(cls, settings) -> bool:
        """Whether :meth:`from_config` would serve a proposer with these settings, decided without loading anything:
        generate offers the method only then (:func:`~.registry.offered_methods`). Default True."""
        return True

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:  # pragma: no cover - abstract
        """Propose drafts for a round's sequences: one call per ``execute()`` of draft_model with every row that
        names this method (or, for a composed proposer's part, the rows it hands on).

        Args:
            requests: distinct ``seq_id`` s, each with ``k`` >= 1 (in draft_model, each has passed :meth:`check`).

        Returns:
            one :class:`Proposal` per request, in order, of at most ``request.k`` tokens (0 is allowed). A proposer
            that samples its drafts returns the distributions it sampled from as ``draft_probs`` [k', V] float32 over
            the target's vocabulary, after the request's sampling transforms
            (:func:`~spec_decode.sampling.logits_to_probs`), so that rejection sampling stays exact
            (:func:`draft_token`). A seeded request's drafts must depend on the request alone (its ids, seed and
            step), or its sampled output stops being reproducible.

        Raises:
            ValueError: an input it cannot take. Any exception fails every row of the call (the other methods' rows
                are served); :meth:`check` lets one row fail alone beforehand.
        """
        raise NotImplementedError

    def propose_one(self, seq_id: int, token_ids: list[int], k: int, params: SamplingParams | None = None,
                    step: int = 0, hidden_states: torch.Tensor | None = None,
                    processors: ProcessorSpec | None = None, tree: bool = False, tree_top_k: int = 0,
                    tree_depth: int = 0) -> Proposal:
        """:meth:`propose` for one sequence (``params`` None: greedy), for tests, benchmarks and the in-process
        transport; an empty proposal when ``k`` <= 0."""
        if k <= 0:
            return Proposal.empty()
        return self.propose([ProposalRequest(seq_id, list(token_ids), k, params or SamplingParams(), step,
                                             hidden_states, processors, tree, tree_top_k, tree_depth)])[0]

    def check(self, request: ProposalRequest) -> None:
        """Raise ValueError (:class:`~spec_decode.settings.InvalidInputError`, naming the input) when ``request``
        cannot be proposed for: draft_model then fails that row alone. Default: every request passes."""

    def takes_tree(self, request: ProposalRequest) -> bool:
        """Whether this proposer drafts ``request`` as a tree: it takes trees (``tree``), and, for a proposer whose
        chains are drawn from its distribution (``greedy_trees``), it is greedy. A sampled request then gets a chain:
        its drafts drawn from q (raced against the target's own noise when seeded) are accepted with min(1, p/q),
        which a tree's chosen nodes (one-hot q, accepted with p) fall far short of; both are exact. ``auto`` reads
        the same ``greedy_trees``."""
        return request.tree and (request.params.is_greedy or not self.greedy_trees)

    def observe(self, requests: list[ProposalRequest]) -> None:
        """Take in steps that a composed proposer (hybrid) drafted with another proposer, so that per-sequence state
        built from every step (the EAGLE head's contexts) stays whole. Default: nothing."""

    def release(self, seq_id: int, final_token_ids: list[int] | None = None) -> None:
        """Free the per-sequence state of ``seq_id``: called for every served proposer on every release, so it must
        accept ids it never saw, and twice (idempotent). ``final_token_ids``: the sequence's last committed ids, or
        None when the release carried none (suffix decoding adds the response to its cache of responses)."""

    def gauges(self) -> dict[str, float]:
        """Current values of the gauges named in ``GAUGES`` (read after every ``execute()``)."""
        return {}

    @classmethod
    def k_schedule(cls, configured: str, max_k: int) -> KSchedule:
        """How k changes over a sequence's steps with this proposer (transformers' ``update_candidate_strategy``);
        generate calls it once per request.

        Args:
            configured: generate's ``num_draft_tokens_schedule`` (``constant`` or ``heuristic``).
            max_k: generate's ``max_num_draft_tokens``.

        Returns:
            By default the configured schedule (:func:`~spec_decode.scheduler.k_schedule.make_schedule`).
        """
        return make_schedule(configured, max_k)


def draft_token(logits: torch.Tensor, request: ProposalRequest, purpose: NoisePurpose, slot: int,
                drafts: list[int] | None = None, column_ids: torch.Tensor | None = None,
                grammar: GrammarCache | None = None, vocab_size: int | None = None,
                lazy: bool = False) -> tuple[int | torch.Tensor, torch.Tensor]:
    """One draft token from a model proposer's logits under the request's processors and sampling.

    Args:
        logits: [N] the proposer's logits for the slot (over its own, possibly pruned, vocabulary).
        request: the sequence's request (its sampling parameters, seed, step and processors).
        purpose: the proposer's noise purpose (one per proposer, so two proposers never share noise).
        slot: the draft's index in the step (0-based).
        drafts: the target ids drafted before this slot in this step (the processors' prefix is ``token_ids +
            drafts``).
        column_ids: [N] int64, the target id of each logits column (a pruned vocabulary), or None (column = id).
        grammar: the process's grammar matchers; without them a request's guide is not applied to the draft (the
            target still enforces it).
        vocab_size: the target's vocabulary size V (a coupled draft races the noise of V tokens, gathered at
            ``column_ids``), or None: ``max(column_ids) + 1``, or N without ``column_ids``.
        lazy: a greedy row's token as a 0-dim int64 tensor on the logits' device, not read by the host (the caller
            reads a slot's tokens in one copy: :func:`slot_outcomes`).

    Returns:
        (token index in [0, N), probs [N] float32 after the request's processors and temperature / top-k / top-p):
        the argmax when greedy; for a seeded sampled request (:attr:`ProposalRequest.coupled`) the exponential race
        of ``probs`` with the noise the verifier's torch path races the target with at the draft's absolute position
        (:func:`~spec_decode.sampling.coupled_exponentials`, over the target's ids: Daliri et al. 2024), so the draft
        equals the target's token whenever both races agree; else a draw keyed by (seed, step, purpose, slot)
        (:func:`~spec_decode.sampling.generator_for`). Either is an exact draw from ``probs``, so a seeded request's
        drafts are reproducible and the verifier's rejection sampling (which needs those ``probs``) stays exact.

    Raises:
        ValueError: from the grammar (:func:`~spec_decode.processors.process_logits`).
    """
    probs = draft_distribution(logits, request, drafts, column_ids, grammar)
    if request.params.is_greedy:
        best = torch.argmax(probs)
        return (best if lazy else int(best)), probs
    if request.coupled:
        n = probs.shape[-1]
        cols = None if column_ids is None else column_ids.cpu()
        size = vocab_size if vocab_size is not None else (n if cols is None or not len(cols) else int(cols.max()) + 1)
        e = coupled_exponentials(request.params.seed, request.position(slot), max(size, n if cols is None else 0))
        return race(probs, e[:n] if cols is None else e[cols], lazy), probs
    return sample_from(probs, generator_for(request.params.seed, request.step, purpose, slot)), probs


def by_shape(count: int, trees: list[int], draft_chains: Callable[[list[int]], list[Proposal]],
             draft_trees: Callable[[list[int]], list[Proposal]]) -> list[Proposal]:
    """The proposals of a round's ``count`` rows when the rows ``trees`` (indices, ascending) draft trees and the
    others chains: ``draft_chains(rows)`` and ``draft_trees(rows)`` each return their rows' proposals in order (a part
    without rows is not asked)."""
    out = [Proposal.empty() for _ in range(count)]
    tree_rows = set(trees)
    for part, drafted in (([j for j in range(count) if j not in tree_rows], draft_chains), (trees, draft_trees)):
        if part:
            for j, proposal in zip(part, drafted(part)):
                out[j] = proposal
    return out


def draft_distribution(logits: torch.Tensor, request: ProposalRequest, drafts: list[int] | None = None,
                       column_ids: torch.Tensor | None = None, grammar: GrammarCache | None = None) -> torch.Tensor:
    """A model proposer's distribution for one slot: ``logits`` [N] under the request's processors (the prefix being
    ``token_ids + drafts``) and its temperature / top-k / top-p, -> probs [N] float32. What :func:`draft_token` draws
    from, and what the candidate trees rank (they pick their nodes by probability and draw nothing).

    Raises:
        ValueError: from the grammar (:func:`~spec_decode.processors.process_logits`).
    """
    spec = request.processors
    if spec is not None and spec.changes_logits:
        if spec.guide_type and grammar is None:
            spec = replace(spec, guide_type="", guide="")
        logits = process_logits(logits[None], spec, list(request.token_ids) + list(drafts or ()), (), grammar,
                                request.seq_id, column_ids)[0]
    return logits_to_probs(logits, request.params)


def slot_outcomes(picks: list[tuple[int | torch.Tensor, torch.Tensor]], running: list[float],
                  min_token_prob: float) -> list[tuple[int, bool, float]]:
    """A drafting slot's outcome for each row, read by the host in one copy: the rows' tokens, whether each passes
    :func:`confident` and each token's probability, computed on the device and copied together (on CUDA a read per
    row and per value would each wait for the device).

    Args:
        picks: per row, (token index: an int or a 0-dim tensor from :func:`draft_token` with ``lazy``, probs [N]).
        running: per row, the product of its drafts' probabilities so far.
        min_token_prob: the confidence threshold.

    Returns:
        per row, (token index, passes, probs[token] as a Python float): the values :func:`confident` and
        ``float(probs[token])`` give (computed in float64, as the host computes them).
    """
    if not picks:
        return []
    cols = []
    for (tok, probs), run in zip(picks, running):
        t = tok if isinstance(tok, torch.Tensor) else torch.tensor(tok, device=probs.device)
        p = probs.double()
        passes = torch.isfinite(probs).all() & (p.max() * run >= min_token_prob)
        cols.append(torch.stack([t.double(), passes.double(), p.gather(0, t.reshape(1))[0]]))  # no __index__
    host = torch.stack(cols).cpu().tolist()
    return [(int(t), bool(ok), prob) for t, ok, prob in host]


def top_k_to_host(probs: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Each row's ``k`` most probable entries of ``probs`` [R, N] (any float dtype and device), read by the host in
    one copy (ids beside probabilities in float64, which holds both exactly): (probabilities [R][k] in decreasing
    order, their indices [R][k]). The candidate trees of the heads read their top-k this way."""
    top = torch.topk(probs.float(), k, dim=-1)
    host = torch.cat([top.values.double(), top.indices.double()], dim=-1).cpu().tolist()
    return [row[:k] for row in host], [[int(x) for x in row[k:]] for row in host]


def confident(running: float, probs: torch.Tensor, min_token_prob: float) -> bool:
    """Whether a step drafts its next slot: ``running`` (the product of its drafts' probabilities so far) times the
    slot's top probability is >= ``min_token_prob``, and ``probs`` [N] is finite (dynamic draft length: EAGLE-2's
    confidence, transformers' ``assistant_confidence_threshold``).

    Every draft slot costs a scored position whether accepted or not, so an unsure proposer should stop early. The rule
    reads the distribution, never the token sampled from it: a rule that kept a sampled draft only when its own
    probability was high would draft from q cut to its likely tokens while reporting q, and rejection sampling would
    lose the target's law. (For greedy rows the top probability is the draft's own.) As a top probability is at most
    1, no slot passes once ``running`` is below ``min_token_prob``: proposers skip its forward.
    """
    return bool(torch.isfinite(probs).all()) and running * float(probs.max()) >= min_token_prob
