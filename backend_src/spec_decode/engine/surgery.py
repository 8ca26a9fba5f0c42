"""Model surgery: a draft LM cut from the target (its first layers, a pruned vocabulary).

What ``make draft`` starts from (:mod:`spec_decode.training.draft`) and what the benchmarks and the GPU check build
their drafts with: a layer-truncated copy of the target ("layer skip" / self-speculative drafting, Elhoushi et al. 2024;
Zhang et al. 2023) whose embedding and tied LM head keep only a :class:`~.draft_vocab.DraftVocab`'s tokens.
"""

from __future__ import annotations

import torch


def truncated_copy(target, layers: int):
    """A copy of ``target`` (a Llama-style causal LM) keeping its first ``layers`` decoder layers.

    Args:
        target: transformers causal LM with ``model.layers`` (e.g. LlamaForCausalLM).
        layers: decoder layers to keep, 1..num_hidden_layers.

    Returns:
        A new model of the same class, float32, sharing no tensors with ``target``.

    Raises:
        ValueError: ``layers`` out of range.
        RuntimeError: the kept layers' weights do not load into the copy (a model not laid out as ``model.layers``).
    """
    cfg = target.config.__class__.from_dict(target.config.to_dict())
    n = cfg.num_hidden_layers
    if not 1 <= layers <= n:
        raise ValueError(f"layers must be in [1, {n}], got {layers}")
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    draft = target.__class__(cfg)
    state = {k: v for k, v in target.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m and m != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"truncated copy mismatch: missing {missing}, unexpected {unexpected}")
    return draft.float()


def prune_vocabulary(draft, vocab):
    """Shrink a (tied-embedding) draft's vocabulary to ``vocab``'s kept tokens plus one "outside" row.

    The kept rows are the target's; the outside row is their mean. The head stays tied to the embeddings.

    Args:
        draft: causal LM from :func:`truncated_copy`.
        vocab: :class:`~.draft_vocab.DraftVocab` over the target's vocabulary.

    Returns:
        The same model, modified in place: ``config.vocab_size = len(vocab) + 1``.
    """
    old = draft.get_input_embeddings().weight.data
    rows = old[vocab.token_ids]
    new = torch.nn.Embedding(len(vocab) + 1, old.shape[1])
    new.weight.data.copy_(torch.cat([rows, rows.mean(0, keepdim=True)]))
    draft.set_input_embeddings(new)
    head = torch.nn.Linear(old.shape[1], len(vocab) + 1, bias=False)
    head.weight = new.weight
    draft.set_output_embeddings(head)
    draft.config.vocab_size = len(vocab) + 1
    draft.config.tie_word_embeddings = True
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # ids of the target's vocabulary: map or drop
        tid = getattr(draft.config, name, None)
        if isinstance(tid, int):
            mapped = int(vocab.to_draft[tid])
            setattr(draft.config, name, mapped if mapped != vocab.unk_index else None)
    return draft
