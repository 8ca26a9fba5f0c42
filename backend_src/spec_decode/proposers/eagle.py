"""EAGLE: a draft head that reads the target's own hidden states (Li et al. 2024, arXiv 2401.15077; EAGLE-3, arXiv
2503.01840; vLLM's ``EagleProposer``).

The head is one decoder layer of the target's architecture (RMSNorm, grouped-query attention with rotary positions,
SwiGLU MLP) over a sequence of *pairs*: pair j joins the target's hidden state after token x_j with the embedding of
the token that followed, x_{j+1}, and its output predicts the target's next hidden state f_{j+1}, from which the
target's frozen LM head reads the distribution of x_{j+2} (EAGLE's feature-level drafting):

    z_j   = W [E(x_{j+1}); f_j] + b                        [2H] -> [H], f_j the target's last hidden state at j
    a_j   = DecoderLayer(z_0..z_j)                         causal attention over the sequence's earlier pairs
    q_j   = softmax(head(a_j))                             the draft distribution of x_{j+2}

Drafting from committed tokens x_0..x_n: the pairs j < n come from the target (its hidden states travel with the
steps), and the last of them drafts x_{n+1}; then pair n is (a_{n-1} in place of f_n, the drafted token), and so on:
the head feeds its own output back, as trained (EAGLE-3's "training-time test": :func:`unrolled_outputs`).

E and head are the target's input embedding and LM head over a pruned vocabulary (:class:`~spec_decode.draft_vocab.
DraftVocab`: the kept tokens, plus one embedding row for every other input token), frozen; the probabilities are
scattered back to the target's vocabulary, zero elsewhere, so rejection sampling stays exact.

Chosen over the MLP speculator (Wertheimer et al. 2024) by measurement: trained on the same data, held out, k = 4,
drafting every slot, 1.51 tokens per step against 1.42 (README, "Trained proposers").

The folder holds ``config.json`` (sizes), ``eagle.safetensors``, ``draft_vocab.json`` and ``train_speculator.json``
(the training report of ``make speculator``).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..draft_vocab import DraftVocab, load_draft_vocab
from ..kv_cache import common_prefix_len
from ..model_loading import resolve_device, resolve_dtype
from ..settings import InvalidInputError, LMSettings, in_range
from .base import Proposal, ProposalRequest, Proposer, confident, draft_token

CONFIG_FILE, WEIGHTS_FILE, REPORT_FILE = "config.json", "eagle.safetensors", "train_speculator.json"


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang and Sennrich 2019), computed in float32 as Llama's."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., size] -> [..., size], same dtype."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, Llama's half-split layout).

    Args:
        x: [B, heads, T, D] queries or keys.
        positions: [B, T] int64 token positions.
        inv_freq: [D/2] float32, theta^(-2i/D) (:meth:`EagleHead.project`).

    Returns:
        [B, heads, T, D], x's dtype.
    """
    d = x.shape[-1]
    ang = positions[:, None, :, None].float() * inv_freq  # [B, 1, T, D/2]
    cos, sin = torch.cos(ang).repeat(1, 1, 1, 2), torch.sin(ang).repeat(1, 1, 1, 2)
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


class EagleHead(nn.Module):
    """The EAGLE head: the pairs' input layer and one decoder layer, over a frozen pruned embedding and LM head.

    Args:
        embedding: [N + 1, H] the target's input embedding rows of the kept tokens, then the "outside the set" row.
        head: [N, H] the target's LM head rows of the kept tokens.
        config: sizes as the target's (:func:`eagle_config`): ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim``, ``intermediate_size``, ``rope_theta``, ``rms_norm_eps``.

    Raises:
        ValueError: shapes that disagree, or heads that do not divide.
    """

    def __init__(self, embedding: torch.Tensor, head: torch.Tensor, config: dict):
        super().__init__()
        h = embedding.shape[1]
        if embedding.shape[0] != head.shape[0] + 1 or head.shape[1] != h:
            raise ValueError(f"embedding [N+1, H] {tuple(embedding.shape)} and head [N, H] {tuple(head.shape)} "
                             f"disagree")
        self.config = dict(config)
        self.heads, self.kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
        self.head_dim, self.theta = int(config["head_dim"]), float(config["rope_theta"])
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} attention heads are not a multiple of {self.kv_heads} key/value heads")
        eps, inter = float(config["rms_norm_eps"]), int(config["intermediate_size"])
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # the rotary frequencies per device (rotate)
        self.register_buffer("embedding", embedding.detach().float().clone())
        self.register_buffer("head", head.detach().float().clone())
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.input_norm = RMSNorm(h, eps)
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.post_norm = RMSNorm(h, eps)
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    @property
    def max_positions(self) -> int:
        """The target's ``max_position_embeddings`` (0: no bound known, as heads saved before it was recorded)."""
        return int(self.config.get("max_position_embeddings", 0) or 0)

    @property
    def hidden_size(self) -> int:
        """H, the target's hidden size."""
        return self.embedding.shape[1]

    def pair_inputs(self, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The layer's inputs z [..., H] for pairs (state [..., H]: the target's hidden state, or the head's own
        output when drafting; tokens [...]: int64 draft-vocabulary indices)."""
        return self.fc(torch.cat([self.embedding[tokens], state.to(self.embedding.dtype)], -1))

    def project(self, z: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention's rotated queries [B, heads, T, D], keys and values [B, kv_heads, T, D] of inputs z [B, T, H]
        at ``positions`` [B, T]."""
        b, t, _ = z.shape
        x = self.input_norm(z)
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        inv = self._inv_freq.get(z.device)
        if inv is None:  # float32 whatever the head's dtype (angles at long positions need it), once per device
            d = self.head_dim
            inv = self._inv_freq[z.device] = 1.0 / self.theta ** (torch.arange(0, d, 2, device=z.device).float() / d)
        return rotate(q, positions, inv), rotate(k, positions, inv), v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention: q [B, heads, T, D] over keys/values [B, kv_heads, S, D] where ``mask`` [B or 1, 1,
        T, S] (bool) allows; returns [B, T, heads x D]."""
        att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return att.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    def finish(self, z: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """The layer's output [..., H] from its inputs z and their attention [..., heads x D] (residuals and MLP)."""
        z = z + self.o_proj(att)
        x = self.post_norm(z)
        return z + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def layer(self, z: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
              past: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, tuple]:
        """The decoder layer over new pairs, attending to ``past`` keys and values and to themselves.

        Args:
            z: [B, T, H] the new pairs' inputs.
            positions: [B, T] int64 their positions j.
            mask: [B or 1, 1, T, C + T] bool, True where a query may attend (columns: the C past keys, then the new).
            past: ([B, kv_heads, C, D] keys, values) already rotated, or None (C = 0).

        Returns:
            ([B, T, H] outputs a, (the new pairs' keys, values) [B, kv_heads, T, D]).
        """
        q, k, v = self.project(z, positions)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        return self.finish(z, self.attend(q, keys, values, mask)), (k, v)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[..., H] layer outputs (predicted hidden states) -> [..., N] logits over the kept tokens."""
        return out @ self.head.T

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Teacher-forced outputs of a whole sequence of pairs (causal).

        Args:
            features: [B, T, H] the target's hidden states f_j.
            tokens: [B, T] draft-vocabulary indices of x_{j+1}.
            positions: [B, T] the pairs' positions j.

        Returns:
            [B, T, H] outputs a_j (``logits`` reads x_{j+2}'s distribution from them).
        """
        t = features.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=features.device).tril()[None, None]
        return self.layer(self.pair_inputs(features, tokens), positions, causal)[0]

    def save(self, folder: Path, vocab: DraftVocab, extra: dict | None = None) -> None:
        """Write ``config.json``, ``eagle.safetensors`` and ``draft_vocab.json`` into ``folder``."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(folder / WEIGHTS_FILE))
        vocab.save(folder)
        (folder / CONFIG_FILE).write_text(json.dumps({"architecture": "eagle", "hidden_size": self.hidden_size,
                                                      "draft_vocab": len(vocab), **self.config, **(extra or {})},
                                                     indent=2))

    @classmethod
    def load(cls, folder: Path) -> tuple[EagleHead, DraftVocab]:
        """The head (eval mode) and its vocabulary from a folder :meth:`save` wrote.

        Raises:
            FileNotFoundError: no ``config.json`` or weights there.
        """
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg = json.loads((folder / CONFIG_FILE).read_text())
        state = load_file(str(folder / WEIGHTS_FILE))
        model = cls(state["embedding"], state["head"], cfg)
        model.load_state_dict(state)
        return model.eval(), load_draft_vocab(folder)


def unroll_mask(t: int, depth: int, device=None) -> torch.Tensor:
    """Attention mask of unrolled step ``depth`` >= 1 over the keys of steps 0..depth (``[1, 1, t, (depth + 1) t]``
    bool): the query at j sees step 0's keys at positions <= j - depth (pairs built from the target's features) and
    step e's key at position j - depth + e for e = 1..depth (the pairs the head built from its own outputs on the way
    from there to j), as a live draft of depth + 1 tokens does."""
    j = torch.arange(t, device=device)[:, None]
    i = torch.arange(t, device=device)[None]
    blocks = [i <= j - depth] + [i == j - depth + e for e in range(1, depth + 1)]
    return torch.cat(blocks, 1)[None, None]


def unrolled_outputs(model: EagleHead, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                     depth: int) -> list[torch.Tensor]:
    """The head's outputs as drafting sees them, for draft positions 1..``depth`` (EAGLE-3's training-time test).

    Step 0 is the teacher-forced pass. Step d's input at pair j is the head's own step d-1 output at j - 1 with the true
    token x_{j+1} (in greedy drafting an accepted draft is the true token), and it attends as :func:`unroll_mask` says.

    Args:
        features: [B, T, H]; tokens: [B, T]; positions: [B, T] as :meth:`EagleHead.forward`.
        depth: how many draft positions to unroll, >= 1.

    Returns:
        ``depth`` tensors [B, T, H]: step d's outputs (rows j < d have no valid input and should not count).
    """
    t = features.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=features.device).tril()[None, None]
    out, (k, v) = model.layer(model.pair_inputs(features, tokens), positions, causal)
    outs, keys, values = [out], [k], [v]
    for d in range(1, depth):
        prev = torch.cat([out[:, :1] * 0, out[:, :-1]], 1)  # step d-1's output for the pair before
        out, (k, v) = model.layer(model.pair_inputs(prev, tokens), positions,
                                  unroll_mask(t, d, features.device), (torch.cat(keys, 2), torch.cat(values, 2)))
        outs.append(out)
        keys.append(k)
        values.append(v)
    return outs


def eagle_config(target_config) -> dict:
    """The head's sizes from the target's transformers config (a Llama-style model); ``max_position_embeddings``
    (0: no bound known) bounds the sequences it drafts for, as the target's bounds what it scores."""
    c = target_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    return {"num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": head_dim, "intermediate_size": c.intermediate_size, "rope_theta": float(theta),
            "rms_norm_eps": float(c.rms_norm_eps),
            "max_position_embeddings": int(getattr(c, "max_position_embeddings", 0) or 0)}


# --- serving: the proposer -------------------------------------------------------------------------------------------

_PURPOSE = 5  # noise purpose of the head's sampled drafts


def default_eagle_dir() -> Path:
    """Folder of the head ``make speculator`` trains for the embedded target (may not exist yet)."""
    from ..model_loading import DEFAULT_MODEL_NAME, cache_dir

    return cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-eagle"


def resolve_eagle_path(value: str) -> Path | None:
    """``auto`` -> the default head when ``make speculator`` has built it (else None); ``""``/``none`` -> None; else
    the folder.

    Raises:
        FileNotFoundError: a given folder without ``config.json``.
    """
    v = (value or "").strip()
    if v.lower() == "auto":
        d = default_eagle_dir()
        return d if (d / REPORT_FILE).exists() else None
    if v.lower() in ("", "none"):
        return None
    path = Path(v).expanduser()
    if not (path / CONFIG_FILE).exists():
        raise FileNotFoundError(f"EAGLE head folder {str(path)!r} has no {CONFIG_FILE}")
    return path


@dataclass(frozen=True)
class EagleSettings(LMSettings):
    """The head's config parameters: ``eagle_path``, ``eagle_min_token_prob`` and, as for the draft LM, ``device``,
    ``dtype``, ``max_sequences`` (contexts kept, LRU).

    Attributes:
        eagle_path: ``auto`` (the head ``make speculator`` trains, when it exists; else none), ``""`` or ``none`` (not
            served), or a folder with ``config.json`` and ``eagle.safetensors``.
        eagle_min_token_prob: a step drafts its next slot while the product of its drafts' probabilities so far and
            the slot's top probability is >= this, in [0, 1]; 0 drafts every slot. Every draft slot costs a scored
            position whether accepted or not, so an unsure head should stop early (EAGLE-2 prunes its draft trees by
            the same confidence; suffix decoding's ``suffix_min_token_prob``).
    """

    eagle_path: str = "auto"
    eagle_min_token_prob: float = 0.3

    def check(self) -> None:
        super().check()
        in_range("eagle_min_token_prob", self.eagle_min_token_prob, 0.0, 1.0)


class _Context:
    """One sequence's pairs in the head: their keys and values ``[kv_heads, capacity, D]`` (pair ``start + i`` at
    index i; the first ``length`` hold), built from the committed ids ``ids`` (pair j read x_{j+1})."""

    GROW = 256

    def __init__(self):
        self.ids: list[int] = []
        self.start = 0
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def write(self, at: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values [kv_heads, n, D] at indices ``at .. at + n - 1`` (growing the buffers)."""
        end = at + keys.shape[1]
        if self.keys is None or self.keys.shape[1] < end:
            grown = [x.new_empty((x.shape[0], end + self.GROW, x.shape[2])) for x in (keys, values)]
            if self.keys is not None and at:
                grown[0][:, :at], grown[1][:, :at] = self.keys[:, :at], self.values[:, :at]
            self.keys, self.values = grown
        self.keys[:, at:end], self.values[:, at:end] = keys, values


class EagleProposer(Proposer):
    """Drafts with an :class:`EagleHead` from the target's hidden states (``speculative_method=eagle``).

    Each sequence keeps a context in the head (:class:`_Context`, LRU over ``max_sequences``): the keys and values of
    its pairs, extended every step with the hidden states the step brings (those of the positions the previous step
    accepted) and cut back to the pairs whose ids are still committed (a rollback). A context that lost pairs (a new
    sequence, an eviction, a step that did not reach this instance) starts again at the first position whose hidden
    state the step brings: it costs acceptance, never correctness. The first step of a sequence (no hidden states
    yet) gets no drafts.

    A round's sequences share each forward: their new pairs' projections and MLP run as one packed batch, each
    attends over its own context. k is capped by nothing but the request; a step stops drafting at the first slot
    where (the product of its drafts' probabilities so far) x (the slot's top probability) falls below
    ``min_token_prob``: the rule reads the distributions, never the sampled token, so rejection sampling stays exact.
    A proposal's score is the sum of its drafts' running probabilities, the head's own estimate of the accepted count
    (what hybrid compares with the suffix score).

    Args:
        model: the head (on its device and dtype).
        vocab: its pruned vocabulary over the target's.
        min_token_prob: the confidence under which a step stops drafting, in [0, 1].
        max_sequences: contexts kept (LRU), >= 1.
    """

    name = "eagle"
    Settings = EagleSettings
    needs_hidden_states = True
    GAUGES = {
        "spec_decode_eagle_cache_sequences": "Sequences holding a context in the EAGLE head",
        "spec_decode_eagle_cache_pairs": "Positions held in the EAGLE head's contexts",
    }

    def __init__(self, model: EagleHead, vocab: DraftVocab, min_token_prob: float = 0.0, max_sequences: int = 64):
        self.model, self.vocab, self.min_token_prob = model, vocab, min_token_prob
        self.max_sequences = max_sequences
        self._contexts: OrderedDict[int, _Context] = OrderedDict()

    @classmethod
    def configured(cls, settings: EagleSettings) -> bool:
        """Whether ``eagle_path`` names a head (``auto``: when ``make speculator`` has built it)."""
        try:
            return resolve_eagle_path(settings.eagle_path) is not None
        except FileNotFoundError:
            return False

    @classmethod
    def from_config(cls, settings: EagleSettings, served) -> EagleProposer | None:
        """The head of ``eagle_path`` on the configured device, or None when there is none.

        Raises:
            FileNotFoundError: a folder without a head.
        """
        path = resolve_eagle_path(settings.eagle_path)
        if path is None:
            return None
        device = resolve_device(settings.device)
        model, vocab = EagleHead.load(path)
        return cls(model.to(device=device, dtype=resolve_dtype(settings.dtype, device)), vocab,
                   settings.eagle_min_token_prob, settings.max_sequences)

    def check(self, request: ProposalRequest) -> None:
        """A request's ids plus its k drafts must fit in the target's positions; its hidden states must be [m, H] with
        H the target's hidden size, m below the number of committed ids (they are the states of the positions before
        the last one), and finite.

        Raises:
            InvalidInputError: naming ``token_ids`` or ``context_hidden_states``.
        """
        limit = self.model.max_positions
        if limit and len(request.token_ids) + request.k > limit:
            raise InvalidInputError("token_ids", f"{len(request.token_ids)} tokens and {request.k} drafts; the target "
                                    f"(and its EAGLE head) takes at most {limit} positions")
        h = request.hidden_states
        if h is None or not len(h):
            return
        size = self.model.hidden_size
        if h.ndim != 2 or h.shape[1] != size or h.shape[0] >= len(request.token_ids):
            raise InvalidInputError("context_hidden_states", f"must be [m, {size}] (the target's hidden states at "
                                    f"the m < {len(request.token_ids)} positions before the last token), got "
                                    f"{list(h.shape)}")
        if not torch.isfinite(h).all():
            raise InvalidInputError("context_hidden_states", "must be finite")

    def _context(self, seq_id: int) -> _Context:
        ctx = self._contexts.get(seq_id)
        if ctx is None:
            ctx = self._contexts[seq_id] = _Context()
            while len(self._contexts) > self.max_sequences:
                self._contexts.popitem(last=False)
        else:
            self._contexts.move_to_end(seq_id)
        return ctx

    def _forward(self, rows: list[tuple[_Context, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """The layer over new pairs of several contexts (packed), each attending to its first ``length`` pairs and
        causally to its new ones, whose keys and values are written after them (``length`` is left as it was).

        Args:
            rows: per context, (ctx, z [T, H] the new pairs' inputs, positions [T]).

        Returns:
            per context, the outputs [T, H].
        """
        m = self.model
        q, k, v = m.project(torch.cat([z for _, z, _ in rows])[None], torch.cat([p for _, _, p in rows])[None])
        atts, at = [], 0
        for ctx, z, _ in rows:
            t, c = z.shape[0], ctx.length
            ctx.write(c, k[0, :, at : at + t], v[0, :, at : at + t])
            mask = torch.ones(t, c + t, dtype=torch.bool, device=z.device).tril(c)[None, None]
            atts.append(m.attend(q[:, :, at : at + t], ctx.keys[None, :, : c + t], ctx.values[None, :, : c + t], mask))
            at += t
        out = m.finish(torch.cat([z for _, z, _ in rows])[None], torch.cat(atts, 1))[0]
        return list(out.split([z.shape[0] for _, z, _ in rows]))

    def _extend(self, r: ProposalRequest, ctx: _Context) -> tuple[torch.Tensor, torch.Tensor]:
        """Cut ``ctx`` back to the pairs ``r`` still commits and return the inputs (z [T, H], positions [T]) of the
        pairs to add, T >= 1 (the last pair, n - 1, is always recomputed: its output drafts)."""
        m, ids = self.model, r.token_ids
        n, first = len(ids) - 1, len(ids) - 1 - len(r.hidden_states)  # last committed index; first state's position
        held = min(common_prefix_len(ctx.ids, ids) - 1 - ctx.start, ctx.length, n - 1 - ctx.start)
        if ctx.length == 0 or held < 0 or ctx.start + held < first:  # pairs missing before the states: start over
            ctx.start, held = first, 0
        ctx.length, ctx.ids = held, list(ids)
        lo = ctx.start + held
        dev = m.head.device
        features = r.hidden_states[lo - first :].to(device=dev, dtype=m.head.dtype)
        tokens = torch.tensor(self.vocab.map_ids(ids[lo + 1 :]), device=dev)
        return m.pair_inputs(features, tokens), torch.arange(lo, n, device=dev)

    def _take_in(self, requests: list[ProposalRequest]) -> tuple[list[int], list[_Context], torch.Tensor | None]:
        """Extend the contexts of the requests that bring hidden states with them (one packed forward).

        Returns:
            (their indices in ``requests``, their contexts, [B, H] the outputs of their last pairs, which draft
            x_{n+1}; None when no request brings states).
        """
        live = [j for j, r in enumerate(requests) if r.hidden_states is not None and len(r.hidden_states)]
        if not live:
            return [], [], None
        ctxs = [self._context(requests[j].seq_id) for j in live]
        work = [(ctx, *self._extend(requests[j], ctx)) for j, ctx in zip(live, ctxs)]
        outs = self._forward(work)
        for ctx, (_, z, _) in zip(ctxs, work):
            ctx.length += z.shape[0]
        return live, ctxs, torch.stack([o[-1] for o in outs])

    @torch.inference_mode()
    def observe(self, requests: list[ProposalRequest]) -> None:
        """Take in the hidden states of steps that another proposer drafts (hybrid's suffix steps), so that the
        contexts stay whole: a context that misses a step starts again at the next one it sees, and drafts less well
        (held out, 1.36 tokens per step drafting every slot when every step starts again, against 1.48)."""
        self._take_in(requests)

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """Per request with hidden states, up to k drafts; draft_probs [k', V] float32 (the request's sampling
        transforms over the kept tokens, scattered back); score the sum of the drafts' running probabilities."""
        vocab = self.vocab
        live, ctxs, state = self._take_in(requests)
        drafts: list[list[int]] = [[] for _ in requests]
        rows: list[list[torch.Tensor]] = [[] for _ in requests]
        score = [0.0] * len(requests)
        if live:
            touched = list(zip(live, ctxs))
            running = [1.0] * len(live)  # the product of the row's drafts' probabilities so far
            for i in range(max(requests[j].k for j in live)):
                logits = self.model.logits(state)
                keep, tokens = [], []
                for row, j in enumerate(live):
                    r = requests[j]
                    tok, probs = draft_token(logits[row], r, _PURPOSE, i)
                    if not confident(running[row], probs, self.min_token_prob):
                        continue
                    running[row] *= float(probs[tok])
                    drafts[j].append(int(vocab.token_ids[tok]))
                    rows[j].append(vocab.scatter(probs))
                    score[j] += running[row]
                    if len(drafts[j]) < r.k and running[row] >= self.min_token_prob:  # else no next slot can pass
                        keep.append(row)
                        tokens.append(tok)
                if not keep:
                    break
                # the drafted pairs (own state, drafted token) at positions n + i; their keys go after the context's
                # pairs for the next draft and are overwritten by the next step's true pairs
                dev = state.device
                z = self.model.pair_inputs(state[keep], torch.tensor(tokens, device=dev))
                step_rows = []
                for at, row in enumerate(keep):
                    r, ctx = requests[live[row]], ctxs[row]
                    step_rows.append((ctx, z[at : at + 1], torch.tensor([len(r.token_ids) - 1 + i], device=dev)))
                state = torch.cat(self._forward(step_rows))
                for ctx, *_ in step_rows:
                    ctx.length += 1
                live, ctxs, running = [live[row] for row in keep], [ctxs[row] for row in keep], \
                    [running[row] for row in keep]
            for j, ctx in touched:  # drop the drafted pairs: only the committed ones stay
                ctx.length = len(requests[j].token_ids) - 1 - ctx.start
        return [Proposal(torch.tensor(d, dtype=torch.int64), torch.stack(r), sc) if d else Proposal.empty()
                for d, r, sc in zip(drafts, rows, score)]

    def release(self, seq_id: int, final_token_ids: list[int] | None = None) -> None:
        """Free the context of ``seq_id``."""
        self._contexts.pop(seq_id, None)

    def gauges(self) -> dict[str, float]:
        """The head's contexts: sequences and positions held."""
        return {"spec_decode_eagle_cache_sequences": len(self._contexts),
                "spec_decode_eagle_cache_pairs": sum(c.length for c in self._contexts.values())}
