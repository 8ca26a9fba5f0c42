"""The EAGLE-3 head (Li et al. 2025, arXiv 2503.01840) and the layout it is published in (read by
:mod:`.eagle3_published`, written by :meth:`Eagle3Head.save`).

EAGLE-3 drafts from three of the target's layers instead of its last one. Pair j joins the target's auxiliary hidden
states at position j (the inputs of layers 2, L // 2 and L - 3, or the ids its config names) with the embedding of
x_{j+1}:

    g_j   = fc [a_j^(1); a_j^(2); a_j^(3)]                          [3H] -> [H], no bias (the head's own output
                                                                    a'_{j-1} [H] in place of g_j when drafting)
    u_j   = [RMSNorm_in(E(x_{j+1})); RMSNorm_hidden(g_j)]           [2H]: the attention's input
    h_j   = g_j + Attn(u_0..u_j);  a'_j = h_j + MLP(RMSNorm_post(h_j))  one decoder layer (residual: g_j)
    q_j   = softmax(lm_head(RMSNorm(a'_j)))                         over the head's draft vocabulary

E is the target's input embedding (full vocabulary, frozen); lm_head covers a draft vocabulary of N target tokens,
draft index i being target token ``i + d2t[i]``. The layout, as the EAGLE authors' trainer (SafeAILab/EAGLE
``eagle/traineagle3``) writes it and vLLM (``model_executor/models/llama_eagle3.py``) and SGLang load it:
``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``, or the trainer's ``LlamaForCausalLM`` with
``draft_vocab_size``; sizes, rope settings, optionally ``eagle_config.eagle_aux_hidden_state_layer_ids``) and weights
(``pytorch_model.bin`` or ``model.safetensors``): ``fc.weight``, ``midlayer.{input_layernorm, hidden_norm,
post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,
down}_proj.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t`` [N] int64, ``t2d`` [V] bool, and optionally
``embed_tokens.weight`` (else the target's is shared).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...engine.draft_vocab import DraftVocab
from .model import RMSNorm, gqa_attention, rope_inv_freq, rotate

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"
# head weight name in the published layout -> this module's parameter name
WEIGHT_NAMES = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "input_norm.weight",
    "midlayer.hidden_norm.weight": "hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight": "post_norm.weight",
    "midlayer.self_attn.q_proj.weight": "q_proj.weight",
    "midlayer.self_attn.k_proj.weight": "k_proj.weight",
    "midlayer.self_attn.v_proj.weight": "v_proj.weight",
    "midlayer.self_attn.o_proj.weight": "o_proj.weight",
    "midlayer.mlp.gate_proj.weight": "gate_proj.weight",
    "midlayer.mlp.up_proj.weight": "up_proj.weight",
    "midlayer.mlp.down_proj.weight": "down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


class Eagle3Head(nn.Module):
    """The EAGLE-3 head, with the same drafting interface as :class:`~.model.EagleHead` (``features``,
    ``pair_inputs``, ``project``, ``attend``, ``finish``, ``layer``, ``logits``), so that
    :class:`~.proposer.EagleProposer` drafts with either.

    Args:
        embedding: [V, H] the input embedding (frozen): the target's, or the head's own when its width differs.
        config: ``hidden_size`` (H, the head's width), ``num_attention_heads``, ``num_key_value_heads``,
            ``intermediate_size``, ``rms_norm_eps``, ``draft_vocab_size``; optional ``head_dim`` (default H / heads),
            ``rope_theta``, ``rope_scaling``, ``max_position_embeddings`` (0: no bound), ``target_hidden_size``
            (H_t, the target's width ``fc`` reads 3 x of; default H), ``fc_bias``, ``qkv_bias`` and ``o_bias``
            (the attention's biases, speculators' ``attention_bias``), ``norm_before_residual`` (the residual is the
            normed ``g``, vLLM ``llama_eagle3.py`` ``_norm_before_residual``) and ``norm_before_fc`` (an RMSNorm
            ``fc_input_norm`` over the concatenated auxiliary states before ``fc``, SGLang PR #32334), all default
            false.
        num_aux: how many target layers ``fc`` reads (3).
        aux_columns: the column blocks of the wire's hidden states holding those layers, in ``fc``'s order (block 0
            is the last hidden state; default 1..num_aux).

    Raises:
        ValueError: heads that do not divide, or an embedding of another width.
    """

    embeds_target_ids = True  # pair_inputs takes target ids (its embedding is the target's whole one)
    embedding: torch.Tensor  # buffer

    def __init__(self, embedding: torch.Tensor, config: dict, num_aux: int = 3, aux_columns: list[int] | None = None):
        super().__init__()
        h = int(config["hidden_size"])
        if embedding.ndim != 2 or embedding.shape[1] != h:
            raise ValueError(f"embedding {tuple(embedding.shape)} is not [V, {h}]")
        self.config = dict(config)
        self.width = h
        self.target_width = int(config.get("target_hidden_size") or h)
        self.heads, self.kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
        self.head_dim = int(config.get("head_dim") or h // self.heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} attention heads are not a multiple of {self.kv_heads} key/value heads")
        eps, inter, n = float(config["rms_norm_eps"]), int(config["intermediate_size"]), int(config["draft_vocab_size"])
        self.aux_columns = list(aux_columns or range(1, num_aux + 1))
        self.norm_before_residual = bool(config.get("norm_before_residual", False))
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self.register_buffer("embedding", embedding.detach().float().clone())
        self.fc_input_norm: nn.Module = (RMSNorm(num_aux * self.target_width, eps) if config.get("norm_before_fc")
                                         else nn.Identity())
        self.fc = nn.Linear(num_aux * self.target_width, h, bias=bool(config.get("fc_bias", False)))
        self.input_norm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        bias = bool(config.get("qkv_bias", False))
        self.q_proj = nn.Linear(2 * h, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=bool(config.get("o_bias", False)))
        self.post_norm = RMSNorm(h, eps)
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, n, bias=False)

    @property
    def head(self) -> torch.Tensor:
        """[N, H] the LM head over the draft vocabulary (its device and dtype are the head's)."""
        return self.lm_head.weight

    @property
    def hidden_size(self) -> int:
        """H_t, the target's hidden size (the width of each block of the wire's hidden states)."""
        return self.target_width

    @property
    def max_positions(self) -> int:
        """The bound on positions it drafts for (the target's, recorded at load); 0: none known."""
        return int(self.config.get("max_position_embeddings", 0) or 0)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """[m, H x (1 + A)] hidden states as the wire brings them -> [m, num_aux x H]: this head's layers'
        blocks, in its ``fc``'s order."""
        h = self.hidden_size
        return torch.cat([hidden[..., c * h : (c + 1) * h] for c in self.aux_columns], -1)

    def pair_inputs(self, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The layer's inputs [..., 3H]: (residual, normed embedding, normed g) for pairs of ``state`` (the target's
        auxiliary states [..., num_aux x H_t], through ``fc``; or the head's own output [..., H] when drafting) and
        ``tokens`` [...] int64 target ids. The residual is g, or its norm with ``norm_before_residual``."""
        g = state.to(self.embedding.dtype)
        if g.shape[-1] != self.width:
            g = self.fc(self.fc_input_norm(g))
        normed = self.hidden_norm(g)
        return torch.cat([normed if self.norm_before_residual else g, self.input_norm(self.embedding[tokens]),
                          normed], -1)

    def project(self, z: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries [B, heads, T, D], keys and values [B, kv_heads, T, D] of inputs z [B, T, 3H] (from their
        [2H] attention part) at ``positions`` [B, T]."""
        b, t, _ = z.shape
        x = z[..., self.width :]
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        inv = self._inv_freq.get(z.device)
        if inv is None:
            inv = self._inv_freq[z.device] = rope_inv_freq(self.config, self.head_dim).to(z.device)
        return rotate(q, positions, inv), rotate(k, positions, inv), v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention (:func:`~.model.gqa_attention`): [B, T, heads x D]."""
        return gqa_attention(q, keys, values, mask)

    def finish(self, z: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """The layer's output a' [..., H] before the final norm (what drafting feeds back) from inputs z [..., 3H]
        and their attention [..., heads x D]."""
        h = z[..., : self.width] + self.o_proj(att)
        x = self.post_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def layer(self, z: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
              past: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, tuple]:
        """As :meth:`~.model.EagleHead.layer`, z [B, T, 3H]."""
        q, k, v = self.project(z, positions)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        return self.finish(z, self.attend(q, keys, values, mask)), (k, v)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[..., H] layer outputs -> [..., N] logits over the draft vocabulary (final norm, then lm_head)."""
        return self.lm_head(self.norm(out))

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Teacher-forced outputs [B, T, H] of pairs (features [B, T, num_aux x H], tokens [B, T] target ids of
        x_{j+1}, positions [B, T]), causal."""
        t = features.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=features.device).tril()[None, None]
        return self.layer(self.pair_inputs(features, tokens), positions, causal)[0]

    def save(self, folder: Path, vocab: DraftVocab, layer_ids: list[int], extra: dict | None = None,
             dtype: torch.dtype = torch.float16, with_embedding: bool = True) -> None:
        """Write the published layout (module docstring) into ``folder``: ``config.json`` and ``model.safetensors``
        (``dtype``, float16 as published; ``d2t``/``t2d`` as the trainer computes them), with the target's
        embedding when ``with_embedding`` (vLLM and SGLang take it when present, else share the target's).

        Args:
            vocab: the draft vocabulary (draft index i = target id ``vocab.token_ids[i]``), ascending ids.
            layer_ids: the target layers ``fc`` reads (``eagle_config.eagle_aux_hidden_state_layer_ids``).
            extra: more config keys (the training report's summary).
        """
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        own = self.state_dict()
        state = {pub: own[mine].to(dtype).contiguous() for pub, mine in WEIGHT_NAMES.items()}
        ids = vocab.token_ids
        state["d2t"] = (ids - torch.arange(len(ids))).to(torch.int64)
        t2d = torch.zeros(vocab.target_vocab_size, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
        if with_embedding:
            state["embed_tokens.weight"] = self.embedding.to(dtype).contiguous()
        save_file(state, str(folder / WEIGHTS_FILE))
        c = self.config
        cfg = {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": self.width,
               "intermediate_size": self.gate_proj.out_features, "num_attention_heads": self.heads,
               "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "num_hidden_layers": 1,
               "rms_norm_eps": float(c["rms_norm_eps"]), "rope_theta": float(c.get("rope_theta", 10000.0)),
               "rope_scaling": c.get("rope_scaling"), "max_position_embeddings": self.max_positions or 2048,
               "vocab_size": vocab.target_vocab_size, "draft_vocab_size": len(vocab), "hidden_act": "silu",
               "bias": False, "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True},
               **(extra or {})}
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
