"""The EAGLE head: one decoder layer over (hidden state, next token) pairs, drafting from the target's features.

EAGLE (Li et al. 2024, arXiv 2401.15077; EAGLE-3, arXiv 2503.01840). The head is one decoder layer of the target's
architecture (RMSNorm, grouped-query attention with rotary positions, SwiGLU MLP) over a sequence of *pairs*: pair j
joins the target's hidden state after token x_j with the embedding of the token that followed, x_{j+1}; its output
predicts the target's next hidden state f_{j+1}, from which the target's frozen LM head reads the distribution of
x_{j+2}:

    z_j   = W [E(x_{j+1}); f_j] + b                        [2H] -> [H], f_j the target's last hidden state at j
    a_j   = DecoderLayer(z_0..z_j)                         causal attention over the sequence's earlier pairs
    q_j   = softmax(head(a_j))                             the draft distribution of x_{j+2}

E and head are the target's input embedding and LM head over a pruned vocabulary
(:class:`~spec_decode.engine.draft_vocab.DraftVocab`: the kept tokens, plus one embedding row for every other input
token), frozen. A head's folder holds ``config.json`` (sizes), ``eagle.safetensors`` and ``draft_vocab.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...engine.draft_vocab import DraftVocab, load_draft_vocab

CONFIG_FILE, WEIGHTS_FILE = "config.json", "eagle.safetensors"


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


def rope_inv_freq(config: dict, head_dim: int) -> torch.Tensor:
    """The rotary frequencies [head_dim / 2] float32 of a head's config: ``rope_theta`` and, when the config has one,
    its ``rope_scaling`` (or ``rope_parameters``) as transformers computes it (``llama3``, ``linear``, ...).

    Raises:
        ValueError: a scaling that also scales the attention (YaRN's), which these heads do not apply.
    """
    theta = float(config.get("rope_theta", 10000.0) or 10000.0)
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    if kind == "default":
        return 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    settings: dict = {"rope_theta": theta, "rope_scaling": dict(scaling)}  # transformers reads them as kwargs
    cfg = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim, max_position_embeddings=int(
        config.get("max_position_embeddings") or scaling.get("original_max_position_embeddings") or 2048), **settings)
    inv, attention_scaling = ROPE_INIT_FUNCTIONS[str(kind)](cfg, None)
    if abs(float(attention_scaling) - 1.0) > 1e-6:
        raise ValueError(f"rope_scaling {kind!r} scales the attention by {attention_scaling}: not supported")
    return inv.float()


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


def gqa_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                  expand: bool | None = None) -> torch.Tensor:
    """Grouped-query attention: q [B, heads, T, D] over keys/values [B, kv_heads, S, D] where ``mask`` [B or 1, 1,
    T, S] (bool) allows; returns [B, T, heads x D].

    On CUDA the keys and values are expanded to the query heads first: PyTorch's memory-efficient kernel takes a
    boolean mask but not ``enable_gqa``, flash takes ``enable_gqa`` but no mask, so the grouped form would run the
    math kernel (the GPU check's attention report, ``bench/gpu_check/attention.py``, shows which runs). Elsewhere the
    grouped call (the CPU's kernels take both). ``expand``: force either form (None: expanded on CUDA). The two
    compute the same attention (query head h reads key head h // (heads / kv_heads) in both).
    """
    if (q.is_cuda if expand is None else expand) and keys.shape[1] != q.shape[1]:
        groups = q.shape[1] // keys.shape[1]
        att = F.scaled_dot_product_attention(q, keys.repeat_interleave(groups, dim=1),
                                             values.repeat_interleave(groups, dim=1), attn_mask=mask)
    else:
        att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    return att.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


class EagleHead(nn.Module):
    """The EAGLE head: the pairs' input layer and one decoder layer, over a frozen pruned embedding and LM head.

    Args:
        embedding: [N + 1, H] the target's input embedding rows of the kept tokens, then the "outside the set" row;
            or, with ``embeds_target_ids``, [V, H] the whole embedding (a published EAGLE-1 head's).
        head: [N, H] the target's LM head rows of the kept tokens.
        config: sizes as the target's (:func:`eagle_config`): ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim``, ``intermediate_size``, ``rope_theta``, ``rms_norm_eps``; optional ``rope_scaling``
            (:func:`rope_inv_freq`), ``input_norm`` (default true: the layer's input RMSNorm; EAGLE-1's published heads
            have none), ``fc_bias`` (default true: the bias of ``fc``, EAGLE-1's ``bias`` setting), ``qkv_bias`` and
            ``o_bias`` (default false: biases of the attention's q/k/v and output projections, as Qwen2's and
            Llama's ``attention_bias``) and ``para_norm`` (default false: HASS's ``add_para_norm``, RMSNorms ``enorm``
            on the embedding and ``hnorm`` on the hidden state before ``fc``).
        embeds_target_ids: :meth:`pair_inputs` takes target ids (rows of a [V, H] embedding) instead of
            draft-vocabulary indices.

    Raises:
        ValueError: shapes that disagree, or heads that do not divide.
    """

    embedding: torch.Tensor  # buffers (register_buffer), declared for the type checker
    head: torch.Tensor

    def __init__(self, embedding: torch.Tensor, head: torch.Tensor, config: dict, embeds_target_ids: bool = False):
        super().__init__()
        h = embedding.shape[1]
        if (not embeds_target_ids and embedding.shape[0] != head.shape[0] + 1) or head.shape[1] != h:
            raise ValueError(f"embedding [N+1, H] {tuple(embedding.shape)} and head [N, H] {tuple(head.shape)} "
                             f"disagree")
        self.embeds_target_ids = embeds_target_ids
        self.config = dict(config)
        self.heads, self.kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
        self.head_dim = int(config["head_dim"])
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} attention heads are not a multiple of {self.kv_heads} key/value heads")
        eps, inter = float(config["rms_norm_eps"]), int(config["intermediate_size"])
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # the rotary frequencies per device (rotate)
        self.register_buffer("embedding", embedding.detach().float().clone())
        self.register_buffer("head", head.detach().float().clone())
        self.fc = nn.Linear(2 * h, h, bias=bool(config.get("fc_bias", True)))
        para = bool(config.get("para_norm", False))
        self.enorm: nn.Module = RMSNorm(h, eps) if para else nn.Identity()
        self.hnorm: nn.Module = RMSNorm(h, eps) if para else nn.Identity()
        self.input_norm: nn.Module = RMSNorm(h, eps) if config.get("input_norm", True) else nn.Identity()
        qkv_bias = bool(config.get("qkv_bias", False))
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=bool(config.get("o_bias", False)))
        self.post_norm = RMSNorm(h, eps)
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    @property
    def max_positions(self) -> int:
        """The target's ``max_position_embeddings``; 0 when the head's config.json does not record it (no bound
        known)."""
        return int(self.config.get("max_position_embeddings", 0) or 0)

    @property
    def hidden_size(self) -> int:
        """H, the target's hidden size."""
        return self.embedding.shape[1]

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states as the wire brings them, [m, H x (1 + A)] (the last hidden state, then the
        auxiliary layers' :func:`~spec_decode.proposers.speculators.aux_hidden_state_layers`), -> the [m, H] this
        head reads: the last hidden state."""
        return hidden[..., : self.hidden_size]

    def pair_inputs(self, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The layer's inputs z [..., H] for pairs (state [..., H]: the target's hidden state, or the head's own
        output when drafting; tokens [...]: int64 draft-vocabulary indices, or target ids with
        ``embeds_target_ids``); with ``para_norm``, each half normed first (``enorm``, ``hnorm``)."""
        return self.fc(torch.cat([self.enorm(self.embedding[tokens]), self.hnorm(state.to(self.embedding.dtype))], -1))

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
            inv = self._inv_freq[z.device] = rope_inv_freq(self.config, self.head_dim).to(z.device)
        return rotate(q, positions, inv), rotate(k, positions, inv), v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention (:func:`gqa_attention`): [B, T, heads x D]."""
        return gqa_attention(q, keys, values, mask)

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
            FileNotFoundError: no ``config.json``, weights or ``draft_vocab.json`` there.
        """
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg = json.loads((folder / CONFIG_FILE).read_text())
        state = load_file(str(folder / WEIGHTS_FILE))
        model = cls(state["embedding"], state["head"], cfg)
        model.load_state_dict(state)
        vocab = load_draft_vocab(folder)
        if vocab is None:  # save() writes it beside every head
            raise FileNotFoundError(f"EAGLE head folder {str(folder)!r} has no draft_vocab.json")
        return model.eval(), vocab


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
