"""A draft model's pruned vocabulary (``draft_vocab.json`` in its folder, written by ``make draft``).

A draft LM that keeps only the target tokens it has seen in training has a smaller embedding and LM head; its
probabilities are scattered back to the target's vocabulary (zero elsewhere), so rejection sampling stays exact
(:mod:`spec_decode.proposers.draft_lm`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..settings import InvalidInputError

DRAFT_VOCAB_FILE = "draft_vocab.json"


class DraftVocab:
    """A draft model's pruned vocabulary: draft token index i is target token ``token_ids[i]``.

    The draft's embedding and LM head have ``len(token_ids) + 1`` rows; the last row (``unk_index``) stands for every
    target token outside the set (inputs only: it is never proposed). Rejection sampling stays exact because the
    draft's distribution, scattered back to the target vocabulary, is simply zero outside the set.

    Args:
        token_ids: [N] int64 target token ids, distinct, each in [0, target_vocab_size).
        target_vocab_size: V of the target.

    Raises:
        ValueError: no ids, ids out of range or repeated.
    """

    def __init__(self, token_ids, target_vocab_size: int):
        keep = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        if keep.numel() == 0 or keep.min() < 0 or keep.max() >= target_vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in [0, {target_vocab_size})")
        if torch.unique(keep).numel() != keep.numel():
            raise ValueError("draft vocabulary ids must be distinct")
        self.token_ids = keep
        self.target_vocab_size = int(target_vocab_size)
        self.unk_index = keep.numel()
        self.to_draft = torch.full((target_vocab_size,), self.unk_index, dtype=torch.int64)
        self.to_draft[keep] = torch.arange(keep.numel())
        self._to_draft_list = self.to_draft.tolist()
        self._kept_on_device = keep  # token_ids on the device scatter last saw (copied once, not per token)

    def scatter(self, probs: torch.Tensor) -> torch.Tensor:
        """[N] probabilities over the kept tokens -> [V] float32 over the target's vocabulary (zero elsewhere), on
        ``probs``' device: a pruned draft's q as the verifier reads it."""
        if self._kept_on_device.device != probs.device:
            self._kept_on_device = self.token_ids.to(probs.device)
        full = torch.zeros(self.target_vocab_size, dtype=torch.float32, device=probs.device)
        full[self._kept_on_device] = probs.float()
        return full

    def __len__(self) -> int:
        """Kept target tokens N (the draft model's vocabulary is N + 1)."""
        return self.unk_index

    def map_ids(self, ids: list[int]) -> list[int]:
        """Target ids -> draft indices (``unk_index`` for ids outside the set).

        Raises:
            InvalidInputError: an id outside the target's vocabulary [0, target_vocab_size) (a ValueError).
        """
        if ids and (min(ids) < 0 or max(ids) >= self.target_vocab_size):
            raise InvalidInputError("token_ids", f"token ids must lie in [0, {self.target_vocab_size}), got "
                                                 f"{min(ids)}..{max(ids)}")
        table = self._to_draft_list
        return [table[i] for i in ids]

    def save(self, folder: Path) -> None:
        """Write ``draft_vocab.json`` into a model folder."""
        (Path(folder) / DRAFT_VOCAB_FILE).write_text(json.dumps(
            {"token_ids": self.token_ids.tolist(), "target_vocab_size": self.target_vocab_size}))


def load_draft_vocab(path: Path | None) -> DraftVocab | None:
    """The pruned vocabulary of a draft folder (``draft_vocab.json``), or None for a full-vocabulary draft.

    Raises:
        ValueError: a file that is not JSON, or ids :class:`DraftVocab` refuses. KeyError: a field missing.
    """
    if path is None or not (Path(path) / DRAFT_VOCAB_FILE).exists():
        return None
    data = json.loads((Path(path) / DRAFT_VOCAB_FILE).read_text())
    return DraftVocab(data["token_ids"], data["target_vocab_size"])
