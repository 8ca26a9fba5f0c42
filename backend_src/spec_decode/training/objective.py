"""EAGLE-3's training objective for ``make speculator`` (:mod:`spec_decode.training.speculator`): the unrolled
training-time test, its training windows and loss, and the evaluation of a head stepped as live greedy decoding
steps it (EAGLE-3, Li et al. 2025, arXiv 2503.01840)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..proposers.eagle import EagleProposer
    from ..proposers.eagle.eagle3 import Eagle3Head
    from .teacher import Teacher


def unroll_mask(t: int, depth: int, device: torch.device | None = None) -> torch.Tensor:
    """Attention mask of unrolled step ``depth`` >= 1 over the keys of steps 0..depth (``[1, 1, t, (depth + 1) t]``
    bool): the query at j sees step 0's keys at positions <= j - depth (pairs built from the target's features) and
    step e's key at position j - depth + e for e = 1..depth (the pairs the head built from its own outputs on the way
    from there to j), as a live draft of depth + 1 tokens does."""
    j = torch.arange(t, device=device)[:, None]
    i = torch.arange(t, device=device)[None]
    blocks = [i <= j - depth] + [i == j - depth + e for e in range(1, depth + 1)]
    return torch.cat(blocks, 1)[None, None]


def unrolled_outputs(model: Eagle3Head, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                     depth: int) -> list[torch.Tensor]:
    """The head's outputs as drafting sees them, for draft positions 1..``depth`` (EAGLE-3's training-time test, Li et
    al. 2025, arXiv 2503.01840, section 3.2; SafeAILab/EAGLE ``eagle/traineagle3/cnets.py`` unrolls the same way).

    Step 0 is the teacher-forced pass (pair j: the target's auxiliary states at j through ``fc``, with x_{j+1}). Step
    d's input at pair j is the head's own step d-1 output a'_{j-1} [H] (in place of ``fc``'s) with the true token
    x_{j+1} (in greedy drafting an accepted draft is the true token), and it attends as :func:`unroll_mask` says: what
    :class:`~spec_decode.proposers.eagle.proposer.Eagle3Proposer` computes drafting d + 1 tokens after x_{j-d+1}.

    Args:
        model: the head.
        features: [B, T, 3H] the target's auxiliary states (:meth:`~spec_decode.proposers.eagle.eagle3.Eagle3Head.
            features` of the wire layout); tokens: [B, T] int64 target ids of x_{j+1}; positions: [B, T] int64, as
            :meth:`~spec_decode.proposers.eagle.eagle3.Eagle3Head.forward` takes them.
        depth: how many draft positions to unroll, >= 1.

    Returns:
        ``depth`` tensors [B, T, H] (the head's dtype, or autocast's): step d's outputs a' before the final norm (rows
        j < d have no valid input and should not count).
    """
    t = features.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=features.device).tril()[None, None]
    out, (k, v) = model.layer(model.pair_inputs(features, tokens), positions, causal)
    outs, keys, values = [out], [k], [v]
    for d in range(1, depth):
        prev = torch.cat([out[:, :1] * 0, out[:, :-1]], 1)  # step d-1's output for the pair before: [B, T, H]
        out, (k, v) = model.layer(model.pair_inputs(prev, tokens), positions,
                                  unroll_mask(t, d, features.device), (torch.cat(keys, 2), torch.cat(values, 2)))
        outs.append(out)
        keys.append(k)
        values.append(v)
    return outs


# What :func:`windows` yields: (wire states, tokens, positions, next hidden states, mask)
WindowBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def windows(sequences: list[list[int]], teacher: Teacher, seq_len: int, batch_size: int, gen: torch.Generator,
            kept: torch.Tensor | None = None) -> Iterator[WindowBatch]:
    """Random training windows of pairs, forever.

    Pair j of a window starting at position s of a sequence x joins the target's states at position s+j (the wire
    layout, :attr:`~spec_decode.training.teacher.Teacher.wire`) with token x_{s+j+1}; its target is the target's
    distribution of x_{s+j+2}, which its LM head reads from its last hidden state f_{s+j+1}. Rows shorter than the
    longest (T <= ``seq_len``) are padded at the end (the causal attention never reads padding from a real position)
    and masked. As EAGLE-3's trainer (``position_mask``), a pair whose target argmax is outside the draft vocabulary
    (``kept``) is masked too: no draft can match it. Sequences of fewer than 2 tokens are never drawn.

    Args:
        sequences: the corpus' token ids; teacher: the target's outputs over them.
        seq_len: the most pairs per row; batch_size: rows B.
        gen: the seeded generator of the windows' rows and starts.
        kept: [V] bool, the target ids in the draft vocabulary (EAGLE-3's ``t2d``), or None (every pair counts).

    Yields:
        (wire [B, T, W] float32 (W = H x (1 + A)), tokens [B, T] int64 target ids, positions [B, T] int64, next hidden
        states [B, T, H] float32, mask [B, T] float32).
    """
    usable = [i for i, s in enumerate(sequences) if len(s) >= 2]
    while True:
        rows = [usable[i] for i in torch.randint(len(usable), (batch_size,), generator=gen).tolist()]
        spans = []
        for r in rows:
            pairs = len(sequences[r]) - 1  # pairs 0..len-2 have a following token
            start = int(torch.randint(max(1, pairs - seq_len + 1), (1,), generator=gen))
            spans.append((r, start, min(seq_len, pairs - start)))
        t = max(n for *_, n in spans)
        width, h = teacher.wire[rows[0]].shape[1], teacher.hidden[rows[0]].shape[1]
        feats, nxt = torch.zeros(batch_size, t, width), torch.zeros(batch_size, t, h)
        tokens, pos = torch.zeros(batch_size, t, dtype=torch.long), torch.zeros(batch_size, t, dtype=torch.long)
        mask = torch.zeros(batch_size, t)
        for b, (r, s, n) in enumerate(spans):
            feats[b, :n] = teacher.wire[r][s : s + n].float()
            nxt[b, :n] = teacher.hidden[r][s + 1 : s + n + 1].float()
            tokens[b, :n] = torch.tensor(sequences[r][s + 1 : s + n + 1])
            pos[b, :n] = torch.arange(s, s + n)
            mask[b, :n] = 1.0 if kept is None else kept[teacher.argmax[r][s + 1 : s + n + 1].long()].float()
        yield feats, tokens, pos, nxt, mask


def depth_weights(depth: int, decay: float = 0.8) -> list[float]:
    """The loss weight of each unrolled draft position d = 0..``depth``-1: ``decay ** d`` (EAGLE-3's trainer,
    SafeAILab/EAGLE ``eagle/traineagle3/main.py``: ``ploss_weight = 0.8 ** i``), normalised to sum to 1 so the loss
    reads as an average KL whatever the depth."""
    w = [decay**d for d in range(depth)]
    return [x / sum(w) for x in w]


def unrolled_loss(model: Eagle3Head, batch: WindowBatch, depth: int,
                  target_head: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """EAGLE-3's loss over a :func:`windows` batch: at each of the ``depth`` unrolled draft positions
    (:func:`unrolled_outputs`), the KL of the head's distribution to the target's next-token distribution over the
    kept tokens (:func:`~spec_decode.training.teacher.distillation_loss` over the target's top 32: the cross-entropy
    to the target's distribution that EAGLE-3 minimises, less the target's entropy), weighted by
    :func:`depth_weights`. No feature regression: EAGLE-3 dropped it (its head's state is no longer the target's).

    Args:
        model: the head (trains).
        batch: a :func:`windows` batch.
        depth: draft positions unrolled, >= 1.
        target_head: [N, H] the target's LM head rows of the draft vocabulary (frozen; the target's distribution is it
            over the target's next hidden state).

    Returns:
        (the loss, a 0-dim float32 tensor with its graph; each position's KL in nats).
    """
    from .teacher import distillation_loss, native_bfloat16, target_distribution

    wire, tokens, pos, nxt, mask = batch
    # bfloat16 matrix products where the CPU has them natively (faster; docs/benchmarks.md); the losses and the
    # weights stay float32
    with torch.autocast(wire.device.type, dtype=torch.bfloat16, enabled=native_bfloat16(wire.device)):
        with torch.no_grad():  # the target's distribution over the kept tokens: its frozen LM head over its states
            target = target_distribution(nxt @ target_head.T)
        outs = unrolled_outputs(model, model.features(wire), tokens, pos, depth)
        logits = [model.logits(out) for out in outs]
    total: torch.Tensor | float = 0.0
    per: list[float] = []
    for d, w in enumerate(depth_weights(depth)):
        m = mask.clone()
        m[:, :d] = 0.0  # step d's first d pairs have no own output to read
        kl = distillation_loss(logits[d], target, m)
        total = total + w * kl
        per.append(kl.item())
    assert isinstance(total, torch.Tensor)  # depth >= 1
    return total, per


def evaluate(proposer: EagleProposer, sequences: list[list[int]], prompt_lens: list[int], teacher: Teacher,
             k: int = 4) -> dict:
    """The serving proposer stepped over held-out target greedy continuations as live greedy decoding steps it.

    A sequence's first step (after the prompt) drafts nothing; each later step brings the hidden states (the wire
    layout of ``teacher``, :attr:`~spec_decode.training.teacher.Teacher.wire`) of the positions the previous step
    accepted, drafts up to ``k`` tokens and accepts them while they equal the target's argmax (the continuation is the
    target's own choice, so this is what the server accepts).

    Returns:
        dict: ``tokens_per_step``, ``acceptance_rate`` (accepted / drafted), ``drafts_per_step``,
        ``acceptance_per_position`` (P(at least j+1 drafts accepted) per step), ``steps``.
    """
    from ..proposers.base import ProposalRequest
    from ..sampling import SamplingParams

    hist, drafted, steps = [0] * (k + 1), 0, 0
    greedy = SamplingParams()
    for n, (seq, plen, top, hid) in enumerate(zip(sequences, prompt_lens, teacher.argmax, teacher.wire)):
        target = top.tolist()  # the target's argmax after each position
        s = plen  # the first step committed x_plen; it brought the state of position plen - 1
        hidden = hid[plen - 1 : plen].float()
        while s < len(seq) - 1:
            want = min(k, len(seq) - 1 - s)
            (p,) = proposer.propose([ProposalRequest(n, seq[: s + 1], want, greedy, steps, hidden)])
            a = 0
            for t in p.draft_token_ids.tolist():
                if t != target[s + a]:
                    break
                a += 1
            hist[a] += 1
            drafted += len(p.draft_token_ids)
            steps += 1
            hidden = hid[s : s + a + 1].float()
            s += a + 1
        proposer.release(n)
    total = max(1, steps)
    return {"tokens_per_step": sum((a + 1) * c for a, c in enumerate(hist)) / total,
            "acceptance_rate": sum(a * c for a, c in enumerate(hist)) / max(1, drafted),
            "drafts_per_step": drafted / total, "steps": steps,
            "acceptance_per_position": [sum(hist[j + 1 :]) / total for j in range(k)]}
