"""A hidden-state speculator: the MLP speculator (Wertheimer et al. 2024, arXiv 2404.19124; vLLM ``MLPSpeculator``).

It drafts from the target's own last hidden state instead of running a second model over the text. Stage i (of
``n_predict``) mixes its running state with the embedding of the token before it and predicts the next token:

    s_0 = h (the target's last hidden state before the last committed token x)
    s_{i+1} = GELU(LN_i(a W_i s_i + b U_i E[t_i])),  t_0 = x,  t_{i+1} = the token stage i drafts
    logits_i = head(LN'_i(O_i s_{i+1}))

with a = 0.5^(0.5 / n_predict), b = sqrt(1 - a^2) (so the state's scale holds from stage to stage), E the target's
input embedding and head the target's frozen LM head, both over a pruned vocabulary (:class:`~spec_decode.draft_vocab.
DraftVocab`: the kept tokens, plus one row for every other input token); its probabilities are scattered back to the
target's vocabulary, zero elsewhere, so rejection sampling stays exact (as the draft LM's). Only W, U, O and the norms
learn (``make speculator``: :mod:`spec_decode.train_speculator`). A round's sequences go through each stage together.

The folder holds ``config.json`` (hidden size, stages, vocabulary), ``speculator.safetensors``, ``draft_vocab.json``
and ``train_speculator.json`` (the training report).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..draft_vocab import DraftVocab, load_draft_vocab
from ..model_loading import cache_dir, resolve_device, resolve_dtype
from ..sampling import generator_for, logits_to_probs, sample_from
from ..settings import InvalidInputError, LMSettings, in_range
from .base import Proposal, ProposalRequest, Proposer

_PURPOSE = 5  # noise purpose of the speculator's sampled drafts
CONFIG_FILE, WEIGHTS_FILE, REPORT_FILE = "config.json", "speculator.safetensors", "train_speculator.json"


def default_speculator_dir() -> Path:
    """Folder of the speculator ``make speculator`` trains for the embedded target (may not exist yet)."""
    from ..model_loading import DEFAULT_MODEL_NAME

    return cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-mlp-speculator"


def resolve_speculator_path(value: str) -> Path | None:
    """``auto`` -> the default speculator when ``make speculator`` has built it (else None); ``""``/``none`` -> None;
    else the folder.

    Raises:
        FileNotFoundError: a given folder that does not exist.
    """
    v = (value or "").strip()
    if v.lower() == "auto":
        d = default_speculator_dir()
        return d if (d / REPORT_FILE).exists() else None
    if v.lower() in ("", "none"):
        return None
    path = Path(v).expanduser()
    if not (path / CONFIG_FILE).exists():
        raise FileNotFoundError(f"speculator folder {str(path)!r} has no {CONFIG_FILE}")
    return path


class MLPSpeculator(nn.Module):
    """The speculator's stages over a frozen pruned embedding and LM head.

    Args:
        embedding: [N + 1, H] input embedding rows of the kept tokens, then the "outside the set" row (frozen).
        head: [N, H] LM head rows of the kept tokens (frozen).
        n_predict: stages (the most tokens one step drafts), >= 1.

    Raises:
        ValueError: shapes that disagree, or ``n_predict`` < 1.
    """

    def __init__(self, embedding: torch.Tensor, head: torch.Tensor, n_predict: int):
        super().__init__()
        if n_predict < 1 or embedding.shape[1] != head.shape[1] or embedding.shape[0] != head.shape[0] + 1:
            raise ValueError(f"embedding [N+1, H] {tuple(embedding.shape)} and head [N, H] {tuple(head.shape)} "
                             f"disagree, or n_predict={n_predict} < 1")
        h = embedding.shape[1]
        self.n_predict = n_predict
        self.register_buffer("embedding", embedding.detach().float().clone())
        self.register_buffer("head", head.detach().float().clone())
        self.state_proj = nn.ModuleList(nn.Linear(h, h, bias=False) for _ in range(n_predict))
        self.emb_proj = nn.ModuleList(nn.Linear(h, h, bias=False) for _ in range(n_predict))
        self.norm = nn.ModuleList(nn.LayerNorm(h) for _ in range(n_predict))
        self.out_proj = nn.ModuleList(nn.Linear(h, h, bias=False) for _ in range(n_predict))
        self.out_norm = nn.ModuleList(nn.LayerNorm(h) for _ in range(n_predict))
        self.state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_weight = math.sqrt(1 - self.state_weight**2)
        for lin in (*self.state_proj, *self.emb_proj):
            nn.init.normal_(lin.weight, std=1.0 / math.sqrt(h))
        for lin in self.out_proj:  # start at the identity: the first state already speaks the head's language
            nn.init.eye_(lin.weight)

    def stage(self, i: int, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One stage: ([B, H] state, [B] draft-vocabulary token indices) -> (next state [B, H], logits [B, N])."""
        mixed = self.state_weight * self.state_proj[i](state) + self.emb_weight * self.emb_proj[i](
            self.embedding[tokens])
        state = nn.functional.gelu(self.norm[i](mixed))
        return state, self.out_norm[i](self.out_proj[i](state)) @ self.head.T

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits of every stage (training).

        Args:
            hidden: [B, H] the target's hidden states before ``tokens[:, 0]``.
            tokens: [B, n_predict] draft-vocabulary indices: the token before each stage's prediction.

        Returns:
            [B, n_predict, N] logits over the kept tokens.
        """
        out, state = [], hidden.float()
        for i in range(self.n_predict):
            state, logits = self.stage(i, state, tokens[:, i])
            out.append(logits)
        return torch.stack(out, 1)

    def save(self, folder: Path, vocab: DraftVocab, extra: dict | None = None) -> None:
        """Write ``config.json``, ``speculator.safetensors`` and ``draft_vocab.json`` into ``folder``."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(folder / WEIGHTS_FILE))
        vocab.save(folder)
        (folder / CONFIG_FILE).write_text(json.dumps({"architecture": "mlp_speculator", "n_predict": self.n_predict,
                                                      "hidden_size": self.embedding.shape[1],
                                                      "draft_vocab": len(vocab), **(extra or {})}, indent=2))

    @classmethod
    def load(cls, folder: Path) -> tuple[MLPSpeculator, DraftVocab]:
        """The speculator and its vocabulary from a folder :meth:`save` wrote."""
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg = json.loads((folder / CONFIG_FILE).read_text())
        state = load_file(str(folder / WEIGHTS_FILE))
        model = cls(state["embedding"], state["head"], int(cfg["n_predict"]))
        model.load_state_dict(state)
        return model.eval(), load_draft_vocab(folder)


@dataclass(frozen=True)
class MLPSpeculatorSettings(LMSettings):
    """The speculator's config parameters: ``mlp_speculator_path`` and, as for the draft LM, ``device``, ``dtype``.

    Attributes:
        mlp_speculator_path: ``auto`` (the speculator ``make speculator`` trains, when it exists; else none), ``""``
            or ``none`` (not served), or a folder with ``config.json`` and ``speculator.safetensors``.
        mlp_speculator_min_token_prob: a step drafts its next slot while the product of its drafts' probabilities so
            far and the stage's top probability is >= this, in [0, 1]; 0 drafts every slot. Each draft slot costs a
            scored position whether accepted or not, so an unsure speculator should stop early (as suffix decoding's
            ``suffix_min_token_prob``; EAGLE-2 prunes its draft trees by the same confidence).
    """

    mlp_speculator_path: str = "auto"
    mlp_speculator_min_token_prob: float = 0.3

    def check(self) -> None:
        super().check()
        in_range("mlp_speculator_min_token_prob", self.mlp_speculator_min_token_prob, 0.0, 1.0)


class MLPSpeculatorProposer(Proposer):
    """Drafts with an :class:`MLPSpeculator` from the target's hidden state (``speculative_method=mlp_speculator``).

    A request without hidden states (its first step) gets no drafts. k is at most the speculator's ``n_predict``, and
    a step stops drafting at the first slot where (the product of its drafts' probabilities so far) x (the stage's
    top probability) falls below ``min_token_prob``: the rule reads the distributions, never the sampled token, so
    rejection sampling stays exact. A proposal's score is the sum of its drafts' running probabilities: the
    speculator's own estimate of the accepted count (what hybrid compares with the suffix score).

    Args:
        model: the speculator (on its device and dtype).
        vocab: its pruned vocabulary over the target's.
        min_token_prob: the confidence under which a step stops drafting, in [0, 1].
    """

    name = "mlp_speculator"
    Settings = MLPSpeculatorSettings
    needs_hidden_states = True

    def __init__(self, model: MLPSpeculator, vocab: DraftVocab, min_token_prob: float = 0.0):
        self.model, self.vocab, self.min_token_prob = model, vocab, min_token_prob

    @classmethod
    def configured(cls, settings: MLPSpeculatorSettings) -> bool:
        """Whether ``mlp_speculator_path`` names a speculator (``auto``: when ``make speculator`` has built it)."""
        try:
            return resolve_speculator_path(settings.mlp_speculator_path) is not None
        except FileNotFoundError:
            return False

    @classmethod
    def from_config(cls, settings: MLPSpeculatorSettings, served) -> MLPSpeculatorProposer | None:
        """The speculator of ``mlp_speculator_path`` on the configured device, or None when there is none.

        Raises:
            FileNotFoundError: a folder without a speculator.
        """
        path = resolve_speculator_path(settings.mlp_speculator_path)
        if path is None:
            return None
        device = resolve_device(settings.device)
        model, vocab = MLPSpeculator.load(path)
        return cls(model.to(device=device, dtype=resolve_dtype(settings.dtype, device)), vocab,
                   settings.mlp_speculator_min_token_prob)

    def check(self, request: ProposalRequest) -> None:
        """A request's hidden states must be [m, H] with H the speculator's (the target's hidden size), and the last of
        them (the one it drafts from) finite. (Finite states that overflow its stages end the row's drafts instead.)

        Raises:
            InvalidInputError: naming ``context_hidden_states``.
        """
        h = request.hidden_states
        if h is None or not len(h):
            return
        size = self.model.embedding.shape[1]
        if h.ndim != 2 or h.shape[1] != size:
            raise InvalidInputError("context_hidden_states", f"must be [m, {size}] (the target's hidden size), got "
                                    f"{list(h.shape)}")
        if not torch.isfinite(h[-1]).all():
            raise InvalidInputError("context_hidden_states", "must be finite")

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """Per request, up to min(k, n_predict) drafts, each stage run once for the requests still drafting;
        draft_probs [k', V] float32 (the request's sampling transforms over the kept tokens, scattered back); score
        the sum of the drafts' running probabilities."""
        m, vocab = self.model, self.vocab
        live = [j for j, r in enumerate(requests) if r.hidden_states is not None and len(r.hidden_states)]
        drafts: list[list[int]] = [[] for _ in requests]
        rows: list[list[torch.Tensor]] = [[] for _ in requests]
        running = [1.0] * len(requests)  # the product of the row's drafts' probabilities so far
        stopped = [False] * len(requests)
        score = [0.0] * len(requests)
        if live:
            dev, dtype = m.head.device, m.head.dtype
            state = torch.stack([requests[j].hidden_states[-1] for j in live]).to(device=dev, dtype=dtype)
            tokens = torch.tensor([vocab.map_ids([requests[j].token_ids[-1]])[0] for j in live], device=dev)
            for i in range(m.n_predict):
                # rows that have their k drafts, or whose next slot fell below the threshold, stop
                keep = [row for row, j in enumerate(live) if i < requests[j].k and not stopped[j]]
                if not keep:
                    break
                if len(keep) < len(live):
                    at = torch.tensor(keep, dtype=torch.long, device=dev)
                    state, tokens, live = state[at], tokens[at], [live[row] for row in keep]
                state, logits = m.stage(i, state, tokens)
                nxt = []
                for row, j in enumerate(live):
                    r = requests[j]
                    probs = logits_to_probs(logits[row], r.params)
                    if r.params.is_greedy:
                        tok = int(torch.argmax(probs))
                    else:
                        tok = sample_from(probs, generator_for(r.params.seed, r.step, _PURPOSE, i))
                    nxt.append(tok)
                    # The decision to draft this slot reads the stage's distribution (its top probability), never
                    # the token sampled from it: a rule that kept a sampled draft only when its own probability was
                    # high would draft from q cut to its likely tokens while reporting q, and rejection sampling
                    # would lose the target's law. For greedy rows the top probability is the draft's own.
                    if not bool(torch.isfinite(probs).all()):  # e.g. finite but huge hidden states: no drafts
                        stopped[j] = True
                        continue
                    if running[j] * float(probs.max()) < self.min_token_prob:
                        stopped[j] = True
                        continue
                    running[j] *= float(probs[tok])
                    drafts[j].append(int(vocab.token_ids[tok]))
                    rows[j].append(vocab.scatter(probs))
                    score[j] += running[j]
                tokens = torch.tensor(nxt, device=dev)
        return [Proposal(torch.tensor(d, dtype=torch.int64), torch.stack(r), sc) if d else Proposal.empty()
                for d, r, sc in zip(drafts, rows, score)]
