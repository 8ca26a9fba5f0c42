"""Arctic Inference's speculators (``speculative_method=arctic``): Snowflake's MLP and LSTM heads, trained by
ArcticTraining and served by Arctic Inference's vLLM plugin (snowflakedb/ArcticInference
``arctic_inference/vllm/spec_dec/arctic_speculator.py``: ``ArcticMLPSpeculator``, ``ArcticLSTMSpeculator``; the
training side is snowflakedb/ArcticTraining ``projects/arctic_lstm_speculator/speculator/{speculator,configs}.py``).

Two architectures, told apart by ``architectures`` in ``config.json`` (``model_type`` is ``mlp_speculator`` for
both):

- ``ArcticMLPSpeculatorPreTrainedModel``: IBM's MLP speculator with its config keys and weight names
  (:mod:`.mlp`).
- ``ArcticLSTMSpeculatorPreTrainedModel`` (Arctic Inference also reads ``MLPVariantSpeculatorPreTrainedModel`` as
  it): config keys ``input_hidden_dim``, ``inner_dim`` / ``proj_dim`` / ``emb_dim`` (strings such as ``"4096"``;
  dotted ones such as ``"4096.4096"`` stack layers, not served here), ``vocab_size``, ``n_predict``,
  ``tie_weights``, ``scale_input``, ``tie_lstm_embs`` and ``method``:

  - ``sum_rnn`` (the default): the MLP speculator's maths with each stage an ``nn.Sequential``
    (``emb.{i}.0.weight``, ``proj.{i}.0.weight``, ``ln.{i}.0.weight`` / ``.bias``, ``head.{i}.weight``).
  - ``sum_lstm`` (the published heads; ``tie_weights`` required): per head i, with s the state (the target's
    hidden state, ``scale_input``-normalised, at head 0), c the cell (zero at head 0), t the input token, and
    a_g = proj_g[min(i, 1)](s) + emb_g(t) * emb_weight / state_weight for each gate g::

        f, u, o = sigmoid(a_forget), sigmoid(a_input), sigmoid(a_output)
        c = c * f + GELU(cell_ln(a_cell)) * u
        s = GELU(state_ln(c)) * o
        logits = head(s)

    Weights ``{forget,input,output,cell}_emb.0.weight`` (one table for all four with ``tie_lstm_embs``),
    ``{forget,input,output,cell}_proj.{0,1}.weight``, ``cell_ln.0.*``, ``state_ln.0.*``, ``head.{i}.weight``.

Both configs carry ``base_model_archs``, the targets' architectures the head was trained on: Arctic Inference refuses
a target whose architecture is not among them, and so do we. (A config without it, as ArcticTraining writes, is
served: the sizes are still checked.)
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
from ..base import Proposal, ProposalRequest
from .base import HeadProposer
from .candidate_tree import propose_heads
from .checkpoint import SpeculatorLoadError, find_weights, load_weights, read_config, take
from .mlp import (
    MLPConfig,
    MLPSpeculatorHead,
    chain_sizes,
    check_mlp_config,
    config_flag,
    mlp_head,
    mlp_weights,
    propose_chain,
    rms_norm,
    take_stage,
    weight_prefix,
)
from .target import TargetInfo

MLP_ARCH = "ArcticMLPSpeculatorPreTrainedModel"
LSTM_ARCHS = ("ArcticLSTMSpeculatorPreTrainedModel", "MLPVariantSpeculatorPreTrainedModel")
GATES = ("forget", "input", "output", "cell")  # the order of Arctic Inference's fused projection
METHODS = ("sum_rnn", "sum_lstm")


class ArcticLSTMHead(nn.Module):
    """Arctic's LSTM speculator (``method: sum_lstm``; Arctic Inference ``ArcticLSTMSpeculator.generate_states``),
    for inference. The four gates' projections are fused in :data:`GATES` order, as Arctic Inference loads them.

    Args:
        emb: [V, D] token embeddings: one for every gate (``tie_lstm_embs``), or one per gate in :data:`GATES` order.
        proj: the fused projections [4D, H] (head 0, from the target) and [4D, D] (heads 1..n-1); just the first
            when n_predict is 1.
        cell_ln, state_ln: (weight [D], bias [D]) of the cell candidate's and the state's norms.
        head: [V, D] LM heads: one shared, or n_predict.
        n_predict: the number of heads (drafts per step at most).
        scale_input: RMS-normalise the target's state (no parameters) and divide it by sqrt 2 before head 0.

    Raises:
        ValueError: lists of other lengths.
    """

    def __init__(self, emb: Sequence[torch.Tensor], proj: Sequence[torch.Tensor], cell_ln: Sequence[torch.Tensor],
                 state_ln: Sequence[torch.Tensor], head: Sequence[torch.Tensor], n_predict: int,
                 scale_input: bool = False):
        super().__init__()
        if len(emb) not in (1, 4) or len(proj) != min(2, n_predict) or len(head) not in (1, n_predict):
            raise ValueError(f"expected 1 or 4 embeddings, {min(2, n_predict)} projections and 1 or {n_predict} LM "
                             f"heads, got {len(emb)}, {len(proj)} and {len(head)}")

        def frozen(ts: Sequence[torch.Tensor]) -> nn.ParameterList:
            return nn.ParameterList([nn.Parameter(t.detach(), requires_grad=False) for t in ts])

        self.emb, self.proj, self.head = frozen(emb), frozen(proj), frozen(head)
        self.cell_ln, self.state_ln = frozen(cell_ln), frozen(state_ln)
        self.n_predict, self.scale_input = n_predict, scale_input
        self.vocab_size, self.inner_dim = head[0].shape
        self.hidden_size = proj[0].shape[1]
        state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_scale = math.sqrt((1 - state_weight**2) * self.inner_dim / 2) / state_weight

    def begin(self, states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The carry head 0 reads from the target's states [B, H] (any float dtype and device): ``(state [B, H] in
        the head's dtype and device, normalised when scale_input; cell [B, D] zeros)``."""
        x = states.to(device=self.head[0].device, dtype=self.head[0].dtype)
        cell = torch.zeros(x.shape[0], self.inner_dim, device=x.device, dtype=x.dtype)
        return ((rms_norm(x) / math.sqrt(2)) if self.scale_input else x, cell)

    def step(self, i: int, carry: tuple[torch.Tensor, ...], tokens: torch.Tensor
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Head ``i`` on a batch: ``carry`` (state, cell) from :meth:`begin` or the previous step, ``tokens`` [B] int64
        (the token before the draft). Returns (logits [B, V] in the head's dtype, (state [B, D], cell [B, D]))."""
        state, cell = carry
        d = self.inner_dim
        if len(self.emb) == 1:
            z = F.embedding(tokens, self.emb[0]).repeat(1, 4)
        else:
            z = torch.cat([F.embedding(tokens, e) for e in self.emb], -1)
        a = F.linear(state, self.proj[min(i, len(self.proj) - 1)]) + z * self.emb_scale
        forget, inp, out = torch.sigmoid(a[:, : 3 * d]).split(d, -1)
        cell = cell * forget + F.gelu(rms_norm(a[:, 3 * d :], self.cell_ln[0], self.cell_ln[1])) * inp
        state = F.gelu(rms_norm(cell, self.state_ln[0], self.state_ln[1])) * out
        return F.linear(state, self.head[min(i, len(self.head) - 1)]), (state, cell)

    def forward(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Every head with given input tokens: ``states`` [B, H], ``tokens`` [B, n <= n_predict] int64 (column i is
        head i's input token). Returns logits [B, n, V]."""
        carry, out = self.begin(states), []
        for i in range(tokens.shape[1]):
            logits, carry = self.step(i, carry, tokens[:, i])
            out.append(logits)
        return torch.stack(out, 1)


def config_dim(cfg: dict[str, Any], key: str, file: Path | str) -> int:
    """A width of the LSTM config: an integer, a string of one (``"4096"``, as ArcticTraining writes it), or a
    one-element list.

    Raises:
        SpeculatorLoadError: missing, not a positive integer, or several dotted widths (stacked layers).
    """
    value = cfg.get(key)
    parts = value if isinstance(value, list) else str(value).split(".") if isinstance(value, (int, str)) else None
    if value is None or isinstance(value, bool) or parts is None or not all(str(p).isdigit() for p in parts) \
            or not parts or int(parts[0]) < 1:
        raise SpeculatorLoadError(file, key, f"must be a positive width such as \"4096\", got {value!r}")
    if len(parts) > 1:
        raise SpeculatorLoadError(file, key, f"{value!r} stacks {len(parts)} layers; only single-layer stages "
                                             f"(one width) are served")
    return int(parts[0])


def check_base_model(cfg: dict[str, Any], file: Path | str, target: TargetInfo) -> None:
    """Arctic Inference's check (``ArcticProposer.load_model``): the target's first architecture must be one of
    ``base_model_archs`` (skipped when the config has none, or the target names none).

    Raises:
        SpeculatorLoadError: naming ``base_model_archs``.
    """
    archs = cfg.get("base_model_archs")
    if archs is None or not target.architectures:
        return
    archs = [archs] if isinstance(archs, str) else archs
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise SpeculatorLoadError(file, "base_model_archs", f"must be a list of architectures, got {archs!r}")
    if target.architectures[0] not in archs:
        raise SpeculatorLoadError(file, "base_model_archs", f"the head was trained for {archs}, not for the "
                                                            f"target's {target.architectures[0]}")


@dataclass(frozen=True)
class LSTMConfig:
    """An ``ArcticLSTMSpeculatorPreTrainedModel`` config as :func:`check_lstm_config` read it: ``cfg`` (as read),
    ``n_predict``, ``hidden`` (``input_hidden_dim``, the target's hidden size), ``vocab`` (``vocab_size``), ``inner``
    (``inner_dim``), ``method``, ``tie_weights``, ``scale_input``."""

    cfg: dict[str, Any]
    n_predict: int
    hidden: int
    vocab: int
    inner: int
    method: str
    tie_weights: bool
    scale_input: bool


def check_lstm_config(folder: Path, target: TargetInfo, cfg: dict[str, Any] | None = None) -> LSTMConfig:
    """An ``ArcticLSTMSpeculatorPreTrainedModel`` folder's ``config.json`` checked against the target without reading
    its weights (ArcticTraining ``ArcticLSTMSpeculatorConfig``, Arctic Inference ``ArcticLSTMSpeculator.__init__``):
    input_hidden_dim = its hidden size, vocab_size = its vocabulary; single-width stages, proj_dim and emb_dim equal
    to inner_dim, a known ``method``. What :func:`load_arctic` checks first for an LSTM speculator.

    Args:
        folder: the head's folder.
        target: the target it drafts for (its sizes).
        cfg: the folder's config when already read; None: read here.

    Raises:
        SpeculatorLoadError: naming ``config.json`` and the key that does not fit.
    """
    cfile = Path(folder) / "config.json"
    cfg = read_config(Path(folder)) if cfg is None else cfg
    n, hidden, vocab = chain_sizes(cfg, cfile, "input_hidden_dim", target)
    inner = config_dim(cfg, "inner_dim", cfile)
    for key in ("proj_dim", "emb_dim"):
        if config_dim(cfg, key, cfile) != inner:
            raise SpeculatorLoadError(cfile, key, f"{cfg[key]!r} differs from inner_dim {cfg['inner_dim']!r}: the "
                                                  f"sum of projection and embedding is normed at inner_dim")
    method = cfg.get("method") or "sum_rnn"
    if method not in METHODS:
        raise SpeculatorLoadError(cfile, "method", f"{method!r} is not one of {', '.join(METHODS)}")
    tie, scale = config_flag(cfg, "tie_weights", cfile), config_flag(cfg, "scale_input", cfile)
    return LSTMConfig(cfg, n, hidden, vocab, inner, method, tie, scale)


def lstm_head(c: LSTMConfig, folder: Path) -> MLPSpeculatorHead | ArcticLSTMHead:
    """The head of a checked LSTM config (:func:`check_lstm_config`) from the folder's weights: ``sum_rnn`` as an
    :class:`MLPSpeculatorHead`, ``sum_lstm`` as an :class:`ArcticLSTMHead` (Arctic Inference
    ``ArcticLSTMSpeculator.__init__`` and ``load_weights``).

    Raises:
        SpeculatorLoadError: a config value or weight that does not fit (naming the file and the key).
    """
    cfile = Path(folder) / "config.json"
    cfg, n, hidden, vocab, inner = c.cfg, c.n_predict, c.hidden, c.vocab, c.inner
    file = find_weights(folder)
    state = load_weights(file)
    if c.method == "sum_rnn":
        return MLPSpeculatorHead(**mlp_weights(state, file, n, hidden, inner, vocab, c.tie_weights, layer="0."),
                                 n_predict=n, scale_input=c.scale_input)
    if not c.tie_weights:
        raise SpeculatorLoadError(cfile, "tie_weights", "must be true with method sum_lstm (its stages are shared)")
    p = weight_prefix(state)
    embs = ("forget",) if config_flag(cfg, "tie_lstm_embs", cfile) else GATES
    emb = [take(state, f"{p}{g}_emb.0.weight", (vocab, inner), file, f"inner_dim {inner}, vocabulary {vocab}")
           for g in embs]
    proj = [torch.cat([take(state, f"{p}{g}_proj.{i}.weight", (inner, hidden if i == 0 else inner), file,
                            f"hidden size {hidden} of the target" if i == 0 else f"inner_dim {inner}") for g in GATES])
            for i in range(min(2, n))]
    norms = {ln: [take(state, f"{p}{ln}.0.{w}", (inner,), file, f"inner_dim {inner}") for w in ("weight", "bias")]
             for ln in ("cell_ln", "state_ln")}
    head = [take_stage(state, file, f"{p}head", 0, (vocab, inner), f"inner_dim {inner}, vocabulary {vocab}",
                       range(n))]
    return ArcticLSTMHead(emb, proj, norms["cell_ln"], norms["state_ln"], head, n, c.scale_input)


def check_arctic_config(folder: Path, target: TargetInfo) -> MLPConfig | LSTMConfig:
    """An Arctic speculator's ``config.json`` checked against the target without reading its weights: the target's
    architecture among ``base_model_archs`` (Arctic Inference ``ArcticProposer.load_model``), then the MLP
    speculator's config (:func:`~.mlp.check_mlp_config`: emb_dim, vocab_size) or the LSTM's
    (:func:`check_lstm_config`: input_hidden_dim, vocab_size). What :func:`load_arctic` checks first, and the launcher
    before it starts anything (:func:`~spec_decode.proposers.speculators.check_heads_fit`).

    Args:
        folder: the head's folder.
        target: the target it drafts for (its sizes and architecture).

    Returns:
        The MLP's (:class:`~.mlp.MLPConfig`) or the LSTM's (:class:`LSTMConfig`) config read.

    Raises:
        SpeculatorLoadError: naming ``config.json`` and the key that does not fit (``architectures`` for another
            layout).
    """
    folder = Path(folder)
    cfg = read_config(folder)
    cfile = folder / "config.json"
    archs = cfg.get("architectures") or []
    archs = [archs] if isinstance(archs, str) else archs
    check_base_model(cfg, cfile, target)
    if MLP_ARCH in archs:
        return check_mlp_config(folder, target, cfg)
    if any(a in LSTM_ARCHS for a in archs):
        return check_lstm_config(folder, target, cfg)
    raise SpeculatorLoadError(cfile, "architectures", f"{archs!r} is neither {MLP_ARCH} nor {' nor '.join(LSTM_ARCHS)}")


def load_arctic(folder: Path, target: TargetInfo) -> MLPSpeculatorHead | ArcticLSTMHead:
    """The Arctic speculator in ``folder`` (``config.json`` and one weights file), float32 on the CPU, checked against
    ``target`` (sizes, every weight, ``base_model_archs``).

    Raises:
        SpeculatorLoadError: naming the file and the key that does not fit (``architectures`` for another layout).
    """
    folder = Path(folder)
    c = check_arctic_config(folder, target)
    return mlp_head(c, folder) if isinstance(c, MLPConfig) else lstm_head(c, folder)


class ArcticProposer(HeadProposer):
    """Drafts with Arctic Inference's MLP or LSTM speculator (``speculative_method=arctic``) from the target's last
    hidden state: up to min(k, n_predict) drafts per step (k is capped, never refused), stopping early while unsure
    (``speculator_min_token_prob``). Stateless between steps, as Arctic Inference's ``ArcticProposer``."""

    name = "arctic"

    @classmethod
    def load(cls, folder: Path, target: TargetInfo) -> MLPSpeculatorHead | ArcticLSTMHead:
        """:func:`load_arctic`.

        Raises:
            SpeculatorLoadError: naming the file and the key that does not fit.
        """
        return load_arctic(folder, target)

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """:func:`~.mlp.propose_chain` with Arctic's noise (``NoisePurpose.ARCTIC``); a request that takes trees gets a
        candidate tree (:func:`.candidate_tree.propose_heads`)."""
        return propose_heads(self, requests, NoisePurpose.ARCTIC, propose_chain)
