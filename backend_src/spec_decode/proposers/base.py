"""The proposer contract: a round's sequences in, one proposal per sequence out.

Every proposer (draft LM, n-gram, suffix, hybrid; README "Adding a proposer") subclasses :class:`Proposer`. It follows
vLLM's ``SpeculativeProposer.get_spec_proposals`` (one call per batch of sequences, a proposal per sequence) and
transformers' candidate generators (``get_candidates`` and ``update_candidate_strategy``: the proposer picks how its
sequences' k changes from step to step, :meth:`Proposer.k_schedule`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..sampling import NoisePurpose, SamplingParams, generator_for, logits_to_probs, sample_from
from ..schedule import KSchedule, make_schedule
from ..settings import ConfigSettings


@dataclass
class Proposal:
    """Draft tokens for one sequence (vLLM ``SpeculativeProposals`` for a single row).

    Attributes:
        draft_token_ids: [k'] int64, k' <= k requested (k' may be 0: nothing to propose).
        draft_probs: [k', V] float32 distributions the drafts were sampled from, or None for proposers without
            probabilities (n-gram, suffix): the verifier then treats q as one-hot.
        score: the proposer's estimate of how many of the drafts the target will accept (suffix decoding's score,
            Arctic Inference), or None when it makes none. Hybrid reads it.
    """

    draft_token_ids: torch.Tensor
    draft_probs: torch.Tensor | None = None
    score: float | None = None

    @staticmethod
    def empty() -> Proposal:
        """A proposal with no draft tokens."""
        return Proposal(torch.empty(0, dtype=torch.int64), None)

    @staticmethod
    def of(tokens: list[int], score: float | None = None) -> Proposal:
        """Drafts without probabilities (model-free proposers): [len(tokens)] int64."""
        return Proposal(torch.tensor(tokens, dtype=torch.int64), None, score)


@dataclass(frozen=True)
class ProposalRequest:
    """One sequence's share of a round.

    Attributes:
        seq_id: sequence id (uint64), unique per generate request.
        token_ids: its committed ids (prompt + accepted output), length >= 1.
        k: the most draft tokens to propose (>= 1; the proposer may return fewer).
        params: the request's sampling parameters (with its seed).
        step: the sequence's step counter (0-based); with the seed it keys a sampling proposer's noise.
        hidden_states: [m, H] float32, the target's last hidden states at the m positions before the last token
            (:class:`~spec_decode.protocol.StepInputs`), or None; only proposers with ``needs_hidden_states`` get them.
    """

    seq_id: int
    token_ids: list[int]
    k: int
    params: SamplingParams
    step: int
    hidden_states: torch.Tensor | None = None


class Proposer:
    """Base class of the proposers: subclass it, give it a ``name`` and register it in :mod:`.registry`.

    Class attributes:
        name: the ``speculative_method`` clients send (lower case).
        Settings: its typed config.pbtxt parameters (a frozen :class:`~spec_decode.settings.ConfigSettings`
            dataclass; its ``PREFIX`` is prepended to every field's name in config.pbtxt).
        needs_hidden_states: True when it drafts from the target's hidden states: generate then sends a sequence's
            latest ones with its steps (``ProposalRequest.hidden_states``).
        GAUGES: Prometheus gauges it exports from draft_model (name -> help), values from :meth:`gauges`.

    Subclasses implement :meth:`propose`, and override :meth:`from_config` (by default ``cls(settings)``),
    :meth:`configured`, :meth:`check`, :meth:`observe`, :meth:`release`, :meth:`gauges` and :meth:`k_schedule` where
    the defaults do not fit. README, "Adding a proposer", walks through an example.
    """

    name: ClassVar[str] = ""
    Settings: ClassVar[type[ConfigSettings]] = ConfigSettings
    needs_hidden_states: ClassVar[bool] = False
    GAUGES: ClassVar[dict[str, str]] = {}

    @classmethod
    def from_config(cls, settings, served: dict[str, Proposer]) -> Proposer | None:
        """Build the proposer draft_model serves from its settings (``cls.Settings.from_params`` of config.pbtxt).

        Args:
            settings: an instance of ``cls.Settings``.
            served: name -> the proposers built before this one (registry order), for proposers composed of others
                (hybrid).

        Returns:
            The proposer, or None when it cannot be served with these settings (e.g. the draft LM without a model).

        Raises:
            ValueError: a setting out of range (naming the config parameter).
        """
        return cls(settings)

    @classmethod
    def configured(cls, settings) -> bool:
        """Whether draft_model serves this proposer with these settings, decided without loading anything (generate
        offers a method only then; the draft LM and the speculator need a model). By default: always."""
        return True

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:  # pragma: no cover - abstract
        """Propose drafts for a round's sequences (distinct seq_ids).

        Returns:
            one :class:`Proposal` per request, in order, each of at most ``request.k`` tokens.

        Raises:
            ValueError: an input the proposer cannot take. Any exception fails every request of the call (the rows of
                the round that name this method; the other methods' rows are served); :meth:`check` lets draft_model
                fail such a request alone beforehand.
        """
        raise NotImplementedError

    def propose_one(self, seq_id: int, token_ids: list[int], k: int, params: SamplingParams | None = None,
                    step: int = 0, hidden_states: torch.Tensor | None = None) -> Proposal:
        """:meth:`propose` for one sequence (``params`` None = greedy); an empty proposal when ``k`` <= 0 (tests,
        benchmarks and the in-process transport)."""
        if k <= 0:
            return Proposal.empty()
        return self.propose([ProposalRequest(seq_id, list(token_ids), k, params or SamplingParams(), step,
                                             hidden_states)])[0]

    def observe(self, requests: list[ProposalRequest]) -> None:
        """Take in a round's steps that this proposer does not draft (a composed proposer, hybrid, drafted them with
        another): a proposer with per-sequence state built from each step (the EAGLE head's contexts) updates it.
        By default: nothing."""

    def check(self, request: ProposalRequest) -> None:
        """Raise ValueError if ``request`` cannot be proposed for (draft_model then fails that request alone)."""

    def release(self, seq_id: int, final_token_ids: list[int] | None = None) -> None:
        """Free the per-sequence state of ``seq_id`` (idempotent). ``final_token_ids``: its last committed ids, when
        known (suffix decoding adds the whole response to its cache of responses)."""

    def gauges(self) -> dict[str, float]:
        """Current values of the gauges named in ``GAUGES``."""
        return {}

    @classmethod
    def k_schedule(cls, configured: str, max_k: int) -> KSchedule:
        """How k changes over a sequence's steps with this proposer (transformers' ``update_candidate_strategy``).

        Args:
            configured: generate's ``num_draft_tokens_schedule`` ("constant" or "heuristic").
            max_k: generate's ``max_num_draft_tokens``.

        Returns:
            By default the configured schedule (:func:`~.schedule.make_schedule`).
        """
        return make_schedule(configured, max_k)


def draft_token(logits: torch.Tensor, request: ProposalRequest, purpose: NoisePurpose,
                slot: int) -> tuple[int, torch.Tensor]:
    """One draft token from a model proposer's logits under the request's sampling.

    Args:
        logits: [N] the proposer's logits for the slot (over its own, possibly pruned, vocabulary).
        request: the sequence's request (its sampling parameters, seed and step).
        purpose: the proposer's noise purpose (one per proposer, so two proposers never share noise).
        slot: the draft's index in the step (0-based).

    Returns:
        (token index in [0, N), probs [N] float32 after the request's temperature / top-k / top-p): the argmax when
        greedy, else a draw keyed by (seed, step, purpose, slot) (:func:`~spec_decode.sampling.generator_for`), so a
        seeded request's drafts are reproducible. The verifier needs those ``probs`` for rejection sampling.
    """
    probs = logits_to_probs(logits, request.params)
    if request.params.is_greedy:
        return int(torch.argmax(probs)), probs
    return sample_from(probs, generator_for(request.params.seed, request.step, purpose, slot)), probs


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
