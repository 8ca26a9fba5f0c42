"""The Medusa proposer: a round's drafts from one forward of the heads over the requests' last hidden states."""

from __future__ import annotations

from pathlib import Path

import torch

from ....sampling import NoisePurpose
from ...base import Proposal, ProposalRequest, draft_token, slot_outcomes
from ..base import HeadProposer
from ..target import TargetInfo
from .model import MedusaHead
from .published import load_medusa


class MedusaProposer(HeadProposer):
    """Drafts with published Medusa heads (``speculative_method=medusa``; vLLM's ``MedusaProposer``, FasterDecoding's
    top-1 candidates).

    A round's requests share one forward of the heads over their last hidden states (the state that predicted the
    last committed token): head i's distribution, after the request's processors and sampling transforms
    (:func:`~spec_decode.proposers.base.draft_token`), proposes slot i, and the draft is its argmax. Medusa's drafts
    are deterministic, so proposals carry no ``draft_probs`` (the verifier takes q one-hot, which keeps rejection
    sampling exact). A request drafts up to min(k, n) slots and stops at the first slot that fails
    :func:`~spec_decode.proposers.base.confident`; its score is the sum of its drafts' running probabilities. A
    request without hidden states (its first step) gets no drafts. The heads keep no per-sequence state.

    Args:
        head: a :class:`MedusaHead` (on its device and dtype).
        hidden_size: H, the target's hidden size.
        settings: the :class:`~.base.SpeculatorSettings` it is served with.
    """

    name = "medusa"
    head: MedusaHead

    @classmethod
    def load(cls, folder: Path, target: TargetInfo) -> MedusaHead:
        """:func:`load_medusa`.

        Raises:
            SpeculatorLoadError: naming the file and the key that does not fit.
        """
        return load_medusa(folder, target)

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """One proposal per request, in order: [k'] int64 drafts, k' <= min(k, n heads), ``draft_probs`` None, score
        the sum of the running products of the drafts' probabilities (empty without hidden states).

        Raises:
            ValueError: from a request's grammar (:func:`~spec_decode.proposers.base.draft_token`).
        """
        out = [Proposal.empty() for _ in requests]
        live, states = self.last_states(requests, self.hidden_size)
        if not live or states is None:
            return out
        ks = [min(requests[j].k, self.head.num_heads) for j in live]
        logits = self.head(states, max(ks))  # [n', B, V] float32 on the head's device
        vocab = logits.shape[-1]
        for row, (j, k) in enumerate(zip(live, ks)):
            r = requests[j]
            drafts: list[int] = []
            running, score = 1.0, 0.0
            for i in range(k):
                _, probs = draft_token(logits[i, row], r, NoisePurpose.MEDUSA, i, drafts, None, self.grammar, vocab,
                                       lazy=True)
                # the head's argmax (Medusa drafts its heads' top token), its confidence and probability: one read
                ((tok, passes, p_tok),) = slot_outcomes([(torch.argmax(probs), probs)], [running],
                                                        self.min_token_prob)
                if not passes:
                    break
                running *= p_tok
                drafts.append(tok)
                score += running
            if drafts:
                out[j] = Proposal(torch.tensor(drafts, dtype=torch.int64), None, score)
        return out
