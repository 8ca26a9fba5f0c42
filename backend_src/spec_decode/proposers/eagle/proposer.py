"""The EAGLE proposers (``speculative_method=eagle`` and ``eagle3``; vLLM's ``EagleProposer``): draft with an
:class:`~.model.EagleHead` (EAGLE-1/2) or an :class:`~.eagle3.Eagle3Head` from the target's hidden states, which travel
with the steps.

Drafting from committed tokens x_0..x_n: the pairs j < n come from the target, and the last of them drafts x_{n+1};
then pair n is (a_{n-1} in place of f_n, the drafted token), and so on: the head feeds its own output back, as it was
trained (EAGLE-3's "training-time test": :func:`spec_decode.training.speculator.unrolled_outputs`). The probabilities
are scattered back to the target's vocabulary, zero elsewhere, so rejection sampling stays exact.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...engine.draft_vocab import DraftVocab
from ...sampling import NoisePurpose
from ...sequences import SequenceLRU, common_prefix_len
from ...settings import InvalidInputError
from ..base import Proposal, ProposalRequest, Proposer, by_shape, draft_token, slot_outcomes
from ..speculators.base import SpeculatorSettings, check_hidden_states, head_served, load_served_head, place_head
from ..speculators.layouts import aux_hidden_state_layers
from ..speculators.target import TargetInfo
from .context import EagleContext, HeadKV
from .eagle3 import Eagle3Head
from .eagle3_published import load_eagle3
from .model import EagleHead
from .published import load_eagle1
from .tree import draft_trees


class EagleProposer(Proposer):
    """Drafts with an EAGLE head from the target's hidden states: ``speculative_method=eagle`` serves a published
    EAGLE-1/2 head (:func:`~.published.load_eagle1`), its subclass :class:`Eagle3Proposer` an EAGLE-3 one.

    Each sequence keeps a context in the head (:class:`~.context.EagleContext`, LRU over ``max_sequences``): the keys
    and values of its pairs in pages of the head's paged pool (:class:`~.context.HeadKV`), extended every step with
    the hidden states the step brings (those of the positions the previous step accepted) and cut back to the pairs
    whose ids are still committed (a rollback: a length change). A context that lost pairs (a new sequence, an
    eviction, a step that did not reach this instance) starts again at the first position whose hidden state the step
    brings: it costs acceptance, never correctness. The first step of a sequence (no hidden states yet) gets no drafts.

    A round's sequences share each forward: their new pairs' projections and MLP run as one packed batch, and one
    attention runs over every row's pages. k is capped by the target's positions (:meth:`room`); a step stops drafting
    at the first slot where (the product of its drafts' probabilities so far) x (the slot's top probability) falls
    below ``min_token_prob``: the rule reads the distributions, never the sampled token, so rejection sampling stays
    exact. A proposal's score is the sum of its drafts' running probabilities, the head's own estimate of the accepted
    count (what hybrid compares with the suffix score).

    Args:
        model: the head (:class:`~.model.EagleHead` or :class:`~.eagle3.Eagle3Head`, on its device and dtype).
        vocab: its draft vocabulary over the target's.
        min_token_prob: the confidence under which a step stops drafting, in [0, 1].
        max_sequences: contexts kept (LRU), >= 1.
        top_k: a tree's children per expanded node and frontier width per level (EAGLE-2's ``top_k``), >= 1.
        depth: a tree's levels at most (EAGLE-2's ``depth``; 0: up to the node budget), >= 0.
    """

    name = "eagle"
    applies_processors = True
    tree_widths = greedy_trees = True
    Settings = SpeculatorSettings
    needs_hidden_states = True
    purpose = NoisePurpose.EAGLE
    GAUGES = {
        "spec_decode_eagle_cache_sequences": "Sequences holding a context in the EAGLE head",
        "spec_decode_eagle_cache_pairs": "Positions held in the EAGLE head's contexts",
    }

    def __init__(self, model: EagleHead | Eagle3Head, vocab: DraftVocab, min_token_prob: float = 0.0,
                 max_sequences: int = 64, top_k: int = SpeculatorSettings.tree_top_k,
                 depth: int = SpeculatorSettings.tree_depth):
        self.model, self.vocab, self.min_token_prob = model, vocab, min_token_prob
        self.top_k, self.depth = top_k, depth
        self._kv: HeadKV | None = None  # the contexts' keys and values, built at the first forward (device, dtype)
        self._contexts: SequenceLRU[EagleContext] = SequenceLRU(max_sequences, on_evict=self._evicted)

    def _evicted(self, seq_id: int, ctx: EagleContext) -> None:
        if self._kv is not None:
            self._kv.release(ctx)

    @classmethod
    def configured(cls, settings: SpeculatorSettings) -> bool:
        """Whether ``speculator_path`` names a head of this method (``auto``: the one ``make speculator`` built)."""
        return head_served(cls.name, settings)

    @classmethod
    def load(cls, folder: Path, target: TargetInfo, settings: SpeculatorSettings) -> tuple[EagleHead | Eagle3Head,
                                                                                           DraftVocab]:
        """The head in ``folder`` (float32, CPU) and its vocabulary, checked against ``target``.

        Raises:
            SpeculatorLoadError: naming the file and the key that does not fit.
        """
        return load_eagle1(folder, target)

    @classmethod
    def from_config(cls, settings: SpeculatorSettings, served) -> EagleProposer | None:
        """The head of this method in ``speculator_path`` on the configured device, or None when there is none.

        Raises:
            SpeculatorLoadError: a folder that does not load (naming the file and key).
            ValueError: CUDA asked for but not available.
        """
        loaded = load_served_head(cls.name, settings, lambda folder, target: cls.load(folder, target, settings))
        if loaded is None:
            return None
        (model, vocab), _ = loaded
        return cls(place_head(model, settings), vocab, settings.speculator_min_token_prob, settings.max_sequences,
                   settings.tree_top_k, settings.tree_depth)

    def check(self, request: ProposalRequest) -> None:
        """A request's hidden states must be [m, H x (1 + A)] with H the target's hidden size, m below the number of
        committed ids (they are the states of the positions before the last one), and finite. A sequence whose drafts
        would pass the target's positions is not refused: it drafts fewer, or none (:meth:`room`).

        Raises:
            InvalidInputError: naming ``context_hidden_states``.
        """
        check_hidden_states(request, self.model.hidden_size)

    def room(self, request: ProposalRequest) -> int:
        """How many drafts ``request`` may get: its k, capped at the positions the target (and the head's rotary
        positions, trained up to the target's ``max_position_embeddings``) has left: max_positions - len(token_ids),
        at least 0; no cap when the head's config records no bound."""
        limit = self.model.max_positions
        return request.k if not limit else max(0, min(request.k, limit - len(request.token_ids)))

    def forward_pairs(self, rows: list[tuple[EagleContext, torch.Tensor, torch.Tensor]],
                 visible: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The layer over new pairs of several contexts (packed), each attending to its first ``length`` pairs and
        causally to its new ones (or where ``visible`` allows), whose keys and values are written after them in the
        head's pool (``length`` is left as it was): one projection, one attention over every row's pages
        (:meth:`~.context.HeadKV.attend_rows`), one MLP.

        Args:
            rows: per context, (ctx, z [T, H] the new pairs' inputs, positions [T]).
            visible: per context, [T, length + T] bool on the host, the pairs each new one attends to (a tree's mask,
                :func:`.tree.ancestor_mask`); None: causal.

        Returns:
            per context, the outputs [T, H].
        """
        m = self.model
        z = torch.cat([z for _, z, _ in rows])[None]
        q, k, v = m.project(z, torch.cat([p for _, _, p in rows])[None])
        if self._kv is None:
            self._kv = HeadKV(m.kv_heads, m.head_dim, k.dtype, k.device)
        att = self._kv.attend_rows(m.attend, q, k, v, [(ctx, x.shape[0]) for ctx, x, _ in rows], visible)
        out = m.finish(z, att[None])[0]
        return list(out.split([x.shape[0] for _, x, _ in rows]))

    def _extend(self, r: ProposalRequest, ctx: EagleContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Cut ``ctx`` back to the pairs ``r`` still commits and return the inputs (z [T, H], positions [T]) of the
        pairs to add, T >= 1 (the last pair, n - 1, is always recomputed: its output drafts)."""
        m, ids, hidden = self.model, r.token_ids, r.hidden_states
        assert hidden is not None  # _take_in extends only the requests that bring states
        n, first = len(ids) - 1, len(ids) - 1 - len(hidden)  # last committed index; first state's position
        held = min(common_prefix_len(ctx.ids, ids) - 1 - ctx.start, ctx.length, n - 1 - ctx.start)
        if ctx.length == 0 or held < 0 or ctx.start + held < first:  # pairs missing before the states: start over
            ctx.start, held = first, 0
        if self._kv is not None:
            self._kv.cut(ctx, held)
        ctx.length, ctx.ids = held, list(ids)
        lo = ctx.start + held
        dev = m.head.device
        features = m.features(hidden[lo - first :]).to(device=dev, dtype=m.head.dtype)
        later = ids[lo + 1 :]
        if m.embeds_target_ids:
            self.vocab.map_ids(later)  # checks the range
        tokens = torch.tensor(later if m.embeds_target_ids else self.vocab.map_ids(later), device=dev)
        return m.pair_inputs(features, tokens), torch.arange(lo, n, device=dev)

    def _take_in(self, requests: list[ProposalRequest]) -> tuple[list[int], list[EagleContext], torch.Tensor | None]:
        """Extend the contexts of the requests that bring hidden states with them (one packed forward).

        Returns:
            (their indices in ``requests``, their contexts, [B, H] the outputs of their last pairs, which draft
            x_{n+1}; None when no request brings states).
        """
        limit = self.model.max_positions  # a sequence at the target's last position never drafts again: skip it
        live = [j for j, r in enumerate(requests)
                if r.hidden_states is not None and len(r.hidden_states) and not (limit and len(r.token_ids) >= limit)]
        if not live:
            return [], [], None
        ctxs = [self._contexts.get(requests[j].seq_id, EagleContext) for j in live]
        work = [(ctx, *self._extend(requests[j], ctx)) for j, ctx in zip(live, ctxs)]
        outs = self.forward_pairs(work)
        for ctx, (_, z, _) in zip(ctxs, work):
            ctx.length += z.shape[0]
        return live, ctxs, torch.stack([o[-1] for o in outs])

    @torch.inference_mode()
    def observe(self, requests: list[ProposalRequest]) -> None:
        """Take in the hidden states of steps that another proposer drafts (hybrid's suffix steps), so that the
        contexts stay whole: a context that misses a step starts again at the next one it sees, and drafts less well
        (docs/benchmarks.md)."""
        self._take_in(requests)

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """Per request with hidden states, up to k drafts (capped by :meth:`room`): a chain (seeded sampled requests
        race the target's coupled noise at each absolute position, :func:`~spec_decode.proposers.base.draft_token`;
        draft_probs [k', V] float32, the request's sampling transforms over the kept tokens, scattered back; score the
        sum of the drafts' running probabilities), or, for a request that takes trees with room for two nodes or
        more, a dynamic tree of at most k nodes (:mod:`.tree`)."""
        ks = [self.room(r) for r in requests]
        live, ctxs, state = self._take_in(requests)  # only sequences with room: ks[j] >= 1 for each
        out = [Proposal.empty() for _ in requests]
        if not live:
            return out
        assert state is not None  # _take_in returns states for every live request

        def part(drafted):  # the drafting of some live rows: their requests' indices, contexts and states
            return lambda rows: drafted(requests, ks, [live[n] for n in rows], [ctxs[n] for n in rows],
                                        state.index_select(0, torch.tensor(rows, device=state.device)))
        grow = [n for n, j in enumerate(live) if self.takes_tree(requests[j]) and ks[j] > 1]
        for j, p in zip(live, by_shape(len(live), grow, part(self._chains), part(self._trees))):
            out[j] = p
        for j, ctx in zip(live, ctxs):  # drop the drafted pairs: only the committed ones stay
            assert self._kv is not None  # _take_in ran a forward
            self._kv.cut(ctx, len(requests[j].token_ids) - 1 - ctx.start)
        return out

    def _trees(self, requests: list[ProposalRequest], ks: list[int], live: list[int], ctxs: list[EagleContext],
               state: torch.Tensor) -> list[Proposal]:
        """Dynamic trees for ``requests[live]`` (:func:`.tree.draft_trees`), each of its request's ``tree_depth``
        levels at most, else ``depth`` (0: their room; :meth:`ProposalRequest.tree_shape`)."""
        depths = [min(ks[j], requests[j].tree_shape(self.top_k, self.depth)[1]) for j in live]
        return draft_trees(self, [requests[j] for j in live], ctxs, state, depths)

    def _chains(self, requests: list[ProposalRequest], ks: list[int], live: list[int], ctxs: list[EagleContext],
                state: torch.Tensor) -> list[Proposal]:
        """Chains for ``requests[live]`` (contexts ``ctxs``, [R, H] the outputs of their last committed pairs): up to
        ``ks[j]`` drafts each, one batched head forward per slot over the rows still drafting."""
        vocab = self.vocab
        drafts: list[list[int]] = [[] for _ in live]
        rows: list[list[torch.Tensor]] = [[] for _ in live]
        score = [0.0] * len(live)
        at = list(range(len(live)))  # the rows still drafting, as indices into live
        running = [1.0] * len(live)  # the product of each row's drafts' probabilities so far
        for i in range(max(ks[j] for j in live)):
            logits = self.model.logits(state)
            keep, tokens = [], []
            picks = [draft_token(logits[row], requests[live[a]], self.purpose, i, drafts[a], vocab.token_ids,
                                 self.grammar, vocab.target_vocab_size, lazy=True) for row, a in enumerate(at)]
            # the slot's tokens, confidence and probabilities in one copy to the host
            for (row, a), (_, probs), (tok, passes, p_tok) in zip(
                    enumerate(at), picks, slot_outcomes(picks, [running[a] for a in at], self.min_token_prob)):
                if not passes:
                    continue
                running[a] *= p_tok
                drafts[a].append(int(vocab.token_ids[tok]))
                rows[a].append(vocab.scatter(probs))
                score[a] += running[a]
                if len(drafts[a]) < ks[live[a]] and running[a] >= self.min_token_prob:  # else no next slot passes
                    keep.append(row)
                    tokens.append(drafts[a][-1] if self.model.embeds_target_ids else tok)
            if not keep:
                break
            # the drafted pairs (own state, drafted token) at positions n + i; their keys go after the context's
            # pairs for the next draft and are overwritten by the next step's true pairs
            dev = state.device
            z = self.model.pair_inputs(state[keep], torch.tensor(tokens, device=dev))
            step_rows = []
            for m, row in enumerate(keep):
                r, ctx = requests[live[at[row]]], ctxs[at[row]]
                step_rows.append((ctx, z[m : m + 1], torch.tensor([len(r.token_ids) - 1 + i], device=dev)))
            state = torch.cat(self.forward_pairs(step_rows))
            for ctx, *_ in step_rows:
                ctx.length += 1
            at = [at[row] for row in keep]
        return [Proposal(torch.tensor(d, dtype=torch.int64), torch.stack(r), sc) if d else Proposal.empty()
                for d, r, sc in zip(drafts, rows, score)]

    def release(self, seq_id: int, final_token_ids: list[int] | None = None) -> None:
        """Free the context of ``seq_id`` (its pages go back to the head's pool)."""
        ctx = self._contexts.pop(seq_id)
        if ctx is not None:
            self._evicted(seq_id, ctx)

    def gauges(self) -> dict[str, float]:
        """The head's contexts: sequences and positions held."""
        return {f"spec_decode_{self.name}_cache_sequences": len(self._contexts),
                f"spec_decode_{self.name}_cache_pairs": sum(c.length for c in self._contexts.values())}


class Eagle3Proposer(EagleProposer):
    """Drafts with an EAGLE-3 head (:class:`~.eagle3.Eagle3Head`; ``speculative_method=eagle3``): the head
    ``make speculator`` trains (``speculator_path: auto``) or a published one. It reads the auxiliary layers' hidden
    states that target_model returns beside its last one (:func:`~spec_decode.proposers.speculators.
    aux_hidden_state_layers`)."""

    name = "eagle3"
    purpose = NoisePurpose.EAGLE3
    GAUGES = {
        "spec_decode_eagle3_cache_sequences": "Sequences holding a context in the EAGLE-3 head",
        "spec_decode_eagle3_cache_pairs": "Positions held in the EAGLE-3 head's contexts",
    }

    def check(self, request: ProposalRequest) -> None:
        """As :meth:`EagleProposer.check`, and the hidden states must carry the layers the head reads.

        Raises:
            InvalidInputError: naming ``context_hidden_states``.
        """
        super().check(request)
        h = request.hidden_states
        model = self.model
        assert isinstance(model, Eagle3Head)
        need = model.hidden_size * (1 + max(model.aux_columns))
        if h is not None and len(h) and h.shape[1] < need:
            raise InvalidInputError("context_hidden_states", f"must be [m, {need}] or wider for the EAGLE-3 head (the "
                                    f"target's last hidden state and the inputs of the layers it reads: "
                                    f"target_model's aux_hidden_state_layers), got {list(h.shape)}")

    @classmethod
    def load(cls, folder: Path, target: TargetInfo, settings: SpeculatorSettings) -> tuple[EagleHead | Eagle3Head,
                                                                                           DraftVocab]:
        """The EAGLE-3 head in ``folder``, reading its layers' columns of the hidden states the target returns for
        ``speculator_path``'s heads.

        Raises:
            SpeculatorLoadError: naming the file and the key that does not fit.
        """
        return load_eagle3(folder, target, aux_hidden_state_layers(settings.speculator_path, target.num_layers))
