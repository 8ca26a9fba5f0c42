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


def tiny_eagle_config() -> dict:
    """The sizes of an EAGLE head over the tiny test Llama (conftest ``tiny_lm``: hidden 32, 4 heads, 2 of them
    key/value heads)."""
    return {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
            "rope_theta": 10000.0, "rms_norm_eps": 1e-6}


def save_tiny_eagle(tiny_lm, folder, kept=tuple(range(0, 97, 2)), seed: int = 0):
    """An untrained EAGLE head over ``tiny_lm``'s embedding and head (the ``kept`` tokens), saved as
    ``make speculator`` saves one; returns the folder."""
    import torch

    from spec_decode.draft_vocab import DraftVocab
    from spec_decode.proposers import EagleHead

    torch.manual_seed(seed)
    vocab = DraftVocab(list(kept), tiny_lm.config.vocab_size)
    emb = tiny_lm.get_input_embeddings().weight.detach()[vocab.token_ids]
    head = tiny_lm.get_output_embeddings().weight.detach()[vocab.token_ids]
    EagleHead(torch.cat([emb, emb.mean(0, keepdim=True)]), head, tiny_eagle_config()).save(folder, vocab)
    (folder / "train_speculator.json").write_text("{}")
    return folder
