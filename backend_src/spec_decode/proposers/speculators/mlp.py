"""IBM's MLP speculator (``speculative_method=mlp_speculator``): a chain of small heads that drafts from the target's
last hidden state and the tokens drafted so far (Wertheimer et al. 2024, "Accelerating Production LLMs with Combined
Token/Embedding Speculators", arXiv 2404.19124).

Head i (0-based) turns a state s and the token t before the draft into the next state and the draft's logits::

    s = proj[i](s) + emb[i](t) * emb_weight / state_weight
    s = GELU(ln[i](s))            # ln: RMS normalisation with a scale and a shift (fms LayerNormParameterized)
    logits = head[i](s)

with state_weight = 0.5 ** (0.5 / n_predict) and emb_weight = sqrt((1 - state_weight**2) * inner_dim / 2). Head 0
reads the target's hidden state (``scale_input``: first RMS-normalised without parameters, then divided by sqrt 2) and
the last committed token; head i + 1 reads head i's state and the token drafted at i. fms-extras
(``fms_extras/models/speculator.py``, ``MLPSpeculator``) writes the sum as ``proj(s) * state_weight + emb(t) *
emb_weight``, the same after the normalisation (up to its epsilon); vLLM (``vllm/model_executor/models/
mlp_speculator.py``) and Arctic Inference divide by state_weight as above, and so do we.

``tie_weights`` shares one embedding, one LM head and one norm between the heads, and the projections of heads 1..n-1
(head 0's reads the target's width). Checkpoints come as Hugging Face folders (``MLPSpeculatorPreTrainedModel``,
``model_type: mlp_speculator``): weights named ``speculator.emb.{i}.weight`` (``speculator.`` dropped in fms-native
and ArcticTraining files), in safetensors (where tied copies are saved once) or ``pytorch_model.bin`` (every name).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...sampling import NoisePurpose
from ..base import Proposal, ProposalRequest, draft_token, slot_outcomes
from .base import HeadProposer
from .checkpoint import SpeculatorLoadError, config_int, find_weights, load_weights, read_config, take
from .target import TargetInfo

NORM_EPS = 1e-6  # fms LayerNormParameterized's and vLLM MLPSpeculatorLayerNorm's epsilon
PREFIX = "speculator."  # what MLPSpeculatorPreTrainedModel puts before its weights' names


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x * rsqrt(mean(x**2) + 1e-6)`` over the last dimension, then ``* weight + bias`` when given (fms
    ``LayerNormParameterized`` with ``use_mean=False``; vLLM ``MLPSpeculatorLayerNorm``), computed in float32.

    Args:
        x: [..., D] any float dtype. weight, bias: [D] or None.

    Returns:
        [..., D] in ``x``'s dtype.
    """
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)).to(x.dtype)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def _frozen(tensors: Sequence[torch.Tensor]) -> nn.ParameterList:
    return nn.ParameterList([nn.Parameter(t.detach(), requires_grad=False) for t in tensors])


class MLPSpeculatorHead(nn.Module):
    """IBM's MLP speculator (fms-extras ``MLPSpeculator``; vLLM ``MLPSpeculator``), for inference.

    Each weight list holds either one entry per head or, when tied, fewer: head i uses entry ``min(i, len - 1)``
    (``tie_weights``: one embedding, LM head and norm; projections [proj 0, proj 1 shared by heads 1..n-1]).

    Args:
        emb: [V, D] token embeddings (n_predict, or 1 when tied).
        proj: [D, H] for head 0 then [D, D] (n_predict, or 2 when tied).
        ln_weight, ln_bias: [D] the norms' scales and shifts (n_predict, or 1 when tied).
        head: [V, D] LM heads (n_predict, or 1 when tied).
        n_predict: the number of heads (drafts per step at most).
        scale_input: RMS-normalise the target's state (no parameters) and divide it by sqrt 2 before head 0.

    Raises:
        ValueError: lists of other lengths or shapes that do not chain.
    """

    def __init__(self, emb: Sequence[torch.Tensor], proj: Sequence[torch.Tensor], ln_weight: Sequence[torch.Tensor],
                 ln_bias: Sequence[torch.Tensor], head: Sequence[torch.Tensor], n_predict: int,
                 scale_input: bool = False):
        super().__init__()
        if n_predict < 1 or any(len(x) not in (1, n_predict) for x in (emb, ln_weight, ln_bias, head)) \
                or len(proj) not in (min(2, n_predict), n_predict):
            raise ValueError(f"weights for {n_predict} heads expected, got {len(emb)} embeddings, {len(proj)} "
                             f"projections, {len(ln_weight)} norms and {len(head)} LM heads")
        self.emb, self.proj, self.head = _frozen(emb), _frozen(proj), _frozen(head)
        self.ln_weight, self.ln_bias = _frozen(ln_weight), _frozen(ln_bias)
        self.n_predict, self.scale_input = n_predict, scale_input
        self.vocab_size, self.inner_dim = head[0].shape
        self.hidden_size = proj[0].shape[1]
        state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_scale = math.sqrt((1 - state_weight**2) * self.inner_dim / 2) / state_weight

    @staticmethod
    def _at(params: nn.ParameterList, i: int) -> torch.Tensor:
        return params[min(i, len(params) - 1)]

    def begin(self, states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The carry head 0 reads: the target's states [B, H] (any float dtype and device), in the head's dtype and
        device, normalised when ``scale_input``. Returns ``(state [B, H],)``."""
        x = states.to(device=self.head[0].device, dtype=self.head[0].dtype)
        return ((rms_norm(x) / math.sqrt(2)) if self.scale_input else x,)

    def step(self, i: int, carry: tuple[torch.Tensor, ...], tokens: torch.Tensor
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Head ``i`` on a batch: ``carry`` from :meth:`begin` or the previous step, ``tokens`` [B] int64 (the token
        before the draft). Returns (logits [B, V] in the head's dtype, the carry for head i + 1: ``(state [B, D],)``).
        """
        s = F.linear(carry[0], self._at(self.proj, i))
        s = s + F.embedding(tokens, self._at(self.emb, i)) * self.emb_scale
        s = F.gelu(rms_norm(s, self._at(self.ln_weight, i), self._at(self.ln_bias, i)))
        return F.linear(s, self._at(self.head, i)), (s,)

    def forward(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Every head with given input tokens (fms-extras ``MLPSpeculator.forward`` at one position): ``states`` [B, H],
        ``tokens`` [B, n <= n_predict] int64 (column i is head i's input token). Returns logits [B, n, V]."""
        carry, out = self.begin(states), []
        for i in range(tokens.shape[1]):
            logits, carry = self.step(i, carry, tokens[:, i])
            out.append(logits)
        return torch.stack(out, 1)


def weight_prefix(state: dict[str, torch.Tensor]) -> str:
    """``speculator.`` when the weights [name -> tensor] carry MLPSpeculatorPreTrainedModel's prefix, else ``""``
    (vLLM ``MLPSpeculator.load_weights`` and Arctic Inference drop it when loading)."""
    return PREFIX if any(k.startswith(PREFIX) for k in state) else ""


def take_stage(state: dict[str, torch.Tensor], file: Path, name: str, i: int, shape: tuple[int, ...], why: str,
               tied: Sequence[int] = (), sub: str = "weight") -> torch.Tensor:
    """Weight ``{name}.{i}.{sub}`` (``name`` with its prefix) as float32 of ``shape``; for a tied stage whose copy
    ``i`` was not saved (safetensors keeps one name per shared tensor), the first of ``{name}.{j}.{sub}``, j in
    ``tied``, that is (vLLM loads a tied stage from whichever copy the file names).

    Raises:
        SpeculatorLoadError: none there (naming ``{name}.{i}.{sub}``), or another shape.
    """
    key = f"{name}.{i}.{sub}"
    if key not in state:
        key = next((k for k in (f"{name}.{j}.{sub}" for j in tied) if k in state), key)
    return take(state, key, shape, file, why)


def mlp_weights(state: dict[str, torch.Tensor], file: Path, n: int, hidden: int, inner: int, vocab: int, tie: bool,
                layer: str = "") -> dict[str, list[torch.Tensor]]:
    """The MLP speculator's weights from a checkpoint's tensors, checked against the sizes (names and shapes of
    fms-extras ``MLPSpeculator``: ``emb.{i}`` [V, D], ``proj.{i}`` [D, H] then [D, D], ``ln.{i}`` [D], ``head.{i}``
    [V, D]; ties as vLLM ``MLPSpeculator.__init__``).

    Args:
        state: the weights file's tensors. file: its path (for errors).
        n, hidden, inner, vocab: n_predict, the target's hidden size H, inner_dim D, the vocabulary V.
        tie: ``tie_weights`` (keeps one embedding / norm / LM head, projections 0 and 1).
        layer: inserted after the stage index of ``emb``, ``proj`` and ``ln`` (``0.`` for Arctic's sum_rnn, whose
            stages are ``nn.Sequential``: ``emb.{i}.0.weight``).

    Returns:
        ``emb``, ``proj``, ``ln_weight``, ``ln_bias``, ``head``: the lists :class:`MLPSpeculatorHead` takes.

    Raises:
        SpeculatorLoadError: a weight missing or of another shape (naming the file and the key).
    """
    p = weight_prefix(state)
    kept = (1 if tie else n), (min(2, n) if tie else n)
    every = range(n) if tie else ()  # the copies a tied stage may be saved under (proj: 1..n-1 after head 0's)
    why_h, why_v = f"hidden size {hidden} of the target", f"inner_dim {inner}, vocabulary {vocab}"
    return {
        "emb": [take_stage(state, file, f"{p}emb", i, (vocab, inner), why_v, every, f"{layer}weight")
                for i in range(kept[0])],
        "proj": [take_stage(state, file, f"{p}proj", i, (inner, hidden if i == 0 else inner),
                            why_h if i == 0 else f"inner_dim {inner}", range(1, n) if tie and i else (),
                            f"{layer}weight") for i in range(kept[1])],
        "ln_weight": [take_stage(state, file, f"{p}ln", i, (inner,), f"inner_dim {inner}", every, f"{layer}weight")
                      for i in range(kept[0])],
        "ln_bias": [take_stage(state, file, f"{p}ln", i, (inner,), f"inner_dim {inner}", every, f"{layer}bias")
                    for i in range(kept[0])],
        "head": [take_stage(state, file, f"{p}head", i, (vocab, inner), why_v, every) for i in range(kept[0])],
    }


def config_flag(cfg: dict[str, Any], key: str, file: Path | str, default: bool = False) -> bool:
    """A boolean config value (``default`` when absent: older configs lack ``tie_weights`` and ``scale_input``,
    which vLLM's ``MLPSpeculatorConfig`` then reads as false).

    Raises:
        SpeculatorLoadError: not a boolean.
    """
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise SpeculatorLoadError(file, key, f"must be true or false, got {value!r}")
    return value


def check_size(cfg: dict[str, Any], key: str, value: int, want: int, file: Path | str, what: str) -> None:
    """Raise :class:`SpeculatorLoadError` (naming ``key``) unless the config's ``value`` is the target's ``want``."""
    if value != want:
        raise SpeculatorLoadError(file, key, f"{cfg.get(key)!r} does not fit {what} ({want})")


def chain_sizes(cfg: dict[str, Any], file: Path | str, hidden_key: str, target: TargetInfo) -> tuple[int, int, int]:
    """``n_predict``, the hidden size (under ``hidden_key``: ``emb_dim`` for IBM's config, ``input_hidden_dim`` for
    Arctic's) and ``vocab_size`` of a chain speculator's config, the last two checked against ``target``.

    Raises:
        SpeculatorLoadError: a missing or non-integer value, or one that does not fit the target (naming the key).
    """
    n = config_int(cfg, "n_predict", file)
    hidden = config_int(cfg, hidden_key, file)
    check_size(cfg, hidden_key, hidden, target.hidden_size, file, "the target's hidden size")
    vocab = config_int(cfg, "vocab_size", file)
    check_size(cfg, "vocab_size", vocab, target.vocab_size, file, "the target's vocabulary")
    return n, hidden, vocab


@dataclass(frozen=True)
class MLPConfig:
    """An MLP speculator's config as :func:`check_mlp_config` read it: ``n_predict``, ``hidden`` (``emb_dim``, the
    target's hidden size), ``vocab`` (``vocab_size``), ``inner`` (``inner_dim``; 0: emb_dim), ``tie_weights``,
    ``scale_input``."""

    n_predict: int
    hidden: int
    vocab: int
    inner: int
    tie_weights: bool
    scale_input: bool


def check_mlp_config(folder: Path, target: TargetInfo, cfg: dict[str, Any] | None = None) -> MLPConfig:
    """An MLP speculator's ``config.json`` (the MLPSpeculatorConfig keys: ``emb_dim``, ``inner_dim`` (0: emb_dim),
    ``vocab_size``, ``n_predict``, ``tie_weights``, ``scale_input``; vLLM ``transformers_utils/configs/
    mlp_speculator.py``) checked against the target without reading its weights: emb_dim = its hidden size,
    vocab_size = its vocabulary. What :func:`load_mlp_speculator` (and Arctic's loader) checks first, and the launcher
    before it starts anything (:func:`~spec_decode.proposers.speculators.check_heads_fit`).

    Args:
        folder: the head's folder.
        target: the target it drafts for (its sizes).
        cfg: the folder's config when already read (Arctic's MLP speculator); None: read here.

    Returns:
        The sizes and flags read (:class:`MLPConfig`).

    Raises:
        SpeculatorLoadError: naming ``config.json`` and the key: a missing or non-integer size, ``emb_dim`` or
            ``vocab_size`` that does not fit the target, a flag that is not a boolean, ``tie_weights`` with one head.
    """
    cfile = Path(folder) / "config.json"
    cfg = read_config(Path(folder)) if cfg is None else cfg
    n, hidden, vocab = chain_sizes(cfg, cfile, "emb_dim", target)
    inner = config_int(cfg, "inner_dim", cfile, default=0, low=0) or hidden
    tie, scale = config_flag(cfg, "tie_weights", cfile), config_flag(cfg, "scale_input", cfile)
    if tie and n < 2:
        raise SpeculatorLoadError(cfile, "tie_weights", "ties the heads of a speculator with one head (n_predict 1)")
    return MLPConfig(n, hidden, vocab, inner, tie, scale)


def mlp_head(c: MLPConfig, folder: Path) -> MLPSpeculatorHead:
    """The :class:`MLPSpeculatorHead` of a checked config (:func:`check_mlp_config`) from the folder's weights.

    Raises:
        SpeculatorLoadError: a weight missing or of another shape (naming the file and the key).
    """
    file = find_weights(folder)
    return MLPSpeculatorHead(**mlp_weights(load_weights(file), file, c.n_predict, c.hidden, c.inner, c.vocab,
                                           c.tie_weights), n_predict=c.n_predict, scale_input=c.scale_input)


def load_mlp_speculator(folder: Path, target: TargetInfo) -> MLPSpeculatorHead:
    """The MLP speculator in ``folder`` (``config.json`` of ``MLPSpeculatorPreTrainedModel`` and one weights file),
    float32 on the CPU, checked against ``target``: emb_dim = its hidden size, vocab_size = its vocabulary, every
    weight there with its shape (fms-extras ``MLPSpeculatorPreTrainedModel``; vLLM ``MLPSpeculator.load_weights``).

    Raises:
        SpeculatorLoadError: naming the file and the key that does not fit.
    """
    return mlp_head(check_mlp_config(Path(folder), target), Path(folder))


def propose_chain(proposer: HeadProposer, requests: list[ProposalRequest], purpose: NoisePurpose
                  ) -> list[Proposal]:
    """Drafts of a chain head (:class:`MLPSpeculatorHead`, Arctic's LSTM): every live row of a round through each
    head position as one batch.

    A request with hidden states starts from its last one (the state that predicted ``token_ids[-1]``) and that
    token; it drafts up to min(k, n_predict) tokens, each through :func:`~spec_decode.proposers.base.draft_token`
    (processors, then greedy / seeded / coupled sampling), stopping at the first slot where
    :func:`~spec_decode.proposers.base.confident` fails. A request without hidden states gets no drafts.

    Returns:
        per request, draft ids [k'] int64, draft_probs [k', V] float32 (on the head's device: the distributions the
        drafts were drawn from), score the sum of the drafts' running probability products.
    """
    head = proposer.head
    out = [Proposal.empty() for _ in requests]
    live, states = proposer.last_states(requests, proposer.hidden_size)
    if states is None:
        return out
    carry = head.begin(states)
    dev, vocab = carry[0].device, head.vocab_size
    ks = [min(r.k, head.n_predict) for r in requests]
    drafts: list[list[int]] = [[] for _ in requests]
    rows: list[list[torch.Tensor]] = [[] for _ in requests]
    score, running = [0.0] * len(requests), [1.0] * len(requests)
    tokens = [min(max(requests[j].token_ids[-1], 0), vocab - 1) for j in live]  # Arctic Inference clamps too
    for i in range(max(ks[j] for j in live)):
        logits, carry = head.step(i, carry, torch.tensor(tokens, dtype=torch.int64, device=dev))
        keep, tokens = [], []
        picks = [draft_token(logits[row], requests[j], purpose, i, drafts[j], None, proposer.grammar, vocab,
                             lazy=True) for row, j in enumerate(live)]
        # the slot's tokens, confidence and probabilities in one copy to the host
        for (row, j), (_, probs), (tok, passes, p_tok) in zip(
                enumerate(live), picks, slot_outcomes(picks, [running[j] for j in live], proposer.min_token_prob)):
            if not passes:
                continue
            running[j] *= p_tok
            score[j] += running[j]
            drafts[j].append(tok)
            rows[j].append(probs.float())
            if len(drafts[j]) < ks[j] and running[j] >= proposer.min_token_prob:  # else no later slot can pass
                keep.append(row)
                tokens.append(tok)
        if not keep:
            break
        if len(keep) < len(live):
            index = torch.tensor(keep, device=dev)
            carry = tuple(t.index_select(0, index) for t in carry)
            live = [live[row] for row in keep]
    for j, d in enumerate(drafts):
        if d:
            out[j] = Proposal(torch.tensor(d, dtype=torch.int64), torch.stack(rows[j]), score[j])
    return out


class MLPSpeculatorProposer(HeadProposer):
    """Drafts with IBM's MLP speculator (``speculative_method=mlp_speculator``) from the target's last hidden state:
    up to min(k, n_predict) drafts per step (k is capped, never refused), stopping early while unsure
    (``speculator_min_token_prob``). Stateless between steps: each step starts from the hidden state the step
    brings (vLLM ``MLPSpeculatorWorker``)."""

    name = "mlp_speculator"

    @classmethod
    def load(cls, folder: Path, target: TargetInfo) -> MLPSpeculatorHead:
        """:func:`load_mlp_speculator`.

        Raises:
            SpeculatorLoadError: naming the file and the key that does not fit.
        """
        return load_mlp_speculator(folder, target)

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """:func:`propose_chain` with the MLP speculator's noise (``NoisePurpose.MLP_SPECULATOR``); a request that takes
        trees gets a candidate tree (:func:`.candidate_tree.propose_heads`)."""
        from .candidate_tree import propose_heads

        return propose_heads(self, requests, NoisePurpose.MLP_SPECULATOR, propose_chain)
