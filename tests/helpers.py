"""Helpers shared by the unit tests."""

import numpy as np


def step_row(seq, ids, drafts=(), **kw) -> dict:
    """One sequence's row of a step model's request (greedy; overrides as keyword arguments)."""
    base = {"sequence_id": np.array([seq], np.uint64), "token_ids": np.array(ids, np.int64),
            "draft_token_ids": np.array(drafts, np.int64), "temperature": np.array([0.0], np.float32),
            "top_k": np.array([0], np.int32), "top_p": np.array([1.0], np.float32), "release": np.array([False]),
            "random_seed": np.array([0], np.int64), "step": np.array([0], np.int64)}
    base.update({k: np.array([v]) if not isinstance(v, np.ndarray) else v for k, v in kw.items()})
    return base


def save_tiny_speculator(tiny_lm, folder, kept=tuple(range(0, 97, 2)), n_predict: int = 3, seed: int = 0):
    """An untrained MLP speculator over ``tiny_lm``'s embedding and head (the ``kept`` tokens), saved as
    ``make speculator`` saves one; returns the folder."""
    import torch

    from spec_decode.draft_vocab import DraftVocab
    from spec_decode.proposers import MLPSpeculator

    torch.manual_seed(seed)
    vocab = DraftVocab(list(kept), tiny_lm.config.vocab_size)
    emb = tiny_lm.get_input_embeddings().weight.detach()[vocab.token_ids]
    head = tiny_lm.get_output_embeddings().weight.detach()[vocab.token_ids]
    MLPSpeculator(torch.cat([emb, emb.mean(0, keepdim=True)]), head, n_predict).save(folder, vocab)
    (folder / "train_speculator.json").write_text("{}")
    return folder
